"""Recordings of real short CPU runs, and a headless Chromium to open their pages (tests/test_timeline_*.py).

``record_gpt2`` trains a GPT-2 built from a config (tests/conftest.py) under ``NumericsMonitor(record=...)``, with
what a test needs changed on the way: a weight scaled at one step, bf16 autocast, a weight blown past fp32's range.
``browse`` opens a page in headless Chromium with every name unresolvable and a proxy that does not exist (the page
must need no network), and returns what the page's script says it drew (``<pre id="td-state">``); it skips the test
where no Chromium is installed. Chromium is bounded by a timeout and ends with every process it started (they carry
a marker in their environment), whatever process group they moved to.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from bounded import MARKER, marked_pids
from conftest import gpt2_batch, tiny_gpt2
from torchdoctor import NonFiniteError, NumericsMonitor

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
NONFINITE_RGB = [255, 0, 255]  # the page's colour for inf / nan (page_js.NONFINITE)


def record_gpt2(out: Path, steps: int = 7, *, scale_at: tuple[int, float] | None = None, bf16: bool = False,
                seed: int = 0) -> NonFiniteError | None:
    """Train a tiny GPT-2 for ``steps`` steps, recording every step into ``out``; ``scale_at=(step, factor)``
    multiplies block 1's MLP input projection (``c_fc``) by ``factor`` before that step's forward. Returns the
    NonFiniteError that stopped the run, if one did."""
    model = tiny_gpt2(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(seed)  # (dropout masks: the same in twin runs)
    try:
        with NumericsMonitor(model, opt, record=out):
            for step in range(steps):
                if scale_at is not None and step == scale_at[0]:
                    with torch.no_grad():
                        model.transformer.h[1].mlp.c_fc.weight.mul_(scale_at[1])
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(**gpt2_batch(step)).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
    except NonFiniteError as e:
        return e
    return None


def chromium() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def browse(page: Path, tmp_path: Path, fragment: str = "") -> dict:
    """Open ``page`` in headless Chromium (no network) and return the page's drawing state."""
    exe = chromium()
    if exe is None:
        pytest.skip("Chromium is not installed, so the page is not opened in a browser (Debian: apt-get install "
                    "chromium; `make test` installs it when it runs as root with apt-get)")
    marker = uuid.uuid4().hex
    profile = tmp_path / f"chromium-{marker[:8]}"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--no-default-browser-check", "--disable-extensions", f"--user-data-dir={profile}",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--window-size=1400,900",
           "--js-flags=--max-old-space-size=512", "--dump-dom", page.resolve().as_uri() + fragment]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, MARKER: marker})
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked_pids(marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    dom = out.decode("utf-8", "replace")
    found = re.search(r'<pre id="td-state"[^>]*>(.*?)</pre>', dom, re.S)
    assert found and found.group(1).strip(), f"the page drew nothing: {err.decode('utf-8', 'replace')[-3000:]}"
    return json.loads(html.unescape(found.group(1)))


HOVER = """<script>
(function () {
  const state = JSON.parse(document.getElementById("td-state").textContent);
  const canvas = document.querySelectorAll("canvas.heat")[%(panel)d], shown = state.panels[%(panel)d].display;
  const box = canvas.getBoundingClientRect();
  canvas.dispatchEvent(new MouseEvent("mousemove", {clientX: box.left + (%(col)d + 0.5) * box.width / shown[0],
                                                    clientY: box.top + (%(row)d + 0.5) * box.height / shown[1]}));
  state.tip = document.getElementById("td-tip").textContent;
  document.getElementById("td-state").textContent = JSON.stringify(state);
})();
</script>"""


def hover(page: Path, tmp_path: Path, panel: int, row: int, col: int) -> str:
    """The text the page shows when the mouse is over cell (row, col) of a panel: a copy of the page with a script
    that moves the mouse there once everything is drawn."""
    probe = tmp_path / f"hover-{page.name}"
    probe.write_text(page.read_text().replace("</body>", HOVER % {"panel": panel, "row": row, "col": col}
                                              + "</body>"))
    return browse(probe, tmp_path)["tip"]


def external_references(text: str) -> list[str]:
    """What in a page would make a browser fetch something: src/href attributes, CSS url() / @import, fetch()."""
    return re.findall(r"""\b(?:src|href)\s*=\s*["'][^"']+|url\(|@import|\bfetch\(|XMLHttpRequest""", text)

"""Progress of a slow ``torchdoctor env`` probe on stderr: the real CLI in a subprocess, with a fabricated toolkit
whose nvcc takes 3 s to answer, on a pipe and on a pseudo-terminal; and nothing at all for a fast probe."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import stat
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from torchdoctor.env.progress import Progress, waiting_for

SRC = str(Path(__file__).parent.parent / "src")
LINE = re.compile(r"torchdoctor env: probing .+ \(\d+ s\)")


def slow_toolkit(root: Path, sleep: float = 3.0) -> Path:
    """A CUDA 13.0 toolkit tree whose nvcc answers --version and --dryrun like the real one, after ``sleep`` s."""
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"""#!/bin/sh
sleep {sleep}
case "$*" in
  *--dryrun*) echo "#\\$ TOP={root}/bin/.." >&2 ;;
  *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88" ;;
esac
""")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so.13").write_text("")
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    return root


def env_cli(tmp_path: Path, *python_flags: str, toolkit: Path | None = None, stderr=subprocess.PIPE):
    """``python [flags] -m torchdoctor env --json``; HOME is a temp dir (no conda toolkits of this machine's user).
    ``-S`` (no site-packages: torch and the packages are not installed) leaves only the tools as slow probes."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(PYTHONPATH=SRC, HOME=str(tmp_path), PATH="/usr/bin:/bin", TERM="xterm")
    if toolkit is not None:
        env.update(PATH=f"{toolkit}/bin:/usr/bin:/bin", CUDA_HOME=str(toolkit))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *python_flags, "-m", "torchdoctor", "env", "--json"], env=env,
                          stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=60)
    return proc, time.monotonic() - t0


def test_a_slow_nvcc_is_named_on_stderr_and_the_json_stays_clean(tmp_path):
    tk = slow_toolkit(tmp_path / "cuda-13.0")
    proc, took = env_cli(tmp_path, "-S", toolkit=tk)
    facts = json.loads(proc.stdout)["facts"]  # stdout is the JSON document and nothing else
    assert any(t["root"] == str(tk) and t["version"] == "13.0" for t in facts["toolkits"]), facts["toolkits"]
    assert facts["probe_seconds"] >= 3 and took < 10
    lines = proc.stderr.splitlines()
    assert lines and all(LINE.fullmatch(line) for line in lines), proc.stderr
    assert "\r" not in proc.stderr  # not a terminal: plain lines
    # first at 2 s, then at most every 5 s: one line for a 3 s probe, naming what it waits for
    assert len(lines) == 1, lines
    assert f"{tk}/bin/nvcc --version" in lines[0] and f"{tk}/bin/nvcc --dryrun -c x.cu" in lines[0]
    assert lines[0].endswith("(2 s)")


def test_on_a_terminal_the_line_is_rewritten_then_wiped(tmp_path):
    """stderr on a pseudo-terminal 100 columns wide, with the full environment (torch and the packages import):
    one line, rewritten with \\r, never wider than the terminal, erased before the process exits."""
    tk = slow_toolkit(tmp_path / "cuda-13.0", sleep=3.5)  # rewrites at 2 and 3 s at least
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc, _ = env_cli(tmp_path, toolkit=tk, stderr=slave)
    finally:
        os.close(slave)
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the slave side is closed and everything has been read
            break
        if not chunk:
            break
        data += chunk
    os.close(master)
    json.loads(proc.stdout)
    text = data.decode()
    assert "\n" not in text, text
    shown = [s.rstrip() for s in text.split("\r") if s.strip()]
    assert len(shown) >= 2 and all(s.startswith("torchdoctor env: probing ") for s in shown), text
    # each rewrite is whole ("... (2 s)") or cut to the terminal's 99 usable columns (four tools run at 2 s here)
    assert all(LINE.fullmatch(s) or (len(s) == 99 and s.endswith("...")) for s in shown), shown
    assert re.search(r"\r +\r$", text), repr(text[-40:])  # the last thing written wipes the line


def test_a_fast_probe_prints_nothing(tmp_path):
    proc, _ = env_cli(tmp_path, "-S")
    facts = json.loads(proc.stdout)["facts"]
    assert facts["probe_seconds"] < 2
    assert proc.stderr == ""


def test_plain_lines_come_every_every_s_and_none_before_first_s():
    out = io.StringIO()
    with Progress("x", lambda: "probing a", out, first_s=0.2, every_s=0.3):
        time.sleep(0.1)
    assert out.getvalue() == ""
    with Progress("x", lambda: "probing a", out, first_s=0.1, every_s=0.25) as p:
        time.sleep(0.5)  # lines at 0.1 and 0.35 s; the next would come at 0.6 s
    assert out.getvalue() == "x: probing a (0 s)\n" * 2 and p.lines == 2, out.getvalue()


def test_a_broken_describe_or_stream_never_breaks_the_wait():
    def boom() -> str:
        raise RuntimeError("no")

    out = io.StringIO()
    with Progress("x", boom, out, first_s=0.05, every_s=10):
        time.sleep(0.2)
    assert out.getvalue() == "x: working (0 s)\n"
    closed = io.StringIO()
    closed.close()
    with Progress("x", lambda: "probing a", closed, first_s=0.05, every_s=10) as p:
        time.sleep(0.2)
    assert p.lines == 1


def test_the_longest_running_tools_are_named_first_and_the_rest_counted():
    assert waiting_for([]) == "probing"
    assert waiting_for(["a --version"]) == "probing a --version"
    assert waiting_for(list("abcdef")) == "probing a; b; c; d; +2 more"

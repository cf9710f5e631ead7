"""``torchdoctor run --json - ...`` as a test runs it: a real process, bounded (tests/bounded.py), its report read."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bounded import run_bounded

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[1] / "src")


def torchdoctor_run(tmp_path: Path, *args: str, timeout: float = 120, mem_bytes: int = 4 << 30,
                    **env_vars: str) -> tuple[int, dict | None, str, str]:
    """(exit code, the --json report or None, stdout before it, stderr) of ``torchdoctor run ARGS``."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHDOCTOR_REPORT_DIR"}  # (a run around this one)
    env.update(PYTHONPATH=SRC, NO_COLOR="1", **env_vars)
    r = run_bounded([PY, "-m", "torchdoctor", "run", "--json", "-", *args], timeout=timeout, env=env,
                    cwd=str(tmp_path), mem_bytes=mem_bytes)
    assert not r.timed_out
    out = r.proc.stdout.decode("utf-8", "replace")
    err = r.proc.stderr.decode("utf-8", "replace")
    i = out.find("\n{\n") + 1 if "\n{\n" in out else (0 if out.startswith("{\n") else -1)
    rep = json.loads(out[i:]) if i >= 0 else None
    return r.proc.returncode, rep, out[:max(i, 0)], err


def ids(rep: dict) -> list[str]:
    return [f["id"] for f in rep["findings"]]


def the(rep: dict, fid: str) -> dict:
    [f] = [f for f in rep["findings"] if f["id"] == fid]
    return f

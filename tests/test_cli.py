"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).parent.parent / "src")


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "torchdoctor", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_lists_demo_and_no_command_is_usage_error():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "demo" in proc.stdout
    assert run_cli().returncode == 2


def test_demo_finds_the_overflow_and_the_fix_works(tmp_path):
    proc = run_cli("demo", "--json", "--report-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first = result["first_run"]["error"]["first"]
    assert first["phase"] == "fwd" and first["value"] == "inf"
    assert first["module"].startswith("encoder.block.2.layer.1")
    assert "within" in result["first_run"]["error"]["diagnosis"]
    assert result["fixed_run"]["region"] == "encoder.block.2.layer.1"
    assert result["fixed_run"]["finite"] is True
    assert (tmp_path / "torchdoctor-nonfinite-rank0.txt").exists()


def test_demo_rejects_bad_steps():
    proc = run_cli("demo", "--steps", "0")
    assert proc.returncode == 2 and "--steps must be at least 1" in proc.stdout

"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "0"], "--steps: must be at least 1, got 0"),
        (["--steps", "-1"], "--steps: must be at least 1, got -1"),
        (["--steps", "abc"], "--steps: must be a whole number of steps (1 or more), got 'abc'"),
        (["--steps", "1.5"], "--steps: must be a whole number of steps (1 or more), got '1.5'"),
        (["--level", "x"], "unrecognized arguments: --level x"),
    ],
)
def test_demo_bad_options_are_usage_errors_without_a_traceback(args, says):
    proc = run_cli("demo", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and says in errors[0]  # one message line (after argparse's usage line)


def test_demo_with_one_step_reports_and_fixes_without_a_traceback(tmp_path):
    """Its only step is checked as the monitor's with block exits: caught there, not a raw traceback."""
    proc = run_cli("demo", "--steps", "1", "--report-dir", str(tmp_path), timeout=300)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "try around the with block" in proc.stdout and "all finite: the fix works" in proc.stdout

"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).parent.parent / "src")


def run_cli(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
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
    # torchdoctor precision, run before training, predicted that module
    assert first["module"] in [site["module"] for site in result["predicted_overflow"]]
    assert {f["id"]: f["severity"] for f in result["findings"]}["demo.prediction"] == "ok"
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
        (["--steps", "1001"], "--steps: at most 1000 (the demo shows the same at 6), got 1001"),
        (["--steps", "9" * 40], "--steps: at most 1000"),
        (["--seed", "99999999999999999999"], "--seed: must be from 0 to 2**64-2 (18446744073709551614), got "
                                             "99999999999999999999"),
        (["--seed", str(2**64 - 1)], "--seed: must be from 0 to 2**64-2"),
        (["--seed", "-1"], "--seed: must be from 0 to 2**64-2"),
        (["--seed", "x"], "--seed: must be a whole number (0 to 2**64-2), got 'x'"),
        (["--seed", "1_0"], "--seed: must be a whole number (0 to 2**64-2), got '1_0'"),  # int() would take it
        (["--steps", "٣"], "--steps: must be a whole number of steps (1 or more), got '٣'"),  # so would it this
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


def test_demo_takes_the_largest_seed(tmp_path):
    """2**64-2 is the last seed torch takes for both of the demo's generators (seed and seed + 1)."""
    proc = run_cli("demo", "--json", "--steps", "1", "--seed", str(2**64 - 2), "--report-dir", str(tmp_path))
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["seed"] == 2**64 - 2


@pytest.mark.parametrize("where, says", [
    ("{file}", "exists and is not a folder"),
    ("{file}/reports", "cannot be written: Not a directory"),
    ("/proc/1/torchdoctor-reports", "cannot be written: "),  # /proc takes no folders, not even root's
    ("", "is empty; pass a folder"),
])
def test_demo_refuses_a_report_dir_it_cannot_write_before_training(tmp_path, where, says):
    file = tmp_path / "a-file"
    file.write_text("x")
    where = where.format(file=file)
    proc = run_cli("demo", "--report-dir", where, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr.splitlines() == [f"torchdoctor demo: --report-dir {where}: " + proc.stderr.split(": ", 2)[2]
                                        .rstrip("\n")]
    assert says in proc.stderr and "Traceback" not in proc.stderr


def test_demo_creates_a_missing_report_dir_with_its_parents(tmp_path):
    where = tmp_path / "new" / "reports"
    proc = run_cli("demo", "--steps", "2", "--report-dir", str(where))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name for p in where.iterdir()} == {"torchdoctor-nonfinite-rank0.txt", "torchdoctor-nonfinite-rank0.json"}
    assert f"(report also written to {where}/torchdoctor-nonfinite-rank0.txt and .json)" in proc.stdout


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_demo_leaves_no_temporary_folder_behind(tmp_path, json_out):
    """Without --report-dir the report goes to a folder of its own in TMPDIR, removed at exit: runs do not pile up."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    for _ in range(2):
        proc = run_cli("demo", "--steps", "2", *(["--json"] if json_out else []), env={"TMPDIR": str(tmp)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        # torch keeps one cache folder of its own there (torchinductor_<user>); ours must be gone
        assert [p.name for p in tmp.iterdir() if p.name.startswith("torchdoctor")] == []
    if json_out:
        doc = json.loads(proc.stdout)
        assert doc["report_files"] is None  # nothing kept to point at
    else:
        assert "in a temporary folder removed at exit; --report-dir DIR keeps them" in proc.stdout
        assert str(tmp) not in proc.stdout

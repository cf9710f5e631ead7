"""Every subcommand's --json is strict JSON (no NaN / Infinity, which JSON.parse and most parsers refuse) and carries
a "findings" list: each command run for real, in a subprocess, on cheap inputs from tests/fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchdoctor import cli
from torchdoctor.deepspeed.ds_run import SUBCOMMANDS

HERE = Path(__file__).parent
SRC = str(HERE.parent / "src")
DS = HERE / "fixtures" / "ds_check"
LOGS = HERE / "fixtures" / "logs"
TIMELINE = HERE / "fixtures" / "timeline" / "run"  # a 4-step recording whose fc2 goes inf at step 3

# command -> (arguments, exit codes it may end with on this machine). Every command with a --json flag is here;
# test_every_subcommand_is_covered holds the list to cli.COMMANDS.
CASES = {
    "demo": (["demo", "--json", "--steps", "1"], {0}),
    "comm": (["comm", "--local", "2", "--json", "--timeout", "60"], {0}),
    "env": (["env", "--json"], {0, 1}),
    "report": (["report", "--json", "--ds-config", str(DS / "good.json"), "--training-args",
                "--learning_rate 3e-5 --fp16"], {0}),
    "ds check": (["ds", "check", "--json", str(DS / "problems.json"), "--world-size", "4"], {1}),
    "ds memory": (["ds", "memory", "--json", "--params", "7B", "--gpus-per-node", "8", "--cpu-mem", "256GiB",
                   "--gpu-mem", "80GB"], {0, 1}),
    "logs": (["logs", "--json", str(LOGS / "hf_trainer_nan.log")], {1}),
    "logs, two files": (["logs", "--json", str(LOGS / "clean_run.log"), str(LOGS / "nccl_timeout.log")], {1}),
    "run": (["run", "--json", "-", "--", sys.executable, "-c", "pass"], {0}),
    "precision": (["precision", "torchdoctor.demo.model:precision_case", "--json"], {1}),  # the demo's overflow
    "numerics show": (["numerics", "show", str(TIMELINE), "-o", "page.html", "--json"], {1}),
    "numerics diff": (["numerics", "diff", str(TIMELINE), str(TIMELINE), "--json"], {0}),
}


def strict_loads(text: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("case", CASES)
def test_json_output_is_strict_and_has_findings(case, tmp_path):
    argv, codes = CASES[case]
    proc = subprocess.run([sys.executable, "-m", "torchdoctor", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC}, cwd=tmp_path)
    assert proc.returncode in codes, proc.stderr[-3000:]
    doc = strict_loads(proc.stdout)  # the whole of stdout: one object, nothing around it
    assert isinstance(doc, dict)
    assert isinstance(doc["findings"], list) and doc["findings"], doc.keys()
    for f in doc["findings"]:
        assert {"id", "severity", "title", "evidence", "fix", "data"} <= set(f), f
        assert f["severity"] in ("ok", "info", "warn", "fail", "skip")


def test_every_subcommand_is_covered():
    covered = {" ".join(a for a in argv[:2] if not a.startswith("-")) if argv[0] in ("ds", "numerics") else argv[0]
               for argv, _ in CASES.values()}
    assert covered == {n for n in cli.COMMANDS if n not in ("ds", "numerics")} | {f"ds {n}" for n in SUBCOMMANDS} | {
        "numerics show", "numerics diff"}


def test_demo_json_findings_say_what_happened(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchdoctor", "demo", "--json", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = strict_loads(proc.stdout)
    ids = {f["id"]: f for f in doc["findings"]}
    assert set(ids) == {"demo.overflow-caught", "demo.prediction", "demo.fix-works"}
    assert ids["demo.prediction"]["severity"] == "ok"  # the monitor named the module precision predicted
    caught = ids["demo.overflow-caught"]
    assert caught["severity"] == "ok" and "encoder.block.2.layer.1" in caught["title"]
    assert caught["fix"] == ["torchdoctor.keep_fp32(model, 'encoder.block.2.layer.1')"]
    assert caught["data"]["report_files"] == [str(tmp_path / "torchdoctor-nonfinite-rank0.txt"),
                                              str(tmp_path / "torchdoctor-nonfinite-rank0.json")]
    assert ids["demo.fix-works"]["severity"] == "ok"


def test_logs_json_for_several_files_lists_every_files_findings():
    proc = subprocess.run([sys.executable, "-m", "torchdoctor", *CASES["logs, two files"][0]], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})
    doc = strict_loads(proc.stdout)
    per_file = [(f["file"], g["id"]) for f in doc["files"] for g in f["findings"]]
    assert [(f["data"]["file"], f["id"]) for f in doc["findings"]] == per_file

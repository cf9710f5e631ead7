"""``torchdoctor run``: one verdict per run -- the numerics monitor's inf/nan becomes ``numerics.nonfinite``.

Real runs: ``python -m torchdoctor run --json - ...`` of a small script, bounded (tests/bounded.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runs import PY, ids, the, torchdoctor_run
from torchdoctor.run.numerics_verdict import OutputScan, nonfinite_finding, read_reports

pytestmark = pytest.mark.machine  # real runs


BOOM = r"""
import sys
import torch
from torch import nn
import torchdoctor

class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.n = 0
    def forward(self, x):
        self.n += 1
        return x * float("inf") if self.n >= 3 else x  # the third forward: step 2

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = torchdoctor.NumericsMonitor(model, opt, report_dir=sys.argv[1] if len(sys.argv) > 1 else None)
for step in range(5):
    opt.zero_grad()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    print("step", step, loss.item(), flush=True)
"""

LINES_ONLY = r"""
import sys
print("step 1 loss 2.0")
print("[rank1] Detected inf at step 3 (forward) in transformer.h.1.mlp", file=sys.stderr)
sys.exit(1)
"""


def test_a_monitored_inf_is_one_numerics_verdict_from_its_report(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(BOOM)
    reports = tmp_path / "reports"
    rc, rep, _, err = torchdoctor_run(tmp_path, "--report-dir", str(reports), "--", PY, str(script), str(reports))
    assert rc == 1 and rep is not None and rep["exit_code"] == 1, err
    assert (reports / "torchdoctor-nonfinite-rank0.json").exists()
    assert ids(rep).count("numerics.nonfinite") == 1
    assert "process.exception" not in ids(rep), err  # the NonFiniteError traceback is folded in
    f = the(rep, "numerics.nonfinite")
    assert f["severity"] == "fail"
    d = f["data"]
    assert (d["source"], d["step"], d["phase"], d["module"], d["cls"], d["slot"], d["value"]) == \
        ("report", 2, "forward", "1", "Boom", "output", "inf")
    assert d["diagnosis"] and any(e.startswith("Diagnosis: ") for e in f["evidence"])
    assert d["report"].endswith("torchdoctor-nonfinite-rank0.json")
    assert "see numerics.nonfinite" in the(rep, "process.exit")["title"]
    assert "(numerics.nonfinite)" in err and "detected inf at step 2 (forward) in 1 (Boom)" in err


def test_the_report_in_the_working_directory_is_found_without_report_dir(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(BOOM)
    rc, rep, _, err = torchdoctor_run(tmp_path, "--", PY, str(script), ".")
    assert rc == 1 and rep is not None, err
    f = the(rep, "numerics.nonfinite")
    assert (f["data"]["source"], f["data"]["step"], f["data"]["module"]) == ("report", 2, "1")
    assert "process.exception" not in ids(rep)


def test_each_run_has_its_own_report_folder_by_default(tmp_path):
    """A monitor given no report_dir writes into the folder `run` gives the command: a new one per run."""
    script = tmp_path / "train.py"
    script.write_text(BOOM)
    paths = []
    for _ in range(2):
        rc, rep, _, err = torchdoctor_run(tmp_path, "--", PY, str(script))
        assert rc == 1 and rep is not None, err
        paths.append(Path(the(rep, "numerics.nonfinite")["data"]["report"]))
    assert paths[0] != paths[1]
    for p in paths:
        assert p.parent.parent == tmp_path / "torchdoctor-reports" and p.parent.name.startswith("run-")
        assert json.loads(p.read_text())["step"] == 2
    assert not list(tmp_path.glob("torchdoctor-nonfinite-*"))  # nothing in the working directory


def test_output_lines_alone_give_rank_step_phase_and_module(tmp_path):
    script = tmp_path / "lines.py"
    script.write_text(LINES_ONLY)
    rc, rep, _, err = torchdoctor_run(tmp_path, "--report-dir", str(tmp_path / "empty"), "--", PY, str(script))
    assert rc == 1 and rep is not None, err
    f = the(rep, "numerics.nonfinite")
    d = f["data"]
    assert (d["source"], d["rank"], d["step"], d["phase"], d["module"]) == \
        ("output", 1, 3, "forward", "transformer.h.1.mlp")
    assert f["title"].startswith("rank 1: ")
    assert "process.exception" not in ids(rep)


def test_a_healthy_run_has_no_numerics_finding(tmp_path):
    rc, rep, out, err = torchdoctor_run(tmp_path, "--report-dir", str(tmp_path / "r"), "--",
                                        PY, "-c", "print('all fine')")
    assert rc == 0 and rep is not None, err
    assert out == "all fine\n"
    assert not [i for i in ids(rep) if i.startswith("numerics.")]


def test_an_unwritable_report_dir_is_refused_before_the_command_runs(tmp_path):
    (tmp_path / "f").write_text("a file, not a folder")
    marker = tmp_path / "ran"
    rc, rep, _, err = torchdoctor_run(tmp_path, "--report-dir", str(tmp_path / "f" / "x"), "--",
                                      PY, "-c", f"open({str(marker)!r}, 'w')")
    assert rc == 2 and rep is None
    assert "cannot write --report-dir" in err and "Traceback" not in err
    assert not marker.exists()


# ------------------------------------------------------------------------------- the pieces, in process


def test_torchrun_prefixes_and_the_first_rank_is_named():
    s = OutputScan()
    s.feed("[rank1]: [rank1] Detected nan at step 4 (backward) in transformer.h.1.mlp (MLP), slot grad_output[0]\n"
           "[rank1]: [rank1] Diagnosis: it overflowed\n"
           "[default0]:Detected inf at step 3 (forward) in transformer.h.0.attn\n"
           "[rank2]:[rank2] Detected inf at step 3 (forward) in GPT2 (the model), slot output\n")
    f = nonfinite_finding([], s.detections)
    assert f is not None
    d = f.data
    assert (d["rank"], d["step"], d["module"], d["other_ranks"]) == (0, 3, "transformer.h.0.attn", [2, 1])
    assert [(r["rank"], r["module"]) for r in d["ranks"]][1] == (2, "")
    assert any("also rank 1: nan at step 4 (backward)" in e for e in f.evidence)
    assert s.detections[0].diagnosis == "it overflowed"


def test_several_report_files_the_earliest_step_goes_first(tmp_path):
    def write(rank: int, step: int, module: str | None) -> None:
        first = {"step": step, "phase": "bwd", "module": module, "cls": "MLP", "slot": "grad_output[0]",
                 "value": "nan"} if module else None
        (tmp_path / f"torchdoctor-nonfinite-rank{rank}.json").write_text(json.dumps(
            {"step": step, "rank": rank, "bad_ranks": [0, 1] if module is None else [], "first": first,
             "cause": "x.y", "severity": "fail", "diagnosis": f"diag {rank}", "fix": f"fix {rank}"}))

    write(0, 5, "h.0.mlp")
    write(1, 4, "h.1.mlp")
    write(2, 4, None)  # a rank whose own values were finite
    (tmp_path / "torchdoctor-nonfinite-loss-rank0.json").write_text("{}")  # a survived loss warning: not ours
    dets, problems = read_reports([str(tmp_path)], None)
    assert problems == [] and len(dets) == 3
    f = nonfinite_finding(dets, [])
    assert (f.data["rank"], f.data["step"], f.data["phase"], f.data["module"]) == (1, 4, "backward", "h.1.mlp")
    assert f.data["other_ranks"] == [0] and f.data["bad_ranks"] == [0, 1]
    assert f.fix[0] == "fix 1" and "diag 1" in " ".join(f.evidence)


def test_a_survived_warning_is_a_warning_and_an_old_report_is_not_this_runs(tmp_path):
    s = OutputScan()
    s.feed("Detected inf at step 7 (forward) in loss (CrossEntropyLoss), slot output\n"
           "Severity: warning (the run goes on: the step's gradients are finite)\n")
    f = nonfinite_finding([], s.detections)
    assert f.severity == "warn" and f.data["step"] == 7 and f.data["rank"] is None
    old = tmp_path / "torchdoctor-nonfinite-rank0.json"
    old.write_text(json.dumps({"step": 1, "rank": None, "first": None}))
    os.utime(old, (1e9, 1e9))
    assert read_reports([str(tmp_path)], 2e9) == ([], [])
    assert nonfinite_finding([], []) is None

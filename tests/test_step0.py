"""The monitor sees before it speaks: a fault present from the first step, in programs shaped like the ones people
run (tests/step0_worker.py), named where it began, its diagnosis resting on what was seen, its fix tried on the bad
step before it is printed -- and the fix, applied in a second run, trains.

Under the library API the programs run in this process; under ``torchdoctor run --numerics`` (the switch) as real,
bounded processes. The healthy twins stay silent.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import step0_worker as W
from runs import PY, ids, the, torchdoctor_run
from torchdoctor import NonFiniteError
from torchdoctor.numerics.engines import MonitorWarning
from torchdoctor.numerics.explain import causes

WORKER = str(Path(__file__).with_name("step0_worker.py"))


def run_api(kind: str, fault: str, out: Path, fix: str | None = None):
    """Run a program with the monitor attached in it: (its result, the report raised or None)."""
    out.mkdir(parents=True, exist_ok=True)
    loop = W.lightning_loop if kind == "lightning" else W.plain_loop
    args = (fault, str(out), True, fix) if kind == "lightning" else (kind, fault, str(out), True, fix)
    try:
        loop(*args)
        report = None
    except NonFiniteError as e:
        report = e.details
    return json.loads((out / "result.json").read_text()), report


def applied(report, kept: str | None = None) -> str:
    """The fix the report printed, followed literally as the worker applies it (``--fix``): every ``keep_fp32`` call
    it writes, bf16, or the where's repair; beside the guards ``kept`` already on when it says so."""
    if report.cause == causes.INVALID_OP:
        fix = "safe-where"
    elif "keep_fp32(model" in report.fix:
        fix = ",".join(f"keep_fp32:{name}" for name in re.findall(r"keep_fp32\(model, '([^']*)'\)",
                                                                   report.fix.split(", in addition")[0]))
    else:
        assert "bf16" in report.fix, report.fix
        fix = "bf16"
    return fix if kept is None or "in addition to" not in (report.fix or "") else f"{kept},{fix}"


def trained(kind: str) -> int:
    """The updates a healthy run of ``kind`` applies: every step, but the first under ``where-loss16``, whose fp16
    loss cannot hold a GradScaler's first scale (65536 > 65504): the scaler skips that step, as it should."""
    return W.STEPS - 1 if kind in ("where-loss16", "where-nested16") else W.STEPS


# (program, fault) -> (phase, module, cause, fix_check) of the first bad value at step 0
FAULTS = {
    ("scaler", "overflow"): ("fwd", "block1.0", causes.LOW_PRECISION_OVERFLOW, "fixed"),
    ("plain", "overflow"): ("fwd", "block1.0", causes.LOW_PRECISION_OVERFLOW, "fixed"),
    ("plain", "grad-overflow"): ("bwd", "head", causes.BACKWARD_OVERFLOW, "fixed"),
    ("plain", "nan-batch"): ("fwd", "block0.0", causes.BAD_INPUT, "not checked"),
    ("scaler", "nan-batch"): ("fwd", "block0.0", causes.BAD_INPUT, "not checked"),
    ("where", "invalid"): ("bwd", "", causes.INVALID_OP, "not checked"),
    # under fp16 and a GradScaler the nan is not taken for an overflow to skip: fp32 does not cure it, so every step
    # would be skipped -- it is named at once
    ("where-scaler", "invalid"): ("bwd", "", causes.INVALID_OP, "not checked"),
    # the same with the loss computed in fp16 inside the model: step 0's first bad value is the scaled loss gradient
    # (65536 is inf in fp16), an overflow -- checked in fp32 from the scale itself, the nan behind it is named, and
    # the headline is where that run's backward went bad: the division's backward, in the module whose forward ran it
    ("where-loss16", "invalid"): ("bwd", "", causes.INVALID_OP, "not checked"),
    # ... with the torch.where in a submodule's forward: named there, not at the model's output where the scale was
    ("where-nested16", "invalid"): ("bwd", "inner", causes.INVALID_OP, "not checked"),
    ("lightning", "overflow"): ("fwd", "body.0", None, "fixed"),
    ("lightning", "nan-batch"): ("fwd", "encoder.0", causes.BAD_INPUT, "not checked"),
}


@pytest.mark.parametrize(("kind", "fault"), list(FAULTS), ids=[f"{k}-{f}" for k, f in FAULTS])
def test_a_fault_from_step_0_is_stopped_named_and_its_checked_fix_trains(tmp_path, kind, fault):
    phase, module, cause, fix_check = FAULTS[kind, fault]
    got, report = run_api(kind, fault, tmp_path / "bad")
    assert report is not None, got
    assert got["ended"] == "NonFiniteError" and got["weights_finite"]
    assert got.get("updates", got.get("steps")) == 0  # stopped before the first update
    assert (report.step, report.first.phase, report.first.module) == (0, phase, module), report.text()
    if cause is not None:
        assert report.cause == cause, report.text()
    assert report.fix_check == fix_check, report.text()
    # what was seen, said: step 0 is watched whole
    assert report.observed["forward"].startswith("every module"), report.observed
    assert report.observed["backward"].startswith("every module's output gradient"), report.observed
    assert report.observed["autocast"] == ("off" if kind in ("where", "lightning") else "float16 (cpu)")
    saved = json.loads((tmp_path / "bad" / "torchdoctor-nonfinite-rank0.json").read_text())
    assert saved["fix_check"] == fix_check and saved["observed"] == report.observed
    if fix_check == "fixed" or cause == causes.INVALID_OP:
        again, after = run_api(kind, fault, tmp_path / "fixed", fix=applied(report))
        assert after is None, after.text()
        assert again["ended"] == "normally" and again["weights_finite"]
        assert again.get("updates", again.get("steps")) == trained(kind)  # it trains


def test_a_nan_only_in_the_backward_is_an_invalid_op_named_with_its_line_not_an_overflow(tmp_path):
    _, report = run_api("where", "invalid", tmp_path)
    assert report.cause == causes.INVALID_OP
    assert "division" in report.diagnosis and "stayed non-finite" in report.diagnosis
    assert "step0_worker.py:" in report.diagnosis and "torch.where(count > 0" in report.diagnosis
    assert "safe denominator" in report.fix and "keep_fp32" not in report.fix and "bf16" not in report.fix
    assert not re.search(r"gradient overflow|GradScaler", report.diagnosis)
    assert "in the forward of Masked (the model)" in report.diagnosis  # the module whose forward ran the line


def test_behind_a_scale_that_overflowed_the_headline_is_where_the_fp32_run_went_bad(tmp_path):
    """The scaled step's first bad value was the loss gradient (the scale, inf in fp16) at the model's output; the
    headline says where the step run again in fp32 at scale 1 made its first nan, and says that it was that run."""
    _, report = run_api("where-nested16", "invalid", tmp_path)
    first = report.first
    assert (first.module, first.cls, first.value) == ("inner", "Masked", "nan")
    assert first.slot == "DivBackward0 (the step run again in fp32 at scale 1)", first.slot
    assert "in the forward of inner (Masked)" in report.diagnosis
    assert "Nested (the model) grad_output" in report.diagnosis  # what the scaled step showed is still said
    assert report.text().splitlines()[0].startswith("Detected nan at step 0 (backward) in inner (Masked)")


def test_adam_on_fp16_weights_is_stopped_before_its_first_update_and_the_eps_fix_is_checked(tmp_path):
    """Lightning's 16-true with the default AdamW eps (1e-8 is 0 in fp16): the first update makes a weight nan from
    finite gradients. The update is tried on a copy before it is applied: the run stops at step 0 with the weights
    untouched, the cause said as the optimizer's own arithmetic (not "check the checkpoint"), and the eps fix tried
    the same way before it is printed."""
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = W.Net("none")

        def training_step(self, batch, batch_idx):
            return self.net(batch[0])[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    from torchdoctor.integrations.lightning import NumericsCallback

    data = torch.utils.data.TensorDataset(torch.cat(W.batches("none")))
    trainer = L.Trainer(max_epochs=1, precision="16-true", accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[NumericsCallback(report_dir=tmp_path)])
    lit = Lit()
    with pytest.raises(NonFiniteError) as e, pytest.warns(MonitorWarning, match=r"eps=1e-08 is 0 in float16.*"
                                                                r"tried on a copy before it is applied"):
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=8))
    d = e.value.details
    assert d.cause == causes.OPTIMIZER_UPDATE and d.step == 0 and d.first.phase == "update"
    assert d.text().splitlines()[0].startswith(f"Detected nan at step 0 (update) in {d.first.module} (")
    assert "AdamW's eps=1e-08 is 0 in float16" in d.diagnosis and "checkpoint" not in d.fix
    assert "The update was not applied" in d.diagnosis
    assert all(bool(torch.isfinite(p).all()) for p in lit.parameters())  # ... and it was not
    assert "16-mixed" in d.fix and "eps=0.0001" in d.fix
    assert d.fix_check == "fixed" and "eps=0.0001, is finite" in d.fix_check_reason
    saved = json.loads((tmp_path / "torchdoctor-nonfinite-rank0.json").read_text())
    assert saved["first"]["phase"] == "update" and saved["cause"] == causes.OPTIMIZER_UPDATE


def test_a_weight_gradient_overflow_is_not_blamed_on_the_loss(tmp_path):
    """The gradient entering the layer was seen finite: its own backward (the weight-gradient matmul in fp16) made
    the inf, not the loss."""
    _, report = run_api("plain", "grad-overflow", tmp_path)
    assert "loss" not in report.diagnosis.split(" In fp16")[0]
    assert "was finite (grad_output" in report.diagnosis and "own backward made it" in report.diagnosis
    assert report.fix == "torchdoctor.keep_fp32(model, 'head')"
    assert "To see where the backward blow-up starts" not in report.text()  # module gradients were seen


def test_a_fix_already_applied_is_never_proposed_again(tmp_path):
    """The region the diagnosis names is kept in fp32 already and the step still overflows: the fix printed is one
    that was checked to work, never the guard that is on."""
    _, report = run_api("plain", "overflow", tmp_path, fix="keep_fp32:block1.0")
    assert report is not None
    assert "keep_fp32(model, 'block1.0')" not in (report.fix or "")
    assert report.fix_check == "fixed", report.text()
    again, after = run_api("plain", "overflow", tmp_path / "again", fix=applied(report, "keep_fp32:block1.0"))
    assert after is None and again["updates"] == W.STEPS


def test_a_scaler_that_skips_every_step_is_a_finding_of_its_own(tmp_path):
    """A loss scaler that skips every step is never "OK": the run ends with a report saying no update was applied,
    with how many steps and the scale's way down."""
    with pytest.warns(UserWarning, match="skipped every step"):
        got, raised = run_api("scaler", "grad-overflow", tmp_path)
    assert raised is None and got["updates"] == 0 and got["ended"] == "normally"
    saved = json.loads((tmp_path / "torchdoctor-nonfinite-rank0.json").read_text())
    assert saved["cause"] == causes.SCALER_NEVER_STEPPED
    assert f"{W.STEPS} of {W.STEPS} step(s) overflowed" in saved["diagnosis"]
    assert "loss scale 65536 at step 0, 2048 at step 5" in saved["diagnosis"]
    assert "no update was ever applied" in saved["diagnosis"]
    assert saved["fix_check"] == "not checked"


@pytest.mark.parametrize("kind", ["scaler", "plain", "lightning", "where", "where-loss16", "where-nested16"])
def test_the_healthy_twins_are_silent(tmp_path, kind, recwarn):
    got, report = run_api(kind, "none", tmp_path)
    assert report is None and got["ended"] == "normally"
    assert got.get("updates", got.get("steps")) == trained(kind)
    assert not list(tmp_path.glob("torchdoctor-nonfinite*"))
    assert not [w for w in recwarn if "torchdoctor" in str(w.message)], [str(w.message) for w in recwarn]


# ---------------------------------------------------------------------------------------------- under the switch
def switched(tmp_path: Path, kind: str, fault: str, *extra: str) -> tuple[int, dict, dict]:
    out = tmp_path / "out"
    rc, rep, _, err = torchdoctor_run(tmp_path, "--numerics", "--", PY, WORKER, kind, fault, str(out), *extra,
                                      timeout=300, OMP_NUM_THREADS="1")
    assert rep is not None, err[-3000:]
    return rc, rep, json.loads((out / "result.json").read_text())


@pytest.mark.parametrize(("kind", "fault"), [("scaler", "overflow"), ("lightning", "overflow"), ("where", "invalid")])
def test_the_switch_sees_step_0_too(tmp_path, kind, fault):
    """``run --numerics`` attaches before the loop's first training forward (a plain loop, with or without a
    GradScaler) or through the trainer's callback: the same verdict as the library's, fix check included."""
    phase, module, cause, fix_check = FAULTS[kind, fault]
    rc, rep, got = switched(tmp_path, kind, fault)
    assert rc == 1 and got["ended"] == "NonFiniteError"
    f = the(rep, "numerics.nonfinite")
    assert (f["data"]["step"], f["data"]["phase"], f["data"]["module"]) == (0, {"fwd": "forward", "bwd": "backward"}[
        phase], module), f["data"]
    assert f["data"]["fix_check"] == fix_check
    assert f["data"]["observed"]["forward"].startswith("every module")
    if cause is not None:
        assert f["data"]["cause"] == cause
    assert "numerics.attached" in ids(rep) and "numerics.not-attached" not in ids(rep)


def test_the_switch_says_a_scaler_skipped_every_step(tmp_path):
    """nanoGPT's recipe overflowing in the backward at every scale it reaches: the scaler skips every
    ``optimizer.step()`` -- never "OK" and never "ended before its first optimizer step"."""
    rc, rep, got = switched(tmp_path, "scaler", "grad-overflow")
    assert got["updates"] == 0
    f = the(rep, "numerics.nonfinite")
    assert f["severity"] == "fail" and f["data"]["cause"] == causes.SCALER_NEVER_STEPPED
    assert "no update was ever applied" in f["data"]["diagnosis"]
    assert "numerics.not-attached" not in ids(rep)


@pytest.mark.parametrize("kind", ["scaler", "lightning"])
def test_the_switch_is_silent_on_a_healthy_run(tmp_path, kind):
    """A healthy GradScaler loop, and a LightningModule whose training_step calls its submodules: watched (attached),
    no finding, no warning (a step that calls submodules was once told 'compiled after the monitor attached')."""
    out = tmp_path / "out"
    rc, rep, _, err = torchdoctor_run(tmp_path, "--numerics", "--", PY, WORKER, kind, "none", str(out),
                                      timeout=300, OMP_NUM_THREADS="1")
    got = json.loads((out / "result.json").read_text())
    assert rc == 0 and got.get("updates", got.get("steps")) == W.STEPS, err[-2000:]
    assert "numerics.nonfinite" not in ids(rep)
    assert the(rep, "numerics.attached")["severity"] == "ok"
    assert "MonitorWarning" not in err and "torchdoctor:" not in err, err[-2000:]

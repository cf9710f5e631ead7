"""Advice that fits the run (issue 18, item 5): an inf loss with finite gradients is a warning the run survives,
"train in bf16" is never told to a run that computes in bf16, and (tests/test_diagnosis_rules.py) "give torchdoctor
the optimizer" only when none is hooked.

An inf loss whose gradients are all finite applies a finite update, so the monitor does not stop the run; it writes
the report, warns (:class:`NonFiniteWarning`, with the report's path) and keeps the report in ``monitor.warnings``.
A nan loss, an inf loss with a non-finite gradient, or one whose gradients were not checked still stops the run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import boom_mlp
from test_diagnosis_data import bert_batch, tiny_bert_regressor
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics import NonFiniteWarning
from torchdoctor.numerics.explain import causes
from torchdoctor.numerics.explain.evidence import contradictions

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

INF = float("inf")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))


def test_an_inf_marked_loss_with_finite_gradients_is_a_warning_and_the_run_goes_on(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon:
        before = [p.detach().clone() for p in model.parameters()]
        out = model(x)
        loss = out.pow(2).mean() + torch.tensor(INF)  # a term no parameter depends on
        mon.mark(loss, "loss")
        loss.backward()
        with pytest.warns(NonFiniteWarning, match="torchdoctor-nonfinite-loss-rank0.txt") as caught:
            opt.step()
        assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was applied
        opt.zero_grad()
        for _ in range(2):  # and the run goes on, watched
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert mon.report is None and len(mon.warnings) == 1
    report = mon.warnings[0]
    assert report.cause == causes.NONFINITE_LOSS and report.severity == "warn" and report.step == 0
    assert report.first.phase == "mark" and "the loss is inf while every gradient of this step is finite" \
        in report.diagnosis
    assert "the value marked 'loss'" in str(caught[0].message)
    assert caught[0].filename == __file__  # pointed at the user's line (opt.step()), not the monitor's
    written = Path(tmp_path, "torchdoctor-nonfinite-loss-rank0.json")
    assert json.loads(written.read_text())["severity"] == "warn"
    assert "Severity: warning" in Path(tmp_path, "torchdoctor-nonfinite-loss-rank0.txt").read_text()
    assert not Path(tmp_path, "torchdoctor-nonfinite-rank0.txt").exists()  # not a stop
    assert contradictions(report) == []


def test_the_models_own_inf_loss_from_a_huge_target_is_a_warning_naming_the_labels(tmp_path):
    """A regression target of 1e20: its squared error is inf in fp32, its gradient (2 * error) is finite."""
    model = tiny_bert_regressor()
    batch = bert_batch()
    batch["labels"][0] = 1e20
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.warns(NonFiniteWarning):
        model(**batch).loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
    (report,) = mon.warnings
    assert report.cause == causes.NONFINITE_LOSS and report.first.slot == "output[loss]"
    assert "BertForSequenceClassification (the model)" in report.diagnosis
    assert "The labels reach 1.00e+20, above sqrt(float32 max) = 1.84e+19" in report.diagnosis
    assert contradictions(report) == []


def test_a_nan_loss_with_finite_gradients_still_stops_the_run(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError) as exc:
        loss = model(torch.randn(3, 4)).pow(2).mean() + torch.tensor(float("nan"))
        mon.mark(loss, "loss")
        loss.backward()
        opt.step()
    assert exc.value.details.cause == causes.LOSS_OUTSIDE_MODEL and exc.value.details.severity == "fail"
    assert not mon.warnings


def test_an_inf_loss_with_an_inf_gradient_still_stops_the_run(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError):
        loss = (model(torch.randn(3, 4)) * INF).mean()
        mon.mark(loss, "loss")
        loss.backward()
        opt.step()
    assert not mon.warnings


def test_an_inf_loss_whose_gradients_are_not_watched_still_stops_the_run(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, grads="none", report_dir=tmp_path) as mon, \
            pytest.raises(NonFiniteError):
        loss = model(torch.randn(3, 4)).pow(2).mean() + torch.tensor(INF)
        mon.mark(loss, "loss")
        loss.backward()
        opt.step()
    assert not mon.warnings


def test_an_inf_loss_after_an_evaluation_forward_without_backward_still_stops(tmp_path):
    model = mlp()
    with NumericsMonitor(model, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError):
        mon.mark(model(torch.randn(3, 4)).sum() + torch.tensor(INF), "loss")
        mon.step()
    assert not mon.warnings


# ---------------------------------------------------------------- bf16 runs
def test_a_bf16_forward_overflow_is_beyond_fp32s_range_not_a_dtype_to_change(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.fill_(1e38)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path), pytest.raises(NonFiniteError) as exc:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.full((2, 4), 10.0))
        out.float().sum().backward()
        opt.step()
    report = exc.value.details
    said = f"{report.diagnosis}\n{report.fix}"
    assert report.cause == causes.RANGE_OVERFLOW, report.diagnosis
    assert "bf16" not in said and "keep_fp32" not in said and report.fp32_region is None
    assert contradictions(report) == []


def test_a_bf16_loss_that_takes_log_of_zero_is_the_loss_not_a_gradient_scale(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path), pytest.raises(NonFiniteError) as exc:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(3, 4))
        torch.log((out - out).abs()).float().mean().backward()
        opt.step()
    report = exc.value.details
    assert report.cause == causes.LOSS_OUTSIDE_MODEL, report.diagnosis
    assert "GradScaler" not in report.diagnosis and "train in bf16" not in report.diagnosis
    assert contradictions(report) == []


def test_a_bf16_backward_overflow_gets_no_loss_scale_and_no_bf16_advice(tmp_path):
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path), pytest.raises(NonFiniteError) as exc:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(4, 8))
        out.float().pow(2).mean().backward()
        opt.step()
    report = exc.value.details
    said = f"{report.diagnosis}\n{report.fix}\n" + "\n".join(report.notes)
    assert "train in bf16" not in said and "GradScaler" not in said
    assert contradictions(report) == []


def test_no_warning_is_left_over_on_a_healthy_run(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon:
            for _ in range(3):
                loss = model(torch.randn(3, 4)).pow(2).mean()
                mon.mark(loss, "loss")
                loss.backward()
                opt.step()
                opt.zero_grad()
    assert mon.warnings == [] and mon.report is None

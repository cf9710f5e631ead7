"""What the monitor watched is said in every report, and advice to change an option is written in the form the
user attached the monitor with (the library, a Trainer callback, the ``run --numerics`` switch)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchdoctor
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.explain.diagnosis_types import Setup
from torchdoctor.numerics.record.watched import describe, human_count


class SqrtOfZero(nn.Module):
    """Finite forward (sqrt(0) = 0), non-finite backward (its derivative at 0 is inf): fp32 cannot help."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * 0)


def bad_backward(tmp_path, via: str, watch: str = "every-module") -> NonFiniteError:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = NumericsMonitor(model, opt, report_dir=str(tmp_path), _via=via, watch=watch)
    try:
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(NonFiniteError) as caught:
            opt.step()
    finally:
        mon.close()
    return caught.value


class OnceAtStep1(nn.Module):
    """An inf at the second forward only: a fault its replay does not reproduce (a transient)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x * float("inf") if self.runs == 2 else x


FORMS = {
    "monitor": "NumericsMonitor(..., transient='skip')",
    "hf": "NumericsCallback(transient='skip')",
    "lightning": "NumericsCallback(transient='skip')",
    "switch": "torchdoctor run --numerics --transient skip",
}


@pytest.mark.parametrize("via", sorted(FORMS))
def test_option_advice_in_the_form_of_the_integration(tmp_path, via):
    """A fault whose replay does not reproduce it: the advice to skip such steps is in the form the monitor was
    attached with, and in no other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OnceAtStep1(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, opt, report_dir=str(tmp_path), _via=via), pytest.raises(NonFiniteError) as caught:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    advice = caught.value.details.fix
    assert caught.value.details.cause == "numerics.transient" and FORMS[via] in advice
    assert "transient='skip')" not in advice.replace(FORMS[via], "")  # no bare or other form beside it
    for other in set(FORMS.values()) - {FORMS[via]}:
        assert other not in advice


def test_setup_option_forms():
    assert Setup(via="switch").option("trace_steps", "1,3") == "torchdoctor run --numerics --trace-steps 1,3"
    assert Setup().option("abort_after_step", 3) == "NumericsMonitor(..., abort_after_step=3)"


def test_at_the_default_the_replay_names_the_module_and_no_option_is_advised(tmp_path):
    err = bad_backward(tmp_path, "monitor", watch="boundaries")
    assert (err.first.module, err.first.slot) == ("1", "grad_input") and err.details.replay == "reproduced"
    assert "grads='modules'" not in err.details.diagnosis + " ".join(err.details.notes)


def test_the_report_says_what_was_watched(tmp_path):
    err = bad_backward(tmp_path, "monitor", watch="boundaries")
    assert err.details.watched == "Sequential (25 params) with SGD, grads=params, watch=boundaries"
    saved = json.loads((tmp_path / "torchdoctor-nonfinite-rank0.json").read_text())
    assert saved["watched"] == err.details.watched
    assert "Watched: Sequential (25 params) with SGD, grads=params, watch=boundaries" in err.report


def test_wrappers_are_named_outermost_first(tmp_path):
    model = nn.Sequential(nn.Linear(1000, 1000))
    opt = torch.optim.AdamW(model.parameters())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        assert describe(torch.compile(ddp), opt, "modules") == (
            "Sequential (1.0M params) with AdamW, torch.compile, DDP, grads=modules")
    finally:
        dist.destroy_process_group()


def test_human_counts():
    assert [human_count(n) for n in (7, 25_000, 1_000_000, 124_439_808, 6_738_415_616)] == [
        "7", "25K", "1.0M", "124M", "6.7B"]


class _Marked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        h = self.fc(x) * 1e39  # plain code between modules: inf from a finite fc output
        torchdoctor.mark(h, "scaled")
        return h.sum()


def test_torchdoctor_mark_reaches_the_monitor_of_the_running_model(tmp_path):
    torchdoctor.mark(torch.ones(1), "no monitor: nothing happens")
    model = _Marked()
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(other, report_dir=tmp_path / "other") as bystander, \
            NumericsMonitor(model, opt, report_dir=tmp_path, _via="switch"):
        with pytest.raises(NonFiniteError) as e:
            model(torch.ones(1, 2)).backward()
            opt.step()
        assert bystander.report is None
    assert (e.value.first.phase, e.value.first.module) == ("mark", "scaled")

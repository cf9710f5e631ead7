"""An inf loss with finite gradients is a warning whatever the model returns besides it (issue 18 review, item 1).

The warning is defined by the values -- the only non-finite judged values of the step are its loss, and every
gradient was checked and is finite -- not by the rule that explains them: a model that returns only its loss got a
"range overflow" diagnosis (no other output to compare with) and the run was stopped, while the same model
returning logits too got the warning. Here the loss is returned every way a model returns it (a dict, a tuple, a
bare tensor, a ``ModelOutput``, computed by a loss module), in fp32 and under fp16 / bf16 autocast, in any
micro-batch of an accumulated step, with the optimizer hooked or with manual steps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics import NonFiniteWarning
from torchdoctor.numerics.explain import causes
from torchdoctor.numerics.explain.evidence import contradictions

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

INF = float("inf")


class LossModel(nn.Module):
    """A regressor that returns its own loss, shaped as ``shape`` says; ``bad`` adds an inf term no parameter
    depends on (the loss is inf, its gradient finite)."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, bad: bool = False):
        loss = F.mse_loss(self.b(torch.relu(self.a(x))).float(), y)
        if bad:
            loss = loss + torch.tensor(INF)
        if self.shape == "dict":
            return {"loss": loss}
        if self.shape == "tuple":
            return (loss,)
        if self.shape == "tensor":
            return loss
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(loss=loss)  # logits None: a ModelOutput holding only its loss


class CriterionModel(nn.Module):
    """The loss made by a loss module the model runs (``self.criterion``), returned as the model's only output."""

    def __init__(self, criterion: nn.Module, named: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.criterion = criterion
        self.named = named

    def forward(self, x: torch.Tensor, y: torch.Tensor, bad: bool = False):
        loss = self.criterion(self.a(x).float(), y * 1e20 if bad else y)  # a target whose square is beyond fp32
        return {"loss": loss} if self.named else loss


class SquaredError(nn.Module):
    """A loss module of the user's own (not one of torch's)."""

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()


def loss_of(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output["loss"]


def train(model, dtype, accumulate, bad_micro_batch, manual=False, steps=3, bad_step=1, lr=0.1):
    """Train ``steps`` steps of ``accumulate`` micro-batches; the one at (bad_step, bad_micro_batch) has an inf
    loss. Returns the monitor, the warnings raised and whether the bad step's update was applied."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    applied = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NumericsMonitor(model, optimizer=opt, manual_steps=manual) as mon:
            for step in range(steps):
                before = [p.detach().clone() for p in model.parameters()]
                for mb in range(accumulate):
                    x, y = torch.randn(3, 4), torch.randn(3, 1)
                    with torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
                        output = model(x, y, bad=step == bad_step and mb == bad_micro_batch)
                    (loss_of(output) / accumulate).backward()
                if manual:
                    mon.step()  # checked before the update, as the manual-steps advice asks
                opt.step()
                opt.zero_grad()
                if step == bad_step:
                    applied = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return mon, [w for w in caught if issubclass(w.category, NonFiniteWarning)], applied


def check_warning(mon, caught, applied, slot, micro_batch_runs):
    assert mon.report is None, mon.report.text() if mon.report else None
    assert len(mon.warnings) == 1 and len(caught) == 1, [str(w.message) for w in caught]
    (report,) = mon.warnings
    assert report.cause == causes.NONFINITE_LOSS and report.severity == "warn" and report.step == 1
    assert report.first.slot == slot and report.first.value == "inf"
    assert "the loss is inf while every gradient of this step is finite" in report.diagnosis
    assert "torchdoctor-nonfinite-loss-rank0.txt" in str(caught[0].message)
    assert applied  # the update of the bad step was applied, and the run went on to its end
    assert contradictions(report) == [], report.text()
    # the frames shown end at the bad micro-batch's loss: the model's calls of that step before it, and its own
    assert sum(1 for f in report.frames if f.step == 1 and f.phase == "fwd" and f.root) == micro_batch_runs


SLOTS = {"dict": "output[loss]", "tuple": "output[0]", "tensor": "output", "model_output": "output[loss]"}
ACCUMULATION = [(1, 0), (2, 0), (2, 1)]  # (micro-batches per step, the bad one)


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("accumulate,bad", ACCUMULATION)
@pytest.mark.parametrize("shape", list(SLOTS))
def test_a_model_returning_only_its_loss_gets_the_warning(tmp_path, shape, accumulate, bad, dtype):
    mon, caught, applied = train(LossModel(shape), dtype, accumulate, bad)
    check_warning(mon, caught, applied, SLOTS[shape], bad + 1)
    (report,) = mon.warnings
    # the model's own loss computation is named, as for a model that returns logits too
    assert "LossModel (the model) returned an inf" in report.diagnosis and "its only output" in report.diagnosis


@pytest.mark.parametrize("accumulate,bad", ACCUMULATION)
@pytest.mark.parametrize("shape", ["dict", "tensor"])
def test_with_manual_steps_as_gradient_accumulation_uses_them_the_inf_loss_is_a_warning(tmp_path, shape,
                                                                                          accumulate, bad):
    mon, caught, applied = train(LossModel(shape), None, accumulate, bad, manual=True)
    check_warning(mon, caught, applied, SLOTS[shape], bad + 1)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])  # (fp16: the gradient overflows)
@pytest.mark.parametrize("criterion,named", [(nn.MSELoss(), False), (nn.MSELoss(), True), (SquaredError(), True)],
                         ids=["torch-loss-bare", "torch-loss-named", "own-loss-named"])
def test_a_loss_module_making_the_inf_loss_gets_the_warning(tmp_path, criterion, named, dtype):
    """A target of 1e20: its squared error is inf in fp32, its gradient (2 * error) finite; the first bad value is
    the loss module's own output, which the model returns as its loss."""
    model = CriterionModel(criterion, named)
    mon, caught, applied = train(model, dtype, 1, 0, lr=1e-21)  # (gradients of ~1e20: a visible, sound update)
    check_warning(mon, caught, applied, "output", 0)  # (the model's own frame ends after its criterion's)
    assert mon.warnings[0].first.module == "criterion"


def test_an_inf_output_that_is_not_the_loss_still_stops_the_run(tmp_path):
    """A model's only output with an inf element among finite ones is not a loss (not a scalar), even though the
    loss the user computes from its finite part has finite gradients."""

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            out = self.a(x)
            return torch.cat([out[:, :2], torch.full_like(out[:, 2:], INF)], 1)

    torch.manual_seed(0)
    model = Logits()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt) as mon, pytest.raises(NonFiniteError):
        model(torch.randn(3, 4))[:, :2].pow(2).mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
    assert not mon.warnings


def test_a_scalar_output_of_a_plain_layer_is_not_taken_for_the_loss(tmp_path):
    """nn.Sequential ending in Linear(8, 1) given a batch of one returns a scalar-shaped output too; an fp16 overflow
    there stops the run even though a user's loss of it can have finite gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[1].weight.fill_(1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt) as mon, pytest.raises(NonFiniteError) as exc:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.full((1, 4), 10.0))
        (out.float().clamp(max=1.0)).sum().backward()
        opt.step()
    assert exc.value.details.first.module == "1" and not mon.warnings


def test_a_nan_loss_returned_alone_still_stops_the_run_and_names_the_loss(tmp_path):
    class NanLoss(LossModel):
        def forward(self, x, y, bad=False):
            loss = super().forward(x, y)["loss"]
            return {"loss": loss * torch.tensor(float("nan")) if bad else loss}

    torch.manual_seed(0)
    model = NanLoss("dict")
    with pytest.raises(NonFiniteError) as exc:
        train(model, None, 1, 0)
    report = exc.value.details
    assert report.cause == causes.MODEL_LOSS and "returned a nan output[loss] as its only output" in report.diagnosis
    assert contradictions(report) == []


def test_a_transformers_model_returning_a_tuple_gets_the_warning_naming_its_labels(tmp_path):
    """``return_dict=False``: the loss is ``output[0]`` of ``(loss, logits)``; a regression target of 1e20 makes it
    inf while its gradient is finite."""
    from test_diagnosis_data import bert_batch, tiny_bert_regressor

    model = tiny_bert_regressor()
    batch = bert_batch()
    batch["labels"][0] = 1e20
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.warns(NonFiniteWarning):
        model(**batch, return_dict=False)[0].backward()
        opt.step()
    (report,) = mon.warnings
    assert report.cause == causes.NONFINITE_LOSS and report.first.slot == "output[0]"
    assert "returned an inf output[0] while its other outputs (output[1]) are finite" in report.diagnosis
    assert "The labels reach 1.00e+20" in report.diagnosis
    assert contradictions(report) == []

"""``optimizer.step(closure)``: the forward and backward run inside ``step()``, after its pre-hooks. The step must
still be checked before its update (the one that went bad is named, the weights are left as it found them), for
optimizers that evaluate the closure once (SGD, AdamW) and several times (LBFGS)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from torchdoctor import AbortAfterStep, NonFiniteError, NumericsMonitor


class Blowup(nn.Module):
    """A linear layer whose output turns inf from its ``bad``-th call on (counting from 1; a fault that stays, which a
    replay of the step reproduces), or only on that call (``once``: a transient fault), and that counts its calls."""

    def __init__(self, bad: int | None, once: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bad = bad
        self.once = once
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        bad = self.bad is not None and (self.calls == self.bad if self.once else self.calls >= self.bad)
        return y * float("inf") if bad else y


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4),
}


WATCH = ["boundaries", "every-module"]


def make(bad: int | None, optimizer: str, tmp_path, watch: str = "boundaries", once: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Blowup(bad, once), nn.Linear(4, 1))
    opt = OPTIMIZERS[optimizer](model.parameters())
    mon = NumericsMonitor(model, opt, report_dir=str(tmp_path), watch=watch)
    x = torch.randn(16, 4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return model, opt, mon, closure


def snapshot(model: nn.Module, opt: torch.optim.Optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items() if not isinstance(v, list)}
             for p, s in opt.state.items()}
    return params, state


def unchanged(model: nn.Module, opt: torch.optim.Optimizer, before) -> bool:
    params, state = before
    now = snapshot(model, opt)[1]
    same_params = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    same_state = state.keys() == now.keys() and all(
        torch.equal(v, now[k][n]) if torch.is_tensor(v) else v == now[k][n]
        for k, s in state.items() for n, v in s.items()
    )
    return same_params and same_state


@pytest.mark.parametrize("watch", WATCH)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_the_bad_step_is_named_and_its_update_refused(optimizer, watch, tmp_path):
    model, opt, mon, closure = make(bad=3, optimizer=optimizer, tmp_path=tmp_path, watch=watch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the optimizer steps but no forward was recorded" (torch.compile)
        opt.step(closure)
        opt.step(closure=closure)  # the keyword form too
        before = snapshot(model, opt)
        with pytest.raises(NonFiniteError) as caught:
            opt.step(closure)
    first = caught.value.first
    assert (first.step, first.phase, first.module) == (2, "fwd", "2")  # the third step, the module that overflowed
    assert caught.value.details.replay == "reproduced"  # (every module watched: the replay says it comes back)
    assert unchanged(model, opt, before)
    assert all(p.grad is None for p in model.parameters())  # the refused step's gradients are not carried on
    assert (tmp_path / "torchdoctor-nonfinite-rank0.json").exists()
    mon.close()


def test_a_fault_that_does_not_come_back_is_a_transient_and_its_update_is_refused(tmp_path):
    """Inf on the third call only: the replay of that step (a fourth call, same inputs and RNG state) is finite."""
    model, opt, mon, closure = make(bad=3, optimizer="SGD", tmp_path=tmp_path, once=True)
    opt.step(closure)
    opt.step(closure)
    before = snapshot(model, opt)
    with pytest.raises(NonFiniteError) as caught:
        opt.step(closure)
    details = caught.value.details
    assert (details.first.step, details.first.phase, details.first.module) == (2, "fwd", "")  # the model's output
    assert details.replay == "not reproduced" and details.cause == "numerics.transient"
    assert "did not reproduce" in details.diagnosis and "nvidia-smi" in details.fix
    assert unchanged(model, opt, before)
    assert model[2].calls == 4  # the replay ran the forward once more
    mon.close()


@pytest.mark.parametrize("watch", WATCH)
def test_lbfgs_bad_first_evaluation_of_a_step(tmp_path, watch):
    model, opt, mon, closure = make(bad=None, optimizer="LBFGS", tmp_path=tmp_path, watch=watch)
    opt.step(closure)
    evaluations = model[2].calls
    assert evaluations > 1  # LBFGS evaluates the closure several times per step
    model[2].bad = evaluations + 1  # the first evaluation of the second step
    before = snapshot(model, opt)
    with pytest.raises(NonFiniteError) as caught:
        opt.step(closure)
    assert (caught.value.first.step, caught.value.first.module) == (1, "2")
    assert unchanged(model, opt, before)
    mon.close()


@pytest.mark.parametrize("watch", WATCH)
def test_lbfgs_bad_later_evaluation_puts_the_weights_back(tmp_path, watch):
    model, opt, mon, closure = make(bad=3, optimizer="LBFGS", tmp_path=tmp_path, watch=watch)  # in the first step
    before = snapshot(model, opt)
    with pytest.raises(NonFiniteError) as caught:
        opt.step(closure)
    assert model[2].calls == 4  # (a replay runs the bad evaluation once more, at either level)
    assert (caught.value.first.step, caught.value.first.module) == (0, "2")
    assert unchanged(model, opt, before)  # LBFGS had moved them after evaluations 1 and 2
    assert "put back as the step began" in caught.value.report
    saved = (tmp_path / "torchdoctor-nonfinite-rank0.txt").read_text()
    assert "put back as the step began" in saved  # the note is in the file too
    mon.close()


def test_healthy_closure_steps_count_one_step_each(tmp_path):
    model, opt, mon, closure = make(bad=None, optimizer="LBFGS", tmp_path=tmp_path)
    for _ in range(3):
        opt.step(closure)
    assert mon.step_index == 3
    assert mon.report is None
    mon.close()


def test_abort_after_step_with_closures(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = NumericsMonitor(model, opt, abort_after_step=1, report_dir=str(tmp_path))
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    with pytest.raises(AbortAfterStep):
        opt.step(closure)  # step 1 is applied, then the run stops
    mon.close()


class StepOnly:
    """An optimizer with no torch step hooks (its step() is wrapped instead), evaluating a closure once."""

    def __init__(self, params, lr: float = 0.1) -> None:
        self.param_groups = [{"params": list(params)}]
        self.state: dict = {}
        self.lr = lr

    def zero_grad(self) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p -= self.lr * p.grad
        return loss


@pytest.mark.parametrize("watch", WATCH)
def test_closure_of_an_optimizer_without_step_hooks(tmp_path, watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Blowup(2), nn.Linear(4, 1))
    opt = StepOnly(model.parameters())
    mon = NumericsMonitor(model, opt, report_dir=str(tmp_path), watch=watch)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError) as caught:
        opt.step(closure)
    assert (caught.value.first.step, caught.value.first.module) == (1, "1")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    mon.close()

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
    """A linear layer whose output turns inf on its ``bad``-th call (counting from 1), and that counts its calls."""

    def __init__(self, bad: int | None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bad = bad
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        return y * float("inf") if self.calls == self.bad else y


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4),
}


def make(bad: int | None, optimizer: str, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Blowup(bad), nn.Linear(4, 1))
    opt = OPTIMIZERS[optimizer](model.parameters())
    mon = NumericsMonitor(model, opt, report_dir=str(tmp_path))
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


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_the_bad_step_is_named_and_its_update_refused(optimizer, tmp_path):
    model, opt, mon, closure = make(bad=3, optimizer=optimizer, tmp_path=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the optimizer steps but no forward was recorded" (torch.compile)
        opt.step(closure)
        opt.step(closure=closure)  # the keyword form too
        before = snapshot(model, opt)
        with pytest.raises(NonFiniteError) as caught:
            opt.step(closure)
    first = caught.value.first
    assert (first.step, first.phase, first.module) == (2, "fwd", "2")  # the third step, the module that overflowed
    assert unchanged(model, opt, before)
    assert all(p.grad is None for p in model.parameters())  # the refused step's gradients are not carried on
    assert (tmp_path / "torchdoctor-nonfinite-rank0.json").exists()
    mon.close()


def test_lbfgs_bad_first_evaluation_of_a_step(tmp_path):
    model, opt, mon, closure = make(bad=None, optimizer="LBFGS", tmp_path=tmp_path)
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


def test_lbfgs_bad_later_evaluation_puts_the_weights_back(tmp_path):
    model, opt, mon, closure = make(bad=3, optimizer="LBFGS", tmp_path=tmp_path)  # within the first step
    before = snapshot(model, opt)
    with pytest.raises(NonFiniteError) as caught:
        opt.step(closure)
    assert model[2].calls == 3
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


def test_closure_of_an_optimizer_without_step_hooks(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Blowup(2), nn.Linear(4, 1))
    opt = StepOnly(model.parameters())
    mon = NumericsMonitor(model, opt, report_dir=str(tmp_path))
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

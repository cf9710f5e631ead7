"""An optimizer that cannot work in its parameters' dtype (Adam's eps=1e-8 is 0 in fp16): each update is tried on a
copy before it is applied, and one that makes a weight non-finite is stopped -- the weights and the optimizer's state
as they were -- with the fix (an eps fp16 holds) tried the same way. A healthy twin runs on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.engines import MonitorWarning
from torchdoctor.numerics.explain import causes
from torchdoctor.numerics.judge.update_trial import smallest_eps, try_update


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> int:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        loss = model(torch.randn(8, 16, generator=g).half()).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return n


def test_a_plain_loops_update_that_would_make_nan_is_stopped_before_it_is_applied(tmp_path):
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(MonitorWarning, match="tried on a copy before it is applied"):
        mon = NumericsMonitor(model, opt, report_dir=tmp_path)
    with mon, pytest.raises(NonFiniteError) as e:
        steps(model, opt, 3)
    d = e.value.details
    assert (d.cause, d.step, d.first.phase) == (causes.OPTIMIZER_UPDATE, 0, "update")
    assert d.first.value in ("nan", "inf")
    assert d.first.module in ("0", "2") and d.first.slot in ("weight", "bias")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # not applied
    assert not opt.state  # the optimizer did not step: its state is as it was (empty)
    assert d.fix_check == "fixed" and "eps=0.0001" in d.fix
    assert [f.phase for f in d.frames] == ["update"] * len(d.frames)
    assert d.observed["update"].startswith("tried on a copy") and d.observed["gradients"].startswith("finite")
    assert any(not ln.finite for ln in d.frames[0].lines) and d.frames[0].lines[0].finite  # nan after, finite grad


def test_with_an_eps_fp16_holds_the_same_loop_trains_and_every_update_is_tried():
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    with NumericsMonitor(model, opt) as mon:  # (no narrow optimizer: no warning, no trial)
        assert not mon._steps.try_updates
        steps(model, opt, 3)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_trial_leaves_the_original_alone_and_says_nothing_where_it_cannot_be_made():
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 16).half()).float().sum().backward()
    names = {id(p): n for n, p in model.named_parameters()}
    grads = [p.grad.clone() for p in model.parameters()]
    bad = try_update(opt, names)
    assert bad and {b.name for b in bad} <= set(names.values())
    assert try_update(opt, names, eps=smallest_eps(torch.float16)) == []
    assert not opt.state and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))

    class Odd(torch.optim.Optimizer):  # built differently from torch's: its constructor wants more than groups
        def __init__(self, params, must):
            super().__init__(params, {"lr": 1.0, "eps": 1e-8})
            self.must = must

        def step(self, closure=None):
            pass

    assert try_update(Odd(model.parameters(), 1), names) is None


def test_a_refused_update_keeps_its_step_number_and_puts_the_buffers_back(tmp_path):
    """As any bad step of the optimizer's boundary: raised before the step ends, so the next try is the same step,
    and the BatchNorm statistics its forward moved are put back (the report says so, and it is true)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    bn = model[1]
    with pytest.warns(MonitorWarning):
        mon = NumericsMonitor(model, opt, report_dir=tmp_path)
    try:
        mean = bn.running_mean.clone()
        x = torch.randn(8, 16).half()
        with pytest.raises(NonFiniteError) as e:
            model(x).float().pow(2).mean().backward()
            opt.step()
        assert e.value.details.step == 0 and mon.step_index == 0
        assert torch.equal(bn.running_mean, mean)
        assert any("put back as they were" in n for n in e.value.details.notes)
    finally:
        mon.close()


def test_with_manual_steps_the_warning_says_the_update_cannot_be_stopped():
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.warns(MonitorWarning, match="cannot be stopped before it is applied with steps that end at mon.step"):
        mon = NumericsMonitor(model, opt, manual_steps=True)
    mon.close()


def test_an_optimizer_whose_update_cannot_be_tried_is_said_once_and_left_to_run():
    class NeedsMore(torch.optim.Adam):  # (its constructor wants more than the groups a copy is built from)
        def __init__(self, params, must):
            super().__init__(params)
            self.must = must

    model = net()
    opt = NeedsMore(model.parameters(), must=1)
    with pytest.warns(MonitorWarning, match="tried on a copy before it is applied"):
        mon = NumericsMonitor(model, opt)
    with mon, pytest.warns(MonitorWarning, match="could not be tried on a copy") as caught:
        steps(model, opt, 1)
    assert sum("could not be tried" in str(w.message) for w in caught) == 1 and not mon._steps.try_updates
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())  # applied: what the warning said

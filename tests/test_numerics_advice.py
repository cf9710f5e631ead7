"""Advice that fits what the monitor knows of the run (issue 18 review, items 2-4).

- The optimizer advice depends on whether an optimizer was given, and separately on whether the step was checked
  before its update: "give torchdoctor the optimizer" was told to a run that had given it, with manual steps.
- A loss made non-finite by a value given to the user's loss function (a nan target, a nan mask) names those
  values, not only the loss's own operations.
- After ``keep_fp32``, a fix that adds a region says it is in addition to the guard already there (and a parent
  that holds both is offered when they are siblings); the fix is followed literally here and the run trains clean.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchdoctor
from conftest import boom_mlp
from test_diagnosis_rules import autocast_step, boundary_input, boundary_model
from torchdoctor import NonFiniteError, NumericsMonitor, keep_fp32
from torchdoctor.numerics.explain import causes
from torchdoctor.numerics.explain.evidence import contradictions
from torchdoctor.numerics.fp32 import Fp32Guard

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

GIVE = "give torchdoctor the optimizer"


def holds(report) -> None:
    assert contradictions(report) == [], report.text()


# ---------------------------------------------------------------- item 2: the optimizer advice
ORDERS = {
    # name: (optimizer given, manual_steps=, mon.step() before optimizer.step(), mon.step() after it)
    "hooked": (True, False, False, False),
    "manual-step-first": (True, True, True, False),
    "step-first-without-manual-steps": (True, False, True, False),
    "manual-step-last": (True, True, False, True),
    "no-optimizer-manual": (False, True, True, False),
    "no-optimizer": (False, False, False, False),
}


def bad_weight_run(tmp_path, order: str, accumulate: int = 1):
    """Three steps of ``accumulate`` micro-batches; a weight is written nan between steps 0 and 1 (a bad reload)."""
    given, manual, step_first, step_last = ORDERS[order]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt if given else None, manual_steps=manual, report_dir=tmp_path) as mon, \
            pytest.raises(NonFiniteError) as exc:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model[1].weight[0, 0] = float("nan")
            for _ in range(accumulate):
                (F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 1)) / accumulate).backward()
            if step_first:
                mon.step()
            opt.step()
            if step_last:
                mon.step()
            opt.zero_grad()
    return exc.value.details, mon


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("order", list(ORDERS))
def test_the_optimizer_advice_follows_what_was_given_and_when_the_step_was_checked(tmp_path, order, accumulate):
    given, manual, step_first, step_last = ORDERS[order]
    report, mon = bad_weight_run(tmp_path, order, accumulate)
    said = report.diagnosis
    assert report.cause == causes.BAD_WEIGHT and report.step >= 1, said
    assert (GIVE in said) == (not given) and ("optimizer=opt" in said) == (not given), said
    checked_before = given and not step_last
    if checked_before:  # the weights measured at the report are those the forward ran with: no doubt about order
        assert report.first.slot == "weight" and "already nan before this forward" in said
        assert "cannot tell which came first" not in said
        assert "no update from non-finite gradients was applied (each step was checked before" in said
        assert ("at mon.step()" in said) == (manual or step_first)
    else:
        assert "cannot tell which came first" in said
    if given and step_last:  # given, but checked at mon.step() after the update: move mon.step(), not "give"
        assert "checked at mon.step() after optimizer.step() had applied its update" in said
        assert "call mon.step() before optimizer.step() in every step" in said
    if not given and manual:
        assert "also call mon.step() before optimizer.step()" in said
    holds(report)


def test_a_run_that_checked_after_the_update_once_is_not_told_no_bad_update_was_ever_applied(tmp_path):
    """Step 0 is checked at mon.step() after its update, step 1 before it: the weights of step 1 are judged (checked
    before its update), but "no update from non-finite gradients was applied" would be a claim about step 0 too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, manual_steps=True, report_dir=tmp_path) as mon, \
            pytest.raises(NonFiniteError) as exc:
        F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 1)).backward()
        opt.step()
        mon.step()  # after the update
        opt.zero_grad()
        with torch.no_grad():
            model[1].weight[0, 0] = float("nan")
        F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 1)).backward()
        mon.step()  # before it
        opt.step()
    said = exc.value.details.diagnosis
    assert "already nan before this forward" in said and "no update from non-finite gradients" not in said
    assert "in an earlier step came after the update" in said and GIVE not in said
    holds(exc.value.details)


@pytest.mark.parametrize("manual", [True, False])
def test_gradients_gone_at_mon_step_ask_for_mon_step_earlier_not_for_the_optimizer(tmp_path, manual):
    """The gradients were non-finite when the backward ended and zero_grad() cleared them before mon.step()."""
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt, manual_steps=manual, report_dir=tmp_path) as mon, \
            pytest.raises(NonFiniteError) as exc:
        if not manual:
            mon.step()  # from here on, steps end at mon.step()
        model.boom.enabled = False  # a healthy step first: the first step is watched every module, gradients too
        for enabled in (False, True):
            model.boom.enabled = enabled
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    report = exc.value.details
    assert report.cause == causes.UNKNOWN_GRADIENT, report.diagnosis
    assert "optimizer=opt" not in report.diagnosis and "Pass the optimizer" not in report.diagnosis
    assert "call it before optimizer.step() and zero_grad()" in report.diagnosis


# ---------------------------------------------------------------- item 3: what the loss is given
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def masked_loss(out, y, mask):
    return (mask * (out - y) ** 2).sum() / mask.sum()


@pytest.mark.parametrize("grads", ["params", "modules"])
@pytest.mark.parametrize("bad", ["targets", "mask"])
def test_a_bad_value_given_to_the_loss_function_is_named_with_the_loss(tmp_path, bad, grads):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, grads=grads, report_dir=tmp_path), \
            pytest.raises(NonFiniteError) as exc:
        for step in range(3):
            y, mask = torch.randn(3, 1), torch.ones(3, 1)
            if step == 1:
                (y if bad == "targets" else mask)[1, 0] = float("nan")  # given to the loss only, never to the model
            masked_loss(model(torch.randn(3, 4)), y, mask).backward()
            opt.step()
            opt.zero_grad()
    report = exc.value.details
    assert report.cause == causes.LOSS_OUTSIDE_MODEL and report.step == 1, report.diagnosis
    assert "your loss function made" not in report.diagnosis + report.fix
    assert "a value the loss is given besides the model's outputs (the targets / labels, a mask" in report.diagnosis
    assert "targets / labels you pass to it, masks" in report.fix and "log/div/sqrt" in report.fix
    assert "torchdoctor.mark(targets, 'targets')" in report.fix and "keep_fp32" not in report.fix
    holds(report)


def test_marking_the_targets_as_the_fix_says_names_them(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError) as exc:
        for step in range(3):
            targets = torch.randn(3, 1)
            if step == 1:
                targets[0, 0] = float("nan")
            out = model(torch.randn(3, 4))
            mon.mark(targets, "targets")  # before the loss, as the fix says
            F.mse_loss(out, targets).backward()
            opt.step()
            opt.zero_grad()
    report = exc.value.details
    assert report.first.phase == "mark" and report.first.module == "targets" and report.step == 1
    assert "when the marked value is one the loss is given (targets / labels, a mask), it came in nan" \
        in report.diagnosis
    assert "find the bad records where batches are made" in report.fix
    holds(report)


# ---------------------------------------------------------------- item 4: extending a region kept in fp32
CALL = re.compile(r"torchdoctor\.keep_fp32\(model, '[^']*'\)")


def follow(fix: str, model: nn.Module) -> list[Fp32Guard]:
    """Run every keep_fp32 call the fix writes, as written, on ``model`` (the guards in place stay)."""
    calls = CALL.findall(fix)
    assert calls, fix
    return [eval(call, {"torchdoctor": torchdoctor, "model": model}) for call in calls]  # noqa: S307


def train_clean(model, x, tmp_path, steps=3) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)  # (steps of at most lr: the model stays the one diagnosed)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon:
        for _ in range(steps):
            autocast_step(x)(model, opt, mon)
            opt.zero_grad()
    assert mon.report is None and not mon.warnings


def test_the_boundary_fix_after_keep_fp32_adds_to_the_guard_and_followed_literally_trains_clean(tmp_path):
    x = boundary_input()
    model = boundary_model()
    first = keep_fp32(model, "2")  # the fix of the fp16 overflow in 2 (test_diagnosis_rules.py)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError) as exc:
        autocast_step(x)(model, opt, mon)
    report = exc.value.details
    assert report.cause == causes.BOUNDARY_OVERFLOW and report.first.module == "3"
    # worded so that it cannot be read as a replacement of the guard on '2'
    assert report.fix.startswith("torchdoctor.keep_fp32(model, '3'), in addition to the keep_fp32 already on '2'")
    assert "(leave that guard on: without the one on '2', 2 overflows float16 itself)" in report.fix
    assert "keeping the guard on 2" in report.diagnosis
    assert report.fp32_region == "3" and report.fp32_kept == ["2"]
    holds(report)
    added = follow(report.fix, model)  # as written, with the guard on '2' still there
    assert sorted(Fp32Guard.attached_to(model).names) == ["2", "3"]
    train_clean(model, x, tmp_path)
    # read as a replacement, the fix brings the first overflow back: that is why it says "in addition"
    first.remove()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError) as again:
        autocast_step(x)(model, opt, mon)
    assert again.value.details.first.module == "2"
    for guard in added:
        guard.remove()


class Block(nn.Module):
    """ff makes ~3.3e5 from inputs ~21 (beyond fp16); out brings it back down."""

    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.ff(x))


def block_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(inp=nn.Linear(16, 16), act=nn.ReLU(), block=Block()))
    with torch.no_grad():
        model.inp.weight.fill_(0.05)
        model.inp.bias.zero_()
        model.block.ff.weight.fill_(1000.0)
        model.block.out.weight.mul_(1e-4)
    return model


@pytest.mark.parametrize("keep_old", [True, False])
def test_siblings_get_their_parent_and_that_call_works_with_or_without_the_old_guard(tmp_path, keep_old):
    x = boundary_input()
    model = block_model()
    old = keep_fp32(model, "block.ff")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError) as exc:
        autocast_step(x)(model, opt, mon)
    report = exc.value.details
    assert report.cause == causes.BOUNDARY_OVERFLOW and report.first.module == "block.out", report.diagnosis
    assert report.fix.startswith("torchdoctor.keep_fp32(model, 'block'): it holds both 'block.ff'")
    assert "the guard already on 'block.ff' may stay" in report.fix and report.fp32_region == "block"
    holds(report)
    follow(report.fix, model)
    if not keep_old:
        old.remove()
    train_clean(model, x, tmp_path)


def test_following_every_keep_fp32_fix_in_turn_literally_ends_in_a_clean_run(tmp_path):
    """Each fix is added to the guards already there (its own wording says so): the fp16 overflow of 2, then the
    boundary at 3. An unrelated guard kept from the start is named by each fix as one to leave on."""
    x = boundary_input()
    model = boundary_model()
    keep_fp32(model, "0")
    fixes = []
    for _ in range(4):
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        try:
            with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon:
                for _ in range(3):
                    autocast_step(x)(model, opt, mon)
                    opt.zero_grad()
            break
        except NonFiniteError as e:
            report = e.details
            holds(report)
            assert re.search(r"in addition to the keep_fp32 already on [^(]*'0'", report.fix), report.fix
            fixes.append(report.fix)
            follow(report.fix, model)
    else:
        pytest.fail(f"still not clean after {fixes}")
    # the first fix holds at once: checked on the bad step before it was printed, it keeps 2 and the module after it
    # (2 alone leaves 3 to overflow on 2's fp32 output: the second fix this loop needed before the fix check)
    assert fixes == ["torchdoctor.keep_fp32(model, '2') and torchdoctor.keep_fp32(model, '3'), in addition to the "
                     "keep_fp32 already on '0' (leave that guard on)"]
    assert sorted(Fp32Guard.attached_to(model).names) == ["0", "2", "3"]

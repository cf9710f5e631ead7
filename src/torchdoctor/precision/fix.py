"""The fix, found and checked: the smallest set of modules to keep in fp32 so that no value computed in the target
dtype overflows or comes within 2x of its largest value, verified by running the forward again under the target
dtype's autocast with those modules kept in fp32 (:func:`torchdoctor.keep_fp32`); then one backward at the loss
scale the prediction proposes, with the gradients checked.

The search starts from the modules the prediction named. A module kept in fp32 returns fp32 values, so a value
still too large for fp16 flows on to the next op; if that op casts it down, the verification sees it and its module
joins the set, round after round, until the forward is clean. Past half the model's parameters (or the model's own
code between modules) a region is no longer the fix: train in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..numerics.engines.wrappers import named_user_modules
from ..numerics.fp32 import keep_fp32
from .ops import NONFINITE, OUT_MAX, Recorder, floats
from .predict import DEFAULT_SCALE_POWER, RISK_FACTOR, LossScale, Prediction
from .probe import Probe, call, loss_of, seeded

MAX_ROUNDS = 8
MAX_SCALE_TRIES = 8  # loss scales checked with a backward, at most
MAX_PRUNE = 12  # regions tried without, once the set works
MAX_PARAM_SHARE = 0.5  # regions holding more of the model than this are not a fix: bf16 is


@dataclass
class FixResult:
    regions: list[str]  # module names, outermost only
    verified: bool  # the forward under the target dtype's autocast, with the regions in fp32, stayed in range
    rounds: int
    remaining: list[str] = field(default_factory=list)  # modules still out of range when the search stopped
    param_share: float = 0.0
    loss: float | None = None  # that forward's loss
    reason: str | None = None  # why the search gave up
    backward_checked: bool = True  # False: the backward is non-finite in fp32 already, only the forward was checked

    def to_json(self) -> dict:
        return {"regions": self.regions, "verified": self.verified, "rounds": self.rounds, "remaining": self.remaining,
                "param_share": self.param_share, "loss": self.loss, "reason": self.reason,
                "backward_checked": self.backward_checked}


def _outermost(names: set[str]) -> list[str]:
    return sorted(n for n in names if not any(n.startswith(o + ".") for o in names if o != n))


def _param_share(model: nn.Module, regions: list[str]) -> float:
    total = sum(p.numel() for p in model.parameters())
    if not total:
        return 0.0
    mods = dict(named_user_modules(model))
    kept = sum(p.numel() for r in regions for p in mods[r].parameters())
    return kept / total


def _flagged(model: nn.Module, batch: Any, probe: Probe, regions: list[str], limit: float,
             absorbed: set[str]) -> tuple[list[str], float]:
    """Run the forward under the target dtype's autocast with ``regions`` in fp32; the modules (in order) where a
    value computed in the target dtype went non-finite (beyond what the fp32 pass had: masks) and reached the
    module's output, or came past ``limit`` (except in ``absorbed`` modules, whose output stays finite when such a
    value overflows: the prediction saw it), and the loss."""
    baseline: dict[tuple[str, str], float] = {}
    for op in probe.fp32_ops:
        key = (op.module, op.name)
        baseline[key] = max(baseline.get(key, 0.0), op.stats[NONFINITE])
    mods = dict(named_user_modules(model))
    names = {m: n for n, m in mods.items()}
    recorder = Recorder(probe.target, weights={p.untyped_storage().data_ptr() for p in model.parameters()})
    went_bad: dict[str, torch.Tensor] = {}

    def watch(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            with recorder.paused():
                ts = floats(output)
                if ts:
                    went_bad[name] = torch.stack([~torch.isfinite(t).all() for t in ts]).any()
        return hook

    handles = [m.register_forward_hook(watch(n)) for m, n in names.items()]
    guard = keep_fp32([mods[r] for r in regions], model=model) if regions else None
    try:
        with seeded(), torch.no_grad(), torch.autocast(probe.device.split(":")[0], dtype=probe.target), recorder, \
                recorder.modules(model, names):
            loss, _ = loss_of(call(model, batch))
    finally:
        if guard is not None:
            guard.remove()
        for h in handles:
            h.remove()
    bad_modules = {n for n, flag in went_bad.items() if bool(flag)}
    flagged: list[str] = []
    for op in recorder.read():
        if not op.computes(probe.target):
            continue
        # a new inf/nan that reaches its module's output (not a mask, not one a saturating function absorbs), or a
        # finite value past the limit
        bad = op.stats[NONFINITE] > 0 and not baseline.get((op.module, op.name), 0.0) and op.module in bad_modules
        near = op.stats[OUT_MAX] > limit and op.module not in absorbed
        if (bad or near) and op.module not in flagged:
            flagged.append(op.module)
    return flagged, float(loss.float())


def _backward_fault(model: nn.Module, batch: Any, probe: Probe, regions: list[str]) -> str | None:
    """One forward and backward under the target dtype's autocast (no loss scale) with ``regions`` in fp32, checked
    by the monitor with every module watched and module-level gradients: the module it names for a non-finite
    gradient (``""``: the model's own code or its loss), or None when every gradient stayed finite. ``.grad`` and the
    buffers are put back."""
    import tempfile

    from ..numerics.errors import NonFiniteError
    from ..numerics.monitor import NumericsMonitor

    mods = dict(named_user_modules(model))
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    guard = keep_fp32([mods[r] for r in regions], model=model) if regions else None
    try:
        with tempfile.TemporaryDirectory(prefix="torchdoctor-precision-") as tmp:
            for p in params:
                p.grad = None
            with NumericsMonitor(model, grads="modules", watch="every-module", report_dir=tmp) as mon:
                with seeded(), torch.autocast(probe.device.split(":")[0], dtype=probe.target):
                    loss, _ = loss_of(call(model, batch))
                if loss.requires_grad:
                    loss.float().backward()
                mon.step()
    except NonFiniteError as e:
        name = e.first.module if e.first is not None else ""
        return name if name in mods else ""
    finally:
        if guard is not None:
            guard.remove()
        for p, g in zip(params, saved):
            p.grad = g
    return None


def _widen(regions: set[str], current: list[str], name: str) -> None:
    """Add ``name``; a module already kept in fp32 named again (its own code around its children) widens to its
    parent."""
    inside = next((r for r in current if name == r or name.startswith(r + ".")), None)
    regions.add(name if inside is None else inside.rsplit(".", 1)[0] if "." in inside else "")


def find_regions(model: nn.Module, batch: Any, probe: Probe, prediction: Prediction) -> FixResult:
    """Grow the set of fp32 regions from the prediction's sites until a forward under the target dtype's autocast
    stays in range and its backward (unscaled) stays finite -- the backward only where it is finite in fp32 (a
    backward non-finite in fp32 already is no region's to fix); give up past :data:`MAX_PARAM_SHARE` of the
    parameters, at the model's own code, or after :data:`MAX_ROUNDS`."""
    backward = prediction.fp32_fault is None
    limit = prediction.dtype_max / RISK_FACTOR
    absorbed = {s.module for s in prediction.absorbed}
    regions = {s.module for s in prediction.overflow + prediction.at_risk}
    regions |= {n.rsplit(".", 1)[0] if "." in n else "" for n, _ in prediction.weights_over}
    rounds = 0
    loss = None
    flagged: list[str] = []
    while True:
        if "" in regions:
            return FixResult(_outermost(regions - {""}), False, rounds, flagged or [""], 1.0, loss,
                             "a value computed by the model's own code between modules (or its loss) is out of "
                             "range or within 2x of it: no module to keep in fp32")
        current = _outermost(regions)
        share = _param_share(model, current)
        if share > MAX_PARAM_SHARE:
            return FixResult(current, False, rounds, flagged, share, loss,
                             f"keeping enough of the model in fp32 would take {share:.0%} of its parameters")
        if rounds >= MAX_ROUNDS:
            return FixResult(current, False, rounds, flagged, share, loss,
                             f"still out of range after {MAX_ROUNDS} rounds of widening the regions")
        rounds += 1
        flagged, loss = _clean(model, batch, probe, current, limit, absorbed, backward)
        if not flagged:
            current, loss = _pruned(model, batch, probe, current, limit, absorbed, loss, backward)
            return FixResult(current, True, rounds, [], _param_share(model, current), loss,
                             backward_checked=backward)
        for name in flagged:
            _widen(regions, current, name)


def _clean(model: nn.Module, batch: Any, probe: Probe, regions: list[str], limit: float,
           absorbed: set[str], backward: bool = True) -> tuple[list[str], float | None]:
    """With ``regions`` in fp32: the modules still out of range in the forward, else (``backward``) the module the
    backward goes non-finite at (empty: both clean), and the forward's loss."""
    flagged, loss = _flagged(model, batch, probe, regions, limit, absorbed)
    if not flagged and backward:
        backward = _backward_fault(model, batch, probe, regions)
        flagged = [] if backward is None else [backward]
    return flagged, loss


def _pruned(model: nn.Module, batch: Any, probe: Probe, regions: list[str], limit: float, absorbed: set[str],
            loss: float | None, backward: bool = True) -> tuple[list[str], float | None]:
    """Drop the regions not needed: the prediction seeds every module past the range, also those that only pass on
    a value their predecessor made (once that one computes in fp32, they do too). Each region is tried without, last
    first, at most :data:`MAX_PRUNE` of them; one that is not needed stays out."""
    kept = list(regions)
    for name in list(reversed(regions))[:MAX_PRUNE]:
        if len(kept) == 1:
            break
        trial = [r for r in kept if r != name]
        flagged, trial_loss = _clean(model, batch, probe, trial, limit, absorbed, backward)
        if not flagged:
            kept, loss = trial, trial_loss
    return kept, loss


@dataclass
class ScaleCheck:
    """One backward under the target dtype's autocast at a loss scale: did the parameters' gradients stay finite?
    (What a loss scaler checks before it steps; those already non-finite in fp32 are not counted.)"""

    power: int
    overflowed: int  # parameters whose gradient went inf/nan

    @property
    def ok(self) -> bool:
        return not self.overflowed

    def to_json(self) -> dict:
        return {"power": self.power, "overflowed": self.overflowed, "ok": self.ok}


def check_scales(model: nn.Module, batch: Any, probe: Probe, regions: list[str], scale: LossScale,
                 default: int = DEFAULT_SCALE_POWER) -> list[ScaleCheck]:
    """Backwards at loss scales, by power of two, sorted: from the predicted start (the default when predicted to
    work, else the nearest predicted power) down in growing steps after an overflow until one keeps the gradients
    finite, the default checked too when it lies above, then halving the gap between the largest power that worked
    and the smallest above it that overflowed -- so the largest power that works is known exactly (what a loss
    scaler backs off to, and how many steps it skips on the way), within :data:`MAX_SCALE_TRIES` backwards."""
    if scale.max_power is None:
        return []
    lowest = scale.min_power if scale.min_power is not None and scale.min_power <= scale.max_power else None
    power = min(default, scale.max_power) if lowest is None else min(max(default, lowest), scale.max_power)
    done: dict[int, ScaleCheck] = {}

    def ok(p: int) -> bool:
        if p not in done:
            done[p] = check_scale(model, batch, probe, regions, p)
        return done[p].ok

    step = 1
    while len(done) < MAX_SCALE_TRIES and not ok(power):
        power, step = power - step, step * 2
    good = [p for p, c in done.items() if c.ok]
    if good and len(done) < MAX_SCALE_TRIES:
        lo = max(good)
        if lo < default and default not in done:
            ok(default)
        hi = min((p for p, c in done.items() if not c.ok and p > lo), default=None)
        while hi is not None and hi - lo > 1 and len(done) < MAX_SCALE_TRIES:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    return [done[p] for p in sorted(done)]


def check_scale(model: nn.Module, batch: Any, probe: Probe, regions: list[str], power: int) -> ScaleCheck:
    """One forward and backward under the target dtype's autocast, the loss multiplied by ``2**power`` as a loss
    scaler would, with ``regions`` in fp32: how many parameter gradients went non-finite (of those finite in fp32).
    ``.grad`` is put back after."""
    mods = dict(named_user_modules(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in named]
    guard = keep_fp32([mods[r] for r in regions], model=model) if regions else None
    broken = set(probe.grads.nonfinite_params)
    try:
        for _, p in named:
            p.grad = None
        with seeded(), torch.autocast(probe.device.split(":")[0], dtype=probe.target):
            loss, _ = loss_of(call(model, batch))
        if not loss.requires_grad:
            return ScaleCheck(power, 0)
        (loss.float() * 2.0 ** power).backward()
        flags = [~torch.isfinite(p.grad).all() for n, p in named if p.grad is not None and n not in broken]
        return ScaleCheck(power, int(torch.stack(flags).sum()) if flags else 0)
    finally:
        if guard is not None:
            guard.remove()
        for (_, p), g in zip(named, saved):
            p.grad = g


def fix_code(regions: list[str]) -> list[str]:
    """The lines a user adds after building the model (one ``keep_fp32`` per region)."""
    if not regions:
        return []
    if len(regions) <= 4:
        return ["import torchdoctor"] + [f"torchdoctor.keep_fp32(model, {r!r})" for r in regions]
    return ["import torchdoctor",
            f"torchdoctor.keep_fp32([model.get_submodule(n) for n in {regions!r}], model=model)"]


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)

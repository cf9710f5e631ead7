"""The passes behind a prediction: one forward in the target dtype (autocast, no gradients), one forward and
backward in fp32, each op recorded (:mod:`.ops`), each module's outputs and output gradients measured, and the
weights' ranges. Every statistic stays on the device until the pass ends, then one read per pass.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..numerics.engines.wrappers import named_user_modules
from .ops import OpRecord, Recorder, floats, flush_below, magnitude, paired

#: the gradient histogram's bins: one per power of two, 2**LOW_EXP .. 2**HIGH_EXP (fp32's whole range)
LOW_EXP, HIGH_EXP = -150, 130
HIST_SAMPLE = 1 << 16  # gradient values per tensor put in the histogram


@dataclass
class ModuleValues:
    name: str
    cls: str
    out_max: float = 0.0  # fp32 pass: the largest finite output magnitude
    grad_max: float = 0.0  # fp32 pass: the largest gradient its outputs in the target dtype received
    narrow: bool = False  # the target dtype's pass: at least one floating output is in the target dtype
    narrow_bad: bool = False  # the target dtype's pass: an output went inf/nan (in any of its calls)


@dataclass
class Probe:
    target: torch.dtype
    device: str
    fp32_ops: list[OpRecord]
    narrow_ops: list[OpRecord]
    modules: dict[str, ModuleValues]  # in the order their forwards finished
    grad_hist: list[float]  # nonzero gradient magnitudes per power of two (LOW_EXP ..): activations in the
    #                         target dtype and parameter gradients
    grad_peak: float  # the largest of those gradient magnitudes
    weights: list[tuple[str, float, float, int]]  # (name, abs max, values flushed to zero, numel)
    loss: float
    narrow_loss: float
    loss_note: str | None
    seconds: float
    notes: list[str] = field(default_factory=list)
    # the first module whose output went non-finite in the target dtype's forward, in the order the calls returned
    # (a module called twice, a final dropout, is placed by the call that went bad)
    first_narrow_bad: str | None = None

    @property
    def paired(self) -> bool:
        return paired(self.fp32_ops, self.narrow_ops)


def loss_of(output: Any) -> tuple[torch.Tensor, str | None]:
    """The loss the model returned (``.loss``, a ``"loss"`` key, a 0-d output or the first 0-d element), else the
    mean square of its first floating output, said so."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if loss is None and isinstance(output, (list, tuple)):
        loss = next((t for t in output if isinstance(t, torch.Tensor) and t.dim() == 0), None)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point():
        return loss, None
    first = next(iter(floats(output)), None)
    if first is None:
        raise ValueError("the model returned no floating-point tensor: nothing to measure")
    return first.float().pow(2).mean(), ("the model returned no loss (pass labels in the batch): gradients are "
                                         "those of the mean square of its first output")


def call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


@contextlib.contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    """The same RNG stream for both passes (dropout masks alike), the caller's put back after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _grad_row(g: torch.Tensor, hist: list[torch.Tensor]) -> torch.Tensor:
    """The gradient's largest magnitude (exact), its nonzero magnitudes added to ``hist`` (a strided sample of at
    most :data:`HIST_SAMPLE` values per tensor: the histogram estimates shares, the peak is read in full)."""
    flat = g.detach().flatten()
    a = flat.abs().float()
    sample = a if a.numel() <= HIST_SAMPLE else a[:: -(-a.numel() // HIST_SAMPLE)]
    nz = sample[(sample > 0) & torch.isfinite(sample)]
    if nz.numel():
        hist.append(torch.histc(torch.log2(nz), bins=HIGH_EXP - LOW_EXP, min=LOW_EXP, max=HIGH_EXP))
    return torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf"))).amax() if a.numel() else a.sum()


def run_probe(model: nn.Module, batch: Any, target: torch.dtype, device: str) -> Probe:
    """Run both passes of ``model`` on ``batch`` (both already on ``device``) and measure them."""
    t0 = time.perf_counter()
    names = {m: n for n, m in named_user_modules(model)}
    modules: dict[str, ModuleValues] = {}
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    notes: list[str] = []

    # 1. the target dtype: which ops compute in it, and where its forward goes non-finite
    narrow = Recorder(target, measure=False)  # (only which dtype each op computes in)
    outs_dtype: dict[str, tuple[tuple[bool, ...], torch.Tensor]] = {}  # per output: in the target dtype; went bad
    narrow_calls: list[tuple[str, torch.Tensor]] = []  # (module, its output went bad) per call, in return order

    def narrow_hook(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            with narrow.paused():
                measure(name, output)

        def measure(name: str, output: Any) -> None:
            ts = floats(output)
            bad = torch.stack([~torch.isfinite(t).all() for t in ts]).any() if ts else torch.zeros((), dtype=bool)
            before = outs_dtype.get(name)
            outs_dtype[name] = (tuple(t.dtype == target for t in ts), bad if before is None else bad | before[1])
            narrow_calls.append((name, bad))
        return hook

    handles = [m.register_forward_hook(narrow_hook(n)) for m, n in names.items()]
    try:
        with seeded(), torch.no_grad(), torch.autocast(device.split(":")[0], dtype=target), narrow, \
                narrow.modules(model, names):
            output = call(model, batch)
            with narrow.paused():  # (the fp32 pass's loss is not recorded either)
                narrow_loss, _ = loss_of(output)
    finally:
        for h in handles:
            h.remove()
    narrow_ops = narrow.read()
    narrow_loss_value = float(narrow_loss.float())

    # 2. fp32: every value's magnitude, and the gradients
    weights = {p.untyped_storage().data_ptr() for _, p in params}
    fp32 = Recorder(target, plan=narrow_ops, weights=weights)
    out_max: dict[str, list[torch.Tensor]] = {}
    grad_max: dict[str, list[torch.Tensor]] = {}
    hist: list[torch.Tensor] = []

    def fp32_hook(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            with fp32.paused():
                measure(module, name, output)

        def measure(module: nn.Module, name: str, output: Any) -> None:
            ts = floats(output)
            modules.setdefault(name, ModuleValues(name, type(module).__name__))
            if not ts:
                return
            with torch.no_grad():
                out_max.setdefault(name, []).append(torch.stack([magnitude(t)[0] for t in ts]).amax())
            narrow_outs = outs_dtype.get(name, ((), None))[0]
            for i, t in enumerate(ts):
                if t.requires_grad and i < len(narrow_outs) and narrow_outs[i]:
                    # a gradient computed in the target dtype (its output was): it feeds the histogram and the peak
                    t.register_hook(lambda g, name=name: grad_max.setdefault(name, []).append(_grad_row(g, hist)))
        return hook

    handles = [m.register_forward_hook(fp32_hook(n)) for m, n in names.items()]
    try:
        with seeded(), fp32, fp32.modules(model, names):
            output = call(model, batch)
        fp32.on = False
        loss, loss_note = loss_of(output)
        params_grad = [p for _, p in params if p.requires_grad]
        for p in params_grad:
            p.grad = None
        if loss.requires_grad:
            loss.backward()
        else:
            notes.append("the loss does not depend on any parameter that requires grad: no gradients measured")
    finally:
        for h in handles:
            h.remove()
    param_rows = [_grad_row(p.grad, hist) for _, p in params if p.grad is not None]
    for _, p in params:
        p.grad = None

    # weights: abs max and values the target dtype flushes to zero
    tiny = flush_below(target)
    with torch.no_grad():
        wrows = [torch.stack([p.detach().abs().amax().float(), ((p.detach() != 0) & (p.detach().abs() < tiny))
                              .sum().float()]) if p.numel() else torch.zeros(2) for _, p in params]

    # one read for all of it
    keys = list(out_max)
    gkeys = list(grad_max)
    flat = [torch.stack(out_max[k]).amax() for k in keys] + [torch.stack(grad_max[k]).amax() for k in gkeys]
    total_hist = torch.stack(hist).sum(0) if hist else torch.zeros(HIGH_EXP - LOW_EXP)
    counted = [torch.stack(grad_max[k]).amax() for k in gkeys]
    peak = torch.stack(param_rows + counted).amax().view(1) if param_rows or counted else torch.zeros(1)
    read = torch.cat([torch.stack(flat).cpu() if flat else torch.zeros(0), peak.cpu(), total_hist.cpu(),
                      torch.stack(wrows).flatten().cpu() if wrows else torch.zeros(0),
                      torch.stack([v[1] for v in outs_dtype.values()]).float().cpu() if outs_dtype else torch.zeros(0),
                      torch.stack([b for _, b in narrow_calls]).float().cpu() if narrow_calls else torch.zeros(0),
                      ]).tolist()
    vals, read = read[:len(keys) + len(gkeys)], read[len(keys) + len(gkeys):]
    for k, v in zip(keys, vals[:len(keys)]):
        modules[k].out_max = v
    for k, v in zip(gkeys, vals[len(keys):]):
        modules.setdefault(k, ModuleValues(k, "?")).grad_max = v
    grad_peak, read = read[0], read[1:]
    grad_hist, read = read[:HIGH_EXP - LOW_EXP], read[HIGH_EXP - LOW_EXP:]
    wvals, read = read[:2 * len(wrows)], read[2 * len(wrows):]
    bad_flags, call_flags = read[:len(outs_dtype)], read[len(outs_dtype):]
    first_bad_call = next((name for (name, _), bad in zip(narrow_calls, call_flags) if bad), None)
    weights = [(n, wvals[2 * i], wvals[2 * i + 1], p.numel()) for i, (n, p) in enumerate(params)]
    for (name, (narrow_outs, _)), bad in zip(outs_dtype.items(), bad_flags):
        m = modules.setdefault(name, ModuleValues(name, "?"))
        m.narrow, m.narrow_bad = any(narrow_outs), bool(bad)
    loss_value = float(loss.detach().float())
    if not math.isfinite(loss_value):
        notes.append(f"the fp32 loss is {loss_value}: the model or the batch is broken before any precision question")
    return Probe(target, device, fp32.read(), narrow_ops, modules, grad_hist, grad_peak, weights, loss_value,
                 narrow_loss_value, loss_note, time.perf_counter() - t0, notes, first_bad_call)

"""The passes behind a prediction: one forward in the target dtype (autocast, no gradients), one forward and
backward in fp32, each op recorded (:mod:`.ops`) and paired value by value with the target dtype's pass, each
module's outputs measured, the gradients the target dtype would compute watched (:mod:`.grads`), and the ranges
of the weights and buffers. Every statistic stays on the device until the pass ends, then one read per pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..numerics.engines.wrappers import named_user_modules
from .grads import GradFacts, GradWatch
from .ops import OpRecord, Recorder, floats, flush_below, magnitude, paired


@dataclass
class ModuleValues:
    name: str
    cls: str
    out_max: float = 0.0  # fp32 pass: the largest finite output magnitude
    narrow: bool = False  # the target dtype's pass: at least one floating output is in the target dtype
    narrow_bad: bool = False  # the target dtype's pass: an output went inf/nan (in any of its calls)


@dataclass
class Probe:
    target: torch.dtype
    device: str
    fp32_ops: list[OpRecord]
    narrow_ops: list[OpRecord]
    modules: dict[str, ModuleValues]  # in the order their forwards finished
    grads: GradFacts  # the fp32 backward's gradients that the target dtype would compute (:mod:`.grads`)
    weights: list[tuple[str, float, float, int]]  # parameters: (name, abs max, values flushed to zero, numel)
    buffers: list[tuple[str, float, float, int]]  # floating buffers, the same (autocast leaves them in fp32)
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

    @property
    def grad_peak(self) -> float:
        return self.grads.peak


class NarrowPassError(RuntimeError):
    """The forward under the target dtype's autocast raised (the fp32 one may still run: see precision_run)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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


def run_probe(model: nn.Module, batch: Any, target: torch.dtype, device: str) -> Probe:
    """Run both passes of ``model`` on ``batch`` (both already on ``device``) and measure them. A forward that
    raises under the target dtype's autocast raises :class:`NarrowPassError`."""
    t0 = time.perf_counter()
    names = {m: n for n, m in named_user_modules(model)}
    modules: dict[str, ModuleValues] = {}
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    notes: list[str] = []

    # 1. the target dtype: which ops compute in it, and where its forward goes non-finite
    narrow = Recorder(target, measure=False)  # (only which dtype each value is in)
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
    except Exception as e:  # noqa: BLE001 -- whatever the model raised: the caller tells the dtype from the model
        raise NarrowPassError(e) from e
    finally:
        for h in handles:
            h.remove()
    narrow_ops = narrow.read()
    narrow_loss_value = float(narrow_loss.float())

    # 2. fp32: every value's magnitude, and the gradients the target dtype would compute
    watch = GradWatch(model)
    fp32 = Recorder(target, plan=narrow_ops, weights=set(watch.params), seen=watch.seen)
    out_max: dict[str, list[torch.Tensor]] = {}

    def fp32_hook(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            with fp32.paused():
                modules.setdefault(name, ModuleValues(name, type(module).__name__))
                ts = floats(output)
                if ts:
                    with torch.no_grad():
                        out_max.setdefault(name, []).append(torch.stack([magnitude(t)[0] for t in ts]).amax())
        return hook

    handles = [m.register_forward_hook(fp32_hook(n)) for m, n in names.items()]
    try:
        for _, p in params:
            p.grad = None
        with seeded(), fp32, fp32.modules(model, names):
            output = call(model, batch)
        fp32.on = False
        watch.finish()
        loss, loss_note = loss_of(output)
        if loss.requires_grad:
            loss.backward()
        else:
            notes.append("the loss does not depend on any parameter that requires grad: no gradients measured")
    finally:
        for h in handles:
            h.remove()
    grads = watch.read()
    for _, p in params:
        p.grad = None

    # weights and buffers: abs max and values the target dtype flushes to zero
    tiny = flush_below(target)
    bufs = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    with torch.no_grad():
        wrows = [torch.stack([t.detach().abs().amax().float(), ((t.detach() != 0) & (t.detach().abs() < tiny))
                              .sum().float()]) if t.numel() else torch.zeros(2, device=t.device)
                 for _, t in params + bufs]

    # one read for all of it
    keys = list(out_max)
    read = torch.cat([torch.stack([torch.stack(out_max[k]).amax() for k in keys]).cpu() if keys else torch.zeros(0),
                      torch.stack(wrows).flatten().cpu() if wrows else torch.zeros(0),
                      torch.stack([v[1] for v in outs_dtype.values()]).float().cpu() if outs_dtype else torch.zeros(0),
                      torch.stack([b for _, b in narrow_calls]).float().cpu() if narrow_calls else torch.zeros(0),
                      ]).tolist()
    vals, read = read[:len(keys)], read[len(keys):]
    for k, v in zip(keys, vals):
        modules[k].out_max = v
    wvals, read = read[:2 * len(wrows)], read[2 * len(wrows):]
    bad_flags, call_flags = read[:len(outs_dtype)], read[len(outs_dtype):]
    first_bad_call = next((name for (name, _), bad in zip(narrow_calls, call_flags) if bad), None)
    stats = [(n, wvals[2 * i], wvals[2 * i + 1], t.numel()) for i, (n, t) in enumerate(params + bufs)]
    for (name, (narrow_outs, _)), bad in zip(outs_dtype.items(), bad_flags):
        m = modules.setdefault(name, ModuleValues(name, "?"))
        m.narrow, m.narrow_bad = any(narrow_outs), bool(bad)
    return Probe(target, device, fp32.read(), narrow_ops, modules, grads, stats[:len(params)], stats[len(params):],
                 float(loss.detach().float()), narrow_loss_value, loss_note, time.perf_counter() - t0, notes,
                 first_bad_call)

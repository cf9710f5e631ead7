"""Every op of a forward, with the module running it and what its values were.

A :class:`Recorder` is a dispatch mode: below autograd and autocast, it sees each aten op as it runs, with the
dtypes autocast chose. For each op that computes new floating values (not a view, not a cast) it keeps, on the
device, the largest magnitude among its floating inputs and outputs and how many of its output values a target
dtype would turn subnormal or flush to zero. The innermost module running the op comes from pre/post forward
hooks on every module. Nothing is read until :meth:`Recorder.read` (one host read for the pass).

Two passes of the same model on the same batch -- one in fp32, one under the target dtype's autocast -- run the
same ops in the same order (autocast's own casts are left out of both), so op ``i`` of one is op ``i`` of the
other: the fp32 pass says how large a value is, the autocast pass whether it is computed in the narrow dtype.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: ops that move or reinterpret values without computing new ones (casts, copies, views are skipped by
#: ``is_view``): leaving them out of both passes makes autocast's own casts invisible to the pairing
_SKIPPED = {"_to_copy", "to", "copy_", "clone", "detach", "alias", "lift_fresh", "empty_like", "zeros_like",
            "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "contiguous", "_unsafe_view",
            "view", "reshape", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze", "slice", "select",
            "split", "split_with_sizes", "chunk", "unbind", "as_strided", "narrow", "flatten", "unflatten",
            "_reshape_alias", "repeat", "cat", "stack", "index_select", "embedding", "gather"}
#: fields of an op's statistics row
IN_MAX, OUT_MAX, NONZERO, SUBNORMAL, FLUSHED, NONFINITE = range(6)


@dataclass(slots=True)
class OpRecord:
    name: str  # the aten op, e.g. "mm" or "addmm"
    module: str  # the innermost module running it ("" for the model's own code at the root)
    dtype: torch.dtype  # the dtype of its first floating output
    stats: list[float]  # IN_MAX, OUT_MAX, NONZERO, SUBNORMAL, FLUSHED, NONFINITE (after Recorder.read)
    ins: tuple[torch.dtype, ...] = ()  # the dtypes of its floating inputs, in order (parameters too)
    outs: tuple[torch.dtype, ...] = ()  # the dtypes of its floating outputs, in order
    where: str | None = None  # for an op of the model's own code (at the root): "file:line in function"

    def computes(self, dtype: torch.dtype) -> bool:
        """Does it compute values in ``dtype`` (one of its outputs is in it)? An fp32 output next to an fp16 one --
        the logsumexp CPU flash attention returns -- is no fp16 value."""
        return dtype in self.outs


def flush_below(dtype: torch.dtype) -> float:
    """Half the dtype's smallest subnormal: a value of smaller magnitude rounds to zero in it."""
    info = torch.finfo(dtype)
    return float(info.smallest_normal) * float(info.eps) / 2


def magnitudes(ts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The values' magnitudes (fp32, flat) and which of them are not values but sentinels: inf, nan, or the dtype's
    own largest finite value (what attention masks fill with: ``torch.finfo(dtype).min``)."""
    parts, marks = [], []
    for t in ts:
        a = t.detach().abs().flatten()
        parts.append(a.float())
        marks.append(~torch.isfinite(a) | (a >= torch.finfo(t.dtype).max))
    if len(parts) == 1:
        return parts[0], marks[0]
    return torch.cat(parts), torch.cat(marks)


def magnitude(t: torch.Tensor) -> torch.Tensor:
    """The largest magnitude among ``t``'s values that are not sentinels (see :func:`magnitudes`), a 0-d fp32 tensor,
    and whether any value is inf or nan."""
    a, sentinel = magnitudes([t])
    return (torch.where(sentinel, torch.zeros_like(a), a).amax() if a.numel() else a.sum()), sentinel.any()


def floats(obj: Any) -> list[torch.Tensor]:
    """The non-empty floating tensors in ``obj``: a tensor, or inside lists, tuples, dicts and ``ModelOutput``-like
    mappings (an op's inputs and outputs, a module's outputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() and obj.numel() else []
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in floats(x)]
    if isinstance(obj, dict) or (hasattr(obj, "values") and callable(obj.values)):
        return [t for x in obj.values() for t in floats(x)]
    return []


#: told of each op recorded: (index, module, op, where, inputs, outputs, inputs narrow, outputs narrow)
Seen = Callable[[int, str, str, "str | None", list, list, list, list], None]


class Recorder(TorchDispatchMode):
    """Record the ops of the forwards run inside it (``with recorder, recorder.modules(model): model(...)``)."""

    def __init__(self, target: torch.dtype, plan: list[OpRecord] | None = None,
                 weights: set[int] | frozenset[int] = frozenset(), measure: bool = True,
                 seen: Seen | None = None) -> None:
        """Each value is judged by its own dtype, one tensor at a time: an op's input or output is measured when it
        is in the target dtype -- in ``plan`` (the ops of a pass in the target dtype already recorded, this pass's
        op at the same place) or, without one, in this pass. An fp32 buffer an fp16 op reads (BatchNorm's
        running_var) or an fp32 output beside an fp16 one (a logsumexp) is no fp16 value. An op with no output in
        the target dtype gets a zero row (nothing there can overflow or flush in it). ``weights``: storage
        addresses of the parameters, left out of an op's inputs (the weights are checked on their own, and
        measuring the embedding at every op that reads it costs more than the op). ``measure=False``: names,
        modules and dtypes only. ``seen(index, module, op, where, ins, outs, narrow_ins, narrow_outs)`` is told of every
        op recorded (the gradient watch: :mod:`.grads`)."""
        super().__init__()
        self.plan = plan
        self.weights = weights
        self.target = target
        self.measure = measure
        self.seen = seen
        info = torch.finfo(target)
        self.normal_min = float(info.tiny)  # below it a value is subnormal in the target dtype
        self.flush_below = flush_below(target)
        self.stack: list[str] = [""]
        self.names: list[str] = []
        self.modules_of: list[str] = []
        self.dtypes: list[torch.dtype] = []
        self.in_dtypes: list[tuple[torch.dtype, ...]] = []
        self.out_dtypes: list[tuple[torch.dtype, ...]] = []
        self.wheres: list[str | None] = []
        self.rows: list[torch.Tensor | None] = []
        self.on = True

    @contextlib.contextmanager
    def modules(self, model: nn.Module, names: dict[nn.Module, str]) -> Iterator[None]:
        """Keep the stack of running modules (``names``: module -> its qualified name) while the block runs."""
        stack = self.stack

        def pop(module: nn.Module, args: object, output: object) -> None:  # (a hook's return value replaces)
            stack.pop()

        handles = []
        for module, name in names.items():
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
            handles.append(module.register_forward_hook(pop))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            del self.stack[1:]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run by the caller's own measuring (inside a hook) are not the model's."""
        on, self.on = self.on, False
        try:
            yield
        finally:
            self.on = on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.on:
            return out
        name = func.overloadpacket.__name__
        if func.is_view or name in _SKIPPED or name.endswith("_like"):
            return out
        outs = floats(out)
        if not outs:
            return out
        ins = floats(list(args) + list((kwargs or {}).values()))
        index = len(self.names)
        module = self.stack[-1]
        self.names.append(name)
        self.modules_of.append(module)
        self.dtypes.append(outs[0].dtype)
        self.in_dtypes.append(tuple(t.dtype for t in ins))
        self.out_dtypes.append(tuple(t.dtype for t in outs))
        self.wheres.append(user_line() if module == "" else None)
        narrow_ins, narrow_outs = self._narrow(index, name, ins, outs)
        if self.seen is not None:
            self.seen(index, module, name, self.wheres[-1], ins, outs, narrow_ins, narrow_outs)
        if not self.measure or not any(narrow_outs):
            self.rows.append(None)  # no value computed in the target dtype there: nothing to measure
            return out
        measured_ins = [t for t, n in zip(ins, narrow_ins) if n and t.untyped_storage().data_ptr() not in self.weights]
        self.rows.append(self._row(measured_ins, [t for t, n in zip(outs, narrow_outs) if n]))
        return out

    def _narrow(self, index: int, name: str, ins: list[torch.Tensor],
                outs: list[torch.Tensor]) -> tuple[list[bool], list[bool]]:
        """Which of the op's inputs and outputs are (or, in the plan, were) in the target dtype."""
        plan = self.plan
        if plan is None:
            return [t.dtype == self.target for t in ins], [t.dtype == self.target for t in outs]
        ref = plan[index] if index < len(plan) else None
        if ref is None or ref.name != name or len(ref.ins) != len(ins) or len(ref.outs) != len(outs):
            return [True] * len(ins), [True] * len(outs)  # the passes parted: measure it all (said by paired())
        return [d == self.target for d in ref.ins], [d == self.target for d in ref.outs]

    def _row(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> torch.Tensor:
        """The op's statistics in a few passes over its output: each magnitude put in one of five buckets -- zero,
        flushed by the target dtype, subnormal there, normal, sentinel (inf, nan, the dtype's own largest value: a
        mask) -- counted at once; the largest normal one."""
        device = outs[0].device
        zero = torch.zeros((), device=device)
        in_max = torch.stack([magnitude(t)[0] for t in ins]).amax() if ins else zero
        counts = torch.zeros(5, device=device)
        out_max = zero
        for t in outs:
            a = t.detach().abs().flatten()
            top = float(torch.finfo(t.dtype).max)
            bounds = torch.tensor([0.0, self.flush_below, self.normal_min, top * (1 - 2**-20)], device=device,
                                  dtype=a.dtype if a.dtype.itemsize >= 4 else torch.float32)
            buckets = torch.bucketize(a if a.dtype == bounds.dtype else a.float(), bounds)
            counts = counts + torch.bincount(buckets, minlength=5).float()
            out_max = torch.maximum(out_max, a.masked_fill(buckets == 4, 0).amax().float())
        return torch.stack([
            in_max,
            out_max,
            counts[1:4].sum(),  # nonzero values
            counts[1:3].sum(),  # below the smallest normal: subnormal (or flushed)
            counts[1],  # flushed to zero
            counts[4],  # sentinels
        ])

    def read(self) -> list[OpRecord]:
        """The recorded ops with their statistics (one host read; an op not measured has a row of zeros)."""
        if not self.names:
            return []
        measured = [r.to("cpu") for r in self.rows if r is not None]
        values = iter(torch.stack(measured).tolist() if measured else [])
        table = [next(values) if r is not None else [0.0] * 6 for r in self.rows]
        return [OpRecord(*row) for row in zip(self.names, self.modules_of, self.dtypes, table, self.in_dtypes,
                                              self.out_dtypes, self.wheres)]


_NOT_USER = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_STDLIB = os.path.dirname(contextlib.__file__) + os.sep


def user_line() -> str | None:
    """``file:line in function`` of the innermost frame outside torch, torchdoctor and Python's own library: the line
    of the model's code running the op (its forward, or a function it calls)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        stdlib = path.startswith(_STDLIB) and "-packages" + os.sep not in path  # (site-packages may sit inside)
        if not (path.startswith(_NOT_USER) or stdlib or path.startswith("<")):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def paired(fp32_ops: list[OpRecord], narrow_ops: list[OpRecord]) -> bool:
    """Did both passes run the same ops in the same order (then op i of one is op i of the other)?"""
    return len(fp32_ops) == len(narrow_ops) and all(
        a.name == b.name and a.module == b.module for a, b in zip(fp32_ops, narrow_ops))

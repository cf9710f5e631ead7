"""What a dtype holds, and where a frame's values leave that range: the facts the diagnosis rules
(:mod:`.diagnosis`) and their check against the frames (:mod:`.evidence`) both read.

The dtype a module *computes* in is read from its outputs (:func:`compute_dtype`): under autocast a Linear given
an fp32 input returns fp16, because it cast the input down. Every test below compares a frame's finite values
with that dtype's maximum.
"""

from __future__ import annotations

import math

import torch

from ..record.frames import BWD, Line, ResolvedFrame


def shown(value: float | None) -> str:
    """A number as the frames print it (so that a diagnosis quotes exactly what the report shows)."""
    if value is None:
        return "?"
    return f"{value:.2e}" if math.isfinite(value) else str(value)


def dtype_max(dtype: torch.dtype | None) -> float | None:
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        return None
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    return float(torch.finfo(dtype).max)


def dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def compute_dtype(frame: ResolvedFrame) -> torch.dtype | None:
    """The dtype ``frame``'s module computes in, as its outputs show: the narrowest floating output dtype. Under
    autocast a Linear given an fp32 input returns fp16, because it cast the input down and computed in fp16."""
    best = None
    for ln in frame.lines:
        top = dtype_max(ln.dtype) if ln.label.startswith("output") and not ln.param else None
        if top is not None and (best is None or top < best[0]):
            best = (top, ln.dtype)
    return best[1] if best else None


def narrower(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    """The narrower (smaller max) of two floating dtypes; either may be None."""
    ma, mb = dtype_max(a), dtype_max(b)
    if ma is None:
        return b if mb is not None else None
    return b if mb is not None and mb < ma else a


def square_overflow(frame: ResolvedFrame) -> tuple[Line, float, torch.dtype] | None:
    """A finite input of ``frame`` large enough that its square overflows the dtype the module computes in."""
    computed = compute_dtype(frame)
    for line in frame.lines:
        if not (line.label.startswith("input") and line.finite and line.abs_max is not None):
            continue
        dtype = narrower(line.dtype, computed)
        top = dtype_max(dtype)
        if top and line.abs_max >= math.sqrt(top):
            return line, math.sqrt(top), dtype
    return None


def product_overflow(frame: ResolvedFrame) -> tuple[Line, Line, torch.dtype] | None:
    """A finite input and a weight of ``frame`` whose largest values multiply beyond the range of the dtype the
    module computes in: a Linear's products can overflow to inf, and a sum of infs of both signs is nan."""
    computed = compute_dtype(frame)
    inputs = [ln for ln in frame.lines if ln.label.startswith("input") and not ln.param and ln.finite
              and ln.abs_max is not None and ln.dtype is not None and ln.dtype.is_floating_point]
    weights = [ln for ln in frame.lines if ln.param and ln.finite and ln.abs_max is not None]
    if not inputs or not weights:
        return None
    x = max(inputs, key=lambda ln: ln.abs_max)
    w = max(weights, key=lambda ln: ln.abs_max)
    dtype = narrower(x.dtype, computed)
    top = dtype_max(dtype)
    return (x, w, dtype) if top is not None and x.abs_max * w.abs_max > top else None


def out_of_range_input(frame: ResolvedFrame) -> tuple[Line, torch.dtype] | None:
    """A finite input of ``frame`` above the range of the dtype the module computes in: it became inf as the
    module (autocast, or an explicit cast) brought it down to that dtype."""
    computed = compute_dtype(frame)
    top = dtype_max(computed)
    if top is None:
        return None
    for line in frame.lines:
        if line.label.startswith("input") and not line.param and line.finite and line.abs_max is not None \
                and line.abs_max > top:
            return line, computed
    return None


def near_max(
    frames: list[ResolvedFrame], upto: int, with_params: bool = True
) -> tuple[ResolvedFrame, Line, float] | None:
    """The largest finite value relative to its dtype's max in frames[:upto+1] (forward only)."""
    best = None
    for f in frames[: upto + 1]:
        if f.phase == BWD:
            continue
        for line in f.lines:
            if line.param and not with_params:
                continue
            top = dtype_max(line.dtype)
            if top is None or line.abs_max is None or not math.isfinite(line.abs_max):
                continue
            ratio = line.abs_max / top
            if best is None or ratio > best[2]:
                best = (f, line, ratio)
    return best

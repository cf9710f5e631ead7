"""Causes read in the forward, each with its own text and fix: a weight already non-finite, a finite value above
the range of the dtype its consumer computes in (a boundary overflow), a product of finite values beyond the dtype
(a product overflow); and which low-precision advice a step may be given (:func:`or_bf16`)."""

from __future__ import annotations

import math

import torch

from ..record.frames import Line, ResolvedFrame
from . import causes
from .causes import divergence, narrow_range, step_dtypes
from .diagnosis_types import Diagnosis, Evidence, Setup, common_region, keep_fp32_fix
from .inputs import producer
from .ranges import dtype_max, dtype_name, shown
from .render import who


def low_precision_words(frames: list[ResolvedFrame], step: int) -> tuple[bool, bool]:
    """(fp16's range involved, the step computes in bf16): which advice applies."""
    dtypes = step_dtypes(frames, step)
    return any(narrow_range(d) for d in dtypes), torch.bfloat16 in dtypes


def or_bf16(frames: list[ResolvedFrame], step: int) -> str:
    """", or train in bf16" -- never to a run that already computes in bf16."""
    _, bf16 = low_precision_words(frames, step)
    return "" if bf16 else ", or train in bf16"


def bad_weight(frames: list[ResolvedFrame], index: int, line: Line, trail: list[tuple[int, float]] | None,
                setup: Setup, judged: bool = True) -> Diagnosis:
    """``judged=False``: the weight was measured as the report was built, which may be after an update that
    followed the forward being judged (no optimizer given, or ``mon.step()`` called after ``optimizer.step()``)."""
    frame = frames[index]
    line = line if line.param else next(ln for ln in frame.lines if ln.param and not ln.finite)
    what = "nan" if math.isnan(line.abs_max) else "inf"
    grew = divergence(frames, index, trail)
    weight = f"{frame.name}.{line.label}" if frame.name else f"{line.label} of {who(frame.name, frame.cls)}"
    text = f"the weight {weight} is already {what} before this forward"
    if not judged:
        when = ("With no optimizer given to the monitor, weights are measured only as a report is built" if not
                setup.optimizer else "This step was checked at mon.step() after optimizer.step() had applied its "
                "update (with manual steps the check runs at mon.step(), not in front of the optimizer), and the "
                "weights were measured then")
        text = (f"{who(frame.name, frame.cls)} {line.label} is {what} now and its output went {what} in this forward. "
                f"{when}, so the monitor cannot tell which came first: the weight was already {what} (loaded that way, "
                f"or an earlier update wrote it), or the optimizer applied a non-finite update after this forward")
    elif setup.always_before and setup.optimizer_note:
        checked = "the optimizer stepped" if not setup.manual else "optimizer.step(), at mon.step()"
        text += (f": no update from non-finite gradients was applied (each step was checked before {checked}), and "
                 f"{setup.optimizer_note}: the optimizer's own update made it")
        fix_note = ("keep the weights and the optimizer's state in fp32 and compute in fp16 under autocast (Lightning: "
                    "precision='16-mixed'), train in bf16 where the device has it (precision='bf16-true'), or give the "
                    "optimizer an eps fp16 holds (eps=1e-4)")
        return Diagnosis(causes.BAD_WEIGHT, text + ".", fix=fix_note, evidence=(Evidence.of(frame, line),))
    elif setup.always_before:
        # the gradients of every update were checked before it was applied: a non-finite one was never applied
        checked = "the optimizer stepped" if not setup.manual else "optimizer.step(), at mon.step()"
        text += (f": no update from non-finite gradients was applied (each step was checked before {checked}), so "
                 "an update from finite gradients made it (a learning rate or an optimizer state that overflowed), or "
                 "code outside the optimizer wrote it (load_state_dict, an in-place edit, another optimizer)")
    else:
        text += ": it was loaded that way or an earlier optimizer update wrote it"
    text += (f" ({grew}: the run diverged)" if grew else "") + "."
    if not setup.optimizer:
        text += (" Check the checkpoint, and give torchdoctor the optimizer (NumericsMonitor(model, optimizer=opt)) "
                 "so a non-finite update is stopped before it is applied"
                 + (" (with manual steps, also call mon.step() before optimizer.step(): the check runs there)."
                    if setup.manual else "."))
    elif not setup.always_before:
        text += (" Check the checkpoint, and call mon.step() before optimizer.step() in every step: the optimizer is "
                 "given, but with manual steps the step is checked at mon.step(), which "
                 + ("in this step" if not setup.before_update else "in an earlier step")
                 + " came after the update, so a non-finite update is applied before it is seen.")
    fix = causes.DIVERGENCE_FIX if grew else (
        "check the checkpoint (torch.isfinite on every tensor of its state dict) and whatever writes the weights "
        "between steps")
    return Diagnosis(causes.BAD_WEIGHT, text, fix=fix, evidence=(Evidence.of(frame, line),))


def boundary_overflow(frames: list[ResolvedFrame], index: int, line: Line, big: Line,
                       computed: torch.dtype, setup: Setup) -> Diagnosis:
    """A finite value above the range of the dtype its consumer computes in, entering that consumer. When its
    producer is kept in fp32 by ``keep_fp32`` (:attr:`Setup.kept_fp32`), the fix extends that region -- the
    consumer as well, or the parent of both -- and says the existing guard stays: the producer's own output does not
    fit the narrow dtype either, so moving the guard from it to the consumer would bring its overflow back."""
    frame = frames[index]
    made = producer(frames, index, big)
    top = dtype_max(computed)
    source = (f"{who(made.name, made.cls)} made it in {dtype_name(big.dtype)}" if made is not None
              else f"it came in {dtype_name(big.dtype)} from outside any watched module")
    consumer = frame.name or "the model"
    kept = setup.region_of(made.name) if made is not None and frame.name else None
    if kept is not None and setup.region_of(frame.name) is not None:
        kept = None  # (the consumer is kept too: it does not compute in the narrow dtype; not this case)
    text = (
        f"{who(frame.name, frame.cls)} was given {big.label} with abs max {shown(big.abs_max)} ({source}), above "
        f"{dtype_name(computed)}'s max {top:.2e}, and it computes in {dtype_name(computed)} (its output's dtype: "
        f"autocast or a cast brings its input down to it), so the value overflowed at that boundary and its "
        f"{line.label} is {'nan' if math.isnan(line.abs_max) else 'inf'}. "
    )
    region, fix = frame.name or None, None
    low = dtype_name(computed)
    if kept is not None:
        where = who(made.name, made.cls) if kept == made.name else f"{who(made.name, made.cls)}, inside {kept},"
        text += (f"{where} computes in {dtype_name(big.dtype)} because keep_fp32 keeps {kept} in fp32, and its output "
                 f"does not fit {low}: ")
        parent = common_region(kept, frame.name)
        if parent and kept.count(".") == frame.name.count(".") == parent.count(".") + 1:  # siblings: their parent
            region = parent
            text += (f"extend the fp32 region to {parent}, which holds both {kept} and {frame.name} (the guard "
                     f"already on {kept} may stay), or cast down only where the value fits {low} (normalise or scale "
                     "it first).")
            outside = tuple(k for k in setup.kept_fp32 if k != parent and not k.startswith(parent + "."))
            fix = (f"{keep_fp32_fix(parent, outside)}: it holds both {kept!r} (kept in fp32 now) and {frame.name!r}, "
                   f"and the guard already on {kept!r} may stay")
        else:
            text += (f"extend the fp32 region to {frame.name} as well, keeping the guard on {kept} (moved from {kept} "
                     f"to {frame.name}, the guard would let {kept} overflow {low} itself), or cast down only where the "
                     f"value fits {low} (normalise or scale it first).")
            fix = keep_fp32_fix(frame.name, (kept, *(k for k in setup.kept_fp32 if k != kept)),
                                f"without the one on {kept!r}, {kept} overflows {low} itself")
    else:
        text += (
            f"Extend the fp32 region to include {consumer}"
            + (f" ({made.name or 'the model'} computes in {dtype_name(big.dtype)}, kept in fp32 or upcast, and its "
               f"output does not fit {low})" if made is not None else "")
            + f", or cast down only where the value fits {low} (normalise or scale it first)."
        )
    evidence = (Evidence.of(frame, big), Evidence.of(frame, line))
    if made is not None:
        made_line = next((ln for ln in made.lines if ln.ref == big.ref and ln.label.startswith("output")), None)
        if made_line is not None:
            evidence = (Evidence.of(made, made_line), *evidence)
    return Diagnosis(causes.BOUNDARY_OVERFLOW, text, region, fix=fix, evidence=evidence)


def product_overflow_cause(frames: list[ResolvedFrame], index: int, line: Line, x: Line, w: Line,
                      dtype: torch.dtype) -> Diagnosis:
    frame = frames[index]
    top = dtype_max(dtype)
    text = (
        f"{who(frame.name, frame.cls)} produced nan from finite values whose products overflow: its {x.label} "
        f"reaches {shown(x.abs_max)} and its {w.label} {shown(w.abs_max)}, and their product is above "
        f"{dtype_name(dtype)}'s max {top:.2e}, so products overflow to inf and a sum of infs of both signs is nan."
    )
    evidence = (Evidence.of(frame, x), Evidence.of(frame, w), Evidence.of(frame, line))
    if narrow_range(dtype):
        return Diagnosis(causes.LOW_PRECISION_OVERFLOW,
                         f"{text} Keep {frame.name or 'the model'} in fp32{or_bf16(frames, frame.step)}.",
                         frame.name or None, evidence=evidence)
    return Diagnosis(causes.RANGE_OVERFLOW, f"{text} A weight this large is not a precision problem: look in the "
                     "frames above for how it grew (a learning rate too high, no clipping).",
                     fix=causes.DIVERGENCE_FIX, evidence=evidence)

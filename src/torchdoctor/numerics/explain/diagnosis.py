"""Why a value went non-finite: the diagnosis rules over a report's resolved frames.

:func:`diagnose` is given the frames of a bad step (earlier steps as context) and the first non-finite line, and
returns one :class:`Diagnosis`: a stable cause id (:data:`.causes.CAUSES`), the why, the fix, and the *evidence*
(the frame lines the text cites, with the numbers it states), so that every claim of a diagnosis can be checked
against the frames it was built from (:mod:`.evidence`). The rules, in the order they are tried:

- a non-finite *weight*: the parameters were already broken (a bad checkpoint or an earlier update);
- a non-finite value the *model was given* (any positional or keyword input, labels included, in any
  micro-batch): the data is broken; a non-finite input that no watched module produced while everything the
  model was given was finite: plain code between modules made it;
- values growing by orders of magnitude over the last steps (:mod:`.causes`): the run diverges;
- finite model outputs and the first bad value in the model's own loss (named ``loss``, or its only / first output
  when a scalar), a mark after the forward or where the loss's gradient enters the model: the loss made it, or a
  value the loss is given besides the model's outputs (targets, masks) was already bad (:mod:`.causes`);
- in the backward: a gradient overflow (fp16), bf16's rounding, or an op's undefined derivative (fp32);
- a finite input above the range of the dtype its module computes in (an fp32 value entering an fp16-autocast
  Linear, after ``keep_fp32`` of the module before it): an overflow of that boundary, whose fix extends the region
  already kept in fp32 (:attr:`Setup.kept_fp32`) -- never moves it;
- a value that sat within 2x of its dtype's maximum just before an inf: an overflow of that dtype;
- a nan from a finite input whose square overflows the dtype its module computes in, or from an input and a
  weight whose product does; else an invalid operation.

fp16 / keep_fp32 / loss-scale advice is given only when a dtype with fp16's range is involved, and "train in
bf16" only to a run that does not already compute in bf16.
"""

from __future__ import annotations

import math
import re

import torch

from ..record.frames import BWD, FWD, MARK, Line, ResolvedFrame
from . import causes
from .backward_causes import backward_cause
from .causes import divergence, narrow_range
from .diagnosis_types import Diagnosis, Evidence, Setup, common_region, keep_fp32_fix, keep_fp32_fixes
from .forward_causes import bad_weight, boundary_overflow, or_bf16, product_overflow_cause
from .inputs import ModelInput, input_name, marked_input, model_input, producer, root_of_call
from .ranges import (
    dtype_max,
    dtype_name,
    near_max,
    out_of_range_input,
    product_overflow,
    shown,
    square_overflow,
)
from .render import who

__all__ = ["HEADROOM_FACTOR", "Diagnosis", "Evidence", "Setup", "common_region", "diagnose", "keep_fp32_fix",
           "keep_fp32_fixes"]

# "within 2x of the dtype's maximum" -- the guide's example: 6.27e4 against fp16's 6.55e4.
HEADROOM_FACTOR = 2.0


def _data(frames: list[ResolvedFrame], index: int, got: ModelInput, consumer_line: Line) -> Diagnosis:
    frame = frames[index]
    line = got.line
    kind = "nan" if math.isnan(line.abs_max) else "inf"
    name = input_name(line.label)
    where = f"step {got.frame.step}" + (f", micro-batch {got.micro_batch}" if got.micro_batch is not None else "")
    model = who(got.frame.name, got.frame.cls) if got.frame.root else (
        f"the model (read as {who(got.frame.name, got.frame.cls)}, the first module of its call, received it)")
    text = f"{name} ({line.label}), given to {model} in {where}, is already {kind}"
    if frame.phase == MARK:
        text += f" (you marked it {frame.name!r} before the call)"
    elif got.frame is not frame:
        text += f"; {who(frame.name, frame.cls)} is the first module whose output it made non-finite"
    text += ": check the data (or whatever feeds the model); the model did not make it."
    if kind == "inf":
        text += (" (An additive attention mask holds -inf where it masks, and a fully masked row makes a softmax "
                 "nan: if this is such a mask, check that no row is masked entirely; any other inf is bad data.)")
    path = [a or b for a, b in re.findall(r"\[([^\]]*)\]|\.(\w+)", line.label[len("input"):])]
    keyword = bool(path) and not path[0].isdigit()
    if keyword:  # batch['labels'], batch['batch']['ids']
        tensor, tag = "batch" + "".join(f"[{p!r}]" for p in path), name
    else:  # the first positional input, or an item of it: x, x[0]
        tensor, tag = "x" + "".join(f"[{p}]" for p in path[1:]), name.replace("positional ", "")
    fix = (
        f"find the bad records in the data loader: assert torch.isfinite({tensor}).all() where batches are made "
        "(missing values read as nan, a division by a zero std in normalisation, a corrupt record), or "
        f"torchdoctor.mark({tensor}, {tag!r}) just before the model is called, so that the monitor checks every batch "
        "there"
    )
    evidence = (Evidence.of(got.frame, line),)
    if got.frame is not frame:
        evidence += (Evidence.of(frame, consumer_line),)
    return Diagnosis(causes.BAD_INPUT, text, fix=fix, evidence=evidence)


def _between_modules(frames: list[ResolvedFrame], index: int, bad: Line) -> Diagnosis:
    frame = frames[index]
    kind = "nan" if math.isnan(bad.abs_max) else "inf"
    parent_name = frame.name.rpartition(".")[0] if frame.name else None
    parent = next((f for f in frames if f.step == frame.step and f.phase == FWD and parent_name is not None
                   and f.name == parent_name), None)
    inside = who(parent.name, parent.cls) if parent is not None else "the code that calls it"
    given = ("every input the model was given in this call was finite" if root_of_call(frames, index) is not None
             else "the model's forward raised before its own inputs were recorded, and other modules ran before it")
    text = (
        f"{who(frame.name, frame.cls)} received {'a nan' if kind == 'nan' else 'an inf'} {bad.label} that no watched "
        f"module produced, while {given}: plain code between modules (in the forward of {inside}, before it calls "
        f"{frame.name or 'the model'}) computed it."
    )
    fix = (f"put torchdoctor.mark(tensor, 'label') after the suspect lines of the forward of {inside} before it calls "
           f"{frame.name or 'the model'}: the first marked value that is {kind} is the line that made it")
    return Diagnosis(causes.BETWEEN_MODULES, text, fix=fix, evidence=(Evidence.of(frame, bad),))


def diagnose(
    frames: list[ResolvedFrame], index: int, line: Line, judge_params: bool = True,
    trail: list[tuple[int, float]] | None = None, setup: Setup | None = None,
) -> Diagnosis:
    """Why the first non-finite ``line`` of ``frames[index]`` went bad. ``trail``: (step, largest finite
    value) of the last healthy steps (:class:`.causes.GrowthTrail`), the evidence of a diverging run.
    ``setup``: the optimizer given or not, when the step was checked against its update, the modules kept in fp32
    (what the advice may assume; :class:`Setup`)."""
    setup = setup or Setup()
    frame = frames[index]
    what = "nan" if math.isnan(line.abs_max) else "inf"
    weight_bad = frame.phase != BWD and (line.param or any(ln.param and not ln.finite for ln in frame.lines))
    if judge_params and weight_bad:
        return bad_weight(frames, index, line, trail, setup)
    if frame.phase not in (BWD, MARK):
        bad_input = next(
            (ln for ln in frame.lines if ln.label.startswith("input") and not ln.finite and not ln.param), None
        )
        if bad_input is not None and producer(frames, index, bad_input) is None:
            got = model_input(frames, index, bad_input)
            if got is not None:
                return _data(frames, index, got, line)
            return _between_modules(frames, index, bad_input)
    elif frame.phase == MARK:
        got = marked_input(frames, index, line)
        if got is not None:  # a batch marked before the model was given it
            return _data(frames, index, got, line)
    if weight_bad:  # measured only now (no hooked optimizer): maybe after an update that followed this forward
        return bad_weight(frames, index, line, trail, setup, judged=False)
    grew = divergence(frames, index, trail)
    if grew is not None:
        return Diagnosis(
            causes.DIVERGENCE,
            f"the run is diverging: {grew}. {who(frame.name, frame.cls)} {line.label} then became "
            f"{what}. Values growing by orders of magnitude step after step are an optimisation problem (a learning "
            "rate too high for this model, no gradient clipping, no warm-up), not a precision one: higher "
            "precision only delays the overflow.",
            fix=causes.DIVERGENCE_FIX, evidence=(Evidence.of(frame, line),),
        )
    own = causes.model_loss(frame, line)
    if own is not None:
        said, quoted = own
        return Diagnosis(causes.MODEL_LOSS, f"{said}.", fix="check the labels and masks of this batch: " + (
            "labels all -100 (ignore_index) give nan; labels outside [0, vocab) or a division by a mask's sum that "
            "is 0 do too; a squared error of a target beyond sqrt(dtype max) overflows"),
            evidence=(Evidence.of(frame, line), *(Evidence.of(frame, ln) for ln in quoted)))
    loss = causes.loss_outside(frames, index, line)
    if loss is not None:
        if not loss.low_precision:
            return Diagnosis(causes.LOSS_OUTSIDE_MODEL, f"{loss.text}: {loss.verdict}.",
                             fix=loss.fix, evidence=(Evidence.of(frame, line),))
        scaled = ("the loss scale multiplied the gradient past fp16's range where it enters that output (the loss "
                  "scaler in use skips such a step and lowers its scale; if every step overflows, no scale fits: "
                  "compute the model's last layer in fp32" + or_bf16(frames, frame.step) + ")" if setup.scaler else
                  "the gradient overflowed there as it was cast to the output's dtype: compute the model's last layer "
                  "in fp32" + or_bf16(frames, frame.step))
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{loss.text}. The model's output is {dtype_name(_out_dtype(frames, index))}: either the loss made the "
            f"{what} (check the targets / labels and masks it is given, and its log/div/sqrt inputs) or {scaled}.",
            evidence=(Evidence.of(frame, line),),
        )
    if frame.phase == BWD:
        return backward_cause(frames, index, line, what, setup)
    if frame.phase == MARK:
        return Diagnosis(
            causes.MARKED_VALUE,
            f"the value marked {frame.name!r} is {what}. Look at the code that computes it (between the "
            "frames above and this mark), or add marks before it to narrow it down.",
            evidence=(Evidence.of(frame, line),),
        )
    boundary = out_of_range_input(frame)
    if boundary is not None:
        return boundary_overflow(frames, index, line, *boundary, setup)
    near = near_max(frames, index, judge_params)
    if what == "inf" and near is not None and near[2] >= 1 / HEADROOM_FACTOR and near[0].phase != MARK:
        nf, nl, ratio = near
        top = dtype_max(nl.dtype)
        region = common_region(nf.name, frame.name)
        fix_target = region or nf.name or None
        reached = (
            f"{who(nf.name, nf.cls)} {nl.label} reached {shown(nl.abs_max)}, within {1 / ratio:.2f}x of "
            f"{dtype_name(nl.dtype)}'s max {top:.2e}, and {who(frame.name, frame.cls)} then overflowed to inf."
        )
        evidence = (Evidence.of(nf, nl), Evidence.of(frame, line))
        if narrow_range(nl.dtype):
            return Diagnosis(
                causes.LOW_PRECISION_OVERFLOW,
                f"{reached} Keep {fix_target or 'that region'} in fp32 (autocast off, inputs upcast)"
                f"{or_bf16(frames, frame.step)}.",
                fix_target, evidence=evidence,
            )
        return Diagnosis(causes.RANGE_OVERFLOW, f"{reached} {_BEYOND_FP32}", evidence=evidence)
    if what == "nan":
        big = square_overflow(frame)
        if big is not None:
            big_line, root, dtype = big
            text = (
                f"{who(frame.name, frame.cls)} produced nan from a finite {big_line.label} whose abs max "
                f"{shown(big_line.abs_max)} is above sqrt({dtype_name(dtype)} max) = {root:.2e}: squaring it "
                "(the variance of a norm, a dot product) overflows to inf, and inf/inf or inf-inf is nan."
            )
            evidence = (Evidence.of(frame, big_line), Evidence.of(frame, line))
            if narrow_range(dtype):
                return Diagnosis(
                    causes.SQUARE_OVERFLOW,
                    f"{text} Keep {frame.name or 'the model'} in fp32, and look in the frames above for why the "
                    "activations grew so large.",
                    frame.name or None, evidence=evidence,
                )
            return Diagnosis(
                causes.SQUARE_OVERFLOW,
                f"{text} In {dtype_name(dtype)} a value this large is not a precision problem: look in the "
                "frames above for why the activations grew so large (a learning rate too high, no clipping).",
                fix=causes.DIVERGENCE_FIX, evidence=evidence,
            )
        product = product_overflow(frame)
        if product is not None:
            return product_overflow_cause(frames, index, line, *product)
        return Diagnosis(
            causes.INVALID_OP,
            f"{who(frame.name, frame.cls)} produced nan from finite inputs: an invalid operation (0/0, inf-inf, "
            f"log or sqrt of a negative number, a softmax over a fully masked row) inside its forward.",
            evidence=(Evidence.of(frame, line),),
        )
    dtype = line.dtype
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex) and not narrow_range(dtype):
        # fp32's range (bf16 included): more precision cannot hold a bigger number
        return Diagnosis(
            causes.RANGE_OVERFLOW,
            f"{who(frame.name, frame.cls)} {line.label} overflowed to inf in {dtype_name(dtype)} with no value near "
            f"the limit in the frames shown: an operation whose result exceeds even fp32's range (exp of a large "
            f"input, an unnormalised sum or product). {_BEYOND_FP32}",
            evidence=(Evidence.of(frame, line),),
        )
    return Diagnosis(
        causes.LOW_PRECISION_OVERFLOW,
        f"{who(frame.name, frame.cls)} {line.label} overflowed to inf in {dtype_name(dtype)} with no value near "
        f"the limit in the frames shown: a single large product. Keep {frame.name or 'the model'} in fp32"
        f"{or_bf16(frames, frame.step)}.",
        frame.name or None, evidence=(Evidence.of(frame, line),),
    )


_BEYOND_FP32 = (
    "Higher precision will not help: look at that operation and the magnitudes it is given (clamp, rescale, or use "
    "a log-space formulation)."
)


def _out_dtype(frames: list[ResolvedFrame], index: int) -> torch.dtype | None:
    return next((ln.dtype for ln in frames[index].lines if ln.dtype is not None), None)

"""The report built when a non-finite value is found: where it started, the frames before it, why.

The report is data first (:class:`NonFiniteReport`, :meth:`NonFiniteReport.to_json`) and text second
(:meth:`NonFiniteReport.text`). The diagnosis is a small set of rules over the resolved frames:

- a non-finite *weight*: the parameters were already broken (a bad checkpoint or an earlier update);
- a non-finite model *input*: the data is broken;
- values growing by orders of magnitude over the last steps (:mod:`.causes`): the run diverges (learning
  rate, clipping, warm-up), whatever the dtype;
- finite model outputs and the first bad value in a mark after the forward or where the loss's gradient
  enters the model: the loss made it (:mod:`.causes`);
- a value that sat within 2x of its dtype's maximum in the frames just before an inf: an overflow of a
  low-precision dtype; keep the region that holds both modules in fp32 (:func:`torchdoctor.keep_fp32`);
- a nan without an inf before it: an invalid operation (0/0, inf-inf, log or sqrt of a negative);
- a first non-finite value in the backward only: a gradient overflow (a loss scaler or bf16) when a
  low-precision dtype is involved, else the derivative of an op at a point where it has none.

fp16 / bf16 / keep_fp32 / loss-scale advice is given only when a low-precision dtype is involved. Every
rule's verdict has a stable id (``NonFiniteReport.cause``, :data:`.causes.CAUSES`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from . import causes
from .causes import divergence, low_precision
from .frames import BWD, MARK, Line, ResolvedFrame
from .render import format_frames

# "within 2x of the dtype's maximum" -- the guide's example: 6.27e4 against fp16's 6.55e4.
HEADROOM_FACTOR = 2.0


@dataclass(frozen=True)
class FirstNonFinite:
    """Where the first non-finite value appeared."""

    step: int
    phase: str
    module: str
    cls: str
    slot: str
    value: str  # "inf" or "nan"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step", "phase", "module", "cls", "slot", "value")}


@dataclass
class NonFiniteReport:
    step: int
    first: FirstNonFinite | None
    frames: list[ResolvedFrame]
    diagnosis: str
    fix: str | None = None
    rank: int | None = None
    bad_ranks: list[int] = field(default_factory=list)
    marker: Line | None = None
    notes: list[str] = field(default_factory=list)
    fp32_region: str | None = None  # the module to keep in fp32, when that is the fix
    position: int = 0  # where the first bad frame sits in its step (ranks compare it)
    boundary: bool = False  # that frame is a compiled region's edge
    cause: str | None = None  # the diagnosis' stable id (causes.CAUSES)

    def text(self) -> str:
        tag = f"[rank{self.rank}] " if self.rank is not None else ""
        # the answer first (where, why, what to do), then the evidence: the frames, then the notes
        out = []
        if self.first is not None:
            f = self.first
            out.append(
                f"Detected {f.value} at step {f.step} ({'backward' if f.phase == BWD else 'forward'}) "
                f"in {f.module} ({f.cls}), slot {f.slot}"
            )
        elif self.bad_ranks:
            out.append(f"Stopped at step {self.step}: rank(s) {self.bad_ranks} found non-finite values;")
            out.append("this rank's values were finite. See the report file of the rank(s) named.")
        else:
            out.append(f"Detected a non-finite value at step {self.step}")
        out.append(f"Diagnosis: {self.diagnosis}")
        if self.fix:
            out.append(f"Fix: {self.fix}")
        if self.first is not None:
            out.append(f"Last {len(self.frames)} frames, in execution order:")
            out.extend(format_frames(self.frames, self.marker))
        out.extend(self.notes)
        return "\n".join(tag + line for line in out)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "bad_ranks": self.bad_ranks,
            "first": self.first.to_json() if self.first else None,
            "cause": self.cause,
            "diagnosis": self.diagnosis,
            "fix": self.fix,
            "fp32_region": self.fp32_region,
            "notes": self.notes,
            "frames": [f.to_json() for f in self.frames],
        }

    def write(self, report_dir: str | os.PathLike, basename: str = "torchdoctor-nonfinite") -> list[str]:
        """Write ``<basename>-rank<r>.txt`` and ``.json`` and flush them to disk; return the paths."""
        os.makedirs(report_dir, exist_ok=True)
        stem = os.path.join(os.fspath(report_dir), f"{basename}-rank{self.rank or 0}")
        paths = []
        contents = {stem + ".txt": self.text() + "\n", stem + ".json": json.dumps(self.to_json(), indent=1)}
        for path, content in contents.items():
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
            paths.append(path)
        return paths


def find_first_bad(
    frames: list[ResolvedFrame], start: int = 0, judge_inputs: bool = True, judge_params: bool = True
) -> tuple[int, Line] | None:
    """The first non-finite line in execution order, from ``frames[start]`` on (earlier frames are context).

    With ``judge_inputs=False`` a non-finite *input* does not count by itself (an additive ``-inf``
    attention mask is a legitimate input); the module output it spoils does. With
    ``judge_params=False`` weights measured now do not count: without a hooked optimizer they may
    have been updated since the forward that is being judged.

    Parameter gradients (``grad:weight``) measured when the report is built hold the whole
    backward's sum (a tied weight collects gradients from later modules too): they count only when no
    value measured at its own time is non-finite. (Those measured as the parameter received them, in
    the backward, carry a ``ref`` and are timely.)
    """
    for timely in (True, False):
        for i in range(start, len(frames)):
            for line in frames[i].lines:
                late = line.label.startswith("grad:") and line.ref is None
                if line.finite or not line.judged or (timely and late) or (line.param and not judge_params):
                    continue
                if judge_inputs or not line.label.startswith("input"):
                    return i, line
    return None


def _square_overflow(frame: ResolvedFrame) -> tuple[Line, float] | None:
    """A finite input of ``frame`` large enough that its square overflows its dtype, if any."""
    for line in frame.lines:
        top = _dtype_max(line.dtype)
        if line.label.startswith("input") and top and line.finite and line.abs_max is not None:
            root = math.sqrt(top)
            if line.abs_max >= root:
                return line, root
    return None


def _produced_earlier(frames: list[ResolvedFrame], index: int, line: Line) -> bool:
    """Was this very tensor an output of an earlier frame of the same step?"""
    step = frames[index].step
    return line.ref is not None and any(
        ln.ref == line.ref and ln.label.startswith("output")
        for f in frames[:index]
        if f.step == step
        for ln in f.lines
    )


def _dtype_max(dtype: torch.dtype | None) -> float | None:
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        return None
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    return float(torch.finfo(dtype).max)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def common_region(a: str, b: str) -> str:
    """The innermost module that contains both qualified names ('' is the root)."""
    pa, pb = a.split("."), b.split(".")
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _near_max(
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
            top = _dtype_max(line.dtype)
            if top is None or line.abs_max is None or not math.isfinite(line.abs_max):
                continue
            ratio = line.abs_max / top
            if best is None or ratio > best[2]:
                best = (f, line, ratio)
    return best


def backward_consumer(frames: list[ResolvedFrame], index: int) -> ResolvedFrame | None:
    """The module whose backward produced the gradient measured at ``frames[index]``.

    A bwd frame measures the gradient w.r.t. a forward output of module P. That gradient is what the
    backward of P's *consumer* returned: the first later forward frame of the same step that took
    the very same tensor as an input (pass-through modules, whose output is that tensor too, are
    skipped). None when the tensor reached its consumer through a view or a plain function.
    """
    bad = frames[index]
    ref = bad.source_ref
    if ref is None:
        return None
    for f in frames:
        if f.step != bad.step or f.phase == BWD:
            continue
        takes = any(ln.ref == ref and ln.label.startswith("input") for ln in f.lines)
        passes = any(ln.ref == ref and ln.label.startswith("output") for ln in f.lines)
        if takes and not passes:
            return f
    return None


@dataclass(frozen=True)
class Diagnosis:
    """One rule's verdict: its stable id (:data:`.causes.CAUSES`), the why, the module to keep in fp32 (when
    that is the fix) and the fix itself when it is not ``keep_fp32``."""

    cause: str
    text: str
    region: str | None = None
    fix: str | None = None


def diagnose(
    frames: list[ResolvedFrame], index: int, line: Line, judge_params: bool = True,
    trail: list[tuple[int, float]] | None = None,
) -> Diagnosis:
    """Why the first non-finite ``line`` of ``frames[index]`` went bad. ``trail``: (step, largest finite
    value) of the last healthy steps (:class:`.causes.GrowthTrail`), the evidence of a diverging run."""
    frame = frames[index]
    what = "nan" if math.isnan(line.abs_max) else "inf"
    if judge_params and frame.phase != BWD and (line.param or any(ln.param and not ln.finite for ln in frame.lines)):
        line = line if line.param else next(ln for ln in frame.lines if ln.param and not ln.finite)
        what = "nan" if math.isnan(line.abs_max) else "inf"
        grew = divergence(frames, index, trail)
        return Diagnosis(
            causes.BAD_WEIGHT,
            f"the weight {frame.name}.{line.label} is already {what} before this forward: it was loaded "
            f"that way or an earlier optimizer update wrote it"
            + (f" ({grew}: the run diverged)" if grew else "") + ". Check the checkpoint, and give torchdoctor the "
            "optimizer (NumericsMonitor(model, optimizer=opt)) so a non-finite update is stopped before it "
            "is applied.",
            fix=causes.DIVERGENCE_FIX if grew else None,
        )
    if frame.phase not in (BWD, MARK):
        bad_input = next(
            (ln for ln in frame.lines if ln.label.startswith("input") and not ln.finite and not ln.param), None
        )
        if bad_input is not None and not _produced_earlier(frames, index, bad_input):
            kind = "nan" if math.isnan(bad_input.abs_max) else "inf"
            mask = "" if kind == "nan" else " (an additive -inf attention mask is expected; any other inf is not)"
            if frame.first_of_step:
                return Diagnosis(
                    causes.BAD_INPUT,
                    f"the input {bad_input.label} given to {frame.name or 'the model'} ({frame.cls}) is already "
                    f"{kind}{mask}: check the data (or whatever feeds the model).",
                    fix="check the batch before the model sees it: assert torch.isfinite(x).all() in the data "
                    "pipeline, and look for missing values, divisions by a zero std in normalisation, or bad records",
                )
            return Diagnosis(
                causes.BETWEEN_MODULES,
                f"{frame.name} ({frame.cls}) received a {kind} {bad_input.label}{mask} that no watched module "
                "produced: it was computed by plain code between modules. Put mon.mark(tensor, 'label') after the "
                "suspect lines to find it.",
            )
    grew = divergence(frames, index, trail)
    if grew is not None:
        return Diagnosis(
            causes.DIVERGENCE,
            f"the run is diverging: {grew}. {frame.name or 'the model'} ({frame.cls}) {line.label} then became "
            f"{what}. Values growing by orders of magnitude step after step are an optimisation problem (a learning "
            "rate too high for this model, no gradient clipping, no warm-up), not a precision one: higher "
            "precision only delays the overflow.",
            fix=causes.DIVERGENCE_FIX,
        )
    own = causes.model_loss(frame, line)
    if own is not None:
        return Diagnosis(causes.MODEL_LOSS, f"{own}.", fix="check the labels and masks of this batch: " + (
            "labels all -100 (ignore_index) give nan; labels outside [0, vocab) or a division by a mask's sum that "
            "is 0 do too"))
    loss = causes.loss_outside(frames, index, line)
    if loss is not None:
        if not loss.low_precision:
            return Diagnosis(causes.LOSS_OUTSIDE_MODEL, f"{loss.text}: the loss made it, not the model.",
                             fix=loss.fix)
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{loss.text}. The model's output is {_dtype_name(_out_dtype(frames, index))}: either the loss made the "
            f"{what} (check log/div/sqrt inputs, labels, masks) or the scaled gradient overflowed there: scale "
            "the loss (torch.amp.GradScaler) or train in bf16.",
        )
    lowp_step = causes.step_involves_low_precision(frames, frame.step)
    if frame.phase == BWD:
        consumer = None if line.label.startswith("grad:") else backward_consumer(frames, index)
        lowp = low_precision(line.dtype) or lowp_step
        if consumer is not None:
            where = (
                f"the forward was finite; in the backward the gradient was finite at the output of "
                f"{consumer.name} ({consumer.cls}) and became {what} at its input "
                f"({frame.name}.{line.label[5:]}): the blow-up starts in the backward of {consumer.name}."
            )
            if lowp:
                return Diagnosis(
                    causes.BACKWARD_OVERFLOW,
                    f"{where} In fp16 scale the loss (torch.amp.GradScaler) or train in bf16; if it persists keep "
                    f"{consumer.name} in fp32.",
                    consumer.name,
                )
            return Diagnosis(causes.BACKWARD_NONFINITE, f"{where} {_FP32_BACKWARD.format(name=consumer.name)}")
        if line.label.startswith("grad:"):
            where = f"the gradient of {frame.name}.{line.label[5:]}"
        else:
            where = f"the gradient flowing into {frame.name} ({frame.cls}) from its {line.label[5:] or 'output'}"
        if lowp:
            return Diagnosis(
                causes.BACKWARD_OVERFLOW,
                f"the forward was finite; {where} became {what} in the backward. In fp16 this is a gradient "
                f"overflow: scale the loss (torch.amp.GradScaler, DeepSpeed dynamic loss scaling) or train in bf16; "
                f"if it persists, keep {frame.name or 'the module'} in fp32.",
                frame.name or None,
            )
        return Diagnosis(
            causes.BACKWARD_NONFINITE,
            f"the forward was finite; {where} became {what} in the backward. "
            + _FP32_BACKWARD.format(name=frame.name or "the module"),
        )
    if frame.phase == MARK:
        return Diagnosis(
            causes.MARKED_VALUE,
            f"the value marked {frame.name!r} is {what}. Look at the code that computes it (between the "
            "frames above and this mark), or add marks before it to narrow it down.",
        )
    near = _near_max(frames, index, judge_params)
    if what == "inf" and near is not None and near[2] >= 1 / HEADROOM_FACTOR and near[0].phase != MARK:
        nf, nl, ratio = near
        top = _dtype_max(nl.dtype)
        region = common_region(nf.name, frame.name)
        fix_target = region or nf.name or None
        reached = (
            f"{nf.name} ({nf.cls}) {nl.label} reached {nl.abs_max:.2e}, within {1 / ratio:.2f}x of "
            f"{_dtype_name(nl.dtype)}'s max {top:.2e}, and {frame.name} ({frame.cls}) then overflowed to inf."
        )
        if low_precision(nl.dtype):
            return Diagnosis(
                causes.LOW_PRECISION_OVERFLOW,
                f"{reached} Keep {fix_target or 'that region'} in fp32 (autocast off, inputs upcast), or train in "
                "bf16.",
                fix_target,
            )
        return Diagnosis(causes.RANGE_OVERFLOW, f"{reached} {_BEYOND_FP32}")
    if what == "nan":
        big = _square_overflow(frame)
        if big is not None:
            big_line, root = big
            text = (
                f"{frame.name} ({frame.cls}) produced nan from a finite {big_line.label} whose abs max "
                f"{big_line.abs_max:.2e} is above sqrt({_dtype_name(big_line.dtype)} max) = {root:.2e}: squaring it "
                "(the variance of a norm, a dot product) overflows to inf, and inf/inf or inf-inf is nan."
            )
            if low_precision(big_line.dtype):
                return Diagnosis(
                    causes.SQUARE_OVERFLOW,
                    f"{text} Keep {frame.name} in fp32, and look in the frames above for why the activations grew "
                    "so large.",
                    frame.name or None,
                )
            return Diagnosis(
                causes.SQUARE_OVERFLOW,
                f"{text} In {_dtype_name(big_line.dtype)} a value this large is not a precision problem: look in the "
                "frames above for why the activations grew so large (a learning rate too high, no clipping).",
                fix=causes.DIVERGENCE_FIX,
            )
        return Diagnosis(
            causes.INVALID_OP,
            f"{frame.name} ({frame.cls}) produced nan from finite inputs: an invalid operation (0/0, inf-inf, "
            f"log or sqrt of a negative number, a softmax over a fully masked row) inside its forward.",
        )
    dtype = line.dtype
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex) and _dtype_max(dtype) > 1e38:
        # fp32's range (bf16 included): more precision cannot hold a bigger number
        return Diagnosis(
            causes.RANGE_OVERFLOW,
            f"{frame.name} ({frame.cls}) {line.label} overflowed to inf in {_dtype_name(dtype)} with no value near "
            f"the limit in the frames shown: an operation whose result exceeds even fp32's range (exp of a large "
            f"input, an unnormalised sum or product). {_BEYOND_FP32}",
        )
    return Diagnosis(
        causes.LOW_PRECISION_OVERFLOW,
        f"{frame.name} ({frame.cls}) {line.label} overflowed to inf in {_dtype_name(dtype)} with no value near "
        f"the limit in the frames shown: a single large product. Keep {frame.name} in fp32 or train in bf16.",
        frame.name or None,
    )


_FP32_BACKWARD = (
    "Every value is fp32 or wider, so this is not a small dtype's overflow and more precision will not help: it is "
    "the derivative of an operation at a point where it has none inside {name}'s backward (sqrt or norm of 0, "
    "log or pow near 0, torch.where whose unselected branch is inf/nan, a division by a value that can be 0), or a "
    "gradient beyond fp32's range (a custom backward's huge factor). grads='modules' names the module, "
    "torch.autograd.set_detect_anomaly(True) names the op."
)
_BEYOND_FP32 = (
    "Higher precision will not help: look at that operation and the magnitudes it is given (clamp, rescale, or use "
    "a log-space formulation)."
)


def _out_dtype(frames: list[ResolvedFrame], index: int) -> torch.dtype | None:
    return next((ln.dtype for ln in frames[index].lines if ln.dtype is not None), None)


def build_report(
    frames: list[ResolvedFrame],
    max_frames: int,
    rank: int | None,
    start: int = 0,
    judge_inputs: bool = True,
    judge_params: bool = True,
    trail: list[tuple[int, float]] | None = None,
) -> NonFiniteReport | None:
    """The report for the first non-finite value in ``frames[start:]`` (None when all are finite);
    the frames before ``start`` (earlier, already checked steps) are shown as context only."""
    found = find_first_bad(frames, start, judge_inputs, judge_params)
    if found is None:
        return None
    index, line = found
    frame = frames[index]
    why = diagnose(frames, index, line, judge_params, trail)
    value = "nan" if math.isnan(line.abs_max) else "inf"
    consumer = backward_consumer(frames, index) if frame.phase == BWD and not line.label.startswith("grad:") else None
    if consumer is not None:
        first = FirstNonFinite(frame.step, BWD, consumer.name, consumer.cls, "grad_input", value)
    else:
        first = FirstNonFinite(frame.step, frame.phase, frame.name, frame.cls, line.label, value)
    shown = frames[max(0, index - max_frames) : index + 1]
    return NonFiniteReport(frame.step, first, shown, why.text, why.fix or fix_keep_fp32(why.region), rank=rank,
                           marker=line, fp32_region=why.region, position=index - start, boundary=frame.boundary,
                           cause=why.cause)


def fix_keep_fp32(region: str | None) -> str | None:
    """The one-line fix for a region that should run in fp32 (None when there is none)."""
    return None if region is None else f"torchdoctor.keep_fp32(model, {region!r})"

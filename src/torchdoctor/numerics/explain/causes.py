"""Causes of a non-finite value that are not a low-precision overflow: a diverging run, a loss made outside.

Most nan/inf losses people meet are not fp16 at all: a learning rate too high for the model (weights and
activations grow by orders of magnitude over a few steps, then overflow even fp32), or a loss function that
divides by zero or takes ``log(0)`` on finite model outputs. Advice about ``keep_fp32`` / bf16 / loss scaling
sends such a user the wrong way, so :func:`~.diagnosis.diagnose` asks these rules first and gives the
low-precision advice only when a dtype with fp16's small range is involved (:func:`narrow_range`): bf16 has fp32's
range, so an overflow in bf16 is not cured by fp32, a loss scale or "train in bf16".

Every diagnosis has a stable id (:data:`CAUSES`), written to the report's JSON as ``cause``.

Seeing growth needs a few steps of history at no extra host sync: :class:`GrowthTrail` keeps, per healthy
step, the largest finite abs max of the step's judged statistics as a 0-d tensor *on the device* (computed from
the statistics the step's check stacks anyway); they are read back only when a report is built.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from ..record.frames import BWD, FWD, MARK, Line, ResolvedFrame
from .render import who

# stable diagnosis ids (NonFiniteReport.cause); DESIGN.md's table lists each with its evidence and fix
BAD_WEIGHT = "numerics.bad_weight"
BAD_INPUT = "numerics.bad_input"
BETWEEN_MODULES = "numerics.between_modules"
DIVERGENCE = "numerics.divergence"
LOSS_OUTSIDE_MODEL = "numerics.loss_outside_model"
MODEL_LOSS = "numerics.model_loss"  # the model returns a loss (HF models given labels=) and only it is bad
LOW_PRECISION_OVERFLOW = "numerics.low_precision_overflow"
SQUARE_OVERFLOW = "numerics.square_overflow"
INVALID_OP = "numerics.invalid_op"
RANGE_OVERFLOW = "numerics.range_overflow"
BACKWARD_OVERFLOW = "numerics.backward_overflow"  # a low-precision gradient overflow
BACKWARD_NONFINITE = "numerics.backward_nonfinite"  # fp32 / fp64 backward: no dtype advice
MARKED_VALUE = "numerics.marked_value"
# a finite value above the range of the dtype the next module computes in (an fp32 region's output entering an
# fp16-autocast module): it overflows as it is cast down at that boundary
BOUNDARY_OVERFLOW = "numerics.boundary_overflow"
NONFINITE_LOSS = "numerics.nonfinite_loss"  # a warning: the loss is inf, every gradient finite, the run goes on
OTHER_RANK = "numerics.other_rank"
UNKNOWN_GRADIENT = "numerics.unknown_gradient"
SCALE_COLLAPSE = "numerics.loss_scale_collapse"
# the run ended with a loss scaler that had skipped every one of its steps: no update was ever applied
SCALER_NEVER_STEPPED = "numerics.scaler_never_stepped"
# the step went bad, and replaying it on the same inputs and RNG state did not: the device or a kernel (replay.py)
TRANSIENT = "numerics.transient"
# checked at its boundaries and not replayed (an input changed in place since, a collective in the forward): the
# model's output went bad, which module made it is unknown
UNLOCALIZED = "numerics.unlocalized"
# the optimizer's update, tried on a copy before it was applied (an optimizer whose eps is 0 in its parameters'
# dtype), makes weights non-finite from finite gradients: stopped before the update (judge/update_trial.py)
OPTIMIZER_UPDATE = "numerics.optimizer_update"
CAUSES = (
    BAD_WEIGHT, OPTIMIZER_UPDATE, BAD_INPUT, BETWEEN_MODULES, DIVERGENCE, LOSS_OUTSIDE_MODEL, MODEL_LOSS,
    LOW_PRECISION_OVERFLOW, SQUARE_OVERFLOW,
    INVALID_OP, RANGE_OVERFLOW, BACKWARD_OVERFLOW, BACKWARD_NONFINITE, MARKED_VALUE, BOUNDARY_OVERFLOW,
    NONFINITE_LOSS, OTHER_RANK, UNKNOWN_GRADIENT, SCALE_COLLAPSE, SCALER_NEVER_STEPPED, TRANSIENT, UNLOCALIZED,
)

DIVERGENCE_FIX = (
    "lower the learning rate (try 10x lower), clip gradients (torch.nn.utils.clip_grad_norm_(model.parameters(), "
    "1.0) before optimizer.step()), and check the warm-up (a scheduler that starts at the peak rate)"
)
LOSS_CHECKS = (
    "check the inputs of log/div/sqrt/pow "
    "(clamp them, e.g. torch.log(x.clamp_min(1e-12)), or use the log-space forms: F.log_softmax, "
    "F.binary_cross_entropy_with_logits), the labels (out of range, ignore_index) and the masks (a division by a "
    "mask's sum that is 0)"
)

# the values a loss is given besides the model's outputs: the monitor never sees them unless they are marked
LOSS_INPUTS = (
    "the other values the loss is given: the targets / labels you pass to it, masks, weights (a nan target makes a "
    "nan loss and nan gradients from finite model outputs; assert torch.isfinite(targets).all() where batches are "
    "made, or torchdoctor.mark(targets, 'targets') before the loss so that the monitor checks them)"
)
LOSS_FIX = (
    "the model's outputs are finite, so the nan/inf comes from the loss: check " + LOSS_INPUTS + ", then the "
    "loss's own operations: " + LOSS_CHECKS
)

GROWTH_FACTOR = 1e3  # "orders of magnitude": three of them over the steps kept
GROWTH_STEPS = 8  # healthy steps kept in the trail
_LOW = (torch.float16, torch.bfloat16)


def low_precision(dtype: torch.dtype | None) -> bool:
    """fp16 / bf16 / fp8: the dtypes with fewer mantissa bits than fp32."""
    return dtype is not None and dtype.is_floating_point and (dtype in _LOW or dtype.itemsize == 1)


def narrow_range(dtype: torch.dtype | None) -> bool:
    """fp16 / fp8: a range far below fp32's, so that keep_fp32, bf16 or a loss scale can be the fix of an
    overflow. (bf16 has fp32's range: an overflow in bf16 would overflow fp32 too.)"""
    return dtype is not None and dtype.is_floating_point and torch.finfo(dtype).max < 1e38


def step_dtypes(frames: list[ResolvedFrame], step: int) -> set[torch.dtype]:
    """The dtypes the values of ``step`` (activations, gradients; not weights) lived in."""
    return {ln.dtype for f in frames if f.step == step for ln in f.lines if not ln.param and ln.dtype is not None}


class GrowthTrail:
    """The last few healthy steps' largest finite activation / gradient abs max, kept on the device."""

    def __init__(self, size: int = GROWTH_STEPS) -> None:
        self._peaks: deque[tuple[int, torch.Tensor]] = deque(maxlen=size)

    def add(self, step: int, group_peaks: dict) -> None:
        """``group_peaks``: (judged, device, dtype) -> the largest value of that group's statistics (0-d, on its
        device) of a step judged finite, so every value is. A tiny device op per group, no host sync."""
        peaks = []
        for (judged, _device, dtype), value in group_peaks.items():
            if not judged or not dtype.is_floating_point:
                continue
            peaks.append(value.float())
        if peaks:
            # groups on several devices: gather on an accelerator if there is one, without waiting (as
            # stats.all_finite does: a copy *to* the CPU would block until the device caught up)
            target = next((p.device for p in peaks if p.device.type != "cpu"), peaks[0].device)
            peak = peaks[0] if len(peaks) == 1 else torch.stack(
                [p.to(target, non_blocking=target.type != "cpu") for p in peaks]).amax()
            self._peaks.append((step, peak))

    def read(self) -> list[tuple[int, float]]:
        """(step, peak) of the steps kept, oldest first (a report is being built: syncing is fine)."""
        if not self._peaks:
            return []
        values = torch.stack([p.cpu() for _, p in self._peaks]).tolist()
        return [(s, v) for (s, _), v in zip(self._peaks, values)]

    def clear(self) -> None:
        self._peaks.clear()


def _step_peak(frames: list[ResolvedFrame], step: int) -> float | None:
    """The largest finite non-parameter abs max of ``step`` in the resolved frames."""
    vals = [
        ln.abs_max for f in frames if f.step == step for ln in f.lines
        if not ln.param and ln.judged and ln.abs_max is not None and math.isfinite(ln.abs_max)
        and ln.dtype is not None and ln.dtype.is_floating_point
    ]
    return max(vals) if vals else None


def _largest_weight(frames: list[ResolvedFrame], step: int) -> tuple[str, float] | None:
    best = None
    for f in frames:
        if f.step != step:
            continue
        for ln in f.lines:
            big = ln.param and ln.abs_max is not None and math.isfinite(ln.abs_max)
            if big and (best is None or ln.abs_max > best[1]):
                best = (f"{f.name}.{ln.label}" if f.name else ln.label, ln.abs_max)
    return best


def divergence(frames: list[ResolvedFrame], index: int, trail: list[tuple[int, float]] | None) -> str | None:
    """The evidence of a diverging run, or None: the largest finite value of the recent steps grew by
    at least :data:`GROWTH_FACTOR` from the smallest one before it, with the peak in the last two steps, over two
    steps or more and already climbing (2x) before the last one."""
    if not trail:
        return None
    step = frames[index].step
    series = [(s, v) for s, v in trail if s < step and v > 0]
    now = _step_peak(frames, step)
    if now is not None and now > 0:
        series.append((step, now))
    if len(series) < 3:
        return None
    peak_at = max(range(len(series)), key=lambda i: series[i][1])
    if peak_at < len(series) - 2:
        return None
    base_at = min(range(peak_at), key=lambda i: series[i][1]) if peak_at else None
    if base_at is None or series[peak_at][1] < GROWTH_FACTOR * series[base_at][1]:
        return None
    # a trend, not one jump: the values were already climbing before the last step (a weight written between two
    # steps, one bad batch, make a single jump -- seen as such, it is not called a diverging optimisation)
    if peak_at - base_at < 2 or series[peak_at - 1][1] < 2 * series[base_at][1]:
        return None
    (s0, v0), (s1, v1) = series[base_at], series[peak_at]
    shown = ", ".join(f"{v:.2e}" for _, v in series[base_at:])
    text = (
        f"the largest activation/gradient grew from {v0:.2e} at step {s0} to {v1:.2e} at step {s1} "
        f"({v1 / v0:.1e}x in {s1 - s0} step(s): {shown})"
    )
    weight = _largest_weight(frames, step)
    if weight is not None and weight[1] >= 1e4:
        text += f"; the weight {weight[0]} is now {weight[1]:.2e}"
    return text


def _root_outputs(frames: list[ResolvedFrame], step: int) -> tuple[set, torch.dtype | None] | None:
    """The refs of the model's own outputs in ``step`` (its last root call), and their dtype."""
    root = next((f for f in reversed(frames) if f.step == step and f.phase == FWD and f.root), None)
    if root is None:
        return None
    outs = [ln for ln in root.lines if ln.label.startswith("output") and ln.ref is not None]
    if not outs or not all(ln.finite for ln in outs):
        return None
    return {ln.ref for ln in outs}, outs[0].dtype


@dataclass(frozen=True)
class LossEvidence:
    text: str
    low_precision: bool  # the gradient at the model's output lives in fp16: a scaled gradient's overflow is possible
    fix: str = LOSS_FIX
    verdict: str = ""  # what made it, after the text: the loss's own ops or the other values it is given


def _loss_verdict(what: str) -> str:
    """The loss made it, or one of the values it is given besides the model's outputs was already bad: the monitor
    sees the model's outputs, never the targets a loss function is given (unless they are marked)."""
    return (f"either a value the loss is given besides the model's outputs (the targets / labels, a mask, weights) "
            f"was already {what}, or the loss's own computation made the {what} from those finite outputs; the model "
            "did not make it")


def module_output_grads(frames: list[ResolvedFrame], step: int, name: str) -> list[tuple[ResolvedFrame, Line]]:
    """The gradients recorded at the outputs of module ``name`` in ``step`` (module-level gradients), as (frame,
    line)."""
    return [(f, ln) for f in frames if f.step == step and f.phase == BWD and f.name == name for ln in f.lines
            if ln.label.startswith("grad_output")]


def loss_outside(frames: list[ResolvedFrame], index: int, line: Line) -> LossEvidence | None:
    """The model's forward was finite and the first bad value is where a loss outside the model begins:
    a ``mark()`` made after the model's forward, the gradient at the model's output, or (``grads='params'``)
    the parameter gradients of the module that produced the model's output."""
    frame = frames[index]
    roots = _root_outputs(frames, frame.step)
    if roots is None:
        return None
    refs, dtype = roots
    what = "nan" if math.isnan(line.abs_max) else "inf"
    lowp = narrow_range(dtype)  # the scaled gradient at an fp16 output can overflow; bf16 has fp32's range
    if frame.phase == MARK:
        after_root = any(f.step == frame.step and f.phase == FWD and f.root for f in frames[:index])
        if not after_root:
            return None
        return LossEvidence(
            f"the model's outputs were finite, and the value marked {frame.name!r} after its forward is {what}", False,
            f"if {frame.name!r} is computed from the model's outputs (a loss), the code between the model's output and "
            f"mark {frame.name!r} made the {what}: " + LOSS_CHECKS + f"; if it is a value given to the loss (targets / "
            f"labels, a mask), it came in {what}: find the bad records where batches are made (assert "
            "torch.isfinite(targets).all() there)",
            f"the code computing the marked value made it from those finite outputs (your loss, if that is what it "
            f"is), or, when the marked value is one the loss is given (targets / labels, a mask), it came in {what}; "
            "the model did not make it",
        )
    if frame.phase != BWD:
        return None
    if not line.label.startswith("grad:"):  # grads="modules": the gradient at a module's output
        if frame.source_ref in refs or (frame.root and frame.source_ref is None):
            return LossEvidence(
                f"the forward was finite (the model's outputs too) and the gradient the loss sent into the model's "
                f"output ({who(frame.name, frame.cls)} {line.label}) was already {what}", lowp,
                verdict=_loss_verdict(what),
            )
        return None
    # grads="params": the bad gradients belong to the module that made the model's output, the first the
    # backward reaches, so the gradient arriving from the loss was already non-finite -- unless the gradient at that
    # module's output was recorded (module-level gradients: the first step, a replay) and is finite: then the
    # module's own backward made it, and the loss is not to blame
    producer = next(
        (f for f in reversed(frames[:index]) if f.step == frame.step and f.phase == FWD and not f.root
         and f.name == frame.name), None,
    )
    if producer is None or not any(ln.ref in refs for ln in producer.lines if ln.label.startswith("output")):
        return None
    if module_output_grads(frames, frame.step, frame.name):
        return None
    return LossEvidence(
        f"the forward was finite (the model's outputs too), and the first gradients of the backward, those of "
        f"{who(frame.name, frame.cls)} which made the model's output, are already {what}: the gradient the loss sent "
        "into the model was not finite", lowp, verdict=_loss_verdict(what),
    )


LOSS_LABELS = ("output[loss]", "output.loss")  # the model's own loss: a dict's, a ModelOutput's, a dataclass's
_FIRST_OUTPUT = ("output", "output[0]")  # a bare tensor, or the first of a tuple: (loss,), (loss, logits)


def _scalar_like(line: Line) -> bool:
    """Every element of the value has one magnitude (abs min = abs max), as a 0-d loss has. (The statistics are
    all the monitor keeps of a value: its shape is not recorded on the step's hot path.)"""
    lo, hi = line.abs_min, line.abs_max
    if lo is None or hi is None or line.dtype is None or not (line.dtype.is_floating_point or line.dtype.is_complex):
        return False
    return lo == hi or (math.isnan(lo) and math.isnan(hi))


def is_model_loss(frame: ResolvedFrame, line: Line) -> bool:
    """Is ``line`` the loss the model returns: its ``loss`` output (a dict, a ``ModelOutput``, a dataclass), or its
    first output (a bare tensor, a tuple ``(loss,)`` or ``(loss, logits)``) when that is a scalar?"""
    if frame.phase != FWD or not frame.root or not line.label.startswith("output"):
        return False
    return line.label in LOSS_LABELS or (line.label in _FIRST_OUTPUT and _scalar_like(line))


def model_loss(frame: ResolvedFrame, line: Line) -> tuple[str, list[Line]] | None:
    """The model computes its own loss (``labels=``, or a model that returns only its loss): its loss output
    (:func:`is_model_loss`) is the first bad value -- every module it ran returned finite values -- and every
    other output is finite, so the loss computation made it. Labels that are all ``-100`` (abs min = abs max
    = 100) are named: a mean cross-entropy over no label is 0/0; so are float labels whose square overflows.
    Returns the text and the lines it quotes besides ``line``."""
    if not is_model_loss(frame, line):
        return None
    others = [ln for ln in frame.lines if ln.label.startswith("output") and ln is not line and ln.ref is not None]
    if not all(ln.finite for ln in others):
        return None
    what = "nan" if math.isnan(line.abs_max) else "inf"
    said = (f"while its other outputs ({', '.join(ln.label for ln in others[:3])}) are finite" if others
            else "as its only output, while every module it ran returned finite values")
    text = (f"{who(frame.name, frame.cls)} returned {'a nan' if what == 'nan' else 'an inf'} {line.label} {said}: "
            f"the loss computation made it")
    labels = next((ln for ln in frame.lines if ln.label in ("input[labels]", "input.labels")), None)
    if labels is not None and labels.abs_min == labels.abs_max == 100:
        text += (f". Every label of this batch is -100 (ignore_index): {labels.label} has abs min = abs max = "
                 f"{labels.abs_max:.2e}, so the mean cross-entropy is 0/0: skip such batches or check how the labels "
                 "are masked (padding, prompt masking, truncation)")
        return text, [labels]
    loss_dtype = line.dtype if line.dtype is not None and line.dtype.is_floating_point else None
    if labels is not None and loss_dtype is not None and labels.dtype is not None and labels.dtype.is_floating_point \
            and labels.finite and labels.abs_max is not None:
        root = math.sqrt(torch.finfo(loss_dtype).max)
        if labels.abs_max >= root:
            text += (f". The labels reach {labels.abs_max:.2e}, above sqrt({str(loss_dtype).removeprefix('torch.')} "
                     f"max) = {root:.2e}: a squared error of such a target overflows (a bad or unscaled target)")
            return text, [labels]
    return text, []

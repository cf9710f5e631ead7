"""The report built when a non-finite value is found: where it started, the frames before it, why.

The report is data first (:class:`NonFiniteReport`, :meth:`NonFiniteReport.to_json`) and text second
(:meth:`NonFiniteReport.text`). The diagnosis is a small set of rules over the resolved frames:

- a non-finite *weight*: the parameters were already broken (a bad checkpoint or an earlier update);
- a non-finite model *input*: the data is broken;
- a value that sat within 2x of its dtype's maximum in the frames just before an inf: an overflow of a
  low-precision dtype; keep the region that holds both modules in fp32 (:func:`torchdoctor.keep_fp32`);
- a nan without an inf before it: an invalid operation (0/0, inf-inf, log or sqrt of a negative);
- a first non-finite value in the backward only: a gradient overflow (use a loss scaler or bf16).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

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

    def text(self) -> str:
        tag = f"[rank{self.rank}] " if self.rank is not None else ""
        out = []
        if self.first is not None:
            f = self.first
            out.append(
                f"Detected {f.value} at step {f.step} ({'backward' if f.phase == BWD else 'forward'}) "
                f"in {f.module} ({f.cls}), slot {f.slot}"
            )
            out.append(f"Last {len(self.frames)} frames, in execution order:")
            out.extend(format_frames(self.frames, self.marker))
        elif self.bad_ranks:
            out.append(f"Stopped at step {self.step}: rank(s) {self.bad_ranks} found non-finite values;")
            out.append("this rank's values were finite. See the report file of the rank(s) named.")
        else:
            out.append(f"Detected a non-finite value at step {self.step}")
        out.append(f"Diagnosis: {self.diagnosis}")
        if self.fix:
            out.append(f"Fix: {self.fix}")
        out.extend(self.notes)
        return "\n".join(tag + line for line in out)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "bad_ranks": self.bad_ranks,
            "first": self.first.to_json() if self.first else None,
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


def diagnose(
    frames: list[ResolvedFrame], index: int, line: Line, judge_params: bool = True
) -> tuple[str, str | None]:
    """(diagnosis, module to keep in fp32 or None) for the first non-finite ``line`` of ``frames[index]``."""
    frame = frames[index]
    what = "nan" if math.isnan(line.abs_max) else "inf"
    if frame.phase == BWD:
        consumer = None if line.label.startswith("grad:") else backward_consumer(frames, index)
        if consumer is not None:
            return (
                f"the forward was finite; in the backward the gradient was finite at the output of "
                f"{consumer.name} ({consumer.cls}) and became {what} at its input "
                f"({frame.name}.{line.label[5:]}): the blow-up starts in the backward of {consumer.name}. "
                f"In fp16 scale the loss (torch.amp.GradScaler) or train in bf16; if it persists keep "
                f"{consumer.name} in fp32.",
                consumer.name,
            )
        if line.label.startswith("grad:"):
            where = f"the gradient of {frame.name}.{line.label[5:]}"
        else:
            where = f"the gradient flowing into {frame.name} ({frame.cls}) from its {line.label[5:] or 'output'}"
        return (
            f"the forward was finite; {where} became {what} in the backward. In fp16 this is a gradient "
            f"overflow: scale the loss (torch.amp.GradScaler, DeepSpeed dynamic loss scaling) or train in bf16; "
            f"if it persists, keep {frame.name or 'the module'} in fp32.",
            frame.name or None,
        )
    if frame.phase == MARK:
        return (
            f"the value marked {frame.name!r} is {what}. Look at the code that computes it (between the "
            "frames above and this mark), or add marks before it to narrow it down.",
            None,
        )
    if judge_params and (line.param or any(ln.param and not ln.finite for ln in frame.lines)):
        line = line if line.param else next(ln for ln in frame.lines if ln.param and not ln.finite)
        what = "nan" if math.isnan(line.abs_max) else "inf"
        return (
            f"the weight {frame.name}.{line.label} is already {what} before this forward: it was loaded "
            f"that way or an earlier optimizer update wrote it. Check the checkpoint, and give torchdoctor the "
            f"optimizer (NumericsMonitor(model, optimizer=opt)) so a non-finite update is stopped before it "
            f"is applied.",
            None,
        )
    bad_input = next(
        (ln for ln in frame.lines if ln.label.startswith("input") and not ln.finite and not ln.param), None
    )
    if bad_input is not None and not _produced_earlier(frames, index, bad_input):
        kind = "nan" if math.isnan(bad_input.abs_max) else "inf"
        mask = "" if kind == "nan" else " (an additive -inf attention mask is expected; any other inf is not)"
        if frame.first_of_step:
            return (
                f"the input {bad_input.label} given to {frame.name or 'the model'} ({frame.cls}) is already "
                f"{kind}{mask}: check the data (or whatever feeds the model).",
                None,
            )
        return (
            f"{frame.name} ({frame.cls}) received a {kind} {bad_input.label}{mask} that no watched module "
            "produced: it was computed by plain code between modules. Put mon.mark(tensor, 'label') after the "
            "suspect lines to find it.",
            None,
        )
    near = _near_max(frames, index, judge_params)
    if what == "inf" and near is not None and near[2] >= 1 / HEADROOM_FACTOR and near[0].phase != MARK:
        nf, nl, ratio = near
        top = _dtype_max(nl.dtype)
        region = common_region(nf.name, frame.name)
        fix_target = region or nf.name or None
        return (
            f"{nf.name} ({nf.cls}) {nl.label} reached {nl.abs_max:.2e}, within {1 / ratio:.2f}x of "
            f"{_dtype_name(nl.dtype)}'s max {top:.2e}, and {frame.name} ({frame.cls}) then overflowed to inf. "
            f"Keep {fix_target or 'that region'} in fp32 (autocast off, inputs upcast), or train in bf16.",
            fix_target,
        )
    if what == "nan":
        big = _square_overflow(frame)
        if big is not None:
            big_line, root = big
            return (
                f"{frame.name} ({frame.cls}) produced nan from a finite {big_line.label} whose abs max "
                f"{big_line.abs_max:.2e} is above sqrt({_dtype_name(big_line.dtype)} max) = {root:.2e}: squaring it "
                "(the variance of a norm, a dot product) overflows to inf, and inf/inf or inf-inf is nan. "
                f"Keep {frame.name} in fp32, and look in the frames above for why the activations grew so large.",
                frame.name or None,
            )
        return (
            f"{frame.name} ({frame.cls}) produced nan from finite inputs: an invalid operation (0/0, inf-inf, "
            f"log or sqrt of a negative number, a softmax over a fully masked row) inside its forward.",
            None,
        )
    dtype = line.dtype
    if dtype is not None and (dtype.is_floating_point or dtype.is_complex) and _dtype_max(dtype) > 1e38:
        # fp32's range (bf16 included): more precision cannot hold a bigger number
        return (
            f"{frame.name} ({frame.cls}) {line.label} overflowed to inf in {_dtype_name(dtype)} with no value near "
            "the limit in the frames shown: an operation whose result exceeds even fp32's range (exp of a large "
            "input, an unnormalised sum or product). Higher precision will not help: look at that operation and "
            "the magnitudes it is given (clamp, rescale, or use a log-space formulation).",
            None,
        )
    return (
        f"{frame.name} ({frame.cls}) {line.label} overflowed to inf in {_dtype_name(dtype)} with no value near "
        f"the limit in the frames shown: a single large product. Keep {frame.name} in fp32 or train in bf16.",
        frame.name or None,
    )


def build_report(
    frames: list[ResolvedFrame],
    max_frames: int,
    rank: int | None,
    start: int = 0,
    judge_inputs: bool = True,
    judge_params: bool = True,
) -> NonFiniteReport | None:
    """The report for the first non-finite value in ``frames[start:]`` (None when all are finite);
    the frames before ``start`` (earlier, already checked steps) are shown as context only."""
    found = find_first_bad(frames, start, judge_inputs, judge_params)
    if found is None:
        return None
    index, line = found
    frame = frames[index]
    diagnosis, region = diagnose(frames, index, line, judge_params)
    value = "nan" if math.isnan(line.abs_max) else "inf"
    consumer = backward_consumer(frames, index) if frame.phase == BWD and not line.label.startswith("grad:") else None
    if consumer is not None:
        first = FirstNonFinite(frame.step, BWD, consumer.name, consumer.cls, "grad_input", value)
    else:
        first = FirstNonFinite(frame.step, frame.phase, frame.name, frame.cls, line.label, value)
    shown = frames[max(0, index - max_frames) : index + 1]
    return NonFiniteReport(frame.step, first, shown, diagnosis, fix_keep_fp32(region), rank=rank, marker=line,
                           fp32_region=region, position=index - start, boundary=frame.boundary)


def fix_keep_fp32(region: str | None) -> str | None:
    """The one-line fix for a region that should run in fp32 (None when there is none)."""
    return None if region is None else f"torchdoctor.keep_fp32(model, {region!r})"

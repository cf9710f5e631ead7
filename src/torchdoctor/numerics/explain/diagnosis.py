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
from dataclasses import dataclass, field

import torch

from ..record.frames import BWD, FWD, MARK, Line, ResolvedFrame
from . import causes
from .causes import divergence, module_output_grads, narrow_range, step_dtypes
from .consumers import code_between, consumer_of
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

# "within 2x of the dtype's maximum" -- the guide's example: 6.27e4 against fp16's 6.55e4.
HEADROOM_FACTOR = 2.0


@dataclass(frozen=True)
class Evidence:
    """One frame line a diagnosis cites: where it is (module, phase, slot) and the number and dtype it states."""

    module: str
    cls: str
    phase: str
    slot: str
    abs_max: float | None
    dtype: torch.dtype | None
    frame: ResolvedFrame | None = field(default=None, compare=False, repr=False)  # where it was read

    @classmethod
    def of(cls, frame: ResolvedFrame, line: Line) -> Evidence:
        return cls(frame.name, frame.cls, frame.phase, line.label, line.abs_max, line.dtype, frame)

    def to_json(self) -> dict:
        return {"module": self.module, "class": self.cls, "phase": self.phase, "slot": self.slot,
                "abs_max": self.abs_max if self.abs_max is None or math.isfinite(self.abs_max) else str(self.abs_max),
                "dtype": dtype_name(self.dtype) if self.dtype is not None else None}


@dataclass(frozen=True)
class Diagnosis:
    """One rule's verdict: its stable id (:data:`.causes.CAUSES`), the why, the module to keep in fp32 (when
    that is the fix), the fix itself when it is not ``keep_fp32``, and the frame lines the text cites."""

    cause: str
    text: str
    region: str | None = None
    fix: str | None = None
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class Setup:
    """What the monitor knows of the run that the advice depends on, beyond the frames.

    ``optimizer``: one was given (``NumericsMonitor(model, optimizer=opt)``). ``manual``: steps end at
    ``mon.step()`` (``manual_steps=True``, or ``mon.step()`` called), so the check runs there and not in front of
    the optimizer. ``before_update``: this step was checked before its update was applied (a hooked optimizer, or
    ``mon.step()`` called before ``optimizer.step()``), so the weights measured now are the ones its forward ran
    with; ``always_before``: every step so far was, so no update from non-finite gradients was ever applied.
    ``kept_fp32``: the modules a ``keep_fp32`` guard keeps in fp32 now (qualified names): a fix that adds a
    region adds it to those. ``via``: how the monitor was attached (``monitor``: ``NumericsMonitor(...)``; ``hf`` /
    ``lightning``: a ``NumericsCallback``; ``switch``: ``torchdoctor run --numerics``), so that advice to change an
    option is written in the form the user attached it with (:meth:`option`)."""

    optimizer: bool = False
    manual: bool = False
    before_update: bool = False
    always_before: bool = False
    kept_fp32: tuple[str, ...] = ()
    via: str = "monitor"
    # what the monitor saw of the step: its forward (a call of the model was recorded), the autocast that call ran
    # under ((device type, dtype) pairs; None: not seen), and whether a loss scaler is in play
    forward_seen: bool = True
    autocast: tuple[tuple[str, torch.dtype], ...] | None = None
    scaler: bool = False
    # the optimizer's own arithmetic cannot work in its parameters' dtype (Adam's eps=1e-8 is 0 in fp16): said as
    # seen on the optimizer, when it is so
    optimizer_note: str | None = None

    @property
    def autocast_dtypes(self) -> set[torch.dtype]:
        return {d for _, d in self.autocast or ()}

    def option(self, name: str, value: object) -> str:
        """The monitor's option ``name=value`` as the user sets it where they attached it."""
        if self.via == "switch":
            return f"torchdoctor run --numerics --{name.replace('_', '-')} {value}"
        if self.via in ("hf", "lightning"):
            return f"NumericsCallback({name}={value!r})"
        return f"NumericsMonitor(..., {name}={value!r})"

    @classmethod
    def hooked(cls, kept_fp32: tuple[str, ...] = ()) -> Setup:
        """An optimizer checked in front of its step (the default ``NumericsMonitor(model, optimizer=opt)``)."""
        return cls(True, False, True, True, kept_fp32)

    def region_of(self, name: str) -> str | None:
        """The module kept in fp32 that ``name`` is (or is inside), if any."""
        return next((k for k in self.kept_fp32 if not k or k == name or name.startswith(k + ".")), None)


def keep_fp32_fixes(regions: tuple[str, ...], kept: tuple[str, ...] = ()) -> str:
    """:func:`keep_fp32_fix` for one region or several together (``keep_fp32(model, '2')`` and
    ``keep_fp32(model, '3')``), in addition to the guards already on ``kept``."""
    if len(regions) == 1:
        return keep_fp32_fix(regions[0], kept)
    calls = " and ".join(f"torchdoctor.keep_fp32(model, {r!r})" for r in regions)
    others = [k for k in kept if k not in regions]
    if others:
        named = ", ".join(repr(k) for k in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        guards = "that guard" if len(others) == 1 else "those guards"
        calls += f", in addition to the keep_fp32 already on {named} (leave {guards} on)"
    return calls


def keep_fp32_fix(region: str, kept: tuple[str, ...] = (), why: str = "") -> str:
    """``torchdoctor.keep_fp32(model, region)``, said to be in addition to the guards already on ``kept`` (a
    second call of keep_fp32 works beside the first, as written; read as a replacement it would undo what the first
    one fixed). ``why``: the reason a guard must stay, when one is known."""
    fix = f"torchdoctor.keep_fp32(model, {region!r})"
    others = [k for k in kept if k != region]
    if others:
        named = ", ".join(repr(k) for k in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        guards = "that guard" if len(others) == 1 else "those guards"
        fix += f", in addition to the keep_fp32 already on {named} (leave {guards} on{': ' + why if why else ''})"
    return fix


def common_region(a: str, b: str) -> str:
    """The innermost module that contains both qualified names ('' is the root)."""
    pa, pb = a.split("."), b.split(".")
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


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


def _low_precision_words(frames: list[ResolvedFrame], step: int) -> tuple[bool, bool]:
    """(fp16's range involved, the step computes in bf16): which advice applies."""
    dtypes = step_dtypes(frames, step)
    return any(narrow_range(d) for d in dtypes), torch.bfloat16 in dtypes


def _or_bf16(frames: list[ResolvedFrame], step: int) -> str:
    """", or train in bf16" -- never to a run that already computes in bf16."""
    _, bf16 = _low_precision_words(frames, step)
    return "" if bf16 else ", or train in bf16"


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
    bad_weight = frame.phase != BWD and (line.param or any(ln.param and not ln.finite for ln in frame.lines))
    if judge_params and bad_weight:
        return _bad_weight(frames, index, line, trail, setup)
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
    if bad_weight:  # measured only now (no hooked optimizer): maybe after an update that followed this forward
        return _bad_weight(frames, index, line, trail, setup, judged=False)
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
                  "compute the model's last layer in fp32" + _or_bf16(frames, frame.step) + ")" if setup.scaler else
                  "the gradient overflowed there as it was cast to the output's dtype: compute the model's last layer "
                  "in fp32" + _or_bf16(frames, frame.step))
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{loss.text}. The model's output is {dtype_name(_out_dtype(frames, index))}: either the loss made the "
            f"{what} (check the targets / labels and masks it is given, and its log/div/sqrt inputs) or {scaled}.",
            evidence=(Evidence.of(frame, line),),
        )
    if frame.phase == BWD:
        return _backward(frames, index, line, what, setup)
    if frame.phase == MARK:
        return Diagnosis(
            causes.MARKED_VALUE,
            f"the value marked {frame.name!r} is {what}. Look at the code that computes it (between the "
            "frames above and this mark), or add marks before it to narrow it down.",
            evidence=(Evidence.of(frame, line),),
        )
    boundary = out_of_range_input(frame)
    if boundary is not None:
        return _boundary_overflow(frames, index, line, *boundary, setup)
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
                f"{_or_bf16(frames, frame.step)}.",
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
            return _product_overflow(frames, index, line, *product)
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
        f"{_or_bf16(frames, frame.step)}.",
        frame.name or None, evidence=(Evidence.of(frame, line),),
    )


def _bad_weight(frames: list[ResolvedFrame], index: int, line: Line, trail: list[tuple[int, float]] | None,
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


def _boundary_overflow(frames: list[ResolvedFrame], index: int, line: Line, big: Line,
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


def _product_overflow(frames: list[ResolvedFrame], index: int, line: Line, x: Line, w: Line,
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
                         f"{text} Keep {frame.name or 'the model'} in fp32{_or_bf16(frames, frame.step)}.",
                         frame.name or None, evidence=evidence)
    return Diagnosis(causes.RANGE_OVERFLOW, f"{text} A weight this large is not a precision problem: look in the "
                     "frames above for how it grew (a learning rate too high, no clipping).",
                     fix=causes.DIVERGENCE_FIX, evidence=evidence)


def _backward(frames: list[ResolvedFrame], index: int, line: Line, what: str, setup: Setup) -> Diagnosis:
    frame = frames[index]
    fp16, bf16 = _low_precision_words(frames, frame.step)
    fp16 = fp16 or narrow_range(line.dtype) or any(narrow_range(d) for d in setup.autocast_dtypes)
    bf16 = bf16 or line.dtype == torch.bfloat16 or torch.bfloat16 in setup.autocast_dtypes
    consumer = None if line.label.startswith("grad:") else consumer_of(frames, index)
    evidence = (Evidence.of(frame, line),)
    between = None if consumer is not None or line.label.startswith("grad:") else code_between(frames, index)
    seen = setup.forward_seen
    forward = "the forward was finite; " if seen else ""
    if between is not None:  # the gradient of a module's output, which no watched module took as its input
        parent, nxt = between
        where = (
            f"{forward}in the backward the gradient at the output of {who(frame.name, frame.cls)} "
            f"became {what}, and no watched module took that output as its input: plain code in the forward of "
            f"{who(parent.name, parent.cls)}, after it calls {frame.name}"
            + (f" and before {nxt.name}" if nxt is not None else "")
            + " (a torch function, an operator, a view passed on), used it, and that code's backward made the "
            f"{what}."
        )
        target = parent.name
    elif consumer is not None:
        where = (
            f"{forward}in the backward the gradient was finite at the output of "
            f"{who(consumer.name, consumer.cls)} and became {what} at its input "
            f"({frame.name + '.' if frame.name else ''}{line.label[5:]}): the blow-up starts in the backward of "
            f"{consumer.name or 'the model'}."
        )
        target = consumer.name
    else:
        own = module_output_grads(frames, frame.step, frame.name) if line.label.startswith("grad:") else []
        finite_in = [(f, ln) for f, ln in own if ln.finite and ln.abs_max is not None]
        if line.label.startswith("grad:"):
            where = f"the gradient of {f'{frame.name}.' if frame.name else ''}{line.label[5:]}"
        else:
            where = f"the gradient flowing into {who(frame.name, frame.cls)} from its {line.label[5:] or 'output'}"
        where = f"{forward}{where} became {what} in the backward."
        if finite_in:  # the gradient at the module's output was recorded, finite: its own backward made it
            f_in, ln_in = finite_in[-1]
            where += (f" The gradient at the output of {who(frame.name, frame.cls)} was finite ({ln_in.label} "
                      f"{shown(ln_in.abs_max)}), so {frame.name or 'the model'}'s own backward made it: the product "
                      "of that gradient and the module's input (the weight gradient's matmul) left the range.")
            evidence = (Evidence.of(f_in, ln_in), *evidence)
        target = frame.name
    keep = target or "the model"
    if not seen and not setup.autocast_dtypes and not fp16 and not bf16:
        return Diagnosis(
            causes.BACKWARD_NONFINITE,
            f"{where} The monitor did not see this step's forward (it attached after it began), so which dtype the "
            "step computed in, and whether its activations were finite, is not known: the report of the next bad "
            "step, seen from its start, says which.",
            target or None, evidence=evidence,
        )
    if fp16:
        scale = (" The loss scaler in use skips such a step and lowers its scale; if steps keep overflowing, the "
                 "values are too large for fp16 at any scale." if setup.scaler else
                 " A loss scale (torch.amp.GradScaler) would skip such steps and lower its scale: that helps only "
                 "while the gradients fit fp16 at some scale.")
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{where} In fp16 this is a gradient overflow: keep {keep} in fp32{'' if bf16 else ', or train in bf16'}."
            + scale,
            target or None, evidence=evidence,
        )
    if bf16:
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{where} The step computes in bf16, whose range is fp32's, so a loss scale will not help and neither "
            f"would fp32's range; bf16 keeps 8 bits of mantissa, so a difference of nearly equal values can round "
            f"to 0 before a division or a log: keep {keep} in fp32 to test that. If it stays {what} in fp32, it is "
            f"the derivative of an operation at a point where it has none ("
            + ("" if consumer is not None else f"{setup.option('grads', 'modules')} names the module, ")
            + "torch.autograd.set_detect_anomaly(True) names the op).",
            target or None, evidence=evidence,
        )
    named = consumer is not None or not line.label.startswith("grad:")  # a module's gradient, not a parameter's
    text = _FP32_BACKWARD.format(name=keep, option="torch.autograd.set_detect_anomaly(True) names the op" if named
                                 else f"{setup.option('grads', 'modules')} names the module, "
                                      "torch.autograd.set_detect_anomaly(True) the op")
    return Diagnosis(causes.BACKWARD_NONFINITE, f"{where} {text}", evidence=evidence)


_FP32_BACKWARD = (
    "Every value seen is fp32 or wider, with no autocast, so this is not a small dtype's overflow and more precision "
    "will not help: it is "
    "the derivative of an operation at a point where it has none inside {name}'s backward (sqrt or norm of 0, "
    "log or pow near 0, torch.where whose unselected branch is inf/nan, a division by a value that can be 0), or a "
    "gradient beyond fp32's range (a custom backward's huge factor). {option}."
)
_BEYOND_FP32 = (
    "Higher precision will not help: look at that operation and the magnitudes it is given (clamp, rescale, or use "
    "a log-space formulation)."
)


def _out_dtype(frames: list[ResolvedFrame], index: int) -> torch.dtype | None:
    return next((ln.dtype for ln in frames[index].lines if ln.dtype is not None), None)

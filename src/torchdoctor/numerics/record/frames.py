"""Frames: what the monitor saw, in execution order, without the numbers.

A *frame* is one module call in one phase (``fwd``, ``bwd``) or one ``mark``: the module's qualified
name and class plus its *slots* (``weight``, ``input[0]``, ``output``, ``grad_output[0]``,
``grad:weight``). During a step only the host-side description is kept here; the numbers stay on the
device in a :class:`~torchdoctor.numerics.windows.StatBuffer` and are joined with the frames only when a
report or a trace is built (:mod:`torchdoctor.numerics.render`).

Parameters and parameter gradients do not change between the forward and ``optimizer.step()``, so
their slots are not measured during the step: :func:`resolve` measures them when a report is built.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..measure.slots import NOT_A_TENSOR
from ..measure.stats import ELSEWHERE, abs_min_max, has_inf, local_part, shard_skip_reason
from ..measure.windows import StatBuffer, StatRef, lookup

FWD, BWD, MARK = "fwd", "bwd", "mark"
UPDATE = "update"  # (a report's first non-finite value made by the optimizer's update, tried on a copy)
_LOSS_MODULE = torch.nn.modules.loss._Loss  # the base of torch's loss modules


@dataclass(slots=True, eq=False)
class ModuleInfo:
    """Static facts about one monitored module (one per module, not per call)."""

    name: str
    cls: str
    module: weakref.ref
    is_root: bool = False
    boundary: bool = False  # the edge of a compiled region: measured eagerly around code the hooks cannot see
    at_once: bool = False  # its outputs were seen changed in place before their window was reduced: measure at once


# A *slot* is one labelled value of a frame, a plain tuple read by the indices below:
#   label    "input[0]", "output[1]", "weight", "grad:weight", ...
#   key, entry, buffer
#            where its statistics are, the three parts of a StatRef (``s[KEY:BUFFER + 1]``, see slot_ref), when it
#            was measured on device; all None otherwise
#   kind     what the value was when not measured: "None", "not a tensor", "empty", "meta", ...
#   dtype    its dtype (a tensor)
#   inf_ref  compat mode: "also holds an inf" (abs max alone says only nan)
#   scope    what the statistics cover when not the whole tensor ("local shard")
#   param    a direct parameter measured while the module ran (ZeRO-3 gathers it only then)
#   judged   may it stop the run? (inputs, and in compat mode what transformers never sees, not)
#   nan_ref  compat mode, complex: "also holds a nan" (|inf + nan j| is inf)
# Flat, and neither a dataclass nor a named tuple: one is made per labelled value on the hot path (~450 per T5 step
# at "params", ~650 at "modules") and lives through the step. The garbage collector stops tracking a plain tuple
# whose values are all untracked (strings, numbers, None, dtypes, the group keys, which are interned), but it walks
# a collection parent first, so a tuple holding a fresh tuple (a StatRef) stays tracked past its first collection
# and is promoted with the step's other survivors; promotions are what trigger full collections of the whole heap
# (issue 12, benchmarks/numerics_gc.py: on the tiny T5 every ~170-330 steps with nested refs, every ~400-1000 flat;
# ~180-200 ms each).
Slot = tuple
LABEL, KEY, ENTRY, BUFFER, KIND, DTYPE, INF_REF, SCOPE, PARAM, JUDGED, NAN_REF = range(11)
_NO_REF = (None, None, None)


def make_slot(label: str, ref: StatRef | None = None, kind: str | None = None, dtype: torch.dtype | None = None,
              inf_ref: StatRef | None = None, scope: str | None = None, param: bool = False, judged: bool = True,
              nan_ref: StatRef | None = None) -> Slot:
    """A slot (the tuple above)."""
    return (label, *(ref or _NO_REF), kind, dtype, inf_ref, scope, param, judged, nan_ref)


def slot_ref(s: Slot) -> StatRef | None:
    """Where the slot's statistics are, or None when it was not measured on device."""
    return None if s[KEY] is None else s[KEY:BUFFER + 1]


def relabelled(s: Slot, label: str, judged: bool | None = None) -> Slot:
    """The same measured value under another label (an output passed on as the next module's input, a tied
    weight under each module's name), judged or not as asked."""
    return (label, *s[KEY:JUDGED], s[JUDGED] if judged is None else judged, s[NAN_REF])


@dataclass(slots=True, eq=False)
class Frame:
    """One module call in one phase. ``with_params``/``with_param_grads`` ask :func:`resolve` to add
    the module's direct parameters (or their gradients) when the report is built; ``weights`` holds
    them instead once the step is over (measured before the update, so a later report shows the
    weights this frame ran with)."""

    step: int
    phase: str
    info: ModuleInfo
    slots: list[Slot]
    with_params: bool = False
    with_param_grads: bool = False
    first_of_step: bool = False
    source_ref: StatRef | None = None  # bwd: the forward output whose gradient this frame measures
    weights: list[Slot] | None = None  # the direct parameters as measured when the step ended


@dataclass(slots=True)
class Line:
    """A slot with its numbers: what a report prints."""

    label: str
    abs_min: float | None = None
    abs_max: float | None = None
    kind: str | None = None
    dtype: torch.dtype | None = None
    param: bool = False  # a direct parameter of the module (its value, not its gradient)
    ref: StatRef | None = None  # identity of the measured tensor within its step
    has_inf: bool | None = None  # known only in compat mode and for tensors measured at report time
    scope: str | None = None  # "local shard": the statistics cover this rank's part of the tensor
    judged: bool = True
    has_nan: bool | None = None  # complex values only (abs max says nan for a real tensor)

    @property
    def finite(self) -> bool:
        return self.abs_max is None or math.isfinite(self.abs_max)


@dataclass(slots=True)
class ResolvedFrame:
    step: int
    phase: str
    name: str
    cls: str
    lines: list[Line] = field(default_factory=list)
    first_of_step: bool = False
    source_ref: StatRef | None = None
    boundary: bool = False  # a compiled region's edge (what is inside was not recorded)
    root: bool = False  # the model itself (its outputs are what a loss outside the model is given)
    loss_module: bool = False  # one of torch's loss modules (nn.MSELoss, nn.CrossEntropyLoss...): its output is a loss

    @property
    def finite(self) -> bool:
        return all(line.finite for line in self.lines)

    def first_bad_line(self) -> Line | None:
        return next((line for line in self.lines if not line.finite), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "phase": self.phase,
            "module": self.name,
            "class": self.cls,
            "slots": [
                {
                    "slot": line.label,
                    "abs_min": _json_float(line.abs_min),
                    "abs_max": _json_float(line.abs_max),
                    "kind": line.kind,
                    "dtype": str(line.dtype).removeprefix("torch.") if line.dtype is not None else None,
                    **({"scope": line.scope} if line.scope else {}),
                }
                for line in self.lines
            ],
        }


def _json_float(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return str(v)  # "inf", "-inf", "nan": JSON has no literals for them


def measure(buffer: StatBuffer, label: str, value: Any, judged: bool = True, param: bool = False,
            at_once: bool = False) -> Slot:
    """Describe ``value`` as a slot, putting its statistics in ``buffer`` when it is a tensor."""
    if isinstance(value, torch.Tensor):
        value, scope = local_part(value)
        reason = shard_skip_reason(value, scope)
        if reason is not None:
            scope = None if reason == ELSEWHERE else scope
            return (label, None, None, None, reason, value.dtype, None, scope, param, judged, None)
        key, entry, buffer_id = buffer.add(value, judged, at_once)
        return (label, key, entry, buffer_id, None, value.dtype, None, scope, param, judged, None)
    if value is None:
        return (label, None, None, None, "None", None, None, None, False, judged, None)
    return (label, None, None, None, NOT_A_TENSOR, None, None, None, False, judged, None)


def measure_now(label: str, t: torch.Tensor | None, param: bool = False) -> Line:
    """Host-side statistics of a tensor that still exists (parameters, gradients): report path only."""
    if t is None:
        return Line(label, kind="None")
    t, scope = local_part(t)
    if t.layout is torch.sparse_coo:  # sparse gradients (nn.Embedding(sparse=True)): their values
        t = t.coalesce().values()
    reason = shard_skip_reason(t, scope)
    scope = None if reason == ELSEWHERE else scope
    if reason is not None:
        return Line(label, kind=reason, dtype=t.dtype, param=param, scope=scope)
    mn, mx = abs_min_max(t)
    nan = torch.isnan(t).any() if t.dtype.is_complex else torch.zeros((), dtype=torch.bool, device=t.device)
    values = torch.stack([mn.double(), mx.double(), has_inf(t).double(), nan.double()]).cpu().tolist()
    has_nan = bool(values[3]) if t.dtype.is_complex else None
    return Line(label, values[0], values[1], dtype=t.dtype, param=param, has_inf=bool(values[2]), scope=scope,
                has_nan=has_nan)


CHANGED_IN_PLACE = "measured after an in-place change"  # the value was changed before its window was reduced


def _line(s: Slot, values: dict) -> Line:
    label, key, entry, buffer_id, kind, dtype, inf_ref, scope, param, judged, nan_ref = s
    if key is None:
        return Line(label, kind=kind, dtype=dtype, param=param, scope=scope, judged=judged)
    if values.lost and (key, entry) in values.lost:
        return Line(label, kind="freed", dtype=dtype, param=param, scope=scope, judged=judged)
    ref = (key, entry, buffer_id)
    mn, mx = lookup(values, ref)
    if values.changed and (key, entry) in values.changed:  # not what the module returned: context
        scope, judged = (f"{scope}, {CHANGED_IN_PLACE}" if scope else CHANGED_IN_PLACE), False
    has_inf = bool(lookup(values, inf_ref)[0]) if inf_ref is not None else None
    has_nan = bool(lookup(values, nan_ref)[0]) if nan_ref is not None else None
    return Line(label, mn, mx, dtype=dtype, param=param, ref=ref, has_inf=has_inf, scope=scope, judged=judged,
                has_nan=has_nan)


def resolve(frames: list[Frame], values: dict, weight_values: dict | None = None) -> list[ResolvedFrame]:
    """Join frames with host-read statistics (``weight_values``: the step's weights measured as it
    ended); measure the parameters not measured then, and the gradients, now."""
    out: list[ResolvedFrame] = []
    for f in frames:
        module = f.info.module()
        rf = ResolvedFrame(
            f.step, f.phase, f.info.name, f.info.cls, first_of_step=f.first_of_step, source_ref=f.source_ref,
            boundary=f.info.boundary, root=f.info.is_root, loss_module=isinstance(module, _LOSS_MODULE),
        )
        if f.weights is not None:
            rf.lines.extend(_line(s, weight_values) for s in f.weights)
        elif f.with_params and module is not None:
            for pname, p in module.named_parameters(recurse=False):
                rf.lines.append(measure_now(pname, p, param=True))
        rf.lines.extend(_line(s, values) for s in f.slots)
        if f.with_param_grads and module is not None:
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    rf.lines.append(measure_now(f"grad:{pname}", p.grad))
        out.append(rf)
    return out

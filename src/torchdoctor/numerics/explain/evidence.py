"""Checking a diagnosis against the frames it was built from.

A diagnosis is a claim about the report's own frames: "X (Linear) output reached 6.27e+04, within 1.04x of
float16's max 6.55e+04". A rule that picks the wrong frame, quotes a number the frames do not show, or explains a
value by a cause the frames rule out (an "invalid operation from finite inputs" while an input is above the range
its module computes in) sends the user the wrong way. :func:`contradictions` lists every such disagreement of a
:class:`~.report.NonFiniteReport`; the test of each rule asserts it finds none. It reads only the report (its
frames, the lines the diagnosis cites, its text), never the monitor.
"""

from __future__ import annotations

import math
import re

import torch

from ..record.frames import BWD, MARK, Line, ResolvedFrame
from . import causes
from .causes import low_precision, narrow_range
from .ranges import compute_dtype, dtype_max, product_overflow, shown
from .render import who
from .report import NonFiniteReport

_NUMBER = re.compile(r"(?<![\w.])\d\.\d\de[+-]\d\d")
_DTYPE = re.compile(r"\b(float16|bfloat16|float32|float64|float8_\w+)\b")
_DTYPE_MAX = re.compile(r"\b(float16|bfloat16|float32|float64)'s max (\d\.\d\de[+-]\d\d)")
_SQRT_MAX = re.compile(r"sqrt\((float16|bfloat16|float32|float64) max\) = (\d\.\d\de[+-]\d\d)")
# words that send a user to low-precision fixes
_LOW_PRECISION_ADVICE = ("keep_fp32", "GradScaler", "train in bf16")
# rules whose text quotes numbers that are not frame values (the growth trail of recent steps)
_TRAIL_NUMBERS = (causes.DIVERGENCE, causes.BAD_WEIGHT)


def _lines(frames: list[ResolvedFrame], module: str, phase: str, slot: str) -> list[Line]:
    return [ln for f in frames if f.name == module and f.phase == phase for ln in f.lines if ln.label == slot]


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b


def _dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def contradictions(report: NonFiniteReport) -> list[str]:
    """Every way the report's diagnosis disagrees with its own frames (empty: it holds)."""
    out: list[str] = []
    text = report.diagnosis
    said = f"{text}\n{report.fix or ''}"
    frames = [*report.frames, *report.cited]
    # 1. each cited line is in the report, with the number and dtype the diagnosis read
    for e in report.evidence:
        found = _lines(frames, e.module, e.phase, e.slot)
        if not any(_same(ln.abs_max, e.abs_max) and ln.dtype == e.dtype for ln in found):
            out.append(f"cited {e.module or e.cls} {e.phase} {e.slot} = {shown(e.abs_max)} ({e.dtype}) is not in "
                       f"the report's frames (there: {[(shown(ln.abs_max), ln.dtype) for ln in found]})")
        # ... and the text names it: its module, and the number when it is finite
        name = repr(e.module) if e.cls == "mark" else who(e.module, e.cls)
        if not _named(e, text):
            out.append(f"the diagnosis cites {name} without naming it")
        if e.abs_max is not None and math.isfinite(e.abs_max) and shown(e.abs_max) not in text:
            out.append(f"the diagnosis cites {name} {e.slot} without its value {shown(e.abs_max)}")
    # 2. every number the text states is a cited value or a dtype's limit (or the growth trail's)
    if report.cause not in _TRAIL_NUMBERS:
        known = {shown(e.abs_max) for e in report.evidence}
        for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            top = torch.finfo(d).max
            known |= {f"{top:.2e}", f"{math.sqrt(top):.2e}"}
        for number in _NUMBER.findall(text):
            if number not in known:
                out.append(f"the diagnosis states {number}, which no cited line shows")
    for name, value in _DTYPE_MAX.findall(text):
        if f"{torch.finfo(_dtype_of(name)).max:.2e}" != value:
            out.append(f"{name}'s max is not {value}")
    for name, value in _SQRT_MAX.findall(text):
        if f"{math.sqrt(torch.finfo(_dtype_of(name)).max):.2e}" != value:
            out.append(f"sqrt({name} max) is not {value}")
    # 3. every dtype the text names is one a cited line (or the module it is in) holds or computes in
    cited_dtypes = {e.dtype for e in report.evidence} | {
        compute_dtype(e.frame) for e in report.evidence if e.frame is not None}
    for name in set(_DTYPE.findall(text)):
        if _dtype_of(name) not in cited_dtypes:
            out.append(f"the diagnosis names {name}, which no cited value is in")
    # 4. the root is never an empty name
    if "  (" in report.text() or text.startswith("(") or " in  " in report.text():
        out.append("a module is named by an empty name")
    out += _rule_invariants(report, said)
    return out


def _named(e, text: str) -> bool:  # noqa: ANN001 - an Evidence
    """Does the text name the cited line's module: as the sentences name modules (``3 (Linear)``, ``BertModel
    (the model)``, a mark by its quoted name), or by the qualified name of the weight or gradient it is?"""
    if e.cls == "mark":
        return repr(e.module) in text
    if who(e.module, e.cls) in text:
        return True
    own = e.slot[len("grad:"):] if e.slot.startswith("grad:") else e.slot[len("grad_"):] \
        if e.slot.startswith("grad_") else e.slot
    return bool(e.module) and f"{e.module}.{own}" in text


def _step_dtypes(report: NonFiniteReport) -> set[torch.dtype]:
    """The dtypes of the step's values the report shows, and the autocast dtype the monitor saw it run under."""
    seen = {ln.dtype for f in report.frames if f.step == report.step for ln in f.lines
            if not ln.param and ln.dtype is not None}
    autocast = (report.observed or {}).get("autocast") or ""
    return seen | {_dtype_of(name) for name in _DTYPE.findall(autocast)}


def _rule_invariants(report: NonFiniteReport, said: str) -> list[str]:
    """What each rule's own evidence must make true of the frames."""
    out: list[str] = []
    cause = report.cause
    last = report.frames[-1] if report.frames else None
    dtypes = _step_dtypes(report)
    if not any(low_precision(d) for d in dtypes):
        out += [f"low-precision advice {w!r} for a step with no low-precision value"
                for w in _LOW_PRECISION_ADVICE if w in said]
    if torch.bfloat16 in dtypes and not any(narrow_range(d) for d in dtypes) and "train in bf16" in said:
        out.append("'train in bf16' told to a run that computes in bf16")
    if last is not None and last.phase not in (BWD, MARK):
        computed = compute_dtype(last)
        top = dtype_max(computed)
        big = [ln for ln in last.lines if ln.label.startswith("input") and ln.finite and ln.abs_max is not None
               and top is not None and ln.abs_max > top]
        if big and cause in (causes.INVALID_OP, causes.LOW_PRECISION_OVERFLOW, causes.RANGE_OVERFLOW,
                             causes.SQUARE_OVERFLOW):
            out.append(f"{cause} although {who(last.name, last.cls)} {big[0].label} = {shown(big[0].abs_max)} is above "
                       f"the max of {computed}, the dtype it computes in")
        if cause == causes.INVALID_OP:
            product = product_overflow(last)
            if product is not None:
                out.append(f"an invalid operation although {product[0].label} times {product[1].label} is above the "
                           f"max of {product[2]}")
            if any(not ln.finite for ln in last.lines if ln.label.startswith("input")):
                out.append("an invalid operation 'from finite inputs' with a non-finite input")
            if not math.isnan(report.marker.abs_max):
                out.append("an invalid operation for an inf (invalid operations make nan)")
    cited = {e.slot: e for e in report.evidence}
    if cause == causes.BAD_INPUT:
        given = [e for e in report.evidence if e.slot.startswith("input") or e.phase == MARK]
        if not given or all(e.abs_max is not None and math.isfinite(e.abs_max) for e in given):
            out.append("bad data without a non-finite value the model was given")
    if cause == causes.BETWEEN_MODULES:
        e = next((e for s, e in cited.items() if s.startswith("input")), None)
        if e is None or e.abs_max is None or math.isfinite(e.abs_max):
            out.append("'between modules' without a non-finite module input")
        elif any(ln.ref is not None and ln.ref == _ref_of(report, e) and ln.label.startswith("output")
                 for f in report.frames[:-1] if f.step == report.step for ln in f.lines):
            out.append("'between modules' for a value a watched module produced")
    if cause == causes.LOW_PRECISION_OVERFLOW and not any(narrow_range(e.dtype) for e in report.evidence):
        out.append("a low-precision overflow with no cited value in a narrow-range dtype")
    if cause == causes.BOUNDARY_OVERFLOW:
        e = report.evidence[-2] if len(report.evidence) >= 2 else None
        top = dtype_max(compute_dtype(last)) if last is not None else None
        if e is None or top is None or e.abs_max is None or not e.abs_max > top:
            out.append("a boundary overflow without an input above the range its module computes in")
    return out


def _ref_of(report: NonFiniteReport, e) -> object:  # noqa: ANN001 - an Evidence
    f = e.frame
    if f is None:
        return None
    return next((ln.ref for ln in f.lines if ln.label == e.slot), None)

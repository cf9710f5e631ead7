"""Where a module's output went in the forward: the module whose backward made the gradient measured at that output.

A bwd frame measures the gradient w.r.t. a forward output of a module; that gradient is what its *consumer's*
backward returned. :func:`backward_consumer` finds the consumer that took that very tensor; :func:`consumer_of`
also one that took it as another tensor with the same values (a view, ZeRO-3's fresh inputs); :func:`code_between`
says, when none did, which parent's forward used it in plain code. :mod:`.inputs` answers the other way: where a
value a module was given came from.
"""

from __future__ import annotations

import math

from ..record.frames import BWD, FWD, ResolvedFrame


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


def consumer_of(frames: list[ResolvedFrame], index: int) -> ResolvedFrame | None:
    """:func:`backward_consumer`, or, when no later module took that very tensor, the next module of the parent's
    forward whose input holds the same values (dtype, abs min and abs max): the output reached it as another
    tensor -- a view, or a copy an engine made (ZeRO-3 hands every module fresh input tensors) -- so that module's
    backward made the gradient, not plain code between the two."""
    found = backward_consumer(frames, index)
    if found is not None:
        return found
    between = code_between(frames, index)
    if between is None or between[1] is None:
        return None
    bad, nxt = frames[index], between[1]
    made = next((ln for f in frames[:index] if f.step == bad.step and f.phase == FWD and f.name == bad.name
                 for ln in f.lines if ln.ref == bad.source_ref and ln.label.startswith("output")), None)
    if made is None or made.abs_max is None or not math.isfinite(made.abs_max):
        return None
    same = any(ln.label.startswith("input") and ln.dtype == made.dtype and ln.abs_min == made.abs_min
               and ln.abs_max == made.abs_max for ln in nxt.lines)
    return nxt if same else None


def code_between(frames: list[ResolvedFrame], index: int) -> tuple[ResolvedFrame, ResolvedFrame | None] | None:
    """The gradient of a module's output measured at ``frames[index]`` went bad while no watched module took that
    output as its input (:func:`backward_consumer` found none): the forward of its parent used it in plain code.
    That parent's frame, and the next module it called after the producer (None if none), or None when the producer
    is the model itself."""
    bad = frames[index]
    if bad.root or not bad.name:
        return None
    producer = next((i for i in range(index - 1, -1, -1) if frames[i].step == bad.step and frames[i].phase == FWD
                     and frames[i].name == bad.name), None)
    if producer is None:
        return None
    name, ref = bad.name, bad.source_ref
    while True:
        parent_name = name.rpartition(".")[0]
        parent = next((f for f in frames[producer + 1:] if f.step == bad.step and f.phase == FWD
                       and f.name == parent_name), None)
        if parent is None:
            return None
        passed_on = ref is not None and any(ln.ref == ref and ln.label.startswith("output") for ln in parent.lines)
        if not passed_on:
            break
        if parent.root or not parent_name:  # the model returned it: what used it is outside the model (the loss)
            return None
        name = parent_name  # the parent returned that very tensor: the code that used it is further out
    inside = parent_name + "." if parent_name else ""
    nxt = next((f for f in frames[producer + 1:] if f.step == bad.step and f.phase == FWD and f.name != parent_name
                and f.name.startswith(inside) and not f.name.startswith(name + ".") and f.name != name), None)
    return parent, nxt

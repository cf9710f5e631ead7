"""Where a non-finite value a module was given came from: the model's inputs, a watched module, or neither.

The model's own frame holds what the model was given (every positional and keyword input, ``labels`` included,
measured as context with its call, so no extra scan), and it ends after its modules' frames. A module's
non-finite input is the data when it is one of those very tensors (same measured value), or when it came from
one through plain code (an input of the model's call is non-finite too); it was made between modules only when
everything the model was given in that call was finite. Each call of the model is one micro-batch of its step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..record.frames import BWD, FWD, Line, ResolvedFrame


def producer(frames: list[ResolvedFrame], index: int, line: Line) -> ResolvedFrame | None:
    """The earlier frame of the same step whose output is this very tensor (None: plain code or the data)."""
    step = frames[index].step
    if line.ref is None:
        return None
    for f in reversed(frames[:index]):
        if f.step == step and f.phase != BWD and any(
            ln.ref == line.ref and ln.label.startswith("output") for ln in f.lines
        ):
            return f
    return None


def root_of_call(frames: list[ResolvedFrame], index: int) -> int | None:
    """The model's own frame for the call that ``frames[index]`` ran in: the first root frame at or after it
    (a module's frame is recorded when its forward returns, so the model's comes after its modules')."""
    step = frames[index].step
    return next((i for i in range(index, len(frames))
                 if frames[i].step == step and frames[i].phase == FWD and frames[i].root), None)


def micro_batch(frames: list[ResolvedFrame], root_index: int) -> int:
    """Which call of the model in its step (0: the first micro-batch of a gradient-accumulation step)."""
    step = frames[root_index].step
    return sum(1 for f in frames[:root_index] if f.step == step and f.phase == FWD and f.root)


def _first_of_call(frames: list[ResolvedFrame], index: int) -> int | None:
    """When ``frames[index]`` is the first module frame of its call of the model (no forward frame of its step
    since the model's last frame): which micro-batch that call is. None when another module ran before it."""
    step = frames[index].step
    for j in range(index - 1, -1, -1):
        f = frames[j]
        if f.step != step:
            break
        if f.phase == FWD:
            return micro_batch(frames, j) + 1 if f.root else None
    return 0


@dataclass(frozen=True)
class ModelInput:
    frame: ResolvedFrame  # the model's frame (or, when its forward never returned, the first module of the call)
    line: Line  # the non-finite input the model was given
    micro_batch: int | None


def model_input(frames: list[ResolvedFrame], index: int, bad: Line) -> ModelInput | None:
    """The non-finite value the model itself was given that is behind ``bad``, a non-finite input of
    ``frames[index]`` no watched module produced; None when every input of the model was finite (then plain code
    between modules made it). The model's inputs are measured in its own frame (context, no extra scan): ``bad``
    is one of them (the same tensor), or came from one through plain code."""
    root_i = root_of_call(frames, index)
    if root_i is None:
        # the forward never returned (it raised), or only a submodule was called: what the first module of the
        # call was given is all that is known to come from outside
        calls = _first_of_call(frames, index)
        return None if calls is None else ModelInput(frames[index], bad, calls)
    root = frames[root_i]
    inputs = [ln for ln in root.lines if ln.label.startswith("input") and not ln.param]
    same = next((ln for ln in inputs if bad.ref is not None and ln.ref == bad.ref and not ln.finite), None)
    if same is None:  # reached the module through plain code: a nan first (never legitimate), then an inf
        bad_ones = [ln for ln in inputs if not ln.finite]
        same = next((ln for ln in bad_ones if math.isnan(ln.abs_max)), bad_ones[0] if bad_ones else None)
    if same is None:
        return None
    return ModelInput(root, same, micro_batch(frames, root_i))


def marked_input(frames: list[ResolvedFrame], index: int, line: Line) -> ModelInput | None:
    """The marked value ``line`` is this very tensor given to the model in a later call of the step (a batch
    marked before the model call): that input of the model's frame."""
    step = frames[index].step
    if line.ref is None:
        return None
    for i in range(index + 1, len(frames)):
        f = frames[i]
        if f.step == step and f.phase == FWD and f.root:
            same = next((ln for ln in f.lines if ln.label.startswith("input") and ln.ref == line.ref), None)
            if same is not None:
                return ModelInput(f, same, micro_batch(frames, i))
    return None


def input_name(label: str) -> str:
    """``input[labels]`` -> ``labels``; ``input[0]`` -> ``positional input 0``; ``input[0][1]`` (an item of a
    tuple given as the first argument: a Lightning batch) -> ``positional input 0[1]``."""
    parts = re.findall(r"\[([^\]]*)\]|\.(\w+)", label[len("input"):])
    if not parts:
        return label
    segments = [a or b for a, b in parts]
    head, rest = segments[0], "".join(f"[{x}]" for x in segments[1:])
    return f"positional input {head}{rest}" if head.isdigit() else f"{head}{rest}"

"""One recorded step's statistics, gathered on the device: per module, phase and slot, (abs min, abs max).

A step watched every module leaves frames (module, phase, slots) whose statistics sit in its
:class:`~..measure.windows.StatBuffer`, grouped by (judged, device, dtype). :func:`step_stats` picks, without
reading anything back, each module's outputs in the forward and the gradients at its outputs in the backward, one
row each: the row's key says which (module name, class, phase, slot, dtype). A value passed on from a child to its
parent unchanged (a block returning its last layer's output) is the child's row only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..measure.windows import StatBuffer
from ..record.frames import BUFFER, BWD, DTYPE, ENTRY, FWD, KEY, LABEL, Frame

#: (module name, module class, phase "fwd" / "bwd", slot label, dtype name)
Key = tuple[str, str, str, str, str]


def _kept(label: str, phase: str) -> bool:
    return label.startswith("output") if phase == FWD else label.startswith("grad_output")


def step_stats(frames: Iterable[Frame], buffer: StatBuffer) -> tuple[list[Key], torch.Tensor | None]:
    """The recorded rows of one step: their keys, and an (n, 2) float32 tensor of (abs min, abs max) on the device
    the statistics are on (None when nothing was measured). No host read."""
    stacks = buffer.stacked()
    keys: list[Key] = []
    picks: dict = {}  # group key -> [(row in the group's stack, index in keys)]
    claimed: set = set()
    for frame in frames:
        if frame.phase not in (FWD, BWD):
            continue
        for s in frame.slots:
            group = s[KEY]
            if group is None or group not in stacks or s[BUFFER] != buffer.buffer_id or not _kept(s[LABEL],
                                                                                                 frame.phase):
                continue
            if (group, s[ENTRY], frame.phase) in claimed:
                continue  # (the same value, already the child's row)
            claimed.add((group, s[ENTRY], frame.phase))
            dtype = s[DTYPE]
            keys.append((frame.info.name, frame.info.cls, frame.phase, s[LABEL],
                         str(dtype).removeprefix("torch.") if dtype is not None else ""))
            picks.setdefault(group, []).append((s[ENTRY], len(keys) - 1))
    if not keys:
        return [], None
    device = None
    parts = []
    for group, pairs in picks.items():
        rows = buffer.rows_of(group)
        stack = stacks[group]
        device = device or stack.device
        at = torch.tensor([rows[e] for e, _ in pairs], device=stack.device)
        pair = stack.view(-1, 2).index_select(0, at).float()  # (abs min, abs max) interleaved rows
        parts.append((torch.tensor([i for _, i in pairs]), pair))
    out = torch.empty(len(keys), 2, dtype=torch.float32, device=device)
    for order, pair in parts:
        out.index_copy_(0, order.to(device), pair.to(device))
    return keys, out

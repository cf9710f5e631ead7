"""Headroom while training (``NumericsMonitor(headroom=True)``): which module is drifting toward its dtype's largest
value, and how many steps are left at its rate.

It needs each module's values, which the default level does not take on a healthy step, so every
``headroom_every``-th step is watched every module (the others cost what the default costs). On such a step each
module's largest output magnitude, as a share of its output dtype's largest value, is gathered from the step's
statistics on the device (:meth:`Headroom.collect`: a few ops, no read) and kept for the last :data:`KEPT` such
steps. One 0-d flag -- a module not yet warned about is within :data:`WARN_FACTOR` of its dtype's largest value --
travels with the step's one host read; only when it is set are the kept values read, the trend fitted (growth per
100 steps, from the log2 of the kept values) and a warning given once per module: logged, warned
(:class:`HeadroomWarning`) and appended to ``torchdoctor-headroom[-rank<r>].jsonl`` beside the reports.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections import deque
from dataclasses import dataclass

import torch

from ..record.frames import BUFFER, ENTRY, FWD, KEY, LABEL

log = logging.getLogger(__name__)

WARN_FACTOR = 2.0  # warn when a module's largest value comes within this factor of its dtype's largest
KEPT = 16  # headroom steps kept for the trend


class HeadroomWarning(UserWarning):
    """A module's values came within 2x of its dtype's largest value (``NumericsMonitor(headroom=True)``)."""


@dataclass
class HeadroomEvent:
    step: int
    module: str
    cls: str
    dtype: str
    peak: float
    dtype_max: float
    growth_per_100: float | None  # the factor its peak grew by per 100 steps, None: too few samples
    steps_left: int | None  # at that rate, until it overflows; None: not growing

    def text(self) -> str:
        trend = ("" if self.growth_per_100 is None else
                 f"; growing {self.growth_per_100:.2f}x per 100 steps" + (
                     f", about {self.steps_left} steps left at that rate" if self.steps_left is not None else
                     " (not growing)"))
        fix = (f"Keep it in fp32 (torchdoctor.keep_fp32(model, {self.module!r})) or train in bf16" if self.module else
                "Train in bf16")
        return (f"torchdoctor: {self.module or 'the model'} ({self.cls}) reached {self.peak:.3g} in {self.dtype} at "
                f"step {self.step}, within {self.dtype_max / self.peak:.2f}x of its largest value "
                f"({self.dtype_max:.3g}){trend}. {fix} before it overflows")

    def to_json(self) -> dict:
        return dict(self.__dict__)


class Headroom:
    """The running share of its dtype's range each module uses, kept on the device (see the module docstring)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.names: list[str] = []
        self.classes: list[str] = []
        self.dtypes: list[torch.dtype | None] = []
        self.index: dict[str, int] = {}
        self.samples: deque[tuple[int, torch.Tensor]] = deque(maxlen=KEPT)  # (step, share per module) on device
        self.warned: set[int] = set()
        self.events: list[HeadroomEvent] = []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _module(self, name: str, cls: str, dtype: torch.dtype) -> int:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
            self.classes.append(cls)
            self.dtypes.append(dtype)
        return i

    def collect(self, step: int, frames: list, buffer, stacks: dict) -> torch.Tensor | None:
        """On a step watched every module: each module's largest output magnitude as a share of its dtype's largest
        value (device), kept; a 0-d flag, still on the device: a module not yet warned about is within
        :data:`WARN_FACTOR`. None when nothing was measured."""
        by_group: dict = {}
        claimed = set()  # a parent's output that is its child's stays the child's (forward hooks run inner first)
        for frame in frames:
            if frame.phase != FWD:
                continue
            for s in frame.slots:
                key = s[KEY]
                if key is None or key not in stacks or s[BUFFER] != buffer.buffer_id or \
                        not s[LABEL].startswith("output") or (key, s[ENTRY]) in claimed:
                    continue
                claimed.add((key, s[ENTRY]))
                i = self._module(frame.info.name, frame.info.cls, key[2])
                by_group.setdefault(key, []).append((s[ENTRY], i))
        if not by_group:
            return None
        shares = []
        for key, pairs in by_group.items():
            rows = buffer.rows_of(key)
            stack = stacks[key]
            positions = torch.tensor([2 * rows[e] + 1 for e, _ in pairs], device=stack.device)
            modules = torch.tensor([i for _, i in pairs], device=stack.device)
            top = float(torch.finfo(key[2]).max)
            share = stack.index_select(0, positions).float() / top
            shares.append((modules, share))
        device = shares[0][1].device
        per_module = torch.zeros(len(self.names), device=device)
        for modules, share in shares:
            per_module = per_module.scatter_reduce(0, modules.to(device), share.to(device), "amax")
        self.samples.append((step, per_module))
        fresh = torch.ones(len(self.names), dtype=torch.bool, device=device)
        if self.warned:
            fresh[torch.tensor(sorted(self.warned), device=device)] = False
        return ((per_module >= 1 / WARN_FACTOR) & torch.isfinite(per_module) & fresh).any()

    def warn(self, rank: int | None, report_dir: str) -> list[HeadroomEvent]:
        """The flag was set: read the kept shares (one read), give a warning once per module that came within
        :data:`WARN_FACTOR`, with its trend."""
        steps = [s for s, _ in self.samples]
        width = len(self.names)
        table = torch.stack([torch.nn.functional.pad(v, (0, width - v.numel())) for _, v in self.samples]).cpu()
        rows = table.tolist()
        latest = rows[-1]
        new = []
        for i, share in enumerate(latest):
            if i in self.warned or not (math.isfinite(share) and share >= 1 / WARN_FACTOR):
                continue
            self.warned.add(i)
            top = float(torch.finfo(self.dtypes[i]).max)
            growth, left = _trend(steps, [r[i] for r in rows], share)
            event = HeadroomEvent(steps[-1], self.names[i], self.classes[i], str(self.dtypes[i]).removeprefix(
                "torch."), share * top, top, growth, left)
            new.append(event)
        self.events += new
        for event in new:
            log.warning("%s", event.text())
            warnings.warn(event.text(), HeadroomWarning, stacklevel=2)
        _append(new, rank, report_dir)
        return new


def _trend(steps: list[int], shares: list[float], latest: float) -> tuple[float | None, int | None]:
    """(growth factor per 100 steps, steps left until the share reaches 1) from a least-squares fit of log2(share)
    over the kept steps; (None, None) with fewer than two usable samples."""
    points = [(s, math.log2(v)) for s, v in zip(steps, shares) if v > 0 and math.isfinite(v)]
    if len(points) < 2:
        return None, None
    mean_s = sum(s for s, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((s - mean_s) ** 2 for s, _ in points)
    if spread == 0:
        return None, None
    slope = sum((s - mean_s) * (v - mean_v) for s, v in points) / spread  # log2 per step
    growth = 2 ** (slope * 100)
    left = int(-math.log2(latest) / slope) if slope > 0 else None
    return growth, left


def _append(events: list[HeadroomEvent], rank: int | None, report_dir: str) -> None:
    if not events:
        return
    name = "torchdoctor-headroom" + (f"-rank{rank}" if rank is not None else "") + ".jsonl"
    try:
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, name), "a", encoding="utf-8") as f:
            for event in events:
                f.write(json.dumps(event.to_json()) + "\n")
    except OSError as e:  # a full disk never stops training over a warning
        log.warning("torchdoctor: the headroom warning was not written to %s: %s", report_dir, e)

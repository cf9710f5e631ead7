"""What is kept of earlier steps: their last frames as a report's context, and their peaks for the divergence rule.

When a step ends healthy, :meth:`History.keep` keeps its record (unread, on the device) as context for a later
report, as far back as a report can show (``max_frames`` frames in all), with the weights its frames ran with,
measured as it ended (:meth:`~..record.step.StepRecord.keep_for_context`). The step's largest values go to the
:class:`~..explain.causes.GrowthTrail` (a few device ops, read only when a report is built). A report reads both
(:meth:`History.frames_with`); a detection forgets the context (:meth:`History.clear`).
"""

from __future__ import annotations

from collections import deque

from ..explain.causes import GrowthTrail
from ..record.frames import ResolvedFrame, resolve
from ..record.step import StepRecord


def resolved(records: list[StepRecord]) -> list[ResolvedFrame]:
    """The frames of these records with their numbers (their statistics read: report time only)."""
    out: list[ResolvedFrame] = []
    for r in records:
        r.settle()
        out.extend(resolve(r.frames, r.buffer.read(), r.weights.read() if r.weights is not None else None))
    return out


class History:
    """Earlier steps kept as a report's context, and the growth trail of recent healthy steps."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self.records: deque[StepRecord] = deque()
        self.growth = GrowthTrail()  # recent healthy steps' largest values, on the device (divergence)

    def keep(self, rec: StepRecord) -> None:
        """A step ended: keep what a later report can show of it (its last frames, their weights)."""
        if not rec.frames:
            return
        rec.keep_for_context(self.max_frames)
        if not rec.frames:
            return
        self.records.append(rec)
        kept = 0
        for i in range(len(self.records) - 1, -1, -1):
            kept += len(self.records[i].frames)
            if kept >= self.max_frames:
                for _ in range(i):
                    self.records.popleft()
                break

    def clear(self) -> None:
        self.records.clear()

    def frames(self) -> list[ResolvedFrame]:
        """The kept steps' frames, oldest first."""
        return resolved(list(self.records))

    def frames_with(self, rec: StepRecord) -> tuple[list[ResolvedFrame], int]:
        """The kept steps as context, then ``rec``'s frames; and where ``rec``'s begin."""
        context = self.frames()
        return context + resolved([rec]), len(context)

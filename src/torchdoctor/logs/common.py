"""What every part of the log analyzer shares: its bounds, the report it returns, small bounded containers.

The bounds are why ``torchdoctor logs`` runs in constant memory on a log of any size: the timeline keeps its first
and last ``TIMELINE_HEAD``/``TIMELINE_TAIL`` events, the loss-scale history its first and last runs, every list
of details ``MAX_DETAILS`` entries, every dedup set ``MAX_KEYS`` keys.
"""

from __future__ import annotations

import math
import signal as _signal
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..findings import Finding

TIMELINE_HEAD = 1000
TIMELINE_TAIL = 1000
SCALE_RUNS_HEAD = 32
SCALE_RUNS_TAIL = 32
MAX_DETAILS = 32            # entries kept per detail list (kills, timeouts, OOMs, build errors)
MAX_KEYS = 4096             # dedup sets stop growing here (later duplicates are then counted again)
CHUNK_BYTES = 1 << 20       # analyze_stream reads this much at a time
MAX_LINE = 1 << 20          # a "line" longer than this (tqdm without newlines) is processed in pieces
TEXT_MAX = 300              # characters of a line kept in the timeline and in evidence
SEG_MAX = 8192              # a candidate segment longer than this is matched in a window around the candidate
SEG_BEFORE = 2048           # ... starting this many characters before it (the rank, the key of a loss)
JOIN_MAX = 400              # characters of a following line joined to a message printed over several lines

CURRENT = object()  # "the step the log is at now"
_SIGNAL_NAMES = {s.value: s.name for s in _signal.Signals}


class HeadTail:
    """The first ``head`` and the last ``tail`` items of a stream, and how many fell in between."""

    __slots__ = ("head", "tail", "dropped", "_head_n", "_tail_n")

    def __init__(self, head: int, tail: int) -> None:
        self.head: list[Any] = []
        self.tail: deque[Any] = deque(maxlen=tail)
        self.dropped = 0
        self._head_n, self._tail_n = head, tail

    def append(self, item: Any) -> None:
        if len(self.head) < self._head_n:
            self.head.append(item)
            return
        if len(self.tail) == self._tail_n:
            self.dropped += 1
        self.tail.append(item)

    def last(self) -> Any:
        if self.tail:
            return self.tail[-1]
        return self.head[-1] if self.head else None

    def items(self) -> list[Any]:
        return [*self.head, *self.tail]

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)


def num(s: str | None) -> float | None:
    try:
        return float(s) if s is not None else None
    except ValueError:
        return None


def fmt_scale(x: float | None) -> str:
    if x is None:
        return "?"
    if math.isfinite(x) and x == int(x):
        return str(int(x))
    return f"{x:g}"


def scale_val(x: float) -> int | float:
    return int(x) if math.isfinite(x) and x == int(x) and abs(x) < 2**63 else x


def step_words(e: dict) -> str:
    """``step N``, or ``progress N/M`` when a progress bar was all that said where the run was (its count may be
    batches of an epoch, samples or steps: calling it a step would claim what the log does not say)."""
    if e.get("step_from") == "bar":
        return f"progress {e['step']}" + (f"/{e['planned']}" if e.get("planned") else "")
    return f"step {e['step']}"


def at_step(e: dict) -> str:
    """`` (step N)`` / `` (progress N/M)`` for an event that knows where the run was, else nothing."""
    return f" ({step_words(e)})" if e.get("step") is not None else ""


def clip(text: str, n: int = TEXT_MAX) -> str:
    text = text.strip()
    return text if len(text) <= n else text[: n - 3] + "..."


def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number that names no signal here."""
    return _SIGNAL_NAMES.get(sig, f"signal {sig}")


def add(lst: list, item: Any, limit: int = MAX_DETAILS) -> None:
    if len(lst) < limit:
        lst.append(item)


def seen(keys: set, key: Any) -> bool:
    """True if ``key`` was seen before; remembers it while the set is small."""
    if key in keys:
        return True
    if len(keys) < MAX_KEYS:
        keys.add(key)
    return False


@dataclass
class LogReport:
    """What a log showed: findings (the verdicts), the timeline of notable lines, how many lines were read."""

    findings: list[Finding]
    timeline: list[dict]
    lines: int
    timeline_dropped: int = 0
    event_counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "findings": [f.to_json() for f in self.findings],
            "timeline": [dict(e) for e in self.timeline],
            "lines": self.lines,
            "timeline_dropped": self.timeline_dropped,
            "event_counts": dict(self.event_counts),
        }

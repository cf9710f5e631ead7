"""Checking the monitor's options up front, so that a typo fails at once and not mid-training."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

GRAD_LEVELS = ("none", "params", "modules")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_options(
    *,
    grads: str = "params",
    max_frames: int = 21,
    trace_steps: Any = None,
    abort_after_step: Any = None,
    report_dir: Any = ".",
    min_loss_scale: float = 1.0,
    max_consecutive_overflows: int = 30,
    stream: Any = None,
    **_: Any,
) -> None:
    """Refuse bad options with a clear message (ValueError / TypeError)."""
    if grads not in GRAD_LEVELS:
        raise ValueError(f"grads={grads!r} is not one of {', '.join(map(repr, GRAD_LEVELS))}")
    if not _is_count(max_frames):
        raise ValueError(f"max_frames must be an int >= 0, got {max_frames!r}")
    if trace_steps is not None and (
        isinstance(trace_steps, (str, bytes))
        or not isinstance(trace_steps, Iterable)
        or not all(_is_count(s) for s in trace_steps)
    ):
        raise ValueError(f"trace_steps must be a list of step numbers (ints >= 0), got {trace_steps!r}")
    if abort_after_step is not None and not _is_count(abort_after_step):
        raise ValueError(f"abort_after_step must be an int >= 0 (steps count from 0), got {abort_after_step!r}")
    if not isinstance(report_dir, (str, os.PathLike)):
        raise TypeError(f"report_dir must be a path, got {type(report_dir).__name__}")
    if os.path.exists(report_dir) and not os.path.isdir(report_dir):
        raise ValueError(f"report_dir={os.fspath(report_dir)!r} exists and is not a folder")
    if not isinstance(min_loss_scale, (int, float)) or min_loss_scale < 0:
        raise ValueError(f"min_loss_scale must be a number >= 0, got {min_loss_scale!r}")
    if not _is_count(max_consecutive_overflows) or max_consecutive_overflows < 1:
        raise ValueError(f"max_consecutive_overflows must be an int >= 1, got {max_consecutive_overflows!r}")
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"stream must be a text stream with write(), got {type(stream).__name__}")

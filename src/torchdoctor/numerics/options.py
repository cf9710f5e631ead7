"""Checking the monitor's options up front, so that a typo fails at once and not mid-training."""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Iterable
from typing import Any

from ..runvars import REPORT_DIR_VAR

GRAD_LEVELS = ("none", "params", "modules")
WATCH_LEVELS = ("boundaries", "every-module")
TRANSIENT_ACTIONS = ("raise", "skip")


def _is_count(value: Any) -> bool:
    """An integer >= 0 (numpy integers included, bools not)."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False


def check_options(
    *,
    grads: str = "params",
    watch: str = "boundaries",
    transient: str = "raise",
    headroom: Any = False,
    headroom_every: Any = 100,
    max_frames: int = 21,
    trace_steps: Any = None,
    abort_after_step: Any = None,
    report_dir: Any = None,
    min_loss_scale: float = 1.0,
    max_consecutive_overflows: int = 30,
    stream: Any = None,
    record: Any = None,
    record_every: Any = 1,
    record_flush: Any = 50,
    **_: Any,
) -> frozenset[int]:
    """Refuse bad options with a clear message (ValueError / TypeError); return the traced steps."""
    if grads not in GRAD_LEVELS:
        raise ValueError(f"grads={grads!r} is not one of {', '.join(map(repr, GRAD_LEVELS))}")
    if watch not in WATCH_LEVELS:
        raise ValueError(f"watch={watch!r} is not one of {', '.join(map(repr, WATCH_LEVELS))}")
    if transient not in TRANSIENT_ACTIONS:
        raise ValueError(f"transient={transient!r} is not one of {', '.join(map(repr, TRANSIENT_ACTIONS))}")
    if not isinstance(headroom, bool):
        raise TypeError(f"headroom must be True or False, got {headroom!r}")
    if not _is_count(headroom_every) or headroom_every < 1:
        raise ValueError(f"headroom_every must be an int >= 1 (steps), got {headroom_every!r}")
    if not _is_count(max_frames):
        raise ValueError(f"max_frames must be an int >= 0, got {max_frames!r}")
    listable = isinstance(trace_steps, Iterable) and not isinstance(trace_steps, (str, bytes))
    steps = list(trace_steps) if listable else None
    if trace_steps is not None and (steps is None or not all(_is_count(s) for s in steps)):
        raise ValueError(f"trace_steps must be a list of step numbers (ints >= 0), got {trace_steps!r}")
    if abort_after_step is not None and not _is_count(abort_after_step):
        raise ValueError(f"abort_after_step must be an int >= 0 (steps count from 0), got {abort_after_step!r}")
    if report_dir is None:
        report_dir = default_report_dir()
    if not isinstance(report_dir, (str, os.PathLike)):
        raise TypeError(f"report_dir must be a path, got {type(report_dir).__name__}")
    if os.path.exists(report_dir) and not os.path.isdir(report_dir):
        raise ValueError(f"report_dir={os.fspath(report_dir)!r} exists and is not a folder")
    if not isinstance(min_loss_scale, numbers.Real) or min_loss_scale < 0:
        raise ValueError(f"min_loss_scale must be a number >= 0, got {min_loss_scale!r}")
    if not _is_count(max_consecutive_overflows) or max_consecutive_overflows < 1:
        raise ValueError(f"max_consecutive_overflows must be an int >= 1, got {max_consecutive_overflows!r}")
    if record is not None:
        if not isinstance(record, (str, os.PathLike)):
            raise TypeError(f"record must be a folder path, got {type(record).__name__}")
        if os.path.exists(record) and not os.path.isdir(record):
            raise ValueError(f"record={os.fspath(record)!r} exists and is not a folder")
    for name, value in (("record_every", record_every), ("record_flush", record_flush)):
        if not _is_count(value) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}")
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"stream must be a text stream with write(), got {type(stream).__name__}")
    return frozenset(operator.index(s) for s in steps or ())


def default_report_dir() -> str:
    """Where reports go when no ``report_dir`` is given: the folder ``torchdoctor run`` gives the command
    (``$TORCHDOCTOR_REPORT_DIR``: ``--report-dir`` or a folder of its own per run), else the current directory."""
    return os.environ.get(REPORT_DIR_VAR) or "."

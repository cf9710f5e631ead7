"""What the Trainer callbacks (:mod:`.hf`, :mod:`.lightning`) share: their options, checked when the callback is
made, not inside ``train()`` / ``fit()``, and how they attach the monitor when training starts."""

from __future__ import annotations

import inspect
import os
from typing import Any

from ..numerics.monitor import NumericsMonitor
from ..numerics.options import check_options
from ..numerics.record.watched import describe, outermost_wrapper
from ..runvars import REPORT_DIR_VAR


def callback_options(monitor_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``monitor_kwargs`` for :class:`~torchdoctor.NumericsMonitor`, refused now when bad or when they name what
    the Trainer provides (``model``, ``optimizer``, ``scaler``)."""
    for reserved in ("model", "optimizer", "scaler"):
        if reserved in monitor_kwargs:
            raise TypeError(f"NumericsCallback takes {reserved!r} from the Trainer; do not pass it")
    try:
        inspect.signature(NumericsMonitor).bind(None, **monitor_kwargs)
    except TypeError as e:
        raise TypeError(f"NumericsCallback: {e}") from None
    traced = check_options(**monitor_kwargs)
    if "trace_steps" in monitor_kwargs:  # a generator would be used up by the check
        monitor_kwargs["trace_steps"] = sorted(traced)
    return monitor_kwargs


def attach_monitor(model: Any, optimizer: Any, scaler: Any, *, report_dir: str, via: str,
                   monitor_kwargs: dict[str, Any], warnings: list) -> NumericsMonitor:
    """The callback's monitor on the Trainer's model: reports where ``torchdoctor run`` asked (its --report-dir or
    per-run folder), else in ``report_dir`` (the Trainer's folder), unless the options say; ``warnings`` is the
    callback's list, one for the whole of ``train()`` / ``fit()`` and readable once it returned."""
    kwargs = {"report_dir": os.environ.get(REPORT_DIR_VAR) or report_dir, "_via": via, **monitor_kwargs}
    monitor = NumericsMonitor(model, optimizer=optimizer, scaler=scaler, **kwargs)
    # what it runs inside (accelerate's DDP where FSDP was asked for, Lightning's strategy): said in the report
    # (a search of the process's modules: made when a report or the switch's announcement first needs it)
    optimizer, grads, level, every = monitor.optimizer, monitor.grads, monitor.watch_level, monitor.headroom_every
    recorded = monitor.record_every
    monitor.watching = lambda: describe(outermost_wrapper(model), optimizer, grads, level, every, recorded)
    monitor.warnings = warnings
    return monitor

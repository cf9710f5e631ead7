"""What the Trainer callbacks (:mod:`.hf`, :mod:`.lightning`) share: their options, checked when the callback is
made, not inside ``train()`` / ``fit()``."""

from __future__ import annotations

import inspect
from typing import Any

from ..numerics.monitor import NumericsMonitor
from ..numerics.options import check_options


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

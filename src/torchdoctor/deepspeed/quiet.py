"""Keeping DeepSpeed's import-time lines off torchdoctor's output: every command that may import DeepSpeed (directly,
or through transformers, which imports it when it is installed) while printing ``--json`` wraps that in
:func:`quiet_deepspeed`."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_deepspeed() -> Iterator[None]:
    """Keep DeepSpeed's import-time lines ("Setting accelerator to CPU") off our stdout (it would break --json).

    DeepSpeed's logger writes to the ``sys.stdout`` of the moment it is created, so a handler created while stdout
    is redirected is pointed back at the real stdout afterwards: the user's own DeepSpeed logging is left as it was.
    """
    real = sys.stdout
    buf = io.StringIO()
    ds_logger = logging.getLogger("DeepSpeed")
    was_disabled = ds_logger.disabled
    ds_logger.disabled = True
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        ds_logger.disabled = was_disabled
        for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for h in getattr(lg, "handlers", ()):
                if isinstance(h, logging.StreamHandler) and h.stream is buf:
                    h.setStream(real)

"""The numerics monitor inside a Lightning ``Trainer``.

Example::

    from torchdoctor.integrations.lightning import NumericsCallback
    trainer = lightning.Trainer(..., callbacks=[NumericsCallback()])
    trainer.fit(model)     # raises torchdoctor.NonFiniteError at the first inf/nan, before the update

The monitor is attached to the user's ``LightningModule`` (so reports name its modules as the user wrote them,
whatever strategy wraps it) and to the torch optimizer inside Lightning's ``LightningOptimizer``
(``trainer.optimizers``). Under automatic optimization ``training_step`` is the model's call (routed through the
module's ``__call__``, as Lightning's DDP wrapper does), so a step that calls submodules (``self.encoder(x)``) is
watched and replayed whole. Under ``precision="16-mixed"`` the precision plugin's ``GradScaler`` is passed as
``scaler=``, so its overflow steps are recorded, not raised. Automatic optimization steps the optimizer as
``optimizer.step(closure)`` (the forward and backward run inside ``step``); manual optimization
(``self.manual_backward(loss); opt.step()``) and ``accumulate_grad_batches`` need nothing more. Reports go to
``trainer.log_dir`` (else ``trainer.default_root_dir``) unless ``report_dir`` is given (or ``torchdoctor run``
gives the run a report folder).

Works with ``lightning`` (``lightning.pytorch``) or the standalone ``pytorch_lightning`` package. Fabric needs no
callback: ``NumericsMonitor(model, optimizer)`` on what ``fabric.setup`` returns looks through its wrappers.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from ..numerics.monitor import NumericsMonitor
from .callbacks import attach_monitor, callback_options

__all__ = ["LightningNumericsCallback", "NumericsCallback"]


class NumericsCallback(Callback):
    """Attach a :class:`~torchdoctor.NumericsMonitor` for the length of ``trainer.fit()``.

    Args:
        **monitor_kwargs: passed to :class:`~torchdoctor.NumericsMonitor` (``grads``, ``max_frames``,
            ``trace_steps``, ``abort_after_step``, ``report_dir`` ...).
    """

    def __init__(self, **monitor_kwargs: Any) -> None:
        self.monitor_kwargs = callback_options(monitor_kwargs)
        self.monitor: NumericsMonitor | None = None
        # warnings the run survived (an inf loss with finite gradients), kept after fit() closed the monitor
        self.warnings: list = []

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.close()
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        optimizer = optimizers[0] if optimizers else None  # the monitor finds the torch optimizer inside
        self.monitor = attach_monitor(pl_module, optimizer, _scaler(trainer), report_dir=_log_dir(trainer),
                                      via="lightning", monitor_kwargs=self.monitor_kwargs, warnings=self.warnings)
        if getattr(pl_module, "automatic_optimization", True):
            # the step is training_step, whatever submodules it calls: watched and replayed as the model's call
            # (not under manual optimization, whose training_step steps the optimizer itself)
            self.monitor._step_through_call(pl_module, "training_step")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()  # the monitor released the model: a new one can attach

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.close()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


LightningNumericsCallback = NumericsCallback


def _log_dir(trainer: Any) -> str:
    try:
        where = trainer.log_dir
    except Exception:  # a logger without a folder
        where = None
    return os.fspath(where or getattr(trainer, "default_root_dir", None) or os.getcwd())


def _scaler(trainer: Any) -> Any:
    """The precision plugin's GradScaler (``precision="16-mixed"``), else None."""
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is None:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    return scaler if callable(getattr(scaler, "get_scale", None)) else None

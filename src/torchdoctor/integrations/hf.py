"""The numerics monitor inside the Hugging Face ``Trainer``.

Example::

    from torchdoctor.integrations.hf import NumericsCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NumericsCallback()])
    trainer.train()     # raises torchdoctor.NonFiniteError at the first inf/nan, before the update

The Trainer hands callbacks accelerate's ``AcceleratedOptimizer``; the monitor hooks the torch
optimizer inside it (``.optimizer``) and, under ``fp16=True``, the ``GradScaler`` accelerate uses
(``.scaler``), so the scaler's overflow steps are recorded, not raised. With a DeepSpeed config
(``TrainingArguments(deepspeed=...)``) it gets accelerate's ``DeepSpeedOptimizerWrapper``, whose
``.optimizer`` is DeepSpeed's ZeRO optimizer: the DeepSpeed engine adapter wraps its ``step`` (which the
Trainer reaches inside ``accelerator.backward``) and reads its loss scaler. Reports go to
``args.output_dir`` unless ``report_dir`` is given (or ``torchdoctor run`` gives the run a report folder).

The Trainer gives the model its ``labels``, so the model's own loss is a value the monitor sees: a step whose
loss is inf while every gradient is finite does not stop training (the update is sound) but is a warning
(:class:`~torchdoctor.numerics.errors.NonFiniteWarning`, with the report's path), kept in
``NumericsCallback.warnings`` -- the Trainer's default ``logging_nan_inf_filter=True`` keeps such a loss out of
its own logs.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..numerics.monitor import NumericsMonitor
from .callbacks import attach_monitor, callback_options


class NumericsCallback(TrainerCallback):
    """Attach a :class:`~torchdoctor.NumericsMonitor` for the length of ``trainer.train()``.

    Args:
        **monitor_kwargs: passed to :class:`~torchdoctor.NumericsMonitor` (``grads``, ``max_frames``,
            ``trace_steps``, ``abort_after_step``, ``report_dir`` ...).
    """

    def __init__(self, **monitor_kwargs: Any) -> None:
        self.monitor_kwargs = callback_options(monitor_kwargs)
        self.monitor: NumericsMonitor | None = None
        # warnings the run survived (an inf loss with finite gradients), kept after train() closed the monitor
        self.warnings: list = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to NumericsCallback.on_train_begin")
        self.close()
        # the monitor looks through accelerate's AcceleratedOptimizer; its GradScaler sits on the wrapper
        self.monitor = attach_monitor(model, optimizer, getattr(optimizer, "scaler", None), report_dir=args.output_dir,
                                      via="hf", monitor_kwargs=self.monitor_kwargs, warnings=self.warnings)

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.close()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

"""Loss scalers, whichever library made them: where a skipped step shows, and what the scale was.

A dynamic loss scaler skips a step whose gradients overflowed and lowers the scale: that is its
normal signal, not a failure. The monitor records such steps (:class:`OverflowEvent`) and stops the
run only when the scale collapses (it reached the scaler's floor or ``min_loss_scale``) or too many
steps in a row overflow. Two kinds are known:

* ``torch.amp.GradScaler`` (and anything with ``update()`` / ``get_scale()``): ``update()`` runs after
  ``scaler.step(opt)``; if the optimizer did not step before it, the step was skipped.
* DeepSpeed's ``DynamicLossScaler`` / ``LossScaler`` (``update_scale(overflow)``, ``cur_scale``,
  ``min_scale``): DeepSpeed's optimizers call ``update_scale`` with their own overflow verdict before
  they step or skip. Under a DeepSpeed engine the monitor's check in front of the optimizer's step
  already sees the overflow, so there the scaler is read, not hooked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class OverflowEvent:
    """A step whose gradients overflowed and that a loss scaler skipped (the scaler's normal signal)."""

    step: int
    scale: float | None
    module: str | None
    slot: str | None


class LossScaler:
    """One loss scaler behind one small interface.

    ``hooked=False`` is for a scaler the monitor only reads (a DeepSpeed optimizer's own: its
    ``loss_scaler``, or the ``loss_scale_config`` of DeepSpeed's FP16 optimizers, which has no
    ``update_scale`` of its own).
    """

    def __init__(self, obj: Any, hooked: bool = True) -> None:
        self.obj = obj
        self.deepspeed = hasattr(obj, "cur_scale")  # DynamicLossScaler, LossScaler, LossScaleConfig
        if hooked and not callable(getattr(obj, self.hook_name, None)):
            raise TypeError(
                f"scaler={type(obj).__name__} has no update() method (torch.amp.GradScaler) nor update_scale() "
                "(DeepSpeed's loss scaler)"
            )

    @property
    def dynamic(self) -> bool:
        """Does it skip overflowing steps? (A static scale, DeepSpeed's ``LossScaler``, does not.)"""
        if self.deepspeed:
            return bool(getattr(self.obj, "dynamic", getattr(self.obj, "dynamic_loss_scale", False)))
        return bool(getattr(self.obj, "is_enabled", lambda: True)())

    @property
    def hook_name(self) -> str:
        """The method whose call tells that a step was checked or skipped."""
        return "update_scale" if self.deepspeed else "update"

    def scale(self) -> float | None:
        if self.deepspeed:
            return float(self.obj.cur_scale)
        get = getattr(self.obj, "get_scale", None)
        return float(get()) if callable(get) else None

    @property
    def floor(self) -> float | None:
        """The scaler's own minimum (DeepSpeed's ``min_loss_scale``); torch's GradScaler has none."""
        if not self.deepspeed:
            return None
        floor = getattr(self.obj, "min_scale", getattr(self.obj, "min_loss_scale", None))
        return None if floor is None else float(floor)

    def collapsed(self, scale: float | None, min_loss_scale: float) -> bool:
        if scale is None:
            return False
        floor = self.floor
        return scale < min_loss_scale or (floor is not None and scale <= floor)

"""Engine adapters: how the monitor meets the machinery around a model (see :mod:`.base`).

:func:`select_engine` picks one when a monitor attaches, like torchtitan picks a model's
``parallelize``: DeepSpeed when a DeepSpeed engine, optimizer or ZeRO-3 parameter is in play,
the plain adapter (which also covers DDP, FSDP1/FSDP2, accelerate and the HF Trainer) otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import Engine, torch_optimizer
from .deepspeed import DeepSpeedEngine, is_deepspeed


class MonitorWarning(UserWarning):
    """Something the monitor cannot do for this model or optimizer (said once, when it attaches)."""


def select_engine(model: nn.Module, optimizer: Any, scaler: Any) -> Engine:
    if is_deepspeed(model, optimizer):
        return DeepSpeedEngine(model, optimizer, scaler)
    return Engine(model, optimizer, scaler)


__all__ = ["DeepSpeedEngine", "Engine", "MonitorWarning", "select_engine", "torch_optimizer"]

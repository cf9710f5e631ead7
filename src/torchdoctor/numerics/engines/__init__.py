"""Engine adapters: how the monitor meets the machinery around a model (see :mod:`.base`).

:func:`select_engine` picks one when a monitor attaches, like torchtitan picks a model's
``parallelize``: DeepSpeed when a DeepSpeed engine, optimizer or ZeRO-3 parameter is in play,
the plain adapter (which also covers DDP, FSDP1/FSDP2, accelerate and the HF Trainer) otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import Engine, StepHooks, torch_optimizer
from .deepspeed import DeepSpeedEngine, deepspeed_engine_of, is_deepspeed


class MonitorWarning(UserWarning):
    """Something the monitor cannot do for this model or optimizer (said once, when it attaches)."""


def select_engine(chain: list[nn.Module], optimizer: Any, scaler: Any) -> Engine:
    """The adapter for a model seen through its wrappers (:func:`~.wrappers.wrapper_chain`: the model as given,
    each wrapper, the user's module last)."""
    if is_deepspeed(chain, optimizer):
        return DeepSpeedEngine(chain[-1], deepspeed_engine_of(chain), optimizer, scaler)
    return Engine(chain[-1], optimizer, scaler)


__all__ = ["DeepSpeedEngine", "Engine", "MonitorWarning", "StepHooks", "select_engine", "torch_optimizer"]

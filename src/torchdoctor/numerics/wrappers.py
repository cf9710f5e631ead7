"""Looking through the wrappers that distributed training puts around a model."""

from __future__ import annotations

from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose forward does the work under DDP / DataParallel wrappers.

    Module names in reports are relative to it, so the same unwrapping must happen wherever a user
    passes one of those names back (``keep_fp32(model, "encoder.block.2")`` on a DDP model).
    """
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model

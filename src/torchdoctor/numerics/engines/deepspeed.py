"""DeepSpeed: the engine ``deepspeed.initialize`` returns, at any ZeRO stage, also inside the HF Trainer.

What the monitor needs, and where DeepSpeed (0.14 - 0.19) keeps it:

* **The user's model** is ``engine.module``: names never carry the engine's ``module.`` prefix.
* **The step.** ``engine.step()`` calls ``engine.optimizer.step()`` once per real step (only at the
  gradient-accumulation boundary). That object is a torch optimizer at ZeRO-0 fp32, DeepSpeed's
  ``FP16_(Unfused)Optimizer`` / ``BF16_Optimizer`` / ``DeepSpeedZeroOptimizer`` (ZeRO-1/2) /
  ``DeepSpeedZeroOptimizer_Stage3`` otherwise -- none of them has torch's step hooks. Its ``step`` is
  shadowed by an instance attribute that checks the step first: nothing (weights, fp32 master copies,
  optimizer state, loss scale) has changed when it is entered. The HF Trainer runs ``engine.step()``
  inside ``accelerator.backward``; its own ``optimizer.step()`` on accelerate's wrapper does nothing.
* **The gradients.** Before the step, ``p.grad`` is None at ZeRO-1/2/3: the reduced gradients sit in
  each optimizer's private partitions, which differ per stage and version. So the monitor checks the
  gradient each parameter *receives* in the backward, with a tensor hook on the parameter (it fires at
  every stage, with the full local gradient of the micro-batch, before DeepSpeed reduces it). Any rank's
  non-finite gradient makes the reduced one non-finite, and the shared verdict stops every rank.
* **ZeRO-3 weights** exist only while their module runs (an empty placeholder otherwise): they are
  measured as the module's forward starts, by a pre-forward hook that runs after DeepSpeed's own (which
  gathers them); outside the forward, this rank's partition (``ds_tensor``) is measured, labelled "local
  shard". The outputs are measured after DeepSpeed's post-forward hook, so they are the very tensors the
  next module receives (DeepSpeed replaces them to hook its backward).
  Parameters are read with ``named_parameters(recurse=False)``: attribute access would gather them.
* **Loss scaling.** fp16 ZeRO optimizers keep a ``DynamicLossScaler`` as ``.loss_scaler``; the FP16
  optimizers a ``loss_scale_config``. With a dynamic scale, DeepSpeed skips an overflowing step itself:
  the monitor records it (with the scale) and lets it skip, and stops the run only when the scale
  reaches DeepSpeed's ``min_loss_scale`` (before DeepSpeed's own "cannot decrease scale anymore") or too
  many steps overflow in a row. bf16 and fp32 have no dynamic scale: a non-finite step is stopped.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from torch import nn

from .base import Engine, GradReceiver, StepHooks, eager
from .hookset import HookSet
from .scalers import LossScaler


def _from_deepspeed(obj: Any) -> bool:
    return type(obj).__module__.startswith("deepspeed.")


def deepspeed_engine_of(chain: list[nn.Module]) -> Any:
    """The DeepSpeedEngine among a model's wrappers (:func:`~.wrappers.wrapper_chain`), or None."""
    for model in chain:
        if type(model).__name__ in ("DeepSpeedEngine", "PipelineEngine", "DeepSpeedHybridEngine") and _from_deepspeed(
            model
        ):
            return model
    return None


def deepspeed_optimizer_of(optimizer: Any) -> Any:
    """DeepSpeed's optimizer inside wrappers (accelerate's ``DeepSpeedOptimizerWrapper``), or None."""
    for _ in range(8):
        if optimizer is None:
            return None
        if type(optimizer).__module__.startswith("deepspeed.runtime"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def is_deepspeed(chain: list[nn.Module], optimizer: Any) -> bool:
    if deepspeed_engine_of(chain) is not None or deepspeed_optimizer_of(optimizer) is not None:
        return True
    return any(hasattr(p, "ds_id") for p in chain[-1].parameters())  # ZeRO-3 parameters without their engine


class DeepSpeedEngine(Engine):
    kind = "deepspeed"

    def __init__(self, root: nn.Module, engine: Any, optimizer: Any, scaler: Any) -> None:
        if optimizer is None and engine is not None:
            optimizer = engine.optimizer
        self._scaler_given = scaler is not None
        super().__init__(root, optimizer, scaler)
        self.params_at_forward = any(hasattr(p, "ds_id") for p in self.root.parameters())  # ZeRO-3
        self.grads_at_report = False  # p.grad is gone by the step: gradients are measured as they arrive

    def _hookable(self, optimizer: Any) -> Any:
        return deepspeed_optimizer_of(optimizer) or super()._hookable(optimizer)

    def loss_scaler(self, scaler: Any) -> LossScaler | None:
        own = [getattr(self.optimizer, attr, None) for attr in ("loss_scaler", "loss_scale_config")]
        if scaler is not None and not any(scaler is o for o in own):
            return LossScaler(scaler)
        self._scaler_given = False  # its own (passed or not): read, and DeepSpeed's step does the skipping
        for obj in own:  # the ZeRO optimizers', the FP16 optimizers'
            if obj is not None and hasattr(obj, "cur_scale"):
                found = LossScaler(obj, hooked=False)
                return found if found.dynamic else None
        return None

    @property
    def skips_overflow(self) -> bool:
        """DeepSpeed's optimizer skips a step whose gradients overflowed when its own scale is dynamic."""
        return self.scaler is not None and not self._scaler_given

    def install(self, hooks: HookSet, steps: StepHooks) -> None:
        if self.optimizer is not None:
            hooks.wrap(self.optimizer, "step", before=eager(steps.on_pre_step), after=eager(steps.on_post_step))
        if self._scaler_given and self.scaler is not None:  # a scaler passed by hand is hooked as usual
            hooks.wrap(self.scaler.obj, self.scaler.hook_name, before=eager(steps.on_scaler_update))

    def grad_flags(self, params: list[nn.Parameter], exact: bool = True) -> list:
        return []  # each gradient is checked as its parameter receives it (attach_grad_watch)

    def attach_grad_watch(self, hooks: HookSet, infos: Iterator[Any], receive: GradReceiver) -> None:
        for info in infos:
            module = info.module()
            for name, p in module.named_parameters(recurse=False) if module is not None else ():
                if p.requires_grad:
                    hooks.add(p.register_hook(functools.partial(receive, info, "grad:" + name)))

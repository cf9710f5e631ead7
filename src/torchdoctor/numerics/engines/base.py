"""The plain engine: a model (DDP, DataParallel, FSDP1/FSDP2, accelerate looked through) and a torch optimizer.

An engine adapter answers, for the machinery around one model, the questions the monitor asks:

* which parameters train (:meth:`Engine.trainable`; the user's module is handed in already unwrapped:
  :class:`~..record.watched.WatchedModel` walks the wrappers once, and names the modules);
* where a training step ends and how to check it *before* the update (:meth:`Engine.install`);
* which gradients are about to be applied (:meth:`Engine.grad_flags`);
* which loss scaler is in play (:meth:`Engine.loss_scaler`);
* whether parameters can be measured when a report is built, or only while their module runs
  (:attr:`Engine.params_at_forward`: DeepSpeed ZeRO-3 gathers them only then).

FSDP needs nothing of its own here: its parameters and gradients are DTensors (FSDP2) or flat
slices (FSDP1) that :func:`~torchdoctor.numerics.stats.local_part` reads on this rank, its wrappers
and classes are looked through by :mod:`~torchdoctor.numerics.wrappers`, and its optimizer is a torch
optimizer. DeepSpeed has its own adapter (:mod:`.deepspeed`).
"""

from __future__ import annotations

import logging
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ..measure.stats import FLAT_ELEMENTS, finite_flags_of, flatten_dense
from ..measure.windows import cpu_paths
from .hookset import HookSet
from .scalers import LossScaler

log = logging.getLogger("torchdoctor.numerics")
_grad = operator.attrgetter("grad")


def eager(fn: Any) -> Any:
    """A step callback that runs as plain Python even inside a compiled optimizer step (``@torch.compile``
    around ``opt.step()``): traced, the monitor's bookkeeping would add a guard per step (a recompilation
    each time). Dynamo is only asked when it is already loaded, as it is by then in a compiled program."""
    if "torch._dynamo" in sys.modules:
        return torch._dynamo.disable(fn)
    return fn


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside wrappers that do not initialise its hooks (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``): they keep it as ``.optimizer``
    (Lightning as ``._optimizer``)."""
    for _ in range(8):
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


class StepHooks(Protocol):
    """What an engine calls around the optimizer's step and the loss scaler (the monitor's step logic:
    :class:`~..judge.steps.Steps`)."""

    def on_pre_step_hook(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None: ...
    def on_pre_step(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict] | None: ...
    def on_post_step(self, *args: Any, **kwargs: Any) -> None: ...
    def on_zero_grad(self, *args: Any, **kwargs: Any) -> None: ...
    def on_scaler_update(self, *args: Any, **kwargs: Any) -> None: ...


#: ``receive(module info, "grad:<name>", gradient)``: a parameter received its gradient in the backward.
GradReceiver = Callable[[Any, str, torch.Tensor], None]


class Engine:
    """A model trained by a torch optimizer, under any wrapper that only forwards the call. ``root``: the user's
    module, already unwrapped."""

    kind = "plain"
    params_at_forward = False  # parameters are measured when a report is built, not during the step
    grads_at_report = True  # parameter gradients (p.grad) still exist when the step is checked

    def __init__(self, root: nn.Module, optimizer: Any, scaler: Any) -> None:
        self._flat_for: list | None = None  # the parameter list _flat_plan decided for
        self._flat = False
        self.root = root
        self.warnings: list[str] = []
        self.optimizer = self._hookable(optimizer)
        self.scaler = self.loss_scaler(scaler)

    # ------------------------------------------------------------------ the model
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.root.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ the step
    def _hookable(self, optimizer: Any) -> Any:
        if optimizer is None:
            return None
        inner = torch_optimizer(optimizer)
        if callable(getattr(inner, "register_step_pre_hook", None)) and hasattr(inner, "_optimizer_step_pre_hooks"):
            return inner
        if callable(getattr(inner, "step", None)):
            return inner  # no step hooks: its step() method is wrapped instead (see install)
        self.warnings.append(
            f"optimizer={type(optimizer).__name__} has no step() to hook: non-finite values are still detected "
            "(gradients when each backward ends, activations at each forward), but a bad update cannot be "
            "stopped before it is applied. Pass the torch optimizer, or call mon.step() before the update."
        )
        return None

    def install(self, hooks: HookSet, steps: StepHooks) -> None:
        """Check each step before the update: the optimizer's step pre-hook (or a wrapper around its
        ``step`` when it has no hooks), and notice steps a loss scaler skipped."""
        opt = self.optimizer
        if opt is not None:
            if hasattr(opt, "_optimizer_step_pre_hooks"):
                hooks.add(opt.register_step_pre_hook(eager(steps.on_pre_step_hook)))
                hooks.add(opt.register_step_post_hook(eager(steps.on_post_step)))
            else:
                log.info("%s has no step hooks: wrapping its step() instead", type(opt).__name__)
                hooks.wrap(opt, "step", before=eager(steps.on_pre_step), after=eager(steps.on_post_step))
            if self.scaler is None and callable(getattr(opt, "zero_grad", None)):
                hooks.wrap(opt, "zero_grad", before=eager(steps.on_zero_grad))
        if self.scaler is not None:
            hooks.wrap(self.scaler.obj, self.scaler.hook_name, before=eager(steps.on_scaler_update))

    skips_overflow = False  # does the optimizer itself skip a step whose gradients overflowed?

    def attach_grad_watch(self, hooks: HookSet, infos: Iterator[Any], receive: GradReceiver) -> None:
        """Engines whose gradients are gone before the step check them as they arrive (none here): ``receive`` each
        gradient a parameter of one of ``infos``' modules receives."""

    def grad_flags(self, params: list[nn.Parameter], exact: bool = True) -> list[torch.Tensor]:
        """On-device "finite" flags of the gradients the optimizer is about to apply (this rank's part);
        ``exact=False``: the fast check of :func:`~..stats.finite_flags_of`, confirmed when it says no."""
        grads = [g for g in map(_grad, params) if g is not None]
        if not exact and grads and cpu_paths() and self._flat_plan(params):
            try:  # every parameter a small plain fp32 CPU tensor: one flattened copy, one sum, no check per tensor
                return [torch.isfinite(flatten_dense(grads).sum())]
            except (RuntimeError, TypeError):  # a gradient of another kind after all (sparse): the general way
                pass
        return finite_flags_of(grads, exact=exact)

    def _flat_plan(self, params: list[nn.Parameter]) -> bool:
        """Decided once per parameter list: are they all plain dense fp32 CPU tensors, :data:`~..stats.FLAT_ELEMENTS`
        in all at most?"""
        if self._flat_for is not params:
            self._flat_for = params
            self._flat = sum(p.numel() for p in params) <= FLAT_ELEMENTS and all(
                p.device.type == "cpu" and p.dtype is torch.float32 and p.layout is torch.strided
                and type(p.data) is torch.Tensor for p in params)
        return self._flat

    # ------------------------------------------------------------------ loss scaling
    def loss_scaler(self, scaler: Any) -> LossScaler | None:
        return None if scaler is None else LossScaler(scaler)

"""A plain training loop under ``run --numerics``: the model is found at its first training forward
(:mod:`.first_forward`), or else from the first optimizer that steps (here), for a loop whose training forward
came before its optimizer existed, or a second model: torch calls every global optimizer step pre-hook before the
optimizer's own pre-hooks, and reads the optimizer's hooks only after the global ones have run: a monitor attached
from the global hook has its own step pre-hook run in that same ``step()``, so even that update is checked before
it is applied (the forward ran before the monitor existed: its gradients are checked, its modules' outputs were
not seen).

Which model: of the modules alive in the process (a ``gc`` scan, once per optimizer), the outermost one that holds
the most of the optimizer's parameters (so a ``DistributedDataParallel``, ``torch.compile`` or Fabric wrapper is
taken whole, and the monitor looks through it), preferring one with fewer trainable parameters the optimizer does
not hold (a container that also holds another model) and one that has a ``forward`` (a ``ModuleDict`` of models
is looked into).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...numerics.record.watched import live_modules


def param_ids(optimizer: Any) -> set[int]:
    return {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())}


def _score(module: nn.Module, wanted: set[int]) -> tuple[int, int]:
    covered = foreign = 0
    for p in module.parameters():
        if id(p) in wanted:
            covered += 1
        elif p.requires_grad:
            foreign += 1
    return covered, -foreign


def _callable(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward  # ModuleList / ModuleDict have none


def pick_model(wanted: set[int], modules: list[nn.Module] | None = None) -> nn.Module | None:
    """The model that trains the parameters ``wanted`` (ids), or None when no module holds any of them."""
    if not wanted:
        return None
    if modules is None:
        modules = live_modules()
    inner = {id(c) for m in modules for c in m._modules.values() if c is not None}
    level = [m for m in modules if id(m) not in inner]  # the outermost modules
    while level:
        scored = [(_score(m, wanted), m) for m in level]
        best_score = max(s for s, _ in scored)
        if best_score[0] == 0:
            return None
        best = next(m for s, m in scored if s == best_score)
        if _callable(best):
            return best
        level = [c for c in best._modules.values() if c is not None]  # a container: look inside
    return None


def optimizer_of(module: nn.Module) -> Any:
    """The torch optimizer alive in the process that holds the most of ``module``'s trainable parameters, or None
    (one ``gc`` scan: at a first training forward, never per step)."""
    mine = {id(p) for p in module.parameters() if p.requires_grad}
    if not mine:
        return None
    found = [(len(mine & param_ids(o)), o) for o in gc.get_objects()
             if issubclass(type(o), torch.optim.Optimizer)]  # (type(): a lazy proxy warns on isinstance)
    most = max((n for n, _ in found), default=0)
    if not most:
        return None
    best = [o for n, o in found if n == most]
    # a wrapper around another of them (Fabric's, accelerate's): the optimizer inside, as its step hook would see it
    inner = {id(getattr(o, attr, None)) for o in best for attr in ("optimizer", "_optimizer")}
    return next((o for o in best if id(o) in inner), best[0])


def find_scaler() -> Any:
    """The one enabled ``GradScaler`` alive in the process, else None (several: which is whose is unknown)."""
    cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if cls is None:
        return None
    found = [o for o in gc.get_objects() if issubclass(type(o), cls) and getattr(o, "_enabled", True)]
    return found[0] if len(found) == 1 else None


class PlainLoops:
    """The global optimizer step pre-hook: attach to the model of each optimizer the first time it steps."""

    def __init__(self, attach: Callable[[nn.Module, Any, Any], None], warn: Callable[[str], None]) -> None:
        self._attach = attach  # (model, optimizer, scaler)
        self._warn = warn
        self._seen: weakref.WeakSet = weakref.WeakSet()  # (torch.optim.Optimizer takes weak references)

    def hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if optimizer in self._seen:
                return None
            self._seen.add(optimizer)
            model = pick_model(param_ids(optimizer))
            if model is not None:
                self._attach(model, optimizer, find_scaler())
        except Exception as e:  # never the training's failure, unless it is the verdict (weights already nan)
            from ...numerics.errors import NonFiniteError

            if isinstance(e, NonFiniteError):
                raise
            self._warn(f"could not attach to {type(optimizer).__name__}'s model: {type(e).__name__}: {e}")
        return None

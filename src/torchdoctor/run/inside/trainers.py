"""The trainers ``run --numerics`` attaches to by name, once their module is imported: the HF ``Trainer`` and
Lightning's ``Trainer`` get torchdoctor's callback as their ``__init__`` returns (unless the script gave them
one), and the engine ``deepspeed.initialize`` returns gets a monitor (unless a Trainer drives it, or the script
watches it already). ``attach`` below is the narrow interface they share with :mod:`.startup`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

_MARK = "_torchdoctor_switch"


class Attach(Protocol):
    monitor_kwargs: dict[str, Any]
    driven_by_trainer: bool

    def announce(self, monitor: Any, via: str) -> None: ...
    def engine(self, engine: Any) -> None: ...
    def warn(self, text: str) -> None: ...


def _after(cls: Any, name: str, then: Callable[[Any], None]) -> None:
    """``cls.name(self, ...)`` followed by ``then(self)`` (patched once; ``then`` never raises into the caller)."""
    original = getattr(cls, name, None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        then(self)  # (a subclass's __init__ goes on after this; what `then` adds is kept)
        return out

    setattr(patched, _MARK, True)
    setattr(cls, name, patched)


def _switch_callback(base: type, start_hook: str, via: str, attach: Attach) -> Any:
    """``base`` (a torchdoctor callback) that also announces what its monitor watches once it attached."""

    class SwitchNumericsCallback(base):
        def _announced(self, *args: Any, **kwargs: Any) -> None:
            getattr(super(), start_hook)(*args, **kwargs)
            if self.monitor is not None:
                attach.announce(self.monitor, via)

    setattr(SwitchNumericsCallback, start_hook, SwitchNumericsCallback._announced)
    return SwitchNumericsCallback(_via="switch", **attach.monitor_kwargs)


def _add_callback(trainer: Any, attach: Attach, via: str) -> None:
    """Give ``trainer`` (an HF or a Lightning Trainer whose ``__init__`` just returned) torchdoctor's callback."""
    name = {"hf": "the HF Trainer", "lightning": "Lightning's Trainer"}[via]
    try:
        if via == "hf":
            from ...integrations.hf import NumericsCallback

            callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", [])
            start_hook = "on_train_begin"
        else:
            from ...integrations.lightning import NumericsCallback

            callbacks = trainer.callbacks
            start_hook = "on_fit_start"
        if any(isinstance(cb, NumericsCallback) for cb in callbacks):
            return  # the script's own (its monitor is then noted when the optimizer first steps)
        callback = _switch_callback(NumericsCallback, start_hook, via, attach)
        if via == "hf":
            trainer.add_callback(callback)
        else:
            callbacks.append(callback)
        attach.driven_by_trainer = True
    except Exception as e:
        attach.warn(f"could not add the callback to {name}: {type(e).__name__}: {e}")


def hf(module: ModuleType, attach: Attach) -> None:
    """``transformers.trainer`` was imported."""
    _after(module.Trainer, "__init__", lambda trainer: _add_callback(trainer, attach, "hf"))


def lightning(module: ModuleType, attach: Attach) -> None:
    """``lightning.pytorch.trainer.trainer`` (or ``pytorch_lightning.trainer.trainer``) was imported."""
    _after(module.Trainer, "__init__", lambda trainer: _add_callback(trainer, attach, "lightning"))


def deepspeed(module: ModuleType, attach: Attach) -> None:
    """``deepspeed`` was imported: wrap ``deepspeed.initialize``."""
    original = getattr(module, "initialize", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        engine = out[0] if isinstance(out, tuple) and out else out
        if not attach.driven_by_trainer:  # a Trainer's callback watches the engine it made
            attach.engine(engine)
        return out

    setattr(initialize, _MARK, True)
    module.initialize = initialize

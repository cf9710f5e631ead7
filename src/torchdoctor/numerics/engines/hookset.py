"""Every hook a monitor puts in place, in one set that removes them all: handles, and methods shadowed on objects.

A monitor meets the model and the machinery around it through hooks: module hooks, tensor hooks, optimizer step
hooks, and, where an object has no hooks (DeepSpeed's optimizers, a loss scaler's ``update``), an instance attribute
that shadows the method. :class:`HookSet` keeps all of them, so that :meth:`HookSet.close` undoes each exactly once
whoever added it (the engine adapter, the compiled regions, the recorder), and :attr:`HookSet.active` is the one
switch that tells every hook whether the monitor still watches (``False`` once it stopped or closed: a hook that
outlives it does nothing).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any


class HookSet:
    """The hooks of one monitor (see the module docstring)."""

    def __init__(self) -> None:
        self.active = False  # the monitor watches: hooks act (set once attached; False once stopped or closed)
        self.closed = False
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any, Any]] = []

    def add(self, handle: Any) -> Any:
        """Keep a hook handle (anything with ``remove()``); :meth:`close` removes it."""
        self._handles.append(handle)
        return handle

    def wrap(self, obj: Any, attr: str, before: Any, after: Any = None) -> None:
        """Shadow ``obj.attr`` with an instance attribute that calls ``before(*args, **kwargs)`` first
        (and ``after`` once it returned); undone by :meth:`close`. ``before`` may return new ``(args, kwargs)``, as a
        torch step pre-hook may."""
        original = getattr(obj, attr)

        @functools.wraps(original)  # keeps what wrappers set on it (LR schedulers' _wrapped_by_lr_sched)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            replaced = before(*args, **kwargs)
            if replaced is not None:  # new (args, kwargs), as a torch step pre-hook may return
                args, kwargs = replaced
            out = original(*args, **kwargs)
            if after is not None:
                after(*args, **kwargs)
            return out

        previous = obj.__dict__.get(attr)
        wrapper._torchdoctor_previous = previous  # type: ignore[attr-defined]
        wrapper._torchdoctor_owner = weakref.ref(self)  # type: ignore[attr-defined]
        self._restore.append((obj, attr, previous, wrapper))
        setattr(obj, attr, wrapper)

    def replace(self, obj: Any, attr: str, new: Any) -> None:
        """Shadow ``obj.attr`` with ``new`` (an instance attribute), undone by :meth:`close`."""
        previous = obj.__dict__.get(attr)
        new._torchdoctor_previous = previous  # type: ignore[attr-defined]
        new._torchdoctor_owner = weakref.ref(self)  # type: ignore[attr-defined]
        self._restore.append((obj, attr, previous, new))
        setattr(obj, attr, new)

    def close(self) -> None:
        """Remove every hook and put every shadowed method back (safe to call twice)."""
        self.active = False
        self.closed = True
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        for obj, attr, old, wrapper in reversed(self._restore):
            if obj.__dict__.get(attr) is not wrapper:
                continue  # wrapped again by someone else since: leave theirs, ours is now a pass-through
            while hasattr(old, "_torchdoctor_owner") and not getattr(old._torchdoctor_owner(), "active", False):
                old = old._torchdoctor_previous  # skip wrappers of monitors closed in the meantime
            if old is None:
                obj.__dict__.pop(attr, None)
            else:
                setattr(obj, attr, old)
        self._restore = []

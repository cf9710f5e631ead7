"""A plain loop's first training forward under ``run --numerics``: the monitor attaches before it runs.

torch's global module forward pre-hook sees every module call; the first outermost call made with gradients on (not
under ``no_grad``, not a recomputation in a backward) whose trainable parameters an optimizer alive in the process
holds is the loop's first training forward. The monitor attaches there, before that forward runs, to the model that
optimizer trains (:func:`.plain.pick_model`), with the one enabled ``GradScaler`` alive (if any) -- so step 0 is seen
whole, and a loop whose scaler skips every ``optimizer.step()`` (fp16 overflowing from the first step) is watched all
the same. The global hooks are then removed: a healthy step pays nothing for them. The call that began before the
monitor existed is handed to it (``NumericsMonitor._joined_in_forward``).

Installed while ``torch`` is being imported (the module ``torch.nn.modules.module`` is handed over), so nothing here
imports torch before a module is first called.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any


def _call_kwargs() -> dict | None:
    """The keyword arguments of the module call whose global pre-hook runs now, read from ``Module._call_impl``'s
    inner frame (the hook itself is given only the positional ones); None where that frame is not found."""
    frame = sys._getframe(2)
    if frame.f_code.co_name == "inner":
        kwargs = frame.f_locals.get("kwargs")
        if isinstance(kwargs, dict):
            return kwargs
    return None


class FirstForward:
    """torch's global module forward hooks, until the loop's first training forward attaches a monitor (see the
    module docstring). ``attach(model, optimizer, scaler, call)``: ``call`` is ``(module, args, kwargs)`` of the call
    under way (``kwargs`` None when they could not be read)."""

    TRIES = 32  # distinct outermost modules called with gradients on before giving up (none trained)

    def __init__(self, attach: Callable[..., None], warn: Callable[[str], None]) -> None:
        self._attach = attach
        self._warn = warn
        self._depth = 0
        self._tried: weakref.WeakSet = weakref.WeakSet()
        self._handles: list[Any] = []

    def install(self, module: Any) -> None:
        """``module``: ``torch.nn.modules.module`` (handed over as it is imported, before ``torch`` is whole)."""
        self._handles = [module.register_module_forward_pre_hook(self._pre),
                         module.register_module_forward_hook(self._post, always_call=True)]

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _post(self, *_: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _pre(self, module: Any, args: Any) -> None:
        self._depth += 1
        if self._depth != 1 or module in self._tried:
            return
        import torch  # (whole by the time a module is called)

        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 or torch.compiler.is_compiling():
            return
        from .plain import find_scaler, optimizer_of, param_ids, pick_model

        try:
            self._tried.add(module)
            if len(self._tried) > self.TRIES:
                self.remove()
                return
            optimizer = optimizer_of(module)
            if optimizer is None:
                return  # not trained (a frozen model, a loss module), or its optimizer is made later
            model = pick_model(param_ids(optimizer))
            if model is None:
                return
            self.remove()  # (before attaching: the monitor's own hooks take over from here)
            self._attach(model, optimizer, find_scaler(), (module, args, _call_kwargs()))
        except Exception as e:  # never the training's failure, unless it is the verdict (weights already nan)
            from ...numerics.errors import NonFiniteError

            if isinstance(e, NonFiniteError):
                raise
            self.remove()
            self._warn(f"could not attach at the first training forward of {type(module).__name__}: "
                       f"{type(e).__name__}: {e}")

"""The first op of a replay that turns finite values into non-finite ones (:class:`FirstInvalidOp`), with the user's
line that made it and the watched module whose forward was running when it did.

In the forward, the op is seen as it runs (a dispatch mode), and the module is the innermost one whose forward is
under way (global module hooks, for the replay only). In the backward, the op is a backward node; anomaly mode
records the forward line that created the node, and a function mode above autograd tags each node a torch function
creates in the forward with the module running it -- so the backward's first bad node names the module whose code
made it (``x.sqrt()`` in a block's own ``forward``: that block, not the module whose gradient first showed the nan).
A node made inside a composite op that torch builds in C++ has no tag: the module is then not said.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_OURS = (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
         os.path.dirname(os.path.abspath(torch.__file__)))
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>.*)$', re.M)
_TAG = "torchdoctor_module"  # (the key of a node's metadata that holds the module that made it)


class _ModuleTags(TorchFunctionMode):
    """Tags each autograd node a torch function makes with the watched module whose forward is running."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        if self.stack:
            # only a node this call made: one an input already had (x.to(its own dtype), .contiguous() returning x,
            # a custom autograd.Function's node, which no torch function saw) is not this module's to claim
            given = {id(t.grad_fn) for t in _tensors((args, kwargs)) if t.grad_fn is not None}
            for t in out if isinstance(out, (tuple, list)) else (out,):
                node = t.grad_fn if isinstance(t, torch.Tensor) else None
                if node is not None and id(node) not in given and _TAG not in node.metadata:
                    node.metadata[_TAG] = self.stack[-1]
        return out


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments (nested in tuples, lists and dicts, as torch.cat's are)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class FirstInvalidOp(TorchDispatchMode):
    """The first op of a replay that makes a non-finite value from inputs that were all finite: in the forward a nan
    (an inf there is an overflow, not an invalid op), in the backward an inf or a nan, with the backward node running
    it, the forward line that made that node (anomaly mode's record) and the module (``names``: id of each watched
    module -> its qualified name) whose forward made it. ``found`` after the replay: ``op``, ``where`` (file, line,
    code, or None), ``phase``, ``nan``, ``module`` (a name, or None where it is not known). ``in_backward``: the same
    for the first backward node whose output is non-finite, whatever its inputs -- where the gradients, finite until
    then, went bad (a nan made in the forward and masked there, in the branch ``torch.where`` does not select, is
    read back by its op's backward)."""

    def __init__(self, names: dict[int, str] | None = None) -> None:
        super().__init__()
        self.found: dict[str, Any] | None = None
        self.in_backward: dict[str, Any] | None = None
        self.names = names or {}
        self.stack: list[str] = []

    @contextlib.contextmanager
    def watching(self) -> Any:
        def enter(module: Any, *_: Any) -> None:
            name = self.names.get(id(module))
            if name is not None:
                self.stack.append(name)

        def leave(module: Any, *_: Any) -> None:
            if self.names.get(id(module)) is not None and self.stack:
                self.stack.pop()

        hooks = (torch.nn.modules.module.register_module_forward_pre_hook(enter),
                 torch.nn.modules.module.register_module_forward_hook(leave, always_call=True))
        try:
            with torch.autograd.set_detect_anomaly(True, check_nan=False), _ModuleTags(self.stack), self:
                yield
        finally:
            for h in hooks:
                h.remove()
            self.stack.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        if self.found is not None and self.in_backward is not None:
            return out
        node = torch._C._current_autograd_node()
        if node is None:
            if self.found is None and _has_nan(out) and not _bad(args, kwargs):
                self.found = {"op": str(func), "where": user_frame("".join(traceback.format_stack())),
                              "phase": "forward", "nan": True, "module": self.stack[-1] if self.stack else None}
            return out
        if not (_has_nan(out) or _has_inf(out)):
            return out
        trace = "".join(node.metadata.get("traceback_") or ())
        entry = {"op": node.name(), "where": user_frame(trace), "phase": "backward", "nan": _has_nan(out),
                 "module": node.metadata.get(_TAG)}
        if self.in_backward is None:  # (the gradients before it were finite; it may read a nan saved in the forward)
            self.in_backward = entry
        if self.found is None and not _bad(args, kwargs):
            self.found = entry
        return out


def user_frame(trace: str) -> dict[str, Any] | None:
    """The innermost frame of a forward traceback (anomaly mode's) that is the user's code, not torch's or ours."""
    frames = [m.groupdict() for m in _FRAME.finditer(trace)]
    for f in reversed(frames):
        path = os.path.abspath(f["file"])
        if not path.startswith(_OURS):
            return {"file": f["file"], "line": int(f["line"]), "code": f["code"].strip()}
    return None


def _bad(args: tuple, kwargs: dict | None) -> bool:
    return any(_has_nan(a) or _has_inf(a) for a in (*args, *(kwargs or {}).values()))


def _has_nan(x: Any) -> bool:
    return _has(x, math.isnan, torch.isnan)


def _has_inf(x: Any) -> bool:
    return _has(x, math.isinf, torch.isinf)


def _has(x: Any, number: Any, tensor: Any) -> bool:
    """Does ``x`` -- a tensor, a Python number an op is given (``x * float("inf")``), a list or tuple of them -- hold a
    value ``number`` / ``tensor`` says yes to?"""
    if isinstance(x, float):
        return number(x)
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel():
        return bool(tensor(x).any())
    if isinstance(x, (list, tuple)):
        return any(_has(v, number, tensor) for v in x)
    return False

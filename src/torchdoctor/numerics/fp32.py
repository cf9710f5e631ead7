"""Run chosen modules in fp32 inside an fp16/bf16 model: the fix from the debugging guide.

The guide's T5 example overflows because one region (the gated-GELU feed-forward of
``encoder.block.2.layer.1``) produces activations close to fp16's 65504; the next Dropout's
``1/(1-p)`` rescale pushes them to inf. Its fix is to run that region with autocast disabled so it
computes in fp32. :func:`keep_fp32` applies that fix to a module from the outside, without editing
the model's code, and can undo it.

Example usage::

    guard = keep_fp32(model, "encoder.block.*.layer.1")      # glob over named_modules() names
    with keep_fp32(model.encoder.block[2].layer[1], model=model):
        loss = model(batch).loss                             # that layer computes in fp32

Inside a guarded module:

* autocast is disabled for every device type on which it is enabled at call time;
* fp16/bf16 (any floating dtype narrower than 32 bits) tensors among the positional and keyword
  arguments, nested in tuples, lists and dicts, are cast to float32;
* fp16/bf16 parameters and buffers of the module and its children are replaced, for the duration
  of the call only, by float32 copies, so a ``model.half()`` network also computes the region in
  fp32. The copies are made with ``Tensor.float()``, so gradients flow back to the original
  parameters and arrive in their own dtype. No parameter or buffer is added: ``state_dict()`` and
  ``load_state_dict()`` are unchanged.

The output is left in fp32 by default (``cast_output=False``). That default is what keeps the
guide's example finite: there the overflow is in the guarded region's *output* (6.27e4, times
1/(1-p) = 6.97e4 > 65504), so casting it back to fp16 would recreate the inf at the boundary.
Left in fp32, the residual add promotes the stream to fp32 and autocast casts per op downstream
(a T5-style RMS norm computes in fp32 anyway). Pass ``cast_output=True`` when the region feeds
an fp16 layer directly in a ``model.half()`` network (which would reject an fp32 input) and its
output is known to fit the input's dtype.

Mechanism: an instance-level ``forward`` attribute (a small picklable callable object, not a
closure) that shadows the class's ``forward``. ``nn.Module.__call__`` looks ``self.forward`` up on
the instance, so the module's own hooks still run exactly once per call, outside the fp32 region
(pre-hooks see the original inputs, forward hooks see the fp32 output). ``Fp32Guard.remove()``
deletes the attribute again, or puts back an instance ``forward`` that was there before.

Known limitations:

* Shallow copies of a guarded module (``copy.copy``, ``nn.DataParallel`` replicas) share the
  wrapper, which runs the *original* module. Guard the replicas' source after replication, or use
  DDP/FSDP, which do not copy modules. ``copy.deepcopy`` and pickling are fine: the copy is
  guarded too and :meth:`Fp32Guard.attached_to` finds its guards.
* Code that calls ``module.forward(...)`` through the class (``type(m).forward(m, x)``) bypasses
  the guard.
* fp16/bf16 buffers of the region are copied to fp32 and back on every call, so in-place updates
  (BatchNorm running statistics, caches) survive, rounded to the buffer's dtype; a large
  low-precision buffer (a KV cache) costs two copies per call.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .engines.wrappers import named_user_modules

__all__ = ["Fp32Guard", "keep_fp32", "kept_in_fp32"]

# Device types torch.autocast knows about. Which of them are valid depends on the torch build, so
# they are probed once (torch.is_autocast_enabled raises RuntimeError for unknown ones).
_AUTOCAST_CANDIDATES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia")
_autocast_device_types: tuple[str, ...] | None = None


def _known_autocast_device_types() -> tuple[str, ...]:
    global _autocast_device_types
    if _autocast_device_types is None:
        names = list(_AUTOCAST_CANDIDATES)
        privateuse1 = torch._C._get_privateuse1_backend_name()
        if privateuse1 not in names:
            names.append(privateuse1)
        valid = []
        for name in names:
            try:
                torch.is_autocast_enabled(name)
            except RuntimeError:
                continue
            valid.append(name)
        _autocast_device_types = tuple(valid)
    return _autocast_device_types


def _enabled_autocast_device_types() -> list[str]:
    return [d for d in _known_autocast_device_types() if torch.is_autocast_enabled(d)]


def _is_low_precision(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype.itemsize < 4


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in ``obj``, rebuilding tuples (named too), lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [_map_tensors(x, fn) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if isinstance(obj, dict):
        # dict subclasses (e.g. transformers' ModelOutput) are rebuilt in place on a shallow copy
        # so their own type and extra attributes survive.
        out = obj.copy() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _map_tensors(v, fn)
        return out
    return obj


def _first_low_precision_dtype(obj: Any) -> torch.dtype | None:
    if _is_low_precision(obj):
        return obj.dtype
    if isinstance(obj, (tuple, list)):
        items: Iterable[Any] = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        dtype = _first_low_precision_dtype(item)
        if dtype is not None:
            return dtype
    return None


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if _is_low_precision(t) else t


@contextlib.contextmanager
def _fp32_state(module: nn.Module) -> Iterator[None]:
    """Swap low-precision params/buffers of ``module``'s subtree for fp32 copies during the block.

    Done on the ``_parameters``/``_buffers`` dicts directly (as torch.nn.utils.stateless does)
    rather than through ``torch.func.functional_call``, which would call the module again and
    fire its hooks a second time. A tensor shared by several submodules gets one copy.

    Buffers are written back afterwards: kernels such as batch_norm update running statistics in
    place without bumping the version counter, so a change cannot be detected cheaply, and an
    fp16/bf16 -> fp32 -> fp16/bf16 round trip is exact for values that did not change.
    Parameters are written back only if their copy was modified in place (version counter).
    """
    copies: dict[int, tuple[torch.Tensor, int]] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    buffers: dict[int, torch.Tensor] = {}
    try:
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, tensor in store.items():
                    if not _is_low_precision(tensor):
                        continue
                    if id(tensor) not in copies:
                        copy = tensor.float()
                        copies[id(tensor)] = (copy, copy._version)
                    if store is sub._buffers:
                        buffers[id(tensor)] = tensor
                    store[name] = copies[id(tensor)][0]
                    swapped.append((store, name, tensor))
        yield
    finally:
        written: set[int] = set()
        for store, name, original in reversed(swapped):
            copy, version = copies[id(original)]
            current = store.get(name)
            if current is copy:
                store[name] = original
                if id(original) not in written and (id(original) in buffers or copy._version != version):
                    written.add(id(original))
                    with torch.no_grad():
                        original.copy_(copy)
            elif isinstance(current, torch.Tensor) and current.is_floating_point():
                # The forward re-assigned the attribute; keep its value in the original dtype.
                store[name] = current.to(original.dtype)


class _Fp32Forward:
    """The instance ``forward`` installed by :func:`keep_fp32` (a class, so modules stay picklable).

    Holds the module weakly so that installing it creates no reference cycle.
    """

    __slots__ = ("_module_ref", "previous", "cast_output", "enabled")

    def __init__(self, module: nn.Module, previous: Callable[..., Any] | None, cast_output: bool) -> None:
        self._module_ref = weakref.ref(module)
        self.previous = previous
        self.cast_output = cast_output
        self.enabled = True

    @property
    def module(self) -> nn.Module:
        module = self._module_ref()
        if module is None:
            raise ReferenceError("the module guarded by keep_fp32 no longer exists")
        return module

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        # inspect.signature() follows __wrapped__, so tools that read forward's signature
        # (e.g. transformers' Trainer dropping unused dataset columns) still see the real one.
        if self.previous is not None:
            return self.previous
        module = self.module
        return type(module).forward.__get__(module, type(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.__wrapped__
        if not self.enabled:
            return forward(*args, **kwargs)
        input_dtype = _first_low_precision_dtype((args, kwargs)) if self.cast_output else None
        args, kwargs = _map_tensors((args, kwargs), _upcast)
        with contextlib.ExitStack() as stack:
            for device_type in _enabled_autocast_device_types():
                stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(_fp32_state(self.module))
            output = forward(*args, **kwargs)
        if input_dtype is not None:
            output = _map_tensors(output, _Downcast(input_dtype))
        return output

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_fp32_forward, (self.module, self.previous, self.cast_output, self.enabled))

    def __repr__(self) -> str:
        return f"<keep_fp32 forward of {type(self.module).__name__}>"


class _Downcast:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t


def _rebuild_fp32_forward(
    module: nn.Module, previous: Callable[..., Any] | None, cast_output: bool, enabled: bool
) -> _Fp32Forward:
    wrapper = _Fp32Forward(module, previous, cast_output)
    wrapper.enabled = enabled
    return wrapper


def _installed_wrapper(module: nn.Module) -> _Fp32Forward | None:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, _Fp32Forward) else None


def kept_in_fp32(modules: Iterable[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """The names, among ``(name, module)`` pairs, of the modules a :func:`keep_fp32` guard keeps in fp32 now
    (an enabled wrapper is installed on them): what a report's advice must extend, never replace."""
    return tuple(name for name, module in modules if (w := _installed_wrapper(module)) is not None and w.enabled)


def _has_own_forward(module: nn.Module) -> bool:
    # Containers (ModuleList, ModuleDict, ...) inherit the "not implemented" forward.
    return type(module).forward is not nn.Module.forward


def _display_name(name: str, module: nn.Module) -> str:
    return name if name else f"<{type(module).__name__}>"


class Fp32Guard:
    """Handle for the modules :func:`keep_fp32` made compute in fp32.

    Attributes:
        modules (list[tuple[str, nn.Module]]): (qualified name, module) pairs, in
            ``named_modules()`` order. The name is relative to the root passed to
            :func:`keep_fp32` (``""`` for a module given without ``model=``).
        cast_output (bool): whether floating outputs are cast back to the input's dtype.

    Use it as a context manager, or call :meth:`remove`; removing twice does nothing.
    """

    def __init__(self, entries: list[tuple[str, nn.Module, _Fp32Forward]], cast_output: bool) -> None:
        self._entries = entries
        self.cast_output = cast_output
        self.modules: list[tuple[str, nn.Module]] = [(name, module) for name, module, _ in entries]

    @property
    def active(self) -> bool:
        """True until :meth:`remove` has run."""
        return any(wrapper.enabled for _, _, wrapper in self._entries)

    @property
    def names(self) -> list[str]:
        """The qualified names of the guarded modules."""
        return [name for name, _ in self.modules]

    def remove(self) -> None:
        """Restore every guarded module's original ``forward`` exactly.

        If something replaced a module's ``forward`` after the guard was installed (so that
        removing the attribute would also drop the newer wrapper), the guard is switched off in
        place instead and a warning says so.
        """
        for name, module, wrapper in self._entries:
            if not wrapper.enabled:
                continue
            wrapper.enabled = False
            if module.__dict__.get("forward") is wrapper:
                if wrapper.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = wrapper.previous
            else:
                warnings.warn(
                    f"keep_fp32: {_display_name(name, module)}.forward was replaced after the fp32 "
                    "guard was installed; the guard is disabled but its wrapper stays in the chain.",
                    stacklevel=2,
                )

    @classmethod
    def attached_to(cls, root: nn.Module) -> Fp32Guard:
        """Return a guard over the fp32 wrappers already installed in ``root``'s modules.

        Useful after ``copy.deepcopy`` or unpickling a guarded model, whose copy is guarded too
        but has no guard object to remove it with.
        """
        entries = []
        cast_output = False
        for name, module in root.named_modules():
            wrapper = _installed_wrapper(module)
            if wrapper is not None and wrapper.enabled:
                entries.append((name, module, wrapper))
                cast_output = cast_output or wrapper.cast_output
        return cls(entries, cast_output)

    def __enter__(self) -> Fp32Guard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        names = ", ".join(_display_name(name, module) for name, module in self.modules)
        state = "active" if self.active else "removed"
        return f"Fp32Guard([{names}], cast_output={self.cast_output}, {state})"


def _match(root: nn.Module, pattern: str | re.Pattern[str]) -> list[tuple[str, nn.Module]]:
    """Modules of ``root`` whose qualified name matches; descendants of a match are left out.

    A glob is matched with ``fnmatch.fnmatchcase`` and a regex with ``fullmatch``, both against the
    whole name. A match's descendants already compute in fp32, so guarding them as well would only
    add overhead. Containers without a forward of their own are skipped (their children may match).
    """
    is_regex = isinstance(pattern, re.Pattern)
    shown = pattern.pattern if is_regex else pattern
    names: list[str] = []
    found: list[tuple[str, nn.Module]] = []
    for name, module in named_user_modules(root):
        names.append(name)
        hit = pattern.fullmatch(name) is not None if is_regex else fnmatch.fnmatchcase(name, pattern)
        if not hit or not _has_own_forward(module):
            continue
        if any(parent == "" or name.startswith(parent + ".") for parent, _ in found):
            continue
        found.append((name, module))
    if not found and not is_regex and "." in pattern and not any(c in pattern for c in "*?["):
        # a name from a wrapper's view of the model (a training script's task object holding the model as
        # ``trainable_module``, as torchdoctor named it): the same modules under the model itself, when exactly one
        # tail of the name is a name here
        parts = pattern.split(".")
        for i in range(1, len(parts)):
            tail = ".".join(parts[i:])
            hits = [(n, m) for n, m in named_user_modules(root) if n == tail and _has_own_forward(m)]
            if len(hits) == 1:
                warnings.warn(f"keep_fp32: {pattern!r} is not a name in {type(root).__name__}, but {tail!r} is (the "
                              f"same module seen from inside a wrapper): keeping {tail!r} in fp32", stacklevel=4)
                return hits
    if not found:
        named = [n for n in names if n]
        close = difflib.get_close_matches(shown, named, n=5, cutoff=0.3)
        hint = f" Close names: {', '.join(close)}." if close else ""
        example = f"; names look like {named[0]!r}" if named else ""
        raise ValueError(
            f"keep_fp32: {'regex' if is_regex else 'glob'} {shown!r} matches no module of "
            f"{type(root).__name__} ({len(names)} modules{example}).{hint}"
        )
    return found


def _resolve(
    target: Any, pattern: str | re.Pattern[str] | None, model: nn.Module | None
) -> list[tuple[str, nn.Module]]:
    if isinstance(target, (str, re.Pattern)):
        if pattern is not None:
            raise ValueError("keep_fp32: give the pattern once (as target with model=, or as pattern)")
        if model is None:
            raise ValueError(f"keep_fp32: pattern {target!r} needs model= (the root module to search)")
        return _match(model, target)
    if pattern is not None:
        if not isinstance(target, nn.Module):
            raise ValueError(f"keep_fp32: with a pattern, target must be the root nn.Module, got {type(target)}")
        if model is not None:
            raise ValueError("keep_fp32: pass either a root module with a pattern, or model=, not both")
        if not isinstance(pattern, (str, re.Pattern)):
            raise ValueError(f"keep_fp32: pattern must be a glob string or a compiled regex, got {type(pattern)}")
        return _match(target, pattern)

    targets = [target] if isinstance(target, nn.Module) else target
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ValueError(
            f"keep_fp32: target must be an nn.Module, a non-empty list of modules, or a name pattern; "
            f"got {type(target).__name__}"
        )
    names_by_id: dict[int, str] = {}
    if model is not None:
        names_by_id = {id(m): name for name, m in named_user_modules(model)}
    resolved: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for module in targets:
        if not isinstance(module, nn.Module):
            raise ValueError(f"keep_fp32: target must be an nn.Module, got {type(module).__name__}")
        if not _has_own_forward(module):
            raise ValueError(
                f"keep_fp32: {type(module).__name__} has no forward of its own (a container); "
                "pass its children, e.g. list(container), or use a name pattern"
            )
        if id(module) in seen:
            continue
        seen.add(id(module))
        if model is not None and id(module) not in names_by_id:
            raise ValueError(f"keep_fp32: the {type(module).__name__} given is not a submodule of model=")
        resolved.append((names_by_id.get(id(module), ""), module))
    return resolved


def keep_fp32(
    target: nn.Module | Iterable[nn.Module] | str | re.Pattern[str],
    pattern: str | re.Pattern[str] | None = None,
    *,
    model: nn.Module | None = None,
    cast_output: bool = False,
) -> Fp32Guard:
    """Make module(s) compute in fp32, with autocast disabled, until the guard is removed.

    Args:
        target (nn.Module | list[nn.Module] | str | re.Pattern): the module(s) to guard; or the
            root module to search when ``pattern`` is given; or the pattern itself with ``model=``.
        pattern (str | re.Pattern, optional): a glob (``"encoder.block.*.layer.1"``) or compiled
            regex matched against the whole of each ``named_modules()`` name of ``target``.
            Descendants of a matched module are not guarded separately. Defaults to None.
        model (nn.Module, optional): the root model, used to name given modules (and as the root
            to search when ``target`` is a pattern). Defaults to None.
        cast_output (bool): cast floating outputs back to the dtype of the first fp16/bf16 input.
            Defaults to False, which keeps the guide's example finite (see the module docstring).

    Returns:
        Fp32Guard: what was guarded; ``remove()`` it, or use it as a context manager.

    Raises:
        ValueError: the target is not a module (or modules), or the pattern matches nothing (the
            message lists close names).
        RuntimeError: a module is already guarded; the whole call then changes nothing.
    """
    resolved = _resolve(target, pattern, model)
    for name, module in resolved:
        if _installed_wrapper(module) is not None:
            raise RuntimeError(
                f"keep_fp32: {_display_name(name, module)} is already kept in fp32; remove() the "
                "existing guard first (Fp32Guard.attached_to(model) finds it)"
            )
    entries = []
    for name, module in resolved:
        previous = module.__dict__.get("forward")
        wrapper = _Fp32Forward(module, previous, cast_output)
        module.__dict__["forward"] = wrapper
        entries.append((name, module, wrapper))
    return Fp32Guard(entries, cast_output)

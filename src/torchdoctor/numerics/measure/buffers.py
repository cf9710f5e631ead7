"""Module buffers put back after a detection: a ``BatchNorm``'s running statistics as the step began.

The forward runs on after the first nan (one host read per step), so by the time a step is judged a
``BatchNorm`` has folded that nan into ``running_mean`` / ``running_var``. Parameters and optimizer
state are safe (the update is refused), so the buffers must be too: :class:`BufferGuard` keeps a
device copy of the buffers at each step's start and copies them back when the step is reported.

What is copied: the *persistent* buffers (those in the ``state_dict``: running statistics, step
counters), not the non-persistent ones, which are derived tables or caches (a rotary ``inv_freq``, a
causal mask). Version counters cannot say which buffers a step changed: ``batch_norm`` updates its
running statistics in place without bumping them. So every persistent buffer is copied at each step's
start, with one fused ``_foreach_copy_`` into copies allocated once; buffers are small next to the
weights (a BatchNorm holds 2 floats per channel); a buffer over 1 MiB that is not a norm layer's (a
quantized layer's packed weights) is data, not step state, and is left alone.
:func:`saved_buffers` is the same put-back around the eager re-run of a compiled region.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


def _guardable(b: torch.Tensor) -> bool:
    return b.layout is torch.strided and not b.is_meta and not b.is_inference() and b.numel() > 0


def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if not pairs:
        return
    with torch.no_grad():
        for b, saved in pairs:
            b.copy_(saved)


@contextlib.contextmanager
def saved_buffers(buffers: Iterable[torch.Tensor]) -> Iterator[None]:
    """Whatever runs inside leaves these buffers as they were."""
    pairs = [(b, b.detach().clone()) for b in buffers if _guardable(b)]
    try:
        yield
    finally:
        _copy_back(pairs)


# A buffer this large that is not a norm layer's running statistics is data, not state a step updates
# (a quantized layer's packed weights: GPTQ/AWQ ``qweight``): copying it every step would cost a weight copy.
_SMALL = 1 << 20


def _guarded(m: torch.nn.Module, b: torch.Tensor) -> bool:
    norm = isinstance(m, torch.nn.modules.batchnorm._NormBase)
    return _guardable(b) and (norm or b.numel() * b.element_size() <= _SMALL)


class BufferGuard:
    """The persistent buffers of the watched modules as they were when the current step began.

    Buffers are found by (module, name) at every step's start, so one that was replaced since the guard was
    made (``model.double()``, ``.to(device)``, an assignment) is the one copied and put back."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self._slots = [(m, name) for m in modules for name in m._buffers
                       if name not in m._non_persistent_buffers_set]
        self._buffers: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []
        self.missed = 0  # buffers the last restore() could not put back (replaced since the step began)

    def _current(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for m, name in self._slots:
            b = m._buffers.get(name)
            if b is not None and _guarded(m, b):
                seen.setdefault(id(b), b)
        return list(seen.values())

    def start(self) -> None:
        """A step begins: copy the buffers (one fused copy into copies allocated once, again when a buffer was
        replaced or changed shape or dtype)."""
        current = self._current()
        same = len(current) == len(self._buffers) and all(
            a is b and a.shape == c.shape and a.dtype == c.dtype
            for a, b, c in zip(current, self._buffers, self._copies, strict=False))
        if not same:
            self._buffers, self._copies = current, [b.detach().clone() for b in current]
            return
        if current:
            with torch.no_grad():
                torch._foreach_copy_(self._copies, [b.detach() for b in current])

    def restore(self) -> int:
        """Put every buffer back as the step began; how many were put back (a buffer replaced since the step
        began, e.g. by ``model.double()``, has no copy of its own and is not counted)."""
        saved = {id(b): c for b, c in zip(self._buffers, self._copies, strict=False)}  # they hold their ids
        current = self._current()
        pairs = [(b, saved[id(b)]) for b in current if id(b) in saved]
        self.missed = len(current) - len(pairs)
        _copy_back(pairs)
        return len(pairs)

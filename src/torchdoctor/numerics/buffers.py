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
weights (a BatchNorm holds 2 floats per channel), see BENCHMARKS.md for the cost.
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


class BufferGuard:
    """The persistent buffers of the watched modules as they were when the current step began."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        seen: dict[int, torch.Tensor] = {}
        for m in modules:
            skip = m._non_persistent_buffers_set
            for name, b in m._buffers.items():
                if b is not None and name not in skip and _guardable(b):
                    seen.setdefault(id(b), b)
        self._buffers = list(seen.values())
        self._copies: list[torch.Tensor] = []

    def start(self) -> None:
        """A step begins: copy the buffers (one fused copy into copies allocated once)."""
        if not self._buffers:
            return
        if not self._copies:
            self._copies = [b.detach().clone() for b in self._buffers]
            return
        with torch.no_grad():
            torch._foreach_copy_(self._copies, [b.detach() for b in self._buffers])

    def restore(self) -> int:
        """Put every buffer back as the step began; how many there are."""
        _copy_back(list(zip(self._buffers, self._copies, strict=False)))
        return len(self._copies)

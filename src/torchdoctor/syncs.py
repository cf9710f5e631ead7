"""Count host synchronisations and dispatched ops made by torch code (used by tests and benchmarks).

A host sync is any op that makes the CPU wait for a device value: on CUDA `.item()`, `bool(t)` and
`if t:` dispatch to ``aten._local_scalar_dense`` or ``aten.is_nonzero``. On CPU the same ops run but
do not wait; counting them there still tells how often code *would* sync on an accelerator, which is
what the "one host sync per step" budget is about.

Example::

    with SyncCounter() as syncs:
        train_step()
    print(syncs.count)
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = ("_local_scalar_dense", "is_nonzero")


class _Counting(TorchDispatchMode):
    """Ops counted by name (``by_op``); ``count`` is their total."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.by_op.values())


class SyncCounter(_Counting):
    """A dispatch mode that counts ``aten._local_scalar_dense`` and ``aten.is_nonzero`` calls."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


class OpCounter(_Counting):
    """A dispatch mode that counts every ATen op dispatched (by name) and the host syncs among them.

    On an accelerator each dispatched op is at least its host-side dispatch (~5-20 us) and most are a kernel
    launch, so on a launch-bound step the count is the cost; on CPU it is countable without a GPU.
    """

    @property
    def syncs(self) -> int:
        return sum(self.by_op[name] for name in _SYNC_OPS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


__all__ = ["OpCounter", "SyncCounter"]

"""Windows: the statistics of one step, gathered on the device and reduced a few dispatches at a time.

Few dispatches per tensor. On an accelerator every dispatched op costs host time (~5-20 us) and usually a
kernel launch, and a training step of a mid-size model is launch-bound, so a few ops per module output was
the monitor's whole cost there (issue 12: +785 ops on a 3036-op T5 step). A :class:`StatBuffer` therefore
gathers floating-point tensors in a *window* and reduces the window a few ops at a time. On an accelerator
with multi-tensor ops, each one dispatch for all its tensors: ``_foreach_abs``, ``_foreach_max`` (abs max),
``_foreach_neg_`` and ``_foreach_max`` again (minus abs min), ``_foreach_neg``, one ``stack``: six dispatches
per window of up to ``WINDOW_TENSORS`` tensors. On a CPU (no launch to save, and its multi-tensor ops cost a
dispatch per tensor inside) tensors of one shape are stacked and reduced by one ``amin`` and one ``amax``
(:func:`_reduce_stacked`). Both statistics exact, nan propagated (checked per device when the monitor attaches,
:func:`window_reduce_works`). The window is bounded (``WINDOW_ELEMENTS``), so the references it holds and its
``abs`` temporaries do not grow with the batch size. A tensor changed in place before its window is
reduced (``ReLU(inplace=True)`` after a BatchNorm, ``x += residual``) no longer holds what its module returned:
its version counter says so at the reduction, its statistics become context (:attr:`StatBuffer.changed`,
:attr:`StatBuffer.moved`), never judged, and the monitor measures that module's outputs at once from then on.

The monitor judges a step from a :class:`StatBuffer`: its groups are stacked once per step and folded into the
one "all finite" flag the host reads; a report reads the values themselves (:class:`StatValues`, :func:`lookup`).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch

from .stats import CHUNK_ELEMENTS, abs_min_max

# A window is reduced when it holds this many tensors or this many elements (so at most ~2x this many
# elements are held and copied by its abs temporaries: 8 MiB of fp32, whatever the batch size).
WINDOW_TENSORS = 256
WINDOW_ELEMENTS = CHUNK_ELEMENTS
_WINDOW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


GroupKey = tuple[bool, torch.device, torch.dtype]  # (judged, device, dtype)
_BUFFER_IDS = itertools.count(1)
_KEYS: dict[GroupKey, GroupKey] = {}  # one object per group key, for every buffer: untracked by the collector once


# Where a tensor's (abs min, abs max) pair lives in a StatBuffer: ``(group key, entry, buffer id)`` -- its group,
# its number within the group in the order it was added, and which buffer (refs of two steps, or of a step and its
# re-run, never compare equal). A plain tuple, neither a named tuple nor a dataclass: one is made per measured
# tensor on the hot path, and the garbage collector stops tracking plain tuples of untracked values (a named tuple
# it tracks for ever: ~170-330 more tracked objects per T5 step, promoted, then full collections). Its group key
# is interned (``_KEYS``), and a frame's slot holds its three parts flat, not the tuple (``frames.Slot``).
StatRef = tuple  # tuple[GroupKey, int, int]


class StatValues(dict):
    """Host copy of a :class:`StatBuffer`: group key -> values (abs min, abs max interleaved, in the order the
    device pieces were reduced), ``rows``: group key -> row of each entry, and ``changed``: the (group key,
    entry) pairs measured after an in-place change."""

    rows: dict
    changed: frozenset = frozenset()
    lost: frozenset = frozenset()
    moved: dict = {}  # noqa: RUF012 -- replaced per instance by read()


class _Group:
    """One (judged, device, dtype) group: entries added, windows waiting, and reduced pieces."""

    __slots__ = ("key", "count", "pending", "pending_elements", "pieces", "order", "pairs", "pair_order")

    def __init__(self, key: GroupKey) -> None:
        self.key = key  # the interned key its StatRefs hold (untracked: a slot holding only it untracks at once)
        self.count = 0
        self.pending: list[tuple[int, torch.Tensor, int]] = []  # (entry, tensor, version) in the window
        self.pending_elements = 0
        self.pieces: list[torch.Tensor] = []  # windows reduced: (n, 2) rows of (abs min, abs max)
        self.order: list[int] = []  # the entries in piece order
        self.pairs: list[torch.Tensor] = []  # tensors reduced one by one: 0-d abs min, abs max, ...
        self.pair_order: list[int] = []

    def put_pair(self, entry: int, mn: torch.Tensor, mx: torch.Tensor) -> None:
        """An entry reduced on its own (0-d abs min and abs max)."""
        self.pairs += (mn, mx)
        self.pair_order.append(entry)

    def joined(self) -> torch.Tensor:
        """Every entry's (abs min, abs max) as one interleaved device tensor: the pieces, then the pairs."""
        if not self.pieces:
            return torch.stack(self.pairs)
        parts = self.pieces + [torch.stack(self.pairs).view(-1, 2)] if self.pairs else self.pieces
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(-1)

    def rows(self) -> list[int]:
        """Entry -> its row in :meth:`joined` (host side, for a report)."""
        row = [0] * self.count
        for i, entry in enumerate(self.order + self.pair_order):
            row[entry] = i
        return row


def _reduce_foreach(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(abs min, abs max) of each tensor as (n, 2) rows, in six dispatches whatever their number and shapes: on
    an accelerator each is a fused multi-tensor kernel."""
    absolute = torch._foreach_abs(tensors)
    maxs = torch._foreach_max(absolute)
    torch._foreach_neg_(absolute)
    mins = torch._foreach_neg(torch._foreach_max(absolute))
    del absolute
    return torch.stack([v for pair in zip(mins, maxs) for v in pair]).view(-1, 2)


def _reduce_stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The same for tensors of one shape: stacked, then ``amin`` and ``amax`` over all but the first dimension. On
    the CPU, where there is no launch to save and every per-tensor step of a multi-tensor op costs ~1 us of
    dispatch, this is the cheapest way for small tensors (us per tensor, 32 tensors, one thread: 1.1 against 5.0
    one by one and 8.7 for the multi-tensor ops at 256 floats; 3.0 / 6.3 / 9.1 at 4K; but 17.6 / 12.2 at 16K,
    hence ``CPU_WINDOW_MAX_ELEMENTS``). (``aminmax`` along a dimension is 4-7x slower than these two.)"""
    stacked = torch.stack(tensors)
    stacked.abs_()
    if stacked.dim() == 1:  # 0-d tensors (a loss): each its own abs min and max
        return torch.stack((stacked, stacked), 1)
    dims = tuple(range(1, stacked.dim()))
    return torch.stack((stacked.amin(dims), stacked.amax(dims)), 1)  # (n, 2): joined by rows


class StatBuffer:
    """The statistics of one step, on device, grouped by (judged, device, dtype) so they can be stacked.

    *Judged* statistics decide whether the step is finite; the others (module inputs, where an
    additive ``-inf`` mask is legitimate) are context for the report only. Floating-point tensors wait in a
    window per group and are reduced together (module docstring); every read reduces what waits first. The
    results stay on the device as (n, 2) pieces, joined once per group when the step is judged; an entry's row
    is looked up on the host, in a report only.
    """

    __slots__ = ("_groups", "_stacked", "_id", "changed", "lost", "moved")

    def __init__(self) -> None:
        self._groups: dict[GroupKey, _Group] = {}
        self._stacked: dict[GroupKey, torch.Tensor] | None = None
        self._id = next(_BUFFER_IDS)
        self.changed: set[tuple[GroupKey, int]] = set()  # measured after an in-place change
        self.lost: set[tuple[GroupKey, int]] = set()  # freed before its window was reduced: no statistics
        self.moved: dict[tuple[GroupKey, int], StatRef] = {}  # changed in place: judged entry -> its context copy

    def _group(self, key: GroupKey) -> _Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(_KEYS.setdefault(key, key))
        return group

    def add(self, t: torch.Tensor, judged: bool = True, at_once: bool = False) -> StatRef:
        """Reduce ``t`` on its device (with its window, or now) and keep the two results. ``t`` must not be
        skipped. ``at_once``: not in a window (a module known to see its outputs changed in place)."""
        # (a tensor subclass -- an AsyncCollectiveTensor from tensor parallelism, a wrapper -- is reduced at once:
        # it may have no storage of its own and waits on a collective when first read; an inference tensor has no
        # version counter to watch)
        if not at_once and type(t) in _PLAIN_TYPES and not t.is_inference():
            ref = self.wait(t, judged, t._version)
            if ref is not None:
                return ref
        with torch.no_grad():  # (no detach dispatch)
            mn, mx = abs_min_max(t)
        return self._put((judged, mx.device, mx.dtype), mn, mx)

    def wait(self, t: torch.Tensor, judged: bool, version: int) -> StatRef | None:
        """Put a plain strided tensor (``torch.Tensor`` or ``Parameter``, not an inference tensor: the caller
        checked) in its window, as it is at ``version``; None when no window takes it (empty, too large, a dtype or
        device without windows), and then the caller measures it at once. The monitor's hot path."""
        n = t.numel()
        device = t.device
        if n > _window_max.get(device, 0) or not n:
            return None
        dtype = t.dtype
        if dtype not in _WINDOW_DTYPES:
            return None
        key = (judged, device, dtype)
        group = self._groups.get(key) or self._group(key)
        entry = group.count
        group.count = entry + 1
        pending = group.pending
        pending.append((entry, t, version))
        group.pending_elements += n
        if len(pending) >= WINDOW_TENSORS or group.pending_elements >= WINDOW_ELEMENTS:
            self._reduce(key, group)
        return (group.key, entry, self._id)

    def _put(self, key: GroupKey, mn: torch.Tensor, mx: torch.Tensor) -> StatRef:
        group = self._group(key)
        entry = group.count
        group.count = entry + 1
        group.put_pair(entry, mn, mx)
        return (group.key, entry, self._id)

    def _reduce(self, key: GroupKey, group: _Group) -> None:
        """Reduce one group's window (see the module docstring for the two ways). Never an exception into the run:

        * a tensor changed in place since it was added holds a value its module did not return: it is measured
          as *context* (moved to the group's unjudged twin, ``moved``), never judged, so that an in-place
          ``masked_fill_(-inf)`` by the code around a module cannot stop a healthy run;
        * a tensor whose storage was freed while it waited (``storage().resize_(0)``, as FSDP frees unsharded
          parameters, a module may return a view of one) gets no statistics (``lost``): reading it would crash;
        * if the multi-tensor ops fail anyway (a functorch wrapper read after its transform), one by one.
        """
        pending, group.pending, group.pending_elements = group.pending, [], 0
        keep = []
        for item in pending:
            entry, t, version = item
            try:
                freed = not t.untyped_storage().data_ptr()
                changed = t._version != version
            except Exception:  # no storage of its own (a functorch wrapper): measured one by one below
                freed = changed = False
            if freed:
                self._set_lost(key, group, entry)
            elif changed:
                self.changed.add((key, entry))
                if key[0]:  # judged: measure it as context instead
                    self._move(key, group, entry, t)
                else:
                    keep.append(item)
            else:
                keep.append(item)
        if not keep:
            return
        pieces, order, pairs, pair_order = len(group.pieces), len(group.order), len(group.pairs), len(group.pair_order)
        try:
            self._reduce_window(group, keep)
        except Exception:  # undo what the window added, then one by one
            del group.pieces[pieces:], group.order[order:], group.pairs[pairs:], group.pair_order[pair_order:]
            with torch.no_grad():
                for entry, t, _ in keep:
                    try:
                        mn, mx = abs_min_max(t)
                    except Exception:
                        self._set_lost(key, group, entry)
                        continue
                    group.put_pair(entry, mn, mx)

    @staticmethod
    def _zero(key: GroupKey, group: _Group, entry: int) -> None:
        zero = torch.zeros((), dtype=key[2], device=key[1])
        group.put_pair(entry, zero, zero)

    def _set_lost(self, key: GroupKey, group: _Group, entry: int) -> None:
        self.lost.add((key, entry))
        self._zero(key, group, entry)

    def _move(self, key: GroupKey, group: _Group, entry: int, t: torch.Tensor) -> None:
        """A judged entry whose value changed in place: zeros where it was judged, its statistics as context."""
        self._zero(key, group, entry)
        try:
            with torch.no_grad():
                mn, mx = abs_min_max(t)
        except Exception:
            self.lost.add((key, entry))
            return
        self.moved[(key, entry)] = self._put((False, mx.device, mx.dtype), mn, mx)

    def _reduce_window(self, group: _Group, pending: list) -> None:
        with torch.no_grad():
            if pending[0][1].device.type == "cpu" and _cpu_stacks[0]:
                by_shape: dict[torch.Size, list] = {}
                for item in pending:
                    by_shape.setdefault(item[1].shape, []).append(item)
                single = []
                for items in by_shape.values():
                    if len(items) == 1:
                        single.append(items[0])
                    else:
                        group.pieces.append(_reduce_stacked([t for _, t, _ in items]))
                        group.order.extend(entry for entry, _, _ in items)
                for entry, t, _ in single:  # (a CPU multi-tensor op costs as much per tensor)
                    group.put_pair(entry, *abs_min_max(t))
            else:
                group.pieces.append(_reduce_foreach([t for _, t, _ in pending]))
                group.order.extend(entry for entry, _, _ in pending)

    def flush(self) -> None:
        """Reduce every waiting window."""
        for key, group in list(self._groups.items()):  # (a reduction may add a context group)
            if group.pending:
                self._reduce(key, group)

    def add_flag(self, flag: torch.Tensor) -> StatRef:
        """Keep a 0-d bool as context (never judged), e.g. "this tensor also holds an inf"."""
        value = flag.to(torch.uint8)
        return self._put((False, value.device, value.dtype), value, value)  # the flag is both "min" and "max"

    def stacked(self) -> dict[GroupKey, torch.Tensor]:
        """One device tensor per group (computed once; the buffer is frozen afterwards)."""
        if self._stacked is None:
            self.flush()
            self._stacked = {key: g.joined() for key, g in self._groups.items() if g.count}
        return self._stacked

    def finite_flags(self) -> list[torch.Tensor]:
        """One 0-d bool tensor per judged group: are all its statistics finite? Still no host sync.

        Does not freeze the buffer: after a forward that raised, the same step goes on recording.
        """
        return [torch.isfinite(v).all() for v in self.judged_stacks().values()]

    def judged_stacks(self) -> dict[GroupKey, torch.Tensor]:
        """The judged groups, each one device tensor (abs min, abs max interleaved; entries in the order they
        were reduced); no host sync, and the buffer is not frozen (the context groups are reduced, and joined only
        if a report reads them)."""
        if self._stacked is not None:
            return {key: v for key, v in self._stacked.items() if key[0]}
        self.flush()  # the context groups too: a window must not keep a step's inputs alive in the history
        return {key: group.joined() for key, group in self._groups.items() if key[0] and group.count}

    @property
    def buffer_id(self) -> int:
        """The buffer part of this buffer's StatRefs."""
        return self._id

    def rows_of(self, key: GroupKey) -> list[int]:
        """Entry -> its row in the group's stacked tensor (host side: no read)."""
        return self._groups[key].rows()

    def read(self) -> StatValues:
        """Host copy of every statistic (the report path; syncs once per group)."""
        stacked = self.stacked()
        values = StatValues({key: v.detach().cpu().double().tolist() for key, v in stacked.items()})
        values.rows = {key: group.rows() for key, group in self._groups.items()}
        values.changed = frozenset(self.changed)
        values.lost = frozenset(self.lost)
        values.moved = dict(self.moved)
        return values


# device -> the largest tensor its windows take (0: none; set by window_reduce_works). On a CPU only small
# tensors: there a dispatch costs ~1-6 us and no launch, so batching pays only where the dispatch outweighs the
# work; above ~8K elements one-by-one abs + aminmax is faster (see _reduce_stacked).
_window_max: dict[torch.device, int] = {}
CPU_WINDOW_MAX_ELEMENTS = 1 << 12
_cpu_stacks = [True]  # CPU windows stack tensors of one shape (see accelerator_path)


def cpu_paths() -> bool:
    """Does a CPU take its own (faster there) ways, not an accelerator's (:func:`accelerator_path` off)?"""
    return _cpu_stacks[0]


def fits_window(t: torch.Tensor) -> bool:
    """Would a window take ``t`` as the monitor gives it one (a plain strided non-empty float tensor within its
    device's limit)? A forward call waits to be labelled only if all its tensors do (``StepRecord.defer``)."""
    n = t.numel()
    return (type(t) is torch.Tensor and t.layout is torch.strided and t.dtype in _WINDOW_DTYPES
            and 0 < n <= _window_max.get(t.device, 0))


@contextlib.contextmanager
def accelerator_path():
    """Reduce CPU tensors the way an accelerator's are (every window through the multi-tensor ops, up to
    ``WINDOW_ELEMENTS``): to count on a machine without a GPU the ops a GPU run dispatches."""
    window_reduce_works(torch.device("cpu"))
    saved = dict(_window_max), _cpu_stacks[0]
    for device, limit in _window_max.items():
        if device.type == "cpu" and limit:
            _window_max[device] = WINDOW_ELEMENTS
    _cpu_stacks[0] = False
    try:
        yield
    finally:
        _window_max.clear()
        _window_max.update(saved[0])
        _cpu_stacks[0] = saved[1]


def window_reduce_works(device: torch.device) -> bool:
    """Do the window's multi-tensor ops (``_foreach_abs`` / ``_foreach_max`` / ``_foreach_neg_``) on ``device``
    give nan for a nan, inf for an inf and the exact abs min? Asked once per device when the monitor attaches
    (one host sync, never inside a step); until a device is asked, its tensors are reduced one by one. The
    probe spans several blocks of a fused kernel (a nan deep inside a 2**18-element tensor) and every dtype.
    """
    limit = _window_max.get(device)
    if limit is None:
        try:
            ok = hasattr(torch, "_foreach_max") and all(_window_probe(device, dtype) for dtype in _WINDOW_DTYPES)
        except Exception:  # no multi-tensor kernel for this device or dtype: reduce one by one
            ok = False
        most = CPU_WINDOW_MAX_ELEMENTS if device.type == "cpu" else WINDOW_ELEMENTS
        limit = _window_max[device] = most if ok else 0
    return limit > 0


def _window_probe(device: torch.device, dtype: torch.dtype) -> bool:
    """The window's reduction of three tensors of ``dtype`` against their known (abs min, abs max)."""
    big = torch.full((1 << 18,), -2.0, device=device, dtype=dtype)
    big[(1 << 17) + 3] = float("nan")
    tensors = [big, torch.tensor([1.0, float("-inf")], device=device, dtype=dtype),
               torch.tensor([-3.0, 0.5, 4.0], device=device, dtype=dtype),
               # two of one shape (the CPU stacks those)
               torch.tensor([[1.0, float("nan")]], device=device, dtype=dtype),
               torch.tensor([[float("-inf"), 0.25]], device=device, dtype=dtype)]
    expected = [math.nan, math.nan, 1.0, math.inf, 0.5, 4.0, math.nan, math.nan, 0.25, math.inf]  # as aminmax
    buf = StatBuffer()
    key = (True, big.device, dtype)
    group = buf._group(key)
    group.pending = [(i, t, t._version) for i, t in enumerate(tensors)]
    group.count = len(tensors)
    values = buf.read()
    got = [x for ref in range(len(tensors)) for x in lookup(values, (key, ref, 0))]
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, expected))


def lookup(values: StatValues, ref: StatRef) -> tuple[float, float]:
    """(abs min, abs max) of one entry, from a host copy."""
    ref = values.moved.get(ref[:2], ref)
    key = ref[0]
    row = values.rows[key][ref[1]]
    group = values[key]
    return group[2 * row], group[2 * row + 1]

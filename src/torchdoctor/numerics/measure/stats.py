"""On-device statistics: abs min / abs max of a tensor, kept on the tensor's own device.

Nothing here reads a value back to the host. The statistics of one training step are collected in a
:class:`~.windows.StatBuffer` (:mod:`.windows`: tensors gathered and reduced a few ops at a time); at the step
boundary it is stacked once per (device, dtype) and reduced to a single "all finite" flag, which the monitor
reads with one ``.item()``. Only when that flag is false (or a step is traced) are the values themselves read.
Here: what a value is (skipped, sharded), one tensor's reduction, and the gradient check over many tensors.

Tensors a window does not take (integers, float8, complex, tensors over ``WINDOW_ELEMENTS`` -- on a CPU
over ``CPU_WINDOW_MAX_ELEMENTS`` --, devices where the probe failed) are reduced one by one:
``aminmax(x.abs())``. Measured on CPU (512x256 fp32) it takes ~18 us against ~175 us for
``torch.linalg.vector_norm(x, inf)``, and it yields both statistics in one pass.
A nan anywhere makes abs max nan and an inf makes it inf (``aminmax`` propagates nan), so abs max alone
decides finiteness. The ``abs()`` temporary is bounded: tensors above ``CHUNK_ELEMENTS`` are reduced chunk
by chunk, so the extra memory does not grow with the batch size.
"""

from __future__ import annotations

import torch

# 1M elements: the largest abs() temporary is 4 MiB for fp32, whatever the batch size.
CHUNK_ELEMENTS = 1 << 20

_FLOAT8 = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def skip_reason(t: torch.Tensor) -> str | None:
    """Why a tensor gets no statistics (a label for the report), or None when it gets them."""
    if t.is_meta:
        return "meta"
    if t.layout is not torch.strided:
        return "sparse" if t.is_sparse else "layout"
    if t.is_quantized:
        return "quantized"
    if t.numel() == 0:
        return "empty"
    return None


_DTENSOR: list[type] = []  # torch.distributed.tensor.DTensor, looked up once (not every torch has it)


def _dtensor_type() -> type | None:
    if not _DTENSOR:
        cls = None
        if torch.distributed.is_available():
            try:
                from torch.distributed.tensor import DTensor as cls
            except ImportError:  # torch < 2.5 kept it private
                try:
                    from torch.distributed._tensor import DTensor as cls
                except ImportError:
                    cls = None
        _DTENSOR.append(cls)
    return _DTENSOR[0]


SHARD = "local shard"  # what a statistic of a sharded tensor covers
ELSEWHERE = "on other ranks"  # a sharded tensor of which this rank holds nothing


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The part of ``t`` this rank holds, and what it covers when that is not all of ``t``.

    A DTensor (FSDP2, tensor parallel) is measured on ``to_local()``: no collective, and the
    statistics say "local shard" unless every placement is a replica. A DeepSpeed ZeRO-3 parameter
    outside its forward is an empty placeholder whose values live in ``ds_tensor`` (this rank's
    partition). FSDP1 (``use_orig_params=True``) leaves each original parameter as this rank's 1-D
    slice of the flat parameter between forwards, marked ``_fsdp_flattened``. Anything else is its
    own whole.
    """
    cls = type(t)
    if cls is torch.Tensor:
        return t, None
    if cls is torch.nn.Parameter:
        if t.numel() == 0 and getattr(t, "ds_tensor", None) is not None:
            return t.ds_tensor, SHARD
        return t, SHARD if getattr(t, "_fsdp_flattened", False) else None
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        replicated = all(p.is_replicate() for p in t.placements)
        return t.to_local(), None if replicated else SHARD
    return t, None


def shard_skip_reason(t: torch.Tensor, scope: str | None) -> str | None:
    """:func:`skip_reason` for a tensor's local part: an empty shard means the values live elsewhere."""
    if scope == SHARD and t.numel() == 0:
        return ELSEWHERE
    return skip_reason(t)


def _abs_of(x: torch.Tensor) -> torch.Tensor:
    """|x| in a dtype that aminmax accepts, exact for every value x can hold."""
    dtype = x.dtype
    if dtype.is_floating_point:
        if dtype in _FLOAT8:
            return x.float().abs()
        return x.abs()
    if dtype.is_complex:
        return x.abs()  # real magnitude
    if dtype is torch.bool:
        return x.to(torch.uint8)
    # integers: widen first so that abs(INT_MIN) does not wrap around, and exactly (float32 would round
    # int32 values above 2**24: 16777217 printed as 16777216); int64 goes to float64 (exact to 2**53)
    return x.to(torch.float64).abs() if dtype is torch.int64 else x.to(torch.int64).abs()


def abs_min_max(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(abs min, abs max) of a non-empty strided tensor as 0-d tensors on ``t``'s device.

    No host synchronisation. Large tensors are reduced in chunks of ``CHUNK_ELEMENTS`` so that the
    temporary stays small.
    """
    if t.requires_grad and torch.is_grad_enabled():  # (under no_grad, as in a window's reduction: no dispatch)
        t = t.detach()
    n = t.numel()
    if n <= CHUNK_ELEMENTS:
        return torch.aminmax(_abs_of(t))
    flat = t.reshape(-1) if t.is_contiguous() else t.flatten()
    mins, maxs = [], []
    for start in range(0, n, CHUNK_ELEMENTS):
        mn, mx = torch.aminmax(_abs_of(flat[start : start + CHUNK_ELEMENTS]))
        mins.append(mn)
        maxs.append(mx)
    return torch.stack(mins).amin(), torch.stack(maxs).amax()


def has_inf(t: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``t``'s device: does ``t`` hold an inf? (float8 has no isinf kernel: upcast.)"""
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return torch.isinf(t.float() if t.dtype in _FLOAT8 else t).any()


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_fused_ok: dict[tuple[str, int | None], bool] = {}


def fused_check_works(device: torch.device) -> bool:
    """Does ``torch._foreach_norm(ts, inf)`` on ``device`` give nan for a nan and inf for a -inf?

    Asked once per device (one host sync; the monitor asks when it attaches, never inside a step): a torch whose fused
    kernel took ``fmax`` somewhere would silently miss a nan, so the fast path is used only where it is seen
    to propagate. The probe spans several blocks of the kernel (a nan deep inside a 2**18-element tensor).
    """
    key = (device.type, device.index)
    ok = _fused_ok.get(key)
    if ok is None:
        try:
            big = torch.ones(1 << 18, device=device)
            big[(1 << 17) + 3] = float("nan")
            small = torch.tensor([1.0, float("-inf")], device=device, dtype=torch.float16)
            norms = torch._foreach_norm([big, small], float("inf")) + torch._foreach_norm([small[:1]], float("inf"))
            ok = bool(torch.isnan(norms[0]).item()) and bool(torch.isposinf(norms[1]).item()) and norms[2].item() == 1
        except Exception:  # no fused kernel for this device or torch: the per-tensor path still works
            ok = False
        _fused_ok[key] = ok
    return ok


def finite_flags_of(tensors: list[torch.Tensor], fused: bool | None = None, exact: bool = True) -> list[torch.Tensor]:
    """One 0-d "all finite" flag per (device, dtype) over many tensors, without a host sync.

    Two ways, chosen per device because the faster one differs (``BENCHMARKS.md``):

    * CPU: one ``aminmax(t)`` per tensor (no ``abs``, no temporary: nan propagates into both results, +inf
      shows in the max and -inf in the min). On the gradients of a 17.7M-parameter T5 it takes 1.8 ms
      against 23 ms for ``torch._foreach_norm(grads, inf)``.
    * Accelerators: ``torch._foreach_norm(grads, inf)``, a few fused kernels for the whole group; on an H200
      0.25 ms against 1.15 ms for the per-tensor ``aminmax`` (a launch per gradient). Used only where
      :func:`fused_check_works` saw it propagate nan and inf.

    ``fused`` forces one way (True / False); None picks by device.

    ``exact=False`` allows a faster check that may call finite values non-finite, never the reverse: on
    CPU, fp32 tensors are summed (small ones stacked by shape, :func:`_cpu_sums`) or their 2-norms taken, all
    in one dispatch (``torch._foreach_norm(ts, 2)``): a nan or inf anywhere makes a sum or norm nan or inf; on
    the 97 gradients of a 17.7M-parameter T5 the norms take ~7 ms, as a sum per tensor (97 dispatches) and
    against ~11 ms for ``aminmax``. A huge finite sum or norm (> ~1e19 for a norm) can overflow: a caller that
    sees a non-finite flag from it asks again with ``exact=True`` before saying so.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    strided = torch.strided
    for t in tensors:
        # the common case first (a dense fp16/bf16/fp32/fp64 gradient), in a few attribute reads: this loop runs
        # over every parameter at every step
        if type(t) is torch.Tensor and t.layout is strided and t.dtype in _FUSED_DTYPES and not t.requires_grad \
                and not t.is_meta and t.numel():
            key = (t.device, t.dtype)
            group = groups.get(key)
            if group is None:
                groups[key] = [t]
            else:
                group.append(t)
            continue
        t = local_part(t)[0]  # a sharded gradient is checked where it lives: no collective
        if t.layout is torch.sparse_coo:  # e.g. nn.Embedding(sparse=True) gradients: check the values
            t = t._values()
        if skip_reason(t) is not None or not (t.dtype.is_floating_point or t.dtype.is_complex):
            continue  # meta, empty, quantized, other layouts: nothing to check
        if t.requires_grad:  # (a gradient rarely is: no detach dispatch for the others)
            t = t.detach()
        if t.dtype.is_complex:
            t = torch.view_as_real(t)
        elif t.dtype in _FLOAT8:
            t = t.float()
        groups.setdefault((t.device, t.dtype), []).append(t)
    flags = []
    for (device, dtype), ts in groups.items():
        use_fused = (device.type != "cpu" and fused_check_works(device)) if fused is None else fused
        if use_fused and dtype in _FUSED_DTYPES:
            flags.append(torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all())
        elif not exact and dtype is torch.float32 and device.type == "cpu":
            flags.append(torch.isfinite(torch.stack(_cpu_sums(ts))).all())
        else:
            flags.append(torch.isfinite(torch.stack([m for t in ts for m in torch.aminmax(t)])).all())
    return flags


SMALL_ELEMENTS = 1 << 12  # on a CPU, tensors up to this size are checked stacked by shape
# On a CPU, plain fp32 gradients up to this many elements in all are copied into one buffer (C++ flattening, no
# Python per tensor) and summed (engines.base.Engine.grad_flags): 47 us against 104 us for the stacks by shape on the
# tiny T5's 89 gradients (87K elements, one thread); above it the copy costs more than it saves (a GPT-2 of 0.9M
# parameters in 52 tensors: 468 us against 242 us) (issue 21)
FLAT_ELEMENTS = 1 << 17
flatten_dense = torch._C._nn.flatten_dense_tensors


def _cpu_sums(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-d values that are finite if every element of ``ts`` is (never the reverse, only a huge finite sum
    overflows): small tensors of one shape stacked and summed (two dispatches per shape; the gradients of a small
    model are mostly of a few shapes), the others by one ``torch._foreach_norm(ts, 2)``. Gradients of the tiny T5
    of BENCHMARKS.md (89 tensors, 6 shapes), one thread: 144 us against 264 us for the norms alone."""
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    rest = []
    for t in ts:
        if t.numel() <= SMALL_ELEMENTS:
            by_shape.setdefault(t.shape, []).append(t)
        else:
            rest.append(t)
    sums = []
    for same in by_shape.values():
        if len(same) > 1:
            sums.append(torch.stack(same).sum())
        else:
            rest.append(same[0])
    if rest:
        sums += torch._foreach_norm(rest, 2)
    return sums


def all_finite(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """Fold per-group flags (possibly on several devices) into one tensor; None when empty."""
    if not flags:
        return None
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    folded = [torch.stack(fs).all() for fs in by_device.values()]
    if len(folded) == 1:
        return folded[0]
    # model split over devices: gather the few flags on an accelerator if there is one (a
    # non_blocking copy *to* the CPU could be read before it lands), else on the CPU
    target = next((f.device for f in folded if f.device.type != "cpu"), folded[0].device)
    return torch.stack([f.to(target, non_blocking=target.type != "cpu") for f in folded]).all()

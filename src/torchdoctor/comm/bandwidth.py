"""Bandwidth figures as nccl-tests reports them (GB = 1e9 bytes, n = ranks, t = seconds per op).

``bytes`` (S) is the size of the full tensor: the all_reduce / broadcast buffer, the gathered output of
all_gather, the input of reduce_scatter, one rank's send buffer of all_to_all. algbw = S / t;
busbw = algbw * factor, where the factor makes busbw comparable to the link speed whatever the op.
"""

from __future__ import annotations

import math

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
SHARDED = frozenset({"all_gather", "reduce_scatter", "all_to_all"})


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in SHARDED:
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def message_elements(op: str, nbytes: int, elem_size: int, n: int) -> tuple[int, int]:
    """(elements per rank's shard, actual S in bytes) for a requested S, rounded down to whole shards."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    per = n if op in SHARDED else 1
    shard = max(1, nbytes // (elem_size * per))
    return shard, shard * elem_size * per


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """GB/s; a time of 0 (a timer too coarse for the message) is an infinite bandwidth, not a crash."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


def busbw_gbps(op: str, nbytes: int, seconds: float, n: int) -> float:
    return algbw_gbps(nbytes, seconds) * bus_factor(op, n)

"""The collective benchmark: every op over a sweep of sizes, times per op, nccl-tests' bandwidths.

Each iteration is timed on its own (the op, then a device sync), so the report has p50/p99 latency;
the time of an iteration is the slowest rank's (one all_reduce MAX per size), as in nccl-tests.
Bandwidths use the median time: on a shared machine one slow iteration would dominate a mean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .bandwidth import OPS, SHARDED, algbw_gbps, busbw_gbps, message_elements
from .sizes import format_bytes


@dataclass(frozen=True)
class BenchResult:
    op: str
    bytes: int
    dtype: str
    algbw_gbps: float
    busbw_gbps: float
    p50_us: float
    p99_us: float

    def to_json(self) -> dict:
        return asdict(self)


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an ascending list."""
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 100)) - 1))
    return sorted_values[k]


def _op_call(torch, dist, op: str, shard: int, n: int, dtype, device) -> Callable[[], None]:
    full = shard * n if op in SHARDED else shard
    a = torch.ones(full, dtype=dtype, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(a)
    if op == "broadcast":
        return lambda: dist.broadcast(a, src=0)
    if op == "all_to_all":
        b = torch.empty_like(a)
        return lambda: dist.all_to_all_single(b, a)
    small = torch.ones(shard, dtype=dtype, device=device)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(a, small)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(small, a)
    raise ValueError(f"unknown op {op!r}")


class Progress:
    """A one-line progress bar on a terminal; one line per finished item otherwise (logs, pipes)."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()

    def start(self, text: str) -> None:
        if self.enabled:
            self.stream.write(f"[bench] {text}\n")
            self.stream.flush()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        if self.tty:
            filled = int(30 * self.done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if self.done == self.total else ""
            self.stream.write(f"\r[bench] [{bar}] {self.done}/{self.total} {label:<28} {elapsed:5.1f}s{end}")
        else:
            self.stream.write(f"[bench] {self.done}/{self.total} {label} ({elapsed:.1f}s)\n")
        self.stream.flush()


def run_bench(torch, dist, device, rank: int, n: int, sizes: list[int], dtype, iters: int, warmup: int,
              ops: tuple[str, ...] = OPS, on_item: Callable[[str, int], None] | None = None,
              on_iter: Callable[[], None] | None = None, progress: Progress | None = None) -> list[BenchResult]:
    """Measure every (op, size).

    ``on_item`` is told each (op, bytes) before it starts (the side channel records it); ``on_iter`` is
    called after every iteration (the watchdog's sign of progress, a plain attribute write).
    """
    on_iter = on_iter or (lambda: None)
    elem = torch.tensor([], dtype=dtype).element_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    results = []
    for op in ops:
        for size in sizes:
            shard, nbytes = message_elements(op, size, elem, n)
            if on_item:
                on_item(op, nbytes)
            call = _op_call(torch, dist, op, shard, n, dtype, device)
            for _ in range(warmup):
                call()
                sync()
                on_iter()
            times = torch.empty(iters, dtype=torch.float64)
            for k in range(iters):
                t0 = time.perf_counter()
                call()
                sync()
                times[k] = time.perf_counter() - t0
                on_iter()
            slowest = times.to(device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            ts = sorted(slowest.cpu().tolist())
            p50 = _percentile(ts, 50)
            results.append(BenchResult(
                op, nbytes, str(dtype).removeprefix("torch."), algbw_gbps(nbytes, p50),
                busbw_gbps(op, nbytes, p50, n), p50 * 1e6, _percentile(ts, 99) * 1e6,
            ))
            if progress:
                progress.step(f"{op} {format_bytes(nbytes)}")
    return results


def render_bench(results: list[BenchResult], n: int) -> str:
    lines = [f"{'op':<15}{'size':>8}{'dtype':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}{'p50 us':>11}{'p99 us':>11}"]
    for r in results:
        lines.append(f"{r.op:<15}{format_bytes(r.bytes):>8}{r.dtype:>10}{r.algbw_gbps:>12.4g}{r.busbw_gbps:>12.4g}"
                     f"{r.p50_us:>11.1f}{r.p99_us:>11.1f}")
    lines.append(f"(n = {n} ranks; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, "
                 "reduce_scatter, all_to_all, x 1 for broadcast; GB = 1e9 bytes)")
    return "\n".join(lines)

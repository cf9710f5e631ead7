"""``torchdoctor comm`` on this machine: loopback gloo bandwidth beside the memory-copy ceiling, and how
fast a dead or frozen rank becomes a verdict.

In one run:
1. memory-copy bandwidth (``dst.copy_(src)``, 64 MiB float32, median of 20) -- the ceiling for loopback,
   where every byte a collective moves is a copy through memory;
2. ``torchdoctor comm --local N --bench --json`` with the default sizes for N = 4 (wall time: the issue's
   < 2 min) and N = 2 (one rank per core: 4 ranks on 2 cores share cores, which costs latency);
3. memory copy again (the machine is shared: the two readings bracket the benchmark);
4. two ranks under a plain env launch, rank 1 SIGKILLed in the middle of the benchmark: seconds from the
   kill to rank 0's verdict (default --timeout 60; gloo sees the closed socket at once);
5. the same with rank 1 frozen by SIGSTOP (its sockets stay open): only the stage deadline ends the wait,
   so the verdict comes after --timeout (10 s here) plus the side channel's settle time.

Usage: python benchmarks/comm_bandwidth.py [--ranks 4,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parent.parent / "src")
sys.path.insert(0, SRC)
from torchdoctor.comm.sizes import format_bytes  # noqa: E402


def memcpy_gbps(nbytes: int = 64 << 20, reps: int = 20) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", **extra)
    return env


def comm_bench(ranks: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torchdoctor", "comm", "--local", str(ranks), "--bench", "--json"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"comm --bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_verdict(sig: int, timeout: float) -> tuple[float, str]:
    """Seconds from hitting rank 1 with ``sig`` mid-benchmark to rank 0's exit, and rank 0's verdict."""
    port = _free_port()
    args = ["--json", "--timeout", f"{timeout:g}", "--bench", "--sizes", "8M", "--iters", "1000000"]
    procs = [subprocess.Popen([sys.executable, "-m", "torchdoctor", "comm", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(2)]
    for line in procs[0].stderr:
        if line.startswith("[bench] 5 ops"):
            break
    time.sleep(1.0)
    procs[1].send_signal(sig)
    t0 = time.perf_counter()
    out, _ = procs[0].communicate(timeout=timeout + 60)
    elapsed = time.perf_counter() - t0
    procs[1].kill()
    procs[1].wait()
    verdict = json.loads(out.strip().splitlines()[-1])
    died = [f["title"] for f in verdict["findings"] if f["id"] == "comm.rank-died"]
    return elapsed, died[0] if died else json.dumps(verdict["findings"])[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,2", help="rank counts to run, comma-separated (default: 4,2)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = [int(n) for n in args.ranks.split(",")]
    before = memcpy_gbps()
    runs = {n: comm_bench(n) for n in counts}
    after = memcpy_gbps()
    killed_s, killed_title = time_to_verdict(signal.SIGKILL, 60)
    frozen_s, frozen_title = time_to_verdict(signal.SIGSTOP, 10)
    ceiling = min(before, after)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"memory copy: {before:.2f} GB/s before, {after:.2f} GB/s after the benchmarks (64 MiB, 1 thread)")
    for n, (out, wall) in runs.items():
        print(f"\ncomm --local {n} --bench (default sizes): {wall:.1f} s wall\n")
        print("| op | size | algbw GB/s | busbw GB/s | busbw / memcpy | p50 us | p99 us |")
        print("|---|---|---|---|---|---|---|")
        largest = max(b["bytes"] for b in out["bench"])
        for b in out["bench"]:
            if b["bytes"] in (largest, 1 << 20, 1 << 10):
                print(f"| {b['op']} | {format_bytes(b['bytes'])} | {b['algbw_gbps']:.4g} | {b['busbw_gbps']:.4g} | "
                      f"{b['busbw_gbps'] / ceiling:.1%} | {b['p50_us']:.0f} | {b['p99_us']:.0f} |")
    print(f"\nSIGKILL mid-benchmark -> verdict: {killed_s:.2f} s (--timeout 60): {killed_title}")
    print(f"SIGSTOP mid-benchmark -> verdict: {frozen_s:.2f} s (--timeout 10): {frozen_title}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "memcpy_gbps": [before, after],
            "runs": {n: {"wall_s": w, "bench": o["bench"]} for n, (o, w) in runs.items()},
            "sigkill_to_verdict_s": killed_s, "sigstop_to_verdict_s": frozen_s}, indent=1))


if __name__ == "__main__":
    main()

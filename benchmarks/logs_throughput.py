"""How fast ``torchdoctor logs`` reads a big training log (target: >= 50 MB/s on one core for 1 GB).

Generates a realistic DeepSpeed + HF Trainer log of the requested size into a temporary file (tqdm bars redrawn
with carriage returns, Trainer log dicts, DeepSpeed step/config/memory lines, NCCL INFO chatter, Python warnings,
and a few real events: fp16 overflows, a nan loss near the end), then times ``analyze_stream`` on it, pinned to one
CPU, and checks that the events were found.

    python benchmarks/logs_throughput.py               # 1 GB
    python benchmarks/logs_throughput.py --size 100M   # quick
    python benchmarks/logs_throughput.py --size 300M --run --shapes

``--run`` also times ``torchdoctor run -- cat LOG`` (its engine, ``run_command``, output to /dev/null: the
analyzer fed from a pipe); ``--shapes`` also times two worst cases of the same size: a log whose every line is an
event, and one line with no newline (base64 junk, where anchors occur by chance).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from torchdoctor.logs.analyze import analyze_stream  # noqa: E402

WORST_LINES = (  # every line an event (kept distinct where the analyzer deduplicates)
    "[2025-01-01 12:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    "Attempted loss scale: 1, reducing to 1",
    "{{'loss': nan, 'grad_norm': nan, 'learning_rate': 3e-05, 'epoch': 0.00}}",
    "[rank{r}]:[E ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL("
    "SeqNum={i}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before "
    "timing out.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
    "of which 1.2 GiB is free.",
    "[2025-01-01] [ERROR] [launch.py:325:sigkill_handler] ['python', 'train.py', '--local_rank={r}'] exits with "
    "return code = -9",
    "/tmp/x/csrc/adam/cpu_adam.cpp:{i}:10: fatal error: cuda_runtime.h: No such file or directory",
)

BLOCK_LINES = 8000


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG]?)i?[bB]?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 100M, 1G)")
    return int(float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()])


def _ts(t: float) -> str:
    s = int(t)
    return f"[2026-03-02 {10 + s // 3600 % 14:02d}:{s // 60 % 60:02d}:{s % 60:02d},{int(t * 1000) % 1000:03d}]"


def block(rng: random.Random, step0: int, total: int, t0: float) -> tuple[str, int, float]:
    """About BLOCK_LINES lines of an ordinary training log, from step0 on."""
    out: list[str] = []
    step, t = step0, t0
    while len(out) < BLOCK_LINES:
        r = rng.random()
        t += 0.5
        if r < 0.30:  # one tqdm redraw line: several \r updates
            bars = []
            for _ in range(rng.randint(2, 6)):
                step += 1
                pct = 100 * step // total
                fill = "█" * (pct * 40 // 100)
                elapsed = f"{step // 7200:02d}:{step // 120 % 60:02d}:{step // 2 % 60:02d}"
                bars.append(f"{pct:3d}%|{fill:<40}| {step}/{total} [{elapsed}<{(total - step) // 7200:02d}:00:00,  "
                            f"{rng.uniform(1.5, 2.5):.2f}it/s]")
            out.append("\r".join(bars))
        elif r < 0.50:
            out.append(f"{{'loss': '{rng.uniform(1.2, 3.2):.4g}', 'grad_norm': '{rng.uniform(0.2, 2.5):.4g}', "
                       f"'learning_rate': '{rng.uniform(1e-5, 5e-5):.4g}', 'epoch': '{step / 5000:.4g}'}}")
        elif r < 0.62:
            out.append(f"{_ts(t)} [INFO] [logging.py:107:log_dist] [Rank 0] step={step}, skipped=3, "
                       f"lr=[{rng.uniform(1e-5, 5e-5):.6e}], mom=[(0.9, 0.999)]")
        elif r < 0.70:
            out.append(f"{_ts(t)} [INFO] [timer.py:264:stop] epoch=0/micro_step={step * 4}/global_step={step}, "
                       f"RunningAvgSamplesPerSec={rng.uniform(90, 110):.4f}, "
                       f"CurrSamplesPerSec={rng.uniform(90, 110):.4f}, "
                       f"MemAllocated=21.37GB, MaxMemAllocated=38.9GB")
        elif r < 0.78:
            out.append(f"[rank{rng.randint(0, 7)}]:[W302 {_ts(t)[12:20]}.{rng.randint(0, 999999):06d} "
                       "reducer.cpp:1400] Warning: find_unused_parameters=True was specified in DDP constructor, but "
                       "did not find any unused parameters in the forward pass.")
        elif r < 0.84:
            out.append(f"gpu-node-{rng.randint(1, 8):02d}:{rng.randint(1000, 9999)}:{rng.randint(1000, 9999)} "
                       f"[{rng.randint(0, 7)}] NCCL INFO Channel {rng.randint(0, 31):02d}/0 : "
                       f"{rng.randint(0, 7)}[0] -> {rng.randint(0, 7)}[1] via P2P/CUMEM/read")
        elif r < 0.90:
            out.append("/usr/local/lib/python3.10/dist-packages/torch/utils/checkpoint.py:91: UserWarning: None of the "
                       "inputs have requires_grad=True. Gradients will be None")
        elif r < 0.95:
            key = rng.choice(["zero_config", "fp16_enabled", "amp_params", "wall_clock_breakdown", "steps_per_print"])
            out.append(f"{_ts(t)} [INFO] [config.py:1003:print]   {key} {'.' * rng.randint(10, 30)} "
                       f"{rng.choice(['True', 'False', '{}', '0', 'None'])}")
        else:
            out.append(f"epoch 0 iter {step}: loss {rng.uniform(1, 3):.4f} | tokens/s {rng.uniform(9e4, 1.1e5):.1f} | "
                       f"mem {rng.uniform(30, 40):.1f} GiB | elapsed {rng.uniform(400, 500):.1f} ms")
        if rng.random() < 0.0005:  # a recovered fp16 overflow now and then
            out.append(f"{_ts(t)} [INFO] [loss_scaler.py:266:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
                       "Attempted loss scale: 65536, reducing to 32768")
    return "\n".join(out) + "\n", step, t


def generate(path: str, size: int, seed: int = 0) -> int:
    """Write about ``size`` bytes: 16 distinct blocks cycled (generation stays fast), a nan loss at the end."""
    rng = random.Random(seed)
    total = 10**7
    step, t = 0, 0.0
    blocks = []
    for _ in range(16):
        text, step, t = block(rng, step, total, t)
        blocks.append(text.encode())
    written = 0
    with open(path, "wb") as f:
        i = 0
        while written < size:
            b = blocks[i % len(blocks)]
            f.write(b)
            written += len(b)
            i += 1
        tail = (b"{'loss': 'nan', 'grad_norm': 'nan', 'learning_rate': '1e-05', 'epoch': '3.2'}\n"
                b"[2026-03-02 23:59:59,001] [ERROR] [launch.py:325:sigkill_handler] ['python', 'train.py'] exits with "
                b"return code = -9\n")
        f.write(tail)
        written += len(tail)
    return written


def generate_worst(path: str, size: int) -> int:
    lines = [WORST_LINES[i % len(WORST_LINES)].format(i=i, r=i % 8) for i in range(60000)]
    data = ("\n".join(lines) + "\n").encode()
    with open(path, "wb") as f:
        for _ in range(max(1, size // len(data))):
            f.write(data)
    return os.path.getsize(path)


def generate_one_line(path: str, size: int, seed: int = 0) -> int:
    import base64

    rng = random.Random(seed)
    block = base64.b64encode(rng.randbytes(3 << 20))  # 4 MiB of junk; a few dozen anchors occur in it by chance
    with open(path, "wb") as f:
        for _ in range(max(1, size // len(block))):
            f.write(block)
    return os.path.getsize(path)


def time_run(path: str) -> float:
    from torchdoctor.run.supervisor import run_command

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        t = time.perf_counter()
        run_command(["cat", path], out_fd=devnull)
        return time.perf_counter() - t
    finally:
        os.close(devnull)


def time_shapes(size: int) -> None:
    for name, gen in (("every line an event", generate_worst), ("one line, no newline (base64)", generate_one_line)):
        path = tempfile.mkstemp(prefix="torchdoctor-logs-", suffix=".log")[1]
        try:
            n = gen(path, size)
            t = time.perf_counter()
            with open(path, "rb") as f:
                report = analyze_stream(f)
            dt = time.perf_counter() - t
        finally:
            os.unlink(path)
        print(f"{name}: {n / 1e6:.0f} MB, {report.lines} lines in {dt:.2f} s = {n / 1e6 / dt:.0f} MB/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"), help="log size, e.g. 1G (default), 100M")
    ap.add_argument("--keep", metavar="PATH", help="write the log here and keep it (default: a temp file, removed)")
    ap.add_argument("--run", action="store_true", help="also time `torchdoctor run -- cat LOG` (output to /dev/null)")
    ap.add_argument("--shapes", action="store_true",
                    help="also time a log whose every line is an event, and one line without a newline")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    path = args.keep or tempfile.mkstemp(prefix="torchdoctor-logs-", suffix=".log")[1]
    try:
        t = time.perf_counter()
        n = generate(path, args.size)
        print(f"generated {n / 1e6:.0f} MB in {time.perf_counter() - t:.1f} s: {path}")
        t = time.perf_counter()
        with open(path, "rb") as f:
            report = analyze_stream(f)
        dt = time.perf_counter() - t
        # the floor in the same run: Python only iterating the file's lines (decoded), doing nothing else
        t = time.perf_counter()
        with open(path, encoding="utf-8", errors="replace") as f:
            for _ in f:
                pass
        floor = time.perf_counter() - t
        run_dt = time_run(path) if args.run else None
    finally:
        if not args.keep:
            os.unlink(path)
    ids = sorted({f.id for f in report.findings})
    print(f"analyze_stream: {n / 1e6:.0f} MB, {report.lines} lines in {dt:.2f} s = {n / 1e6 / dt:.0f} MB/s "
          f"(one core); timeline kept {len(report.timeline)} events, dropped {report.timeline_dropped}; "
          f"findings: {', '.join(ids)}")
    print(f"floor (plain `for line in open(...)`, decoded): {floor:.2f} s = {n / 1e6 / floor:.0f} MB/s; "
          f"analyze_stream takes {dt / floor:.2f}x that")
    if run_dt is not None:
        print(f"torchdoctor run -- cat (to /dev/null): {run_dt:.2f} s = {n / 1e6 / run_dt:.0f} MB/s")
    if args.shapes:
        time_shapes(args.size)
    expected = {"fp16.overflow", "loss.nonfinite", "process.killed"}
    if not expected <= set(ids):
        print(f"MISSING findings: {sorted(expected - set(ids))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

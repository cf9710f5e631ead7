"""``torchdoctor comm``: prove every rank can talk to every other, or say which one cannot and where.

Run it the way you run training: under torchrun (any node count), under srun (one task per GPU), or
standalone with ``--local N``. Each stage (join, init, device, all_reduce, all_gather, broadcast, ring,
barrier, and with ``--bench`` the benchmark) is bounded by ``--timeout``; a rank that never joins, dies
or hangs is named in the verdict and every process exits instead of hanging.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from .._system import MIB
from ..units import UNITS_HELP
from .capacity import MIN_BATCH, RANK_BYTES, RANKS_PER_CPU
from .session import EXIT_USAGE, Options

DEFAULT_SIZES = "1K:64M:4"
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int8", "uint8")


# the end of --help, built by cli.describe like every command's
EXAMPLES = [
    ("torchdoctor comm --local 4", "4 ranks on this machine"),
    ("torchrun --nproc_per_node 8 -m torchdoctor comm", "one node"),
    ("torchrun --nnodes 2 --node_rank R --master_addr A --master_port 29500 --nproc_per_node 8 -m torchdoctor comm",
     "two nodes (static)"),
    ("srun --ntasks-per-node 8 python -m torchdoctor comm", "SLURM, one task per GPU"),
    ("torchdoctor comm --local 2 --bench --sizes 1M:256M", "bandwidth, as nccl-tests reports it"),
    ("torchrun --nnodes 8 --nproc_per_node 8 ... -m torchdoctor comm --pairs", "every link, the slow ones named"),
]
EXIT_CODES = [(0, "every rank passed"), (1, "a rank is missing, broken or stuck"), (EXIT_USAGE, "bad usage"),
              (130, "interrupted (Ctrl-C)"),
              (143, "--local stopped from outside by SIGTERM (`timeout`, `kill`; 129 for SIGHUP)")]
# counts are plain digits: int() would also take "1_0", " 10", "+10" and other scripts' digits
_COUNT = re.compile(r"[0-9]+")
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", metavar="N", default=None,
                        help="start N ranks on this machine (no launcher needed), in batches of one per CPU "
                             f"(at least {MIN_BATCH}); refused beyond {RANKS_PER_CPU} ranks per CPU (a connectivity "
                             "check mostly waits) or what the available memory holds "
                             f"(~{RANK_BYTES // MIB} MiB a rank, plus 3x the largest --sizes with --bench on gloo)")
    parser.add_argument("--force", action="store_true",
                        help="with --local: start N ranks even beyond what this machine holds")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                        help="auto (default): nccl when every rank has a CUDA device, else gloo")
    parser.add_argument("--timeout", default="60",
                        help="seconds each stage (and each benchmark iteration) may take (default: 60)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--nccl-debug", choices=("INFO", "WARN", "TRACE", "VERSION"), default=None,
                        help="set NCCL_DEBUG for this run (NCCL's own log goes to stderr)")
    parser.add_argument("--nccl-debug-subsys", default=None, metavar="LIST",
                        help="set NCCL_DEBUG_SUBSYS, e.g. INIT,NET,P2P")
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--bench", action="store_true",
                       help="after the checks, time all_reduce, all_gather, reduce_scatter, broadcast, all_to_all")
    bench.add_argument("--sizes", default=DEFAULT_SIZES,
                       help="message sizes: a list (1K,1M,64M) or a range START:END[:FACTOR] (1K:64M doubles; "
                            f"default {DEFAULT_SIZES}); the full tensor's bytes, as in nccl-tests; {UNITS_HELP}, "
                            "a plain number is bytes")
    bench.add_argument("--iters", default="20", help="timed iterations per size (default: 20)")
    bench.add_argument("--warmup", default="5", help="untimed iterations first (default: 5)")
    bench.add_argument("--dtype", default="float32", choices=DTYPES, help="element type (default: float32)")
    links = parser.add_argument_group("links")
    links.add_argument("--pairs", action="store_true",
                       help="after the checks, the point-to-point bandwidth of every pair of ranks, both directions, "
                            "in rounds of disjoint pairs (N-1 rounds for N ranks); names the links far below the "
                            "median of their kind (same host, other host, NVLink, PCIe)")
    links.add_argument("--pair-size", default=None,
                       help=f"message size for --pairs, 64K to 1G (default 8M; {UNITS_HELP}); implies --pairs")
    links.add_argument("--pair-iters", default=None,
                       help="timed messages per direction of a pair (default 5); implies --pairs")


def _usage(message: str) -> int:
    print(f"torchdoctor comm: {message}", file=sys.stderr)
    return EXIT_USAGE


def count(flag: str, text: str | None) -> int | str | None:
    """A count given on the command line: plain digits (``10``), else the one-line reason it is refused."""
    if text is None:
        return None
    if not _COUNT.fullmatch(text):
        return f"{flag} takes a count in plain digits (0-9), got {text!r}"
    return int(text)


def _options(args: argparse.Namespace) -> Options | str:
    from .sizes import SizeError, parse_sizes

    timeout = float(args.timeout) if _SECONDS.fullmatch(str(args.timeout)) else math.nan
    if not math.isfinite(timeout) or timeout < 1:
        return (f"--timeout must be a number of seconds, at least 1 (plain digits, such as 60 or 2.5), "
                f"got {args.timeout!r}")
    iters, warmup = count("--iters", args.iters), count("--warmup", args.warmup)
    for v in (iters, warmup):
        if isinstance(v, str):
            return v
    if iters < 1 or warmup < 0:
        return "--iters must be at least 1 and --warmup at least 0"
    try:
        sizes = parse_sizes(args.sizes)
    except SizeError as e:
        return f"--sizes: {e}"
    from .pairs import MAX_PAIR_BYTES, MIN_PAIR_BYTES

    pairs = args.pairs or args.pair_size is not None or args.pair_iters is not None
    try:
        pair_sizes = parse_sizes(str(args.pair_size or "8M"))
    except SizeError as e:
        return f"--pair-size: {e}"
    if len(pair_sizes) != 1:
        return f"--pair-size takes one size, got {args.pair_size!r}"
    if not MIN_PAIR_BYTES <= pair_sizes[0] <= MAX_PAIR_BYTES:
        return (f"--pair-size must be from 64K (smaller messages measure latency, not a link) to 1G (each rank "
                f"holds one such buffer), got {args.pair_size!r}")
    pair_iters = count("--pair-iters", args.pair_iters or "5")
    if isinstance(pair_iters, str):
        return pair_iters
    if pair_iters < 1:
        return "--pair-iters must be at least 1"
    return Options(backend=args.backend, timeout=timeout, json=args.json, bench=args.bench, sizes=sizes,
                   iters=iters, warmup=warmup, dtype=args.dtype, nccl_debug=args.nccl_debug,
                   nccl_debug_subsys=args.nccl_debug_subsys, pairs=pairs, pair_size=pair_sizes[0],
                   pair_iters=pair_iters)


def _nothing_to_test(world: int, backend: str, has_cuda: bool) -> str | None:
    if backend == "nccl" and not has_cuda:
        return "--backend nccl needs CUDA, and torch sees no CUDA device here (use --backend gloo or auto)"
    if world == 1 and (backend == "gloo" or not has_cuda):
        return ("world size 1 without a GPU: nothing crosses a process boundary, so there is nothing to test; "
                "start several ranks: torchdoctor comm --local 2, or torchrun --nproc_per_node N -m torchdoctor comm")
    return None


def run(args: argparse.Namespace) -> int:
    local = count("--local", args.local)
    if isinstance(local, str):
        return _usage(local)
    args.local = local
    opts = _options(args)
    if isinstance(opts, str):
        return _usage(opts)
    from .launch import LaunchError, from_env

    try:
        launch = from_env(os.environ) if args.local is None else None
    except LaunchError as e:
        return _usage(str(e))
    if args.local is not None and args.local < 1:
        return _usage("--local needs at least 1 rank")
    if args.local is not None:  # before torch is imported: refusing costs nothing
        from .capacity import batch_size, rank_bytes, refusal, this_machine

        machine = this_machine()
        largest = max([*(opts.sizes if opts.bench else []), *([opts.pair_size] if opts.pairs else [])], default=None)
        per_rank = rank_bytes(largest, host_buffers=opts.backend != "nccl")
        if not args.force and (msg := refusal(args.local, machine, per_rank)):
            return _usage(msg)
    if args.local is None and launch is None:
        return _usage("no launcher found (RANK/WORLD_SIZE or SLURM_PROCID unset): run under torchrun or srun, "
                      "or start ranks here with --local N")
    # c10d's C++ warnings come with stack traces on every store retry; our verdict says what they mean
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.local is None:  # a rank: its session takes SIGTERM / SIGINT in one thread, which torch's must not steal
        from .session import block_stop_signals

        block_stop_signals()
    import torch

    world = args.local if args.local is not None else launch.world_size
    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    # Only this machine's view: under a launcher, other ranks may differ, which the join stage sorts out.
    if (args.local is not None or world == 1) and (msg := _nothing_to_test(world, args.backend, has_cuda)):
        return _usage(msg)
    if args.local is not None:
        from .local import run_local

        return run_local(args.local, opts, batch_size(machine))
    from .session import RankSession

    return RankSession(launch, opts).run()

"""The numerics monitor on a compiled training step, against the same compiled step bare.

Run from the repository root::

    .venv/bin/python benchmarks/compile_overhead.py            # inductor, about a minute on 2 cores
    .venv/bin/python benchmarks/compile_overhead.py --json

Four copies of one seeded MLP (8 x (Linear 512x512, GELU) + Linear 512x16, batch 64) are compiled with
``torch.compile`` (inductor): one bare, one each with ``NumericsMonitor(grads="none"|"params"|"modules")``
attached to the compiled module. After a warm-up (compilation), each repetition runs ``--steps`` SGD steps of
every variant round-robin, the starting variant rotating, so machine noise lands on all alike. Reported per
variant: the median step time and the median over repetitions of its ratio to the bare step of the same
repetition; and Dynamo's graph / graph-break / recompilation counts over the whole run (they must be equal).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from torch import nn
from torch._dynamo.utils import counters, get_compilation_metrics

from torchdoctor import NumericsMonitor

VARIANTS = ("bare", "none", "params", "modules", "params, every module")


def mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = mlp(args.width, args.depth)
    runs = {}
    for v in VARIANTS:
        model = copy.deepcopy(base)
        call = torch.compile(model, backend=args.backend)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        if v == "bare":
            mon = None
        elif v == "params, every module":  # the level before issue 21 (a tree from before it: its only one)
            try:
                mon = NumericsMonitor(call, optimizer=opt, grads="params", watch="every-module")
            except TypeError:
                mon = NumericsMonitor(call, optimizer=opt, grads="params")
        else:
            mon = NumericsMonitor(call, optimizer=opt, grads=v)
        runs[v] = (call, opt, mon)
    x = torch.randn(args.batch, args.width)

    def step(v: str) -> None:
        call, opt, _ = runs[v]
        call(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for v in VARIANTS:  # compile and warm up
        for _ in range(3):
            step(v)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
        for v in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(v)
            times[v].append((time.perf_counter() - t0) / args.steps)
    for _, _, mon in runs.values():
        if mon is not None:
            mon.close()
    result = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
        "model": f"MLP {args.depth}x{args.width}, batch {args.batch}, SGD, backend {args.backend}",
        "median_ms": {v: 1e3 * statistics.median(times[v]) for v in VARIANTS},
        "ratio": {v: statistics.median(t / b for t, b in zip(times[v], times["bare"])) for v in VARIANTS},
        "dynamo": {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
                   "recompiles": len([m for m in get_compilation_metrics() if m.recompile_reason])},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['model']}; {result['machine']}; {args.reps} reps x {args.steps} steps, interleaved")
    for v in VARIANTS:
        print(f"  {v:20} {result['median_ms'][v]:8.2f} ms/step   {result['ratio'][v]:.3f}x bare")
    d = result["dynamo"]
    print(f"  dynamo over all the models: {d['graphs']} graphs, {d['breaks']} breaks, {d['recompiles']} recompiles")


if __name__ == "__main__":
    main()

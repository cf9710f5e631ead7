"""The numerics monitor on an FSDP2 training step, 2 ranks on gloo, against the same step bare.

Run from the repository root (it starts its own 2 ranks with torchrun)::

    .venv/bin/python benchmarks/fsdp_overhead.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/fsdp_overhead.py --json

Each rank builds four copies of one seeded model (an input Linear, 4 residual blocks of Linear 256->1024,
GELU, Linear 1024->256, a LayerNorm and an output Linear), each ``fully_shard``-ed per block and at the
root, with its own AdamW: one bare, one each with ``NumericsMonitor(grads="none"|"params"|"modules")``.
After a warm-up, each repetition runs ``--steps`` steps of every variant round-robin (the starting one
rotating). Rank 0 reports the median step time per variant, the median over repetitions of its ratio to
the bare step, and the host syncs per step beyond the bare step's (``SyncCounter``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("bare", "none", "params", "modules")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchdoctor import NumericsMonitor
    from torchdoctor.syncs import SyncCounter

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.act, self.down = nn.Linear(args.width, 4 * args.width), nn.GELU(), nn.Linear(4 * args.width,
                                                                                                       args.width)

        def forward(self, x):
            return x + self.down(self.act(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(64, args.width)
            self.blocks = nn.ModuleList([Block() for _ in range(args.blocks)])
            self.norm, self.out = nn.LayerNorm(args.width), nn.Linear(args.width, 16)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(self.norm(x))

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = Net()
    runs = {}
    for v in VARIANTS:
        model = copy.deepcopy(base)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[v] = (model, opt, None if v == "bare" else NumericsMonitor(model, optimizer=opt, grads=v))
    x = torch.randn(args.batch, 64, generator=torch.Generator().manual_seed(rank))

    def step(v: str) -> None:
        model, opt, _ = runs[v]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for v in VARIANTS:
        for _ in range(3):
            step(v)
    syncs = {}
    for v in VARIANTS:
        with SyncCounter() as c:
            step(v)
        syncs[v] = c.count
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(v)
            times[v].append((time.perf_counter() - t0) / args.steps)
    for _, _, mon in runs.values():
        if mon is not None:
            mon.close()
    if rank == 0:
        print(json.dumps({
            "model": f"FSDP2, {dist.get_world_size()} ranks gloo, {args.blocks} blocks width {args.width}, batch "
                     f"{args.batch}, AdamW, torch {torch.__version__}, 1 thread per rank",
            "median_ms": {v: 1e3 * statistics.median(times[v]) for v in VARIANTS},
            "ratio": {v: statistics.median(t / b for t, b in zip(times[v], times["bare"])) for v in VARIANTS},
            "extra_syncs_per_step": {v: syncs[v] - syncs["bare"] for v in VARIANTS},
        }))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "--worker",
           "--width", str(args.width), "--blocks", str(args.blocks), "--batch", str(args.batch),
           "--reps", str(args.reps), "--steps", str(args.steps)]
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"the ranks failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['model']}; {args.reps} reps x {args.steps} steps, interleaved")
    for v in VARIANTS:
        print(f"  {v:8} {result['median_ms'][v]:8.2f} ms/step   {result['ratio'][v]:.3f}x bare   "
              f"{result['extra_syncs_per_step'][v]:+d} host syncs/step")


if __name__ == "__main__":
    main()

"""Can the monitor's per-step verdict under DDP ride on DDP's own gradient all-reduce? 2 ranks on gloo.

Run from the repository root (it starts its own 2 ranks with torchrun)::

    .venv/bin/python benchmarks/ddp_verdict.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/ddp_verdict.py --json

Two parts, both on rank 0's side of a 2-rank DDP job (one thread per rank):

1. **What the shared verdict costs.** A small residual MLP under DDP with SGD, three variants round-robin per
   repetition (the first rotating): bare; ``NumericsMonitor(ddp, opt)`` (the verdict all-reduced: every rank
   stops together); the same with ``sync_ranks=False`` (each rank judges its own values: what riding on DDP's
   reduction would cost at most). Median step time per variant and the median over repetitions of each ratio.
2. **Does DDP's reduction carry the fault to every rank?** No monitor: for each kind of fault made on rank 1
   alone, each rank's own finiteness after the backward -- of the model's outputs (what the boundaries level
   checks in the forward) and of its gradients after DDP's all-reduce. Where rank 0 sees every fault in its
   reduced gradients, a verdict from local values would agree on every rank; where it does not, a rank judging
   alone would stop while the other goes on into its next collective, and wait forever.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("bare", "shared", "local")
FAULTS = ("input inf (reaches the loss)", "backward only (sqrt'(0))", "weight inf (rank 1's copy)",
          "output nan the loss ignores", "nan logits at an ignore_index token",
          "input inf in micro-batch 1 of 2 (no_sync)")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from torchdoctor import NumericsMonitor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

        def forward(self, x):
            return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))

    class Net(nn.Module):
        def __init__(self, d: int = 64, blocks: int = 4, vocab: int = 32) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block(d) for _ in range(blocks)))
            self.head = nn.Linear(d, vocab)
            self.aux = nn.Linear(d, 1)
            self.sqrt = self.nan_diagnostic = False

        def forward(self, x):
            h = self.blocks(x)
            if self.sqrt:
                h = h.abs().sqrt()
            diagnostic = h.detach().mean(-1)  # an output the loss does not use
            if self.nan_diagnostic:
                diagnostic = diagnostic + float("nan")
            return self.head(h), self.aux(h), diagnostic

    def make() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Net()
        ddp = nn.parallel.DistributedDataParallel(model)
        return model, ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3)

    x = torch.randn(args.batch, 64)
    y = torch.randint(0, 32, (args.batch,))

    def loss_of(outputs: tuple, target: torch.Tensor = y) -> torch.Tensor:
        logits, aux, _diagnostic = outputs
        return nn.functional.cross_entropy(logits, target, ignore_index=-100) + 1e-3 * aux.pow(2).mean()

    def finite(outputs: tuple) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in outputs)

    # ---------------------------------------------------------------- 1. cost
    runs = {}
    for name in VARIANTS:
        model, ddp, opt = make()
        mon = None
        if name != "bare":
            mon = NumericsMonitor(ddp, opt, sync_ranks=name == "shared", report_dir=args.out)
            mon.__enter__()
        runs[name] = (ddp, opt, mon)

    def one_step(ddp, opt) -> None:
        loss_of(ddp(x)).backward()
        opt.step()
        opt.zero_grad()

    for name in VARIANTS:
        for _ in range(args.warmup):
            one_step(*runs[name][:2])
    times = {name: [] for name in VARIANTS}
    ratios = {name: [] for name in VARIANTS if name != "bare"}
    for rep in range(args.reps):
        order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
        medians = {}
        for name in order:
            ddp, opt, _ = runs[name]
            steps = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                one_step(ddp, opt)
                steps.append(time.perf_counter() - t0)
            medians[name] = statistics.median(steps)
            times[name] += steps
        for name in ratios:
            ratios[name].append(medians[name] / medians["bare"])
    for _ddp, _opt, mon in runs.values():
        if mon is not None:
            mon.__exit__(None, None, None)

    # ---------------------------------------------------------------- 2. is the fault carried?
    carried = []
    for fault in FAULTS:
        model, ddp, opt = make()
        inputs, target = x.clone(), y.clone()
        on_me = rank == 1
        if on_me and fault.startswith("input inf"):
            inputs[0, 3] = float("inf")
        if fault.startswith("backward"):
            model.sqrt = True
            if on_me:
                with torch.no_grad():  # the last LayerNorm's output made exactly 0 in one row
                    model.blocks[-1].norm.weight.zero_()
                    model.blocks[-1].norm.bias.zero_()
        if on_me and fault.startswith("weight"):
            with torch.no_grad():
                model.blocks[1].up.weight[0, 0] = float("inf")
        model.nan_diagnostic = on_me and fault.startswith("output nan")
        outs_ok = []
        if fault.endswith("(no_sync)"):
            with ddp.no_sync():
                outputs = ddp(inputs)
                loss_of(outputs, target).backward()
                outs_ok.append(finite(outputs))
            outputs = ddp(x)
            loss_of(outputs, target).backward()
            outs_ok.append(finite(outputs))
        else:
            outputs = ddp(inputs)
            if on_me and fault.startswith("nan logits"):  # the loop masks a token whose logits went nan
                logits = outputs[0].clone()
                logits[0] = float("nan")
                outputs = (logits, *outputs[1:])
                target[0] = -100
            loss_of(outputs, target).backward()
            outs_ok.append(finite(outputs))
        grads_ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        seen = [None, None]
        dist.all_gather_object(seen, (all(outs_ok), grads_ok))
        carried.append({"fault": fault, "rank1_outputs_ok": seen[1][0], "rank1_grads_ok": seen[1][1],
                        "rank0_outputs_ok": seen[0][0], "rank0_grads_ok": seen[0][1]})

    if rank == 0:
        result = {
            "batch": args.batch,
            "ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
            "ratio": {name: statistics.median(rs) for name, rs in ratios.items()},
            "carried": carried,
        }
        with open(os.path.join(args.out, "result.json"), "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # results written: past torch's gloo abort at interpreter exit (tests/conftest.py leave_worker)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.path.join(os.path.dirname(here), "src")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--worker", "--out", out, "--reps", str(args.reps), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"the 2-rank run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "result.json")) as fh:
            result = json.load(fh)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"DDP, 2 ranks on gloo, batch {result['batch']}: median step time")
    for name, ms in result["ms"].items():
        ratio = result["ratio"].get(name)
        print(f"  {name:7s} {ms:7.2f} ms" + (f"   {ratio:.3f}x bare" if ratio else ""))
    print("\nfault on rank 1 -> finite after the backward?      rank 1 outputs/grads   rank 0 outputs/grads")
    for row in result["carried"]:
        print(f"  {row['fault']:45s}  {row['rank1_outputs_ok']!s:5s} / {row['rank1_grads_ok']!s:5s}"
              f"          {row['rank0_outputs_ok']!s:5s} / {row['rank0_grads_ok']!s:5s}")


if __name__ == "__main__":
    main()

"""What the numerics monitor costs in Python garbage collection, per training step.

Run from the repository root::

    .venv/bin/python benchmarks/numerics_gc.py                  # bare, "params", "modules": ~5 min on 2 cores
    .venv/bin/python benchmarks/numerics_gc.py --steps 500 --rounds 1   # a quick look, ~1 min
    .venv/bin/python benchmarks/numerics_gc.py --json out.json

Why: the monitor keeps a few objects per hooked module through each step (its frames, the slots that label the
values, the gradient hooks at ``"modules"``). Every collection that runs mid-step promotes what is alive then --
these objects and the model's own activations -- to an older generation, and promotions are what trigger a full
collection of the whole heap (~150-200 ms for this process's ~350K objects; more in a real training program).
``numerics_dispatch.py`` cannot show this: its variants share one process, hence one collector, so a collection
the monitor causes lands on whichever variant runs at that moment, the bare one included. Here each variant runs in
a process of its own: the tiny T5 of ``numerics_dispatch.py`` (d_model 32, 4+4 layers, batch 1, 8/8 tokens, SGD,
one thread), a warm-up, then ``--steps`` steps timed in thread CPU time with every collection timed by
``gc.callbacks``. Variants are interleaved over ``--rounds``; medians are printed. To compare two trees, run this
script with each tree's ``src`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("bare", "params", "modules")


def child(variant: str, steps: int) -> dict:
    """One variant in this process: ms per step, and the collector's work per generation."""
    import gc

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from numerics_dispatch import Variant, batch_of, t5  # (the same tiny T5, monitor and step)

    torch.set_num_threads(1)
    run, batch = Variant(variant, t5(32, 64, 4, 2, 16, 128, gated=False)), batch_of(128, 1, 8, 8)
    for _ in range(10):
        run.step(batch)
    started: list[float] = []
    count, spent = [0, 0, 0], [0.0, 0.0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.thread_time())
        elif started:
            spent[info["generation"]] += time.thread_time() - started.pop()
            count[info["generation"]] += 1

    gc.callbacks.append(on_gc)
    t0 = time.thread_time()
    for _ in range(steps):
        run.step(batch)
    elapsed = time.thread_time() - t0
    gc.callbacks.remove(on_gc)
    run.close()
    return {"step_ms": elapsed / steps * 1e3, "gc_ms_per_step": sum(spent) / steps * 1e3,
            "collections": count, "ms_per_collection": [s / c * 1e3 if c else None for s, c in zip(spent, count)],
            "objects": len(gc.get_objects())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500, help="timed steps per run (default 1500)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each variant, interleaved (default 2)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be at least 1")
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return 0
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            print(f"  round {r + 1}/{args.rounds}: {v}", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, __file__, "--child", v, "--steps", str(args.steps)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            runs[v].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{'variant':10s} {'step':>9s} {'gc/step':>9s}   collections per 1000 steps (gen 0 / 1 / 2)   ms each (2)")
    for v, rs in runs.items():
        per_k = [statistics.median(r["collections"][g] for r in rs) * 1000 / args.steps for g in range(3)]
        full = [r["ms_per_collection"][2] for r in rs if r["ms_per_collection"][2] is not None]
        print(f"{v:10s} {statistics.median(r['step_ms'] for r in rs):7.2f}ms "
              f"{statistics.median(r['gc_ms_per_step'] for r in rs):7.3f}ms   "
              f"{per_k[0]:7.0f} / {per_k[1]:5.0f} / {per_k[2]:5.1f}{'':19s}"
              f"{statistics.median(full) if full else float('nan'):6.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

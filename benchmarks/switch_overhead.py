"""The monitor's cost under ``torchdoctor run --numerics`` against the same monitor attached in the script.

Run from the repository root::

    .venv/bin/python benchmarks/switch_overhead.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/switch_overhead.py --quick    # smoke test, numbers meaningless
    .venv/bin/python benchmarks/switch_overhead.py --json out.json

One training script (written to a temporary folder; it imports torchdoctor only in the ``library`` variant) trains
a tiny T5 (d_model 32, 4+4 layers, batch 1, 8/8 tokens, AdamW, one thread: compute negligible, the CPU picture of
a launch-bound GPU step) in a fresh process per variant:

* ``bare``: nothing attached;
* ``library``: ``NumericsMonitor(model, optimizer=opt)`` (the default level, ``grads="params"``) in the script;
* ``switch``: the bare script, started with the environment ``torchdoctor run --numerics`` gives its command
  (:func:`torchdoctor.run.inside.child_environment`): the bootstrap attaches the same monitor, same level, at the
  first ``optimizer.step()``.

Each process warms up, then times ``--steps`` steps (thread CPU time, and wall time); the parent runs
``--reps`` rounds of the three variants, the starting variant rotating, and reports the median over rounds of
each ratio taken within a round (switch / library is the figure that matters: it should be 1.00).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from torchdoctor.run.inside import child_environment  # noqa: E402

SCRIPT = r'''
import json, sys, time
import torch
from transformers import T5Config, T5ForConditionalGeneration

variant, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_decoder_layers=4, num_heads=4,
               decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
model = T5ForConditionalGeneration(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
if variant == "library":
    import torchdoctor
    mon = torchdoctor.NumericsMonitor(model, optimizer=opt)
g = torch.Generator().manual_seed(1)
batches = [(torch.randint(1, 64, (1, 8), generator=g), torch.randint(1, 64, (1, 8), generator=g))
           for _ in range(warmup + steps)]
cpu, wall = [], []
for i, (x, y) in enumerate(batches):
    t0, w0 = time.thread_time(), time.perf_counter()
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if i >= warmup:
        cpu.append(time.thread_time() - t0)
        wall.append(time.perf_counter() - w0)
print(json.dumps({"cpu": cpu, "wall": wall}))
'''

VARIANTS = ("bare", "library", "switch")


def run_one(script: Path, variant: str, warmup: int, steps: int, reports: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHDOCTOR_NUMERICS"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["OMP_NUM_THREADS"] = "1"
    env["TORCHDOCTOR_REPORT_DIR"] = reports
    if variant == "switch":
        env = child_environment({"report_dir": reports}, env)
    proc = subprocess.run([sys.executable, str(script), variant, str(warmup), str(steps)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    if variant == "switch" and "watching T5ForConditionalGeneration" not in proc.stderr:
        raise SystemExit(f"the switch did not attach:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args()
    if a.quick:
        a.reps, a.steps, a.warmup = 1, 10, 2
    ratios: dict[str, list[float]] = {"library/bare": [], "switch/bare": [], "switch/library": []}
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        for rep in range(a.reps):
            order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
            got = {}
            for v in order:
                got[v] = statistics.median(run_one(script, v, a.warmup, a.steps, tmp)["cpu"])
                medians[v].append(got[v])
            ratios["library/bare"].append(got["library"] / got["bare"])
            ratios["switch/bare"].append(got["switch"] / got["bare"])
            ratios["switch/library"].append(got["switch"] / got["library"])
            print(f"round {rep + 1}/{a.reps}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()),
                  file=sys.stderr, flush=True)
    out = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_start": load0,
                    "load_end": os.getloadavg()},
        "reps": a.reps, "steps": a.steps,
        "median_step_us": {v: round(statistics.median(m) * 1e6, 1) for v, m in medians.items()},
        "ratios": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
        "ratio_ranges": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()},
    }
    print("median step (thread CPU time): " + ", ".join(f"{k} {v:.0f} us" for k, v in out["median_step_us"].items()))
    for k, v in out["ratios"].items():
        lo, hi = out["ratio_ranges"][k]
        print(f"{k:16s} {v:.3f}  (rounds: {lo:.3f} .. {hi:.3f})")
    print(f"load average: {load0[0]:.2f} at start, {out['machine']['load_end'][0]:.2f} at end")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

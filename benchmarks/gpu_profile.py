"""Where the numerics monitor's time goes under CUDA: a profile of one training step, bare vs monitored.

``benchmarks/gpu_check.py`` shows that on a small, launch-bound model the monitor costs ~1.4x under CUDA
while hooking alone costs ~1.05x. This script splits the rest: the aten ops each variant dispatches (host
time per op, torch.profiler) and the Python functions of the monitor (cProfile, tottime).

Usage: ``python benchmarks/gpu_profile.py [--device cuda] [--level none] [--top 25]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from gpu_check import build, training_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--level", default="none", choices=["none", "params", "modules"])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device here (use --device cpu for a smoke run)")
        return 0
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    amp = device.type == "cuda"
    base, batch = build(device)
    for name in ("bare", args.level):
        step, mon = training_step(base, batch, device, None if name == "bare" else args.level)
        for _ in range(3):
            step()
        if amp:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if amp else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                step()
            if amp:
                torch.cuda.synchronize()
        print(f"===== {name}: aten ops, 5 steps, by host self time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        if mon is not None:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                step()
            if amp:
                torch.cuda.synchronize()
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"===== {name}: Python, 5 steps, by tottime")
            print(out.getvalue())
            mon.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

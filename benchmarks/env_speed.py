"""How long ``torchdoctor env`` takes, next to the tools people run today, in one interleaved run.

Each tool runs as a fresh process (what a user waits for): ``torchdoctor env --json``,
``python -m torch.utils.collect_env``, ``transformers env`` and ``ds_report`` (when installed).
Reports the median wall time per tool and the ratio to torchdoctor's. The issue's bar: < 5 s here.

Usage: python benchmarks/env_speed.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")
BIN = Path(sys.executable).parent


def tools() -> dict[str, list[str]]:
    out = {"torchdoctor env": [sys.executable, "-m", "torchdoctor", "env", "--json"],
           "torch collect_env": [sys.executable, "-m", "torch.utils.collect_env"]}
    for name, cmd in (("transformers env", "transformers"), ("ds_report", "ds_report")):
        exe = BIN / cmd if (BIN / cmd).exists() else shutil.which(cmd)
        if exe:
            out[name] = [str(exe)] + (["env"] if cmd == "transformers" else [])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": SRC}
    times: dict[str, list[float]] = {name: [] for name in tools()}
    codes: dict[str, int] = {}
    for _ in range(args.reps):
        for name, cmd in tools().items():  # interleaved: noise on this shared box hits every tool alike
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, env=env, timeout=300)
            times[name].append(time.perf_counter() - t0)
            codes[name] = p.returncode
    base = statistics.median(times["torchdoctor env"])
    print(f"{os.cpu_count()} cores; median of {args.reps} interleaved runs (fresh process each)\n")
    print("| tool | median s | min..max s | vs torchdoctor env | exit |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f}..{max(ts):.2f} | {med / base:.2f}x | {codes[name]} |")


if __name__ == "__main__":
    main()

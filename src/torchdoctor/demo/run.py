"""``torchdoctor demo``: the guide's fp16 overflow, found, explained and fixed, on CPU in seconds.

1. A tiny T5-shaped model (built in-package, no downloads) trains in fp16 (CPU autocast + GradScaler)
   under :class:`~torchdoctor.NumericsMonitor`. Its gated-GELU feed-forward in block 2 pushes its
   output close to fp16's 65504 and the following dropout's 1/(1-p) rescale overflows to inf.
2. The monitor stops the step before the optimizer applies it and prints the report: the module, the
   frames before it, and why.
3. The demo applies the report's fix, :func:`torchdoctor.keep_fp32` on the region named, and trains
   the same steps again from the same start: the loss stays finite.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_steps, default=6, help="training steps per run, 1 or more (default: 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, data and dropout (default: 0)")
    parser.add_argument(
        "--report-dir",
        default=None,
        help="where the monitor writes torchdoctor-nonfinite-rank0.txt/.json (default: a temporary folder)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the narrative")


def _steps(text: str) -> int:
    """``--steps``: a whole number >= 1; argparse turns the ValueError into a one-line usage error, exit 2."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps (1 or more), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _train(build_demo, train_steps, seed: int, steps: int, report_dir: str, region: str | None = None):
    import torch

    from torchdoctor import NonFiniteError, NumericsMonitor, keep_fp32

    model, batches = build_demo(seed)
    guard = keep_fp32(model, region) if region else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[float] = []
    error = None  # the monitor raises before the optimizer applies a non-finite step
    mon = NumericsMonitor(model, optimizer=opt, report_dir=report_dir)
    try:  # around the with block: a step checked only as the block exits is raised by the with statement
        with mon:
            losses = train_steps(model, batches, steps, "fp16", optimizer=opt, seed=seed)
    except NonFiniteError as e:
        error = e
    finally:
        if guard is not None:
            guard.remove()
    return losses, error, mon


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:  # run() called without the parser (argparse checks --steps itself)
        print("torchdoctor demo: --steps must be at least 1", file=sys.stderr)
        return 2
    import torch

    from .model import build_demo, train_steps

    torch.set_num_threads(min(2, torch.get_num_threads()))
    report_dir = args.report_dir or tempfile.mkdtemp(prefix="torchdoctor-demo-")
    say = (lambda *a: None) if args.json else print
    t0 = time.perf_counter()
    say(f"torchdoctor demo: a tiny T5 trains in fp16 (CPU autocast + GradScaler) for {args.steps} steps\n")
    losses, error, _ = _train(build_demo, train_steps, args.seed, args.steps, report_dir)
    result = {"first_run": {"losses": losses, "error": None}, "fixed_run": None}
    if error is None:
        say(f"no overflow this time (losses {losses}); nothing to fix")
        if args.json:
            print(json.dumps(result))
        return 1
    result["first_run"]["error"] = error.details.to_json()
    say(f"the monitor stopped the run at step {error.first.step}, before the optimizer applied it:\n")
    say(error.report)
    if not any(note.startswith("(could not write") for note in error.details.notes):
        say(f"\n(report also written to {report_dir}/torchdoctor-nonfinite-rank0.txt and .json)\n")
    region = error.details.fp32_region
    if region is None:
        say("the report names no region to keep in fp32; the demo stops here")
        return 1
    say(f"applying the fix: torchdoctor.keep_fp32(model, {region!r}) and training the same steps again\n")
    fixed, fixed_error, _ = _train(build_demo, train_steps, args.seed, args.steps, report_dir, region)
    ok = fixed_error is None and len(fixed) == args.steps and all(map(_finite, fixed))
    result["fixed_run"] = {"region": region, "losses": fixed, "finite": ok}
    say(f"losses with {region} in fp32: {[round(x, 3) for x in fixed]}")
    say(("all finite: the fix works" if ok else "still not finite") + f"  ({time.perf_counter() - t0:.1f} s)")
    if args.json:
        print(json.dumps(result))
    return 0 if ok else 1


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")

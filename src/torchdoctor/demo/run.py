"""``torchdoctor demo``: the guide's fp16 overflow, found, explained and fixed, on CPU in seconds.

1. A tiny T5-shaped model (built in-package, no downloads) trains in fp16 (CPU autocast + GradScaler)
   under :class:`~torchdoctor.NumericsMonitor`. Its gated-GELU feed-forward in block 2 pushes its
   output close to fp16's 65504 and the following dropout's 1/(1-p) rescale overflows to inf.
2. The monitor stops the step before the optimizer applies it and prints the report: the module, the
   frames before it, and why.
3. The demo applies the report's fix, :func:`torchdoctor.keep_fp32` on the region named, and trains
   the same steps again from the same start: the loss stays finite.

The monitor writes its report to ``--report-dir`` (created, parents too, when missing; a path that cannot be written
is refused before any training). Without it the report goes to a temporary folder that is removed at exit, so no
folder is left behind per run; the narrative says so. ``--json`` is one strict-JSON object with the project's
``findings`` list (``demo.overflow-caught``, ``demo.fix-works``; ``demo.no-overflow`` / ``demo.no-region`` when the
demo did not go as shown, exit 1).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
MAX_STEPS = 1000  # the fixed run trains every step (1000: ~30 s on 2 cores); more steps show nothing new
MAX_SEED = 2**64 - 2  # torch takes 64-bit seeds, and the demo seeds its batches with seed + 1
REPORT = "torchdoctor-nonfinite-rank0"

EXAMPLES = [
    ("torchdoctor demo", "the overflow found, explained and fixed (about 5 s on CPU)"),
    ("torchdoctor demo --report-dir reports", "keep the monitor's report in ./reports"),
    ("torchdoctor demo --json | jq .findings", "the same as one JSON object"),
]
EXIT_CODES = [(EXIT_OK, "the demo went as shown"), (EXIT_PROBLEMS, "it did not (no overflow, or the fix did not hold)"),
              (EXIT_USAGE, "bad usage"), (130, "interrupted (Ctrl-C)")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_steps, default=6,
                        help=f"training steps per run, 1 to {MAX_STEPS} (default: 6)")
    parser.add_argument("--seed", type=_seed, default=0,
                        help="seed for the model, data and dropout, 0 to 2**64-2 (default: 0)")
    parser.add_argument(
        "--report-dir", metavar="DIR", default=None,
        help="keep the monitor's report (torchdoctor-nonfinite-rank0.txt/.json) in DIR, created if missing "
             "(default: a temporary folder, removed at exit)",
    )
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object ({"findings": [...], "first_run", "fixed_run"}) instead of the '
                             "narrative")


def _whole(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number {what}, got {text!r}") from None


def _steps(text: str) -> int:
    """``--steps``: 1 to :data:`MAX_STEPS`; argparse turns the error into a one-line usage error, exit 2."""
    value = _whole(text, "of steps (1 or more)")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"at most {MAX_STEPS} (the demo shows the same at 6), got {value}")
    return value


def _seed(text: str) -> int:
    """``--seed``: 0 to :data:`MAX_SEED` (``torch.manual_seed`` raises on anything past 64 bits)."""
    value = _whole(text, "(0 to 2**64-2)")
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**64-2 ({MAX_SEED}), got {text}")
    return value


def report_dir_problem(path: str) -> str | None:
    """Why the monitor could not write its report into ``path`` (None: it can). A missing folder is created, parents
    too, as the monitor itself would; what is refused is said before the minutes of training, not after."""
    if not path.strip():
        return "is empty; pass a folder"
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a folder"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # the real test: access() says yes to root on a read-only mount
            pass
    except OSError as e:
        return f"cannot be written: {e.strerror or e}"
    return None


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
    # run() called without the parser (the parser checks these itself)
    if not 1 <= args.steps <= MAX_STEPS or not 0 <= args.seed <= MAX_SEED:
        print(f"torchdoctor demo: --steps must be 1 to {MAX_STEPS} and --seed 0 to 2**64-2", file=sys.stderr)
        return EXIT_USAGE
    if args.report_dir is not None and (why := report_dir_problem(args.report_dir)):
        print(f"torchdoctor demo: --report-dir {args.report_dir}: {why}", file=sys.stderr)
        return EXIT_USAGE
    # Without --report-dir the report goes to a folder of its own that is removed at exit: the narrative shows the
    # report, and a run must not leave a folder behind per run.
    scratch = None if args.report_dir is not None else tempfile.mkdtemp(prefix="torchdoctor-demo-")
    try:
        return _demo(args, args.report_dir or scratch, kept=scratch is None)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _demo(args: argparse.Namespace, report_dir: str, kept: bool) -> int:
    import torch

    from ..findings import Finding
    from ..jsonfile import dumps
    from .model import build_demo, train_steps

    torch.set_num_threads(min(2, torch.get_num_threads()))
    say = (lambda *a: None) if args.json else print
    t0 = time.perf_counter()
    say(f"torchdoctor demo: a tiny T5 trains in fp16 (CPU autocast + GradScaler) for {args.steps} steps\n")
    losses, error, _ = _train(build_demo, train_steps, args.seed, args.steps, report_dir)
    result: dict = {"findings": [], "seed": args.seed, "steps": args.steps,
                    "first_run": {"losses": losses, "error": None}, "fixed_run": None, "report_files": None}
    findings: list[Finding] = []

    def done(code: int) -> int:
        if args.json:
            result["findings"] = [f.to_json() for f in findings]
            print(dumps(result))
        return code

    if error is None:
        say(f"no overflow this time (losses {losses}); nothing to fix")
        findings.append(Finding(
            "demo.no-overflow", "fail", f"no overflow in {args.steps} fp16 step(s) with seed {args.seed}: the demo "
            "has nothing to show", [f"losses: {losses}"], ["run it as shipped: torchdoctor demo (seed 0, 6 steps)"]))
        return done(EXIT_PROBLEMS)
    details = error.details
    result["first_run"]["error"] = details.to_json()
    written = not any(note.startswith("(could not write") for note in details.notes)
    if written and kept:
        result["report_files"] = [os.path.join(report_dir, REPORT + ext) for ext in (".txt", ".json")]
    first = error.first
    findings.append(Finding(
        "demo.overflow-caught", "ok",
        f"the monitor stopped the run at step {first.step}, before the optimizer applied it: {first.value} in "
        f"{first.module} ({first.cls}), slot {first.slot}",
        [details.diagnosis], [details.fix] if details.fix else [],
        {"cause": details.cause, "fp32_region": details.fp32_region, "report_files": result["report_files"]}))
    say(f"the monitor stopped the run at step {first.step}, before the optimizer applied it:\n")
    say(error.report)
    if written and kept:
        say(f"\n(report also written to {report_dir}/{REPORT}.txt and .json)\n")
    elif written:
        say(f"\n(the monitor also wrote it to {REPORT}.txt and .json, in a temporary folder removed at exit; "
            "--report-dir DIR keeps them)\n")
    region = details.fp32_region
    if region is None:
        say("the report names no region to keep in fp32; the demo stops here")
        findings.append(Finding("demo.no-region", "fail", "the report names no region to keep in fp32: the demo "
                                "stops before its fix", [details.diagnosis]))
        return done(EXIT_PROBLEMS)
    say(f"applying the fix: torchdoctor.keep_fp32(model, {region!r}) and training the same steps again\n")
    fixed, fixed_error, _ = _train(build_demo, train_steps, args.seed, args.steps, report_dir, region)
    ok = fixed_error is None and len(fixed) == args.steps and all(map(_finite, fixed))
    result["fixed_run"] = {"region": region, "losses": fixed, "finite": ok}
    shown = [round(x, 3) for x in fixed]
    findings.append(Finding(
        "demo.fix-works", "ok" if ok else "fail",
        f"with {region} in fp32 the same {args.steps} step(s) train "
        + ("with finite losses: the fix works" if ok else "and the loss is still not finite"),
        [f"losses: {shown}"] + ([f"the monitor stopped it again: {fixed_error.first.module}"]
                                if fixed_error is not None and fixed_error.first is not None else []),
        [] if ok else ["train in bf16 (torch.autocast(dtype=torch.bfloat16)): fp32's range"],
        {"region": region}))
    say(f"losses with {region} in fp32: {shown}")
    say(("all finite: the fix works" if ok else "still not finite") + f"  ({time.perf_counter() - t0:.1f} s)")
    return done(EXIT_OK if ok else EXIT_PROBLEMS)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")

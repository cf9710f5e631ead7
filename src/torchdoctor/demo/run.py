"""``torchdoctor demo``: the guide's fp16 overflow, found, explained and fixed, on CPU in seconds.

1. A tiny T5-shaped model (built in-package, no downloads) trains in fp16 (CPU autocast + GradScaler)
   under :class:`~torchdoctor.NumericsMonitor`. Its gated-GELU feed-forward in block 2 pushes its
   output close to fp16's 65504 and the following dropout's 1/(1-p) rescale overflows to inf.
2. The monitor stops the step before the optimizer applies it and prints the report: the module, the
   frames before it, and why.
3. The demo applies the report's fix, :func:`torchdoctor.keep_fp32` on the region named, and trains
   the same steps again from the same start: the loss stays finite.

The monitor writes its report to ``--report-dir`` (created, parents too, when missing). A path it could not write is
refused before any training, in one line, exit 2: a folder that takes no new file, or a report file already there
(``torchdoctor-nonfinite-rank0.txt`` / ``.json``) that cannot be opened for writing -- immutable, read-only to this
user, a folder, a FIFO or device, a link that leads nowhere -- tried without changing it. If writing still fails when
the monitor writes (a disk that filled up meanwhile), the demo did not go as shown: it says so plainly
(``demo.report-not-written``) and exits 1.

Without ``--report-dir`` the report goes to a temporary folder that is removed at exit, so no folder is left behind
per run; the narrative says so. It is removed however the demo ends: normally, on an error, on Ctrl-C (exit 130),
and on any signal that would otherwise end the process -- SIGTERM, SIGHUP (the terminal closed), SIGQUIT, SIGUSR1/2,
SIGALRM, SIGXCPU, SIGXFSZ... (exit 128 + the signal's number). A signal that arrives while the folder is being made
or removed waits until that is done; the first signal decides the exit code. SIGKILL cannot be cleaned up after
(nothing runs in a process it ends), nor can a crash of the interpreter itself (SIGSEGV, SIGBUS): such a run can
leave one ``torchdoctor-demo-*`` folder in the temporary directory. A signal that was set to be ignored when the demo
started (``nohup`` ignores SIGHUP) stays ignored.

``--json`` is one strict-JSON object with the project's ``findings`` list (``demo.overflow-caught``,
``demo.fix-works``; ``demo.no-overflow`` / ``demo.no-region`` / ``demo.report-not-written`` when the demo did not go
as shown, exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import stat
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
EXIT_CODES = [(EXIT_OK, "the demo went as shown"),
              (EXIT_PROBLEMS, "it did not (no overflow, the fix did not hold, or the report could not be written)"),
              (EXIT_USAGE, "bad usage, or a --report-dir the report cannot be written to"),
              (130, "interrupted (Ctrl-C)"), ("128+N", "ended by signal N (SIGTERM: 143, SIGHUP: 129)")]


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
    # digits only: Python's int() also takes "1_0" and other spellings nobody means as a count
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise argparse.ArgumentTypeError(f"must be a whole number {what}, got {text!r}")
    return int(text)


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
    too, as the monitor itself would; what is refused is said before the minutes of training, not after: a folder
    that takes no new file, and each report file already there that cannot be opened for writing."""
    if not path.strip():
        return "is empty; pass a folder"
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a folder"
    why = _folder_problem(path, create=True)
    if why:
        return why
    for ext in (".txt", ".json"):
        why = _report_file_problem(os.path.join(path, REPORT + ext))
        if why:
            return f"{REPORT + ext} {why}"
    return None


def _folder_problem(path: str, create: bool = False) -> str | None:
    try:
        if create:
            os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # the real test: access() says yes to root on a read-only mount
            pass
    except OSError as e:
        return f"cannot be written: {e.strerror or e}"
    return None


def _report_file_problem(target: str) -> str | None:
    """Why the monitor's ``open(target, "w")`` would fail (None: it would not), found without changing the file:
    an existing one is opened write-only, neither truncated nor appended to (O_WRONLY without O_APPEND also finds
    an append-only file, which O_TRUNC would be refused on), and closed."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        if not os.path.islink(target):
            return None  # the monitor creates it: the folder takes new files (checked before)
        # a dangling link: the monitor's open() would create its target, in the folder the link points into
        where = os.path.dirname(os.path.realpath(target))
        if not os.path.isdir(where):
            return f"is a link to {os.readlink(target)}, in a folder that does not exist"
        why = _folder_problem(where)
        return f"is a link into {where}, which {why}" if why else None
    except OSError as e:  # a symlink loop, a folder on the way that cannot be searched
        return f"cannot be written: {e.strerror or e}"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder; the monitor writes its report to that file name"
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
        return f"is {kind}, not a file the report can be written to"
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)))
    except OSError as e:
        return f"cannot be written: {e.strerror or e}"
    return None


# -- ending cleanly -------------------------------------------------------------------------------------------

# Signals whose default action ends the process and that a Python handler can take: sent by kill, a scheduler, a
# closed terminal, or a resource limit. Not SIGKILL/SIGSTOP (cannot be caught), nor the crash signals a fault in
# native code raises (SIGSEGV, SIGBUS, SIGFPE, SIGILL: the faulting instruction would run again and again).
ENDING_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF",
    "SIGPWR", "SIGIO", "SIGABRT") if hasattr(signal, name))


class Ended(BaseException):
    """Raised in the main thread by a signal that would end the demo. A BaseException, as KeyboardInterrupt is, so
    an ``except Exception`` on the way (the monitor never hides an error) does not stop it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Endings:
    """While installed, the first SIGINT or ending signal is kept in :attr:`signum`; if it comes while
    :attr:`armed` (the demo training) it also raises -- KeyboardInterrupt for SIGINT, :class:`Ended` otherwise --
    once: the handler disarms itself as it raises, so whatever runs after (the temporary folder's removal) is never
    cut short by a second signal, and one that comes unarmed (the folder being made or removed) waits for the end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self._before: dict[int, object] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt if signum == signal.SIGINT else Ended(signum)

    def install(self) -> None:
        for sig in (signal.SIGINT, *ENDING_SIGNALS):
            try:
                now = signal.getsignal(sig)
                # only a signal left to its default: one set to be ignored (nohup's SIGHUP), or handled by whoever
                # runs the demo, keeps that
                if now is (signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL):
                    self._before[sig] = signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread (run() called from one): the caller's signals
                return

    def restore(self) -> None:
        for sig, before in self._before.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, before)  # type: ignore[arg-type]
        self._before = {}


def _say_ended(signum: int) -> None:
    with contextlib.suppress(OSError, ValueError):  # SIGHUP: the terminal may be gone
        print(f"torchdoctor demo: ended by {signal.Signals(signum).name}", file=sys.stderr)


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
    # report, and a run must not leave a folder behind per run -- however it ends, short of SIGKILL (see the module
    # docstring). The handlers are in place before the folder exists and restored only after it is gone.
    endings = _Endings()
    endings.install()
    scratch = None
    code = EXIT_PROBLEMS
    try:
        if args.report_dir is None:
            scratch = tempfile.mkdtemp(prefix="torchdoctor-demo-")  # unarmed: a signal now waits until it is set
        if endings.signum is None:
            try:
                endings.armed = True
                code = _demo(args, args.report_dir or scratch, kept=scratch is None)
                endings.armed = False
            except Ended:
                pass  # said below, once the folder is gone
    finally:
        endings.armed = False
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        endings.restore()
    if endings.signum == signal.SIGINT:
        raise KeyboardInterrupt  # the CLI says "interrupted", exit 130, as everywhere
    if endings.signum is not None:
        _say_ended(endings.signum)
        return 128 + endings.signum
    return code


def _demo(args: argparse.Namespace, report_dir: str, kept: bool) -> int:
    import torch

    from ..findings import Finding
    from ..jsonfile import dumps
    from .model import build_demo, train_steps

    torch.set_num_threads(min(2, torch.get_num_threads()))
    say = (lambda *a: None) if args.json else print
    t0 = time.perf_counter()
    predicted = _predicted(args.seed)
    site = predicted[0] if predicted else None
    say("torchdoctor precision predicts " + (
        f"an fp16 overflow at {site['module']} ({site['class']}): {site['op']} reaches {site['peak']:.3g} in fp32, "
        f"beyond fp16's {65504:.3g}" if site else "no fp16 overflow") + " -- training to see:\n")
    say(f"torchdoctor demo: a tiny T5 trains in fp16 (CPU autocast + GradScaler) for {args.steps} steps\n")
    losses, error, _ = _train(build_demo, train_steps, args.seed, args.steps, report_dir)
    result: dict = {"findings": [], "seed": args.seed, "steps": args.steps, "predicted_overflow": predicted,
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
    unwritten = next((note for note in details.notes if note.startswith("(could not write")), None)
    written = unwritten is None
    if written and kept:
        result["report_files"] = [os.path.join(report_dir, REPORT + ext) for ext in (".txt", ".json")]
    first = error.first
    findings.append(Finding(
        "demo.overflow-caught", "ok",
        f"the monitor stopped the run at step {first.step}, before the optimizer applied it: {first.value} in "
        f"{first.module} ({first.cls}), slot {first.slot}",
        [details.diagnosis], [details.fix] if details.fix else [],
        {"cause": details.cause, "fp32_region": details.fp32_region, "report_files": result["report_files"]}))
    confirmed = first.module in [p["module"] for p in predicted]
    findings.append(Finding(
        "demo.prediction", "ok" if confirmed else "warn",
        f"the module the monitor named, {first.module}, is " + ("" if confirmed else "not ")
        + "among those torchdoctor precision predicted before training", [p["module"] for p in predicted]))
    say(f"the monitor stopped the run at step {first.step}, before the optimizer applied it"
        + (" (at the module precision predicted)" if confirmed else " (not where precision predicted)") + ":\n")
    say(error.report)
    if written and kept:
        say(f"\n(report also written to {report_dir}/{REPORT}.txt and .json)\n")
    elif written:
        say(f"\n(the monitor also wrote it to {REPORT}.txt and .json, in a temporary folder removed at exit; "
            "--report-dir DIR keeps them)\n")
    else:  # checked up front, so something changed since (a disk that filled up): not the demo as shown
        why = unwritten.strip("()")
        say(f"\nthe demo did not go as shown: the monitor {why}\n")
        findings.append(Finding(
            "demo.report-not-written", "fail", f"the demo did not go as shown: the monitor {why}", [unwritten],
            ["free space there, or pass --report-dir DIR with a folder that can be written"],
            {"report_dir": report_dir}))
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
    if not written:
        say("the report was not written: the demo did not go as shown (exit 1)")
    return done(EXIT_OK if ok and written else EXIT_PROBLEMS)


def _predicted(seed: int) -> list[dict]:
    """What ``torchdoctor precision`` predicts for the demo's model and first batch, before any training."""
    import torch

    from ..precision.predict import predict_model
    from .model import build_demo

    model, batches = build_demo(seed)
    input_ids, labels = batches[0]
    prediction = predict_model(model, {"input_ids": input_ids, "labels": labels}, torch.float16, "cpu")
    return [s.to_json() for s in prediction.overflow]


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")

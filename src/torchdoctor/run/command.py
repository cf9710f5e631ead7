"""``torchdoctor run [--log FILE] [--json FILE] [--report-dir DIR] -- CMD ...``: run a command, explain how it ended.

The command's stdout and stderr pass through unchanged (its stdout stays clean for pipes), so
everything torchdoctor itself says goes to **stderr**, after the command has ended: the log findings
(loss-scale overflow, nan loss, NCCL errors, ...) and a ``process.exit`` finding -- for a command SIGKILLed
at start-up with no traceback, the peak RSS of its process tree against the machine's RAM and the
kernel's OOM-killer line where readable.

``--json FILE`` writes the machine-readable report to FILE (``-``: to stdout, after the command's output
has ended): ``{"command", "pid", "exit_code", "signal", "duration_s", "peak_rss_gib", "peak_rss_at_s",
"min_available_gib", "min_available_at_s", "mem_total_gib", "cgroup_limit_gib", "interval_s",
"findings", "timeline", "memory"}``. A file, not stdout, by default because stdout carries the command's
own output; the text findings on stderr are printed either way.

One verdict per run: when the numerics monitor (``torchdoctor.NumericsMonitor``) found an inf/nan, the
``numerics.nonfinite`` finding says where (rank, step, phase, module, slot), why and what to do, from its report
files (``torchdoctor-nonfinite-rank*.json`` written during the run in ``--report-dir DIR`` -- created if missing;
by default a new ``./torchdoctor-reports/run-...`` folder per run -- exported to the command as
``TORCHDOCTOR_REPORT_DIR``, where a monitor given no ``report_dir`` writes; and in the current directory), else from its
``Detected ...`` output lines; its NonFiniteError traceback is folded into it (no ``process.exception``).
Under several ranks the rank whose own values went bad first leads (a rank that only received them through the
gradient reduction comes after it).

``--numerics`` (or any of ``--grads``, ``--trace-steps``, ``--abort-after-step``) attaches that monitor with no
code change in every Python process the command starts (:mod:`torchdoctor.run.inside`, switched on through the
command's environment by :mod:`.switch`); the ``numerics.attached`` finding says what each process watched,
``numerics.not-attached`` (info) that nothing was.

A distributed job (a process that calls ``init_process_group``) is watched while it runs (:mod:`.watch`; ``--no-flight``
turns it off): each rank keeps a status file in the report folder and PyTorch's Flight Recorder is on. When no rank has
made progress for ``--hang-after`` seconds while one waits in a collective -- or on the first Ctrl-C / SIGTERM while the
job hangs -- every rank's records and stack are collected, the verdict is printed at once and the job is ended (a
stopped rank too). The verdict is the report's first finding, ``comm.<class>``: the culprit rank(s), the class
(``init-mismatch``, ``stopped``, ``killed``, ``exception``, ``exited-early``, ``collective-mismatch``,
``never-arrived``, ``transport``, ``slow``) and the culprit's own call site; the other ranks' timeouts follow as
``info``.

How the command runs: in its own process group (SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to torchdoctor are
forwarded to that whole group, so torchrun and its workers get one Ctrl-C; a third Ctrl-C sends SIGKILL), with
``PYTHONUNBUFFERED=1`` unless set (its stdout is a pipe now, and Python would otherwise hold prints back), and
with no stdin when torchdoctor's stdin is a terminal (a background process group reading the terminal would be
stopped by the kernel: an interactive ``pdb`` needs the command run directly). Its output is passed on chunk by
chunk as it arrives (a ``\\r`` progress bar is not held back until a newline). When whoever reads torchdoctor's
stdout goes away (``torchdoctor run -- CMD | head``), the command's stdout pipe is closed: its next write fails
(SIGPIPE, exit 141; EPIPE for programs that ignore SIGPIPE, like Python's BrokenPipeError), as in a shell
pipeline without torchdoctor, and the findings still go to stderr.

Exit status: the command's own (128 + N when signal N killed it), 127 when it is not found, 126 when it
cannot be executed, 2 for bad usage (no command, an unwritable --log or --json file or --report-dir).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time

from ..runvars import REPORT_DIR_VAR

EXIT_USAGE, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND = 2, 126, 127
USAGE = ("torchdoctor run [--log FILE] [--json FILE] [--interval S] [--report-dir DIR] [--hang-after S|off] "
         "[--no-flight] [--numerics [--grads G] [--trace-steps LIST] [--abort-after-step N] [--record DIR "
         "[--record-every N]]] -- CMD [ARG ...]")
EXAMPLES = [
    ("torchdoctor run --numerics -- torchrun --nproc_per_node 8 train.py",
     "find the first module that goes inf/nan, no code change"),
    ("torchdoctor run -- python train.py", "run it; explain how it ended, on stderr"),
    ("torchdoctor run --log train.log -- torchrun --nproc_per_node 8 train.py", "keep the output too"),
    ("torchdoctor run --json report.json -- deepspeed train.py --deepspeed ds.json", "the report as JSON"),
    ("torchdoctor run --hang-after 60 -- torchrun --nproc_per_node 8 train.py",
     "a job that hangs: after 60 s without progress, the culprit rank, why, and where it was; then it is ended"),
]
EXIT_CODES = [("the command's own", "(128 + N when signal N killed it)"), (EXIT_NOT_FOUND, "command not found"),
              (EXIT_NOT_EXECUTABLE, "cannot be executed"), (EXIT_USAGE, "bad usage")]


def _interval(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v >= 0.01):
        raise argparse.ArgumentTypeError(f"must be at least 0.01 seconds, got {text!r}")
    return v


def _hang_after(text: str) -> float:
    if text.strip().lower() in ("off", "never", "0"):
        return 0.0
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds or 'off': {text!r}") from None
    if not (math.isfinite(v) and v >= 0.5):
        raise argparse.ArgumentTypeError(f"must be at least 0.5 seconds (or 'off'), got {text!r}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    parser.add_argument("--log", metavar="FILE", default=None,
                        help="also append everything the command writes (stdout and stderr) to FILE")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the report as one JSON object to FILE ('-': stdout, after the command's output)")
    parser.add_argument("--interval", metavar="S", type=_interval, default=0.5,
                        help="seconds between samples of the process tree's RSS and MemAvailable (default 0.5)")
    parser.add_argument("--report-dir", metavar="DIR", default=None,
                        help="where the numerics monitor writes its report files, read for the numerics.nonfinite "
                             "finding (created if missing; exported to the command as TORCHDOCTOR_REPORT_DIR). "
                             "Default: a new folder per run, ./torchdoctor-reports/run-<date>-<time>-<pid>, made only "
                             "when there is a report to write")
    parser.add_argument("--no-flight", action="store_true",
                        help="leave a distributed job as it is: by default it runs with PyTorch's Flight Recorder on, "
                             "each rank keeps a status file (its init_process_group call, a heartbeat, how it "
                             "ended) and writes its records as it ends badly, for one verdict on a failure: the "
                             "culprit rank, the class, its call site")
    parser.add_argument("--hang-after", metavar="S", type=_hang_after, default=None,
                        help="when no rank of a distributed job has made progress for S seconds while one waits in a "
                             "collective, collect every rank's state, print the verdict and end the job ('off': only "
                             "after it ends; default: a quarter of the job's collective timeout, at most 120 s)")
    from .switch import add_arguments as add_numerics_arguments

    add_numerics_arguments(parser)
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD",
                        help="the command to run, after `--` (e.g. -- deepspeed train.py --deepspeed ds.json)")


def run_report_dir() -> str:
    """The report folder of a run without ``--report-dir``: the one an enclosing ``torchdoctor run`` gave, else
    ``./torchdoctor-reports/run-<date>-<time>-<pid>``, a new one per run (an earlier run's reports are never
    overwritten). Not created here: the monitor creates it when it has something to write."""
    given = os.environ.get(REPORT_DIR_VAR)
    if given:
        return given
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join(os.getcwd(), "torchdoctor-reports", f"run-{stamp}-{os.getpid()}")


def _remove_empty(*dirs: str | None) -> bool:
    """Remove each folder that is empty, in order, stopping at the first that is not; whether the first went."""
    first = True
    for d in dirs:
        if d:
            try:
                os.rmdir(d)  # only when empty
            except OSError:
                return not first
        first = False
    return True


def _removed(findings: list, folder: str) -> list:
    """The findings, with a mention of ``folder`` (removed: it held nothing) saying so."""
    import dataclasses

    said = f"{folder} (removed again: nothing was written to it)"
    return [dataclasses.replace(f, evidence=[e.replace(folder, said) if folder in e else e for e in f.evidence])
            if any(folder in e for e in f.evidence) else f for f in findings]


def _say_verdict(watch, report_dir: str, prefix: str | None, cmd: list[str]) -> None:
    """The verdict on a hung (or interrupted) job, printed at once -- before the job is ended."""
    from ..findings import render_text, use_color
    from . import flight

    found = flight.findings(report_dir, prefix or os.path.join(report_dir, "nccl_trace_rank_"), watch, live=True)
    head = [f for f in found if f.severity in ("fail", "warn")][:1]
    print(f"\ntorchdoctor run: {watch.trigger} -- every rank's state collected; ending the job", file=sys.stderr)
    if head:
        print(render_text(head, color=use_color(sys.stderr), with_summary=False), file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    print(f"torchdoctor run: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from ..findings import render_text, use_color
    from .supervisor import WrapError, cmdline, run_command

    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        _say(f"no command given\nusage: {USAGE}")
        return EXIT_USAGE
    interval = getattr(args, "interval", 0.5)
    if not (isinstance(interval, (int, float)) and math.isfinite(interval) and interval >= 0.01):
        _say(f"--interval must be at least 0.01 seconds, got {interval!r}")
        return EXIT_USAGE
    json_path = getattr(args, "json", None)
    if json_path and json_path != "-" and os.sep not in json_path and not json_path.endswith(".json") \
            and shutil.which(json_path):
        # `torchdoctor run --json python train.py` would silently take `python` as the report file
        _say(f"--json takes a FILE, and {json_path!r} is a program; write e.g. --json report.json -- {json_path} ...")
        return EXIT_USAGE

    report_dir = getattr(args, "report_dir", None)
    if report_dir is not None:
        from .numerics_verdict import check_report_dir

        why = check_report_dir(report_dir) if report_dir else "empty path"
        if why:
            _say(f"cannot write --report-dir {report_dir}: {why}")
            return EXIT_USAGE
    else:
        report_dir = run_report_dir()
    default_dir = getattr(args, "report_dir", None) is None and not os.environ.get(REPORT_DIR_VAR)
    existed = os.path.isdir(report_dir)

    log_file = json_file = None
    try:
        if args.log:
            try:
                log_file = open(args.log, "ab", buffering=0)  # noqa: SIM115 -- closed in finally
            except OSError as e:
                _say(f"cannot write --log {args.log}: {e.strerror or e}")
                return EXIT_USAGE
        if json_path and json_path != "-":
            try:  # fail before the run, not after hours of it
                json_file = open(json_path, "w")  # noqa: SIM115
            except OSError as e:
                _say(f"cannot write --json {json_path}: {e.strerror or e}")
                return EXIT_USAGE
        from . import switch

        numerics = switch.options(args, report_dir)
        started = time.time()
        watch = result = None
        try:
            env = switch.environment(numerics) if numerics is not None else {}
            prefix = None
            if not getattr(args, "no_flight", False):
                from . import flight
                from .watch import Watch

                hang_after = getattr(args, "hang_after", None)
                more, prefix = flight.environment(report_dir, {**os.environ, **env}, flight.period_for(hang_after))
                env = {**env, **more}
                os.makedirs(report_dir, exist_ok=True)  # (NCCL's own dump on a timeout needs the folder)
                watch = Watch(report_dir, hang_after, time.monotonic())
            result = run_command(cmd, log_file=log_file, interval=interval, report_dir=report_dir, env=env or None,
                                 watch=watch, on_verdict=lambda w: _say_verdict(w, report_dir, prefix, cmd))
        except WrapError as e:
            _say(str(e))
            return e.exit_code
        except OSError as e:
            _say(f"cannot create the report folder {report_dir}: {e.strerror or e}")
            return EXIT_USAGE
        finally:
            if watch is not None:
                watch.close()  # (its bookkeeping files go, whatever happened)
            if not existed and result is None:
                _remove_empty(report_dir, os.path.dirname(report_dir) if default_dir else None)
        if numerics is not None:
            result.findings.append(switch.attach_finding(report_dir, started, numerics.get("record")))
        if prefix is not None:
            from .headline import fold

            result.findings = fold(result.findings, flight.findings(report_dir, prefix, watch, result),
                                   ended_by_run=watch is not None and watch.ending_epoch is not None)
        # a folder that holds nothing goes again (made only for a report)
        if not existed and _remove_empty(report_dir, os.path.dirname(report_dir) if default_dir else None):
            result.findings = _removed(result.findings, report_dir)

        shown = [f for f in result.findings if f.severity != "skip"]
        print(f"\n--- torchdoctor run: {cmdline(cmd)} ---", file=sys.stderr)
        print(render_text(shown, color=use_color(sys.stderr)), file=sys.stderr)
        if args.log:
            log_file, error = None, result.log_error or _close(log_file)
            if error:
                _say(f"warning: the output could not be saved in --log {args.log}: {error}")
            else:
                print(f"(output saved in {args.log})", file=sys.stderr)
        if json_path:
            sys.stderr.flush()
            from ..jsonfile import dumps

            text = dumps(result.to_json(), indent=1)
            if json_file is not None:
                try:
                    json_file.write(text + "\n")
                    json_file.flush()
                    error = None
                except OSError as e:
                    error = e.strerror or str(e)
                json_file, error = None, error or _close(json_file)
                if error:  # the command's own exit code stands; the report it could not keep is on stdout
                    _say(f"warning: the report could not be written to --json {json_path}: {error}; "
                         "here it is on stdout")
                    print(text, flush=True)
                else:
                    print(f"(report written to {json_path})", file=sys.stderr)
            else:
                print(text, flush=True)
        return result.exit_code
    finally:
        for f in (log_file, json_file):
            _close(f)


def _close(f) -> str | None:
    """Close ``f`` (None: nothing to do); the OS error a close reports (a full disk), or None."""
    if f is None:
        return None
    try:
        f.close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -c 'from torchdoctor.run.command import main; main()'``)."""
    parser = argparse.ArgumentParser(prog="torchdoctor run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))

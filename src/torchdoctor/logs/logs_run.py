"""``torchdoctor logs FILE... | -``: read training logs (plain, .gz, or stdin) and say what went wrong.

Prints a condensed timeline (runs of the same event folded to their first and last line) and the findings:
fp16 loss-scale collapse, non-finite loss, NCCL timeouts and errors, CUDA and host out-of-memory, killed ranks,
CUDA/compiler build failures. Exit codes: 0 nothing failed, 1 a ``fail`` finding, 2 a file could not be read.

A gzip log cut short (half of a file: a log copied while its job still wrote it) or damaged part-way is read up to
there, as ``zcat`` prints what it can: the findings are from those lines, with a warning that says the file ends
early or is damaged and after how many lines (``logs.gzip-truncated``, ``logs.gzip-corrupt``); the exit code
follows the findings. One that gives no text at all (a damaged header) cannot be read: exit 2.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any

from ..findings import render_text, use_color
from ..jsonfile import STDIN_CLOSED, dumps, stdin_closed

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXAMPLES = [
    ("torchdoctor logs train.log", "the timeline and the findings"),
    ("torchdoctor logs rank0.log rank1.log.gz", "several logs, plain or gzip"),
    ("kubectl logs trainer-0 | torchdoctor logs -", "from standard input"),
    ("torchdoctor logs train.log --json", "as JSON"),
]
EXIT_CODES = [(EXIT_OK, "nothing failed"), (EXIT_PROBLEMS, "a fail finding"),
              (EXIT_USAGE, "a file could not be read"), (130, "interrupted (Ctrl-C)")]
MAX_GROUPS = 30  # timeline groups printed (first and last halves)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="log files (plain or gzip-compressed); '-' reads standard input")
    parser.add_argument("--json", action="store_true",
                        help='print {"findings": [...], "timeline": [...], "lines": N} (a "files" list for several)')


def condense(timeline: list[dict], max_groups: int = MAX_GROUPS) -> list[str]:
    """Timeline lines for people: consecutive events of one kind fold to first, '... N more', last."""
    groups: list[list[dict]] = []
    for e in timeline:
        if groups and groups[-1][0]["event"] == e["event"]:
            groups[-1].append(e)
        else:
            groups.append([e])
    shown = groups
    skipped = 0
    if len(groups) > max_groups:
        shown = groups[: max_groups // 2] + [[]] + groups[-(max_groups // 2):]
        skipped = len(groups) - 2 * (max_groups // 2)
    width = max((len(e["event"]) for e in timeline), default=5)

    from .patterns import DS_PREFIX_RE

    def row(e: dict) -> str:
        step = f"step {e['step']}" if e["step"] is not None else ""
        text = DS_PREFIX_RE.sub(lambda m: m.group(1)[11:19] + " ", e["text"], count=1)  # keep the time only
        return f"  line {e['line']:>7}  {step:<12} {e['event']:<{width}}  {text[:150]}"

    out = []
    for g in shown:
        if not g:
            out.append(f"  ... {skipped} more group(s) of events ...")
            continue
        out.append(row(g[0]))
        if len(g) > 2:
            steps = [e["step"] for e in g[1:-1] if e["step"] is not None]
            span = f", steps {steps[0]}-{steps[-1]}" if steps else ""
            out.append(f"  {'':>12}  ... {len(g) - 2} more {g[0]['event']} (lines {g[1]['line']}-{g[-2]['line']}"
                       f"{span})")
        if len(g) > 1:
            out.append(row(g[-1]))
    return out


class NotALog(OSError):
    """A source that is no log: a folder, a device that is not a terminal (``/dev/zero`` would stream forever), or
    ``-`` when standard input is closed."""


def _refuse_non_logs(f, name: str) -> None:
    try:
        fd = f.fileno()
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError, AttributeError):  # no descriptor (a stream handed in by a test): nothing to judge
        return
    if stat.S_ISDIR(mode):
        raise NotALog(0, f"{name}: is a directory; pass the log files in it")
    if stat.S_ISCHR(mode) and not os.isatty(fd):
        # a log is a file, a pipe or a terminal; a device such as /dev/zero never ends and holds no log
        raise NotALog(0, f"{name}: a character device, not a log (pass a log file, or - for standard input)")


def _analyze(path: str):
    """The report of one log. Read once, in chunks (constant memory, lines cut at ``MAX_LINE``): a FIFO or
    ``<(...)`` is read as it is written, and gzip is sniffed from the stream, not by reopening the file."""
    from .analyze import analyze_stream, open_stream

    if path == "-":  # plain or gzip, sniffed like a file (gzip -c train.log | torchdoctor logs -)
        if stdin_closed():  # `<&-`: descriptor 0 may be some other file this process opened, never read it
            raise NotALog(0, f"{STDIN_CLOSED}; pass the log files, or pipe a log in (... | torchdoctor logs -)")
        _refuse_non_logs(sys.stdin.buffer, "standard input")
        return analyze_stream(open_stream(sys.stdin.buffer))
    with open(path, "rb") as f:
        _refuse_non_logs(f, path)
        return analyze_stream(open_stream(f))


def run(args: argparse.Namespace) -> int:
    import gzip
    import zlib

    results: list[tuple[str, Any]] = []
    unreadable = 0
    for path in args.files:
        if path != "-" and os.path.isdir(path):
            from ..comm.hang import FolderReport

            folder = FolderReport.read(path)
            if folder is not None:
                results.append((path, folder))
                continue
        try:
            results.append((path, _analyze(path)))
        except NotALog as e:
            print(f"torchdoctor logs: {e.strerror}", file=sys.stderr)
            unreadable += 1
        except IsADirectoryError:
            print(f"torchdoctor logs: {path}: is a directory, and holds no Flight Recorder dumps; pass the log files "
                  "in it", file=sys.stderr)
            unreadable += 1
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            print(f"torchdoctor logs: cannot read {'standard input' if path == '-' else path}: {why}",
                  file=sys.stderr)
            unreadable += 1
    failed = any(f.severity == "fail" for _, r in results for f in r.findings)
    code = EXIT_USAGE if unreadable else EXIT_PROBLEMS if failed else EXIT_OK
    if not results:
        return code
    if args.json:
        if len(args.files) == 1:
            print(dumps(results[0][1].to_json(), indent=1))
        else:
            # every --json has a top-level "findings" list: here each file's, with the file in its data
            findings = [{**f, "data": {**f["data"], "file": p}} for p, r in results for f in r.to_json()["findings"]]
            print(dumps({"files": [{"file": p, **r.to_json()} for p, r in results], "findings": findings}, indent=1))
        return code
    for i, (path, report) in enumerate(results):
        if i:
            print()
        name = "standard input" if path == "-" else path
        if not hasattr(report, "timeline"):  # a folder of Flight Recorder dumps
            print(f"torchdoctor logs: {name} ({report.describe()})")
            print(render_text(report.findings, color=use_color(sys.stdout)))
            continue
        dropped = f", {report.timeline_dropped} more not kept" if report.timeline_dropped else ""
        print(f"torchdoctor logs: {name} ({report.lines} lines, {len(report.timeline)} events{dropped})")
        if report.timeline:
            print("timeline:")
            print("\n".join(condense(report.timeline)))
        print()
        print(render_text(report.findings, color=use_color(sys.stdout)))
    return code

"""``numerics show`` and ``numerics diff``: read the recordings, call :mod:`.show` / :mod:`.diff`, print, pick the exit
code. A path that is not a recording is one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import os
import sys

from ...findings import Finding
from ...jsonfile import dumps
from .diff import NothingToCompare, compare
from .diff_report import build_page, finding, lines
from .html import MAX_COLUMNS
from .show import build
from .store import NotARecording, load_run

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def _progress(text: str) -> None:
    print(f"torchdoctor numerics: {text}", file=sys.stderr, flush=True)


def _write(path: str, text: str, command: str) -> int | None:
    """Write the page; None when written, else the exit code (the reason said in one line)."""
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        print(f"torchdoctor numerics {command}: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 1024:.0f} KB"


def show(args: argparse.Namespace) -> int:
    try:
        ranks = load_run(args.run_dir)
    except NotARecording as e:
        print(f"torchdoctor numerics show: {e}", file=sys.stderr)
        return EXIT_USAGE
    wanted = getattr(args, "ranks", None)
    if wanted:
        missing = sorted(set(wanted) - {r.rank for r in ranks})
        if missing:
            print(f"torchdoctor numerics show: {args.run_dir} has no rank {', '.join(map(str, missing))} (it has "
                  f"{', '.join(str(r.rank) for r in ranks)})", file=sys.stderr)
            return EXIT_USAGE
        ranks = [r for r in ranks if r.rank in wanted]
    if all(r.steps.numel() == 0 for r in ranks):
        print(f"torchdoctor numerics show: {args.run_dir}: no step recorded yet (a recording is written every 50 "
              "recorded steps, before a NonFiniteError, and when the monitor closes)", file=sys.stderr)
        return EXIT_USAGE
    out = args.output or os.path.join(args.run_dir, "timeline.html")
    name = os.path.basename(os.path.abspath(args.run_dir))
    _progress(f"drawing {len(ranks)} rank(s) of {args.run_dir}")
    text, summaries = build(ranks, f"torchdoctor numerics timeline: {name}", args.columns or MAX_COLUMNS)
    failed = _write(out, text, "show")
    if failed is not None:
        return failed
    size = len(text.encode("utf-8"))
    bad = any(s.first_bad is not None for s in summaries)
    if args.json:
        print(dumps({"output": out, "bytes": size, "ranks": [s.to_json() for s in summaries],
                     "verdict": "non-finite" if bad else "finite",
                     "findings": [f.to_json() for f in findings(summaries, out)]}, indent=1))
        return EXIT_PROBLEMS if bad else EXIT_OK
    print(f"wrote {out} ({_size(size)}): {len(ranks)} rank(s); open it in a browser (it fetches nothing)")
    for s in summaries:
        span = f"steps {s.steps[0]}-{s.steps[-1]}" if s.steps else "no step"
        print(f"rank {s.rank}: {s.rows} module outputs x {len(s.steps)} recorded steps ({span}), "
              f"{s.columns} columns drawn")
        if s.marker is not None:
            print(f"  {s.marker.text}")
        elif not s.steps:
            print("  no step recorded on this rank")
        elif s.first_bad is None:
            print("  every recorded value finite")
        if s.closest is not None:
            print(f"  {s.closest.text()}")
        for p in s.problems:
            print(f"  unreadable: {p}")
    return EXIT_PROBLEMS if bad else EXIT_OK


def findings(summaries: list, out: str) -> list[Finding]:
    """One finding per rank: where its first non-finite value is (fail), or that every recorded value was finite."""
    found = []
    for s in summaries:
        data = s.to_json()
        if s.marker is not None:
            found.append(Finding("numerics.timeline-nonfinite", "fail", f"rank {s.rank}: {s.marker.text}",
                                 evidence=[f"drawn in {out}"], data=data))
        elif not s.steps:
            found.append(Finding("numerics.timeline-empty", "info", f"rank {s.rank}: no step recorded", data=data))
        else:
            found.append(Finding("numerics.timeline-finite", "ok", f"rank {s.rank}: every recorded value finite "
                                 f"({len(s.steps)} steps x {s.rows} module outputs)",
                                 evidence=[s.closest.text()] if s.closest else [], data=data))
    return found


def diff(args: argparse.Namespace) -> int:
    runs = []
    for path in (args.run_a, args.run_b):
        try:
            runs.append(load_run(path))
        except NotARecording as e:
            print(f"torchdoctor numerics diff: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        result, pairs = compare(runs[0], runs[1], rtol=args.rtol, atol=args.atol, stat=args.stat)
    except NothingToCompare as e:
        print(f"torchdoctor numerics diff: nothing to compare: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = lines(result, args.run_a, args.run_b)
    code = EXIT_OK if result.agree else EXIT_PROBLEMS
    if args.output:
        _progress(f"drawing {args.output}")
        page = build_page(result, pairs, args.run_a, args.run_b, text, args.columns or MAX_COLUMNS)
        failed = _write(args.output, page, "diff")
        if failed is not None:
            return failed
        text.append(f"wrote {args.output} ({_size(len(page.encode('utf-8')))}): A, B and B/A per phase")
    if args.json:
        f = finding(result, args.run_a, args.run_b)
        print(dumps({**f.data, "output": args.output, "findings": [f.to_json()]}, indent=1))
        return code
    print("\n".join(text))
    return code

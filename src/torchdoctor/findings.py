"""Findings: the verdicts every subcommand ends in, and their renderers.

A :class:`Finding` says what is wrong (or fine), the evidence, and the fix. Ids are stable, dotted and
lowercase (``comm.rank-died``, ``cuda.torch-vs-nvcc``) so scripts can match on them. Every subcommand's
``--json`` is one object with a ``"findings"`` list of :meth:`Finding.to_json` dicts plus its own facts.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("ok", "info", "warn", "fail", "skip")
_ID = re.compile(r"^[a-z0-9]+(?:[.-][a-z0-9]+)*$")
_MARK = {"ok": "OK", "info": "INFO", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


@dataclass(frozen=True)
class Finding:
    """One verdict.

    Args:
        id (str): stable dotted lowercase id, e.g. ``comm.rank-missing``.
        severity (str): one of ``ok``, ``info``, ``warn``, ``fail``, ``skip``.
        title (str): one line that says what was found, with the names that matter (rank, host, stage).
        evidence (list[str]): the observations behind it, one per line.
        fix (list[str]): concrete remedies (a command, an env var, a config key and value), best first.
        data (dict): machine-readable details for ``--json``.
    """

    id: str
    severity: str
    title: str
    evidence: list[str] = field(default_factory=list)
    fix: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert _ID.match(self.id), f"finding id {self.id!r} is not dotted lowercase"
        assert self.severity in SEVERITIES, f"unknown severity {self.severity!r}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "title": self.title,
            "evidence": list(self.evidence),
            "fix": list(self.fix),
            "data": dict(self.data),
        }


def worst(findings: Iterable[Finding]) -> str:
    """The most serious severity present (``fail`` > ``warn`` > ``info`` > ``ok`` > ``skip``)."""
    order = {"skip": 0, "ok": 1, "info": 2, "warn": 3, "fail": 4}
    return max((f.severity for f in findings), key=order.__getitem__, default="ok")


_ORDER = {"fail": 0, "warn": 1, "info": 2, "ok": 3, "skip": 4}
# ANSI colours for the severity marks: red, yellow, cyan, green, dim
_COLOR = {"fail": "\033[1;31m", "warn": "\033[1;33m", "info": "\033[36m", "ok": "\033[32m", "skip": "\033[2m"}
_RESET = "\033[0m"


def use_color(stream: Any) -> bool:
    """Colour for a terminal only: not when ``NO_COLOR`` is set (https://no-color.org), ``TERM=dumb``, or the
    output is a pipe or a file. ``FORCE_COLOR`` turns it on anyway."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"


def summary(findings: Iterable[Finding]) -> str:
    """``'2 FAIL, 3 WARN, 9 OK'``: each severity present, most serious first."""
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    return ", ".join(f"{counts[s]} {_MARK[s]}" for s in sorted(counts, key=_ORDER.__getitem__))


def render_text(findings: Iterable[Finding], width: int = 100, color: bool = False,
                with_summary: bool = True) -> str:
    """Plain-text rendering for people: one block per finding, most serious first, then (for more than one
    finding) a summary line. ``color`` paints the severity marks (see :func:`use_color`)."""
    ordered = sorted(findings, key=lambda f: _ORDER[f.severity])
    lines: list[str] = []
    for f in ordered:
        mark = f"[{_MARK[f.severity]}]"
        if color:
            mark = f"{_COLOR[f.severity]}{mark}{_RESET}"
        # The id names the check whatever its outcome ('build.ninja-missing' is also the id of "ninja found"),
        # so an OK line leaves it out: "[OK] ninja 1.11.1 found (build.ninja-missing)" reads as a contradiction.
        # --json keeps it for every severity.
        lines.append(f"{mark} {f.title}" if f.severity == "ok" else f"{mark} {f.title}  ({f.id})")
        for e in f.evidence:
            lines.extend(textwrap.wrap(e, width, initial_indent="    ", subsequent_indent="      "))
        for i, fx in enumerate(f.fix):
            head = "    fix: " if i == 0 else "         "
            lines.extend(textwrap.wrap(fx, width, initial_indent=head, subsequent_indent="         "))
    if with_summary and len(ordered) > 1:
        lines += ["", summary(ordered)]
    return "\n".join(lines)


def render_markdown(findings: Iterable[Finding]) -> str:
    """Markdown for pasting into a bug report."""
    out: list[str] = []
    for f in findings:
        out.append(f"- **{_MARK[f.severity]}** {f.title}" + ("" if f.severity == "ok" else f" (`{f.id}`)"))
        out.extend(f"  - {e}" for e in f.evidence)
        out.extend(f"  - fix: {fx}" for fx in f.fix)
    return "\n".join(out)

"""``numerics.nonfinite``: the numerics monitor's verdict, as ``torchdoctor run`` saw it -- one per run.

When :class:`torchdoctor.NumericsMonitor` finds an inf/nan it raises ``NonFiniteError``, prints
``[rank1] Detected inf at step 3 (forward) in transformer.h.1.mlp (MLP), slot output`` (the ``[rankN] `` tag only
under torch.distributed; torchrun may put its own ``[rank1]:`` / ``[default1]:`` in front) and writes
``torchdoctor-nonfinite-rank<r>.json`` / ``.txt`` into its ``report_dir``. Sources, best first:

* the report JSON files (:meth:`NonFiniteReport.to_json`) in ``--report-dir`` and in the current directory,
  written during this run (mtime at or after its start);
* the ``Detected ...`` lines of the command's output (with the ``Diagnosis:`` / ``Fix:`` lines right after them).

Which rank went first: the earliest step, then the lowest rank. The NonFiniteError's traceback is folded in:
``process.exception`` about it is dropped (:func:`is_monitor_exception`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..findings import Finding

REPORT_GLOB = "torchdoctor-nonfinite-rank*.json"
_FILE_RANK = re.compile(r"torchdoctor-nonfinite-rank(\d+)\.json$")
#: torchrun's ``[rank1]:`` / ``[default1]:``, then the monitor's own ``[rank1] `` tag.
_PREFIX = r"^(?:\[(?:rank|default)(?P<trank>\d+)\]:[ ]?)?(?:\[rank(?P<rank>\d+)\] )?"
DETECTED_RE = re.compile(
    _PREFIX + r"Detected (?P<value>-?inf|nan|a non-finite value) at step (?P<step>\d+)"
    r"(?: \((?P<phase>forward|backward|update)\) in (?P<who>.+?))?(?:, slot (?P<slot>\S.*?))?\s*$")
_FOLLOW_RE = re.compile(_PREFIX + r"(?P<key>Diagnosis|Fix|Severity): (?P<text>.+?)\s*$")
_WHO_RE = re.compile(r"^(?P<module>.*?) \((?P<cls>[^()]*)\)$")
_FOLLOW_LINES = 4  # a Diagnosis/Fix line this close after a Detected line of the same rank belongs to it
_MAX_DETECTIONS = 256
MONITOR_FILES = ("torchdoctor/numerics/", "torchdoctor\\numerics\\")


@dataclass
class Detection:
    """One rank's first non-finite value, from a report file or an output line."""

    rank: int | None
    step: int
    phase: str | None  # "forward" / "backward" / "update" (None: not said)
    module: str | None
    cls: str | None = None
    slot: str | None = None
    value: str | None = None
    diagnosis: str | None = None
    fix: str | None = None
    cause: str | None = None
    severity: str = "fail"
    source: str = "output"  # "report" or "output"
    path: str | None = None  # the report file
    line: int | None = None  # the output line (1-based, counted over both streams as they arrived)
    bad_ranks: list[int] = field(default_factory=list)
    file_rank: int | None = None  # the rank in the report file's name
    located: bool = True  # it names where (False: a report of a rank whose own values were finite)
    fix_check: str | None = None  # the fix tried on the bad step: "fixed", "not fixed", "not checked"
    fix_check_reason: str | None = None
    observed: dict | None = None  # what the monitor saw of the step

    def key(self) -> tuple:
        return (self.step, -1 if self.rank is None else self.rank)


def _split_who(who: str | None) -> tuple[str | None, str | None]:
    """``"1 (Boom)"`` -> ("1", "Boom"); ``"Sequential (the model)"`` -> ("", "Sequential")."""
    if who is None:
        return None, None
    if who.endswith(" (the model)"):
        return "", who[: -len(" (the model)")]
    m = _WHO_RE.match(who)
    return (m["module"], m["cls"]) if m else (who, None)


class OutputScan:
    """Collects the monitor's ``Detected ...`` lines (and the Diagnosis/Fix after them) from decoded text blocks."""

    def __init__(self) -> None:
        self.detections: list[Detection] = []
        self._lineno = 0
        self._last: dict[int | None, tuple[Detection, int]] = {}  # rank -> (its last detection, line)
        self.error: str | None = None

    def feed(self, block: str) -> None:
        if self.error is not None:
            return
        try:
            self._feed(block)
        except Exception as e:  # noqa: BLE001 -- only evidence: must never disturb the run
            self.error = f"{type(e).__name__}: {e}"

    def _feed(self, block: str) -> None:
        if "Detected " not in block and (not self._last or ": " not in block):
            self._lineno += block.count("\n")
            return
        for raw in block.split("\n"):
            self._lineno += 1
            line = raw.rstrip("\r")
            if "\r" in line:
                line = line.rsplit("\r", 1)[-1]
            if "Detected " in line:
                m = DETECTED_RE.match(line)
                if m:
                    self._detected(m)
                    continue
            if ": " in line and self._last:
                m = _FOLLOW_RE.match(line)
                if m:
                    rank = _rank(m)
                    prev = self._last.get(rank)
                    if prev is not None and self._lineno - prev[1] <= _FOLLOW_LINES:
                        d = prev[0]
                        if m["key"] == "Diagnosis" and d.diagnosis is None:
                            d.diagnosis = m["text"]
                        elif m["key"] == "Fix" and d.fix is None:
                            d.fix = m["text"]
                        elif m["key"] == "Severity" and m["text"].startswith("warning"):
                            d.severity = "warn"  # a survived one (an inf loss with finite gradients)
                        self._last[rank] = (d, self._lineno)
        self._lineno -= 1  # the block ends with a newline (or is a partial line): not one more line

    def _detected(self, m: re.Match) -> None:
        rank = _rank(m)
        module, cls = _split_who(m["who"])
        d = Detection(rank=rank, step=int(m["step"]), phase=m["phase"], module=module, cls=cls, slot=m["slot"],
                      value=None if m["value"] == "a non-finite value" else m["value"], line=self._lineno)
        same = next((x for x in self.detections if (x.rank, x.step, x.phase, x.module) ==
                     (d.rank, d.step, d.phase, d.module)), None)
        if same is not None:  # printed twice: the monitor's line, then the NonFiniteError's message
            self._last[rank] = (same, self._lineno)
            return
        if len(self.detections) < _MAX_DETECTIONS:
            self.detections.append(d)
            self._last[rank] = (d, self._lineno)


def _rank(m: re.Match) -> int | None:
    r = m["rank"] or m["trank"]
    return int(r) if r is not None else None


def _phase(p: Any) -> str | None:
    return {"fwd": "forward", "bwd": "backward", "forward": "forward", "backward": "backward"}.get(p, p)


def read_reports(dirs: list[str], since: float | None) -> tuple[list[Detection], list[str]]:
    """The monitor's report JSON files in ``dirs`` (each once) written at or after ``since`` (seconds since the
    epoch; half a second of slack for coarse file-system clocks): (detections, problems reading them)."""
    out: list[Detection] = []
    problems: list[str] = []
    seen: set[str] = set()
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(glob.escape(d), REPORT_GLOB))):
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            try:
                if since is not None and os.stat(path).st_mtime < since - 0.5:
                    continue  # an earlier run's
                with open(path, encoding="utf-8") as fh:
                    rep = json.load(fh)
            except (OSError, ValueError) as e:
                problems.append(f"{path}: {getattr(e, 'strerror', None) or e}")
                continue
            det = _from_report(rep, path)
            if det is None:
                problems.append(f"{path}: not a torchdoctor non-finite report")
            else:
                out.append(det)
    return out, problems


def _from_report(rep: Any, path: str) -> Detection | None:
    if not isinstance(rep, dict) or not isinstance(rep.get("step"), int):
        return None
    m = _FILE_RANK.search(os.path.basename(path))
    rank = rep.get("rank") if isinstance(rep.get("rank"), int) else None
    file_rank = int(m.group(1)) if m else None
    first = rep.get("first") if isinstance(rep.get("first"), dict) else None
    bad = [r for r in rep.get("bad_ranks") or [] if isinstance(r, int)]
    det = Detection(rank=rank, step=rep["step"], phase=None, module=None, source="report", path=path,
                    diagnosis=_str(rep.get("diagnosis")), fix=_str(rep.get("fix")), cause=_str(rep.get("cause")),
                    severity="warn" if rep.get("severity") == "warn" else "fail", bad_ranks=bad)
    if first is not None:
        det.step = first.get("step") if isinstance(first.get("step"), int) else det.step
        det.phase = _phase(first.get("phase"))
        det.module, det.cls, det.slot = _str(first.get("module")), _str(first.get("cls")), _str(first.get("slot"))
        det.value = _str(first.get("value"))
    det.file_rank, det.located = file_rank, first is not None
    det.fix_check, det.fix_check_reason = _str(rep.get("fix_check")), _str(rep.get("fix_check_reason"))
    det.observed = rep.get("observed") if isinstance(rep.get("observed"), dict) else None
    return det


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _where(d: Detection) -> str:
    mod = d.module if d.module else (f"{d.cls} (the model)" if d.module == "" and d.cls else "an unnamed module")
    s = f"in {mod}" + (f" ({d.cls})" if d.cls and d.module else "")
    if d.slot:
        s += f", slot {d.slot}"
    return s


def _what(d: Detection) -> str:
    value = d.value or "a non-finite value"
    phase = f" ({d.phase})" if d.phase else ""
    where = f" {_where(d)}" if d.module is not None else ""
    return f"{value} at step {d.step}{phase}{where}"


def nonfinite_finding(reports: list[Detection], lines: list[Detection], problems: list[str] | None = None,
                      report_dirs: list[str] | None = None) -> Finding | None:
    """``numerics.nonfinite`` from the report files (preferred) or the output's Detected lines; None if neither."""
    problems = list(problems or [])
    source = "report" if reports else "output"
    dets = reports or lines
    if not dets:
        return None
    if len(dets) > 1 or any(d.rank is not None for d in dets):
        for d in dets:  # several files: the file name tells the ranks apart when the JSON has none
            if d.rank is None and d.file_rank is not None and len(dets) > 1:
                d.rank = d.file_rank
    located = [d for d in dets if d.located]
    firsts: dict[int | None, Detection] = {}  # each rank's first: its earliest step (then as it came)
    for d in located or dets:
        if d.rank not in firsts or d.step < firsts[d.rank].step:
            firsts[d.rank] = d
    # a report from a rank whose own values were finite names the rank(s) that were not: those went first (in the
    # same step, the others only received their values through the gradient reduction)
    named_bad = sorted({r for d in dets for r in d.bad_ranks})
    pool = sorted(firsts.values(), key=lambda d: (d.step, bool(named_bad) and d.rank not in named_bad, *d.key()[1:]))
    first = pool[0]
    others = pool[1:]
    who = f"rank {first.rank}: " if first.rank is not None else ""
    title = f"{who}the numerics monitor detected {_what(first)}"
    if others:
        title += f" -- the first of {len(pool)} ranks that detected one"
    elif not located and named_bad:
        title = (f"the numerics monitor stopped the run at step {first.step}: rank(s) {named_bad} found "
                 "non-finite values")
    ev: list[str] = []
    if first.source == "report":
        ev.append(f"report: {first.path}")
    elif first.line is not None:
        ev.append(f"output line {first.line}: Detected {_what(first)}")
    if first.cause:
        ev.append(f"cause: {first.cause}")
    if first.diagnosis:
        ev.append(f"Diagnosis: {first.diagnosis}")
    if first.fix_check:
        ev.append(f"Fix check: {first.fix_check}" + (f" ({first.fix_check_reason})" if first.fix_check_reason else ""))
    for d in others:
        r = f"rank {d.rank}" if d.rank is not None else "another process"
        ev.append(f"also {r}: {_what(d)}" + (f" (report: {d.path})" if d.path else ""))
    if named_bad and located:
        ev.append(f"ranks that found non-finite values (as the reports say): {named_bad}")
    if source == "output":
        ev.append("no report file found" + (f" in {', '.join(report_dirs)}" if report_dirs else "") +
                  ": from the Detected lines of the output")
    ev += [f"unreadable report: {p}" for p in problems]
    fix = [first.fix] if first.fix else []
    reports_at = first.path or (report_dirs[0] if report_dirs else None)
    fix.append("read the full report (the frames before the first non-finite value): "
               + (os.path.splitext(first.path)[0] + ".txt" if first.path else
                  "torchdoctor-nonfinite-rank<r>.txt in the monitor's report_dir" +
                  (f" ({reports_at})" if reports_at and not first.path else "")))
    sev = "warn" if all(d.severity == "warn" for d in pool) else "fail"
    data = {
        "source": source, "rank": first.rank, "step": first.step, "phase": first.phase, "module": first.module,
        "cls": first.cls, "slot": first.slot, "value": first.value, "diagnosis": first.diagnosis, "fix": first.fix,
        "cause": first.cause, "report": first.path, "first_rank": first.rank,
        "fix_check": first.fix_check, "fix_check_reason": first.fix_check_reason, "observed": first.observed,
        "other_ranks": [d.rank for d in others],
        "ranks": [{"rank": d.rank, "step": d.step, "phase": d.phase, "module": d.module, "slot": d.slot,
                   "value": d.value, "report": d.path} for d in pool],
        "bad_ranks": named_bad,
    }
    return Finding("numerics.nonfinite", sev, title, ev, fix, data)


def is_monitor_exception(f: Finding) -> bool:
    """A ``process.exception`` about the monitor's own NonFiniteError (its type, or raised in its files)."""
    if f.id != "process.exception":
        return False
    exc = f.data.get("exception") or {}
    typ = exc.get("type") or "" if isinstance(exc, dict) else ""
    if typ.rsplit(".", 1)[-1] == "NonFiniteError":
        return True
    inner = f.data.get("innermost_frame") or {}
    file = inner.get("file") or "" if isinstance(inner, dict) else ""
    return any(p in file for p in MONITOR_FILES)


def fold(findings: list[Finding], nonfinite: Finding | None) -> list[Finding]:
    """The log findings with the monitor's NonFiniteError traceback folded into ``numerics.nonfinite``."""
    if nonfinite is None:
        return findings
    return [nonfinite, *(f for f in findings if not is_monitor_exception(f))]


def check_report_dir(path: str) -> str | None:
    """Why ``path`` cannot hold report files (created if missing), or None when it can."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    if not os.path.isdir(path):
        return "not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return "permission denied"
    return None

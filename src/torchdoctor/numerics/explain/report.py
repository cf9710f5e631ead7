"""The report built when a non-finite value is found: where it started, the frames before it, why.

The report is data first (:class:`NonFiniteReport`, :meth:`NonFiniteReport.to_json`) and text second
(:meth:`NonFiniteReport.text`). Why it went bad is :mod:`.diagnosis`'s rules over the resolved frames; every
verdict has a stable id (``NonFiniteReport.cause``, :data:`.causes.CAUSES`) and names the frame lines it cites
(``NonFiniteReport.evidence``), which :mod:`.evidence` checks against the frames shown.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ...jsonfile import dumps
from ..record.frames import BWD, UPDATE, Line, ResolvedFrame
from .consumers import code_between, consumer_of
from .diagnosis import HEADROOM_FACTOR, Evidence, Setup, common_region, diagnose, keep_fp32_fix
from .render import format_frames, who

__all__ = [
    "HEADROOM_FACTOR", "FirstNonFinite", "NonFiniteReport", "Setup", "build_report",
    "common_region", "find_first_bad", "fix_keep_fp32",
]


@dataclass(frozen=True)
class FirstNonFinite:
    """Where the first non-finite value appeared."""

    step: int
    phase: str
    module: str
    cls: str
    slot: str
    value: str  # "inf" or "nan"

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step", "phase", "module", "cls", "slot", "value")}


_PHASE_WORDS = {BWD: "backward", UPDATE: "update"}


@dataclass
class NonFiniteReport:
    step: int
    first: FirstNonFinite | None
    frames: list[ResolvedFrame]
    diagnosis: str
    fix: str | None = None
    rank: int | None = None
    bad_ranks: list[int] = field(default_factory=list)
    marker: Line | None = None
    notes: list[str] = field(default_factory=list)
    fp32_region: str | None = None  # the module to keep in fp32, when that is the fix
    # the modules keep_fp32 kept in fp32 when the report was made: a keep_fp32 fix adds fp32_region to them
    fp32_kept: list[str] = field(default_factory=list)
    position: int = 0  # where the first bad frame sits in its step (ranks compare it)
    boundary: bool = False  # that frame is a compiled region's edge
    cause: str | None = None  # the diagnosis' stable id (causes.CAUSES)
    evidence: tuple[Evidence, ...] = ()  # the frame lines the diagnosis cites (evidence.contradictions checks them)
    # "fail": raised (NonFiniteError); "warn": recorded on the monitor and warned about, the run goes on
    severity: str = "fail"
    # lines the diagnosis cites from frames recorded after the first bad one (the model's own frame, whose inputs
    # are what it was given, ends after its modules'): shown after the frames, so every claim can be read there
    cited: list[ResolvedFrame] = field(default_factory=list)
    # what the monitor watched (watched.describe): the model, its size, the optimizer, the wrappers
    watched: str | None = None
    # whether the step was replayed with every module watched (replay.py): "reproduced", "not reproduced", "not
    # replayed"; and why, when it was not reproduced or not replayed
    replay: str | None = None
    replay_reason: str | None = None
    # what the monitor saw of the step (Observed.to_json): which parts of it were watched, the autocast it ran under
    observed: dict[str, Any] | None = None
    # whether the fix was tried on the bad step before it was printed (fixcheck.py): "fixed", "not fixed", "not
    # checked"; and how, or why not
    fix_check: str | None = None
    fix_check_reason: str | None = None

    def text(self) -> str:
        tag = f"[rank{self.rank}] " if self.rank is not None else ""
        # the answer first (where, why, what to do), then the evidence: the frames, then the notes
        out = []
        if self.first is not None:
            f = self.first
            out.append(
                f"Detected {f.value} at step {f.step} ({_PHASE_WORDS.get(f.phase, 'forward')}) "
                f"in {who(f.module, f.cls)}, slot {f.slot}"
            )
        elif self.bad_ranks:
            out.append(f"Stopped at step {self.step}: rank(s) {self.bad_ranks} found non-finite values;")
            out.append("this rank's values were finite. See the report file of the rank(s) named.")
        else:
            out.append(f"Detected a non-finite value at step {self.step}")
        if self.severity == "warn":
            out.append("Severity: warning (the run goes on: the step's gradients are finite)")
        out.append(f"Diagnosis: {self.diagnosis}")
        if self.fix:
            out.append(f"Fix: {self.fix}")
        if self.first is not None and self.frames:
            out.append(f"Last {len(self.frames)} frames, in execution order:")
            out.extend(format_frames(self.frames, self.marker))
        if self.cited:
            out.append("Cited by the diagnosis, from frames that end later in the step:")
            out.extend(format_frames(self.cited)[1:])
        out.extend(self.notes)
        if self.replay is not None:
            out.append(f"Replay: {self.replay}" + (f" ({self.replay_reason})" if self.replay_reason else ""))
        if self.fix_check is not None:
            out.append(f"Fix check: {self.fix_check}" + (f" ({self.fix_check_reason})" if self.fix_check_reason
                                                         else ""))
        if self.observed:
            out.append("Observed: " + "; ".join(f"{k} {v}" for k, v in self.observed.items()))
        if self.watched:
            out.append(f"Watched: {self.watched}")
        return "\n".join(tag + line for line in out)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "bad_ranks": self.bad_ranks,
            "first": self.first.to_json() if self.first else None,
            "cause": self.cause,
            "severity": self.severity,
            "diagnosis": self.diagnosis,
            "evidence": [e.to_json() for e in self.evidence],
            "fix": self.fix,
            "fp32_region": self.fp32_region,
            "fp32_kept": self.fp32_kept,
            "notes": self.notes,
            "frames": [f.to_json() for f in self.frames],
            "cited": [f.to_json() for f in self.cited],
            "watched": self.watched,
            "replay": self.replay,
            "replay_reason": self.replay_reason,
            "observed": self.observed,
            "fix_check": self.fix_check,
            "fix_check_reason": self.fix_check_reason,
        }

    def write(self, report_dir: str | os.PathLike, basename: str = "torchdoctor-nonfinite") -> list[str]:
        """Write ``<basename>-rank<r>.txt`` and ``.json`` and flush them to disk; return the paths."""
        os.makedirs(report_dir, exist_ok=True)
        stem = os.path.join(os.fspath(report_dir), f"{basename}-rank{self.rank or 0}")
        paths = []
        contents = {stem + ".txt": self.text() + "\n", stem + ".json": dumps(self.to_json(), indent=1)}
        for path, content in contents.items():
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
            paths.append(path)
        return paths


def find_first_bad(
    frames: list[ResolvedFrame], start: int = 0, judge_inputs: bool = True, judge_params: bool = True
) -> tuple[int, Line] | None:
    """The first non-finite line in execution order, from ``frames[start]`` on (earlier frames are context).

    With ``judge_inputs=False`` a non-finite *input* does not count by itself (an additive ``-inf``
    attention mask is a legitimate input); the module output it spoils does. With
    ``judge_params=False`` weights measured now do not count: without a hooked optimizer they may
    have been updated since the forward that is being judged.

    Parameter gradients (``grad:weight``) measured when the report is built hold the whole
    backward's sum (a tied weight collects gradients from later modules too): they count only when no
    value measured at its own time is non-finite. (Those measured as the parameter received them, in
    the backward, carry a ``ref`` and are timely.)

    Module-level gradients (``grad_output``) recorded without being judged -- the first step records them at every
    level, but only ``grads="modules"`` lets them stop a step -- count here: a report is built for a step that went
    bad anyway, and they say where its backward went bad.
    """
    for timely in (True, False):
        for i in range(start, len(frames)):
            for line in frames[i].lines:
                late = line.label.startswith("grad:") and line.ref is None
                judged = line.judged or line.label.startswith("grad_")
                if line.finite or not judged or (timely and late) or (line.param and not judge_params):
                    continue
                if judge_inputs or not line.label.startswith("input"):
                    return i, line
    return None


def build_report(
    frames: list[ResolvedFrame],
    max_frames: int,
    rank: int | None,
    start: int = 0,
    judge_inputs: bool = True,
    judge_params: bool = True,
    trail: list[tuple[int, float]] | None = None,
    setup: Setup | None = None,
) -> NonFiniteReport | None:
    """The report for the first non-finite value in ``frames[start:]`` (None when all are finite);
    the frames before ``start`` (earlier, already checked steps) are shown as context only.
    ``setup``: what the advice may assume beyond the frames (:class:`~.diagnosis_types.Setup`: the optimizer given, the
    step checked before its update, the modules kept in fp32)."""
    setup = setup or Setup()
    found = find_first_bad(frames, start, judge_inputs, judge_params)
    if found is None:
        return None
    index, line = found
    frame = frames[index]
    why = diagnose(frames, index, line, judge_params, trail, setup)
    value = "nan" if math.isnan(line.abs_max) else "inf"
    module_grad = frame.phase == BWD and not line.label.startswith("grad:")
    consumer = consumer_of(frames, index) if module_grad else None
    between = code_between(frames, index) if module_grad and consumer is None else None
    if consumer is not None:
        first = FirstNonFinite(frame.step, BWD, consumer.name, consumer.cls, "grad_input", value)
    elif between is not None:  # plain code in the parent's forward, after the module whose output gradient it is
        parent = between[0]
        first = FirstNonFinite(frame.step, BWD, parent.name, parent.cls, f"code after {frame.name}", value)
    else:
        first = FirstNonFinite(frame.step, frame.phase, frame.name, frame.cls, line.label, value)
    shown = frames[max(0, index - max_frames) : index + 1]
    fix = why.fix or fix_keep_fp32(why.region, setup.kept_fp32)
    return NonFiniteReport(frame.step, first, shown, why.text, fix, rank=rank, marker=line, fp32_region=why.region,
                           position=index - start, boundary=frame.boundary, cause=why.cause, evidence=why.evidence,
                           cited=_cited(why.evidence, shown), fp32_kept=list(setup.kept_fp32))


def _cited(evidence: tuple[Evidence, ...], shown: list[ResolvedFrame]) -> list[ResolvedFrame]:
    """The evidence lines whose frames are not among those shown, each under its own frame's header."""
    shown_ids = {id(f) for f in shown}
    out: dict[int, ResolvedFrame] = {}
    for e in evidence:
        f = e.frame
        if f is None or id(f) in shown_ids:
            continue
        line = next((ln for ln in f.lines if ln.label == e.slot), None)
        if line is None:
            continue
        cited = out.setdefault(id(f), ResolvedFrame(f.step, f.phase, f.name, f.cls, root=f.root))
        if line not in cited.lines:
            cited.lines.append(line)
    return list(out.values())


def fix_keep_fp32(region: str | None, kept: tuple[str, ...] = ()) -> str | None:
    """The one-line fix for a region that should run in fp32 (None when there is none). ``kept``: the modules a
    keep_fp32 guard keeps in fp32 now; the fix adds the region to them, and says so
    (:func:`.diagnosis_types.keep_fp32_fix`)."""
    return None if region is None else keep_fp32_fix(region, kept)

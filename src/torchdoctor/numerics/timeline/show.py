"""``numerics show``: a recording as one page -- per rank, a module x step heatmap of the forward's outputs and one
of the gradients at them, the first non-finite value marked, the text report below -- and what it says in text.

The first non-finite value marked is the monitor's own verdict where the rank has a report (``report.json``), else
the first non-finite value the recording holds (earliest step, the forward first, in execution order); the step
axis keeps that step a column of its own whatever the downsampling.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import torch

from .diff import fmt
from .grid import PHASES, Binned, FirstBad, Grid, bin_steps, first_bad, grid_of, recorded
from .html import MAX_COLUMNS, Marker, Panel, RankPage, columns_for, dtype_log10_max, page
from .store import RankTimeline

PHASE_WORDS = {"fwd": "forward", "bwd": "backward"}


@dataclass
class Closest:
    """The value nearest its dtype's largest (the least headroom) in a rank's recording."""

    step: int
    phase: str
    module: str
    cls: str
    slot: str
    dtype: str
    value: float
    decades: float

    def text(self) -> str:
        return (f"closest to its dtype's max: {self.module or '(model)'} ({self.cls}) {self.slot}, "
                f"{PHASE_WORDS[self.phase]}, step {self.step}: abs max {fmt(self.value)} in {self.dtype}, "
                f"{self.decades:.2f} decades below its max")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "module": self.module, "class": self.cls, "slot": self.slot,
                "dtype": self.dtype, "abs_max": self.value, "decades_below_max": round(self.decades, 4)}


@dataclass
class RankSummary:
    rank: int | str
    rows: int
    steps: list[int]
    columns: int
    first_bad: FirstBad | None
    marker: Marker | None
    closest: Closest | None
    problems: list[str]

    def to_json(self) -> dict[str, Any]:
        fb = self.first_bad
        return {"rank": self.rank, "rows": self.rows, "steps": len(self.steps),
                "first_step": self.steps[0] if self.steps else None, "last_step": self.steps[-1] if self.steps
                else None, "columns": self.columns,
                "first_nonfinite": None if fb is None else {
                    "step": fb.step, "phase": fb.phase, "module": fb.module, "class": fb.cls, "slot": fb.slot,
                    "value": fb.value, "source": fb.source, "drawn": bool(self.marker and self.marker.col is not None
                                                                          and self.marker.row is not None)},
                "closest_to_max": self.closest.to_json() if self.closest else None, "problems": self.problems}


def slot_of(phase: str, suffix: str) -> str:
    return ("output" if phase == "fwd" else "grad_output") + suffix


def closest(grid: Grid, log_max: dict[str, float]) -> Closest | None:
    best = None
    for p in range(len(PHASES)):
        tops = torch.tensor([log_max.get(d.split("/")[0], math.nan) if d else math.nan for d in
                             (x[p] for x in grid.dtypes)])
        v = grid.hi[p]
        ok = recorded(v) & v.isfinite() & (v > 0) & tops.isfinite()[None, :]
        if not bool(ok.any()):
            continue
        room = torch.where(ok, tops[None, :] - v.clamp(min=1e-45).log10(), math.inf)
        i, r = divmod(int(room.argmin()), room.shape[1])
        if best is None or float(room[i, r]) < best[0]:
            best = (float(room[i, r]), p, i, r)
    if best is None:
        return None
    room, p, i, r = best
    row = grid.rows[r]
    return Closest(int(grid.steps[i]), PHASES[p], row.module, row.cls, slot_of(PHASES[p], row.suffix),
                   grid.dtypes[r][p].split("/")[0], float(grid.hi[p, i, r]), room)


def marker_of(grid: Grid, fb: FirstBad | None, binned: Binned) -> Marker | None:
    if fb is None:
        return None
    at = (grid.steps == fb.step).nonzero().flatten()
    col = bisect.bisect_right(binned.starts, int(at[0])) - 1 if at.numel() else None
    who = f"{fb.module or '(model)'} ({fb.cls}) {fb.slot}" if fb.module is not None else "(on another rank)"
    source = "the monitor's report" if fb.source == "report" else "the first non-finite value recorded"
    text = f"first {fb.value} ({source}): step {fb.step}, {PHASE_WORDS[fb.phase]}, {who}"
    if col is None:
        every = grid.settings.get("record_every", 1)
        text += f" -- step {fb.step} was not recorded (every {every}th step is): no column for it"
    elif fb.module is None:
        text += " -- this rank's values were finite; the column is marked"
    elif fb.row is None:
        text += " -- the recording keeps module outputs and their gradients, not this value: the column is marked"
    elif fb.source == "report" and fb.slot and slot_of(fb.phase, grid.rows[fb.row].suffix) != fb.slot:
        text += f" -- a value the recording does not keep; marked on the module's {slot_of(fb.phase, '')} row"
    return Marker(fb.step, PHASES.index(fb.phase), col, fb.row, text, fb.module)


def report_text(grid: Grid) -> str:
    """The rank's report as the monitor printed it (report.txt), else its main lines from report.json."""
    if grid.report_text:
        return grid.report_text
    rep = grid.report
    if not rep:
        return "(no non-finite report: the run did not stop on a non-finite value while recording)"
    first = rep.get("first") or {}
    lines = [f"Detected {first.get('value')} at step {first.get('step')} ({PHASE_WORDS.get(first.get('phase'), '?')}"
             f") in {first.get('module')} ({first.get('cls')}), slot {first.get('slot')}" if first else
             f"Stopped at step {rep.get('step')}: rank(s) {rep.get('bad_ranks')} found non-finite values"]
    for key, title in (("diagnosis", "Diagnosis"), ("fix", "Fix"), ("fix_check", "Fix check"), ("replay", "Replay")):
        if rep.get(key):
            lines.append(f"{title}: {rep[key]}")
    lines.append(f"({len(rep.get('frames') or [])} frames in report.json)")
    return "\n".join(lines)


def facts(grid: Grid, binned: Binned, fb: FirstBad | None) -> list[str]:
    s = grid.settings
    steps = grid.steps.tolist()
    out = [f"{len(grid.rows)} rows (module outputs, in execution order) x {len(steps)} recorded steps"
           + (f" ({steps[0]}-{steps[-1]}, every {s.get('record_every', 1)})" if steps else "")]
    if len(binned.starts) < len(steps):
        out.append(f"drawn as {len(binned.starts)} columns of up to {max(binned.counts)} recorded steps: each column "
                   "holds the largest abs max and the smallest abs min of its steps"
                   + (f"; step {fb.step} (the first non-finite) is a column of its own" if fb is not None else ""))
    out.append(f"world size {s.get('world_size')}, torch {s.get('torch')}, torchdoctor {s.get('torchdoctor')}")
    if s.get("watching"):
        out.append(f"watching: {s['watching']}")
    out += [f"unreadable: {p}" for p in grid.problems]
    return out


def rank_name(rank: int | str) -> str:
    return "all ranks" if rank == "all" else f"rank {rank}"


def build(ranks: list[RankTimeline], title: str, max_columns: int = MAX_COLUMNS) -> tuple[str, list[RankSummary]]:
    """The page of ``ranks`` (a recording as :func:`.store.load_run` reads it) and what each rank shows."""
    grids = [grid_of(r) for r in ranks]
    columns = columns_for(sum(len(g.rows) for g in grids), 1, max_columns)
    log_max = dtype_log10_max()
    pages, summaries = [], []
    for g in grids:
        fb = first_bad(g)
        alone = [int(i) for i in (g.steps == fb.step).nonzero().flatten()] if fb is not None else []
        [binned] = bin_steps(g.steps, [(g.hi, g.lo)], columns, alone)
        marker = marker_of(g, fb, binned)
        near = closest(g, log_max)
        lines = facts(g, binned, fb) + ([near.text()] if near else [])
        pages.append(RankPage(rank_name(g.rank), g.rows, [g.dtypes], [binned], marker, report_text(g), lines))
        summaries.append(RankSummary(g.rank, len(g.rows), g.steps.tolist(), len(binned.starts), fb, marker, near,
                                     g.problems))
    groups = [("forward and backward", [Panel("forward: each module's output, abs max", 0),
                                        Panel("backward: the gradient at each output, abs max", 1)])]
    subtitle = (f"{len(ranks)} rank(s); torch {ranks[0].settings.get('torch')}; recorded every "
                f"{ranks[0].settings.get('record_every', 1)} step(s). Hover a cell for its exact values.")
    return page(title, subtitle, pages, groups, ["run"], "The non-finite report"), summaries

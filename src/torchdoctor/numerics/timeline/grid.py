"""A recording as rows x steps: the shape both ``numerics show`` and ``numerics diff`` read it in.

A *row* is one output of one module -- ``output`` in the forward and the gradient at that output, ``grad_output``,
in the backward share it -- so the forward and the gradient views line up module by module. Rows are in the
forward's execution order (the order a module's output was first recorded; rows with a gradient only follow, in
the backward's order), and each phase keeps its own execution order for "upstream" questions. Values are the
recording's (abs min, abs max) per step; -1 says "not recorded there" (statistics are absolute values, never -1),
nan and inf stay as they were.

:func:`fold` is the one reduction everything here uses (several keys into one row, several ranks into one, several
steps into one column): the largest abs max and the smallest abs min of what was recorded, a nan winning, -1 only
where nothing was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .store import RankTimeline

PHASES = ("fwd", "bwd")
_PREFIX = {"fwd": "output", "bwd": "grad_output"}


@dataclass(frozen=True)
class Row:
    module: str
    cls: str
    suffix: str  # "" for a module's one output, "[i]" for the i-th of several
    dtype: str | None = None  # None where rows of several dtypes were merged (diff aligns across dtypes)

    def label(self) -> str:
        return f"{self.module or '(model)'} ({self.cls}){' ' + self.suffix if self.suffix else ''}"


@dataclass
class Grid:
    """One rank's recording (or several ranks' folded into one): ``hi[p, i, r]`` / ``lo[p, i, r]`` are the abs max
    / abs min of row ``r`` in phase ``PHASES[p]`` at ``steps[i]``."""

    rank: int | str  # "all" for ranks folded into one
    rows: list[Row]
    dtypes: list[list[str]]  # per row, per phase: the dtype(s) recorded, joined by "/" ("" where none)
    order: list[list[int]]  # per phase: its rows in execution order
    steps: torch.Tensor  # int64 (n,)
    hi: torch.Tensor  # float32 (2, n, R)
    lo: torch.Tensor  # float32 (2, n, R)
    settings: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] | None = None
    report_text: str | None = None
    problems: list[str] = field(default_factory=list)

    def row_index(self) -> dict[tuple[str, str, str], int]:
        return {(r.module, r.cls, r.suffix): i for i, r in enumerate(self.rows)}


def recorded(v: torch.Tensor) -> torch.Tensor:
    """Where a value was recorded (-1 is "not recorded"; nan was recorded)."""
    return (v >= 0) | v.isnan()


def fold(index: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, size: int, dim: int) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Fold ``hi`` / ``lo`` along ``dim`` into ``size`` slots, ``index[j]`` naming the slot of position ``j``: the
    largest abs max, the smallest recorded abs min (nan wins both), -1 where no position recorded anything."""
    shape = list(hi.shape)
    shape[dim] = size
    view = [1] * hi.dim()
    view[dim] = -1
    at = index.view(view).expand_as(hi)
    out_hi = torch.full(shape, -1.0).scatter_reduce_(dim, at, hi, "amax", include_self=True)
    mask = recorded(lo)
    out_lo = torch.full(shape, float("inf")).scatter_reduce_(dim, at, torch.where(mask, lo, float("inf")), "amin",
                                                             include_self=True)
    seen = torch.zeros(shape, dtype=torch.int32).scatter_add_(dim, at, mask.to(torch.int32))
    return out_hi, torch.where(seen > 0, out_lo, -1.0)


def slot_suffix(phase: str, slot: str) -> str:
    prefix = _PREFIX.get(phase, "")
    return slot[len(prefix):] if slot.startswith(prefix) else slot


def grid_of(run: RankTimeline, by_dtype: bool = True) -> Grid:
    """``run`` as rows: with ``by_dtype`` a module's output recorded in two dtypes (autocast turned on halfway) is two
    rows; without, one (what diff aligns two runs by)."""
    rows: dict[Row, int] = {}
    dtypes: list[list[list[str]]] = []
    order: list[list[int]] = [[], []]
    index = [[], []]  # per phase: (key column, row)
    for phase_first in (True, False):  # forward rows first: the rows' order is the forward's
        for col, (module, cls, phase, slot, dtype) in enumerate(run.keys):
            if phase not in PHASES or (phase == "fwd") != phase_first:
                continue
            p = PHASES.index(phase)
            row = Row(module, cls, slot_suffix(phase, slot), dtype if by_dtype else None)
            r = rows.get(row)
            if r is None:
                r = rows[row] = len(rows)
                dtypes.append([[], []])
            if r not in order[p]:
                order[p].append(r)
            if dtype not in dtypes[r][p]:
                dtypes[r][p].append(dtype)
            index[p].append((col, r))
    n, size = run.steps.shape[0], len(rows)
    hi = torch.full((2, n, size), -1.0)
    lo = torch.full((2, n, size), -1.0)
    for p in (0, 1):
        if index[p]:
            cols = torch.tensor([c for c, _ in index[p]])
            at = torch.tensor([r for _, r in index[p]])
            hi[p], lo[p] = fold(at, run.values[:, cols, 1], run.values[:, cols, 0], size, dim=1)
    return Grid(run.rank, list(rows), [["/".join(d) for d in per] for per in dtypes], order, run.steps.clone(), hi,
                lo, run.settings, run.report, run.report_text, list(run.problems))


def aligned(grids: list[Grid], steps: torch.Tensor | None = None) -> tuple[list[Row], torch.Tensor,
                                                                           list[tuple[torch.Tensor, torch.Tensor]]]:
    """Several grids on common axes: rows in the first grid's order (then the rows only later ones have), ``steps``
    (default: every step any grid recorded); each grid's (hi, lo) on them, -1 where it has no value."""
    rows: dict[Row, int] = {}
    for g in grids:
        for r in g.rows:
            rows.setdefault(r, len(rows))
    if steps is None:
        steps = torch.unique(torch.cat([g.steps for g in grids])) if grids else torch.empty(0, dtype=torch.int64)
    out = []
    for g in grids:
        hi = torch.full((2, steps.shape[0], len(rows)), -1.0)
        lo = torch.full_like(hi, -1.0)
        at_step = torch.searchsorted(steps, g.steps)
        keep = (at_step < steps.shape[0]) & (steps[at_step.clamp(max=max(steps.shape[0] - 1, 0))] == g.steps) \
            if steps.shape[0] else torch.zeros_like(g.steps, dtype=torch.bool)
        rows_at = torch.tensor([rows[r] for r in g.rows], dtype=torch.int64)
        if keep.any() and rows_at.numel():
            src_steps = keep.nonzero().flatten()
            for p in (0, 1):
                part_hi = g.hi[p][src_steps]
                part_lo = g.lo[p][src_steps]
                hi[p][at_step[src_steps][:, None], rows_at[None, :]] = part_hi
                lo[p][at_step[src_steps][:, None], rows_at[None, :]] = part_lo
        out.append((hi, lo))
    return list(rows), steps, out


def fold_ranks(grids: list[Grid]) -> Grid:
    """Every rank's grid folded into one (rank "all"): per step and row, the largest abs max and smallest abs min over
    the ranks that recorded it -- what two runs of different world sizes can be compared by."""
    rows, steps, parts = aligned(grids)
    hi = torch.stack([h for h, _ in parts])  # (ranks, 2, n, R)
    lo = torch.stack([lo for _, lo in parts])
    at = torch.zeros(len(grids), dtype=torch.int64)
    hi, lo = fold(at, hi, lo, 1, dim=0)
    where = {r: i for i, r in enumerate(rows)}
    dtypes = [["", ""] for _ in rows]
    order: list[list[int]] = [[], []]
    for g in grids:
        for p in (0, 1):
            for r in g.order[p]:
                i = where[g.rows[r]]
                if i not in order[p]:
                    order[p].append(i)
            for r, row in enumerate(g.rows):
                seen = [d for d in dtypes[where[row]][p].split("/") if d]
                for d in g.dtypes[r][p].split("/"):
                    if d and d not in seen:
                        seen.append(d)
                dtypes[where[row]][p] = "/".join(seen)
    first = grids[0]
    return Grid("all", rows, dtypes, order, steps, hi[0], lo[0], first.settings, None, None,
                [p for g in grids for p in g.problems])


@dataclass
class FirstBad:
    """Where a recording (or its report) first went non-finite."""

    step: int
    phase: str  # "fwd" / "bwd"
    row: int | None  # the row, None when the report names a value the recording does not keep
    value: str  # "inf" / "nan" / "-inf"
    source: str  # "report" (the monitor's verdict) or "recording" (the first non-finite value recorded)
    slot: str | None = None  # the slot the report names
    module: str | None = None
    cls: str | None = None


def first_nonfinite(grid: Grid) -> FirstBad | None:
    """The first non-finite recorded value: the earliest step, the forward before the backward, then the phase's
    execution order."""
    bad = ~grid.hi.isfinite() & recorded(grid.hi)  # (2, n, R)
    if not bool(bad.any()):
        return None
    steps_bad = bad.any(dim=2).any(dim=0).nonzero().flatten()
    i = int(steps_bad[0])
    for p, phase in enumerate(PHASES):
        for r in grid.order[p]:
            if bool(bad[p, i, r]):
                v = float(grid.hi[p, i, r])
                row = grid.rows[r]
                return FirstBad(int(grid.steps[i]), phase, r, "nan" if v != v else "inf", "recording",
                                _PREFIX[phase] + row.suffix, row.module, row.cls)
    return None  # (not reached: a bad value is in some phase's order)


def first_bad(grid: Grid) -> FirstBad | None:
    """The report's first non-finite value (the monitor's own verdict) where there is one, else the recording's."""
    first = (grid.report or {}).get("first")
    if isinstance(first, dict) and first.get("phase") in PHASES and isinstance(first.get("step"), int):
        phase = first["phase"]
        slot = str(first.get("slot") or "")
        module, cls, suffix = str(first.get("module")), str(first.get("cls")), slot_suffix(phase, slot)
        same = [i for i, r in enumerate(grid.rows) if (r.module, r.cls) == (module, cls)]
        rows = [i for i in same if grid.rows[i].suffix == suffix] if slot.startswith(_PREFIX[phase]) else []
        at = (grid.steps == first["step"]).nonzero().flatten()
        p = PHASES.index(phase)
        # of a module's rows (one per dtype), the one non-finite at that step; a slot the recording does not keep
        # (a weight, an input, a parameter's gradient): the module's first row, if it has one
        bad = [i for i in rows if at.numel() and not bool(grid.hi[p, int(at[0]), i].isfinite())]
        row = (bad or rows or same or [None])[0]
        return FirstBad(first["step"], phase, row, str(first.get("value") or "non-finite"), "report", slot,
                        module, cls)
    report = grid.report or {}
    seen = first_nonfinite(grid)
    if seen is None and isinstance(report.get("step"), int):  # another rank went first: its step, no row here
        return FirstBad(report["step"], "fwd", None, "non-finite", "report")
    return seen


@dataclass
class Binned:
    """A grid's step axis in at most ``max_columns`` columns: ``starts[c]`` is the first step index of column ``c``
    (the next column's start ends it); ``hi`` / ``lo`` (2, C, R) are the folded values."""

    starts: list[int]
    first_step: list[int]  # per column: its first and last recorded step
    last_step: list[int]
    counts: list[int]  # per column: how many recorded steps it folds
    hi: torch.Tensor
    lo: torch.Tensor


def bin_steps(steps: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], max_columns: int,
              alone: list[int] = ()) -> list[Binned]:
    """The step axis of ``parts`` (each a (hi, lo) pair on ``steps``) downsampled to at most ``max_columns`` columns
    of consecutive steps, each column the fold of its steps (its extremes exact); each step index in ``alone`` (the
    first non-finite step, a first divergence) is a column of its own. Every part gets the same columns."""
    n = steps.shape[0]
    if n == 0:
        return [Binned([], [], [], [], hi[:, :0], lo[:, :0]) for hi, lo in parts]
    if n <= max_columns:
        starts = list(range(n))
    else:
        budget = max(1, max_columns - 2 * len(alone))
        edges = {round(i * n / budget) for i in range(budget)}
        edges |= {j for i in alone if 0 <= i < n for j in (i, i + 1) if j < n}
        starts = sorted(edges)
    column = torch.zeros(n, dtype=torch.int64)
    for c, s in enumerate(starts[1:], start=1):
        column[s:] = c
    ends = starts[1:] + [n]
    first_step = [int(steps[s]) for s in starts]
    last_step = [int(steps[e - 1]) for e in ends]
    out = []
    for hi, lo in parts:
        b_hi, b_lo = fold(column, hi, lo, len(starts), dim=1)
        out.append(Binned(starts, first_step, last_step, [e - s for s, e in zip(starts, ends)], b_hi, b_lo))
    return out

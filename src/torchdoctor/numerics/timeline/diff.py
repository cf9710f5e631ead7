"""Two recordings side by side: the first (step, phase, module, rank) where they part, what still agreed before it,
and how the difference grew after.

Alignment: by step number (the steps both recorded), by row -- (module, class, output slot), across dtypes, so an
fp32 run and a bf16 one line up -- and by phase; by rank when both runs have the same ranks, else each run's ranks
are folded into one (per step and row the largest abs max, the smallest abs min: :func:`.grid.fold_ranks`).

Two values agree when both are finite and ``|a - b| <= atol + rtol * max(|a|, |b|)`` (symmetric: which run is A
does not matter), or when both are the same non-finite (nan and nan, inf and inf). A value one run did not record
there is not compared. "First" is the earliest step, the forward before the backward, then the phase's execution
order (the order the module's value was first recorded), then the lowest rank.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .grid import PHASES, Grid, Row, aligned, fold_ranks, grid_of, recorded
from .store import RankTimeline

STATS = {"max": ("hi",), "min": ("lo",), "both": ("hi", "lo")}
_STAT_NAME = {"hi": "abs max", "lo": "abs min"}
UPSTREAM_SHOWN = 5
GROWTH_LINES = 10


class NothingToCompare(ValueError):
    """Two recordings with no step, or no row, in common (said in one line)."""


@dataclass
class Pair:
    """One rank of each run (or each run's ranks folded), on common axes: ``a`` / ``b`` map "hi" / "lo" to
    (2, n, R) tensors."""

    rank: int | str
    rows: list[Row]
    order: list[list[int]]  # per phase, rows in execution order (A's, then rows only B has)
    steps: torch.Tensor
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    dtypes_a: list[list[str]]
    dtypes_b: list[list[str]]


def differs(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Where two recorded values disagree (see the module docstring); False where either was not recorded."""
    both = recorded(x) & recorded(y)
    fx, fy = x.isfinite(), y.isfinite()
    far = (x - y).abs() > atol + rtol * torch.maximum(x.abs(), y.abs())
    kind = (fx != fy) | (x.isnan() != y.isnan())
    return both & ((fx & fy & far) | kind)


def pairs_of(run_a: list[RankTimeline], run_b: list[RankTimeline]) -> list[Pair]:
    ga = [grid_of(r, by_dtype=False) for r in run_a]
    gb = [grid_of(r, by_dtype=False) for r in run_b]
    if [g.rank for g in ga] != [g.rank for g in gb]:
        ga, gb = [fold_ranks(ga)], [fold_ranks(gb)]
    return [_pair(x, y) for x, y in zip(ga, gb)]


def _pair(ga: Grid, gb: Grid) -> Pair:
    common = torch.tensor(sorted(set(ga.steps.tolist()) & set(gb.steps.tolist())), dtype=torch.int64)
    rows, steps, ((a_hi, a_lo), (b_hi, b_lo)) = aligned([ga, gb], common)
    where = {r: i for i, r in enumerate(rows)}
    order: list[list[int]] = [[], []]
    for g in (ga, gb):
        for p in (0, 1):
            for r in g.order[p]:
                if where[g.rows[r]] not in order[p]:
                    order[p].append(where[g.rows[r]])

    def dtypes(g: Grid) -> list[list[str]]:
        out = [["", ""] for _ in rows]
        for r, row in enumerate(g.rows):
            out[where[row]] = list(g.dtypes[r])
        return out

    return Pair(ga.rank, rows, order, steps, {"hi": a_hi, "lo": a_lo}, {"hi": b_hi, "lo": b_lo}, dtypes(ga),
                dtypes(gb))


@dataclass
class Value:
    """One row's values in both runs at one step and phase."""

    row: Row
    phase: str
    stat: str  # "abs max" / "abs min"
    a: float
    b: float
    dtype_a: str
    dtype_b: str

    def ratio(self) -> str:
        return ratio_text(self.a, self.b)

    def to_json(self) -> dict[str, Any]:
        return {"module": self.row.module, "class": self.row.cls, "slot": _slot(self.phase, self.row),
                "phase": self.phase, "stat": self.stat, "a": _num(self.a), "b": _num(self.b),
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b}


@dataclass
class Growth:
    step: int
    differing: int
    compared: int
    worst: Value | None  # the largest |log10(B/A)| among finite pairs that step
    first: Value | None  # the first diverging row's values that step

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "differing": self.differing, "compared": self.compared,
                "worst": self.worst.to_json() if self.worst else None,
                "first": self.first.to_json() if self.first else None}


@dataclass
class Divergence:
    step: int
    rank: int | str
    value: Value
    other_ranks: list[int | str]  # other ranks diverging at the same step, phase and row
    upstream: list[Value]  # the nearest rows before it that step (execution order), all within tolerance
    upstream_agreed: int  # how many rows compared before it that step (they all agreed)
    growth: list[Growth]
    step_index: int = 0
    row_index: int = 0


@dataclass
class DiffResult:
    rtol: float
    atol: float
    stat: str
    ranks: tuple[int, int]  # world sizes seen (rank folders) in A and B
    folded: bool  # ranks folded into one (world sizes differ)
    steps: list[int]  # compared
    steps_only: tuple[int, int]  # steps only A / only B recorded
    rows: int
    rows_only: tuple[list[str], list[str]]
    first: Divergence | None
    largest: Value | None = None  # when they agree: the largest difference seen
    largest_step: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return self.first is None


def compare(run_a: list[RankTimeline], run_b: list[RankTimeline], rtol: float = 1e-3, atol: float = 0.0,
            stat: str = "max") -> tuple[DiffResult, list[Pair]]:
    """Compare two recordings (each a list of ranks, as :func:`.store.load_run` gives them)."""
    pairs = pairs_of(run_a, run_b)
    if all(p.steps.numel() == 0 for p in pairs):
        raise NothingToCompare(f"no step recorded in both runs (A: {_span(run_a)}; B: {_span(run_b)})")
    if all(not p.rows for p in pairs):
        raise NothingToCompare("neither run recorded any module output")
    stats = STATS[stat]
    best = None
    masks = []
    for n, pair in enumerate(pairs):
        dif = torch.zeros_like(pair.a["hi"], dtype=torch.bool)
        for s in stats:
            dif |= differs(pair.a[s], pair.b[s], rtol, atol)
        masks.append(dif)
        hit = _first(pair, dif)
        if hit is not None and (best is None or hit[:3] < best[0][:3]):
            best = (hit, n)
    a_steps = set().union(*(set(r.steps.tolist()) for r in run_a))
    b_steps = set().union(*(set(r.steps.tolist()) for r in run_b))
    shown = pairs[0]
    result = DiffResult(rtol, atol, stat, (len(run_a), len(run_b)), shown.rank == "all", shown.steps.tolist(),
                        (len(a_steps - b_steps), len(b_steps - a_steps)), len(shown.rows),
                        (recorded_by_one(shown, "b"), recorded_by_one(shown, "a")), None)
    if best is None:
        result.largest, result.largest_step = _largest(pairs, stats)
        return result, pairs
    (i, p, _pos, r), n = best
    pair = pairs[n]
    s = next(s for s in stats if bool(differs(pair.a[s][p, i, r], pair.b[s][p, i, r], rtol, atol)))
    others = []  # other ranks diverging at the same step, phase and row
    for m, q in enumerate(pairs):
        at = (q.steps == pair.steps[i]).nonzero().flatten()
        if m != n and pair.rows[r] in q.rows and at.numel() and bool(masks[m][p, int(at[0]),
                                                                              q.rows.index(pair.rows[r])]):
            others.append(q.rank)
    upstream, agreed = _upstream(pair, i, p, r, s)
    result.first = Divergence(int(pair.steps[i]), pair.rank, _value(pair, i, p, r, s), others, upstream, agreed,
                              _growth(pair, masks[n], i, p, r, s), i, r)
    return result, pairs


def recorded_by_one(pair: Pair, missing: str) -> list[str]:
    """Rows recorded by one run only: ``missing`` names the run that has none of their values."""
    side = pair.a if missing == "a" else pair.b
    other = pair.b if missing == "a" else pair.a
    return [row.label() for n, row in enumerate(pair.rows) if not _present(side, n) and _present(other, n)]


def _present(side: dict[str, torch.Tensor], row: int) -> bool:
    return bool(recorded(side["hi"][:, :, row]).any())


def _first(pair: Pair, dif: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(step index, phase, position in the phase's order, row) of the first disagreement."""
    at = dif.any(dim=2).any(dim=0).nonzero().flatten()
    if at.numel() == 0:
        return None
    i = int(at[0])
    for p in (0, 1):
        for pos, r in enumerate(pair.order[p]):
            if bool(dif[p, i, r]):
                return i, p, pos, r
    return None


def _value(pair: Pair, i: int, p: int, r: int, s: str) -> Value:
    return Value(pair.rows[r], PHASES[p], _STAT_NAME[s], float(pair.a[s][p, i, r]), float(pair.b[s][p, i, r]),
                 pair.dtypes_a[r][p], pair.dtypes_b[r][p])


def _upstream(pair: Pair, i: int, p: int, r: int, s: str) -> tuple[list[Value], int]:
    """The rows compared before (i, p, r) that step, in execution order: the forward's before a backward row."""
    before = [(0, q) for q in pair.order[0]] if p == 1 else []
    before += [(p, q) for q in pair.order[p][:pair.order[p].index(r)]]
    both = [(pp, q) for pp, q in before if bool(recorded(pair.a[s][pp, i, q]) & recorded(pair.b[s][pp, i, q]))]
    return [_value(pair, i, pp, q, s) for pp, q in both[-UPSTREAM_SHOWN:]][::-1], len(both)


def _growth(pair: Pair, dif: torch.Tensor, i0: int, p0: int, r0: int, s: str) -> list[Growth]:
    n = pair.steps.shape[0]
    picks = sorted({i for i in (i0, i0 + 1, i0 + 2, n - 1) if i0 <= i < n} | {
        min(n - 1, i0 + round((n - 1 - i0) * k / (GROWTH_LINES - 3))) for k in range(GROWTH_LINES - 3)})
    a, b = pair.a[s], pair.b[s]
    both = recorded(a) & recorded(b)
    finite = both & a.isfinite() & b.isfinite() & (a > 0) & (b > 0)
    out = []
    for i in picks:
        spread = torch.where(finite[:, i], (b[:, i].log10() - a[:, i].log10()).abs(), -1.0)
        worst = None
        if bool((spread > 0).any()):
            flat = int(spread.flatten().argmax())
            wp, wr = divmod(flat, spread.shape[1])
            worst = _value(pair, i, wp, wr, s)
        first = _value(pair, i, p0, r0, s) if bool(both[p0, i, r0]) else None
        out.append(Growth(int(pair.steps[i]), int(dif[:, i].sum()), int(both[:, i].sum()), worst, first))
    return out


def _largest(pairs: list[Pair], stats: tuple[str, ...]) -> tuple[Value | None, int | None]:
    best = (0.0, None, None)
    for pair in pairs:
        for s in stats:
            a, b = pair.a[s], pair.b[s]
            ok = recorded(a) & recorded(b) & a.isfinite() & b.isfinite() & (torch.maximum(a, b) > 0)
            rel = torch.where(ok, (a - b).abs() / torch.maximum(a, b).clamp(min=1e-45), -1.0)
            if rel.numel() and float(rel.max()) > best[0]:
                p, i, r = (int(x) for x in torch.unravel_index(rel.argmax(), rel.shape))
                best = (float(rel.max()), _value(pair, i, p, r, s), int(pair.steps[i]))
    return best[1], best[2]


def _span(run: list[RankTimeline]) -> str:
    steps = sorted(set().union(*(set(r.steps.tolist()) for r in run)))
    return f"steps {steps[0]}-{steps[-1]} ({len(steps)} recorded)" if steps else "no step recorded"


def _slot(phase: str, row: Row) -> str:
    return ("output" if phase == "fwd" else "grad_output") + row.suffix


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)


def ratio_text(a: float, b: float) -> str:
    if not (math.isfinite(a) or math.isfinite(b)):
        return "non-finite in both"
    if not math.isfinite(b):
        return "non-finite in B only"
    if not math.isfinite(a):
        return "non-finite in A only"
    if a == 0:
        return "B/A inf" if b else "B/A 1"
    return f"B/A {b / a:.6g}"


def fmt(v: float) -> str:
    """A float32 statistic, as few digits as tell it apart from its neighbours."""
    if not math.isfinite(v):
        return str(v)
    for digits in range(1, 10):
        text = f"{v:.{digits}g}"
        try:
            if struct.unpack("<f", struct.pack("<f", float(text)))[0] == v:
                return text
        except OverflowError:  # (rounded past float32's largest)
            continue
    return repr(v)

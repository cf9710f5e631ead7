"""What ``numerics diff`` says: the text for people, the JSON for machines, and the page (``-o``) that draws both runs
and their ratio."""

from __future__ import annotations

import bisect
from typing import Any

from ...findings import Finding
from .diff import DiffResult, Pair, Value, fmt
from .grid import Binned, bin_steps
from .html import MAX_COLUMNS, Marker, Panel, RankPage, columns_for, page

PHASE_WORDS = {"fwd": "forward", "bwd": "backward"}


def where(v: Value) -> str:
    slot = ("output" if v.phase == "fwd" else "grad_output") + v.row.suffix
    return f"{v.row.module or '(model)'} ({v.row.cls}) {slot}"


def both(v: Value) -> str:
    dtypes = v.dtype_a if v.dtype_a == v.dtype_b else f"{v.dtype_a or '-'} / {v.dtype_b or '-'}"
    return f"{v.stat} {fmt(v.a)} / {fmt(v.b)} ({v.ratio()}; {dtypes})"


def rank_words(rank: int | str) -> str:
    return "all ranks folded" if rank == "all" else f"rank {rank}"


def lines(r: DiffResult, name_a: str, name_b: str) -> list[str]:
    tol = f"rtol {r.rtol:g}" + (f", atol {r.atol:g}" if r.atol else "")
    stat = {"max": "abs max", "min": "abs min", "both": "abs max and abs min"}[r.stat]
    out = [f"torchdoctor numerics diff: A = {name_a} ({r.ranks[0]} rank(s)), B = {name_b} ({r.ranks[1]} rank(s))",
           f"compared: {stat} of {r.rows} module outputs, forward and backward, at {len(r.steps)} step(s) both "
           f"recorded ({_span(r.steps)}), within {tol}"]
    if r.folded:
        out.append(f"  the runs have different ranks ({r.ranks[0]} vs {r.ranks[1]}): each run's ranks folded into one "
                   "(per step and module, the largest abs max and smallest abs min over its ranks)")
    if any(r.steps_only):
        out.append(f"  not compared: {r.steps_only[0]} step(s) only A recorded, {r.steps_only[1]} only B")
    for side, rows in zip("AB", r.rows_only):
        if rows:
            out.append(f"  only {side} recorded {len(rows)} module output(s): " + ", ".join(rows[:5])
                       + (" ..." if len(rows) > 5 else ""))
    f = r.first
    if f is None:
        tail = (f"; the largest difference: {where(r.largest)}, {PHASE_WORDS[r.largest.phase]}, step "
                f"{r.largest_step}: {both(r.largest)}" if r.largest else "; every value identical")
        out.append(f"AGREE: every value compared is within {tol}{tail}")
        return out
    also = f" (also on {', '.join(rank_words(x) for x in f.other_ranks)})" if f.other_ranks else ""
    out.append(f"DIVERGED at step {f.step}, {PHASE_WORDS[f.value.phase]}, {where(f.value)}, {rank_words(f.rank)}"
               f"{also}: {both(f.value)}, beyond {tol}")
    if f.upstream_agreed:
        out.append(f"  upstream (earlier that step, in execution order): {f.upstream_agreed} module output(s) "
                   "compared, all within tolerance; the nearest:")
        out += [f"    {where(v)}, {PHASE_WORDS[v.phase]}: {both(v)}" for v in f.upstream]
    else:
        out.append("  upstream: nothing recorded before it that step (it is the first value compared)")
    out.append("  after it (module outputs beyond tolerance / compared, both phases; the widest B/A that step):")
    for g in f.growth:
        first = f"; here: {g.first.ratio()}" if g.first is not None and g.step != f.step else ""
        worst = f"; widest {where(g.worst)} {PHASE_WORDS[g.worst.phase]}: {g.worst.ratio()}" if g.worst else ""
        out.append(f"    step {g.step}: {g.differing}/{g.compared}{worst}{first}")
    return out


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def finding(r: DiffResult, name_a: str, name_b: str) -> Finding:
    text = lines(r, name_a, name_b)
    if r.first is None:
        return Finding("numerics.runs-agree", "ok", text[-1], evidence=text[1:-1], data=to_json(r))
    head = next(t for t in text if t.startswith("DIVERGED"))
    return Finding("numerics.runs-diverge", "fail", head, evidence=[t.strip() for t in text[1:] if t != head],
                   data=to_json(r))


def to_json(r: DiffResult) -> dict[str, Any]:
    f = r.first
    return {
        "verdict": "agree" if f is None else "diverge", "rtol": r.rtol, "atol": r.atol, "stat": r.stat,
        "ranks": list(r.ranks), "ranks_folded": r.folded, "steps_compared": len(r.steps),
        "first_step": r.steps[0] if r.steps else None, "last_step": r.steps[-1] if r.steps else None,
        "steps_only": list(r.steps_only), "rows": r.rows, "rows_only": [list(x) for x in r.rows_only],
        "first": None if f is None else {"step": f.step, "rank": f.rank, **f.value.to_json(),
                                         "other_ranks": f.other_ranks},
        "upstream": [] if f is None else [v.to_json() for v in f.upstream],
        "upstream_agreed": 0 if f is None else f.upstream_agreed,
        "growth": [] if f is None else [g.to_json() for g in f.growth],
        "largest": r.largest.to_json() if r.largest is not None else None, "largest_step": r.largest_step,
    }


def build_page(r: DiffResult, pairs: list[Pair], name_a: str, name_b: str, text: list[str],
               max_columns: int = MAX_COLUMNS) -> str:
    """Both runs and their ratio, per rank (or the folded ranks), the first divergence marked."""
    columns = columns_for(sum(len(p.rows) for p in pairs), 2, max_columns)
    ranks = []
    for p in pairs:
        first = r.first if r.first is not None and r.first.rank == p.rank else None
        alone = [first.step_index] if first is not None else []
        a, b = bin_steps(p.steps, [(p.a["hi"], p.a["lo"]), (p.b["hi"], p.b["lo"])], columns, alone)
        marker = None
        if first is not None:
            col = _column(a, first.step_index)
            marker = Marker(first.step, 0 if first.value.phase == "fwd" else 1, col, first.row_index,
                            f"first divergence: step {first.step}, {PHASE_WORDS[first.value.phase]}, "
                            f"{where(first.value)}: {both(first.value)}", first.value.row.module)
        facts = [f"{len(p.rows)} module outputs x {p.steps.shape[0]} steps recorded in both"]
        if len(a.starts) < p.steps.shape[0]:
            facts.append(f"drawn as {len(a.starts)} columns of up to {max(a.counts)} steps: each column holds its "
                         "steps' largest abs max (the ratio is of those)")
        ranks.append(RankPage(rank_words(p.rank), p.rows, [p.dtypes_a, p.dtypes_b], [a, b], marker,
                              "\n".join(text), facts))
    groups = [(f"{PHASE_WORDS[ph]}", [Panel(f"A ({PHASE_WORDS[ph]}): abs max", n, "values", 0),
                                      Panel(f"B ({PHASE_WORDS[ph]}): abs max", n, "values", 1),
                                      Panel(f"B / A ({PHASE_WORDS[ph]})", n, "ratio")])
              for n, ph in enumerate(("fwd", "bwd"))]
    if r.first is not None and r.first.value.phase == "bwd":
        groups.reverse()  # (the phase where they part shows first)
    return page(f"torchdoctor numerics diff: {name_a} vs {name_b}", f"A = {name_a}, B = {name_b}. Hover a cell for "
                "both runs' exact values.", ranks, groups, ["A", "B"], "What diff found")


def _column(binned: Binned, index: int) -> int:
    return bisect.bisect_right(binned.starts, index) - 1

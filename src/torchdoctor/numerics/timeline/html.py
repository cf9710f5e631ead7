"""One self-contained HTML page of heatmaps: everything inline (script, style, data), nothing fetched when it is viewed.

The data go in as base64 blocks of float32 (abs max then abs min, laid out phase x row x column: see
:mod:`.page_js`), one per source (a run; two for a diff), and a JSON description (``td-meta``): per rank its rows,
their dtypes, the steps of each column, the marker, the text report; the panel groups; the colour modes. A page of
500 modules x 10,000 steps is about 12 MB at the default 1,200 columns (:data:`CELL_BUDGET`).
"""

from __future__ import annotations

import base64
import html
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .grid import PHASES, Binned, Row
from .page_js import SCRIPT, STYLE
from .store import tensor_bytes

#: values (abs max + abs min, both phases, every row and column, all ranks and sources) one page holds at most:
#: 3.2M float32 = 12.8 MB raw, 17 MB as base64
CELL_BUDGET = 3_200_000
MAX_COLUMNS = 1200
MIN_COLUMNS = 100
#: the page may fetch nothing: inline script and style only (a browser refuses any request the page would make)
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"
MODE_NAMES = {"headroom": "colour: headroom to the dtype's max", "log": "colour: log10 abs max (this rank's range)"}


def dtype_log10_max() -> dict[str, float]:
    """log10 of each floating dtype's largest finite value, by the name the recording uses (torch's own table)."""
    out = {}
    for name in dir(torch):
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype) and dt.is_floating_point and not dt.is_complex:
            try:
                out[str(dt).removeprefix("torch.")] = math.log10(torch.finfo(dt).max)
            except (TypeError, ValueError, RuntimeError):  # (packed types: torch has no max for them)
                continue
    return out


def columns_for(rows: int, sources: int, max_columns: int = MAX_COLUMNS) -> int:
    """How many step columns a page with ``rows`` rows in all (summed over ranks) and ``sources`` runs can hold."""
    per_column = max(1, rows * sources * 2 * 2)  # (abs max, abs min) x (forward, backward)
    return max(min(MIN_COLUMNS, max_columns), min(max_columns, CELL_BUDGET // per_column))


def encode(binned: Binned) -> str:
    """hi then lo, each (phase, row, column), as base64 of little-endian float32."""
    data = torch.cat([binned.hi.permute(0, 2, 1).flatten(), binned.lo.permute(0, 2, 1).flatten()]).float()
    if sys.byteorder != "little":  # (the page reads little-endian float32)
        raise RuntimeError("a big-endian host: the page's data would be read back wrong")
    return base64.b64encode(tensor_bytes(data)).decode("ascii")


@dataclass
class Marker:
    step: int
    phase: int  # 0 forward, 1 backward
    col: int | None  # None: the step has no column (not recorded)
    row: int | None  # None: the value named has no row (a weight, a parameter gradient, another rank's)
    text: str
    module: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "col": self.col, "row": self.row, "text": self.text,
                "module": self.module}


@dataclass
class RankPage:
    """One entry of the rank selector."""

    name: str
    rows: list[Row]
    dtypes: list[list[list[str]]]  # per source, per row, per phase
    sources: list[Binned]
    marker: Marker | None = None
    report: str = ""
    facts: list[str] = field(default_factory=list)


@dataclass
class Panel:
    title: str
    phase: int
    kind: str = "values"  # "values" (one run's abs max) or "ratio" (B/A of sources 0 and 1)
    source: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "phase": self.phase, "kind": self.kind, "source": self.source}


def page(title: str, subtitle: str, ranks: list[RankPage], groups: list[tuple[str, list[Panel]]],
         source_names: list[str], text_title: str) -> str:
    """The whole page as one string."""
    blocks = []
    meta_ranks = []
    for n, rank in enumerate(ranks):
        ids = []
        for s, binned in enumerate(rank.sources):
            ids.append(f"td-data-{n}-{s}")
            blocks.append(f'<script type="text/plain" id="{ids[-1]}">\n{encode(binned)}\n</script>')
        first = rank.sources[0]
        meta_ranks.append({
            "name": rank.name, "rows": [[r.module, r.cls, r.suffix] for r in rank.rows], "dtypes": rank.dtypes,
            "first": first.first_step, "last": first.last_step,
            "count": first.counts,
            "sources": ids, "marker": rank.marker.to_json() if rank.marker else None, "report": rank.report,
            "facts": rank.facts})
    meta = {"ranks": meta_ranks, "groups": [{"name": g, "panels": [p.to_json() for p in panels]}
                                            for g, panels in groups],
            "modes": ["headroom", "log"], "mode_names": MODE_NAMES, "source_names": source_names,
            "dtype_log10_max": dtype_log10_max(), "phases": list(PHASES)}
    meta_json = json.dumps(meta, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<div class="sub">{html.escape(subtitle)}</div>
<div class="controls"><label>rank <select id="td-rank"></select></label>
<select id="td-group"></select><select id="td-mode"></select></div>
<div id="td-marker"></div>
<div id="td-panels"></div>
<div id="td-tip"></div>
<h2>{html.escape(text_title)}</h2>
<pre id="td-report"></pre>
<h2>The recording</h2>
<pre id="td-facts"></pre>
<pre id="td-state" hidden></pre>
<script type="application/json" id="td-meta">{meta_json}</script>
{chr(10).join(blocks)}
<script>{SCRIPT}</script>
</body></html>
"""


"""Where the ranks of a hung job parted: from every rank's Flight Recorder records (:mod:`.dumps`).

Per process group, each rank's collectives carry a sequence id that every rank counts alike. The ranks part at the
first sequence id some rank never entered: those ranks are *missing* (with the last collective they entered and
completed, and the Python stack they were at when they dumped); the others entered it and wait (with the stack of
their call, when the dump kept stacks). Before that point, every sequence id all ranks entered is compared across
ranks as Flight Recorder's analyzer does: the op (``COLLECTIVE_TYPE_MISMATCH``), the sizes
(``SIZE_OR_SYNTAX_MISMATCH``) and the dtypes (``COLLECTIVE_DTYPE_MISMATCH``); for ``all_to_all`` the sizes differ per
rank by design, so the elements all ranks send are compared with those all ranks receive -- decided where the
records have both, where Flight Recorder's own analyzer leaves it undecided. Point-to-point ops (``is_p2p``) are not
sequenced with the collectives and are left out.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any

from .dumps import Dumps, RankDump, frames_of

Frames = list[tuple[str, int, str]]
_ALL_TO_ALL = ("all_to_all", "alltoall", "alltoall_base", "all_to_all_single")


@dataclass
class Call:
    seq: int
    op: str  # "all_reduce" (Flight Recorder's profiling name without the backend)
    backend: str
    in_sizes: list
    in_dtypes: list
    out_sizes: list
    out_dtypes: list
    state: str
    frames: Frames

    def shape(self) -> str:
        return f"{self.op} {self.in_sizes} {'/'.join(self.in_dtypes) or '?'}" if self.in_sizes else self.op


@dataclass
class Parting:
    """One process group's verdict."""

    group: str  # its name and description
    ranks: list[int]  # the group's ranks (from its config), or the ranks with records
    seq: int | None  # the collective where the ranks part (None: none parted)
    call: Call | None  # that collective, as a waiting rank recorded it
    missing: list[int]  # ranks that never entered it
    last_entered: dict[int, int | None]  # per missing rank
    last_completed: dict[int, int | None]  # per rank, when the records say
    waiting: list[int]
    waiting_frames: Frames  # where a waiting rank called it
    missing_stacks: dict[int, Frames]  # where each missing rank was when it dumped
    no_dump: list[int]  # ranks of the group with no dump at all
    mismatch: tuple[str, int, dict[int, str]] | None = None  # (Flight Recorder's state, sequence id, rank -> call)
    all_completed: bool = False  # every rank's records say the last collective completed
    notes: list[str] = field(default_factory=list)


def _ranks_of(config: Any) -> list[int] | None:
    raw = config.get("ranks") if isinstance(config, dict) else None
    try:
        ranks = ast.literal_eval(raw) if isinstance(raw, str) else raw
        return [int(r) for r in ranks] if isinstance(ranks, (list, tuple)) and ranks else None  # ([]: gloo's)
    except (ValueError, SyntaxError, TypeError):
        return None


def _calls(dump: RankDump) -> dict[str, dict[int, Call]]:
    """The rank's collectives by process group name, then sequence id."""
    out: dict[str, dict[int, Call]] = {}
    for e in dump.fr.get("entries") or ():
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq = e.get("collective_seq_id")
        if not isinstance(seq, int) or seq <= 0:
            continue
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
        backend, _, op = str(e.get("profiling_name") or "?").rpartition(":")
        out.setdefault(name, {})[seq] = Call(
            seq, op, backend, list(e.get("input_sizes") or []), [str(d) for d in e.get("input_dtypes") or []],
            list(e.get("output_sizes") or []), [str(d) for d in e.get("output_dtypes") or []],
            str(e.get("state") or "?"), frames_of(e.get("frames"), innermost_first=True))
    return out


def _group_desc(dumps: Dumps, name: str) -> tuple[str, list[int] | None]:
    for d in dumps.ranks.values():
        for key, cfg in (d.fr.get("pg_config") or {}).items():
            if str(key) == name or (isinstance(cfg, dict) and str(cfg.get("name")) == name):
                desc = cfg.get("desc") if isinstance(cfg, dict) else None
                return (f"{name} ({desc})" if desc else name), _ranks_of(cfg)
        for e in d.fr.get("entries") or ():
            pg = e.get("process_group") if isinstance(e, dict) else None
            if isinstance(pg, (list, tuple)) and len(pg) > 1 and str(pg[0]) == name:
                return f"{name} ({pg[1]})", None
    return name, None


def _completed(dump: RankDump, name: str, calls: dict[int, Call]) -> int | None:
    """The last collective the rank completed -- as far as it can be trusted: gloo counts a collective that ended in an
    error (a timeout, a lost peer) as completed, so a rank whose dump comes from an exception has completed only what
    came before the collective it last entered."""
    status = (dump.fr.get("pg_status") or {}).get(name)
    value = None
    if isinstance(status, dict) and isinstance(status.get("last_completed_collective"), int):
        value = status["last_completed_collective"] if status["last_completed_collective"] >= 0 else None
    else:
        done = [s for s, c in calls.items() if c.state == "completed"]
        value = max(done) if done else None
    entered = max(calls) if calls else 0
    if value is not None and value >= entered and (dump.reason or "").startswith("exception"):
        value = entered - 1 if entered > 1 else None
    return value


def _numel(sizes: list) -> int:
    total = 0
    for s in sizes:
        if isinstance(s, (list, tuple)):
            total += math.prod(int(x) for x in s) if s else 1
    return total


def _mismatch(by_rank: dict[int, dict[int, Call]], upto: int) -> tuple[str, int, dict[int, str]] | None:
    """The first sequence id up to ``upto`` where the ranks' calls disagree, Flight Recorder's way."""
    for seq in range(1, upto + 1):
        calls = {r: c[seq] for r, c in by_rank.items() if seq in c}
        if len(calls) < 2:
            continue
        ops = {c.op for c in calls.values()}
        shown = {r: c.shape() for r, c in calls.items()}
        if len(ops) > 1:
            return "COLLECTIVE_TYPE_MISMATCH", seq, shown
        if {tuple(c.in_dtypes) for c in calls.values()} != {tuple(next(iter(calls.values())).in_dtypes)}:
            return "COLLECTIVE_DTYPE_MISMATCH", seq, shown
        op = next(iter(ops))
        if op in _ALL_TO_ALL:
            sent = sum(_numel(c.in_sizes) for c in calls.values())
            received = sum(_numel(c.out_sizes) for c in calls.values())
            if sent and received and sent != received:
                return "SIZE_OR_SYNTAX_MISMATCH", seq, {r: f"{c.shape()} -> {c.out_sizes}" for r, c in calls.items()}
            continue
        if len({repr(c.in_sizes) for c in calls.values()}) > 1:
            return "SIZE_OR_SYNTAX_MISMATCH", seq, shown
    return None


def analyze(dumps: Dumps) -> list[Parting]:
    """One :class:`Parting` per process group that has records, the groups where ranks parted first."""
    per_rank = {r: _calls(d) for r, d in dumps.ranks.items()}
    names = sorted({n for calls in per_rank.values() for n in calls}, key=lambda n: (len(n), n))
    out = []
    for name in names:
        desc, members = _group_desc(dumps, name)
        if members is None and dumps.world_size and (name == "0" or "default_pg" in desc):
            members = list(range(dumps.world_size))  # the default group holds every rank of the job
        by_rank = {r: calls.get(name, {}) for r, calls in per_rank.items() if members is None or r in members}
        ranks = members or sorted(by_rank)
        no_dump = [r for r in ranks if r not in dumps.ranks]
        entered = {r: (max(c) if c else 0) for r, c in by_rank.items()}
        completed = {r: _completed(dumps.ranks[r], name, c) for r, c in by_rank.items()}
        top = max(entered.values(), default=0)
        behind = [r for r, last in entered.items() if last < top]
        parting = Parting(desc, ranks, None, None, [], {}, completed, [], [], {}, no_dump)
        if behind:
            seq = min(entered[r] for r in behind) + 1
            parting.seq = seq
            parting.missing = sorted(r for r, last in entered.items() if last < seq)
            parting.waiting = sorted(r for r, last in entered.items() if last >= seq)
            parting.last_entered = {r: entered[r] or None for r in parting.missing}
            first_waiting = parting.waiting[0]
            parting.call = by_rank[first_waiting].get(seq)
            parting.waiting_frames = parting.call.frames if parting.call else []
            if not parting.waiting_frames:
                parting.waiting_frames = dumps.ranks[first_waiting].stack
        elif top:
            done = all(completed.get(r) == top for r in by_rank)  # every rank that dumped completed the last one
            parting.all_completed = done and not no_dump
            if not done:
                parting.seq = top
                parting.call = next((c[top] for c in by_rank.values() if top in c), None)
                parting.waiting = sorted(r for r in by_rank if completed.get(r) != top)
                parting.waiting_frames = (parting.call.frames if parting.call else []) or \
                    (dumps.ranks[parting.waiting[0]].stack if parting.waiting else [])
                parting.missing = list(no_dump)  # (every rank with records entered it: a rank without one is suspect)
        parting.missing_stacks = {r: dumps.ranks[r].stack for r in parting.missing if r in dumps.ranks}
        common = min(entered.values(), default=0)
        parting.mismatch = _mismatch(by_rank, common)
        out.append(parting)
    return sorted(out, key=lambda p: (p.seq is None and p.mismatch is None, p.group))

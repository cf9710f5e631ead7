"""Ranks that asked ``init_process_group`` for different jobs: another world size, another address or port, another
backend, a rank twice -- read from each process's own record of the call (written before the call, so a rank stuck in
it is known), against what the other ranks and the launcher's environment say."""

from __future__ import annotations

import collections
import urllib.parse
from dataclasses import dataclass
from typing import Any

from .facts import RankFacts, frames, site_text, user_site

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


@dataclass
class Asked:
    """What one process asked for, and where each value came from."""

    proc: RankFacts
    rank: int | None
    rank_from: str
    world: int | None
    world_from: str
    address: str | None  # host:port, a file, or None (a store object)
    address_from: str
    backend: str | None


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def asked(proc: RankFacts) -> Asked | None:
    init = proc.init
    if not init:
        return None
    env = init.get("env") or {}
    rank, rank_from = init.get("rank"), "rank="
    if not isinstance(rank, int) or rank < 0:
        rank, rank_from = _int(env.get("RANK")), "RANK="
    world, world_from = init.get("world_size"), "world_size="
    if not isinstance(world, int) or world < 1:
        world, world_from = _int(env.get("WORLD_SIZE")), "WORLD_SIZE="
    address, address_from = None, ""
    method = init.get("init_method")
    if init.get("store"):
        address_from = "store="
    elif method and not str(method).startswith("env://"):
        u = urllib.parse.urlparse(str(method))
        if u.scheme == "tcp" and u.port:
            address, address_from = f"{_host(u.hostname)}:{u.port}", "init_method="
        elif u.scheme == "file":
            address, address_from = u.path, "init_method="
    elif env.get("MASTER_PORT"):
        address, address_from = f"{_host(env.get('MASTER_ADDR'))}:{env['MASTER_PORT']}", "MASTER_ADDR:MASTER_PORT="
    return Asked(proc, rank, rank_from, world, world_from, address, address_from,
                 None if init.get("backend") is None else str(init.get("backend")).lower())


def _host(name: Any) -> str:
    name = str(name or "?")
    return "localhost" if name in _LOOPBACK else name


def _odd(values: dict[int, Any], expected: Any) -> list[int]:
    return [i for i, v in values.items() if v is not None and v != expected]


def _expected(values: list[Any], env_value: Any = None) -> Any:
    """The value most processes asked for (on a tie, the launcher's own)."""
    counts = collections.Counter(v for v in values if v is not None)
    if not counts:
        return None
    top = max(counts.values())
    best = [v for v, n in counts.items() if n == top]
    return env_value if env_value in best else best[0]


def check(procs: list[RankFacts]) -> dict | None:
    """The first disagreement among the processes' ``init_process_group`` calls: ``{"what", "culprits" (processes),
    "expected", "got" (per culprit), "sentence"}``, or None."""
    rows = [a for a in (asked(p) for p in procs) if a is not None]
    if len(rows) < 2 and not any(a.world and a.rank is not None and a.rank >= a.world for a in rows):
        return None
    env_world = _expected([_int((a.proc.init.get("env") or {}).get("WORLD_SIZE")) for a in rows])
    by = dict(enumerate(rows))
    world = _expected([a.world for a in rows], env_world)
    odd = _odd({i: a.world for i, a in by.items()}, world)
    if odd:
        return _result("world size", [by[i] for i in odd], world, {i: by[i].world for i in odd}, by,
                       lambda a: f"{a.world_from}{a.world}")
    env_addr = _expected([asked_env_address(a) for a in rows])
    address = _expected([a.address for a in rows], env_addr)
    odd = _odd({i: a.address for i, a in by.items()}, address)
    if odd:
        return _result("address", [by[i] for i in odd], address, {i: by[i].address for i in odd}, by,
                       lambda a: f"{a.address_from}{a.address}")
    backend = _expected([a.backend for a in rows])
    odd = _odd({i: a.backend for i, a in by.items()}, backend)
    if odd:
        return _result("backend", [by[i] for i in odd], backend, {i: by[i].backend for i in odd}, by,
                       lambda a: f"backend {a.backend}")
    seen: dict[int, list[Asked]] = collections.defaultdict(list)
    for a in rows:
        if a.rank is not None:
            seen[a.rank].append(a)
    for rank, twins in sorted(seen.items()):
        if len(twins) > 1:
            env_rank = [a for a in twins if a.rank_from == "rank=" and _int((a.proc.init.get("env") or {})
                                                                           .get("RANK")) not in (None, rank)]
            culprits = env_rank or twins
            return _result("rank", culprits, None, {i: rank for i, a in by.items() if a in culprits}, by,
                           lambda a: f"{a.rank_from}{a.rank}", duplicate=rank)
    for a in rows:
        if a.world and a.rank is not None and not 0 <= a.rank < a.world:
            return _result("rank", [a], f"0..{a.world - 1}", {0: a.rank}, {0: a}, lambda a: f"{a.rank_from}{a.rank}")
    return None


def asked_env_address(a: Asked) -> str | None:
    env = a.proc.init.get("env") or {}
    return f"{_host(env.get('MASTER_ADDR'))}:{env['MASTER_PORT']}" if env.get("MASTER_PORT") else None


def _result(what: str, culprits: list[Asked], expected: Any, got: dict, by: dict, show: Any,
            duplicate: int | None = None) -> dict:
    others = [a for a in by.values() if a not in culprits]

    def who(a: Asked) -> str:
        return f"rank {a.rank if a.rank is not None else '?'} (pid {a.proc.pid})"

    if duplicate is not None:
        sentence = (f"{len(culprits)} processes asked for rank {duplicate}: "
                    + "; ".join(f"pid {a.proc.pid} ({show(a)}, its launcher's RANK="
                                f"{(a.proc.init.get('env') or {}).get('RANK', '?')})" for a in culprits))
    else:
        sentence = ("; ".join(f"{who(a)} asked for {show(a)}" for a in culprits)
                    + (f", where {', '.join(who(a) for a in others)} asked for {show(others[0])}" if others else "")
                    + (f" (the job's {what}: {expected})" if expected is not None else ""))
    return {"what": what, "culprits": [a.proc for a in culprits], "expected": expected, "got": got,
            "sentence": sentence, "sites": {a.proc.pid: site_text(user_site(frames((a.proc.init or {})
                                                                               .get("stack")))) for a in culprits}}

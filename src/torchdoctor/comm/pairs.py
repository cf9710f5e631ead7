"""``torchdoctor comm --pairs``: point-to-point bandwidth of every pair of ranks, both directions.

nccl-tests gives one bus bandwidth for the whole ring; a slow link hides in it. Here every pair is measured on its
own, and all pairs of a round at once: the rounds of a round-robin tournament (:func:`schedule`, the circle method)
pair every rank with every other exactly once in N-1 rounds (N rounds for an odd N, one rank resting each round),
each rank in one pair per round, so 64 ranks take 63 rounds, not 2016 pair runs. In a pair the lower rank sends
first: ``warmup`` sends, then ``iters`` timed ones, the receiver timing from its first timed receive to its last
(the sender sends back to back, so that is the link's throughput); then the other direction. Each rank keeps what it
received; one gather at the end (:func:`~.checks.all_gather_json`) puts the matrix on every rank.

Links are classed by kind (:func:`link_class`): the same host or another host; on GPUs of one host, NVLink or PCIe as
NVML reports it (``pynvml``, when installed), else whether torch says the two devices reach each other directly. A
link far below the median of its class (less than ``SLOW_FRACTION`` of it) is named with both hosts and devices;
when every link of one rank is slow, that rank is named instead.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

SLOW_FRACTION = 0.5  # a link below this share of its class's median is slow
MIN_PAIR_BYTES = 64 << 10  # below this a message measures latency, and the per-link figures are noise
MAX_PAIR_BYTES = 1 << 30  # a rank holds one such buffer; beyond 1 GiB a link shows nothing more
#: Test builds only: "RANK:SECONDS" makes that rank wait SECONDS before each of its sends and receives in --pairs,
#: a link made slow at a known place (no CPU limit on a shared machine is that reliable).
TEST_SLOW_ENV = "TORCHDOCTOR_COMM_TEST_SLOW"


def schedule(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method): N-1 rounds, N when N is odd."""
    ranks: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(ranks)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = ranks[i], ranks[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


@dataclass(frozen=True)
class Link:
    src: int
    dst: int
    gbps: float  # GB/s (1e9 bytes)
    seconds: float  # per message
    kind: str  # "same host", "other host", "NVLink", "PCIe", ...
    src_host: str
    dst_host: str
    src_device: str
    dst_device: str

    def to_json(self) -> dict:
        return asdict(self)


def _slow_delay(rank: int) -> float:
    spec = os.environ.get(TEST_SLOW_ENV)
    if not spec:
        return 0.0
    who, _, seconds = spec.partition(":")
    return float(seconds or 0) if who.strip() == str(rank) else 0.0


def measure(torch, dist, device, rank: int, n: int, nbytes: int, iters: int, warmup: int,
            on_round: Callable[[int, int, str], None], on_iter: Callable[[], None]) -> dict[tuple[int, int], float]:
    """This rank's part: every round's pair, both directions. Returns {(src, dst): seconds per message} for the
    messages it received."""
    elements = max(1, nbytes // 4)
    buf = torch.ones(elements, dtype=torch.float32, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    delay = _slow_delay(rank)
    got: dict[tuple[int, int], float] = {}
    rounds = schedule(n)
    for k, pairs in enumerate(rounds):
        mine = next((p for p in pairs if rank in p), None)
        on_round(k, len(rounds), f"{mine[0]}<->{mine[1]}" if mine else "resting")
        if mine is None:
            continue
        for src, dst in (mine, mine[::-1]):
            if rank == src:
                for _ in range(warmup + iters):
                    if delay:
                        time.sleep(delay)
                    dist.send(buf, dst)
                    on_iter()
                sync()
            else:
                for _ in range(warmup):
                    dist.recv(buf, src)
                    on_iter()
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    if delay:
                        time.sleep(delay)
                    dist.recv(buf, src)
                    on_iter()
                sync()
                got[(src, dst)] = (time.perf_counter() - t0) / iters
    return got


def link_class(a: dict, b: dict) -> str:
    """The kind of link between two ranks, from their identities (host, device)."""
    if a.get("host") != b.get("host"):
        return "other host"
    da, db = str(a.get("device") or "cpu"), str(b.get("device") or "cpu")
    if not (da.startswith("cuda") and db.startswith("cuda")):
        return "same host"
    return _gpu_link(da, db)


def _gpu_link(da: str, db: str) -> str:
    ia, ib = (int(d.split(":")[1]) if ":" in d else 0 for d in (da, db))
    if ia == ib:
        return "same GPU"
    try:
        import pynvml

        pynvml.nvmlInit()
        ha, hb = pynvml.nvmlDeviceGetHandleByIndex(ia), pynvml.nvmlDeviceGetHandleByIndex(ib)
        nvlink = pynvml.nvmlDeviceGetP2PStatus(ha, hb, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
        return "NVLink" if nvlink == pynvml.NVML_P2P_STATUS_OK else "PCIe"
    except Exception:  # no pynvml, or NVML refuses: what torch knows
        try:
            import torch

            return "GPU peer-to-peer" if torch.cuda.can_device_access_peer(ia, ib) else "GPU through the host"
        except Exception:
            return "same host"


def links(measured: dict[tuple[int, int], float], nbytes: int, idents: dict[int, dict]) -> list[Link]:
    out = []
    for (src, dst), seconds in sorted(measured.items()):
        a, b = idents.get(src) or {}, idents.get(dst) or {}
        out.append(Link(src, dst, nbytes / seconds / 1e9 if seconds > 0 else float("inf"), seconds,
                        link_class(a, b), str(a.get("host", "?")), str(b.get("host", "?")),
                        str(a.get("device", "?")), str(b.get("device", "?"))))
    return out


def slow_links(all_links: list[Link]) -> tuple[list[Link], dict[str, float], list[int]]:
    """(links below SLOW_FRACTION of their class's median, each class's median, ranks all of whose links are slow)."""
    medians = {kind: statistics.median(x.gbps for x in all_links if x.kind == kind)
               for kind in {x.kind for x in all_links}}
    slow = [x for x in all_links if x.gbps < SLOW_FRACTION * medians[x.kind]]
    ranks = sorted({x.src for x in all_links} | {x.dst for x in all_links})
    whole = [r for r in ranks if (mine := [x for x in all_links if r in (x.src, x.dst)]) and
             all(x in slow for x in mine)]
    return slow, medians, whole


def render(all_links: list[Link], n: int, nbytes: int, iters: int) -> str:
    from .sizes import format_bytes

    gb = {(x.src, x.dst): x.gbps for x in all_links}
    width = max(9, len(str(n - 1)) + 1)  # "1.23e-05" and a space: columns never run together

    def cell(s: int, d: int) -> str:
        text = "-" if s == d else f"{gb.get((s, d), float('nan')):.3g}"
        return " " + text.rjust(width - 1)

    lines = [f"point-to-point GB/s, {format_bytes(nbytes)} messages x {iters}, row sends to column:",
             "src\\dst " + "".join(" " + str(d).rjust(width - 1) for d in range(n))]
    for s in range(n):
        lines.append(f"{s:>7} " + "".join(cell(s, d) for d in range(n)))
    kinds = sorted({x.kind for x in all_links})
    lines.append("classes: " + "; ".join(
        f"{k}: median {statistics.median(x.gbps for x in all_links if x.kind == k):.3g} GB/s "
        f"({sum(x.kind == k for x in all_links)} links)" for k in kinds))
    return "\n".join(lines)


def findings(all_links: list[Link]) -> list[Any]:
    from ..findings import Finding

    if not all_links:
        return []
    slow, medians, whole = slow_links(all_links)
    if not slow:
        return [Finding("comm.links-even", "ok", f"all {len(all_links)} point-to-point links within "
                        f"{1 / SLOW_FRACTION:g}x of their class's median",
                        [f"{k}: median {v:.3g} GB/s" for k, v in sorted(medians.items())],
                        data={"medians": medians})]
    out = []
    for r in whole:
        mine = [x for x in slow if r in (x.src, x.dst)]
        x = mine[0]
        host, device = (x.src_host, x.src_device) if x.src == r else (x.dst_host, x.dst_device)
        out.append(Finding(
            "comm.slow-rank", "warn",
            f"every link of rank {r} (host {host}, {device}) is slow: {len(mine)} links at "
            f"{min(y.gbps for y in mine):.3g}-{max(y.gbps for y in mine):.3g} GB/s against a median of "
            f"{medians[x.kind]:.3g} GB/s",
            [f"{y.src}->{y.dst}: {y.gbps:.3g} GB/s ({y.kind})" for y in mine[:8]],
            ["the rank itself: its device, its NIC or PCIe slot, a throttled or shared CPU (top, nvidia-smi -q), "
             "or another job on it"], {"rank": r, "links": [y.to_json() for y in mine]}))
    rest = [x for x in slow if x.src not in whole and x.dst not in whole]
    if rest:
        out.append(Finding(
            "comm.slow-link", "warn",
            f"{len(rest)} link(s) below {SLOW_FRACTION:.0%} of their class's median: "
            + "; ".join(f"{x.src}->{x.dst} ({x.src_host} {x.src_device} -> {x.dst_host} {x.dst_device}) "
                        f"{x.gbps:.3g} GB/s" for x in rest[:3]),
            [f"{x.src}->{x.dst}: {x.gbps:.3g} GB/s, {x.kind} median {medians[x.kind]:.3g}" for x in rest[:12]],
            ["check those hosts' cabling, NIC and switch port (ibstat, ethtool, the switch's error counters), or "
             "the PCIe / NVLink topology of those GPUs (nvidia-smi topo -m)"],
            {"links": [x.to_json() for x in rest], "medians": medians}))
    return out

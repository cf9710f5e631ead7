"""A job that ran, but every rank kept waiting for one: from when each rank entered each collective.

Each rank's Flight Recorder entries carry the time the rank called the collective (``time_created_ns``, the system
clock). For every collective all ranks entered, the last rank to arrive made the others wait: the gap between it and
the rank before it is time no other rank could use. Summed per rank over the job, one rank that holds most of that
waiting, and enough of it to matter against the job's own length, is the slow rank. Where it spent that time comes from
its heartbeat's samples of its main thread taken outside collectives.

A rank is slow when (all three): it caused at least half of all the waiting, the others waited for it at least
:data:`MIN_SHARE` of the time the collectives spanned, and at least :data:`MIN_WAITED_S` in all (less is within the
noise of process scheduling on a busy host, and no fix would be felt). Fewer than :data:`MIN_COLLECTIVES` shared
collectives: no call. Its lag is given where it was large: the gaps of at least half its largest one (a step's wait for
its data loader shows as one such gap per step).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SHARE = 0.2  # the others waited for the rank at least a fifth of the job
MIN_COLLECTIVES = 4
MIN_WAITED_S = 1.0


@dataclass
class Slow:
    rank: int
    waited_s: float  # the others' waiting it caused
    span_s: float  # from the first to the last collective entered
    last_at: int  # collectives it arrived last at, by a gap
    collectives: int  # collectives all ranks entered
    mean_lag_s: float  # per collective it held up
    share: float  # its part of all the waiting
    hosts_differ: bool
    big_lag_s: float = 0.0  # the mean of its large gaps (at least half its largest)
    big_at: int = 0  # how many collectives it held up by such a gap


def find(timings: dict[int, dict[str, list]], hosts: dict[int, str | None] | None = None) -> Slow | None:
    """``timings``: rank -> group -> [[seq, ns, op], ...] (the ranks' own records)."""
    if len(timings) < 2:
        return None
    waited: dict[int, float] = dict.fromkeys(timings, 0.0)
    gaps: dict[int, list[float]] = {r: [] for r in timings}
    last_at: dict[int, int] = dict.fromkeys(timings, 0)
    lo, hi, shared = None, None, 0
    groups = set.intersection(*(set(t) for t in timings.values()))
    for group in groups:
        per_rank = {r: {int(s): int(ns) for s, ns, *_ in t[group] if ns} for r, t in timings.items()}
        seqs = set.intersection(*(set(v) for v in per_rank.values()))
        for seq in seqs:
            arrivals = sorted((per_rank[r][seq], r) for r in per_rank)
            (t_prev, _), (t_last, r_last) = arrivals[-2], arrivals[-1]
            gap = (t_last - t_prev) / 1e9
            waited[r_last] += gap
            last_at[r_last] += 1
            gaps[r_last].append(gap)
            lo = arrivals[0][0] if lo is None else min(lo, arrivals[0][0])
            hi = t_last if hi is None else max(hi, t_last)
            shared += 1
    if shared < MIN_COLLECTIVES or lo is None or hi is None or hi <= lo:
        return None
    total = sum(waited.values())
    rank = max(waited, key=waited.__getitem__)
    span = (hi - lo) / 1e9
    if total <= 0 or waited[rank] < 0.5 * total or waited[rank] < MIN_SHARE * span or waited[rank] < MIN_WAITED_S:
        return None
    differ = len({h for h in (hosts or {}).values() if h}) > 1
    big = [g for g in gaps[rank] if g >= 0.5 * max(gaps[rank])]
    return Slow(rank, waited[rank], span, last_at[rank], shared, waited[rank] / max(1, last_at[rank]),
                waited[rank] / total, differ, sum(big) / len(big), len(big))


def hot_site(samples: list, n_samples: int) -> tuple[str, int, str, int, int] | None:
    """(file, line, function, count, samples) of the place the main thread was most often outside collectives."""
    best = max((s for s in samples or () if isinstance(s, (list, tuple)) and len(s) >= 4), key=lambda s: s[3],
               default=None)
    if best is None:
        return None
    return str(best[0]), int(best[1]), str(best[2]), int(best[3]), int(n_samples or best[3])

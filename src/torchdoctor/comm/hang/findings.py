"""The findings of a hang post-mortem: where the ranks parted, who never came, where each side was."""

from __future__ import annotations

import os

from ...findings import Finding
from .analyze import Frames, Parting
from .dumps import Dumps
from .facts import JobFacts, RankFacts

_LIBRARY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep, os.sep + "lib" + os.sep + "python")
SHOWN_FRAMES = 4


def _user_frames(frames: Frames) -> Frames:
    """The frames of the user's own code (outside installed packages), innermost first; all of them if none is."""
    inner_first = list(reversed(frames))
    own = [f for f in inner_first if not any(part in f[0] for part in _LIBRARY)]
    return own or inner_first


def where(frames: Frames) -> str:
    if not frames:
        return "(no stack recorded)"
    shown = _user_frames(frames)[:SHOWN_FRAMES]
    return " <- ".join(f"{f[0]}:{f[1]} in {f[2]}" for f in shown)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def hang_findings(dumps: Dumps, partings: list[Parting], source: str, job: JobFacts | None = None,
                  procs: list[RankFacts] | None = None) -> list[Finding]:
    """The verdict (:mod:`.verdict`: ``comm.<class>``, the culprit first) when something failed or hung;
    ``comm.dump-unreadable`` for the files that could not be read; without a verdict, ``comm.flight-stacks`` /
    ``comm.flight-incomplete`` / ``comm.flight-records`` say what the records do show. ``source``: where the dumps
    are; ``job``: what ``torchdoctor run`` saw of the ranks (None: the dumps alone)."""
    from .verdict import judge

    out: list[Finding] = []
    data_common = {"dumps": source, "ranks_read": sorted(dumps.ranks)}
    job = job if job is not None else JobFacts(world_size=dumps.world_size)
    verdict = judge(dumps, partings, job, procs)
    if verdict is not None:
        out.append(verdict.finding())
    if dumps.problems:
        out.append(Finding("comm.dump-unreadable", "warn",
                           f"{len(dumps.problems)} Flight Recorder dump file(s) could not be used",
                           list(dumps.problems), [], {"problems": list(dumps.problems)}))
    parted = verdict is not None
    if dumps.ranks and not dumps.entries:  # the recorder was off (TORCH_FR_BUFFER_SIZE=0) or recorded nothing
        out.insert(0 if verdict is None else 1, Finding(
            "comm.flight-stacks", "warn",
            f"Flight Recorder recorded no collective in the {len(dumps.ranks)} dump(s), so where the ranks parted is "
            "unknown; where each rank was when it ended:",
            [f"rank {r} ({d.reason or 'dumped'}): {where(d.stack)}" for r, d in sorted(dumps.ranks.items())]
            + ([f"no dump from {_ranks(dumps.without_dump)}"] if dumps.without_dump else []),
            ["keep the recorder on (unset TORCH_FR_BUFFER_SIZE=0, or set it to 2000) to get the collective each "
             "rank was in"], data_common))
    elif dumps.ranks and not parted and dumps.without_dump:
        out.append(Finding(
            "comm.flight-incomplete", "warn",
            f"dumps from {len(dumps.ranks)} of {dumps.world_size} ranks: {_ranks(dumps.without_dump)} left none, "
            "so where the job parted cannot be told; the ranks that dumped agree on every collective they entered",
            [f"rank {r} ({d.reason or 'dumped'}): {where(d.stack)}" for r, d in sorted(dumps.ranks.items())],
            ["those ranks were killed before they could write (SIGKILL, the OOM killer: see the other findings), or "
             "ran on a host whose report folder was not collected"], {**data_common, "no_dump": dumps.without_dump}))
    elif dumps.ranks and not parted:
        out.append(Finding("comm.flight-records", "ok",
                           f"Flight Recorder records of {len(dumps.ranks)} rank(s): every rank entered the same "
                           "collectives, nothing parted", [], [], data_common))
    return out

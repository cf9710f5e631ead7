"""The findings of a hang post-mortem: where the ranks parted, who never came, where each side was."""

from __future__ import annotations

import os

from ...findings import Finding
from .analyze import Frames, Parting
from .dumps import Dumps

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


def hang_findings(dumps: Dumps, partings: list[Parting], source: str) -> list[Finding]:
    """``comm.hang`` / ``comm.collective-mismatch`` per process group that parted, ``comm.flight-records`` when
    none did, ``comm.dump-unreadable`` for the files that could not be read. ``source``: where the dumps are."""
    out: list[Finding] = []
    data_common = {"dumps": source, "ranks_read": sorted(dumps.ranks)}
    for p in partings:
        if p.mismatch is not None:
            state, seq, calls = p.mismatch
            out.append(Finding(
                "comm.collective-mismatch", "fail",
                f"process group {p.group}: at collective {seq} the ranks called different things ({state})",
                [f"rank {r}: {c}" for r, c in sorted(calls.items())],
                ["every rank must call the same collective with the same sizes and dtypes at each step: look for a "
                 "branch on the rank or on data that differs per rank before that call"],
                {**data_common, "group": p.group, "seq": seq, "state": state, "calls": calls}))
        if p.seq is None:
            continue
        call = p.call
        what = f"collective {p.seq}" + (f" ({call.shape()})" if call else "")
        if p.missing:
            last = ", ".join(f"rank {r}: {p.last_entered.get(r) or 'none'}" + (
                f" (completed: {p.last_completed[r]})" if p.last_completed.get(r) is not None else "")
                for r in p.missing if r in p.last_entered)
            title = (f"the job hung in process group {p.group} at {what}: {_ranks(p.missing)} never entered it"
                     + (f"; {_ranks(p.waiting)} wait in it" if p.waiting else ""))
            evidence = []
            for r in p.missing:
                stack = p.missing_stacks.get(r)
                if stack:
                    why = dumps.ranks[r].reason if r in dumps.ranks else None
                    evidence.append(f"rank {r} was at {where(stack)}" + (f" ({why})" if why else ""))
                elif r in dumps.ranks:
                    evidence.append(f"rank {r}: its dump records collectives only, not where it was (torchdoctor "
                                    "run's dumps add the rank's stack)")
                else:
                    evidence.append(f"rank {r}: no dump (killed before it could write one, or on a host whose "
                                    "report folder was not collected)")
            if last:
                evidence.append(f"last collective entered by the missing rank(s): {last}")
            if p.waiting:
                evidence.append(f"{_ranks(p.waiting)} called it at {where(p.waiting_frames)}")
            fix = [f"{_ranks(p.missing)} did not reach that call: a branch on the rank, a data loader that ran out "
                   "of batches on that rank first, an exception caught on that rank, or a rank stuck before it "
                   "(its stack above). Every rank must reach every collective in the same order."]
        else:
            title = (f"the job hung in process group {p.group} at {what}: every rank entered it, "
                     f"{_ranks(p.waiting)} never completed it")
            evidence = [f"{_ranks(p.waiting)} called it at {where(p.waiting_frames)}"]
            fix = ["every rank arrived: the transfer itself did not finish -- a dead link or device, or a peer "
                   "process that died; run `torchdoctor comm` on the same hosts to test every link"]
        if p.no_dump:
            evidence.append(f"no dump from {_ranks(p.no_dump)}")
        out.append(Finding("comm.hang", "fail", title, evidence, fix, {
            **data_common, "group": p.group, "seq": p.seq, "op": call.op if call else None,
            "sizes": call.in_sizes if call else None, "dtypes": call.in_dtypes if call else None,
            "missing": p.missing, "waiting": p.waiting, "last_entered": p.last_entered,
            "last_completed": p.last_completed, "no_dump": p.no_dump,
            "missing_stacks": {r: [list(f) for f in s] for r, s in p.missing_stacks.items()},
            "waiting_stack": [list(f) for f in p.waiting_frames]}))
    if dumps.problems:
        out.append(Finding("comm.dump-unreadable", "warn",
                           f"{len(dumps.problems)} Flight Recorder dump file(s) could not be used",
                           list(dumps.problems), [], {"problems": list(dumps.problems)}))
    parted = any(f.id in ("comm.hang", "comm.collective-mismatch") for f in out)
    if dumps.ranks and not dumps.entries:  # the recorder was off (TORCH_FR_BUFFER_SIZE=0) or recorded nothing
        out.insert(0, Finding(
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

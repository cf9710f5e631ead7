"""What is known of each rank of a distributed job besides its Flight Recorder records, each fact with its witness:
the process state ``torchdoctor run`` read in ``/proc``, the status file the rank kept (:mod:`torchdoctor.run.inside.
status`: its ``init_process_group`` call, its heartbeat, how Python saw it end), the launcher's log, the kernel log."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

Frames = list[tuple[str, int, str]]

_LIBRARY = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
            os.sep + "lib" + os.sep + "python")
_OURS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../torchdoctor


def is_user_frame(frame: tuple | list) -> bool:
    """A frame of the user's own code: not an installed package, not the standard library, not torchdoctor's hook."""
    path = str(frame[0])
    return not (path.startswith("<") or any(p in path for p in _LIBRARY) or path.startswith(_OURS + os.sep))


def user_site(frames: Frames | list | None) -> tuple[str, int, str] | None:
    """The innermost frame of the user's code in ``frames`` (innermost last), or None."""
    for f in reversed(frames or ()):
        if is_user_frame(f):
            return str(f[0]), int(f[1] or 0), str(f[2])
    return None


def site_text(site: tuple[str, int, str] | None) -> str | None:
    return None if site is None else f"{site[0]}:{site[1]}"


def frames(raw: Any) -> Frames:
    out = []
    for f in raw or ():
        if isinstance(f, (list, tuple)) and len(f) >= 3:
            try:
                out.append((str(f[0]), int(f[1] or 0), str(f[2])))
            except (TypeError, ValueError):
                continue
    return out


@dataclass
class RankFacts:
    """One rank's process as ``torchdoctor run`` saw it (every field optional: dumps read alone give none)."""

    rank: int
    host: str | None = None
    pid: int | None = None
    #: running | stopped | traced | exited | killed | gone | unknown -- the last state read
    state: str = "unknown"
    state_witness: str = ""  # e.g. "/proc/123/stat: T at 12.4 s"
    stopped_at: float | None = None  # seconds into the run it was first seen stopped (T) or traced (t)
    traced: bool = False  # the stop was a tracing stop (t: a debugger)
    gone_at: float | None = None  # seconds into the run its process was first seen gone (or a zombie)
    busy: bool | None = None  # last read R (on a CPU) rather than S/D
    exit_code: int | None = None  # from a zombie's /proc stat, or the launcher's log
    signal: str | None = None  # the signal that killed it, where a witness says so
    signal_witnesses: list[str] = field(default_factory=list)  # each line that saw the signal (zombie, launcher log)
    oom_lines: list[str] = field(default_factory=list)  # kernel OOM-killer lines that name its pid
    init: dict | None = None  # its status file's init_process_group record
    beat: dict | None = None  # its last heartbeat
    beat_age: float | None = None  # seconds between its last heartbeat and the verdict
    end: dict | None = None  # how Python saw it end
    timing: dict | None = None  # group -> [[seq, ns, op], ...] (written at exit)
    ended_by_run: bool = False  # it ended after ``run`` started ending the job

    @property
    def end_time(self) -> float | None:
        """When it ended (seconds since the epoch, as the rank wrote it), where known."""
        return float(self.end["t"]) if self.end and isinstance(self.end.get("t"), (int, float)) else None


@dataclass
class JobFacts:
    """The job as a whole: its ranks, how ``run`` came to judge it, and what ``run`` did to it."""

    ranks: dict[int, RankFacts] = field(default_factory=dict)
    world_size: int | None = None
    how: str = "after the job ended"  # or "while it hung: no progress for 3.0 s ...", "when ... got SIGINT ..."
    live: bool = False  # judged while the job still ran (hung), before anything was ended
    settled: bool = True  # the ranks had stopped moving (False: interrupted while they progressed)
    ended_well: bool = False  # the command exited 0 on its own
    ras: list = field(default_factory=list)  # NCCL RAS communicators (:class:`.ras.Communicator`), where read
    notes: list[str] = field(default_factory=list)

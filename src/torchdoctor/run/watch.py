"""``torchdoctor run`` watching a distributed job's ranks: progress, process state, a verdict while it hangs.

Each rank keeps a status file (:mod:`.inside.status`: its ``init_process_group`` call, a heartbeat with its collective
counters and where its main thread is, how it ended). Every :data:`POLL_S` seconds :class:`Watch` reads those files and
each rank's ``/proc/<pid>/stat`` (on this host): running, stopped (``T``), traced (``t``: a debugger), a zombie or gone.

A hang: every rank still running has made no progress -- no collective entered or completed, ``init_process_group`` not
returned, no CPU used outside collectives (a rank computing is working) -- for the threshold (``--hang-after``; by
default a quarter of the job's collective timeout, at most 120 s), and at least one of them waits in a collective or in
``init_process_group``. Then, and on the first Ctrl-C or SIGTERM ``run`` gets, it asks every rank for its Flight
Recorder dump (a request file each rank's heartbeat thread answers, also while its main thread is blocked in a
collective), reads NCCL's RAS where ``ncclras`` is installed, prints the verdict at once, and ends the job: SIGTERM to
its process group and to each rank (a stopped rank is continued so it can take it, and writes where it was), SIGKILL to
whatever is left :data:`GRACE_S` seconds later.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from .inside import status

POLL_S = 0.25
CPU_EVERY_S = 1.0  # how often a rank's CPU time (its process tree's) is read
LATE_BEATS, LATE_MIN_S = 4, 1.0  # a heartbeat older than this many periods (and at least this long) is late
DUE_SLACK_S = 2 * POLL_S  # a heartbeat older than its period and this is due: what the rank does now is not known yet
BUSY_SHARE = 0.1  # a rank outside collectives that used this share of a CPU since the last read is working
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
GRACE_S = 5.0  # from SIGTERM to SIGKILL when run ends the job
ANSWER_S = 3.0  # how long the ranks have to answer a dump request
SETTLED_S = 2.0  # on Ctrl-C: no rank moved for this long, so where they stand is where they part
MAX_AUTO_S = 120.0
DEFAULT_AUTO_S = 120.0  # no rank said its collective timeout


@dataclass
class Proc:
    """One process of the job that called ``init_process_group``, as ``run`` sees it."""

    host: str
    pid: int
    doc: dict = field(default_factory=dict)
    mtime: int = 0
    sig: Any = None  # its progress, as a comparable value
    changed: float = 0.0  # (monotonic) when its progress last changed
    state: str = "unknown"  # running, stopped, traced, gone
    char: str = ""  # /proc state letter
    stopped_at: float | None = None  # (epoch) first seen stopped / traced
    traced: bool = False
    gone_at: float | None = None  # (epoch) first seen gone or a zombie
    exit_code: int | None = None  # a zombie's, from /proc/<pid>/stat
    local: bool = True
    cpu: float | None = None  # CPU seconds of its process tree (itself and its children: DataLoader workers)
    seen: tuple[str, str] | None = None  # (state, letter) when the verdict was made, before run ended the job

    @property
    def rank(self) -> int | None:
        r = self.doc.get("rank")
        if isinstance(r, int):
            return r
        init = self.doc.get("init") or {}
        if isinstance(init.get("rank"), int) and init["rank"] >= 0:
            return init["rank"]
        try:
            return int((init.get("env") or {}).get("RANK"))
        except (TypeError, ValueError):
            return None

    @property
    def ended(self) -> bool:
        return "end" in self.doc or self.state == "gone"

    def in_wait(self) -> bool:
        """Waiting for the others: in init, in a collective, or with collectives of a host backend still pending."""
        return self.in_collective() or bool((self.doc.get("beat") or {}).get("pending"))

    def _beat_age(self) -> tuple[float, float] | None:
        """(seconds since its last heartbeat, the heartbeat's period), or None before its first."""
        beat = self.doc.get("beat") or {}
        t, period = beat.get("t"), beat.get("period")
        if not isinstance(t, (int, float)) or not isinstance(period, (int, float)):
            return None
        return time.time() - t, period

    def beat_late(self) -> bool:
        """Is its heartbeat late? A thread that waits in a collective -- gloo's, a CUDA sync -- hands the GIL over, and
        the beat comes on time; a main thread that holds it (the rank's own Python code, computing) delays the beat,
        and what its last beat said ("inside a collective", from before) is old news."""
        seen = self._beat_age()
        return seen is not None and seen[0] > max(LATE_BEATS * seen[1], LATE_MIN_S)

    def beat_due(self) -> bool:
        """Is its next heartbeat due and not seen yet (older than its period, not yet late)? What its last one said --
        "inside a collective" -- may be over: a verdict waits for the next one (or for it to be late)."""
        seen = self._beat_age()
        return seen is not None and seen[0] > seen[1] + DUE_SLACK_S and not self.beat_late()

    def in_collective(self) -> bool:
        """In init or inside a collective: its CPU time is no sign of work (a device sync may spin)."""
        init = self.doc.get("init") or {}
        if init and not init.get("done") and not init.get("error"):
            return True
        return bool((self.doc.get("beat") or {}).get("in_collective"))


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` so far, in seconds; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
        fields = raw[raw.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


def read_stat(pid: int) -> tuple[str, int | None] | None:
    """(state letter, exit code of a zombie) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    code = None
    if fields and fields[0] == "Z" and len(fields) >= 50:
        with contextlib.suppress(ValueError):
            code = int(fields[49])  # the wait status (field 52: exit_code, Linux >= 3.5)
    return (fields[0] if fields else "?"), code


class Watch:
    """The ranks of the job, their progress and state; the decision that it hangs; the request for dumps; the end."""

    def __init__(self, report_dir: str, hang_after: float | None, start: float) -> None:
        self.dir = report_dir
        self.hang_after = hang_after  # None: automatic; 0: never judged while it runs
        self.start = start
        self.procs: dict[tuple[str, int], Proc] = {}
        self.next_poll = 0.0
        self.next_cpu = 0.0
        self.root: int | None = None  # the command's pid (set when it started)
        self.started_epoch = time.time()
        self.foreign: set[tuple[str, int]] = set()
        self.host = status.host()
        self.trigger: str | None = None  # why the job is being judged while it runs
        self.trigger_epoch: float | None = None
        self.request_id: str | None = None
        self.request_at: float | None = None
        self.expected: set[tuple[str, int]] = set()
        self.verdict_done = False
        self.ending_epoch: float | None = None  # when run began ending the job
        self.kill_at: float | None = None
        self.notes: list[str] = []
        self.ras_text: str | None = None
        self.ras_proc: Any = None
        self.settled = True
        self.continued: set[tuple[str, int]] | None = None  # stopped ranks continued to take SIGTERM
        self.continued_at = 0.0
        self._ids = itertools.count(1)

    # -- reading
    def poll(self, now: float) -> None:
        if now < self.next_poll:
            return
        self.next_poll = now + POLL_S
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            entries = []
        for e in entries:
            m = status.NAME.match(e.name)
            if not m:
                continue
            key = (m.group(1), int(m.group(2)))
            try:
                mtime = e.stat().st_mtime_ns
            except OSError:
                continue
            if key in self.foreign:
                continue
            p = self.procs.get(key)
            if p is None:
                if key[0] == self.host and not self._ours(key[1], e):
                    self.foreign.add(key)  # another job's, or an earlier run's, in the same folder
                    continue
                p = self.procs[key] = Proc(key[0], key[1], changed=now, local=key[0] == self.host)
            if mtime != p.mtime:
                doc = status.read_json(e.path)
                if doc is not None:
                    p.doc, p.mtime = doc, mtime
        for p in self.procs.values():
            self._state(p, now)
            sig = self._progress(p)
            if sig != p.sig:
                p.sig, p.changed = sig, now
        if now >= self.next_cpu:
            self._working(now)

    def _working(self, now: float) -> None:
        """A rank outside any collective that keeps a CPU busy (itself or its DataLoader workers) is computing, not
        stuck: it counts as progress (a long evaluation on rank 0 while the others wait is no hang)."""
        from .process import _ppid_map

        elapsed = now - (self.next_cpu - CPU_EVERY_S) if self.next_cpu else CPU_EVERY_S
        self.next_cpu = now + CPU_EVERY_S
        children: dict[int, list[int]] = {}
        for pid, ppid in _ppid_map().items():  # (one look at /proc for every rank)
            children.setdefault(ppid, []).append(pid)
        for p in self.procs.values():
            if not p.local or p.state != "running":
                continue
            tree, todo = [], [p.pid]
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo.extend(children.get(pid, ()))
            cpu = sum(cpu_seconds(pid) for pid in tree)
            if p.cpu is not None and (not p.in_collective() or p.beat_late()) and \
                    cpu - p.cpu >= BUSY_SHARE * max(elapsed, POLL_S):
                p.changed = now
            p.cpu = cpu

    def _ours(self, pid: int, entry: os.DirEntry) -> bool:
        """A process of this host is one of the command's when it descends from it; one already gone, when its file
        was written since the command started."""
        from .process import process_tree

        if self.root is not None and read_stat(pid) is not None:
            return pid in process_tree(self.root)
        try:
            return entry.stat().st_mtime >= self.started_epoch - 1.0
        except OSError:
            return False

    def _state(self, p: Proc, now: float) -> None:
        if not p.local or p.state == "gone":
            return
        st = read_stat(p.pid)
        if st is None or st[0] in ("Z", "X"):
            p.state, p.gone_at = "gone", time.time()
            if st is not None and st[1] is not None:
                p.exit_code = st[1]
            return
        p.char = st[0]
        if st[0] in ("T", "t"):
            if p.stopped_at is None:
                p.stopped_at, p.traced = time.time(), st[0] == "t"
            p.state = "traced" if st[0] == "t" else "stopped"
        else:
            p.state = "running"

    @staticmethod
    def _progress(p: Proc) -> Any:
        init = p.doc.get("init") or {}
        beat = p.doc.get("beat") or {}
        groups = beat.get("groups")
        where = None if groups else tuple(tuple(f) for f in (beat.get("stack") or [])[-3:])
        # leaving a collective is progress, also where a host backend's recorder has not counted it completed yet
        return (bool(init.get("done")), bool(init.get("error")), "end" in p.doc, bool(beat.get("in_collective")),
                tuple(sorted((k, v[0], v[2]) for k, v in (groups or {}).items())), where)

    # -- deciding
    def period(self) -> float:
        """The ranks' heartbeat period: a change is seen up to this much (and one poll) after it happened."""
        return max((float((p.doc.get("beat") or {}).get("period") or 0) for p in self.procs.values()), default=1.0)

    def idle(self, now: float) -> float | None:
        """Seconds since any rank still running last made progress, as far as ``run`` has seen (a lower bound)."""
        live = [p for p in self.procs.values() if not p.ended]
        return min((now - p.changed for p in live), default=None)

    def worth_holding(self, now: float) -> bool:
        """Is a signal ``run`` got worth holding back to collect the ranks' state first? Only where the job may hang:
        no progress for :data:`SETTLED_S` (allowing for a heartbeat not yet seen), or a rank stopped or gone.
        A job that is moving gets the signal at once."""
        if not self.procs or self.trigger is not None:
            return False
        if any(p.state in ("stopped", "traced") or p.ended for p in self.procs.values()):
            return True
        idle = self.idle(now)
        return idle is not None and idle + self.period() + POLL_S >= SETTLED_S

    def threshold(self) -> float | None:
        if self.hang_after is not None:
            return self.hang_after or None
        timeouts = [t for p in self.procs.values() if isinstance(t := (p.doc.get("init") or {}).get("timeout_s"),
                                                                       (int, float)) and t > 0]
        return min(MAX_AUTO_S, min(timeouts) / 4) if timeouts else DEFAULT_AUTO_S

    def _expected_world(self) -> int | None:
        sizes = []
        for p in self.procs.values():
            with contextlib.suppress(TypeError, ValueError):
                sizes.append(int(((p.doc.get("init") or {}).get("env") or {}).get("WORLD_SIZE")))
        return max(sizes, default=None)

    def stalled(self, now: float) -> float | None:
        """Seconds no rank has made progress, when that is a hang past the threshold; else None."""
        limit = self.threshold()
        if limit is None or not self.procs or now - self.start < limit:
            return None
        live = [p for p in self.procs.values() if not p.ended]
        if not live or not any(p.in_wait() or p.state in ("stopped", "traced") for p in live):
            return None
        if any(p.state == "running" and p.beat_due() for p in live):
            return None  # (judged on what each running rank said of itself a period ago at most)
        idle = min(now - p.changed for p in live)
        if any(not (p.doc.get("init") or {}).get("done") for p in live):
            world = self._expected_world()
            if world is not None and len(self.procs) < world:  # ranks still starting: init waits for them
                limit *= 4
        return idle if idle >= limit else None

    # -- acting
    def step(self, now: float, held: list[int]) -> str | None:
        """One look; returns ``"judge"`` when the verdict is due now (after the ranks answered), ``"end"`` when the
        job should be ended, else None. ``held``: signals ``run`` got and has not forwarded yet."""
        self.poll(now)
        if self.trigger is None and self.continued is None:
            self._teardown(now)
        if self.trigger is None:
            if held:
                name = signal.Signals(held[0]).name
                idle = self.idle(now) or 0.0
                self.settled = idle >= SETTLED_S
                if self.settled:
                    self.notes.append(f"status file: no rank had made progress for {idle:.1f} s")
                self._request(f"when torchdoctor run got {name}", now)
            else:
                idle = self.stalled(now)
                if idle is not None:
                    self._request(f"while it hung: no progress for {idle:.1f} s (threshold {self.threshold():g} s)",
                                  now)
            return None
        if not self.verdict_done and self.request_at is not None:
            answered = {k for k, p in self.procs.items() if p.doc.get("answered") == self.request_id}
            waiting = {k for k in self.expected - answered if not self.procs[k].ended
                       and self.procs[k].state == "running"}
            if waiting and now - self.request_at < ANSWER_S:
                return None
            if self.ras_proc is not None and self.ras_proc.poll() is None and now - self.request_at < ANSWER_S + 2:
                return None  # (NCCL's RAS collects from every peer within ANSWER_S)
            if self.ras_proc is not None:
                from ..comm.hang import ras

                self.ras_text, why_not = ras.collect(self.ras_proc, 1.0)
                self.ras_proc = None
                if why_not:
                    self.notes.append(f"NCCL RAS: not read ({why_not})")
            if waiting:
                self.notes.append("status file: " + ", ".join(f"pid {k[1]}" for k in sorted(waiting))
                                  + f" did not answer the dump request within {ANSWER_S:g} s")
                self.expected -= waiting
            if self.continued is None:  # a stopped rank cannot answer: SIGTERM, then SIGCONT -- it writes where it
                self.continued = {k for k, p in self.procs.items() if p.local and p.state == "stopped"}  # stood
                for k in self.continued:
                    self.procs[k].seen = (self.procs[k].state, self.procs[k].char)
                    with contextlib.suppress(OSError):
                        os.kill(k[1], signal.SIGTERM)
                        os.kill(k[1], signal.SIGCONT)
                self.continued_at = now
            if any(not self.procs[k].ended for k in self.continued) and now - self.continued_at < ANSWER_S:
                return None
            self.verdict_done = True
            for p in self.procs.values():  # the states the verdict rests on (ending the job changes them)
                p.seen = p.seen or (p.state, p.char)
            return "judge"
        if self.kill_at is not None and now >= self.kill_at:
            return "kill"
        return None

    def _teardown(self, now: float) -> None:
        """The job is ending on its own (a rank failed) while a rank is stopped: that rank cannot take the launcher's
        SIGTERM (torchrun would wait its grace period, then SIGKILL it, leaving no trace of where it stood). It is
        sent SIGTERM and continued, so it ends the way the others did and writes where it was."""
        stopped = {k for k, p in self.procs.items() if p.local and p.state == "stopped"}
        failed = [p for p in self.procs.values() if (p.doc.get("end") or {}).get("how") in ("exception", "signal")
                  or (p.state == "gone" and "end" not in p.doc)]
        if not stopped or not failed:
            return
        self.continued, self.continued_at = stopped, now
        for k in stopped:
            p = self.procs[k]
            p.seen = (p.state, p.char)
            with contextlib.suppress(OSError):
                os.kill(k[1], signal.SIGTERM)
                os.kill(k[1], signal.SIGCONT)
        self.notes.append("torchdoctor run: " + ", ".join(f"pid {k[1]}" for k in sorted(stopped)) + " stopped while "
                          "the job was ending: sent SIGTERM and continued, so it could end")

    def _request(self, why: str, now: float) -> None:
        self.trigger, self.trigger_epoch = why, time.time()
        self.request_id = f"{os.getpid()}-{next(self._ids)}"
        self.expected = {k for k, p in self.procs.items() if not p.ended and p.state == "running"
                         and p.doc.get("beat")}
        with contextlib.suppress(OSError):
            status.write_json(os.path.join(self.dir, status.REQUEST), {"id": self.request_id, "why": why,
                                                                       "t": time.time()})
        self.request_at = now
        if any("nccl" in str((p.doc.get("init") or {}).get("backend") or "").lower() for p in self.procs.values()):
            from ..comm.hang import ras

            self.ras_proc, why_not = ras.start(ANSWER_S)
            if why_not:
                self.notes.append(f"NCCL RAS: not read ({why_not})")

    def end_job(self, root: int, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the command's group and to each rank (their own sessions under torchrun), continue the
        stopped ones so they take it; SIGKILL follows :data:`GRACE_S` seconds later."""
        self.ending_epoch = time.time()
        with contextlib.suppress(OSError):
            os.killpg(root, sig)
        for p in self.procs.values():
            if not p.local or p.state == "gone":
                continue
            with contextlib.suppress(OSError):
                os.kill(p.pid, sig)
            if p.state in ("stopped", "traced"):
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGCONT)
        self.kill_at = time.monotonic() + GRACE_S

    def kill_rest(self, root: int) -> None:
        from .process import process_tree

        self.kill_at = None
        pids = set(process_tree(root)) | {p.pid for p in self.procs.values() if p.local and p.state != "gone"}
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        """Read the files one last time; ``run``'s bookkeeping is removed (the dumps stay)."""
        self.next_poll = 0.0
        self.poll(time.monotonic())
        status.remove_all(self.dir)

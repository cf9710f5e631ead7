"""Processes of this host: what state a rank's process is in, and ``--local``'s ranks as one group that never
outlives its launcher.

``--local`` starts its ranks in a process group of their own: a Ctrl-C on the terminal reaches the launcher alone
(the foreground group), which tells the ranks itself, so each signal means one thing -- and the launcher can end the
whole group on its way out, whatever it left behind. Each rank also asks the kernel to SIGKILL it when its launcher
dies (``PR_SET_PDEATHSIG``): a launcher killed by SIGKILL runs no cleanup, and a rank without its launcher has lost
the store anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def process_state(pid: int | None) -> str | None:
    """"gone", "stopped" or "running" for a process of this host (None when unknown)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def process_status(pid: int | None) -> dict:
    """What this host sees of a rank's process, at the moment of asking: ``process`` (as :func:`process_state`),
    ``tracer_pid`` (``TracerPid`` in ``/proc/PID/status``: 0 when no debugger holds it; None when unreadable) and
    ``tracer`` (that debugger's command name, when there is one and it can be read).

    Read when the verdict is made: under ``--local`` the launcher ends a stuck rank right after it, so what its
    process was doing can only be recorded then."""
    state = process_state(pid)
    out: dict = {"process": state, "tracer_pid": None, "tracer": None}
    if state not in ("stopped", "running"):
        return out
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    out["tracer_pid"] = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        return out
    if out["tracer_pid"]:
        try:
            with open(f"/proc/{out['tracer_pid']}/comm") as f:
                out["tracer"] = f.read().strip() or None
        except OSError:
            pass
    return out


def _prctl():
    """libc's ``prctl``, looked up before any fork (the child only calls it); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class RankGroup:
    """The ranks of one ``--local`` run: started into one process group, signalled and ended together."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}  # rank -> process, in start order
        self._groups: dict[int, int] = {}  # rank -> its process group
        self._prctl = _prctl()
        self._parent = os.getpid()

    def start(self, rank: int, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        live = self._live_groups()
        pgid = live[0] if live else 0  # 0: this rank leads a new group
        try:
            p = self._popen(cmd, env, pgid)
        except subprocess.SubprocessError:  # setpgid refused: the group emptied meanwhile
            pgid, p = 0, self._popen(cmd, env, 0)
        self.procs[rank] = p
        self._groups[rank] = pgid or p.pid
        return p

    def _popen(self, cmd: list[str], env: dict[str, str], pgid: int) -> subprocess.Popen:
        prctl, parent = self._prctl, self._parent

        def in_child() -> None:  # after fork, before exec: system calls only
            os.setpgid(0, pgid)
            # A rank in a background group that writes to the terminal under `stty tostop` would be stopped
            # (SIGTTOU); ignored, the write goes through. An ignored signal stays ignored across exec.
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            if prctl is not None:
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before the request was in place
                os._exit(1)

        # stdin from /dev/null: a rank in a background group that read the terminal would be stopped (SIGTTIN)
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=in_child)

    def _live_groups(self) -> list[int]:
        """Groups with a rank not yet reaped: only those ids are still ours (a reaped group's id can be reused)."""
        return list(dict.fromkeys(self._groups[r] for r, p in self.procs.items() if p.returncode is None))

    def running(self) -> list[int]:
        return [r for r, p in self.procs.items() if p.poll() is None]

    def send(self, sig: int) -> None:
        """``sig`` to every rank still running, by group, so that a rank's own children get it too."""
        for pgid in self._live_groups():
            with contextlib.suppress(OSError):
                os.killpg(pgid, sig)

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            with contextlib.suppress(OSError):
                self.procs[r].kill()

    def kill_stopped(self) -> list[int]:
        """SIGKILL the ranks that are stopped (SIGSTOP, a debugger): no other signal reaches them. The ranks killed."""
        out = []
        for r, p in self.procs.items():
            if p.poll() is None and process_state(p.pid) == "stopped":
                with contextlib.suppress(OSError):
                    p.kill()
                out.append(r)
        return out

    def end(self, grace: float = 0.0) -> None:
        """Leave nothing behind: wait up to ``grace`` seconds for the ranks, then SIGKILL the groups and reap."""
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.send(signal.SIGKILL)
        for p in self.procs.values():
            if p.returncode is None:
                with contextlib.suppress(OSError):
                    p.kill()
                p.wait()

"""The child process of ``torchdoctor run`` while it runs: starting it, forwarding signals, its process tree and memory.

Only something outside the command can see a SIGKILL that leaves no traceback, so :mod:`.supervisor` starts the command
here as a child in its own process group and watches it:

* :func:`spawn` starts it with its stdout and stderr as pipes (read by :mod:`.pump`), in its own group, with
  no terminal as stdin (a background group reading a terminal would be stopped by SIGTTIN: better no stdin than a
  hang);
* :class:`Signals` forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to us to that whole group (so torchrun and
  all its workers get a Ctrl-C exactly once); the third SIGINT sends SIGKILL;
* :class:`Memory` sums ``VmRSS`` over the child's whole process tree (found through the ``ppid`` field of
  ``/proc/*/stat``, so torchrun's workers count) and reads ``MemAvailable`` / ``MemTotal``; it keeps the peak
  tree RSS and the lowest MemAvailable, with their times, and every pid it saw (for the kernel log).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from .._system import GIB, read_meminfo
from ..logs.analyze import signal_name as signame

_MAX_SAMPLES = 4000  # memory samples kept for --json; older ones are thinned, never the peaks
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


class WrapError(Exception):
    """The command could not be started; ``exit_code`` is what a shell would return (127, 126)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ----------------------------------------------------------------------------------------------- /proc


def _ppid_map() -> dict[int, int]:
    """pid -> ppid for every process visible in /proc (threads are not listed at the top level)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid ..." -- comm may hold spaces and parentheses: split after the last ')'
            out[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and all its living descendants (``[]`` once ``root`` is gone)."""
    ppids = _ppid_map()
    if root not in ppids:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def vm_rss(pid: int) -> int:
    """Resident set size of one process in bytes (0 for a zombie or a process that is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Memory:
    """Samples the tree's RSS and the machine's MemAvailable; keeps the extremes and a thinned series."""

    def __init__(self, root: int, start: float) -> None:
        self.root, self.start = root, start
        self.peak, self.peak_t, self.peak_procs = 0, None, 0
        self.min_avail: int | None = None
        self.min_avail_t: float | None = None
        self.total: int | None = None
        self.pids_seen: set[int] = {root}
        self.samples: list[dict[str, float]] = []
        self._every, self._n = 1, 0

    def sample(self, now: float) -> None:
        t = now - self.start
        tree = process_tree(self.root)
        self.pids_seen.update(tree[:4096])
        rss = sum(vm_rss(p) for p in tree)
        if tree and rss > self.peak:
            self.peak, self.peak_t, self.peak_procs = rss, t, len(tree)
        mi = read_meminfo()
        avail, self.total = mi.get("MemAvailable"), mi.get("MemTotal", self.total)
        if avail is not None and (self.min_avail is None or avail < self.min_avail):
            self.min_avail, self.min_avail_t = avail, t
        if self._n % self._every == 0:
            self.samples.append({"t": round(t, 2), "rss_gib": round(rss / GIB, 4),
                                 "available_gib": None if avail is None else round(avail / GIB, 4)})
            if len(self.samples) > _MAX_SAMPLES:
                self.samples = self.samples[::2]
                self._every *= 2
        self._n += 1


# ------------------------------------------------------------------------------------------- signals


class Signals:
    """Forwards terminal/job-control signals to the child's process group while it runs."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.pgid: int | None = None
        self.pending: list[int] = []
        self.forwarded: list[tuple[float, str]] = []
        self.sigints = 0
        self.killed_by_us = False
        self.old: dict[int, Any] = {}
        #: asked on the first SIGINT / SIGTERM: True holds it back (``run`` first collects the hung job's state, then
        #: :meth:`release` forwards it); a second signal is forwarded at once, the held one with it
        self.hold: Any = None
        self.held: list[int] = []

    def install(self) -> None:
        try:
            for name in _FORWARDED:
                sig = getattr(signal, name)
                self.old[sig] = signal.signal(sig, self._handle)
            self.old[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, self._stop)
            self.old[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._cont)
        except ValueError:  # not the main thread: signals cannot be forwarded, the run still works
            self.restore()

    def restore(self) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)
        self.old.clear()

    def attach(self, pgid: int) -> None:
        self.pgid = pgid
        for sig in self.pending:
            self._send(sig)
        self.pending.clear()

    def _send(self, sig: int) -> None:
        if self.pgid is None:
            self.pending.append(sig)
            return
        try:
            os.killpg(self.pgid, sig)
        except OSError:
            with contextlib.suppress(OSError):  # the child left its group (setsid): reach it at least
                os.kill(self.pgid, sig)

    def _handle(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGINT:
            self.sigints += 1
            if self.sigints >= 3:
                os.write(2, b"\ntorchdoctor run: third interrupt -- sending SIGKILL to the command\n")
                self.killed_by_us = True
                sig = signal.SIGKILL
        if sig in (signal.SIGINT, signal.SIGTERM) and not self.held and self.hold is not None and self.hold(sig):
            self.held.append(sig)
            return
        self.release()
        self.forwarded.append((time.monotonic() - self.start, signame(sig)))
        self._send(sig)

    def release(self) -> None:
        """Forward the signals held back."""
        held, self.held = self.held, []
        self.hold = None  # (once: the next one goes straight on)
        for sig in held:
            self.forwarded.append((time.monotonic() - self.start, signame(sig)))
            self._send(sig)

    def _stop(self, sig: int, frame: Any) -> None:  # Ctrl-Z: stop the command, then ourselves
        self._send(signal.SIGTSTP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def _cont(self, sig: int, frame: Any) -> None:
        self._send(signal.SIGCONT)


# ------------------------------------------------------------------------------------ start and stop


def spawn(argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` with piped stdout/stderr in its own process group (looked up on PATH like a shell does).

    Raises:
        WrapError: the command could not be started (exit_code 127: not found, 126: not executable).
    """
    env = dict(os.environ)
    env.update(extra_env or {})
    env.setdefault("PYTHONUNBUFFERED", "1")  # its stdout is a pipe now: without this Python would block-buffer
    # Our own group for the child: a signal we forward reaches the whole tree exactly once. A terminal as
    # stdin would stop a background group that reads it (SIGTTIN) -- give it no stdin rather than a hang.
    stdin = subprocess.DEVNULL if _isatty(0) else None
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    try:
        return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **group)
    except FileNotFoundError:
        raise WrapError(f"{argv[0]}: command not found", 127) from None
    except PermissionError:
        raise WrapError(f"{argv[0]}: permission denied (not executable)", 126) from None
    except OSError as e:
        raise WrapError(f"{argv[0]}: cannot execute: {e.strerror or e}", 126) from None


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def terminate(pid: int) -> None:
    """SIGTERM the group of ``pid``, then SIGKILL it: only when we failed and must not leave it running unseen."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except OSError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                return
            time.sleep(0.05)

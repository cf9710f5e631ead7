"""Run a command as a transparent child and explain how it ended (the engine of ``torchdoctor run``).

A DeepSpeed run that exhausts host RAM while loading is SIGKILLed by the kernel with no traceback: the
log just stops. Only something *outside* the process can say what happened, so this module runs the
command as a child and watches it:

* its stdout and stderr pass through unchanged (byte for byte, chunk by chunk as they arrive, so a
  ``\\r`` progress bar is not held back), are appended to a log file if asked, and are fed to the log
  :class:`~torchdoctor.logs.analyze.Analyzer` in blocks of whole lines, each stream cut on its own
  (``Analyzer.feed_block``: as fast as ``torchdoctor logs``);
* when the reader of our stdout (or stderr) goes away (``torchdoctor run ... | head``), that pipe of the
  command is closed, so its next write there fails (SIGPIPE, or EPIPE) just as in a plain shell pipeline --
  the command is not kept running with nobody reading its output;
* every ``interval`` seconds it sums ``VmRSS`` over the child's whole process tree (found through the
  ``ppid`` field of ``/proc/*/stat``, so torchrun's workers count) and reads ``MemAvailable`` and
  ``MemTotal``; it keeps the peak tree RSS and the lowest MemAvailable, with their times;
* when the command fails or is killed, when its output says one of its processes was SIGKILLed (a worker,
  a grandchild: even if the command then exits 0), or when the cgroup's ``oom_kill`` counter rose, it reads
  the kernel log (best effort: ``dmesg -T``, ``/dev/kmsg``, ``journalctl -k``) for OOM-killer lines about
  the processes it saw and those the output names. That evidence, with the samples, goes to the analyzer's
  ``process.killed`` finding (``Analyzer.set_run_evidence``): a logged SIGKILL is blamed on the OOM killer
  only when the kernel says so, and is said not to be the OOM killer when the kernel log is readable without
  such a line and memory never ran low.

The child runs in its own process group; SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to us are forwarded
to that whole group (so torchrun and all its workers get a Ctrl-C exactly once), the third SIGINT sends
SIGKILL. The wrapper itself never prints during the run: the caller renders :class:`RunResult`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .._system import GIB, MIB, cgroup_memory, fmt_bytes, read_meminfo, read_text
from ..findings import Finding
from .analyze import signal_name as signame
from .wrap_findings import (  # noqa: F401 -- re-exported: the findings are part of this module's API
    MEMORY_FIXES,
    _memory_low,
    _not_low_phrase,
    _oom_evidence,
    cmdline,
    exit_finding,
    memory_finding,
)

_READ_CHUNK = 65536  # a pipe's default capacity: one read takes what it holds
_MAX_PARTIAL_LINE = 1 << 20  # a "line" longer than this is fed to the analyzer in pieces
_MAX_SAMPLES = 4000  # memory samples kept for --json; older ones are thinned, never the peaks
_DRAIN_IDLE_S = 1.0  # after the child exits: stop reading once the pipes are idle this long ...
_DRAIN_MAX_S = 5.0  # ... or this long at most (a daemonised grandchild may hold the pipes forever)
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


# --------------------------------------------------------------------------------------- kernel log

_OOM_LINE = re.compile(r"Killed process (\d+)|oom-kill:.*?\bpid=(\d+)|Out of memory.*?process (\d+)")


@dataclass
class KernelLog:
    readable: bool
    source: str  # "dmesg -T", "/dev/kmsg", "journalctl -k" or why none was readable
    oom_lines: list[str] = field(default_factory=list)  # OOM-killer lines that name one of our pids
    memcg: str | None = None  # the cgroup whose limit ran out (CONSTRAINT_MEMCG); None: the machine's RAM
    memcg_limit: int | None = None
    # OOM-killer lines about *other* pids at least as new as the command (pids grow): perhaps a short-lived
    # process of the command that no sample saw -- while there are any, a missing line proves nothing
    unseen_oom_lines: list[str] = field(default_factory=list)


def memcg_limit(path: str) -> int | None:
    """The memory limit of the cgroup ``path`` (as the kernel names it, e.g. ``/slurm/uid_1/job_7``)."""
    for f in (f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes", f"/sys/fs/cgroup{path}/memory.max",
              f"/sys/fs/cgroup/unified{path}/memory.max"):
        text = (read_text(os.path.normpath(f)) or "").strip()
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _run_quiet(cmd: list[str], timeout: float) -> str | None:
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    text = p.stdout.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("-- No entries", "No journal"))]
    return "\n".join(lines) if lines else None


def _read_kmsg(max_records: int = 200_000, max_s: float = 2.0) -> str | None:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    out: list[str] = []
    deadline = time.monotonic() + max_s
    try:
        while len(out) < max_records and time.monotonic() < deadline:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the buffer
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten while we read: keep going
                    continue
                return None
            if not rec:
                break
            out.append(rec.decode("utf-8", "replace").split(";", 1)[-1].rstrip("\n"))
    finally:
        os.close(fd)
    return "\n".join(out) if out else None


def parse_oom_lines(text: str, pids: set[int]) -> tuple[list[str], str | None]:
    """The OOM-killer lines of a kernel log that name one of ``pids`` (the last 4), and the cgroup whose limit
    ran out when the kill was confined to one (``constraint=CONSTRAINT_MEMCG ... oom_memcg=PATH``)."""
    lines, memcg = [], None
    for line in text.splitlines():
        m = _OOM_LINE.search(line)
        if m and int(next(g for g in m.groups() if g)) in pids:
            lines.append(line.strip())
            c = re.search(r"constraint=CONSTRAINT_MEMCG\b.*?\boom_memcg=([^,\s]+)", line)
            if c:
                memcg = c.group(1)
    return lines[-4:], memcg


def _newer_oom_lines(text: str, pids: set[int]) -> list[str]:
    """OOM-killer lines (the last 4) about pids not in ``pids`` but not older than the oldest of them."""
    first = min(pids)
    out = []
    for line in text.splitlines():
        m = _OOM_LINE.search(line)
        if m:
            pid = int(next(g for g in m.groups() if g))
            if pid >= first and pid not in pids:
                out.append(line.strip())
    return out[-4:]


def read_kernel_oom(pids: set[int]) -> KernelLog:
    """The kernel's OOM-killer lines about ``pids``, from the first kernel log we are allowed to read."""
    sources = (
        ("dmesg -T", lambda: _run_quiet(["dmesg", "-T"], 3.0)),
        ("/dev/kmsg", _read_kmsg),
        ("journalctl -k", lambda: _run_quiet(["journalctl", "-k", "-b", "-q", "--no-pager", "-n", "20000"], 5.0)),
    )
    for name, read in sources:
        text = read()
        if text is None:
            continue
        lines, memcg = parse_oom_lines(text, pids)
        unseen = _newer_oom_lines(text, pids) if not lines and pids else []
        return KernelLog(True, name, lines, memcg, memcg_limit(memcg) if memcg else None, unseen)
    return KernelLog(False, "kernel log not readable (dmesg -T, /dev/kmsg and journalctl -k refused or absent)")


# --------------------------------------------------------------------------------------- the run


@dataclass
class RunResult:
    """Everything observed about one run of a command."""

    argv: list[str]
    pid: int
    exit_code: int  # the command's exit status; 128 + signal when a signal killed it
    signal: int | None
    duration_s: float
    peak_rss: int  # bytes: max over samples of the tree's summed VmRSS, and the child's own ru_maxrss
    peak_rss_t: float | None  # seconds after start (None when the peak came from ru_maxrss only)
    peak_rss_procs: int  # processes in the tree at the sampled peak
    child_maxrss: int  # bytes: ru_maxrss from wait4 (the child and its reaped descendants, max not sum;
    # it includes our own RSS at fork time, see run_command)
    mem_total: int | None
    min_available: int | None
    min_available_t: float | None
    cgroup_limit: int | None
    cgroup_oom_kills: int | None  # how much the cgroup's oom_kill counter rose during the run
    pids_seen: set[int]
    forwarded: list[tuple[float, str]]  # (seconds after start, signal name) sent on to the child
    killed_by_us: bool  # SIGKILL sent by us after the third SIGINT
    interval: float
    samples: list[dict[str, float]]  # {"t", "rss_gib", "available_gib"}, thinned to at most _MAX_SAMPLES
    log_findings: list[Finding]
    timeline: list[dict]
    kernel: KernelLog | None = None
    findings: list[Finding] = field(default_factory=list)
    reader_gone: tuple[str, float] | None = None  # ("stdout" or "stderr", seconds): our reader of it went away
    last_lines: list[str] = field(default_factory=list)  # the output's last error-looking lines
    log_error: str | None = None  # why --log stopped being written (a full disk), None when it was written whole

    @property
    def signal_name(self) -> str | None:
        return signame(self.signal) if self.signal else None

    def to_json(self) -> dict[str, Any]:
        def gib(b: int | None) -> float | None:
            return None if b is None else round(b / GIB, 3)

        return {
            "command": list(self.argv),
            "pid": self.pid,
            "exit_code": self.exit_code,
            "signal": self.signal_name,
            "duration_s": round(self.duration_s, 3),
            "peak_rss_gib": gib(self.peak_rss),
            "peak_rss_at_s": None if self.peak_rss_t is None else round(self.peak_rss_t, 2),
            "min_available_gib": gib(self.min_available),
            "min_available_at_s": None if self.min_available_t is None else round(self.min_available_t, 2),
            "mem_total_gib": gib(self.mem_total),
            "cgroup_limit_gib": gib(self.cgroup_limit),
            "interval_s": self.interval,
            "findings": [f.to_json() for f in self.findings],
            "timeline": list(self.timeline),
            "memory": list(self.samples),
        }


def _write_all(fd: int, data: bytes) -> bool:
    """Write everything; False when the reader is gone (EPIPE) so the caller stops writing there."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # an inherited non-blocking stdout
            select.select([], [fd], [], 1.0)
            continue
        except (BrokenPipeError, OSError):
            return False
        view = view[n:]
    return True


class _Lines:
    """Cuts one byte stream into blocks of whole ``\\n`` lines for the analyzer (which reads ``\\r`` segments
    itself): each read of the pipe becomes one block (the lines it completes), the unfinished last line waits
    for the next read. A line longer than ``_MAX_PARTIAL_LINE`` is handed on in pieces, cut after a ``\\r``
    where there is one."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []  # the unfinished line, as read (joined only when it ends: no quadratic copies)
        self.size = 0

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        """``(block, partial)`` pairs for :meth:`Analyzer.feed_block`."""
        out: list[tuple[bytes, bool]] = []
        cut = data.rfind(b"\n") + 1
        if cut:
            block = b"".join((*self.parts, data[:cut])) if self.parts else data[:cut]
            self.parts, self.size = [], 0
            out.append((block, False))
            data = data[cut:]
        if data:
            self.parts.append(data)
            self.size += len(data)
            if self.size > _MAX_PARTIAL_LINE:
                rest = b"".join(self.parts)
                r = rest.rfind(b"\r") + 1 or len(rest)
                out.append((rest[:r], True))
                self.parts, self.size = ([rest[r:]], len(rest) - r) if r < len(rest) else ([], 0)
        return out

    def flush(self) -> list[tuple[bytes, bool]]:
        rest = b"".join(self.parts)
        self.parts, self.size = [], 0
        return [(rest, False)] if rest else []


class _Analysis:
    """The log analyzer behind a guard: a bug in it must never disturb the command it watches."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.analyzer: Any = None
        try:
            from .analyze import Analyzer

            self.analyzer = Analyzer(source="command")
        except Exception as e:  # noqa: BLE001 -- reported as a finding, the run goes on
            self.error = f"cannot start the log analyzer: {type(e).__name__}: {e}"

    def feed(self, blocks: list[tuple[bytes, bool]]) -> None:
        if self.analyzer is None:
            return
        try:
            for block, partial in blocks:
                self.analyzer.feed_block(block, partial=partial)
        except Exception as e:  # noqa: BLE001
            self.error = f"the log analyzer failed on a line: {type(e).__name__}: {e}"
            self.analyzer = None

    def kills(self) -> list[dict]:
        if self.analyzer is not None:
            try:
                return self.analyzer.kills()
            except Exception as e:  # noqa: BLE001
                self.error = f"the log analyzer failed at the end: {type(e).__name__}: {e}"
        return []

    def set_run_evidence(self, **kw: Any) -> None:
        if self.analyzer is not None:
            try:
                self.analyzer.set_run_evidence(**kw)
            except Exception as e:  # noqa: BLE001
                self.error = f"the log analyzer failed at the end: {type(e).__name__}: {e}"

    def set_exit(self, code: int) -> None:
        if self.analyzer is not None:
            try:
                self.analyzer.set_exit(code)
            except Exception as e:  # noqa: BLE001
                self.error = f"the log analyzer failed at the end: {type(e).__name__}: {e}"

    def last_lines(self) -> list[str]:
        if self.analyzer is not None:
            try:
                return self.analyzer.last_lines()
            except Exception:  # noqa: BLE001 -- only evidence
                pass
        return []

    def finish(self) -> tuple[list[Finding], list[dict]]:
        if self.analyzer is not None:
            try:
                report = self.analyzer.finish()
                return list(report.findings), list(report.timeline)
            except Exception as e:  # noqa: BLE001
                self.error = f"the log analyzer failed at the end: {type(e).__name__}: {e}"
        return [], []


class _Memory:
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


class _Signals:
    """Forwards terminal/job-control signals to the child's process group while it runs."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.pgid: int | None = None
        self.pending: list[int] = []
        self.forwarded: list[tuple[float, str]] = []
        self.sigints = 0
        self.killed_by_us = False
        self.old: dict[int, Any] = {}

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
        self.forwarded.append((time.monotonic() - self.start, signame(sig)))
        self._send(sig)

    def _stop(self, sig: int, frame: Any) -> None:  # Ctrl-Z: stop the command, then ourselves
        self._send(signal.SIGTSTP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def _cont(self, sig: int, frame: Any) -> None:
        self._send(signal.SIGCONT)


def run_command(argv: list[str], *, log_file: Any = None, interval: float = 0.5,
                out_fd: int = 1, err_fd: int = 2) -> RunResult:
    """Run ``argv``, pass its output through to ``out_fd``/``err_fd``, watch it, and say how it ended.

    Args:
        argv: the command and its arguments (looked up on PATH like a shell does).
        log_file: an open binary file; every byte the command writes (stdout and stderr, in arrival order)
            is appended to it and flushed at once.
        interval: seconds between memory samples.

    Raises:
        WrapError: the command could not be started (exit_code 127: not found, 126: not executable).
    """
    if not argv:
        raise WrapError("no command given", 2)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")  # its stdout is a pipe now: without this Python would block-buffer
    # Our own group for the child: a signal we forward reaches the whole tree exactly once. A terminal as
    # stdin would stop a background group that reads it (SIGTTIN) -- give it no stdin rather than a hang.
    stdin = subprocess.DEVNULL if _isatty(0) else None
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()

    start = time.monotonic()
    sigs = _Signals(start)
    log_bytes, log_error = 0, None
    sigs.install()
    proc = None
    status: tuple[int, Any] | None = None  # (wait status, rusage)
    try:
        cg_limit, oom_before = cgroup_memory()
        # a forked child's ru_maxrss starts at this process's own high-water mark (the mm is copied with its
        # hiwater and exec keeps the maximum), not at its current RSS: compare against the high-water mark
        own_rss = max(vm_rss(os.getpid()) or 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        try:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, **group)
        except FileNotFoundError:
            raise WrapError(f"{argv[0]}: command not found", 127) from None
        except PermissionError:
            raise WrapError(f"{argv[0]}: permission denied (not executable)", 126) from None
        except OSError as e:
            raise WrapError(f"{argv[0]}: cannot execute: {e.strerror or e}", 126) from None
        start = time.monotonic()
        sigs.start = start
        sigs.attach(proc.pid)
        analysis = _Analysis()
        mem = _Memory(proc.pid, start)
        mem.sample(start)
        next_sample = start + interval

        sel = selectors.DefaultSelector()
        outputs = {proc.stdout.fileno(): [out_fd, _Lines(), proc.stdout, "stdout"],
                   proc.stderr.fileno(): [err_fd, _Lines(), proc.stderr, "stderr"]}
        for fd in outputs:
            sel.register(fd, selectors.EVENT_READ)
        exited_at = last_data = None
        reader_gone: tuple[str, float] | None = None
        while outputs:
            now = time.monotonic()
            if status is None:
                if now >= next_sample:
                    mem.sample(now)
                    next_sample = max(next_sample + interval, now + interval / 4)
                pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    status, exited_at = (st, ru), now
            elif now - exited_at > _DRAIN_MAX_S or now - max(exited_at, last_data or exited_at) > _DRAIN_IDLE_S:
                break  # the command is gone but something it started still holds the pipes
            timeout = 0.1 if status is not None else max(0.0, min(next_sample - now, 0.25))
            for key, _ in sel.select(timeout):
                fd = key.fd
                try:
                    data = os.read(fd, _READ_CHUNK)
                except OSError:
                    data = b""
                dest, lines, pipe, name = outputs[fd]
                if not data:
                    analysis.feed(lines.flush())
                    sel.unregister(fd)
                    del outputs[fd]
                    continue
                last_data = time.monotonic()
                gone = dest is not None and not _write_all(dest, data)
                if log_file is not None:
                    try:
                        log_file.write(data)
                        log_file.flush()
                    except OSError as e:  # a full disk: the run goes on, the log stops, the user is told
                        log_error = f"{e.strerror or e} (the log stops after {log_bytes:,} bytes)"
                        log_file = None
                    else:
                        log_bytes += len(data)
                analysis.feed(lines.feed(data))
                if gone:
                    # Our reader went away (`torchdoctor run ... | head`): close this pipe, so the command's next
                    # write to it fails (SIGPIPE, or EPIPE where it ignores SIGPIPE) as it would with no
                    # torchdoctor in between -- rather than running on with nobody reading its output.
                    analysis.feed(lines.flush())
                    sel.unregister(fd)
                    del outputs[fd]
                    pipe.close()
                    if reader_gone is None:
                        reader_gone = (name, last_data - start)
        for _, lines, _, _ in outputs.values():
            analysis.feed(lines.flush())
        sel.close()
        if status is None:
            _, st, ru = os.wait4(proc.pid, 0)
            status = (st, ru)
        end = exited_at if exited_at is not None else time.monotonic()
    finally:
        sigs.restore()
        if proc is not None:
            if status is None:  # we failed (a bug): do not leave the command running unseen
                _terminate(proc.pid)
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()

    st, ru = status
    sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
    code = 128 + sig if sig else os.WEXITSTATUS(st)
    proc.returncode = -sig if sig else code
    child_maxrss = int(ru.ru_maxrss) * 1024
    peak, peak_t, procs = mem.peak, mem.peak_t, mem.peak_procs
    # The kernel may have seen a higher peak between our samples -- but a forked child's ru_maxrss starts at
    # the parent's high-water RSS at fork time (it survives exec), so only a value clearly above it counts.
    if child_maxrss > peak and child_maxrss > 1.1 * own_rss + 16 * MIB:
        peak, peak_t, procs = child_maxrss, None, 1
    _, oom_after = cgroup_memory()
    oom_kills = None if oom_before is None or oom_after is None else oom_after - oom_before
    result = RunResult(
        argv=list(argv), pid=proc.pid, exit_code=code, signal=sig, duration_s=end - start,
        peak_rss=peak, peak_rss_t=peak_t, peak_rss_procs=procs, child_maxrss=child_maxrss,
        mem_total=mem.total, min_available=mem.min_avail, min_available_t=mem.min_avail_t,
        cgroup_limit=cg_limit, cgroup_oom_kills=oom_kills, pids_seen=mem.pids_seen,
        forwarded=sigs.forwarded, killed_by_us=sigs.killed_by_us, interval=interval,
        samples=mem.samples, log_findings=[], timeline=[], reader_gone=reader_gone, log_error=log_error,
    )
    # The kernel log is read (it can take a few seconds) when the command failed or was killed, when its output
    # says a process of it was SIGKILLed (a worker, a grandchild -- whatever the command's own exit status), and
    # when the cgroup's oom_kill counter rose.
    sigkilled = [k for k in analysis.kills() if k["signum"] == signal.SIGKILL]
    if code != 0 or sigkilled or oom_kills:
        result.kernel = read_kernel_oom(result.pids_seen | {k["pid"] for k in sigkilled if k["pid"]})
    if sigkilled:  # the log's process.killed finding is judged with what we saw ourselves
        confirmed, oom_ev = _oom_evidence(result)
        low = _memory_low(result)
        ev = list(oom_ev)
        if low is False:
            ev.append(_not_low_phrase(result))
        if confirmed is False and low is not False:
            confirmed = None  # no kernel line for the pids we know, but memory did run low: cannot rule it out
        analysis.set_run_evidence(oom_killer=confirmed, memory_low=low, evidence=[f"torchdoctor run: {e}" for e in ev],
                                  exit_code=code, host=socket.gethostname())
    analysis.set_exit(code)
    result.last_lines = analysis.last_lines()
    result.log_findings, result.timeline = log_findings, timeline = analysis.finish()
    result.findings = [exit_finding(result)]
    mf = memory_finding(result)
    if mf is not None:
        result.findings.append(mf)
    if analysis.error:
        result.findings.append(Finding("logs.analyzer-error", "info", "the log analyzer could not read this run",
                                       evidence=[analysis.error], fix=[], data={}))
    result.findings += log_findings
    return result


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _terminate(pid: int) -> None:
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


__all__ = ["RunResult", "WrapError", "run_command", "exit_finding", "memory_finding", "read_kernel_oom",
           "process_tree", "vm_rss", "read_meminfo", "cgroup_memory", "fmt_bytes", "cmdline"]

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
import shlex
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

_READ_CHUNK = 65536  # a pipe's default capacity: one read takes what it holds
_MAX_PARTIAL_LINE = 1 << 20  # a "line" longer than this is fed to the analyzer in pieces
_MAX_SAMPLES = 4000  # memory samples kept for --json; older ones are thinned, never the peaks
_DRAIN_IDLE_S = 1.0  # after the child exits: stop reading once the pipes are idle this long ...
_DRAIN_MAX_S = 5.0  # ... or this long at most (a daemonised grandchild may hold the pipes forever)
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

MEMORY_FIXES = [
    "Offload to NVMe instead of CPU: in the DeepSpeed config set zero_optimization.offload_optimizer.device "
    'and (ZeRO-3) offload_param.device to "nvme" with "nvme_path" on a fast local disk -- "cpu" offload '
    "keeps the optimizer states (and parameters) in host RAM, on every node",
    "Build the model under ZeRO-3 zero.Init so no rank materialises the full model in host RAM: "
    "`with deepspeed.zero.Init(config_dict_or_path=ds_config):` around construction (HF: create the "
    "TrainingArguments/HfDeepSpeedConfig with the ZeRO-3 config before from_pretrained; accelerate: "
    "zero3_init_flag: true)",
    "Start fewer ranks per node (torchrun --nproc_per_node 4 instead of 8, deepspeed --num_gpus 4): each rank "
    "loads its own copy of the checkpoint into host RAM before it is sharded",
    "Size it before the next try: `torchdoctor ds memory` estimates host and GPU memory per node for each "
    "ZeRO stage and offload choice",
]


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
                    except OSError:
                        log_file = None
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
        samples=mem.samples, log_findings=[], timeline=[], reader_gone=reader_gone,
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


# --------------------------------------------------------------------------------------- findings


def cmdline(argv: list[str], limit: int = 300) -> str:
    """The command as a shell would show it, on one line and at most ``limit`` characters."""
    def show(a: str) -> str:
        if shlex.quote(a) == a:
            return a
        return f'"{a}"' if not any(c in a for c in '"\\$`') else shlex.quote(a)

    s = " ".join(show(a) for a in argv).replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _ram(r: RunResult) -> tuple[int | None, str]:
    """The memory the tree was up against: the cgroup limit when it is tighter than the machine's RAM."""
    if r.kernel is not None and r.kernel.memcg_limit is not None:
        return r.kernel.memcg_limit, "cgroup limit"
    if r.cgroup_limit is not None and (r.mem_total is None or r.cgroup_limit < r.mem_total):
        return r.cgroup_limit, "cgroup limit"
    return r.mem_total, "RAM"


def _memory_low(r: RunResult) -> bool | None:
    """Did the samples see memory nearly run out (MemAvailable under 10% of MemTotal, or the tree's RSS within
    10% of a cgroup limit)? None when nothing was sampled."""
    if r.min_available is None and not r.peak_rss:
        return None
    total, what = _ram(r)
    low_avail = r.min_available is not None and bool(r.mem_total) and r.min_available < 0.1 * r.mem_total
    near_limit = what == "cgroup limit" and bool(total) and r.peak_rss > 0.9 * total
    return low_avail or near_limit


def _not_low_phrase(r: RunResult) -> str:
    total, what = _ram(r)
    s = (f"MemAvailable never fell below {fmt_bytes(r.min_available)} of {fmt_bytes(r.mem_total)}"
         if r.min_available is not None else "memory was never low")
    if what == "cgroup limit" and total:
        s += f", and the process tree stayed under 90% of its {fmt_bytes(total)} cgroup limit"
    return s + f" (sampled every {r.interval:g} s)"


def _peak_phrase(r: RunResult) -> str:
    if not r.peak_rss:
        return "peak RSS not measured: it ended before the first sample"
    total, what = _ram(r)
    s = f"peak RSS {fmt_bytes(r.peak_rss)}"
    if total:
        s += f" of {fmt_bytes(total)} {what} ({100 * r.peak_rss / total:.0f}%)"
    return s


def _memory_evidence(r: RunResult) -> list[str]:
    ev = []
    if r.peak_rss_t is not None:
        ev.append(f"peak RSS of the process tree: {fmt_bytes(r.peak_rss)} at {r.peak_rss_t:.1f} s "
                  f"({r.peak_rss_procs} process{'es' if r.peak_rss_procs != 1 else ''}; sum of VmRSS sampled "
                  f"every {r.interval:g} s, shared pages counted once per process)")
    elif r.peak_rss:
        ev.append(f"peak RSS: {fmt_bytes(r.peak_rss)} (the kernel's ru_maxrss of the command; the samples every "
                  f"{r.interval:g} s saw less)")
    else:
        ev.append("peak RSS: not measured (the command ended before the first sample found its processes, and "
                  "the kernel's ru_maxrss cannot be told apart from torchdoctor's own)")
    if r.min_available is not None:
        at = f" at {r.min_available_t:.1f} s" if r.min_available_t is not None else ""
        ev.append(f"lowest MemAvailable: {fmt_bytes(r.min_available)} of {fmt_bytes(r.mem_total)} MemTotal{at}")
    if r.cgroup_limit is not None:
        ev.append(f"cgroup memory limit: {fmt_bytes(r.cgroup_limit)}")
    return ev


def _oom_evidence(r: RunResult) -> tuple[bool | None, list[str]]:
    """(OOM confirmed? True / ruled out by a readable log: False / unknown: None, evidence lines)."""
    ev: list[str] = []
    confirmed: bool | None = None
    k = r.kernel
    if k is not None:
        if not k.readable:
            ev.append(k.source)
        elif k.oom_lines:
            confirmed = True
            ev += [f"kernel ({k.source}): {line}" for line in k.oom_lines]
            if k.memcg:
                ev.append(f"the OOM kill was confined to the cgroup {k.memcg} (CONSTRAINT_MEMCG, limit "
                          f"{fmt_bytes(k.memcg_limit)}): a job/container memory limit ran out, not the machine's RAM")
        elif k.unseen_oom_lines:
            ev.append(f"kernel log ({k.source}) has no OOM-killer entry for the processes torchdoctor saw, but it "
                      "has some for newer processes it did not see (short-lived ones of this command?):")
            ev += [f"kernel ({k.source}): {line}" for line in k.unseen_oom_lines]
        else:
            confirmed = False
            ev.append(f"kernel log ({k.source}) has no OOM-killer entry for this command's processes")
    if r.cgroup_oom_kills:
        confirmed = True
        ev.append(f"the cgroup's oom_kill counter rose by {r.cgroup_oom_kills} during the run")
    return confirmed, ev


def exit_finding(r: RunResult) -> Finding:
    """``process.exit``: how the command ended, and for SIGKILL whether the OOM killer did it."""
    cmd = cmdline(r.argv)
    d = r.duration_s
    data = {"exit_code": r.exit_code, "signal": r.signal_name, "duration_s": round(d, 3), "pid": r.pid,
            "peak_rss_bytes": r.peak_rss, "min_available_bytes": r.min_available, "mem_total_bytes": r.mem_total}
    ev = [f"command: {cmd}", f"pid {r.pid}, ran {d:.1f} s"]
    ev += [f"forwarded {name} at {t:.1f} s" for t, name in r.forwarded]
    confirmed, oom_ev = _oom_evidence(r)
    if r.signal is None and r.exit_code == 0:
        if confirmed:  # the command survived it (a worker restarted, a subprocess retried) -- still worth saying
            data["oom_killer"] = True
            return Finding("process.exit", "warn", f"exited 0 after {d:.1f} s, but the kernel's OOM killer killed a "
                           f"process of it ({_peak_phrase(r)})", evidence=ev + _memory_evidence(r) + oom_ev,
                           fix=list(MEMORY_FIXES), data=data)
        return Finding("process.exit", "ok", f"exited 0 after {d:.1f} s ({_peak_phrase(r)})",
                       evidence=ev + _memory_evidence(r), data=data)
    data["oom_killer"] = confirmed
    ev += _memory_evidence(r)
    if r.signal is not None or confirmed:  # "no OOM line" is noise for a plain `exit 1`
        ev += oom_ev
    if r.reader_gone is not None and (r.signal == signal.SIGPIPE or r.signal is None) and not confirmed:
        what, t = r.reader_gone
        how = (f"ended by SIGPIPE after {d:.1f} s" if r.signal is not None else
               f"exited with code {r.exit_code} after {d:.1f} s")
        ev.append(f"torchdoctor's {what} reader went away at {t:.1f} s (e.g. `| head`): torchdoctor closed the "
                  f"command's {what} pipe, so its next write there failed, as in a shell pipeline without torchdoctor")
        return Finding("process.exit", "info", f"{how}: nobody was reading its {what} any more", evidence=ev,
                       data={**data, "reader_gone": what})
    if r.signal is None:
        if confirmed:
            return Finding("process.exit", "fail",
                           f"exited with code {r.exit_code} after {d:.1f} s: the kernel's OOM killer killed a "
                           f"process of it ({_peak_phrase(r)})", evidence=ev, fix=list(MEMORY_FIXES), data=data)
        if r.forwarded:
            return Finding("process.exit", "info", f"exited with code {r.exit_code} after {d:.1f} s, after "
                           f"torchdoctor forwarded {r.forwarded[-1][1]} to it", evidence=ev, data=data)
        return Finding("process.exit", "warn", f"exited with code {r.exit_code} after {d:.1f} s",
                       evidence=ev, fix=["read the command's last error above (or in --log)"], data=data)
    name = r.signal_name
    if r.killed_by_us:
        return Finding("process.exit", "info", f"killed by SIGKILL after {d:.1f} s (sent by torchdoctor after the "
                       "third Ctrl-C)", evidence=ev, data=data)
    if any(n == name for _, n in r.forwarded):
        return Finding("process.exit", "info", f"ended by {name} after {d:.1f} s (forwarded by torchdoctor)",
                       evidence=ev, data=data)
    if r.signal == signal.SIGKILL:
        if confirmed:
            title = f"killed by the kernel's OOM killer (SIGKILL) after {d:.1f} s: {_peak_phrase(r)}"
        elif confirmed is False:
            title = (f"killed by SIGKILL after {d:.1f} s: {_peak_phrase(r)} -- no OOM-killer entry in the kernel "
                     "log: a scheduler limit or `kill -9` is likelier")
        else:
            title = (f"killed by SIGKILL after {d:.1f} s: {_peak_phrase(r)} -- the kernel's OOM killer is the "
                     "usual cause")
        if confirmed is not False:
            ev.append("a process killed while starting up with no traceback has usually run out of CPU RAM, the "
                      "machine's or its cgroup's (the kernel kills it; Python cannot print anything)")
        total, _ = _ram(r)
        if total and r.min_available is not None and r.min_available > 0.2 * total and not confirmed:
            ev.append(f"MemAvailable never fell below {fmt_bytes(r.min_available)} in the samples: a spike "
                      f"shorter than {r.interval:g} s, or something else sent SIGKILL")
        fix = list(MEMORY_FIXES)
        if r.kernel is not None and r.kernel.memcg:
            fix.insert(0, "Raise the job's memory limit: Slurm --mem / --mem-per-gpu, docker run --memory, "
                          "Kubernetes resources.limits.memory")
        if confirmed is not True:
            sched = ("check the job scheduler's record (Slurm: sacct -j JOBID -o State,ExitCode,MaxRSS,ReqMem,"
                     "Timelimit) and who else could `kill -9` it")
            fix = [sched, *fix] if confirmed is False else [*fix, "if it was not memory: " + sched]
        return Finding("process.exit", "fail", title, evidence=ev, fix=fix, data=data)
    fix = ["read the command's last output above (or in --log); run it under `python -X faulthandler` for a "
           "native stack trace"] if r.signal in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL) else []
    if confirmed:
        fix += MEMORY_FIXES
    return Finding("process.exit", "fail", f"killed by {name} after {d:.1f} s ({_peak_phrase(r)})",
                   evidence=ev, fix=fix, data=data)


def memory_finding(r: RunResult) -> Finding | None:
    """``process.memory``: host RAM nearly exhausted during a run that the exit finding does not blame on it."""
    if r.signal == signal.SIGKILL and not r.killed_by_us:
        return None  # process.exit already says it
    total, what = _ram(r)
    low_avail = (r.min_available is not None and r.mem_total and r.min_available < 0.1 * r.mem_total)
    near_limit = what == "cgroup limit" and total and r.peak_rss > 0.9 * total
    if not (low_avail or near_limit):
        return None
    title = (f"host memory nearly exhausted: MemAvailable fell to {fmt_bytes(r.min_available)} of "
             f"{fmt_bytes(r.mem_total)}" if low_avail else f"the process tree came within 10% of its {what}")
    return Finding("process.memory", "warn", f"{title} ({_peak_phrase(r)})", evidence=_memory_evidence(r),
                   fix=list(MEMORY_FIXES), data={"peak_rss_bytes": r.peak_rss, "min_available_bytes": r.min_available,
                                                 "limit_bytes": total})


__all__ = ["RunResult", "WrapError", "run_command", "exit_finding", "memory_finding", "read_kernel_oom",
           "process_tree", "vm_rss", "read_meminfo", "cgroup_memory", "fmt_bytes", "cmdline"]

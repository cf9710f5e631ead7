"""Run a command as a transparent child and explain how it ended (the engine of ``torchdoctor run``).

A DeepSpeed run that exhausts host RAM while loading is SIGKILLed by the kernel with no traceback: the
log just stops. Only something *outside* the process can say what happened, so :func:`run_command` runs the
command as a child and watches it, with two helpers:

* :mod:`.process` -- the child itself: started in its own process group (SIGINT, SIGTERM, SIGHUP and
  SIGQUIT sent to us are forwarded to that whole group, the third SIGINT sends SIGKILL), and every
  ``interval`` seconds the summed ``VmRSS`` of its whole process tree and the machine's ``MemAvailable``;
* :mod:`.pump` -- its output: stdout and stderr passed through unchanged as they arrive (and appended to
  a log file if asked), decoded (UTF-8, a line that is not as Latin-1, a UTF-16 stream as UTF-16) and fed to
  the log :class:`~torchdoctor.logs.analyze.Analyzer` in blocks of whole lines.

This module holds the end of the run: when the command fails or is killed, when its output says one of its
processes was SIGKILLed (a worker, a grandchild: even if the command then exits 0), or when the cgroup's
``oom_kill`` counter rose, it reads the kernel log (best effort: ``dmesg -T``, ``/dev/kmsg``, ``journalctl -k``)
for OOM-killer lines about the processes it saw and those the output names. That evidence, with the samples,
goes to the analyzer's ``process.killed`` finding (``Analyzer.set_run_evidence``): a logged SIGKILL is blamed on
the OOM killer only when the kernel says so, and is said not to be the OOM killer when the kernel log is
readable without such a line and memory never ran low. The wrapper itself never prints during the run: the
caller renders :class:`RunResult`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from .._system import (
    MIB,
    UNREADABLE_ENV,
    cgroup_limit_readable,
    cgroup_memory,
    fmt_bytes,
    read_meminfo,
    read_text,
    unreadable,
)
from ..findings import Finding
from ..runvars import REPORT_DIR_VAR
from .exit_findings import (  # noqa: F401 -- re-exported: the findings are part of this module's API
    MEMORY_FIXES,
    _memory_low,
    _not_low_phrase,
    _oom_evidence,
    _unknown_limit_phrase,
    cmdline,
    exit_finding,
    memory_finding,
)
from .process import Memory, Signals, WrapError, process_tree, spawn, terminate, vm_rss
from .pump import Analysis, Pump
from .result import KernelLog, RunResult

_DRAIN_IDLE_S = 1.0  # after the child exits: stop reading once the pipes are idle this long ...
_DRAIN_MAX_S = 5.0  # ... or this long at most (a daemonised grandchild may hold the pipes forever)


# --------------------------------------------------------------------------------------- kernel log

_OOM_LINE = re.compile(r"Killed process (\d+)|oom-kill:.*?\bpid=(\d+)|Out of memory.*?process (\d+)")


def memcg_limit(path: str) -> int | None:
    """The memory limit of the cgroup ``path`` (as the kernel names it, e.g. ``/slurm/uid_1/job_7``)."""
    if unreadable("cgroup"):
        return None
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
            head, _, msg = rec.decode("utf-8", "replace").partition(";")
            fields = head.split(",")  # priority, sequence, microseconds since boot, flags
            usec = fields[2] if len(fields) > 2 and fields[2].isdigit() else None
            # shown as plain dmesg shows it: the time keeps an old record from being taken for this command's
            out.append((f"[{int(usec) / 1e6:12.6f}] " if usec else "") + msg.rstrip("\n"))
    finally:
        os.close(fd)
    return "\n".join(out) if out else None


_WALL = re.compile(r"^\[(\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})\]")  # dmesg -T: [Fri Dec  4 03:32:50 2026]
_SINCE_BOOT = re.compile(r"^\[\s*(\d+\.\d+)\]")  # dmesg, /dev/kmsg: [  123.456789], seconds the system ran


def line_time(line: str) -> float | None:
    """When a kernel-log line was written (seconds since the epoch), where its prefix says; None otherwise."""
    m = _WALL.match(line)
    if m:
        try:
            return time.mktime(time.strptime(m.group(1), "%a %b %d %H:%M:%S %Y"))
        except (ValueError, OverflowError):
            return None
    m = _SINCE_BOOT.match(line)
    if m:  # the kernel's clock, like CLOCK_MONOTONIC, does not count suspend
        return time.time() - (time.monotonic() - float(m.group(1)))
    return None


def _oom_lines(text: str, since: float | None) -> Iterator[tuple[int, str]]:
    """(pid, line) of each OOM-killer line, leaving out those the log dates before ``since`` (seconds since the
    epoch, with 2 s of slack: dmesg -T prints whole seconds): such a line is about another process that had the
    pid before, or about another job -- pids wrap around (at 32768 by default) and the log keeps days."""
    for line in text.splitlines():
        m = _OOM_LINE.search(line)
        if not m:
            continue
        t = line_time(line) if since is not None else None
        if t is not None and t < since - 2.0:
            continue
        yield int(next(g for g in m.groups() if g)), line.strip()


def parse_oom_lines(text: str, pids: set[int], since: float | None = None) -> tuple[list[str], str | None]:
    """The OOM-killer lines of a kernel log that name one of ``pids`` (the last 4) and are not older than ``since``,
    and the cgroup whose limit ran out when the kill was confined to one (``constraint=CONSTRAINT_MEMCG ...
    oom_memcg=PATH``)."""
    lines, memcg = [], None
    for pid, line in _oom_lines(text, since):
        if pid in pids:
            lines.append(line)
            c = re.search(r"constraint=CONSTRAINT_MEMCG\b.*?\boom_memcg=([^,\s]+)", line)
            if c:
                memcg = c.group(1)
    return lines[-4:], memcg


def _newer_oom_lines(text: str, pids: set[int], since: float | None = None) -> list[str]:
    """OOM-killer lines (the last 4) about pids not in ``pids`` that may still be the command's: written since it
    started, where the log dates them; else (no date) not older than the oldest of ``pids``."""
    first = min(pids)
    out = []
    for pid, line in _oom_lines(text, since):
        if pid in pids:
            continue
        dated = since is not None and line_time(line) is not None
        if dated or pid >= first:
            out.append(line)
    return out[-4:]


def read_kernel_oom(pids: set[int], since: float | None = None) -> KernelLog:
    """The kernel's OOM-killer lines about ``pids``, from the first kernel log we are allowed to read; with
    ``since`` (when the command started, seconds since the epoch), none the log dates before it."""
    if unreadable("kernel-log"):
        return KernelLog(False, f"kernel log not readable (hidden by {UNREADABLE_ENV}=kernel-log)")
    sources = (
        ("dmesg -T", lambda: _run_quiet(["dmesg", "-T"], 3.0)),
        ("/dev/kmsg", _read_kmsg),
        ("journalctl -k", lambda: _run_quiet(["journalctl", "-k", "-b", "-q", "--no-pager", "-n", "20000"], 5.0)),
    )
    for name, read in sources:
        text = read()
        if text is None:
            continue
        lines, memcg = parse_oom_lines(text, pids, since)
        unseen = _newer_oom_lines(text, pids, since) if not lines and pids else []
        return KernelLog(True, name, lines, memcg, memcg_limit(memcg) if memcg else None, unseen)
    return KernelLog(False, "kernel log not readable (dmesg -T, /dev/kmsg and journalctl -k refused or absent)")


# --------------------------------------------------------------------------------------- the run


def run_command(argv: list[str], *, log_file: Any = None, interval: float = 0.5,
                out_fd: int = 1, err_fd: int = 2, report_dir: str | None = None,
                env: dict[str, str] | None = None, watch: Any = None, on_verdict: Any = None) -> RunResult:
    """Run ``argv``, pass its output through to ``out_fd``/``err_fd``, watch it, and say how it ended.

    Args:
        argv: the command and its arguments (looked up on PATH like a shell does).
        log_file: an open binary file; every byte the command writes (stdout and stderr, in arrival order)
            is appended to it and flushed at once.
        interval: seconds between memory samples.
        report_dir: where the numerics monitor's report files are looked for (besides the current directory);
            exported to the command as ``TORCHDOCTOR_REPORT_DIR``.
        env: more variables for the command's environment (``run --numerics``'s bootstrap).
        watch: a :class:`~.watch.Watch` of the job's ranks: while the command runs, a hang (or the first Ctrl-C /
            SIGTERM) makes it collect every rank's state; ``on_verdict(watch)`` is then called (to print the verdict
            at once) and the job is ended.

    Raises:
        WrapError: the command could not be started (exit_code 127: not found, 126: not executable).
    """
    if not argv:
        raise WrapError("no command given", 2)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()

    start = time.monotonic()
    sigs = Signals(start)
    sigs.install()
    proc = None
    status: tuple[int, Any] | None = None  # (wait status, rusage)
    try:
        cg_limit, oom_before = cgroup_memory()
        cg_readable = cgroup_limit_readable()
        # a forked child's ru_maxrss starts at this process's own high-water mark (the mm is copied with its
        # hiwater and exec keeps the maximum), not at its current RSS: compare against the high-water mark
        own_rss = max(vm_rss(os.getpid()) or 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        started_at = time.time()  # for the kernel log: an OOM line dated before it is not about this command
        extra = {**(env or {}), **({REPORT_DIR_VAR: os.path.abspath(report_dir)} if report_dir else {})}
        proc = spawn(argv, extra)
        start = time.monotonic()
        sigs.start = start
        sigs.attach(proc.pid)
        if watch is not None:
            watch.start, watch.root = start, proc.pid
            sigs.hold = lambda sig: watch.worth_holding(time.monotonic())
        analysis = Analysis()
        mem = Memory(proc.pid, start)
        mem.sample(start)
        next_sample = start + interval

        pump = Pump([(proc.stdout, out_fd, "stdout"), (proc.stderr, err_fd, "stderr")], log_file, analysis, start)
        exited_at = None
        while pump.open:
            now = time.monotonic()
            if status is None:
                if now >= next_sample:
                    mem.sample(now)
                    next_sample = max(next_sample + interval, now + interval / 4)
                pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    status, exited_at = (st, ru), now
                elif watch is not None:
                    _watch_step(watch, now, sigs, proc.pid, on_verdict)
            elif now - exited_at > _DRAIN_MAX_S or now - max(exited_at, pump.last_data or exited_at) > _DRAIN_IDLE_S:
                break  # the command is gone but something it started still holds the pipes
            pump.poll(0.1 if status is not None else max(0.0, min(next_sample - now, 0.25)))
        pump.close()
        if status is None:
            _, st, ru = os.wait4(proc.pid, 0)
            status = (st, ru)
        end = exited_at if exited_at is not None else time.monotonic()
    finally:
        sigs.release()
        sigs.restore()
        if proc is not None:
            if status is None:  # we failed (a bug): do not leave the command running unseen
                terminate(proc.pid)
            if watch is not None:
                _end_ranks(watch, proc.pid)
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
        cgroup_limit=cg_limit, cgroup_oom_kills=oom_kills, pids_seen=mem.pids_seen, cgroup_readable=cg_readable,
        forwarded=sigs.forwarded, killed_by_us=sigs.killed_by_us, interval=interval,
        samples=mem.samples, log_findings=[], timeline=[], reader_gone=pump.reader_gone, log_error=pump.log_error,
    )
    # The kernel log is read (it can take a few seconds) when the command failed or was killed, when its output
    # says a process of it was SIGKILLed (a worker, a grandchild -- whatever the command's own exit status), and
    # when the cgroup's oom_kill counter rose.
    result.log_kills = analysis.kills()
    sigkilled = [k for k in result.log_kills if k["signum"] == signal.SIGKILL]
    if code != 0 or sigkilled or oom_kills:
        result.kernel = read_kernel_oom(result.pids_seen | {k["pid"] for k in sigkilled if k["pid"]}, started_at)
    if sigkilled:  # the log's process.killed finding is judged with what we saw ourselves
        confirmed, oom_ev = _oom_evidence(result)
        low = _memory_low(result)
        ev = list(oom_ev)
        if low is False:
            ev.append(_not_low_phrase(result))
        elif low is None and not result.cgroup_readable:
            ev.append(_unknown_limit_phrase(result))
        if confirmed is False and low:
            confirmed = None  # no kernel line for the pids we know, but memory did run low: cannot rule it out
        analysis.set_run_evidence(oom_killer=confirmed, memory_low=low, evidence=[f"torchdoctor run: {e}" for e in ev],
                                  exit_code=code, host=socket.gethostname())
    analysis.set_exit(code)
    result.last_lines = analysis.last_lines()
    log_findings, result.timeline = analysis.finish()
    log_findings = _numerics(log_findings, analysis, report_dir, started_at)
    result.log_findings = log_findings
    result.findings = [exit_finding(result)]
    mf = memory_finding(result)
    if mf is not None:
        result.findings.append(mf)
    if analysis.error:
        result.findings.append(Finding("logs.analyzer-error", "info", "the log analyzer could not read this run",
                                       evidence=[analysis.error], fix=[], data={}))
    result.findings += log_findings
    return result


def _watch_step(watch: Any, now: float, sigs: Signals, root: int, on_verdict: Any) -> None:
    """One look at the job's ranks; on a hang or a held signal: the verdict, then the end of the job."""
    try:
        action = watch.step(now, sigs.held)
        if action == "judge":
            if on_verdict is not None:
                on_verdict(watch)
            held = list(sigs.held)
            sigs.release()
            watch.end_job(root, held[0] if held else signal.SIGTERM)
        elif action == "kill":
            watch.kill_rest(root)
    except Exception as e:  # noqa: BLE001 -- a bug here must not cost the run: say it, forward what was held
        sigs.release()
        with contextlib.suppress(OSError):
            os.write(2, f"torchdoctor run: watching the ranks failed: {type(e).__name__}: {e}\n".encode())
        watch.trigger = watch.trigger or "failed"
        watch.verdict_done = True


def _end_ranks(watch: Any, root: int) -> None:
    """The command is gone: no rank of it is left behind (a stopped rank, one that ignored the end)."""
    with contextlib.suppress(Exception):
        watch.next_poll = 0.0
        watch.poll(time.monotonic())
        if any(p.local and p.state != "gone" for p in watch.procs.values()):
            watch.kill_rest(root)


def _numerics(findings: list[Finding], analysis: Analysis, report_dir: str | None, since: float) -> list[Finding]:
    """The log findings with the numerics monitor's verdict (``numerics.nonfinite``) first, its traceback folded
    in; a bug here costs only that finding."""
    try:
        from .numerics_verdict import fold, nonfinite_finding, read_reports

        dirs = [d for d in (report_dir, os.getcwd()) if d]
        reports, problems = read_reports(dirs, since)
        nf = nonfinite_finding(reports, analysis.numerics.detections, problems, dirs)
        return fold(findings, nf)
    except Exception as e:  # noqa: BLE001
        return [*findings, Finding("logs.analyzer-error", "info", "the numerics verdict could not be made",
                                   evidence=[f"{type(e).__name__}: {e}"], fix=[], data={})]


__all__ = ["RunResult", "WrapError", "run_command", "exit_finding", "memory_finding", "read_kernel_oom",
           "process_tree", "vm_rss", "read_meminfo", "cgroup_memory", "fmt_bytes", "cmdline"]

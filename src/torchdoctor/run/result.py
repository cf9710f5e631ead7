"""What ``torchdoctor run`` observed about one run of a command (:class:`RunResult`), and what the kernel log said
about it (:class:`KernelLog`): the data :mod:`.supervisor` collects and :mod:`.exit_findings` judges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._system import GIB
from ..findings import Finding
from ..logs.analyze import signal_name as signame


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
    cgroup_readable: bool = True  # whether a memory cgroup's limit could be read (False: a limit may be unseen)
    log_kills: list[dict] = field(default_factory=list)  # processes the output says a signal killed (pid, rank, ...)

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

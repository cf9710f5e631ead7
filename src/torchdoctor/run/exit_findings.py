"""The findings of ``torchdoctor run`` about the command itself: ``process.exit`` (how it ended; for SIGKILL, whether
the OOM killer did it, with what evidence) and ``process.memory`` (host RAM nearly exhausted). Pure functions of a
:class:`~torchdoctor.run.result.RunResult`; :mod:`.supervisor` runs the command and collects it.
"""

from __future__ import annotations

import shlex
import signal
from typing import TYPE_CHECKING

from .._system import fmt_bytes
from ..findings import Finding
from ..logs.judge_process import SIGKILL_OTHER_SENDERS, SIGKILL_SENDERS

if TYPE_CHECKING:
    from .result import RunResult

#: Signals a program dies of by itself (a crash, not a kill), as ``run`` names them.
_CRASHES = {signal.SIGSEGV: "a segmentation fault", signal.SIGBUS: "a bus error", signal.SIGABRT: "an abort",
            signal.SIGILL: "an illegal instruction", signal.SIGFPE: "a floating-point exception"}

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



def cmdline(argv: list[str], limit: int = 300) -> str:
    """The command as a shell would show it, on one line and at most ``limit`` characters."""
    def show(a: str) -> str:
        if shlex.quote(a) == a:
            return a
        return f'"{a}"' if not any(c in a for c in '"\\$`') else shlex.quote(a)

    s = " ".join(show(a) for a in argv).replace("\n", " ")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _ram(r: RunResult) -> tuple[int | None, str]:
    """The memory the tree was up against: the cgroup limit when it is tighter than the machine's RAM (None: a
    cgroup the kernel names, whose limit could not be read)."""
    if r.kernel is not None and r.kernel.memcg is not None:
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
    if low_avail or near_limit:
        return True
    if what == "cgroup limit" and not total or what == "RAM" and not r.cgroup_readable:
        return None  # a cgroup limit this process cannot read may have been near: "never low" is not known
    return False


def _not_low_phrase(r: RunResult) -> str:
    total, what = _ram(r)
    s = (f"MemAvailable never fell below {fmt_bytes(r.min_available)} of {fmt_bytes(r.mem_total)}"
         if r.min_available is not None else "memory was never low")
    if what == "cgroup limit" and total:
        s += f", and the process tree stayed under 90% of its {fmt_bytes(total)} cgroup limit"
    return s + f" (sampled every {r.interval:g} s)"


def _unknown_limit_phrase(r: RunResult) -> str:
    return (f"its memory cgroup's limit could not be read, so whether memory ran low is not known (MemAvailable "
            f"never fell below {fmt_bytes(r.min_available)} of the machine's {fmt_bytes(r.mem_total)}, but a "
            "container's limit may be far lower)")


def _peak_phrase(r: RunResult) -> str:
    if not r.peak_rss:
        return "peak RSS not measured: it ended before the first sample"
    total, what = _ram(r)
    s = f"peak RSS {fmt_bytes(r.peak_rss)}"
    if total:
        s += f" of {fmt_bytes(total)} {what} ({100 * r.peak_rss / total:.0f}%)"
    elif what == "cgroup limit":
        s += " (its cgroup's limit could not be read)"
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
    # "no OOM line" is noise for a plain `exit 1` or a segfault: only a SIGKILL (or a confirmed kill) needs it
    if r.signal == signal.SIGKILL or confirmed or (r.signal is not None and r.signal not in _CRASHES):
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
        cause = next((f for f in r.log_findings if f.severity == "fail"), None)
        if cause is not None:
            return Finding("process.exit", "warn", f"exited with code {r.exit_code} after {d:.1f} s: see {cause.id}",
                           evidence=ev + [f"{cause.id}: {cause.title}"],
                           fix=["read the command's last error above (or in --log)"], data=data)
        if r.last_lines:
            ev += ["its last error lines:"] + [f"  {x}" for x in r.last_lines]
        return Finding("process.exit", "warn", f"exited with code {r.exit_code} after {d:.1f} s, no known failure "
                       "signature in its output" + (f"; last: {r.last_lines[-1][:120]}" if r.last_lines else ""),
                       evidence=ev, fix=["read the command's last error lines above (or in --log); a Python "
                                         "program that exits non-zero without a traceback called sys.exit(N)"],
                       data={**data, "last_lines": list(r.last_lines)})
    name = r.signal_name
    if r.killed_by_us:
        return Finding("process.exit", "info", f"killed by SIGKILL after {d:.1f} s (sent by torchdoctor after the "
                       "third Ctrl-C)", evidence=ev, data=data)
    if any(n == name for _, n in r.forwarded):
        return Finding("process.exit", "info", f"ended by {name} after {d:.1f} s (forwarded by torchdoctor)",
                       evidence=ev, data=data)
    if r.signal == signal.SIGKILL:
        low = _memory_low(r)
        if confirmed:
            title = f"killed by the kernel's OOM killer (SIGKILL) after {d:.1f} s: {_peak_phrase(r)}"
        elif confirmed is False:
            title = (f"killed by SIGKILL after {d:.1f} s: {_peak_phrase(r)} -- no OOM-killer entry in the kernel "
                     "log: a scheduler limit or `kill -9` is likelier")
        elif low:
            title = (f"killed by SIGKILL after {d:.1f} s: {_peak_phrase(r)} -- memory ran low, so likely the "
                     "kernel's OOM killer (no kernel-log line for its processes confirms it)")
        elif low is False:
            title = (f"killed by SIGKILL after {d:.1f} s: {_peak_phrase(r)} -- memory never ran low in the samples: "
                     "a scheduler (time limit, scancel, preemption) or `kill -9` is likelier than the OOM killer")
        else:
            title = (f"killed by SIGKILL after {d:.1f} s: {_peak_phrase(r)} -- the kernel's OOM killer, a scheduler "
                     "(time limit, scancel, preemption) or `kill -9`: nothing here tells them apart")
        if confirmed is not False and low is not False:
            ev.append("a process killed while starting up with no traceback has usually run out of CPU RAM, the "
                      "machine's or its cgroup's (the kernel kills it; Python cannot print anything)")
        total, _ = _ram(r)
        if low is None and not r.cgroup_readable and r.min_available is not None:
            ev.append(_unknown_limit_phrase(r))
        elif total and r.min_available is not None and r.min_available > 0.2 * total and not confirmed:
            ev.append(f"MemAvailable never fell below {fmt_bytes(r.min_available)} in the samples: a spike "
                      f"shorter than {r.interval:g} s, or something else sent SIGKILL")
        fix = list(MEMORY_FIXES)
        if r.kernel is not None and r.kernel.memcg:
            fix.insert(0, "Raise the job's memory limit: Slurm --mem / --mem-per-gpu, docker run --memory, "
                          "Kubernetes resources.limits.memory")
        if confirmed is not True:
            sched = ("check the job scheduler's record (Slurm: sacct -j JOBID -o State,ExitCode,MaxRSS,ReqMem,"
                     "Timelimit) and who else could `kill -9` it")
            if confirmed is False:  # the kernel log was read: the OOM killer is ruled out, and memory cures with it
                fix = [SIGKILL_OTHER_SENDERS]
            elif low is False:
                fix = [SIGKILL_SENDERS, *fix]
            else:
                fix = [*fix, "if it was not memory: " + sched]
        return Finding("process.exit", "fail", title, evidence=ev, fix=fix, data=data)
    fix = ["read the command's last output above (or in --log); run it under `python -X faulthandler` for a "
           "native stack trace"] if r.signal in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL) else []
    if confirmed:
        fix += MEMORY_FIXES
    crash = _CRASHES.get(r.signal)
    if crash is not None:
        if r.signal == signal.SIGBUS:
            fix.append("a bus error in training is usually /dev/shm too small for DataLoader workers or NCCL: "
                       "docker run --ipc=host or --shm-size=16g, or fewer num_workers")
        if r.signal == signal.SIGABRT:
            fix.append("an abort follows a fatal C++ error (terminate called after throwing ..., an NCCL watchdog, "
                       "a failed assertion): the lines just before it say which")
        ev += [f"its last lines: {x}" for x in r.last_lines[-3:]]
        return Finding("process.exit", "fail", f"crashed with {crash} ({name}) after {d:.1f} s ({_peak_phrase(r)})",
                       evidence=ev, fix=fix, data=data)
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

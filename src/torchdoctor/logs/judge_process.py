"""Judging the processes a log saw die: which rank, which signal, and -- for SIGKILL -- who most likely sent it
(the OOM killer, the scheduler, a watchdog), with what ``torchdoctor run`` saw itself when it ran the command.
"""

from __future__ import annotations

from ..findings import Finding
from .common import signal_name


def who(k: dict) -> str:
    """``rank 3 (pid 12) on node-1``; ``local rank 2 (pid 29736)`` when only torchrun's local_rank is known (the
    global rank is local_rank + node_rank x nproc_per_node, which the log does not say)."""
    if k.get("rank") is not None:
        s = f"rank {k['rank']}"
    elif k.get("local_rank") is not None:
        s = f"local rank {k['local_rank']}"
    else:
        s = "a process"
    if k.get("pid"):
        s += f" (pid {k['pid']})"
    if k.get("host"):
        s += f" on {k['host']}"
    return s


# Who sends SIGKILL besides the OOM killer: the same list whichever way the kernel log was (or could not be) read.
SIGKILL_OTHER_SENDERS = (
    "who else sends SIGKILL, and how to tell: the job scheduler at its time limit, on scancel or on preemption "
    "(Slurm: sacct -j JOBID -o JobID,State,ExitCode,Elapsed,Timelimit,MaxRSS,ReqMem -- State TIMEOUT, CANCELLED, "
    "PREEMPTED or OUT_OF_MEMORY), a `kill -9` by a user or a watchdog, a launcher stopping the other ranks after one "
    "failed (look for the first rank that failed)")
SIGKILL_SENDERS = SIGKILL_OTHER_SENDERS + "; the OOM killer leaves a 'Killed process PID' line in dmesg -T"
_LOCAL = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}


def same_host(a: str, b: str) -> bool:
    """torchrun names this machine ``localhost`` in its summary (single-node runs); a domain may be added or not."""
    a, b = a.lower(), b.lower()
    return a == b or a in _LOCAL or b in _LOCAL or a.split(".")[0] == b.split(".")[0]


class ProcessJudge:
    """Mixin: ``_judge_process``."""

    def _judge_process(self) -> list[Finding]:
        out = []
        kills = [x for x in self._exits if x["signum"] is not None]
        exits = [x for x in self._exits if x["signum"] is None]
        data_common = {"host_oom_lines": list(self._host_oom), "cpu_memory_percent_max": self._cpu_mem_pct_max,
                       "cancelled": self._cancel}
        if kills:
            primary = next((k for k in kills if k["signum"] == 9), None) or next(
                (k for k in kills if k["signum"] != 15), kills[0])
            sig = primary["signum"]
            culprit = who(primary)
            ev = [f"line {k['line']}: {k['text']}" for k in kills[:4]]
            if len(kills) > 4:
                ev.append(f"... {len(kills) - 4} more")
            ev += [f"line {h['line']}: {h['text']}" for h in self._host_oom[:2]]
            if self._cpu_mem_pct_max is not None:
                ev.append(f"DeepSpeed's last host-memory report: {self._cpu_mem_last['used_gb']} GB used "
                          f"({self._cpu_mem_last['percent']}%), peak {self._cpu_mem_pct_max}%")
            if self._cancel:
                ev.append(f"line {self._cancel['line']}: {self._cancel['text']}")
            fix: list[str] = []
            sev = "fail"
            # what `torchdoctor run` saw on this machine; a kill reported for another host is not covered by it
            run = self._run
            if run is not None and primary["host"] and run.get("host") and not same_host(primary["host"], run["host"]):
                run = None
            if sig == 9:
                fix = ["dmesg -T | grep -i oom (or journalctl -k | grep -i oom) on that host confirms an OOM kill"]
                if self._deepspeed:
                    fix += ["torchdoctor ds memory --params <N> --config ds.json estimates the host RAM per node for "
                            "your ZeRO setup: CPU offload (offload_optimizer / offload_param to cpu) and loading the "
                            "full model on every rank need it",
                            "with ZeRO-3, offload to NVMe instead of CPU, build the model under deepspeed.zero.Init "
                            "(HF: from_pretrained with the DeepSpeed config set up first), use fewer dataloader "
                            "workers"]
                else:
                    fix += ["host RAM per node: every rank that loads the whole model holds a copy -- load it once "
                            "and lazily (from_pretrained(..., low_cpu_mem_usage=True), torch.load(..., mmap=True), "
                            "safetensors), fewer ranks or dataloader workers per node, or a node with more RAM"]
                if self._cancel:
                    cause = f"the job was cancelled by Slurm ({self._cancel['reason'].lower()}): see process.cancelled"
                elif self._host_oom_n:
                    cause = "the kernel's OOM killer (confirmed by the log): host RAM ran out"
                elif run is not None and run["oom_killer"]:
                    cause = "the kernel's OOM killer (confirmed by the kernel log torchdoctor run read): memory ran out"
                    fix = fix[1:]
                elif run is not None and run["oom_killer"] is False:
                    cause = ("not the kernel's OOM killer: torchdoctor run found no OOM-killer entry for the "
                             "command's processes in the kernel log, and memory never ran low -- something else sent "
                             "SIGKILL")
                    fix = [SIGKILL_OTHER_SENDERS]
                    if run.get("exit_code") == 0:
                        sev = "warn"  # the command carried on and succeeded
                elif run is not None and run["memory_low"] is False and (self._cpu_mem_pct_max or 0) < 80:
                    cause = ("host memory never ran low while torchdoctor run watched, so another sender (a "
                             "scheduler's time limit, scancel, preemption, `kill -9`) is likelier than the OOM "
                             "killer (no kernel-log line for the command's processes tells either way)")
                    fix = [SIGKILL_SENDERS, *fix]
                elif run is not None and run["memory_low"]:
                    cause = ("likely the kernel's OOM killer: memory ran low while torchdoctor run watched (the "
                             "kernel log, which would confirm it, could not be read)")
                elif (self._cpu_mem_pct_max or 0) >= 80:
                    cause = (f"likely the kernel's OOM killer: host RAM ran low (DeepSpeed last reported "
                             f"{self._cpu_mem_pct_max:g}% of host memory in use)")
                else:
                    cause = ("the log does not say who sent it: it could be the kernel's OOM killer (host RAM ran "
                             "out) or the job scheduler (a time limit, scancel, preemption), a `kill -9`, or a "
                             "launcher killing the other ranks after one failed")
                    fix = [fix[0], SIGKILL_SENDERS, *fix[1:]]
                if run is not None:
                    ev += run["evidence"]
            elif sig == 6:
                cause = "an abort (a C++ exception: NCCL watchdog, CUDA error)"
                if any(f.failed for f in self._families):
                    cause = "an abort after the communication failure above"
                    sev = "warn"  # explained (and failed) by the comm finding
                fix = ["the cause is the error printed just before the abort; see the other findings"]
            elif sig in (11, 4, 8):
                cause = {11: "a segmentation fault", 4: "an illegal instruction", 8: "a floating-point exception"}[sig]
                cause += (" in native code (a C/C++/CUDA extension built for another torch, Python or CPU, or a "
                          "driver mismatch)")
                fix = ["rerun with python -X faulthandler (or PYTHONFAULTHANDLER=1) to get the Python stack of the "
                       "crash; gdb -batch -ex bt python core (or coredumpctl gdb) for the native one",
                       "torchdoctor env checks that torch, the CUDA toolkit and prebuilt extensions match; reinstall "
                       "extensions (flash-attn, apex, DeepSpeed ops, bitsandbytes) against this torch"]
            elif sig == 7:
                cause = "a bus error: usually /dev/shm too small for dataloader workers or NCCL"
                fix = ["give the container --ipc=host or a larger --shm-size; or use fewer dataloader workers"]
            elif sig == 15:
                sev = "warn"
                cause = ("the scheduler stopped the job" if self._cancel else
                         "the launcher or the scheduler stopped it (torchrun sends SIGTERM to the other ranks after "
                         "one fails)")
                fix = ["look for the first rank that failed; if a time limit stopped the job, raise it or resume "
                       "from a checkpoint"]
            else:
                cause = f"signal {signal_name(sig)}"
            verb = "crashed with" if sig in (4, 6, 7, 8, 11) else "was killed by"
            core = " (core dumped)" if any("core dumped" in k["text"] for k in kills) else ""
            title = f"{culprit} {verb} {signal_name(sig)} ({-sig}){core}: {cause}"
            out.append(Finding("process.killed", sev, title, ev, fix,
                               {"kills": kills, "host_oom": self._host_oom_n > 0, **data_common}))
        if self._cancel:
            out.append(self._cancelled())
        if exits:
            first = exits[0]
            codes = sorted({x["code"] for x in exits})
            ev = [f"line {x['line']}: {x['text']}" for x in exits[:3]]
            if not self._tb_n:  # no traceback to point at: quote the end of the log
                ev += [f"last lines: {x}" for x in self.last_lines(4)]
            out.append(Finding(
                "process.exit-code", "warn",
                f"a training process exited with code {', '.join(map(str, codes))}"
                + (f" ({first['source']})" if first["source"] else ""),
                ev, ["the cause is the first error or traceback above the exit line; see the other findings"],
                {"exits": exits}))
        if not kills and self._host_oom_n:
            out.append(Finding(
                "process.killed", "fail", "the kernel's OOM killer killed a process (host RAM ran out)",
                [f"line {h['line']}: {h['text']}" for h in self._host_oom[:3]],
                ["torchdoctor ds memory --params <N> --config ds.json estimates the host RAM per node for your ZeRO "
                 "setup", "dmesg -T | grep -i oom shows which process was killed"],
                {"kills": [], "host_oom": True, **data_common}))
        return out

    def _cancelled(self) -> Finding:
        """Slurm's own line that it cancelled the job or a step, and why (slurmstepd's reason words)."""
        c = self._cancel
        why = c["reason"]
        what = f"{'job' if c['what'] == 'JOB' else 'job step'} {c['id']}" + (f" on {c['node']}" if c["node"] else "")
        fixes = {
            "TIME LIMIT": "the job reached its time limit (sbatch --time): raise it within the partition's limit, or "
                          "checkpoint and resume -- sbatch --signal=B:USR1@300 gives the script 5 minutes' notice "
                          "to save, and --requeue restarts it to resume from the last checkpoint",
            "PREEMPTION": "a job of higher priority preempted it: submit with --requeue and resume from a checkpoint, "
                          "or use a partition or QOS without preemption",
            "NODE FAILURE": "the node failed (slurmctld's log says why): resubmit with --exclude=NODE and tell the "
                            "cluster's admins",
        }
        fix = [fixes.get(why, "no reason in the line: a user or an admin ran scancel, or Slurm stopped it for a "
                              "reason of its own -- sacct -j JOBID -o JobID,State,ExitCode,Reason,Elapsed,Timelimit "
                              "says which"),
               "sacct -j JOBID -o JobID,State,ExitCode,Elapsed,Timelimit shows the state Slurm recorded"]
        reason = "by scancel or an admin (no reason given)" if why == "scancel" else f"due to {why.lower()}"
        return Finding("process.cancelled", "fail", f"Slurm cancelled {what} at {c['at']} {reason}",
                       [f"line {c['line']}: {c['text']}"], fix, dict(c))


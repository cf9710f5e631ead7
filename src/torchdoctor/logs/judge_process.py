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
            if run is not None and primary["host"] and run.get("host") and primary["host"] != run["host"]:
                run = None
            sched = ("check who else sends SIGKILL: the job scheduler's record (Slurm: sacct -j JOBID -o "
                     "State,ExitCode,MaxRSS,ReqMem,Timelimit), a watchdog or parent process that kills its workers "
                     "with kill -9")
            if sig == 9:
                fix = [
                    "dmesg -T | grep -i oom (or journalctl -k | grep -i oom) on that host confirms an OOM kill",
                    "torchdoctor ds memory --params <N> --config ds.json estimates the host RAM per node for your ZeRO "
                    "setup: CPU offload (offload_optimizer / offload_param to cpu) and loading the full model on "
                    "every rank need it",
                    "with ZeRO-3, offload to NVMe instead of CPU, build the model under deepspeed.zero.Init (HF: "
                    "from_pretrained with the DeepSpeed config set up first), use fewer dataloader workers",
                ]
                if self._cancel:
                    cause = f"the job was cancelled by the scheduler ({self._cancel['reason'].lower()})"
                elif self._host_oom_n:
                    cause = "the kernel's OOM killer (confirmed by the log): host RAM ran out"
                elif run is not None and run["oom_killer"]:
                    cause = "the kernel's OOM killer (confirmed by the kernel log torchdoctor run read): memory ran out"
                    fix = fix[1:]
                elif run is not None and run["oom_killer"] is False:
                    cause = ("not the kernel's OOM killer: torchdoctor run found no OOM-killer entry for the "
                             "command's processes in the kernel log, and memory never ran low -- something else sent "
                             "SIGKILL")
                    fix = [sched]
                    if run.get("exit_code") == 0:
                        sev = "warn"  # the command carried on and succeeded
                elif run is not None and run["memory_low"] is False and (self._cpu_mem_pct_max or 0) < 80:
                    cause = ("host memory never ran low while torchdoctor run watched, so the OOM killer is less "
                             "likely than another sender (the kernel log, which would tell, could not be read)")
                    fix = [fix[0], sched, *fix[1:]]
                elif (self._cpu_mem_pct_max or 0) >= 80:
                    cause = (f"most likely the kernel's OOM killer: host RAM ran out (DeepSpeed last reported "
                             f"{self._cpu_mem_pct_max:g}% of host memory in use)")
                else:
                    cause = "most likely the kernel's OOM killer: host RAM ran out"
                if run is not None:
                    ev += run["evidence"]
            elif sig == 6:
                cause = "an abort (a C++ exception: NCCL watchdog, CUDA error)"
                if self._nccl_timeout_n or self._nccl_error_n:
                    cause = "an abort after the NCCL failure above"
                    sev = "warn"  # explained (and failed) by the comm finding
                fix = ["the cause is the error printed just before the abort; see the other findings"]
            elif sig == 11:
                cause = "a segmentation fault (a native extension or a CUDA/driver mismatch)"
                fix = ["rerun with python -X faulthandler to get the Python stack",
                       "torchdoctor env checks that torch, the CUDA toolkit and prebuilt extensions match"]
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
            title = f"{culprit} was killed by {signal_name(sig)} ({-sig}): {cause}"
            out.append(Finding("process.killed", sev, title, ev, fix,
                               {"kills": kills, "host_oom": self._host_oom_n > 0, **data_common}))
        if exits:
            first = exits[0]
            codes = sorted({x["code"] for x in exits})
            ev = [f"line {x['line']}: {x['text']}" for x in exits[:3]]
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

"""Judgements: side-channel records and rank identities in, a per-rank table and findings out.

Pure functions over plain dicts (what :meth:`SideChannel.snapshot` returns), so every verdict is
tested with fabricated records; the processes that produce real records are tested separately.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ..findings import Finding
from .errors import OWN_KINDS, own_findings
from .identity import describe, device_label

STAGES = ("connect", "join", "init", "device", "all_reduce", "all_gather", "broadcast", "ring", "barrier",
          "bench", "done")


# how a rank whose heartbeat stopped is described, by what this host can see of its process
DEAD_VERBS = {"gone": "died during", "stopped": "is frozen (stopped) in", "running": "stopped responding in"}
_BLAME_VERBS = {"gone": "died", "stopped": "is frozen", "running": "stopped responding"}  # in the others' rows
# a rank that never joined, whose process --local's launcher started and this host can see
NOT_JOINED_WORDS = {"gone": "died before joining", "stopped": "is frozen (stopped) before joining",
                    "running": "is stuck starting (alive and running, it never joined)"}
_NOT_JOINED_BLAME = {"gone": "died before joining", "stopped": "is frozen", "running": "is stuck starting"}
_ALIVE = ("stopped", "running")
_OOM = ("out of memory", "can't allocate memory", "cannot allocate memory", "outofmemoryerror")


def is_out_of_memory(error: str) -> bool:
    low = error.lower()
    return any(m in low for m in _OOM)


def exit_words(record: Mapping[str, Any]) -> str:
    """``was killed by SIGKILL`` / ``exited with code 1``: how a launcher saw a rank's process end."""
    if record.get("signal"):
        return f"was killed by {record['signal']}"
    return f"exited with code {record.get('returncode')}"


def stage_index(name: str | None) -> int:
    return STAGES.index(name) if name in STAGES else -1


def _where(stage: Mapping[str, Any] | None) -> str:
    if not stage:
        return "join"
    return f"{stage['name']} {stage['detail']}".strip() if stage.get("detail") else stage["name"]


def network_fixes(backend: str) -> list[str]:
    """The guide's remedies for a collective that does not complete."""
    if backend == "nccl":
        return [
            "rerun with `--nccl-debug INFO` (NCCL_DEBUG=INFO) and read the first NCCL WARN line of the rank named",
            "pin the network interface on every node: NCCL_SOCKET_IFNAME=<iface> (the one `ip route get "
            "<MASTER_ADDR>` uses; e.g. NCCL_SOCKET_IFNAME=eth0, or ^lo,docker to exclude)",
            "ranks on one node: try NCCL_P2P_DISABLE=1; if that fixes it, PCIe ACS or the IOMMU blocks GPU "
            "peer-to-peer (disable ACS / set iommu=pt)",
            "test GPU pairs in isolation: CUDA_VISIBLE_DEVICES=0,1 torchdoctor comm --local 2, then 0,2, ...",
        ]
    return [
        "pin the network interface on every node: GLOO_SOCKET_IFNAME=<iface> (the one `ip route get "
        "<MASTER_ADDR>` uses)",
        "check that every host can reach every other on the ports gloo opens (firewall between nodes)",
    ]


def _ended_on(exit_rec: Mapping[str, Any] | None, sig: str | None) -> bool:
    """A rank's process that ended on the signal that stopped the run: killed by it, Python's exit code for a Ctrl-C,
    or ended after its launcher received it (a rank still starting is killed then)."""
    if not exit_rec:
        return False
    if exit_rec.get("on_signal") or exit_rec.get("signal") == (sig or "SIGINT"):
        return True
    return (sig or "SIGINT") == "SIGINT" and exit_rec.get("returncode") == 130


def judge(snap: Mapping[int, Mapping[str, Any]], backend: str, timeout: float,
          store_lost: str | None = None, store_host_rank: int | None = None,
          interrupted: bool = False, stopped_by: str | None = None, local: bool = False,
          slurm_job: str | None = None) -> tuple[list[dict], list[Finding]]:
    """Rows of the summary table and the findings explaining the run (the fault first).

    ``stopped_by``: the signal ``--local``'s launcher received from outside and passed on to the ranks -- SIGINT (a
    Ctrl-C; ``interrupted=True`` says the same), SIGTERM or SIGHUP (``timeout``, ``kill``, a closed terminal). The
    ranks that ended on it are no fault of theirs. ``local``: the launcher is ``--local``'s, which ends a stuck rank
    after the verdict (its fix cannot send the user to a live pid). ``slurm_job``: SLURM_JOB_ID, when set."""
    n = len(snap)
    ident = {r: rec.get("identity") for r, rec in snap.items()}
    finals = {r: snap[r]["final"] for r in range(n) if snap[r].get("final")}
    halt = stopped_by or ("SIGINT" if interrupted else None)
    outside = halt if halt and halt != "SIGINT" else None  # SIGTERM / SIGHUP to the launcher: not the user's Ctrl-C
    user = sorted(r for r, f in finals.items() if f.get("kind") == "interrupted" or
                  outside and f.get("kind") == "terminated")
    passed = len(finals) == n and all(f["status"] == "ok" for f in finals.values())
    stopped = (halt is not None or bool(user)) and not passed  # a signal after every rank passed changed nothing
    # --local starts ranks in batches and stops starting them at the first failure: those never started
    unstarted = [r for r in range(n) if not ident[r] and snap[r].get("launched") is False]
    if stopped:  # ranks that ended on the signal, or were still starting, are not what went wrong
        user = sorted({*user, *(r for r in range(n) if r not in finals and r not in unstarted and (
            _ended_on(snap[r].get("exit"), halt) or not ident[r] and not snap[r].get("exit")))})
        if not any(snap[r].get("exit") for r in range(n) if r not in finals and r not in user):
            # a rank that saw a peer end on the signal before the signal reached it ended on it too
            user = sorted({*user, *(r for r, f in finals.items() if f.get("kind") == "peer-died")})
    exits = {r: snap[r]["exit"] for r in range(n) if snap[r].get("exit") and r not in finals and r not in user}
    # ranks that never joined whose process this host looked at (--local's launcher posted its pid)
    seen = {r: snap[r]["process"] for r in range(n) if not ident[r] and snap[r].get("process") and
            r not in exits and r not in user and r not in unstarted}
    # a process still running but not joined is stuck in its start only if the others gave up waiting for it
    gave_up = any(f.get("kind") == "timeout" and f.get("stage") == "join" for f in finals.values())
    starting = [r for r, state in seen.items() if state == "running" and not gave_up]
    if store_lost and store_host_rank is not None:
        # The store's host is gone and liveness cannot be read: only it is known dead, the rest is unknown.
        missing = []
        dead = [store_host_rank] if store_host_rank not in finals else []
    else:
        # a rank whose launcher saw it end without a final status died, whether it joined or not
        missing = [r for r in range(n) if not ident[r] and not exits.get(r) and r not in unstarted and r not in user
                   and r not in seen]
        dead = [r for r in range(n) if r not in finals and r not in user and
                (exits.get(r) or ident[r] and not snap[r].get("alive") or r in seen and r not in starting)]
    running = [r for r in range(n) if r not in finals and r not in missing and r not in dead and r not in user
               and r not in unstarted and r not in starting]
    broken = {r: f for r, f in finals.items() if f["status"] != "ok" and r not in user}
    # a SIGTERM or a Ctrl-C says nothing about how far the others got: it does not make the ranks behind it "stuck"
    failed_at = max((stage_index(f["stage"]) for f in broken.values() if f.get("kind") != "terminated"), default=-1)
    stuck = [] if store_lost else [
        r for r in running if stage_index((snap[r].get("stage") or {}).get("name")) < failed_at]
    wrong = [r for r, f in broken.items() if f.get("kind") == "wrong"]
    usage = [r for r, f in broken.items() if f.get("kind") == "usage"]
    own_kind = [r for r, f in broken.items() if f.get("kind") in OWN_KINDS]  # not the network: a module, a bug
    primary = sorted({*missing, *dead, *stuck, *wrong, *usage, *own_kind})
    # Without a dead, missing or stuck rank, the ranks that raised at the earliest stage failed on their own;
    # ranks that raised or timed out later were waiting on them.
    errors = {r: f for r, f in broken.items() if f.get("kind") == "error"}
    own: list[int] = []
    if not primary and errors:
        first = min(stage_index(f["stage"]) for f in errors.values())
        own = sorted(r for r, f in errors.items() if stage_index(f["stage"]) == first)
    culprits = sorted({*primary, *own})
    findings: list[Finding] = []
    blame = []
    if usage:
        findings.append(Finding("comm.backend-unavailable", "fail", broken[usage[0]]["error"],
                                fix=["run with --backend gloo (or auto) on machines without CUDA"],
                                data={"ranks": usage}))

    findings += own_findings(broken, _ranks, lambda r: describe(ident[r], r))
    blame += [f"{describe(ident[r], r)} failed in {broken[r]['stage']}" for r in own_kind]
    for r in missing:
        what = "never joined" if not store_lost else "sent no word (the side channel was lost)"
        blame.append(f"rank {r} {what}")
        findings.append(Finding(
            "comm.rank-missing", "fail", f"rank {r} {what} (no contact within {timeout:g} s)",
            evidence=[f"ranks that joined: {', '.join(str(q) for q in range(n) if ident[q]) or 'none'}"],
            fix=[f"check that the launcher started rank {r}: every node needs the same --nnodes and "
                 "--nproc_per_node, and the same --master-addr/--master-port (or --rdzv-endpoint)",
                 "from the missing rank's host, `nc -zv <MASTER_ADDR> <MASTER_PORT>` must connect (firewall, "
                 "wrong address)"],
            data={"rank": r},
        ))
    for r in dead:
        if not exits.get(r) and snap[r].get("process") in _ALIVE:  # alive, but not answering
            findings.append(_frozen_finding(r, snap[r], store_lost if r == store_host_rank else None, timeout, local))
        else:
            findings.append(_dead_finding(r, snap[r], exits.get(r), store_lost if r == store_host_rank else None))
        verbs = _BLAME_VERBS if ident[r] else _NOT_JOINED_BLAME
        blame.append(f"{describe(ident[r], r)} " + (exit_words(exits[r]) if r in exits else
                                                   verbs.get(snap[r].get("process"), "died")))
    for r in stuck:
        stage = snap[r].get("stage")
        blame.append(f"{describe(ident[r], r)} is stuck")
        findings.append(Finding(
            "comm.rank-stuck", "fail", f"{describe(ident[r], r)} is alive but stuck in {_where(stage)}",
            evidence=["its heartbeat still moves, but it never reached the stage where the others gave up "
                      f"({STAGES[failed_at]})"],
            fix=network_fixes(backend) if (stage or {}).get("name") not in ("device",) else
            ["the device stage allocates memory on the rank's GPU: check `nvidia-smi` on that host for a "
             "hung or busy GPU"],
            data={"rank": r, "stage": (stage or {}).get("name")},
        ))
    for r in wrong:
        f = broken[r]
        blame.append(f"{describe(ident[r], r)} got a wrong result")
        corrupted = (["data arrives corrupted: try NCCL_P2P_DISABLE=1; if that fixes it, PCIe ACS or the IOMMU "
                      "interferes with GPU peer-to-peer (disable ACS / iommu=pt)"] + network_fixes(backend)[-1:]
                     if backend == "nccl" else
                     ["data arrives corrupted between processes: check the host's memory (ECC errors in `dmesg`) "
                      "and rerun; a reproducible corruption on gloo is a bug worth reporting to PyTorch"])
        findings.append(Finding(
            "comm.wrong-result", "fail", f"{describe(ident[r], r)} got a wrong {f['stage']} result",
            evidence=[f["error"]],
            fix=corrupted,
            data={"rank": r, "stage": f["stage"]},
        ))
    if len(own) > 1 and set(own) == set(broken):
        f = broken[own[0]]
        findings.append(Finding(
            "comm.stage-error", "fail",
            f"{f['stage']} failed on every rank ({_ranks(own)}): {f['error'].splitlines()[0][:200]}",
            evidence=[f"rank {r}: {broken[r]['error'].splitlines()[0][:200]}" for r in own],
            fix=network_fixes(backend), data={"ranks": own, "stage": f["stage"]},
        ))
    else:
        for r in own:
            f = broken[r]
            blame.append(f"{describe(ident[r], r)} failed in {f['stage']}")
            if is_out_of_memory(f["error"]):
                findings.append(Finding(
                    "comm.out-of-memory", "fail",
                    f"{describe(ident[r], r)} ran out of memory in "
                    f"{_where({'name': f['stage'], 'detail': f['detail']})}",
                    evidence=[f["error"].splitlines()[0][:300]],
                    fix=["use smaller benchmark sizes (--sizes 1K:64M), or fewer ranks per device: the sharded ops "
                         "hold the full tensor and its shard on every rank"] if f["stage"] == "bench" else
                    ["the device is full before the check starts: `nvidia-smi` shows which processes hold its "
                     "memory (a leftover training run?)"],
                    data={"ranks": [r], "stage": f["stage"]},
                ))
                continue
            findings.append(Finding(
                "comm.stage-error", "fail",
                f"{describe(ident[r], r)} failed in {f['stage']}: {f['error'].splitlines()[0][:200]}",
                evidence=[f["error"]],
                fix=network_fixes(backend) if f["stage"] != "device" else
                ["check the rank's GPU with `nvidia-smi` (memory in use by other processes, Xid errors in "
                 "`dmesg`)"],
                data={"ranks": [r], "stage": f["stage"]},
            ))
    if store_lost and not (store_host_rank is not None and store_host_rank in dead):
        findings.append(Finding(
            "comm.store-lost", "fail", f"the rendezvous store stopped answering: {store_lost}",
            evidence=["without it the other ranks' states cannot be read; the table shows what was seen before"],
            fix=["the store lives in the launcher (torchrun's agent on the first node): check that node and "
                 "the launcher's own output"],
        ))
        culprits = culprits or sorted(broken)
    terminated = sorted(r for r, f in broken.items() if f.get("kind") == "terminated")
    if not culprits and terminated:
        where = " / ".join(sorted({_where({"name": broken[r]["stage"], "detail": broken[r]["detail"]})
                                   for r in terminated}))
        if local:  # --local's launcher passed no signal on: one reached these ranks' processes themselves
            fix = [f"a SIGTERM reached rank{'s' if len(terminated) > 1 else ''} {_ranks(terminated)} directly, not "
                   "through torchdoctor comm --local: find what sent it (a `kill`, a script ending processes by "
                   "name, systemd-oomd or earlyoom under memory pressure)"] + _slurm_fix(slurm_job)
        else:
            fix = ["a scheduler limit or `scancel` (check `sacct -j $SLURM_JOB_ID`), or a launcher that stopped the "
                   "job: its own output names the first process that failed",
                   "rerun with a larger time limit, or without --bench for a quick check"]
        findings.append(Finding(
            "comm.terminated", "fail",
            f"the check was stopped from outside (SIGTERM) on ranks {_ranks(terminated)} during {where}",
            evidence=["no rank died, hung or failed on its own before that: the stages after it were not checked"],
            fix=fix, data={"ranks": terminated},
        ))
        culprits = terminated
    timed_out = {r: f for r, f in broken.items() if f.get("kind") == "timeout"}
    if not culprits and timed_out:
        stages = sorted({f["stage"] for f in timed_out.values()}, key=stage_index)
        where = " / ".join(stages)
        ring = [r for r in range(n) if snap[r].get("ring") is not None]
        evidence = [f"ranks {', '.join(map(str, sorted(timed_out)))} timed out or failed in {where}; all are "
                    "alive and none failed on its own"]
        links = []
        if "ring" in stages and ring:
            for r in range(n):
                got = (snap[r].get("ring") or {}).get("received")
                if not got:
                    links.append(f"{(r - 1) % n}->{r}")
            if links:
                evidence.append(f"ring links that carried nothing: {', '.join(links)}")
        findings.append(Finding(
            "comm.link-broken" if links else "comm.stage-timeout", "fail",
            f"{where} did not complete between ranks that are all alive"
            + (f" (links {', '.join(links)})" if links else ""),
            evidence=evidence, fix=network_fixes(backend), data={"stages": stages, "links": links},
        ))
        culprits = sorted(timed_out)

    where = " / ".join(sorted({_where({"name": finals[r]["stage"], "detail": finals[r]["detail"]})
                               for r in user if r in finals}, key=lambda w: stage_index(w.split()[0])))
    if stopped and outside:
        findings.append(_outside_finding(outside, where, user, bool(culprits), timeout, slurm_job))
    elif stopped:
        findings.append(Finding(
            "comm.interrupted", "skip",
            f"interrupted by the user (Ctrl-C) during {where}: the stages after it were not checked" if where else
            "interrupted by the user (Ctrl-C) before any rank joined: nothing was checked",
            evidence=[f"ranks {_ranks(user)} stopped on the Ctrl-C (SIGINT)"] if user else [],
            fix=["rerun and let it finish (each stage ends within --timeout, "
                 f"{timeout:g} s)"], data={"ranks": user}))
    if unstarted:
        findings.append(Finding(
            "comm.not-started", "skip", f"ranks {_span(unstarted)} were not started",
            evidence=["--local starts ranks in batches, and no more once a rank has ended or on Ctrl-C / SIGTERM"],
            data={"ranks": unstarted}))

    rows = []
    for r in range(n):
        rec, f = snap[r], finals.get(r)
        stage = rec.get("stage")
        row = {"rank": r, "host": (ident[r] or {}).get("host"), "local_rank": (ident[r] or {}).get("local_rank"),
               "device": device_label(ident[r]) if ident[r] else None}
        if r in unstarted:
            row.update(status="missing", stage=None, detail="not started")
        elif r in user:
            where = _where({"name": f["stage"], "detail": f["detail"]}) if f else (stage or {}).get("name")
            how = f"stopped from outside ({outside})" if outside else "interrupted"
            row.update(status="interrupted", stage=f["stage"] if f else (stage or {}).get("name"),
                       detail=f"{how} in {where}" if where and ident[r] else f"{how} before joining")
        elif r in starting:
            row.update(status="missing", stage=None, detail="still starting when the check ended (its process runs)")
        elif r in missing:
            row.update(status="missing", stage="join", detail="never joined")
        elif r in dead:
            row.update(status="broken", stage=(stage or {}).get("name"),
                       detail=_dead_where(rec, exits.get(r), bool(store_lost and r == store_host_rank)))
        elif store_lost and not f:
            row.update(status="missing", stage=(stage or {}).get("name"),
                       detail="state unknown: the side channel was lost")
        elif r in stuck:
            row.update(status="broken", stage=(stage or {}).get("name"), detail=f"stuck in {_where(stage)}")
        elif f and f["status"] == "ok":
            row.update(status="ok", stage="done", detail="")
        elif f and r in culprits:
            row.update(status="broken", stage=f["stage"], detail=f["error"].splitlines()[0][:120])
        elif f:  # no fault of its own: it waited on the culprit, and the table points there
            row.update(status="ok", stage=f["stage"], detail=f"cut short in {f['stage']} by another rank"
                       + (f": {'; '.join(blame)}" if blame else ""))
        else:
            row.update(status="ok", stage=(stage or {}).get("name"), detail=f"still waiting in {_where(stage)}")
        rows.append(row)
    return rows, findings


def _dead_where(rec: Mapping[str, Any], exit_rec: Mapping[str, Any] | None, is_store: bool) -> str:
    """``was killed by SIGKILL during bench all_reduce 8M``, ``died during init``, ``... before joining``."""
    stage = rec.get("stage")
    verb = f"{exit_words(exit_rec)} during" if exit_rec else DEAD_VERBS.get(rec.get("process"), "died during")
    if exit_rec and not rec.get("identity"):
        return f"{exit_words(exit_rec)} before joining"
    if not rec.get("identity") and rec.get("process") in NOT_JOINED_WORDS:
        return NOT_JOINED_WORDS[rec["process"]]
    if is_store and not stage:
        return "died (its last stage was never read)"
    return f"{verb} {_where(stage)}"


def _dead_finding(r: int, rec: Mapping[str, Any], exit_rec: Mapping[str, Any] | None,
                  store_lost: str | None) -> Finding:
    """A rank that died (or is silent on another host): what its last records and its launcher say about it."""
    ident, stage = rec.get("identity"), rec.get("stage")
    is_store = store_lost is not None
    state = "gone" if exit_rec else rec.get("process")  # "gone" | None (not on this host); alive: _frozen_finding
    who = describe(ident, r)
    title = f"{who} {_dead_where(rec, exit_rec, is_store)}"
    if is_store:
        title = f"{who}, which hosts the rendezvous store, died or became unreachable" + (
            f" during {_where(stage)}" if stage else "")
    started = rec.get("started") or {}
    host = (ident or {}).get("host") or (exit_rec or {}).get("host") or started.get("host") or "?"
    pid = (exit_rec or {}).get("pid") or (ident or {}).get("pid") or started.get("pid")
    if exit_rec:
        evidence = [f"its launcher saw its process {pid} end: {exit_words(exit_rec)} (returncode "
                    f"{exit_rec.get('returncode')}), with no status of its own"]
        evidence.append(f"last stage entered: {_where(stage)}" if ident else
                        "it never reached the rendezvous store: it ended while starting (before joining)")
    elif not ident and state == "gone":
        evidence = [f"its launcher started it as process {pid}, which has ended; it never reached the rendezvous "
                    "store (it ended while starting)"]
    else:
        evidence = [f"its heartbeat stopped and it left no status; last stage entered: "
                    f"{_where(stage) if stage or not is_store else 'never read'}"]
    if state is None and not is_store:
        evidence.append(f"its process on host {host} could not be checked from here: it died or froze")
    oom = (f"no traceback usually means a kill from outside; the OOM killer leaves a trace: on host {host}: "
           "dmesg -T | grep -i -E 'killed process|out of memory'")
    if exit_rec and not exit_rec.get("signal"):
        fixes = [f"read rank {r}'s own output (stderr) for the error it exited with"]
    elif exit_rec:
        fixes = [oom if exit_rec.get("signal") == "SIGKILL" else
                 f"find what sent {exit_rec['signal']} to it (a crash in native code is SIGSEGV / SIGABRT: read "
                 f"rank {r}'s own output for the native stack)"]
    else:
        fixes = [f"read rank {r}'s own output for its last error", oom]
    return Finding(
        "comm.rank-died", "fail", title,
        evidence=evidence + ([f"the store stopped answering: {store_lost}"] if is_store else []),
        fix=fixes,
        data={"rank": r, "stage": (stage or {}).get("name"), "detail": (stage or {}).get("detail"),
              "process": state, "returncode": (exit_rec or {}).get("returncode"),
              "signal": (exit_rec or {}).get("signal")},
    )


def _tracer_words(rec: Mapping[str, Any], pid: Any, past: bool) -> str:
    """What ``TracerPid`` said when the verdict read it: a debugger holds the process, or none does."""
    tracer_pid, tracer = rec.get("tracer_pid"), rec.get("tracer")
    holds = "held" if past else "holds"
    if tracer_pid:
        return (f"; TracerPid {tracer_pid}{f' ({tracer})' if tracer else ''} in /proc/{pid}/status: a debugger "
                f"{holds} it")
    if tracer_pid == 0:
        return (f"; TracerPid 0 in /proc/{pid}/status: no debugger {holds} it, so a stop signal did (SIGSTOP from "
                "`kill -STOP` or a script, SIGTSTP, a job suspended by the scheduler)")
    return ": SIGSTOP, Ctrl-Z, a debugger, or a job suspended by the scheduler"


def _frozen_finding(r: int, rec: Mapping[str, Any], store_lost: str | None, timeout: float = 60.0,
                    local: bool = False) -> Finding:
    """A silent rank whose process this host sees alive: stopped (state T) or running but not answering -- joined, or
    (under --local, whose launcher posted its pid) never joined. It is stuck, not dead, and what it is doing can be
    looked at: where it still exists. Under --local the launcher ends it right after this verdict (a stopped process
    takes no other signal, and the check leaves no rank behind), so the fix says what it was and how to catch it
    next time instead of naming a pid that will be gone."""
    ident, stage, state = rec.get("identity"), rec.get("stage"), rec.get("process")
    started = rec.get("started") or {}
    host = (ident or {}).get("host") or started.get("host") or "?"
    pid = (ident or {}).get("pid") or started.get("pid")
    if ident:
        what = f"{DEAD_VERBS[state]} {_where(stage)}"
        evidence = [f"its heartbeat stopped and it left no status; last stage entered: {_where(stage)}"]
    else:
        what = NOT_JOINED_WORDS[state]
        evidence = [f"its launcher started it as process {pid}; it never reached the rendezvous store"
                    + (f" (the others waited {timeout:g} s after the last rank that joined)" if state == "running"
                       else "")]
    is_ = "was, when this verdict was made," if local else "is"  # under --local it is ended right after
    if state == "stopped":
        evidence.append(f"its process {pid} on host {host} {is_} alive but stopped (state T in /proc/{pid}/stat)"
                        + _tracer_words(rec, pid, local))
    elif ident:
        evidence.append(f"its process {pid} on host {host} {is_} alive and running, but no thread of it answers: "
                        "hung in native code (a driver call holding the GIL?)")
    else:
        evidence.append(f"its process {pid} on host {host} {is_} alive and running: still in its start (importing "
                        "torch takes seconds; much longer is a loaded machine or an import that hangs, such as torch "
                        "on a network filesystem)")
    look = ("`ps -o pid,stat,args --ppid <torchdoctor's pid>` lists the ranks (state T: stopped), then "
            + ("`py-spy dump --pid <pid>` (its Python stack), `grep TracerPid /proc/<pid>/status` (a debugger "
               "holding it), `kill -CONT <pid>`" if state == "stopped" else "`py-spy dump --native --pid <pid>`"))
    catch = (f"to look at it next time, do it before the verdict: the others wait --timeout ({timeout:g} s) for a "
             f"silent rank; meanwhile {look}. A larger --timeout gives you longer, and under torchrun the check "
             "itself ends no rank")
    if local:
        evidence.append("torchdoctor comm --local ends it (SIGKILL) "
                        + ("right after this verdict (a stopped process takes no other signal)" if state == "stopped"
                           else "a few seconds after this verdict, with any rank still left")
                        + f", as it ends every rank it started: process {pid} is gone by the time you read this")
    if state == "stopped" and local:
        tracer_pid, tracer = rec.get("tracer_pid"), rec.get("tracer")
        if tracer_pid:
            cause = (f"a debugger ({tracer or 'process'} {tracer_pid}) held it: let it continue, or detach it, "
                     f"within --timeout ({timeout:g} s), or the check counts the rank as stuck")
        elif tracer_pid == 0:
            cause = ("no debugger held it: find what sent it SIGSTOP (a `kill -STOP`, a script or tool that pauses "
                     "processes, a Ctrl-Z sent to the rank itself)")
        else:
            cause = ("find what stopped it: a SIGSTOP (`kill -STOP`, a script) or a debugger (a non-zero TracerPid "
                     "in /proc/<pid>/status names it; it could not be read here)")
        fix = [cause, catch]
    elif state == "stopped":
        fix = [f"see where it is: `py-spy dump --pid {pid}` on host {host} (its Python stack); "
               f"`grep -E 'State|TracerPid' /proc/{pid}/status` (a non-zero TracerPid is the debugger holding it)",
               f"resume it (`kill -CONT {pid}`) or find who stopped it (a debugger, `scontrol suspend`, a Ctrl-Z)"]
    else:
        fix = [catch if local else f"see what it is doing: `py-spy dump --native --pid {pid}` on host {host}",
               "rerun with --nccl-debug INFO to see the last NCCL call" if ident else
               "a start this slow: fewer ranks on this machine, or a larger --timeout; a start that hangs: its "
               "stack (`py-spy dump`) names the import"]
    if store_lost:
        evidence.append(f"it hosts the rendezvous store, which stopped answering: {store_lost}")
    return Finding(
        "comm.rank-stuck", "fail", f"{describe(ident, r)} {what}",
        evidence=evidence, fix=fix,
        data={"rank": r, "stage": (stage or {}).get("name"), "detail": (stage or {}).get("detail"), "process": state,
              "pid": pid, "tracer_pid": rec.get("tracer_pid"), "tracer": rec.get("tracer"),
              "ended_by_launcher": local},
    )


def _slurm_fix(slurm_job: str | None) -> list[str]:
    if not slurm_job:
        return []
    return [f"inside SLURM job {slurm_job}, its time limit or a `scancel` sends SIGTERM: `sacct -j {slurm_job} -o "
            "JobID,State,Elapsed,Timelimit` shows which (State TIMEOUT or CANCELLED)"]


def _outside_finding(sig: str, where: str, ranks: list[int], fault_first: bool, timeout: float,
                     slurm_job: str | None) -> Finding:
    """``--local``'s launcher received ``sig`` from outside and passed it on: the run was stopped, nobody failed."""
    who = ("its terminal closed, or `kill -HUP`" if sig == "SIGHUP" else "`timeout`, `kill`, a scheduler")
    what = f"stopped from outside ({sig} to torchdoctor comm: {who})"
    evidence = [f"torchdoctor comm --local received {sig} and passed it on to every rank"
                + (f": ranks {_ranks(ranks)} stopped on it" if ranks else "")]
    if not fault_first:
        evidence.append("no rank died, hung or failed on its own before it")
    fix = (["run it where a closed terminal does not stop it (`nohup`, tmux, screen)"] if sig == "SIGHUP" else
           [f"rerun with more time: a larger limit for `timeout` or the job (each stage ends within --timeout, "
            f"{timeout:g} s; --bench takes longer)"]) + _slurm_fix(slurm_job)
    return Finding(
        "comm.terminated", "skip",
        f"{what} during {where}: the stages after it were not checked" if where else
        f"{what} before any rank joined: nothing was checked",
        evidence=evidence, fix=fix, data={"ranks": ranks, "signal": sig})


def cross_rank(idents: Mapping[int, Mapping[str, Any]], backend: str) -> list[Finding]:
    """What the identities of the ranks that joined say: shared GPUs, version and setting differences."""
    out: list[Finding] = []
    joined = {r: i for r, i in sorted(idents.items()) if i}
    # Two ranks on one physical GPU
    by_gpu: dict[tuple, list[int]] = defaultdict(list)
    for r, i in joined.items():
        if i.get("device", "cpu") != "cpu":
            key = i.get("device_uuid") or (i.get("env", {}).get("CUDA_VISIBLE_DEVICES"), i["device"])
            by_gpu[(i["host"], key)].append(r)
    for (host, _), ranks in by_gpu.items():
        if len(ranks) > 1:
            i = joined[ranks[0]]
            out.append(Finding(
                "comm.shared-gpu", "fail" if backend == "nccl" else "warn",
                f"ranks {', '.join(map(str, ranks))} share one GPU ({i['device']} {i.get('device_name') or ''} "
                f"on host {host})".replace("  ", " "),
                evidence=[f"{describe(joined[r], r)}: {joined[r]['device']} uuid {joined[r].get('device_uuid')}"
                          for r in ranks] + [f"host {host} has {i.get('cuda_devices')} visible GPU(s)"],
                fix=[f"start at most {i.get('cuda_devices')} rank(s) on host {host}: torchrun --nproc_per_node "
                     f"{i.get('cuda_devices')}",
                     "or give each rank its own GPU (CUDA_VISIBLE_DEVICES, or torch.cuda.set_device(LOCAL_RANK))"],
                data={"host": host, "ranks": ranks},
            ))
    # Versions that differ between ranks
    for field, severity in (("torch", "fail"), ("nccl", "fail"), ("cuda", "warn"), ("driver", "warn")):
        groups: dict[Any, list[int]] = defaultdict(list)
        for r, i in joined.items():
            if i.get(field) is not None:  # no CUDA device: no nccl / driver version to compare
                groups[i.get(field)].append(r)
        if len(groups) > 1:
            out.append(Finding(
                f"comm.{field}-version-mismatch", severity, f"{field} versions differ between ranks",
                evidence=[f"{field} {v}: ranks {_ranks(rs)}" for v, rs in groups.items()],
                fix=[f"install the same {field} version on every node (one container image or environment)"],
                data={"versions": {str(v): rs for v, rs in groups.items()}},
            ))
    # NCCL_* settings that differ between ranks
    keys = sorted({k for i in joined.values() for k in i.get("env", {}) if k.startswith("NCCL_")})
    for k in keys:
        groups = defaultdict(list)
        for r, i in joined.items():
            groups[i.get("env", {}).get(k)].append(r)
        if len(groups) > 1:
            ev = [f"{k}={v}: ranks {_ranks(rs)}" if v is not None else f"unset: ranks {_ranks(rs)}"
                  for v, rs in groups.items()]
            out.append(Finding(
                "comm.env-mismatch", "warn", f"{k} differs between ranks", evidence=ev,
                fix=[f"set {k} the same way for every rank: export it in the job script before torchrun / srun, "
                     "not in one node's shell profile"],
                data={"variable": k, "values": {str(v): rs for v, rs in groups.items()}},
            ))
    # Ranks without a device while others have one
    with_gpu = [r for r, i in joined.items() if i.get("cuda_devices")]
    without = [r for r, i in joined.items() if not i.get("cuda_devices")]
    if with_gpu and without:
        out.append(Finding(
            "comm.no-device", "fail", f"ranks {_ranks(without)} see no CUDA device while ranks {_ranks(with_gpu)} do",
            evidence=[f"{describe(joined[r], r)}: CUDA_VISIBLE_DEVICES="
                      f"{joined[r].get('env', {}).get('CUDA_VISIBLE_DEVICES', '(unset)')}" for r in without],
            fix=["on those hosts check `nvidia-smi` and CUDA_VISIBLE_DEVICES, and that torch is a CUDA build "
                 "(torch.version.cuda is not None)"],
            data={"ranks": without},
        ))
    return out


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs))


def _span(rs: list[int]) -> str:
    """``8-99`` for a run of consecutive ranks (what batches leave unstarted), else the list."""
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return _ranks(rs)

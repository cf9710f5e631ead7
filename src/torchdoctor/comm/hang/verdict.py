"""One verdict for a distributed job that failed, hung or dragged: the culprit rank(s), the class, the culprit's own
call site -- every sentence with the witness it rests on.

Witnesses: ``process state`` (``/proc/<pid>/stat``, read by ``torchdoctor run`` while the job ran), ``status file``
(what the rank wrote of its own ``init_process_group`` call, its heartbeat and its exit), ``stack`` (the rank's own
dump: its exception's traceback, or its main thread when a signal or ``run``'s request came), ``Flight Recorder``
(the collectives each rank entered), ``launcher log`` and ``kernel log`` (the signal that killed a rank; an OOM kill
only where the kernel says so), ``NCCL RAS``.

The classes, in the order they are decided -- a cause before its consequences (the others' timeouts and lost
connections are evidence under it, never a second culprit):

``init-mismatch``  the ranks asked ``init_process_group`` for different jobs (world size, address or port, backend,
                   a rank twice);
``stopped``        a rank's process was stopped (``T``: SIGSTOP, Ctrl-Z; ``t``: a debugger) while the others waited;
``killed``         a rank died without Python's exit running (SIGKILL -- the kernel's OOM killer only where the kernel
                   log says so --, a crash), or by a signal from outside before anything else failed;
``exception``      a rank raised (not a timeout or a lost peer inside a collective: those are consequences);
``exited-early``   a rank exited (code 0: uneven inputs) while the others went on to a collective it never joined;
``collective-mismatch``  the ranks called different collectives (op, sizes, dtypes) at one sequence number --
                   a skipped collective shows as one; the minority is the culprit;
``never-arrived``  a rank, alive, never entered the collective the others wait in (with where it was);
``transport``      every rank entered the collective and none completed it (completion as far as it can be trusted:
                   gloo counts a failed collective as completed);
``slow``           the job ran, but every rank kept waiting for one (:mod:`.slow`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...findings import Finding
from . import init_check, ras, slow
from .analyze import Parting
from .dumps import Dumps
from .facts import JobFacts, RankFacts, frames, is_user_frame, site_text, user_site

_COMM_FAILURE = re.compile(r"timed? ?out|timeout|connection (?:closed|reset|refused)|closed by peer|broken pipe|"
                           r"socket|watchdog|abort|DistBackendError|DistNetworkError|DistStoreError|"
                           r"NCCL (?:error|communicator)", re.I)
_DIST = "/torch/distributed/"
SETTLED_S = 2.0  # ranks that entered no collective for this long stand where they part


def quiet_for(dumps: Dumps) -> float | None:
    """Seconds between the last collective any rank entered and the first dump (the dumps' own clock: one host's, or
    hosts' clocks, NTP apart), or None where the records do not say."""
    entered = [e.get("time_created_ns") for d in dumps.ranks.values() for e in d.fr.get("entries") or ()
               if isinstance(e, dict)]
    entered = [t for t in entered if isinstance(t, int) and t > 0]
    written = [d.time for d in dumps.ranks.values() if d.time]
    if not entered or not written:
        return None
    return min(written) - max(entered) / 1e9


@dataclass
class Verdict:
    cls: str
    culprits: list[int]
    site: tuple[str, int, str] | None
    title: str
    evidence: list[str] = field(default_factory=list)
    fix: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    severity: str = "fail"

    def finding(self) -> Finding:
        witnesses = sorted({e.split(":", 1)[0] for e in self.evidence if ":" in e})
        return Finding(f"comm.{self.cls}", self.severity, self.title, self.evidence, self.fix, {
            "class": self.cls, "culprit_ranks": list(self.culprits), "call_site": site_text(self.site),
            "call_site_function": self.site[2] if self.site else None, "witnesses": witnesses, **self.data})


# ------------------------------------------------------------------------------------------------ helpers


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _at(site: tuple | None) -> str:
    return f"{site[0]}:{site[1]} in {site[2]}" if site else "(no stack of its own code)"


def _in_dist(stack: list | None) -> bool:
    return any(_DIST in str(f[0]) for f in (stack or ())[-12:])


def comm_consequence(f: RankFacts) -> bool:
    """The rank ended by an error a collective raised because of another rank (a timeout, a lost peer)."""
    end = f.end or {}
    if end.get("how") != "exception" or _COMM_FAILURE.search(str(end.get("error") or "")) is None:
        return False
    return _in_dist(end.get("stack")) or not end.get("stack")


def _stack_of(f: RankFacts | None, dumps: Dumps, rank: int) -> tuple[list, str]:
    """The freshest stack known for a rank, with its witness."""
    d = dumps.ranks.get(rank)
    if d is not None and d.stack:
        why = d.reason or "its dump"
        why = ("at run's request" if why.startswith("requested by torchdoctor run") else
               "its exception" if why.startswith("exception") else why.split(" ")[0])
        return list(d.stack), f"stack ({why})"
    if f is not None and f.end and f.end.get("stack"):
        return frames(f.end["stack"]), "stack (as it ended)"
    if f is not None and f.beat and f.beat.get("stack"):
        age = f" {f.beat_age:.1f} s before" if f.beat_age is not None else ""
        return frames(f.beat["stack"]), f"status file (its last heartbeat,{age} the verdict)".replace(",  ", ", ")
    return [], ""


def _where(f: RankFacts | None, dumps: Dumps, rank: int) -> tuple[tuple | None, str]:
    stack, witness = _stack_of(f, dumps, rank)
    return user_site(stack), witness


def _state_line(job: JobFacts) -> str | None:
    parts = []
    for r, f in sorted(job.ranks.items()):
        if f.state == "unknown" and not f.state_witness:
            continue
        parts.append(f"rank {r} pid {f.pid} {f.state}" + (f" ({f.state_witness})" if f.state_witness else ""))
    return "process state: " + "; ".join(parts) if parts else None


def _consequences(job: JobFacts, culprits: list[int]) -> list[str]:
    out = []
    for r, f in sorted(job.ranks.items()):
        if r in culprits or not f.end:
            continue
        end = f.end
        if end.get("how") == "exception":
            out.append(f"status file: rank {r} then failed with {str(end.get('error'))[:160]} (a consequence)")
        elif end.get("how") == "signal" and not f.ended_by_run:
            out.append(f"status file: rank {r} was then ended by {end.get('signal')} (the launcher ending the job)")
    return out


def _parting(partings: list[Parting]) -> Parting | None:
    return next((p for p in partings if p.seq is not None), None)


def _collective(p: Parting | None) -> str:
    if p is None or p.seq is None:
        return "a collective"
    return (f"{p.call.op} (collective {p.seq} of process group {p.group})" if p.call
            else f"collective {p.seq} of process group {p.group}")


def _base_data(dumps: Dumps, p: Parting | None, job: JobFacts) -> dict:
    data: dict[str, Any] = {"how": job.how, "ranks_read": sorted(dumps.ranks)}
    if p is not None:
        call = p.call
        data.update(group=p.group, seq=p.seq, op=call.op if call else None, sizes=call.in_sizes if call else None,
                    dtypes=call.in_dtypes if call else None, missing=p.missing, waiting=p.waiting,
                    last_entered=p.last_entered, last_completed=p.last_completed, no_dump=p.no_dump,
                    missing_stacks={r: [list(f) for f in s] for r, s in p.missing_stacks.items()},
                    waiting_stack=[list(f) for f in p.waiting_frames])
    data["process_states"] = {r: {"pid": f.pid, "host": f.host, "state": f.state, "witness": f.state_witness}
                              for r, f in sorted(job.ranks.items())}
    return data


def _waiting_line(p: Parting | None, dumps: Dumps, job: JobFacts, culprits: list[int]) -> str | None:
    if p is None or not p.waiting:
        return None
    waiting = [r for r in p.waiting if r not in culprits]
    if not waiting:
        return None
    site = user_site(p.waiting_frames)
    return f"Flight Recorder: {_ranks(waiting)} entered {_collective(p)} and waited in it, called at {_at(site)}"


# ------------------------------------------------------------------------------------------------ classes


def judge(dumps: Dumps, partings: list[Parting], job: JobFacts, procs: list[RankFacts] | None = None) -> Verdict | None:
    """The verdict, or None when nothing failed, hung or dragged (or nothing can be said)."""
    procs = procs if procs is not None else list(job.ranks.values())
    p = _parting(partings)
    idle = quiet_for(dumps)
    if not job.settled and idle is not None and idle >= SETTLED_S:
        job.settled = True
        job.notes.append(f"Flight Recorder: no rank had entered a collective for {idle:.1f} s when they dumped")
    elif not job.settled:
        job.notes.append("torchdoctor run: the ranks were still making progress: where each stood is not where they "
                         "parted, so no hang is judged")
    decisions = [_init_mismatch, _stopped, _killed, _exception, _exited_early]
    if job.settled:  # (a snapshot of ranks still moving says nothing of where they part)
        decisions += [_mismatch, _never_arrived, _transport, _outside_by_stacks]
    for decide in decisions:
        v = decide(dumps, partings, p, job, procs)
        if v is not None:
            return _finish(v, dumps, p, job)
    if job.ended_well:
        v = _slow(job)
        if v is not None:
            return v
    return None


def _finish(v: Verdict, dumps: Dumps, p: Parting | None, job: JobFacts) -> Verdict:
    v.evidence += [line for line in (_waiting_line(p, dumps, job, v.culprits),) if line]
    v.evidence += _consequences(job, v.culprits)
    state = _state_line(job)
    if state:
        v.evidence.append(state)
    v.evidence += ras.lines(job.ras)
    v.evidence += job.notes
    v.data = {**_base_data(dumps, p, job), **v.data}
    v.evidence.insert(0, f"{'torchdoctor run' if job.ranks or job.live else 'dumps alone'}: judged {job.how}")
    return v


def _init_mismatch(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    found = init_check.check(procs)
    if found is None:
        return None
    culprits = sorted({c.rank for c in found["culprits"]} if all(isinstance(c.rank, int) for c in found["culprits"])
                      else set())
    first = found["culprits"][0]
    site = user_site(frames((first.init or {}).get("stack")))
    ev = [f"status file: {found['sentence']}"]
    for c in found["culprits"]:
        init = c.init or {}
        if init.get("error"):
            ev.append(f"status file: pid {c.pid}'s init_process_group raised {init['error']}")
        elif not init.get("done"):
            ev.append(f"status file: pid {c.pid} was still in init_process_group")
    what = found["what"]
    fixes = {"world size": "pass the same world_size everywhere -- or none: torchrun, srun and deepspeed export "
                           "WORLD_SIZE and init_process_group reads it",
             "address": "every rank must meet at the same MASTER_ADDR:MASTER_PORT (or init_method): drop the "
                        "per-rank address, let the launcher's environment decide",
             "backend": "every rank must use the same backend",
             "rank": "each process needs its own rank: pass none (the launcher's RANK is read) or rank=int(os.environ"
                     "['RANK'])"}
    got = sorted({str(v) for v in found["got"].values()})
    title = (f"{_ranks(culprits) if culprits else 'a process'} asked init_process_group for {what} {', '.join(got)}"
             + (f" where the others asked for {found['expected']}" if found["expected"] is not None else "")
             + f", at {_at(site)}")
    return Verdict("init-mismatch", culprits, site, title, ev, [fixes[what]],
                   {"mismatch": what, "expected": found["expected"],
                    "got": {str(k): v for k, v in found["got"].items()},
                    "pids": [c.pid for c in found["culprits"]]})


def _stopped(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    stopped = sorted((f for f in job.ranks.values() if f.stopped_at is not None), key=lambda f: f.stopped_at)
    if not stopped:
        return None
    culprits = [f.rank for f in stopped]
    first = stopped[0]
    site, witness = _where(first, dumps, first.rank)
    how = "a tracing stop (t: a debugger holds it)" if first.traced else "stopped (T: SIGSTOP, Ctrl-Z or a debugger)"
    title = f"{_ranks(culprits)} {'was' if len(culprits) == 1 else 'were'} {how}, at {_at(site)}"
    if p is not None and p.waiting:
        title += f"; {_ranks([r for r in p.waiting if r not in culprits])} waited for it in {_collective(p)}"
    ev = [f"process state: rank {f.rank} (pid {f.pid}) {f.state_witness or 'stopped'}" for f in stopped]
    if site:
        ev.append(f"{witness}: rank {first.rank} was at {_at(site)}")
    fix = ["a stopped process runs no code until it gets SIGCONT (`kill -CONT <pid>`); find what stopped it: a "
           "debugger attached (pdb, gdb, py-spy --native holds it for a moment), `kill -STOP`, Ctrl-Z in its "
           "terminal, a scheduler suspending the job"]
    return Verdict("stopped", culprits, site, title, ev, fix, {"stopped_pids": [f.pid for f in stopped]})


def _ended_at(f: RankFacts) -> float | None:
    return f.end_time if f.end_time is not None else f.gone_at


def _first_failure(job: JobFacts, exclude: RankFacts | None = None) -> float | None:
    times = [t for f in job.ranks.values() if f is not exclude and (t := _ended_at(f)) is not None
             and (f.end or {}).get("how") != "exit"]
    return min(times, default=None)


def _last_entered(dumps: Dumps, p: Parting | None, rank: int) -> str | None:
    """The last collective a rank entered, from the other ranks' records where it left none of its own."""
    if p is None or p.seq is None:
        return None
    seq = p.last_entered.get(rank)
    if seq is None and rank in p.no_dump:
        seq = p.seq - 1 if p.seq > 1 else None  # the others' records: it took part in every collective before
        return f"collective {seq} (the last one all the others completed with it)" if seq else None
    return f"collective {seq}" if seq else None


def _killed(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    dead = []
    for f in job.ranks.values():
        if f.ended_by_run or f.end is not None or f.stopped_at is not None:
            continue
        if f.state in ("killed", "gone") or f.signal:
            before = _first_failure(job, exclude=f)
            t = _ended_at(f)
            if before is None or t is None or t <= before + 0.5:
                dead.append(f)
    # a rank ended by a signal it could take (SIGTERM from outside) before anything else failed
    if not dead:
        firsts = sorted((f for f in job.ranks.values() if (f.end or {}).get("how") == "signal" and not f.ended_by_run),
                        key=lambda f: f.end_time or 0)
        if firsts and (first_other := _first_failure(job, exclude=firsts[0])) is not None and \
                (firsts[0].end_time or 0) + 0.5 < first_other:
            dead = [firsts[0]]
    if not dead:
        return None
    dead.sort(key=lambda f: _ended_at(f) or 0)
    culprits = [f.rank for f in dead]
    first = dead[0]
    site, witness = _where(first, dumps, first.rank)
    if first.oom_lines:
        how = "killed by the kernel's OOM killer"
    elif first.signal:
        how = f"killed by {first.signal}"
    elif (first.end or {}).get("how") == "signal":
        how = f"ended by {first.end.get('signal')}, sent from outside before any other rank failed"
    else:
        how = "gone without Python's exit running (SIGKILL, a crash, or os._exit)"
    last = _last_entered(dumps, p, first.rank)
    title = (f"{_ranks(culprits)} {'was' if len(culprits) == 1 else 'were'} {how}"
             + (f", after {last}" if last else "") + f"; its last heartbeat had it at {_at(site)}")
    ev = []
    for f in dead:
        ev += f.signal_witnesses
        if f.state_witness:
            ev.append(f"process state: rank {f.rank} (pid {f.pid}) {f.state_witness}")
        ev += [f"kernel log: {line}" for line in f.oom_lines]
    if site:
        ev.append(f"{witness}: rank {first.rank} was last at {_at(site)}")
    fix = (["the kernel killed it for memory: lower the host memory per rank (fewer ranks per node, smaller "
            "batches or workers, a bigger limit); `torchdoctor ds memory` sizes a DeepSpeed job"] if first.oom_lines
           else ["find who sent the signal: the job scheduler (time limit, preemption: `sacct -j <job> -o State`), "
                 "a `kill`, a watchdog of your own; not the kernel's OOM killer unless the kernel log says so "
                 "(`dmesg -T | grep -i oom`)"])
    return Verdict("killed", culprits, site, title, ev, fix, {"killed_pids": [f.pid for f in dead],
                                                              "signal": first.signal, "oom": bool(first.oom_lines)})


def _exception(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    raised = sorted((f for f in job.ranks.values() if (f.end or {}).get("how") == "exception"
                     and not comm_consequence(f) and not f.ended_by_run and not _interrupted(f.end)),
                    key=lambda f: f.end_time or 0)
    if not raised:
        for r, d in sorted(dumps.ranks.items()):  # a post-mortem of dumps alone: the reasons they give
            if (d.reason or "").startswith("exception") and not _COMM_FAILURE.search(d.reason or ""):
                raised.append(RankFacts(r, end={"how": "exception", "error": d.reason.partition(": ")[2],
                                                "stack": [list(x) for x in d.stack]}))
                break
    if not raised:
        return None
    first = raised[0]
    stack = frames(first.end.get("stack"))
    site = user_site(stack)
    error = str(first.end.get("error"))
    title = f"rank {first.rank} raised {error[:200]} at {_at(site)}"
    ev = [f"stack: rank {first.rank}'s traceback ends at {_at(site)}"]
    if site and stack and not is_user_frame(stack[-1]):
        ev.append(f"stack: raised inside {stack[-1][0]}:{stack[-1][1]} in {stack[-1][2]}")
    return Verdict("exception", [first.rank], site, title, ev,
                   ["fix the exception on that rank (its traceback is in the output above); the other ranks' errors "
                    "follow from it"], {"error": error})


def _interrupted(end: dict) -> bool:
    """A Ctrl-C the launcher passed on (KeyboardInterrupt) ends a rank; it is no fault of the rank's code."""
    return str(end.get("error") or "").startswith("KeyboardInterrupt")


def _exited_early(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    if job.ended_well:
        return None
    gone = sorted((f for f in job.ranks.values() if (f.end or {}).get("how") == "exit" and not f.ended_by_run),
                  key=lambda f: f.end_time or 0)
    waiting_after = [f for f in job.ranks.values() if (f.end or {}).get("how") != "exit"]
    if not gone or not waiting_after:
        return None
    culprits = [f.rank for f in gone]
    first = gone[0]
    code = first.end.get("code", 0)
    site = user_site(frames(first.end.get("stack")))
    witness = "status file (where it called sys.exit or destroy_process_group)"
    if site is None:
        site, witness = _where(first, dumps, first.rank)
    last = (p.last_entered.get(first.rank) if p is not None else None)
    title = (f"{_ranks(culprits)} exited (code {code}) while the others went on"
             + (f" to {_collective(p)}, which it never entered" if p is not None and p.seq else "")
             + f"; it left at {_at(site)}")
    ev = [f"status file: rank {f.rank} (pid {f.pid}) exited with code {f.end.get('code', 0)}" for f in gone]
    if last:
        ev.append(f"Flight Recorder: the last collective rank {first.rank} entered was {last}")
    if site:
        ev.append(f"{witness}: rank {first.rank} was at {_at(site)}")
    fix = ["every rank must run the same number of collectives: give each rank the same number of batches "
           "(DistributedSampler(drop_last=True), or DataLoader(drop_last=True) on equal shards), or wrap the loop "
           "in torch.distributed.algorithms.Join([model]) so a rank that runs out shadows the others' collectives"]
    return Verdict("exited-early", culprits, site, title, ev, fix, {"exit_code": code})


def _mismatch(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    found = next((q for q in partings if q.mismatch is not None), None)
    if found is None:
        return None
    state, seq, calls = found.mismatch
    groups: dict[str, list[int]] = {}
    for r, c in calls.items():
        groups.setdefault(c, []).append(r)
    ordered = sorted(groups.values(), key=len, reverse=True)
    majority = ordered[0] if len(ordered[0]) > sum(len(g) for g in ordered[1:]) else None
    culprits = sorted(r for g in ordered[1:] for r in g) if majority else []
    shown = {r: c for r, c in calls.items()}
    first = culprits[0] if culprits else sorted(calls)[0]
    site, witness = _where(job.ranks.get(first), dumps, first)
    if majority:
        title = (f"{_ranks(culprits)} called {calls[first]} where {_ranks(sorted(majority))} called "
                 f"{calls[majority[0]]} (collective {seq} of process group {found.group}, {state}): "
                 f"{_ranks(culprits)} called it at {_at(site)}")
        if _skipped(dumps, found, culprits, majority, seq):
            title += f" -- {_ranks(culprits)} skipped the {calls[majority[0]].split()[0]}"
    else:
        title = (f"at collective {seq} of process group {found.group} the ranks called different things ({state}): "
                 + "; ".join(f"rank {r}: {c}" for r, c in sorted(calls.items()))
                 + " -- which side is out of step cannot be told from two sides")
    ev = [f"Flight Recorder: rank {r}: {c}" for r, c in sorted(shown.items())]
    for r in culprits:
        s, w = _where(job.ranks.get(r), dumps, r)
        if s:
            ev.append(f"{w}: rank {r} was at {_at(s)}")
    fix = ["every rank must call the same collectives in the same order with the same sizes and dtypes: look for "
           "a branch on the rank, or on data that differs per rank, before that call"]
    return Verdict("collective-mismatch", culprits, site, title, ev, fix,
                   {"state": state, "mismatch_seq": seq, "calls": {str(r): c for r, c in calls.items()}})


def _skipped(dumps: Dumps, p: Parting, culprits: list[int], majority: list[int], seq: int) -> bool:
    """The culprit's call at ``seq`` is the one the others make next: it skipped theirs."""
    from .analyze import _calls

    name = p.group.split(" ")[0]
    mine = {r: _calls(dumps.ranks[r]).get(name, {}) for r in culprits if r in dumps.ranks}
    theirs = {r: _calls(dumps.ranks[r]).get(name, {}) for r in majority if r in dumps.ranks}
    if not mine or not theirs:
        return False
    ref = next(iter(theirs.values()))
    return all(seq in c and seq + 1 in ref and c[seq].op == ref[seq + 1].op for c in mine.values())


def _never_arrived(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    if p is None or not p.missing or not p.waiting:
        return None
    culprits = list(p.missing)
    first = culprits[0]
    f = job.ranks.get(first)
    site, witness = _where(f, dumps, first)
    doing = ""
    if f is not None and f.state in ("running",):
        doing = " (its process running: " + ("on a CPU" if f.busy else "sleeping or waiting") + ")"
    who = "it was" if len(culprits) == 1 else f"rank {first} was"
    title = f"{_ranks(culprits)} never arrived at {_collective(p)}: {who} at {_at(site)}{doing}"
    ev = []
    for r in culprits:
        s, w = _where(job.ranks.get(r), dumps, r)
        last = p.last_entered.get(r)
        ev.append(f"Flight Recorder: rank {r} last entered collective {last or 'none'}")
        if s:
            ev.append(f"{w}: rank {r} was at {_at(s)}")
        elif r not in dumps.ranks:
            ev.append(f"Flight Recorder: no dump from rank {r}")
    fix = [f"{_ranks(culprits)} did not reach that call: a data loader or I/O that never returned, a branch on the "
           "rank, an exception caught on that rank, a loop with a different length -- its stack above says where it "
           "was; every rank must reach every collective in the same order"]
    return Verdict("never-arrived", culprits, site, title, ev, fix, {})


def _outside_by_stacks(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    """No collective recorded (the recorder off): the ranks' own stacks still tell those inside a collective from
    those elsewhere."""
    if dumps.entries or len(dumps.ranks) < 2:
        return None
    inside = sorted(r for r, d in dumps.ranks.items() if _in_dist(d.stack))
    outside = sorted(r for r, d in dumps.ranks.items() if d.stack and not _in_dist(d.stack))
    if not inside or not outside:
        return None
    site, witness = _where(job.ranks.get(outside[0]), dumps, outside[0])
    waiting_site = user_site(dumps.ranks[inside[0]].stack)
    title = (f"{_ranks(outside)} never arrived at the collective {_ranks(inside)} waited in: "
             f"{'it was' if len(outside) == 1 else f'rank {outside[0]} was'} at {_at(site)}")
    ev = [f"stack: rank {r} was at {_at(user_site(dumps.ranks[r].stack))}, outside torch.distributed" for r in outside]
    ev.append(f"stack: {_ranks(inside)} waited inside torch.distributed, called at {_at(waiting_site)}")
    ev.append("Flight Recorder: off (no collective recorded), so which collective is not known")
    fix = [f"{_ranks(outside)} did not reach the collective the others wait in: its stack above says where it was"]
    return Verdict("never-arrived", outside, site, title, ev, fix, {"missing": outside, "waiting": inside})


def _transport(dumps: Dumps, partings: list, p: Parting | None, job: JobFacts, procs: list) -> Verdict | None:
    if p is None or p.missing or not p.waiting:
        return None
    site = user_site(p.waiting_frames)
    errors = {r: str(f.end.get("error")) for r, f in sorted(job.ranks.items())
              if (f.end or {}).get("how") == "exception"}
    title = (f"every rank entered {_collective(p)} and none completed it: the transfer itself failed (no rank is "
             f"behind); called at {_at(site)}")
    ev = [f"stack: rank {r} failed with {e[:200]}" for r, e in errors.items()]
    ev.append("Flight Recorder: completion read from each rank's records; a collective that ended in an error is "
              "not counted as completed (gloo marks it so)")
    fix = ["the link or a peer's transport failed mid-collective: test every pair with `torchdoctor comm --pairs` on "
           "the same hosts, check the network interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), and NCCL's own "
           "logs (NCCL_DEBUG=WARN) on a GPU job"]
    return Verdict("transport", [], site, title, ev, fix, {"errors": {str(r): e for r, e in errors.items()}})


def _slow(job: JobFacts) -> Verdict | None:
    timings = {r: f.timing for r, f in job.ranks.items() if f.timing}
    found = slow.find(timings, {r: f.host for r, f in job.ranks.items()})
    if found is None:
        return None
    f = job.ranks[found.rank]
    hot = slow.hot_site((f.beat or {}).get("samples"), (f.beat or {}).get("n_samples", 0))
    site = hot[:3] if hot else None
    title = (f"rank {found.rank} held the others back: they waited {found.big_lag_s:.2f} s for it at {found.big_at} "
             f"of {found.collectives} collectives ({found.waited_s:.1f} s in all, "
             f"{100 * found.waited_s / found.span_s:.0f}% of the {found.span_s:.1f} s the collectives spanned); it "
             f"spent that time at {_at(site)}")
    ev = [f"Flight Recorder: when each rank entered each of {found.collectives} collectives; rank {found.rank} came "
          f"last by a gap at {found.last_at}, {100 * found.share:.0f}% of all the waiting"]
    if hot:
        ev.append(f"status file: rank {found.rank}'s main thread was at {_at(site)} in {hot[3]} of {hot[4]} samples "
                  "taken outside collectives")
    if found.hosts_differ:
        ev.append("Flight Recorder: the ranks ran on different hosts: their clocks' offset adds to each gap")
    fix = [f"make rank {found.rank} as fast as the others: its data loading, its share of the batch, its device "
           "(a slower GPU, a throttled or busy host) -- the place above is where its time went"]
    v = Verdict("slow", [found.rank], site, title, ev, fix,
                {"waited_s": round(found.waited_s, 3), "span_s": round(found.span_s, 3),
                 "lag_s": round(found.big_lag_s, 3), "lag_at": found.big_at,
                 "mean_lag_s": round(found.mean_lag_s, 3), "last_at": found.last_at,
                 "collectives": found.collectives, "how": job.how}, severity="warn")
    return v

"""One rank's run of the check: stages under a watchdog, then one summary printed by one rank.

Never hang: each stage has a deadline watched by a thread; a missed deadline, an exception, a SIGTERM
from the launcher or a SIGINT (Ctrl-C: exit 130) all end in :meth:`RankSession.fail`, which records the failure in
the side channel,
waits briefly for the other ranks' records to settle, prints the verdict (if this rank is the reporter)
and leaves with ``os._exit`` -- a process group with a dead peer cannot be torn down reliably.
A passing rank leaves with ``os._exit`` too: Python's finalization kills daemon threads with ``pthread_exit``,
which aborts the process when one of them is inside a C++ call (torch's store client), so the verdict
"all ok" could end in SIGABRT.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn

from ..findings import Finding, render_text, use_color
from ..jsonfile import dumps
from . import checks, errors, identity, rules
from .launch import Launch
from .procs import process_status
from .sidechannel import SideChannel, StoreUnreachable

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
HARD_EXIT_S = 20.0  # beyond the stage deadline (or the report's settle time): leave, whatever is stuck
# Fault injection for the process tests, read only here: "RANK:STAGE[:SECONDS]" makes that rank SIGKILL itself
# SECONDS (default 0) after entering STAGE ("connect", "join", ..., "bench", "bench all_reduce 8M": a stage, or a
# stage and the start of its detail) -- a real death at a known place, which no outside kill can time.
TEST_DIE_ENV = "TORCHDOCTOR_COMM_TEST_DIE"


def injected_death(spec: str | None, rank: int) -> tuple[str, float] | None:
    """(stage, seconds) of this rank's injected death from :data:`TEST_DIE_ENV`'s value, or None."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        who, stage, after = int(parts[0]), parts[1].strip(), float(parts[2]) if len(parts) > 2 else 0.0
    except (ValueError, IndexError):
        raise ValueError(f"{TEST_DIE_ENV}={spec!r}: expected RANK:STAGE[:SECONDS]") from None
    return (stage, after) if who == rank and stage else None


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def block_stop_signals() -> None:
    """Block SIGTERM and SIGINT in this thread and every thread started after it, so that only the session's
    ``sigwait`` thread takes them. Called before torch is imported: threads torch starts at import would otherwise
    leave SIGTERM unblocked, and the kernel may hand a process-wide SIGTERM to one of them -- its default action kills
    the rank without a report (and a SIGINT there runs Python's handler, which the blocked main thread never sees)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _matches(stage: str, name: str, detail: str) -> bool:
    where = f"{name} {detail}".strip()
    return where == stage or where.startswith(stage + " ")


@dataclass
class Options:
    backend: str = "auto"
    timeout: float = 60.0
    json: bool = False
    bench: bool = False
    sizes: list[int] = field(default_factory=list)
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    nccl_debug: str | None = None
    nccl_debug_subsys: str | None = None
    pairs: bool = False
    pair_size: int = 8 << 20
    pair_iters: int = 5


def summary_text(world: int, backend: str, rows: list[dict], findings: list[Finding], bench_text: str = "",
                 color: bool = False) -> str:
    """The table and the findings; ``color`` paints the severity marks, as every command does on a terminal."""
    out = [f"torchdoctor comm: {world} ranks, backend {backend}"]
    w_host = max([4] + [len(str(r["host"] or "?")) for r in rows])
    w_dev = max([6] + [len(str(r["device"] or "?")) for r in rows])
    out.append(f"{'rank':>4}  {'host':<{w_host}}  {'local':>5}  {'device':<{w_dev}}  status")
    for r in rows:
        status = {"ok": "OK", "broken": "BROKEN", "missing": "MISSING", "interrupted": "INTERRUPTED"}[r["status"]]
        if r["detail"]:
            status += f" ({r['detail']})"
        local = "?" if r["local_rank"] is None else r["local_rank"]
        out.append(f"{r['rank']:>4}  {str(r['host'] or '?'):<{w_host}}  {local:>5}  "
                   f"{str(r['device'] or '?'):<{w_dev}}  {status}")
    if bench_text:
        out += ["", bench_text]
    out += ["", render_text(findings, color=color)]
    return "\n".join(out)


class RankSession:
    def __init__(self, launch: Launch, opts: Options):
        self.launch, self.opts = launch, opts
        self.channel: SideChannel | None = None
        self.backend = opts.backend
        self.stage, self.detail = "connect", ""
        self.deadline: float | None = None
        self._ending = threading.Lock()  # one ending per process: the success report or fail(), never both
        self._posted_ok = False
        self._printed = False
        self.bench_results: list = []
        self.pair_links: list = []
        self.idents: dict = {}
        self.usage_error = False
        self._armed_at = 0.0
        self._die_at = injected_death(os.environ.get(TEST_DIE_ENV), launch.rank)

    # -- stage bookkeeping -------------------------------------------------------------------------
    def touch(self) -> float:
        """Progress was made: the current stage gets a fresh deadline (returned)."""
        now = time.monotonic()
        self.deadline = now + self.opts.timeout
        if now - self._armed_at > 1.0:  # throttled: the benchmark touches every iteration
            self._armed_at = now
            # Last resort, in C (no GIL needed): if a driver call holds the GIL and the watchdog thread cannot
            # run, dump the stacks and exit instead of hanging forever.
            faulthandler.dump_traceback_later(self.opts.timeout + HARD_EXIT_S, exit=True)
        return self.deadline

    def enter(self, name: str, detail: str = "") -> None:
        self.stage, self.detail = name, detail
        if self.channel:
            self.channel.post_stage(name, detail)
        self.touch()
        if self._die_at and _matches(self._die_at[0], name, detail):
            kill = threading.Timer(self._die_at[1], os.kill, (os.getpid(), signal.SIGKILL))
            kill.daemon = True
            kill.start()
            self._die_at = None

    @contextmanager
    def run_stage(self, name: str, detail: str = ""):
        self.enter(name, detail)
        try:
            yield
        except checks.WrongResult as e:
            self.fail("wrong", str(e))
        except Exception as e:  # any failure inside a stage is a verdict, not a traceback: said as what it is
            self.fail(*errors.classify(e))
        self.deadline = None

    def _watchdog(self) -> None:
        while True:
            time.sleep(0.1)
            d = self.deadline
            where = f"{self.stage} {self.detail}".strip()
            dead = self.channel.peer_deaths if self.channel else {}
            if dead and d is not None:  # a peer its launcher saw die: no stage that needs it can complete
                r = min(dead)
                self.fail("peer-died", f"rank {r} {rules.exit_words(dead[r])} (seen by its launcher) while this "
                                       f"rank was in {where}")
            if d is not None and time.monotonic() > d:
                self.fail("timeout", f"no progress in {where} for {self.opts.timeout:g} s")

    def _signals(self) -> None:
        if signal.sigwait(STOP_SIGNALS) == signal.SIGINT:  # Ctrl-C, or srun passing it on
            self.fail("interrupted", "interrupted by the user (SIGINT, Ctrl-C)")
        self.fail("terminated", self._terminated_words())

    def _terminated_words(self) -> str:
        """Who sent this rank its SIGTERM. Under --local only the launcher passes one on, when it got a signal from
        outside; under torchrun or srun it is their agent, which stops every rank once one has failed."""
        if self.launch.mode != "local":
            return "stopped by SIGTERM (launchers stop every rank when one fails)"
        try:
            got = self.channel.get("stopped_by") if self.channel else None
        except Exception:
            got = None
        if got:
            return f"stopped from outside ({got} to torchdoctor comm --local, passed on to every rank)"
        return "stopped by a SIGTERM sent to this rank's own process (not through torchdoctor comm --local)"

    # -- the end -----------------------------------------------------------------------------------
    def fail(self, kind: str, error: str) -> None:
        """Record the failure, report, and leave the process. Never returns."""
        if not self._ending.acquire(blocking=False):
            time.sleep(HARD_EXIT_S)  # the other ending exits the process long before this
            self._exit(EXIT_PROBLEMS)
        self.deadline = None
        code = EXIT_PROBLEMS
        try:
            self._arm_hard_exit()
            if self.channel is None and kind in ("interrupted", "terminated"):  # stopped before it reached the store
                print(f"[rank {self.launch.rank}] torchdoctor comm: {error}, before this rank reached the rendezvous "
                      "store: nothing was checked", file=sys.stderr, flush=True)
                return
            if self.channel is None:  # could not even reach the store
                self._print_alone(kind, error)
                return
            if not self._posted_ok:  # a SIGTERM after this rank passed does not turn it into a failure
                self.channel.post_final("broken", self.stage, self.detail, kind, error)
            code = self.report(settle=min(self.opts.timeout, 8.0))
        except BaseException:  # reporting itself broke (a closed stdout, a lost store): still leave
            pass
        finally:
            # a signal after this rank passed (and printed that every rank did) changed nothing: the verdict's code
            self._exit(EXIT_USAGE if self.usage_error else code if self._posted_ok else
                       EXIT_INTERRUPTED if kind == "interrupted" else max(code, EXIT_PROBLEMS))

    def _arm_hard_exit(self) -> None:
        """Reporting reads the store, which can block forever if its host froze: bound it (a Python timer that
        says why, and behind it faulthandler's C thread in case the GIL is stuck)."""
        settle = min(self.opts.timeout, 8.0)
        faulthandler.dump_traceback_later(settle + HARD_EXIT_S + 5, exit=True)

        def give_up():
            if not self._printed:
                print(f"[rank {self.launch.rank}] torchdoctor comm: no verdict: the rendezvous store at "
                      f"{self.launch.master_addr}:{self.launch.master_port} stopped answering while this rank "
                      f"was reporting a failure in {self.stage} (its host froze or is unreachable)", flush=True)
            self._exit(EXIT_PROBLEMS)

        t = threading.Timer(settle + HARD_EXIT_S, give_up)
        t.daemon = True
        t.start()

    def _arm_hard_exit_after(self, settle: float) -> None:
        faulthandler.dump_traceback_later(settle + HARD_EXIT_S, exit=True)

    def _exit(self, code: int) -> NoReturn:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    def _print_alone(self, kind: str, error: str) -> None:
        where = f"{self.launch.master_addr}:{self.launch.master_port}"
        if "address already in use" in error.lower() or "eaddrinuse" in error.lower():
            f = Finding("comm.port-in-use", "fail", f"rank {self.launch.rank} cannot host the rendezvous store: port "
                        f"{self.launch.master_port} is already in use", evidence=[error],
                        fix=[f"pick a free MASTER_PORT (`ss -ltnp | grep {self.launch.master_port}` shows who holds "
                             "it), the same on every node"], data={"rank": self.launch.rank})
        else:
            f = self._unreachable(kind, error, where)
        self._printed = True
        if self.opts.json:
            print(dumps({"world_size": self.launch.world_size, "backend": self.backend,
                         "timeout_s": self.opts.timeout, "launch": self.launch.mode, "ranks": [],
                         "findings": [f.to_json()]}))
        else:
            text = render_text([f], color=use_color(sys.stdout))
            print("\n".join(f"[rank {self.launch.rank}] {line}" for line in text.splitlines()))

    def _unreachable(self, kind: str, error: str, where: str) -> Finding:
        return Finding(
            "comm.store-unreachable", "fail",
            f"rank {self.launch.rank} cannot reach the rendezvous store at {where}",
            evidence=[f"no answer within {self.opts.timeout:g} s" if kind == "timeout" else error],
            fix=[f"check MASTER_ADDR/MASTER_PORT ({self.launch.master_addr}:{self.launch.master_port}): from this "
                 "host `nc -zv <addr> <port>` must connect; rank 0 must be running (under srun it hosts the store)",
                 "a firewall between nodes, or an address that resolves to another interface, gives the same "
                 "symptom: use the IP of the interface the nodes share"],
            data={"rank": self.launch.rank, "kind": kind},
        )

    def verdict(self, settle: float) -> tuple[list[dict], list[Finding], int, dict]:
        """Rows, findings and exit code from the side channel, after letting it settle."""
        ch = self.channel
        snap = ch.snapshot(settle=settle)
        here = socket.gethostname()
        for rec in snap.values():  # a silent rank on this host: is its process gone, stopped, or hung?
            # its own identity, or (a rank that never joined) the process --local's launcher started for it
            proc = rec["identity"] or (None if rec.get("exit") else rec.get("started"))
            if proc and not rec["final"] and not rec["alive"] and proc.get("host") == here:
                rec.update(process_status(proc.get("pid")))  # now: under --local the launcher ends it after this
        if self.backend == "auto":
            self.backend = ch.get("backend") or "not chosen"
        local = self.launch.mode == "local"
        rows, findings = rules.judge(snap, self.backend, self.opts.timeout, ch.lost,
                                     None if self.launch.agent_store else 0,
                                     stopped_by=ch.get("stopped_by") if local else None, local=local,
                                     slurm_job=os.environ.get("SLURM_JOB_ID") or None)
        # What the identities show (a shared GPU, differing versions) is often the cause of a failed stage
        cross = rules.cross_rank({r: s["identity"] for r, s in snap.items()}, self.backend)
        findings = [f for f in cross if f.severity == "fail"] + findings + [f for f in cross if f.severity != "fail"]
        if not any(f.severity == "fail" for f in findings) and all(r["stage"] == "done" for r in rows):
            stages = "join, init, device, all_reduce, all_gather, broadcast" + (
                ", ring" if self.launch.world_size > 1 else "") + ", barrier" + (", bench" if self.opts.bench else "") \
                + (", pairs" if self.opts.pairs and self.launch.world_size > 1 else "")
            findings.insert(0, Finding("comm.ok", "ok", f"all {len(rows)} ranks passed every stage ({stages})",
                                       data={"backend": self.backend}))
        if self.opts.bench and self.launch.world_size == 1:
            findings.append(Finding(
                "comm.bench-one-rank", "info",
                "one rank: the benchmark moved no data between devices, so its GB/s are not a bandwidth",
                evidence=["with a single rank every collective is a local no-op (NCCL returns in ~20 us whatever "
                          "the size), and the nccl-tests factor for broadcast is 1 at any rank count"],
                fix=["measure links with 2 or more ranks: torchrun --nproc_per_node 2 -m torchdoctor comm --bench"]))
        if self.pair_links:
            from .pairs import findings as pair_findings

            findings += pair_findings(self.pair_links)
        code = EXIT_USAGE if self.usage_error else (
            EXIT_PROBLEMS if any(f.severity == "fail" for f in findings) else EXIT_OK)
        return rows, findings, code, snap

    def report(self, settle: float) -> int:
        """The reporter (lowest rank that reached its end) prints the verdict. Returns the exit code."""
        rows, findings, code, snap = self.verdict(settle)
        for row in rows:  # --json carries each rank's full identity (versions, device UUID, NCCL_* env)
            row["identity"] = snap[row["rank"]]["identity"]
        finals = [r for r, s in snap.items() if s["final"]]
        if self.channel.lost:  # no coordination possible: better one table per survivor than none
            self._print(rows, findings, prefix=f"[rank {self.launch.rank}] ")
        elif finals and min(finals) == self.launch.rank and self.channel.claim_report():
            self._print(rows, findings)
        self._leave(finals)
        return code

    def _print(self, rows, findings, prefix: str = "") -> None:
        from .bench import render_bench

        self._printed = True
        if self.opts.json:
            out = {"world_size": self.launch.world_size, "backend": self.backend, "timeout_s": self.opts.timeout,
                   "launch": self.launch.mode, "ranks": rows, "findings": [f.to_json() for f in findings]}
            if self.opts.bench:
                out["bench"] = [b.to_json() for b in self.bench_results]
            if self.opts.pairs:
                out["pairs"] = {"bytes": self.opts.pair_size, "iters": self.opts.pair_iters,
                                "links": [x.to_json() for x in self.pair_links]}
            print(dumps(out))
        else:
            bench = render_bench(self.bench_results, self.launch.world_size) if self.bench_results else ""
            if self.pair_links:
                from .pairs import render as render_pairs

                bench = "\n\n".join(t for t in (bench, render_pairs(self.pair_links, self.launch.world_size,
                                                                      self.opts.pair_size, self.opts.pair_iters)) if t)
            text = summary_text(self.launch.world_size, self.backend, rows, findings, bench, use_color(sys.stdout))
            print("\n".join(prefix + line for line in text.splitlines()) if prefix else text)
        sys.stdout.flush()

    def _leave(self, finished: list[int]) -> None:
        """Under plain srun rank 0 hosts the store: it stays until the ranks that finished have read it."""
        ch = self.channel
        ch.post("left", True)
        if ch.hosts_store:
            ch.wait_for("left", time.monotonic() + 10, ranks=finished)
        ch.close()

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> NoReturn:
        block_stop_signals()  # before any thread (run.py does it before importing torch), so only _signals gets them
        threading.Thread(target=self._signals, name="torchdoctor-signals", daemon=True).start()
        threading.Thread(target=self._watchdog, name="torchdoctor-watchdog", daemon=True).start()
        if self.opts.nccl_debug:
            os.environ["NCCL_DEBUG"] = self.opts.nccl_debug
        if self.opts.nccl_debug_subsys:
            os.environ["NCCL_DEBUG_SUBSYS"] = self.opts.nccl_debug_subsys
        self.enter("connect", f"{self.launch.master_addr}:{self.launch.master_port}")
        try:
            self.channel = SideChannel(self.launch, self.opts.timeout)
        except StoreUnreachable as e:
            self.fail("error", str(e))
        import torch
        import torch.distributed as dist

        me = identity.probe(self.launch.rank, self.launch.local_rank)
        ch, n, rank = self.channel, self.launch.world_size, self.launch.rank
        ch.post_identity(me)
        ch.start_heartbeat()
        with self.run_stage("join"):  # each rank that joins renews the deadline: --local starts ranks in batches
            missing = ch.wait_for("id", time.monotonic() + self.opts.timeout, on_arrival=self.touch)
            if missing:
                self.fail("timeout", f"ranks {', '.join(map(str, sorted(missing)))} did not join within "
                                     f"{self.opts.timeout:g} s of the last rank that did")
        idents = self.idents = {r: ch.get(f"id/{r}") for r in range(n)}
        self.backend = self._resolve_backend(idents)
        if rank == 0:
            ch.put("backend", self.backend)
        use_gpu = me["device"] != "cpu"
        device = torch.device(me["device"]) if use_gpu else torch.device("cpu")
        comm_device = device if self.backend == "nccl" else torch.device("cpu")
        with self.run_stage("init", self.backend):
            if use_gpu:
                torch.cuda.set_device(device)
            # device_id makes NCCL create its communicator here, so NCCL's own start-up errors land in "init"
            bound = {"device_id": device} if self.backend == "nccl" else {}
            dist.init_process_group(
                self.backend, store=_prefix(ch, "pg"), rank=rank, world_size=n,
                timeout=datetime.timedelta(seconds=self.opts.timeout + 30),  # our watchdog fires first
                **bound,
            )
        with self.run_stage("device", str(device)):
            checks.allocate(torch, device)
        with self.run_stage("all_reduce"):
            checks.all_reduce(torch, dist, comm_device, rank, n)
        with self.run_stage("all_gather", "identities"):
            checks.all_gather_identity(torch, dist, comm_device, me, n, idents)
        with self.run_stage("broadcast", "from rank 0"):
            checks.broadcast(torch, dist, comm_device, rank)
        if n > 1:  # NCCL refuses a send to oneself; one rank has no link to test anyway
            with self.run_stage("ring", f"send {rank}->{(rank + 1) % n}, recv {(rank - 1) % n}->{rank}"):
                checks.ring(torch, dist, comm_device, rank, n, lambda v: ch.post("ring", v))
        with self.run_stage("barrier"):
            dist.barrier()
        if self.opts.bench:
            self._bench(torch, dist, comm_device)
        if self.opts.pairs and n > 1:
            self._pairs(torch, dist, comm_device)
        with self.run_stage("done"):
            ch.post_final("ok", "done")
            self._posted_ok = True
            dist.destroy_process_group()
        if not self._ending.acquire(blocking=False):  # a SIGTERM arrived meanwhile: fail() reports
            time.sleep(HARD_EXIT_S)
        self.deadline = None
        self._arm_hard_exit_after(self.opts.timeout)
        self._exit(self.report(settle=self.opts.timeout))

    def _bench(self, torch, dist, device) -> None:
        from .bench import Progress, run_bench
        from .sizes import format_bytes

        dtype = getattr(torch, self.opts.dtype)
        progress = Progress(len(self.opts.sizes) * 5, enabled=self.launch.rank == 0)
        progress.start(f"5 ops x {len(self.opts.sizes)} sizes, {self.opts.iters} timed iterations each "
                       f"(+{self.opts.warmup} warmup), {self.launch.world_size} ranks, {self.backend}")
        with self.run_stage("bench"):
            self.bench_results = run_bench(
                torch, dist, device, self.launch.rank, self.launch.world_size, self.opts.sizes, dtype,
                self.opts.iters, self.opts.warmup,
                on_item=lambda op, nbytes: self.enter("bench", f"{op} {format_bytes(nbytes)}"),
                on_iter=self.touch, progress=progress,
            )

    def _pairs(self, torch, dist, device) -> None:
        from . import pairs

        rank, n = self.launch.rank, self.launch.world_size
        t0 = time.monotonic()

        def on_round(k: int, total: int, what: str) -> None:
            self.enter("pairs", f"round {k + 1}/{total} ({what})")
            if rank == 0:
                print(f"[pairs] round {k + 1}/{total} ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

        with self.run_stage("pairs"):
            got = pairs.measure(torch, dist, device, rank, n, self.opts.pair_size, self.opts.pair_iters, 1,
                                on_round, self.touch)
        with self.run_stage("pairs", "gather"):
            everyone = checks.all_gather_json(torch, dist, device, [[s, d, t] for (s, d), t in got.items()], n)
        measured = {(s, d): t for part in everyone for s, d, t in part or ()}
        self.pair_links = pairs.links(measured, self.opts.pair_size, self.idents)

    def _resolve_backend(self, idents: dict) -> str:
        have = {r: bool(i and i.get("cuda_devices")) for r, i in idents.items()}
        if self.opts.backend == "auto":
            return "nccl" if all(have.values()) else "gloo"
        if self.opts.backend == "nccl" and not all(have.values()):
            self.usage_error = True
            without = ", ".join(str(r) for r, h in have.items() if not h)
            self.stage = "init"
            self.fail("usage", f"--backend nccl needs a CUDA device on every rank; ranks {without} have none "
                               "(use --backend gloo, or auto)")
        return self.opts.backend


def _prefix(ch: SideChannel, name: str):
    """The process group's store: its own connection. A backend waiting in the store (gloo's init waiting for a
    peer's address, NCCL's for a unique id) holds its client's lock for the whole wait, so on the side channel's
    connection it would block the failure report of the very rank it left waiting."""
    from torch.distributed import PrefixStore

    return PrefixStore(f"{ch.prefix}/{name}", ch.connect())

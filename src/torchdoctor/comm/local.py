"""``torchdoctor comm --local N``: start N ranks on this machine, the way torchrun would.

This process hosts the rendezvous store (so the side channel outlives any rank), starts the ranks as
subprocesses of ``python -m torchdoctor comm`` and waits for them. The ranks check and report
themselves; if none of them could print a verdict (all killed), this process prints it from the store.

As a launcher it sees what the ranks cannot: how a rank's process ended. It posts that (exit code or signal) to
the side channel the moment it reaps the process, so the others name a rank killed before it joined (or hung
in a collective with a dead peer) at once, instead of waiting out the timeout and calling it "never joined".

It also posts the pid of each rank it starts: a rank that never joined has no identity of its own, and the verdict
still looks at its process (stopped, or running and stuck in its start) instead of calling it "never joined".

It starts the ranks in batches (:func:`capacity.batch_size`): each imports torch, seconds of CPU, and N at once
would leave the machine thrashing. The ranks live in a process group of their own (:class:`procs.RankGroup`): a
Ctrl-C reaches this process alone, which tells the ranks (SIGINT: "interrupted by the user"); so does a SIGTERM
or SIGHUP sent to it (``timeout``, ``kill``, a closed terminal: "stopped from outside", exit 128 + the signal). On its
way out it ends the group, and a rank dies with its launcher even when the launcher is SIGKILLed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Callable

from .launch import Launch, free_port
from .procs import RankGroup
from .session import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, HARD_EXIT_S, Options, RankSession
from .sidechannel import SideChannel, exit_record, post_exit, post_pid

GRACE_S = 8.0 + HARD_EXIT_S  # a rank's report (settle) and its hard exit, beyond the stage deadline
REPORT_S = 8.0 + 5.0  # after a signal was passed on: a rank's report (settle) and its exit
LEAVE_S = 5.0  # after the verdict is out: the other ranks' own exits; then they are killed
# signals from outside that stop the run with a report (the ranks get SIGINT for a Ctrl-C, SIGTERM for the others)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def child_argv(opts: Options) -> list[str]:

    argv = ["--backend", opts.backend, "--timeout", f"{opts.timeout:g}"]
    if opts.json:
        argv.append("--json")
    if opts.bench:
        argv += ["--bench", "--sizes", ",".join(str(s) for s in opts.sizes), "--iters", str(opts.iters),
                 "--warmup", str(opts.warmup), "--dtype", opts.dtype]
    if opts.pairs:
        argv += ["--pairs", "--pair-size", str(opts.pair_size), "--pair-iters", str(opts.pair_iters)]
    if opts.nccl_debug:
        argv += ["--nccl-debug", opts.nccl_debug]
    if opts.nccl_debug_subsys:
        argv += ["--nccl-debug-subsys", opts.nccl_debug_subsys]
    return argv


def run_local(n: int, opts: Options, batch: int) -> int:
    from torch.distributed import PrefixStore, TCPStore

    from .sidechannel import key_prefix

    port = free_port()
    store = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=opts.timeout),
                     wait_for_workers=False)
    base = dict(os.environ)
    for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_RESTART_COUNT"):
        base.pop(k, None)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                TORCHDOCTOR_AGENT_STORE="1", TORCHDOCTOR_LAUNCH_MODE="local")
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks must not each take every core
    cmd = [sys.executable, "-m", "torchdoctor", "comm", *child_argv(opts)]
    channel = PrefixStore(key_prefix("0.0"), store)
    group = RankGroup()

    def start(rank: int) -> None:
        p = group.start(rank, cmd, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        with contextlib.suppress(Exception):  # the verdict's help, not the run's condition
            post_pid(channel, rank, p.pid)

    def ended(rank: int, returncode: int, pid: int, on_signal: str | None) -> None:
        post_exit(channel, rank, {**exit_record(returncode, pid), **({"on_signal": on_signal} if on_signal else {})})

    supervisor = _Supervisor(n, batch, opts.timeout, group, channel, start, ended)
    try:
        stopped_by = supervisor.run()
        if supervisor.signals > 1:
            twice = ("interrupted twice" if stopped_by == signal.SIGINT else
                     f"stopped from outside twice ({signal.Signals(stopped_by).name})")
            print(f"torchdoctor comm --local: {twice}: the ranks were killed without a report", file=sys.stderr,
                  flush=True)
        elif not channel.check(["reporter"]):
            _report_for_dead_ranks(n, port, opts)
    finally:
        group.end()
    if stopped_by is not None:  # a signal after every rank passed changed nothing
        if _all_passed(channel, n):
            return EXIT_OK
        return EXIT_INTERRUPTED if stopped_by == signal.SIGINT else 128 + stopped_by
    reporter = group.procs.get(supervisor.reporter) if supervisor.reporter is not None else None
    if reporter is not None and reporter.returncode is not None and reporter.returncode >= 0:
        return reporter.returncode  # the verdict's own code: a rank killed after it does not change it
    codes = [p.returncode for p in group.procs.values()]
    if len(codes) == n and all(c == EXIT_OK for c in codes):
        return EXIT_OK
    return EXIT_USAGE if codes and all(c == EXIT_USAGE for c in codes) else EXIT_PROBLEMS


def _all_passed(channel, n: int) -> bool:
    """Every rank posted its final status, and every one is "ok": the verdict was complete."""
    try:
        for r in range(n):
            if not channel.check([f"final/{r}"]) or json.loads(channel.get(f"final/{r}"))["status"] != "ok":
                return False
    except Exception:
        return False
    return True


class _JoinProgress:
    """While ranks are still joining (many ranks start slowly: each imports torch), a line on stderr now and
    then -- ``12/64 ranks joined (6 s), 16 started`` -- so a long start is not silence. Nothing for a start under
    2 s."""

    FIRST_S, EVERY_S = 2.0, 5.0

    def __init__(self, channel, n: int) -> None:
        self.channel, self.n, self.start = channel, n, time.monotonic()
        self.joined: set[int] = set()
        self.last_print: float | None = None

    def poll(self, started: int | None = None) -> None:
        if len(self.joined) == self.n:
            return
        now = time.monotonic()
        if now - self.start < self.FIRST_S or (self.last_print is not None and now - self.last_print < self.EVERY_S):
            return
        with contextlib.suppress(Exception):  # progress is a courtesy: never let it break the run
            self.joined |= {r for r in range(self.n) if r not in self.joined and self.channel.check([f"id/{r}"])}
        self.last_print = now
        more = f", {started} started" if started is not None and started < self.n else ""
        print(f"torchdoctor comm --local: {len(self.joined)}/{self.n} ranks joined ({now - self.start:.0f} s){more}",
              file=sys.stderr, flush=True)


class _Supervisor:
    """Start the ranks batch by batch and wait for them; never forever.

    - A batch starts once every rank of the one before has joined or ended (or after half the timeout: a rank
      stuck in its start must not hold the others back); none starts after a rank ended or a signal came.
    - Once the verdict is out (the reporter claimed it and exited), stopped ranks are SIGKILLed at once -- no
      other signal reaches them -- and the rest get :data:`LEAVE_S` to exit.
    - Without a verdict: once a rank ended, the others get their own deadline plus the time to report; after a
      signal, the time to report it. Then SIGKILL.
    - SIGINT (Ctrl-C), SIGTERM and SIGHUP to this process are recorded (``stopped_by``) and passed on to the ranks
      (SIGHUP as SIGTERM), which report them; ranks still starting are killed (they have nothing to report, and a
      signal there would print a traceback); a second signal kills them all. Ctrl-Z (SIGTSTP) stops the ranks with
      this process, SIGCONT resumes them.
    """

    def __init__(self, n: int, batch: int, timeout: float, group: RankGroup, channel,
                 start: Callable[[int], None], ended: Callable[[int, int, int, str | None], None]) -> None:
        self.n, self.batch, self.timeout = n, batch, timeout
        self.group, self.channel, self._start, self._ended = group, channel, start, ended
        self.progress = _JoinProgress(channel, n)
        self.started = 0
        self.stop: int | None = None  # the first signal received
        self.signals = 0
        self._told: set[int] = set()
        self._batch: list[int] = []
        self._batch_at = self._stop_at = 0.0
        self.reporter: int | None = None  # the rank that printed the verdict, once it has

    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if self.stop is None:
            self.stop, self._stop_at = signum, time.monotonic()
        if self.signals > 1:  # asked twice: stop waiting for reports
            self.group.send(signal.SIGKILL)
            return
        with contextlib.suppress(Exception):  # the verdict says who stopped the run; the ranks word it by it
            self.channel.set("stopped_by", json.dumps(signal.Signals(signum).name))
        self._stop_ranks(signum)

    def _stop_ranks(self, signum: int) -> None:
        """A rank still importing torch has nothing to report, and a signal there prints a traceback (or one line
        per rank): it is killed, and its exit record says why. The others get the signal and report it."""
        self.group.kill([r for r in self.group.running() if not self._joined(r)])
        self.group.send(self._passed_on(signum))  # "interrupted by the user" / "stopped from outside"

    @staticmethod
    def _passed_on(signum: int) -> int:
        """What the ranks get for a signal this process received: they report SIGINT and SIGTERM."""
        return signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM

    def _on_suspend(self, _signum, _frame) -> None:
        """Ctrl-Z reaches this process alone (the ranks have their own group): the ranks stop with it, as they did
        in the terminal's group, instead of timing out on a store that stopped answering."""
        self.group.send(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def _on_resume(self, _signum, _frame) -> None:
        self.group.send(signal.SIGCONT)

    def run(self) -> int | None:
        """Returns the signal that stopped the run, or None."""
        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        old.update({signal.SIGTSTP: signal.signal(signal.SIGTSTP, self._on_suspend),
                    signal.SIGCONT: signal.signal(signal.SIGCONT, self._on_resume)})
        try:
            self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return self.stop

    def _loop(self) -> None:
        first_end = verdict_at = None
        while True:
            if self.stop is None and first_end is None and self.started < self.n and self._batch_done():
                self._next_batch()
            self._tell()
            self.progress.poll(self.started)
            if not self.group.running() and (self.started == self.n or self.stop is not None or first_end):
                return
            now = time.monotonic()
            if first_end is None and len(self._told) > 0:
                first_end = now
            if verdict_at is None and first_end is not None and self._verdict_out():
                verdict_at = now
                self.group.kill_stopped()
            late = (verdict_at is not None and now - verdict_at > LEAVE_S
                    or self.stop is not None and now - self._stop_at > REPORT_S
                    or first_end is not None and now - first_end > self.timeout + GRACE_S)
            if late:
                self.group.send(signal.SIGKILL)
            time.sleep(0.1)

    def _batch_done(self) -> bool:
        if not self._batch:
            return True
        if time.monotonic() - self._batch_at > self.timeout / 2:
            return True
        waiting = [r for r in self._batch if r not in self._told and self.group.procs[r].poll() is None]
        try:
            return not waiting or self.channel.check([f"id/{r}" for r in waiting])
        except Exception:  # the store is ours: an error here is a hiccup, decided at the next poll
            return False

    def _next_batch(self) -> None:
        self._batch = list(range(self.started, min(self.n, self.started + self.batch)))
        self._batch_at = time.monotonic()
        for r in self._batch:
            if self.stop is not None:
                break
            self._start(r)
            self.started += 1
        if self.stop is not None and self.signals == 1:  # it came while a rank was being started: that one missed it
            self._stop_ranks(self.stop)
        with contextlib.suppress(Exception):  # the verdict tells ranks never started from ranks that never joined
            self.channel.set("launched", json.dumps(self.started))

    def _tell(self) -> None:
        """Post each rank's end as soon as it is reaped (within a poll, 0.1 s)."""
        for r, p in self.group.procs.items():
            if r not in self._told and p.poll() is not None:
                self._told.add(r)
                with contextlib.suppress(Exception):  # the report matters more than the record
                    # a rank that ends after the signal ended on it, whatever its code (one still starting when
                    # it came may leave with 1, not 130 or -15): no fault of its own
                    on = signal.Signals(self.stop).name if self.stop is not None else None
                    self._ended(r, p.returncode, p.pid, on)

    def _joined(self, rank: int) -> bool:
        try:
            return self.channel.check([f"id/{rank}"])
        except Exception:
            return True  # unknown: it gets the signal, not a kill

    def _verdict_out(self) -> bool:
        """The reporter claimed the verdict and its process has ended: it printed it."""
        try:
            if not self.channel.check(["reporter"]):
                return False
            rank = int(self.channel.get("reporter"))
        except Exception:
            return False
        p = self.group.procs.get(rank)
        if p is None or p.poll() is None:
            return False
        self.reporter = rank
        return True


def _report_for_dead_ranks(n: int, port: int, opts: Options) -> None:
    """Every rank ended without printing a verdict (killed, or interrupted before joining): say so from what they
    left in the store."""
    launch = Launch(0, n, 0, "127.0.0.1", port, "local", agent_store=True, run_id="0.0")
    session = RankSession(launch, opts)
    session.channel = SideChannel(launch, opts.timeout)
    rows, findings, _, snap = session.verdict(settle=1.0)
    for row in rows:
        row["identity"] = snap[row["rank"]]["identity"]
    session._print(rows, findings)

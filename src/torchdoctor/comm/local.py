"""``torchdoctor comm --local N``: start N ranks on this machine, the way torchrun would.

This process hosts the rendezvous store (so the side channel outlives any rank), starts the ranks as
subprocesses of ``python -m torchdoctor comm`` and waits for them. The ranks check and report
themselves; if none of them could print a verdict (all killed), this process prints it from the store.

As a launcher it sees what the ranks cannot: how a rank's process ended. It posts that (exit code or signal) to
the side channel the moment it reaps the process, so the others name a rank killed before it joined (or hung
in a collective with a dead peer) at once, instead of waiting out the timeout and calling it "never joined".
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from .launch import Launch, free_port
from .session import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, HARD_EXIT_S, Options, RankSession
from .sidechannel import SideChannel, exit_record, post_exit

GRACE_S = 8.0 + HARD_EXIT_S  # a rank's report (settle) and its hard exit, beyond the stage deadline


def child_argv(opts: Options) -> list[str]:

    argv = ["--backend", opts.backend, "--timeout", f"{opts.timeout:g}"]
    if opts.json:
        argv.append("--json")
    if opts.bench:
        argv += ["--bench", "--sizes", ",".join(str(s) for s in opts.sizes), "--iters", str(opts.iters),
                 "--warmup", str(opts.warmup), "--dtype", opts.dtype]
    if opts.nccl_debug:
        argv += ["--nccl-debug", opts.nccl_debug]
    if opts.nccl_debug_subsys:
        argv += ["--nccl-debug-subsys", opts.nccl_debug_subsys]
    return argv


def run_local(n: int, opts: Options) -> int:
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
    procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]
    channel = PrefixStore(key_prefix("0.0"), store)

    def ended(rank: int, p: subprocess.Popen) -> None:
        post_exit(channel, rank, exit_record(p.returncode, p.pid))

    codes, stopped_by = _wait(procs, opts.timeout, ended, _JoinProgress(channel, n).poll)
    if not channel.check(["reporter"]):
        _report_for_dead_ranks(n, port, opts)
    if stopped_by is not None:
        return 128 + stopped_by
    if all(c == EXIT_OK for c in codes):
        return EXIT_OK
    return EXIT_USAGE if all(c == EXIT_USAGE for c in codes) else EXIT_PROBLEMS


class _JoinProgress:
    """While ranks are still joining (many ranks start slowly: each imports torch), a line on stderr now and
    then -- ``12/64 ranks joined (6 s)`` -- so a long start is not silence. Nothing for a start under 2 s."""

    FIRST_S, EVERY_S = 2.0, 5.0

    def __init__(self, channel, n: int) -> None:
        self.channel, self.n, self.start = channel, n, time.monotonic()
        self.joined: set[int] = set()
        self.last_print: float | None = None

    def poll(self) -> None:
        if len(self.joined) == self.n:
            return
        now = time.monotonic()
        if now - self.start < self.FIRST_S or (self.last_print is not None and now - self.last_print < self.EVERY_S):
            return
        with contextlib.suppress(Exception):  # progress is a courtesy: never let it break the run
            self.joined |= {r for r in range(self.n) if r not in self.joined and self.channel.check([f"id/{r}"])}
        self.last_print = now
        print(f"torchdoctor comm --local: {len(self.joined)}/{self.n} ranks joined ({now - self.start:.0f} s)",
              file=sys.stderr, flush=True)


def _wait(procs: list[subprocess.Popen], timeout: float,
          ended: Callable[[int, subprocess.Popen], None] = lambda r, p: None,
          progress: Callable[[], None] = lambda: None) -> tuple[list[int], int | None]:
    """Wait for the ranks; never forever. Once one has ended, the others get their own deadline plus the time
    to report; then SIGTERM (they report that), then SIGKILL. SIGTERM / Ctrl-C to this process reach them.
    ``ended(rank, process)`` is told of each rank's end as soon as it is reaped (within 0.1 s); ``progress()``
    is called on every poll (0.1 s)."""
    stop = {"signal": None}
    told: set[int] = set()

    def tell() -> None:
        for r, p in enumerate(procs):
            if r not in told and p.poll() is not None:
                told.add(r)
                with contextlib.suppress(Exception):  # the report matters more than the record
                    ended(r, p)

    def forward(signum, _frame):
        stop["signal"] = signum
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_end = None
        while any(p.poll() is None for p in procs):
            time.sleep(0.1)
            tell()
            progress()
            now = time.monotonic()
            if first_end is None and any(p.poll() is not None for p in procs):
                first_end = now
            if first_end is not None and now - first_end > timeout + GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                _reap(procs, 15)
                break
        if stop["signal"] is not None:
            _reap(procs, 15)
        tell()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return [p.returncode if p.returncode is not None else EXIT_PROBLEMS for p in procs], stop["signal"]


def _reap(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report_for_dead_ranks(n: int, port: int, opts: Options) -> None:
    """Every rank ended without printing a verdict (killed): say so from what they left in the store."""
    launch = Launch(0, n, 0, "127.0.0.1", port, "local", agent_store=True, run_id="0.0")
    session = RankSession(launch, opts)
    session.channel = SideChannel(launch, opts.timeout)
    rows, findings, _, snap = session.verdict(settle=1.0)
    for row in rows:
        row["identity"] = snap[row["rank"]]["identity"]
    session._print(rows, findings)

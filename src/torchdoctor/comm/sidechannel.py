"""The side channel: a key-value store next to the collectives, which a stuck collective cannot block.

Every rank writes here who it is, the stage it entered, a heartbeat counter and its final status. When a
collective fails or hangs, the survivors read this to say which rank never joined, died, or is stuck,
and where. The store is the rendezvous TCPStore: under torchrun (and ``--local``) it lives in a process
that outlives the ranks, so it survives any rank's death; under plain ``srun`` it lives in rank 0.

Two records come from outside the ranks' own stage bookkeeping, both read by the heartbeat thread (its own
connection, so a rank stuck in a collective still sees them):

- ``exit/<rank>`` and the counter ``exits``: ``--local``'s parent posts how a rank's process ended (exit code or
  signal) the moment it reaps it -- a launcher's view that turns "never joined" (after the timeout) into "killed by
  SIGKILL" (at once). Only watched under ``--local``: torchrun's agent does not write them.
- rank 0's stage, re-read every beat when rank 0 hosts the store: when rank 0 dies, its store dies with it, and
  the survivors can only say where it died from what they read before.

``--local``'s parent also writes, for the verdict: ``launched`` (how many ranks it has started: it starts them in
batches, so a rank that never joined may never have been started), ``pid/<rank>`` (the process it started for that
rank, and its host: a rank that never joined has no identity of its own, yet its process can be looked at) and
``stopped_by`` (the signal it received from outside: SIGINT for a Ctrl-C, SIGTERM / SIGHUP from ``timeout``, ``kill``
or a closed terminal; it passes it on to the ranks).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .launch import Launch

HEARTBEAT_S = 0.25


def key_prefix(run_id: str) -> str:
    """The side channel's namespace in the store (PrefixStore adds the separating slash)."""
    return f"torchdoctor/comm/{run_id}"


def exit_record(returncode: int, pid: int) -> dict:
    """How a rank's process ended, as its launcher saw it: ``Popen.returncode`` (negative: the signal)."""
    sig = None
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
    return {"returncode": returncode, "signal": sig, "pid": pid, "host": socket.gethostname()}


def post_pid(store, rank: int, pid: int) -> None:
    """The launcher's side: the process it just started for ``rank``."""
    store.set(f"pid/{rank}", json.dumps({"pid": pid, "host": socket.gethostname()}))


def post_exit(store, rank: int, record: dict) -> None:
    """The launcher's side: ``store`` is the run's PrefixStore; the counter tells heartbeats to look."""
    store.set(f"exit/{rank}", json.dumps(record))
    store.add("exits", 1)


class StoreUnreachable(RuntimeError):
    """The rendezvous store could not be reached (wrong address, firewall, or its host is gone)."""


def _tcp_store(launch: Launch, timeout: float, master: bool):
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            launch.master_addr, launch.master_port, None, master,
            timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
        )
    except Exception as e:  # RuntimeError / DistNetworkError / TimeoutError, depending on the torch version
        where = f"{launch.master_addr}:{launch.master_port}"
        raise StoreUnreachable(f"cannot reach the rendezvous store at {where}: {str(e).splitlines()[0]}") from e


class SideChannel:
    """Stage, heartbeat and status records of every rank, under one run's key prefix."""

    def __init__(self, launch: Launch, timeout: float):
        from torch.distributed import PrefixStore

        self.launch = launch
        self.timeout = timeout
        self.hosts_store = launch.rank == 0 and not launch.agent_store
        self.raw = _tcp_store(launch, timeout, master=self.hosts_store)
        self.prefix = key_prefix(launch.run_id)
        self.store = PrefixStore(self.prefix, self.raw)
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self.lost: str | None = None  # set when the store stops answering
        self._seen: dict[str, Any] = {}  # last values read: what a lost store leaves us
        self._claimed: bool | None = None
        # --local's parent posts exit/<rank> records; under any other launcher nobody does
        self.watch_exits = launch.mode == "local"
        self.exits: dict[int, dict] = {}  # rank -> how its process ended, as its launcher saw it
        self.peer_deaths: dict[int, dict] = {}  # those of them that ended without posting a final status

    # -- writing ------------------------------------------------------------------------------------
    def _set(self, key: str, value: Any) -> None:
        self._seen[key] = value  # what this rank wrote survives a lost store (its own row stays right)
        try:
            self.store.set(key, json.dumps(value))
        except Exception as e:
            self.lost = self.lost or str(e).splitlines()[0]

    def post_identity(self, ident: dict) -> None:
        self._set(f"id/{self.launch.rank}", ident)

    def post_stage(self, name: str, detail: str = "") -> None:
        self._set(f"stage/{self.launch.rank}", {"name": name, "detail": detail})

    def post_final(self, status: str, stage: str, detail: str = "", kind: str = "", error: str = "") -> None:
        self._set(f"final/{self.launch.rank}", {"status": status, "stage": stage, "detail": detail,
                                                "kind": kind, "error": error})

    def post(self, key: str, value: Any) -> None:
        self._set(f"{key}/{self.launch.rank}", value)

    def put(self, key: str, value: Any) -> None:
        """A run-wide value (not per rank), e.g. the backend rank 0 chose."""
        self._set(key, value)

    def start_heartbeat(self) -> None:
        """Bump ``hb/<rank>`` every HEARTBEAT_S from a thread with its own connection."""
        from torch.distributed import PrefixStore

        store = PrefixStore(self.prefix, self.connect())
        key = f"hb/{self.launch.rank}"
        watch_host = not self.launch.agent_store and self.launch.rank != 0  # rank 0 hosts the store
        exits_seen = 0

        def beat():
            nonlocal exits_seen
            while not self._beat_stop.is_set():
                with contextlib.suppress(Exception):  # a hiccup must not make this rank look dead
                    store.add(key, 1)
                if watch_host:
                    with contextlib.suppress(Exception):
                        if "stage/0" in self._seen or store.check(["stage/0"]):
                            self._seen["stage/0"] = json.loads(store.get("stage/0"))
                if self.watch_exits:
                    with contextlib.suppress(Exception):
                        count = int(store.add("exits", 0))
                        if count != exits_seen:
                            self._read_exits(store)
                            exits_seen = count
                self._beat_stop.wait(HEARTBEAT_S)

        self._beat_thread = threading.Thread(target=beat, name="torchdoctor-heartbeat", daemon=True)
        self._beat_thread.start()

    def connect(self):
        """A new client connection to the same store (the raw store, no prefix)."""
        return _tcp_store(self.launch, self.timeout, master=False)

    def _read_exits(self, store) -> None:
        """New ``exit/<rank>`` records; a peer that ended without a final status died (it posts its final before
        it leaves, so once its launcher saw it end, no final will come)."""
        for r in range(self.launch.world_size):
            if r in self.exits or not store.check([f"exit/{r}"]):
                continue
            rec = json.loads(store.get(f"exit/{r}"))
            self.exits[r] = self._seen[f"exit/{r}"] = rec
            # one that ended on the signal its launcher passed on to every rank: this rank has it too, and says so
            if r != self.launch.rank and not rec.get("on_signal") and not store.check([f"final/{r}"]):
                self.peer_deaths[r] = rec

    def stop_heartbeat(self, wait: float = 2.0) -> None:
        """Stop the heartbeat and wait (bounded) for its thread to leave the store client. A daemon thread
        still inside a C++ store call when Python finalizes is killed by ``pthread_exit`` unwinding through
        a noexcept frame: the process aborts ("terminate called without an active exception", SIGABRT)."""
        self._beat_stop.set()
        t = self._beat_thread
        if t is not None and t is not threading.current_thread():
            t.join(wait)

    def claim_report(self) -> bool:
        """True for exactly one call per run: the rank that prints the summary (asks the store once)."""
        if self._claimed is None:
            try:
                won = self.store.compare_set("reporter", "", str(self.launch.rank))
                self._claimed = won.decode() == str(self.launch.rank)
            except Exception:
                self._claimed = True  # no store, no coordination: better two tables than none
            return self._claimed
        return False  # this rank already printed (or lost): never a second table

    # -- reading ------------------------------------------------------------------------------------
    def get(self, key: str) -> Any:
        """The JSON value at ``key``, or None when absent (never blocks); the last value seen once lost."""
        if self.lost:
            return self._seen.get(key)
        try:
            if not self.store.check([key]):
                return None
            value = self._seen[key] = json.loads(self.store.get(key))
            return value
        except Exception as e:
            self.lost = self.lost or str(e).splitlines()[0]
            return self._seen.get(key)

    def heartbeats(self) -> dict[int, int]:
        out = {}
        for r in range(self.launch.world_size):
            try:
                out[r] = int(self.store.add(f"hb/{r}", 0))
            except Exception as e:
                self.lost = self.lost or str(e).splitlines()[0]
                out[r] = -1
        return out

    def wait_for(self, kind: str, deadline: float, poll: float = 0.05, ranks=None,
                 on_arrival: Callable[[], float] | None = None) -> set[int]:
        """Wait until every rank (of ``ranks``) has posted ``kind/<rank>`` or the deadline passes; the ranks missing.
        ``on_arrival()``, called when ranks arrived, returns the new deadline (progress renews it)."""
        missing = set(range(self.launch.world_size) if ranks is None else ranks)
        while True:
            arrived = {r for r in sorted(missing) if self.get(f"{kind}/{r}") is not None}
            missing -= arrived
            if arrived and missing and on_arrival is not None:
                deadline = on_arrival()
            if not missing or time.monotonic() >= deadline or self.lost:
                return missing
            time.sleep(poll)

    def snapshot(self, settle: float = 5.0, window: float = 1.2) -> dict[int, dict]:
        """Every rank's records plus ``alive`` (heartbeat moved in the last ``window`` seconds).

        Waits up to ``settle`` seconds for the picture to stop changing: every rank either posted its
        final status or is known dead. Ranks still running after that are reported alive, in their stage.
        """
        n = self.launch.world_size
        start = time.monotonic()
        first = self.heartbeats()
        moved: set[int] = set()
        while True:
            time.sleep(0.2)
            now = self.heartbeats()
            moved |= {r for r in range(n) if now[r] != first[r]}
            finals = {r for r in range(n) if self.get(f"final/{r}") is not None}
            elapsed = time.monotonic() - start
            if self.lost:
                break
            if elapsed >= window and all(r in finals or r not in moved for r in range(n)):
                break
            if len(finals) == n or elapsed >= settle:
                break
        launched = self.get("launched") if self.watch_exits else None  # how many ranks --local has started
        snap = {}
        for r in range(n):
            snap[r] = {
                "identity": self.get(f"id/{r}"),
                "stage": self.get(f"stage/{r}"),
                "final": self.get(f"final/{r}"),
                "ring": self.get(f"ring/{r}"),
                "alive": r in moved,
                "exit": self.get(f"exit/{r}") if self.watch_exits else None,
                "launched": None if launched is None else r < launched,
                "started": self.get(f"pid/{r}") if self.watch_exits else None,  # {"pid", "host"}: --local started it
            }
        return snap

    def close(self) -> None:
        self.stop_heartbeat()

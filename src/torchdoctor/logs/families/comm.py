"""Communication failures: NCCL and gloo collectives that time out, a hung watchdog, the network under them, the
store and rendezvous every rank meets at, and invalid usage (two ranks on one GPU). The handlers here keep what each
line says; :mod:`.comm_verdicts` judges it.

Message table (each regex below names where its text is printed):

- PyTorch ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` (read at pytorch/pytorch@cf1380dfb6c8 (~2.1),
  @0007e752d518 (~2.2) and a ~2.8 copy, cyyever/pytorch@0b10febc2dd0): ``WorkNCCL::checkTimeout`` "Watchdog caught
  collective operation timeout: WorkNCCL(SeqNum=.., OpType=.., NumelIn=.., NumelOut=.., Timeout(ms)=..) ran for ..
  milliseconds before timing out." (1.x prints ``WorkNCCL(OpType=.., Timeout(ms)=..)``), "Work .. timed out in
  blocking wait", ``handleException`` "Some NCCL operations have failed or timed out", the progress lines "Timeout at
  NCCL work: S, last enqueued NCCL work: E, last completed NCCL work: C." (~2.3-2.7), "Exception (either an error or
  timeout) detected by watchdog at work: .." and "failure detected by watchdog at work sequence id: S PG status: last
  enqueued work: E, last completed work: C" (2.8+), the heartbeat monitor's "Heartbeat monitor timed out", "NCCL
  monitor thread timeout", "ProcessGroupNCCL's watchdog got stuck for N seconds"; the log prefixes ``[Rank r]``,
  ``[PG 0 (default_pg) Rank r]``, ``[PG ID 2 PG GUID 3 Rank r]``.
- PyTorch ``torch/csrc/distributed/c10d/NCCLUtils.hpp``/``.cpp`` (torch 2.13, pytorch@0323141fed06): "NCCL error in:
  file:line, <ncclGetErrorString>, NCCL version x.y.z" with "ncclSystemError: ...", "ncclInvalidUsage: ..." and
  "Last error:" details, "NCCL communicator was aborted on rank N".
- NVIDIA/nccl ``src/init.cc`` (v2.12.12 @7aa1c46 to v2.30.7 @5067397): ncclGetErrorString ("unhandled system
  error", "remote process exited or there was a network error", "invalid usage", "invalid argument"), "Duplicate GPU
  detected : rank %d and rank %d both on CUDA device %lx" (removed in 2.30); ``src/misc/socket.cc`` "socketStartConnect:
  Connect to %s failed : %s", "Net : Connect to ..", "%s: connect to %s failed : %s", "socketProgress: Connection
  closed by remote peer %s", "Call to %s %s failed : %s"; ``src/include/checks.h`` "Call to %s failed: %s";
  ``src/transport/net_ib.cc`` "NET/IB : Got completion from peer %s with error %d" / "with status=%d" / "with
  status=%s(%d)"; ``src/misc/ibvwrap.cc`` "Call to ibv_.. failed"; ``src/bootstrap.cc`` "Bootstrap : no socket
  interface found", ``net_socket.cc`` "NET/Socket : No usable listening interface found".
- facebookincubator/gloo@cc441984208d ``gloo/transport/tcp/pair.cc`` "Connection closed by peer %s", "Read error %s:
  %s", "Connect timeout %s"; ``unbound_buffer.cc`` "Timed out waiting %dms for recv operation to complete".
- PyTorch ``torch/csrc/distributed/c10d/socket.cpp`` / ``TCPStore*.cpp`` (torch 2.13 strings, pytorch socket.cpp copy):
  "The client socket has timed out after T while trying to connect to (H, P).", "The client socket has failed to
  connect to ..", "The server socket has failed to bind to A (errno: 98 - Address already in use)", "The server socket
  has failed to listen on any local network address.", "Failed to recv, got 0 bytes. Connection was likely closed",
  "wait timeout after Nms", "Timed out after N seconds waiting for clients. n/N clients joined."; torch 2.13
  ``torch/distributed/distributed_c10d.py`` "Timed out initializing process group in store based barrier on rank R,
  for key: K (world_size=W, num_workers_joined=J, timeout=T ...)"; ``torch/distributed/elastic/rendezvous/``
  "The connection to the C10d store has failed.", ``RendezvousTimeoutError``/``RendezvousClosedError``;
  ``elastic/utils/distributed.py`` "port: P already in use", "timed out waiting for all W members to join".
"""

from __future__ import annotations

import re
from typing import Any

from ...findings import Finding
from ..common import MAX_KEYS, add, clip, seen
from . import comm_verdicts
from .base import Family

_PG = r"(?:\[(?:PG [^\]]*?)?Rank (?P<rank>\d+)\] ?)?"
_WORK = (r"WorkNCCL\((?:SeqNum=(?P<seq>\d+), )?OpType=(?P<op>\w+)(?:, NumelIn=(?P<numel>\d+))?[^)]*?"
         r"(?:Timeout\(ms\)=(?P<tmo>\d+))?\)")
NCCL_TIMEOUT_RE = re.compile(_PG + r"Watchdog caught collective operation timeout: " + _WORK
                             + r"(?: ran for (?P<ran>\d+) milliseconds before timing out)?")
BLOCKING_TIMEOUT_RE = re.compile(_PG + r"Work " + _WORK + r" timed out in blocking wait")
#: where each rank's collectives stopped: the work that timed out, the last one enqueued and the last completed
NCCL_PROGRESS_RE = re.compile(
    _PG + r"(?:Timeout at NCCL work: |Exception \(either an error or timeout\) detected by watchdog at work: "
    r"|failure detected by watchdog at work sequence id: )(?P<seq>\d+)[,]? (?:PG status: )?last enqueued "
    r"(?:NCCL )?work: (?P<enq>-?\d+), last completed (?:NCCL )?work: (?P<done>-?\d+)")
NCCL_HEARTBEAT_RE = re.compile(
    _PG + r"(?:Heartbeat monitor timed out|NCCL monitor thread timeout|monitoring thread detects no heartbeat"
    r"|ProcessGroupNCCL's watchdog got stuck for (?P<sec>\d+) seconds)")
NCCL_ABORT_RE = re.compile(r"Some NCCL operations have failed or timed out")
NCCL_ERROR_RE = re.compile(
    r"NCCL error(?: in: (?P<where>\S+?))?[,:] (?P<reason>.*?)(?:, NCCL version (?P<ver>[\w.+-]+))?\s*$")
NCCL_CODE_RE = re.compile(
    r"nccl(?P<code>InternalError|SystemError|UnhandledCudaError|RemoteError|InvalidUsage|InvalidArgument)"
    r":\s*(?P<detail>.*)")
NCCL_ABORTED_RE = re.compile(r"NCCL communicator was aborted on rank (\d+)")
NCCL_WARN_RE = re.compile(r"NCCL WARN (.*)")
# network: NCCL's sockets and InfiniBand, gloo's pairs
CONNECT_FAILED_RE = re.compile(r"[Cc]onnect to (?P<peer>\S+?)(?: failed ?: ?| returned )(?P<err>[^,]*)")
CONNECT_RETURNED_RE = re.compile(r"Call to connect returned (?P<err>[^,]+)")
CLOSED_BY_PEER_RE = re.compile(r"Connection closed by (?:remote )?peer (?P<peer>\S+)")
CALL_FAILED_RE = re.compile(
    r"Call to (?P<call>recv from|send to|ibv_\w+(?:\(\))?|bind|listen|accept|recv|send)(?: (?P<peer>\S+))?"
    r" (?:failed|returned)(?: with error)? ?:? ?(?P<err>.*?)\s*$")
IB_COMPLETION_RE = re.compile(
    r"NET/IB ?: Got completion from peer (?P<peer>\S+) with (?:error (?P<err>\d+)|status=(?P<status>\w+)"
    r"(?:\((?P<code>\d+)\))?)")
NO_INTERFACE_RE = re.compile(r"(?:Bootstrap|NET/Socket) : (?:no socket interface found|No usable listening interface"
                             r" found|no interface found)")
GLOO_READ_RE = re.compile(r"(?P<what>Read error|Connect timeout) (?P<peer>\[[^\]]*\]:\d+|[\w.-]+:\d+)"
                          r"(?::\s*(?P<err>.*))?")
GLOO_TIMEOUT_RE = re.compile(r"Timed out waiting (?P<ms>\d+)ms for (?P<op>recv|send) operation to complete(?!, retry)")
# the store and rendezvous
CLIENT_TIMEOUT_RE = re.compile(r"The client socket has timed out after (?P<t>\S+) while trying to connect to "
                               r"\((?P<host>[^,]+), (?P<port>\d+)\)")
CLIENT_FAILED_RE = re.compile(r"The client socket has failed to connect to (?:any network address of \((?P<host>"
                              r"[^,]+), (?P<port>\d+)\)|(?P<addr>\S+))(?: \((?P<err>[^)]*)\))?")
SERVER_FAILED_RE = re.compile(r"The server socket has failed to (?:bind to (?P<addr>\S+)|listen on any local network"
                              r" address)")
ADDR_IN_USE_RE = re.compile(r"(?i:address already in use)|EADDRINUSE|port: (?P<port>\d+) already in use")
STORE_BARRIER_RE = re.compile(
    r"Timed out initializing process group in store based barrier on rank:? (?P<rank>\d+), for key: (?P<key>\S+) "
    r"\(world_size=(?P<ws>\d+), (?:worker_count|num_workers_joined)=(?P<joined>\d+)")
#: distributed_c10d.py's _store_based_barrier while it waits (torch 1.9-2.x): who has joined so far
STORE_WAITING_RE = re.compile(
    r"Waiting in store based barrier to initialize process group for rank: (?P<rank>\d+), key: (?P<key>\S+) "
    r"\(world_size=(?P<ws>\d+), (?:worker_count|num_workers_joined)=(?P<joined>\d+)")
STORE_WAIT_RE = re.compile(r"(?:wait|barrier) timeout after (?P<ms>\d+)ms|Wait timeout for key|Timed out after (?P<s>"
                           r"\d+) seconds waiting for clients\. (?P<n>\d+)/(?P<N>\d+) clients joined"
                           r"|timed out waiting for all (?P<ws>\d+) members to join")
#: the store's socket closed under a rank: torch's own words, or an exception whose whole message is the OS error
STORE_CLOSED_RE = re.compile(r"Failed to (?:recv|send), (?:got|sent) 0 bytes\. Connection was likely closed"
                             r"|^(?:[\w.]+Error): (?P<why>Connection reset by peer|Broken pipe|Socket Timeout)\s*$")
RDZV_RE = re.compile(r"(?P<cls>Rendezvous(?:Connection|Timeout|Closed)Error)|The connection to the C10d store has "
                     r"failed|The connection to etcd has failed")
# invalid usage
DUPLICATE_GPU_RE = re.compile(r"Duplicate GPU detected ?: rank (?P<a>\d+) and rank (?P<b>\d+) both on CUDA device "
                              r"(?P<dev>\w+)")
DEVICE_ORDINAL_RE = re.compile(r"invalid device ordinal")

#: IB work-completion status -> what it means (ibv_wc_status: verbs.h)
IB_STATUS = {"12": "IBV_WC_RETRY_EXC_ERR: the transport retried and gave up -- a flapping link, a switch, or "
             "NCCL_IB_TIMEOUT too short", "5": "IBV_WC_WR_FLUSH_ERR: flushed after an earlier error on the queue pair",
             "13": "IBV_WC_RNR_RETRY_EXC_ERR: the peer was not ready to receive (it stalled or died)",
             "4": "IBV_WC_LOC_PROT_ERR: a local protection error (memory registration)",
             "10": "IBV_WC_REM_ACCESS_ERR: remote access error"}

class Comm(Family):
    """NCCL / gloo / store / rendezvous: the rules' handlers keep what each line says, :meth:`judge` decides."""

    RULES = (
        ("Watchdog caught", NCCL_TIMEOUT_RE, "on_timeout"),
        ("timed out in blocking wait", BLOCKING_TIMEOUT_RE, "on_timeout"),
        ("last enqueued", NCCL_PROGRESS_RE, "on_progress"),
        ("Heartbeat monitor timed out", NCCL_HEARTBEAT_RE, "on_heartbeat"),
        ("NCCL monitor thread timeout", NCCL_HEARTBEAT_RE, "on_heartbeat"),
        ("detects no heartbeat", NCCL_HEARTBEAT_RE, "on_heartbeat"),
        ("watchdog got stuck", NCCL_HEARTBEAT_RE, "on_heartbeat"),
        ("Some NCCL operations", NCCL_ABORT_RE, "on_abort"),
        ("NCCL error", NCCL_ERROR_RE, "on_nccl_error"),
        ("nccl", NCCL_CODE_RE, "on_nccl_code"),
        ("NCCL communicator was aborted", NCCL_ABORTED_RE, "on_aborted"),
        ("onnect to", CONNECT_FAILED_RE, "on_connect"),
        ("Call to connect returned", CONNECT_RETURNED_RE, "on_connect"),
        ("Connection closed by", CLOSED_BY_PEER_RE, "on_closed"),
        ("Call to ", CALL_FAILED_RE, "on_call_failed"),
        ("Got completion from peer", IB_COMPLETION_RE, "on_ib"),
        ("interface found", NO_INTERFACE_RE, "on_no_interface"),
        ("Read error", GLOO_READ_RE, "on_gloo_error"),
        ("Connect timeout", GLOO_READ_RE, "on_gloo_error"),
        ("Timed out waiting", GLOO_TIMEOUT_RE, "on_gloo_timeout"),
        ("NCCL WARN", NCCL_WARN_RE, "on_warn"),
        ("The client socket has timed out", CLIENT_TIMEOUT_RE, "on_client_timeout"),
        ("The client socket has failed", CLIENT_FAILED_RE, "on_client_failed"),
        ("The server socket has failed", SERVER_FAILED_RE, "on_server_failed"),
        ("lready in use", ADDR_IN_USE_RE, "on_addr_in_use"),
        ("ADDRINUSE", ADDR_IN_USE_RE, "on_addr_in_use"),
        ("store based barrier", STORE_BARRIER_RE, "on_store_barrier"),
        ("Waiting in store based barrier", STORE_WAITING_RE, "on_store_waiting"),
        ("timeout after", STORE_WAIT_RE, "on_store_wait"),
        ("Wait timeout for key", STORE_WAIT_RE, "on_store_wait"),
        ("waiting for clients", STORE_WAIT_RE, "on_store_wait"),
        ("members to join", STORE_WAIT_RE, "on_store_wait"),
        ("Connection was likely closed", STORE_CLOSED_RE, "on_store_closed"),
        ("Connection reset by peer", STORE_CLOSED_RE, "on_store_closed"),
        ("Broken pipe", STORE_CLOSED_RE, "on_store_closed"),
        ("Socket Timeout", STORE_CLOSED_RE, "on_store_closed"),
        ("Rendezvous", RDZV_RE, "on_rendezvous"),
        ("The connection to ", RDZV_RE, "on_rendezvous"),
        ("Duplicate GPU detected", DUPLICATE_GPU_RE, "on_duplicate_gpu"),
        ("invalid device ordinal", DEVICE_ORDINAL_RE, "on_device_ordinal"),
    )
    ANCHORS = ("Watchdog caught", "Heartbeat monitor timed out", "NCCL", "InternalError", "SystemError",
               "UnhandledCudaError", "RemoteError", "InvalidUsage", "InvalidArgument", "Timeout at NCCL",
               "Exception (either", "ProcessGroupNCCL", "Connect to", "Connection closed by", "Call to ",
               "Got completion", "Read error", "Connect timeout", "Timed out waiting", "The client socket",
               "The server socket", "EADDRINUSE", "Rendezvous", "The connection to ", "Duplicate GPU",
               "Failed to recv", "Failed to send", "Bootstrap :", "Connection reset by peer", "Broken pipe",
               "Socket Timeout", "Address already in use", "Wait timeout", "Timed out initializing",
               "Waiting in store based barrier")
    # lower-case sentences stand on the analyzer's wide needles: an exception line ("...Error: wait timeout after"),
    # an NCCL / c10 prefix (the "NCCL" and "ProcessGroupNCCL" anchors)
    NEEDLES = ()
    CAUSE_EVENTS = frozenset({"nccl-timeout", "nccl-error", "nccl-abort", "nccl-heartbeat-timeout", "comm-network",
                              "comm-rendezvous", "comm-invalid-usage", "gloo-timeout"})

    def __init__(self, log: Any) -> None:
        super().__init__(log)
        self.timeouts: list[dict] = []
        self._timeout_keys: set = set()
        self.timeout_n = 0
        self.timeout_ranks: set[int] = set()
        self.timeout_first: dict | None = None  # the lowest SeqNum of all timeouts: the collective that hung
        self.progress: dict[Any, dict] = {}     # rank -> its last "last enqueued / completed" line
        self.heartbeat: list[dict] = []
        self.abort_n = 0
        self.errors: list[dict] = []
        self.error_n = 0
        self._error_keys: set = set()
        self.warns: list[dict] = []
        self.warn_n = 0
        self.network: list[dict] = []
        self.network_n = 0
        self.retries: list[dict] = []  # connects NCCL retried (INFO lines): a failure only when a warning follows
        self._network_keys: set = set()
        self.gloo_timeouts: list[dict] = []
        self.store: list[dict] = []
        self._store_keys: set = set()
        self.usage: list[dict] = []

    @property
    def failed(self) -> bool:
        return bool(self.timeout_n or self.error_n or self.heartbeat or self.network_n or self.store
                    or self.usage or self.gloo_timeouts)

    # --------------------------------------------------------------------------------------- timeouts
    def _rank(self, m: re.Match, text: str) -> int | None:
        return int(m["rank"]) if "rank" in m.re.groupindex and m["rank"] else self.log.rank_of(text)

    def on_timeout(self, m: re.Match, text: str, lineno: int) -> None:
        rank = self._rank(m, text)
        seq = int(m["seq"]) if m["seq"] else None
        if seen(self._timeout_keys, (rank, seq, m["op"])):
            return
        self.log.event(lineno, "nccl-timeout", text)
        self.timeout_n += 1
        if rank is not None and len(self.timeout_ranks) < MAX_KEYS:
            self.timeout_ranks.add(rank)
        ran = m["ran"] if "ran" in m.re.groupindex else None
        d = {"line": lineno, "step": self.log.step, "rank": rank, "op": m["op"], "seq": seq,
             "numel": int(m["numel"]) if m["numel"] else None, "timeout_ms": int(m["tmo"]) if m["tmo"] else None,
             "ran_ms": int(ran) if ran else None, "text": self.log.quote(text)}
        add(self.timeouts, d)
        first = self.timeout_first
        if first is None or (seq is not None and (first["seq"] is None or seq < first["seq"])):
            self.timeout_first = d

    def on_progress(self, m: re.Match, text: str, lineno: int) -> None:
        rank = self._rank(m, text)
        if len(self.progress) < MAX_KEYS or rank in self.progress:
            self.progress[rank] = {"line": lineno, "rank": rank, "seq": int(m["seq"]), "enqueued": int(m["enq"]),
                                   "completed": int(m["done"]), "text": self.log.quote(text)}

    def on_heartbeat(self, m: re.Match, text: str, lineno: int) -> None:
        self.log.event(lineno, "nccl-heartbeat-timeout", text)
        add(self.heartbeat, {"line": lineno, "rank": self._rank(m, text), "stuck_s": int(m["sec"]) if m["sec"] else
                             None, "text": self.log.quote(text)}, 8)

    def on_abort(self, m: re.Match, text: str, lineno: int) -> None:
        self.abort_n += 1
        if self.abort_n <= 8:
            self.log.event(lineno, "nccl-abort", text)

    # --------------------------------------------------------------------------------------- NCCL errors
    def _error(self, lineno: int, text: str, kind: str, detail: str | None = None, **extra: Any) -> None:
        rank = self.log.rank_of(text)
        if seen(self._error_keys, (kind, detail, rank)):
            return
        self.log.event(lineno, "nccl-error", text)
        self.error_n += 1
        add(self.errors, {"line": lineno, "step": self.log.step, "kind": kind, "detail": detail, "rank": rank,
                          "text": self.log.quote(text), **extra})

    def on_nccl_error(self, m: re.Match, text: str, lineno: int) -> None:
        reason = (m["reason"] or "").strip() or None
        self._error(lineno, text, "NCCL error", reason, version=m["ver"])
        if reason and ("invalid usage" in reason or "invalid argument" in reason):
            self._usage(lineno, text, "nccl", reason)

    def on_nccl_code(self, m: re.Match, text: str, lineno: int) -> None:
        detail = (m["detail"] or "").strip() or None
        self._error(lineno, text, "nccl" + m["code"], detail)
        if m["code"] in ("InvalidUsage", "InvalidArgument"):
            self._usage(lineno, text, "nccl", "nccl" + m["code"] + (f": {detail}" if detail else ""))

    def on_aborted(self, m: re.Match, text: str, lineno: int) -> None:
        self._error(lineno, text, "communicator aborted", f"rank {m.group(1)}")

    def on_warn(self, m: re.Match, text: str, lineno: int) -> None:
        self.warn_n += 1
        if self.warn_n <= 16:
            if not (self.network and self.network[-1]["line"] == lineno):  # else in the timeline as what it says
                self.log.event(lineno, "nccl-warn", text)
            self.warns.append({"line": lineno, "text": self.log.quote(text), "msg": clip(m.group(1), 200)})

    # ------------------------------------------------------------------------------------------ network
    def _network(self, lineno: int, text: str, kind: str, peer: str | None, detail: str | None, **extra: Any) -> None:
        if "NCCL INFO" in text or "retrying" in text:  # NCCL's INFO chatter, a retry it announces: not yet a failure
            add(self.retries, {"line": lineno, "kind": kind, "peer": peer, "detail": detail,
                               "text": self.log.quote(text)}, 4)
            return
        self.network_n += 1
        if seen(self._network_keys, (kind, peer, detail)):
            return
        if len(self.network) < 16:
            self.log.event(lineno, "comm-network", text)
        add(self.network, {"line": lineno, "step": self.log.step, "kind": kind, "peer": peer,
                           "detail": clip(detail, 160) if detail else None, "host": self.log.host_of(text),
                           "rank": self.log.rank_of(text), "text": self.log.quote(text), **extra}, 16)

    def on_connect(self, m: re.Match, text: str, lineno: int) -> None:
        peer = m["peer"] if "peer" in m.re.groupindex else None
        self._network(lineno, text, "connect", peer, (m["err"] or "").strip()[:160] or None)

    def on_closed(self, m: re.Match, text: str, lineno: int) -> None:
        self._network(lineno, text, "closed", m["peer"], "connection closed by the peer")

    def on_call_failed(self, m: re.Match, text: str, lineno: int) -> None:
        call, err = m["call"], (m["err"] or "").strip() or None
        if call.startswith("ibv_"):
            self._network(lineno, text, "ib", m["peer"], f"{call} failed" + (f": {err}" if err else ""))
        elif call in ("bind", "listen") and err and "in use" in err:
            self._store(lineno, text, "port-in-use", None, err)
        else:
            self._network(lineno, text, "closed" if err and re.search(r"(?i)reset|broken pipe|closed", err)
                          else "socket", m["peer"], f"{call} failed" + (f": {err}" if err else ""))

    def on_ib(self, m: re.Match, text: str, lineno: int) -> None:
        status = m["err"] or m["code"] or m["status"]
        name = m["status"] if m["status"] and not m["status"].isdigit() else None
        meaning = IB_STATUS.get(status or "", name or "")
        self._network(lineno, text, "ib", m["peer"], f"work completion status {status}"
                      + (f" ({meaning})" if meaning else ""), status=status)

    def on_no_interface(self, m: re.Match, text: str, lineno: int) -> None:
        self._network(lineno, text, "no-interface", None, m.group(0))

    def on_gloo_error(self, m: re.Match, text: str, lineno: int) -> None:
        what = m["what"]
        self._network(lineno, text, "connect" if what == "Connect timeout" else "closed", m["peer"],
                      what + (f": {m['err']}" if m["err"] else ""))

    def on_gloo_timeout(self, m: re.Match, text: str, lineno: int) -> None:
        self.log.event(lineno, "gloo-timeout", text)
        add(self.gloo_timeouts, {"line": lineno, "step": self.log.step, "rank": self.log.rank_of(text),
                                 "ms": int(m["ms"]), "op": m["op"], "text": self.log.quote(text)}, 8)

    # ------------------------------------------------------------------------------------- store, rendezvous
    def _store(self, lineno: int, text: str, kind: str, addr: str | None, detail: str | None, **extra: Any) -> None:
        # c10's [W socket.cpp] lines: a connect it retries (an IPv6 address, a rank 0 not up yet), not a failure --
        # except a port in use, which every address it tries then fails with
        warning = self.log.level_of(text) == "WARNING" and kind != "port-in-use"
        if seen(self._store_keys, (kind, addr, warning)):
            return
        self.log.event(lineno, "comm-rendezvous", text)
        add(self.store, {"line": lineno, "step": self.log.step, "kind": kind, "addr": addr, "detail": detail,
                         "rank": self.log.rank_of(text), "text": self.log.quote(text), "warning": warning,
                         **extra}, 16)

    def on_client_timeout(self, m: re.Match, text: str, lineno: int) -> None:
        self._store(lineno, text, "connect-timeout", f"{m['host']}:{m['port']}", f"timed out after {m['t']}")

    def on_client_failed(self, m: re.Match, text: str, lineno: int) -> None:
        addr = f"{m['host']}:{m['port']}" if m["host"] else m["addr"]
        self._store(lineno, text, "connect-failed", addr, m["err"])

    def on_server_failed(self, m: re.Match, text: str, lineno: int) -> None:
        in_use = ADDR_IN_USE_RE.search(text)
        self._store(lineno, text, "port-in-use" if in_use else "listen-failed", m["addr"], clip(text, 200))

    def on_addr_in_use(self, m: re.Match, text: str, lineno: int) -> None:
        if "The server socket" in text:
            return  # on_server_failed has it
        self._store(lineno, text, "port-in-use", m["port"], clip(text, 200))

    def on_store_barrier(self, m: re.Match, text: str, lineno: int) -> None:
        self._store(lineno, text, "barrier-timeout", m["key"], f"{m['joined']} of {m['ws']} ranks joined",
                    world_size=int(m["ws"]), joined=int(m["joined"]))

    def on_store_waiting(self, m: re.Match, text: str, lineno: int) -> None:
        ws, joined = int(m["ws"]), int(m["joined"])
        kind = "barrier-crowded" if joined > ws else "barrier-waiting"
        self._store(lineno, text, kind, m["key"], f"{joined} of {ws} ranks joined", world_size=ws, joined=joined)

    def on_store_wait(self, m: re.Match, text: str, lineno: int) -> None:
        joined = f"{m['n']} of {m['N']} clients joined" if m["n"] else None
        self._store(lineno, text, "wait-timeout", None, joined or clip(m.group(0), 120))

    def on_store_closed(self, m: re.Match, text: str, lineno: int) -> None:
        self._store(lineno, text, "store-closed", None, m["why"] or "connection closed")

    def on_rendezvous(self, m: re.Match, text: str, lineno: int) -> None:
        cls = m["cls"] or ""
        kind = {"RendezvousTimeoutError": "rdzv-timeout", "RendezvousClosedError": "rdzv-closed"}.get(cls,
                                                                                                      "rdzv-connect")
        self._store(lineno, text, kind, None, clip(m.group(0), 120))

    # ------------------------------------------------------------------------------------------- usage
    def _usage(self, lineno: int, text: str, kind: str, detail: str, **extra: Any) -> None:
        if any(u["kind"] == kind and u["detail"] == detail for u in self.usage):
            return
        self.log.event(lineno, "comm-invalid-usage", text)
        add(self.usage, {"line": lineno, "kind": kind, "detail": detail, "rank": self.log.rank_of(text),
                         "text": self.log.quote(text), **extra}, 8)

    def on_duplicate_gpu(self, m: re.Match, text: str, lineno: int) -> None:
        self._usage(lineno, text, "duplicate-gpu", f"ranks {m['a']} and {m['b']} on CUDA device {m['dev']}",
                    ranks=[int(m["a"]), int(m["b"])], device=m["dev"])

    def on_device_ordinal(self, m: re.Match, text: str, lineno: int) -> None:
        self._usage(lineno, text, "device-ordinal", "a rank asked for a GPU index this process cannot see")

    # ------------------------------------------------------------------------------------------- verdicts
    def judge(self) -> list[Finding]:
        return comm_verdicts.judge(self)

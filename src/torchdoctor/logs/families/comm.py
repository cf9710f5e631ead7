"""Communication failures: NCCL and gloo collectives that time out, a hung watchdog, the network under them, the
store and rendezvous every rank meets at, and invalid usage (two ranks on one GPU).

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

CONNECT_FIX = ("NCCL picked an interface or address the peer cannot reach: set NCCL_SOCKET_IFNAME to the interface "
               "that links the nodes (`ip -br addr` on each node; e.g. NCCL_SOCKET_IFNAME=eth0, or ^docker0,lo to "
               "exclude), and open the ports between the nodes (firewall, security group); NCCL_DEBUG=INFO "
               "NCCL_DEBUG_SUBSYS=INIT,NET shows the addresses it tries")
COMM_FIX = ("torchdoctor comm (under torchrun/srun, or --local N) checks that every rank can reach every other and "
            "names the one that cannot; --bench measures the bandwidth")


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
        out = []
        usage = self._judge_usage()
        out += usage
        if self.timeout_n or self.heartbeat:
            out.append(self._judge_timeout())
        if self.gloo_timeouts and not self.timeout_n:
            out.append(self._judge_gloo_timeout())
        network = self._judge_network()
        out += network
        out += self._judge_store()
        if (self.error_n or (self.abort_n and not out)) and not (network or usage):
            out.append(self._judge_error())
        elif self.warn_n and not out:
            out.append(Finding("comm.nccl-warn", "info", f"{self.warn_n} NCCL warning(s), no NCCL failure",
                               [f"line {w['line']}: {w['text']}" for w in self.warns[:3]], [],
                               {"count": self.warn_n, "warnings": list(self.warns)}))
        return out

    def _judge_timeout(self) -> Finding:
        t = self.timeouts
        ev = [f"line {x['line']}: {x['text']}" for x in t[:3]]
        if self.timeout_n > 3:
            ev.append(f"... {self.timeout_n - 3} more timeout(s)")
        ev += [f"line {x['line']}: {x['text']}" for x in self.heartbeat[:2]]
        if self.abort_n:
            ev.append(f"'Some NCCL operations have failed or timed out' x{self.abort_n}: the ranks took the process "
                      "down")
        behind = self._behind()
        if behind:
            ev.append(behind)
        ranks = sorted(self.timeout_ranks)
        first = self.timeout_first
        if first is not None:
            # collectives run in SeqNum order on every rank: the lowest one is where a rank stopped following
            later = sorted({x["seq"] for x in t if x["seq"] is not None and x["seq"] != first["seq"]})
            more = ""
            if later:
                shown = ", ".join(map(str, later[:3])) + (", ..." if len(later) > 3 else "")
                more = f" (earliest; later SeqNum {shown} timed out too)"
            secs = f" after {first['ran_ms'] / 1000:.0f} s" if first["ran_ms"] else (
                f" (timeout {first['timeout_ms'] / 1000:.0f} s)" if first["timeout_ms"] else "")
            seq = f" SeqNum={first['seq']}" if first["seq"] is not None else ""
            title = (f"NCCL collective timed out: {first['op']}{seq}{more} on rank(s) "
                     f"{', '.join(map(str, ranks[:16])) or '?'}{secs}")
        else:
            stuck = next((h["stuck_s"] for h in self.heartbeat if h["stuck_s"]), None)
            title = ("NCCL watchdog hung" + (f" for {stuck} s" if stuck else "") + ": a rank is stuck inside a "
                     "NCCL/CUDA call (the heartbeat monitor took the process down)")
        fix = [
            COMM_FIX,
            "with a healthy network a timeout means one rank never entered the collective: find the rank missing from "
            "these lines (stuck in data loading, a rank-0-only branch that calls a collective, uneven batch counts); "
            "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 dumps every rank's last collectives",
            "raise the timeout only for legitimately long steps (checkpoint save, first compile): "
            "deepspeed.init_distributed(timeout=timedelta(minutes=60)), init_process_group(timeout=...), or "
            "TrainingArguments(ddp_timeout=3600)",
        ]
        if first is None:
            fix.insert(1, "a hung watchdog usually follows a collective timeout or a CUDA error on a peer, or a CUDA "
                          "call blocked while another thread holds the GIL: look for the first error before it; "
                          "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC raises the monitor's patience")
        return Finding("comm.nccl-timeout", "fail", title, ev, fix,
                       {"count": self.timeout_n, "ranks": ranks[:256], "timeouts": list(t),
                        "earliest": dict(first) if first is not None else None,
                        "heartbeat_timeouts": list(self.heartbeat), "aborts": self.abort_n,
                        "progress": [self.progress[r] for r in sorted(self.progress, key=lambda r: (r is None, r))]})

    def _behind(self) -> str | None:
        """From the ranks' "last completed work" lines: the one(s) that completed the fewest collectives."""
        ranks = [p for p in self.progress.values() if p["rank"] is not None]
        if len(ranks) < 2:
            return None
        low = min(p["completed"] for p in ranks)
        behind = sorted(p["rank"] for p in ranks if p["completed"] == low)
        if len(behind) == len(ranks):
            return None
        return (f"rank(s) {', '.join(map(str, behind[:8]))} completed the fewest collectives (last completed work "
                f"{low}; the others got further): the rank that stopped is there")

    def _judge_gloo_timeout(self) -> Finding:
        g = self.gloo_timeouts[0]
        return Finding(
            "comm.nccl-timeout", "fail",
            f"gloo collective timed out: a {g['op']} waited {g['ms'] / 1000:.0f} s for its peer",
            [f"line {x['line']}: {x['text']}" for x in self.gloo_timeouts[:3]],
            [COMM_FIX, "one rank never reached the collective (a rank-only branch, uneven batches, a crash on the "
             "peer): the first error of another rank is the cause; init_process_group(timeout=...) raises the "
             "limit"], {"count": len(self.gloo_timeouts), "timeouts": list(self.gloo_timeouts), "backend": "gloo"})

    def _judge_network(self) -> list[Finding]:
        if not self.network and self.retries:
            last = self.retries[-1]["line"]
            after = [w for w in self.warns if w["line"] > last]
            ev = [f"line {r['line']}: {r['text']}" for r in self.retries[:3]]
            if not after:
                return [Finding("comm.network", "info", "NCCL retried connecting to a peer "
                                f"({self.retries[0]['detail'] or 'connection failed'}); nothing here says it failed",
                                ev, [], {"count": 0, "retries": list(self.retries)})]
            ev += [f"line {w['line']}: {w['text']}" for w in after[:2]]
            return [Finding("comm.network", "fail",
                            f"a rank could not connect to its peer: NCCL retried "
                            f"({self.retries[0]['detail'] or 'connection failed'}) and then warned",
                            ev, [COMM_FIX, CONNECT_FIX], {"count": len(self.retries), "retries": list(self.retries),
                                                          "warnings": after})]
        if not self.network:
            return []
        net = self.network
        kinds = [n["kind"] for n in net]
        first = net[0]
        who = f" on {first['host']}" if first.get("host") else ""
        peer = f" {first['peer']}" if first["peer"] else ""
        if "no-interface" in kinds:
            title = f"NCCL found no usable network interface{who}"
        elif "ib" in kinds:
            ib = next(n for n in net if n["kind"] == "ib")
            title = f"InfiniBand error with peer {ib['peer'] or '?'}: {ib['detail']}"
        elif first["kind"] == "connect":
            title = f"a rank could not connect to its peer{peer}{who}: {first['detail'] or 'connection failed'}"
        else:
            title = f"the connection to a peer{peer} was lost{who}: {first['detail'] or 'closed'}"
        ev = [f"line {n['line']}: {n['text']}" for n in net[:4]]
        if self.network_n > len(net[:4]):
            ev.append(f"{self.network_n} network line(s) in all")
        ev += [f"line {e['line']}: {e['text']}" for e in self.errors[:2]]
        fix = [COMM_FIX]
        if "connect" in kinds or "no-interface" in kinds:
            fix.append(CONNECT_FIX)
        if "closed" in kinds or "socket" in kinds:
            fix.append("a connection closed or reset by the peer means the process at the other end died or its "
                       "node dropped off the network: the first error of that rank (an OOM kill, a CUDA error, a "
                       "crash) is the cause; look for it above, or in that node's log")
        if "ib" in kinds:
            fix.append("InfiniBand: check the links on both nodes (ibstat, ibv_devinfo, dmesg for mlx5 errors), "
                       "raise NCCL_IB_TIMEOUT (e.g. 22) for a congested fabric, pin NCCL_IB_HCA to the right HCAs; "
                       "NCCL_IB_DISABLE=1 falls back to sockets to rule the fabric in or out")
        return [Finding("comm.network", "fail", title, ev, fix,
                        {"count": self.network_n, "events": list(net), "nccl_errors": list(self.errors)})]

    def _judge_store(self) -> list[Finding]:
        if not self.store:
            return []
        order = ("port-in-use", "barrier-crowded", "barrier-timeout", "connect-timeout", "connect-failed",
                 "rdzv-timeout", "rdzv-connect", "rdzv-closed", "wait-timeout", "barrier-waiting", "listen-failed",
                 "store-closed")
        errors = [s for s in self.store if not s["warning"]]
        if not errors:  # only c10's warnings: connects it retried (torchrun's IPv6 localhost, a slow rank 0)
            w = self.store[0]
            return [Finding("comm.rendezvous", "info",
                            f"c10d warned while connecting to the store ({w['detail'] or w['kind']}); it retries, and "
                            "nothing here says it failed", [f"line {s['line']}: {s['text']}" for s in self.store[:2]],
                            [], {"kind": w["kind"], "events": list(self.store)})]
        main = min(errors, key=lambda s: order.index(s["kind"]))
        kind, addr = main["kind"], main["addr"]
        titles = {
            "port-in-use": f"the rendezvous port{' ' + addr if addr else ''} is already in use",
            "barrier-timeout": f"not every rank reached init_process_group: {main['detail']}",
            "barrier-crowded": f"more processes joined the store's barrier than the world size: {main['detail']}",
            "barrier-waiting": f"init_process_group is waiting for ranks at the store's barrier: {main['detail']}",
            "connect-timeout": f"a rank could not reach the store at {addr} ({main['detail']})",
            "connect-failed": f"a rank could not connect to the store at {addr}"
                              + (f" ({main['detail']})" if main["detail"] else ""),
            "rdzv-timeout": "torchrun's rendezvous timed out: not enough nodes joined",
            "rdzv-connect": "torchrun could not reach the rendezvous store",
            "rdzv-closed": "torchrun's rendezvous was closed (another node ended the job)",
            "wait-timeout": f"waiting on the store timed out ({main['detail']})",
            "listen-failed": "the store could not listen on any local address",
            "store-closed": f"the connection to the store was lost ({main['detail']})",
        }
        fixes = {
            "port-in-use": "another process holds the port: a job still running or a leftover from an earlier run on "
                           "this node (ss -ltnp | grep PORT shows it; kill it), or give this job another port "
                           "(MASTER_PORT, torchrun --master_port / --rdzv-endpoint host:port)",
            "barrier-timeout": "the missing ranks failed or hang before init_process_group (their own logs say why), "
                               "or the world size does not match the ranks started (--nnodes x --nproc_per_node, "
                               "WORLD_SIZE)",
            "barrier-crowded": "two jobs share one store (the same MASTER_ADDR:MASTER_PORT: give each its own "
                               "--master_port), or WORLD_SIZE is smaller than the processes started (a launcher run "
                               "inside another: python -m torch.distributed.launch under torchrun, two nodes with "
                               "the same --node_rank)",
            "barrier-waiting": "the missing ranks failed or hang before init_process_group (their own logs say why), "
                               "or the world size does not match the ranks started",
            "connect-timeout": "the store runs in rank 0's process (or torchrun's agent): MASTER_ADDR must be that "
                               "node's address as the other nodes see it, MASTER_PORT open between them, and rank 0 "
                               "must have started (nc -zv HOST PORT from this node)",
            "connect-failed": "nothing listens at that address: rank 0 (or the agent) is not up yet, died, or "
                              "MASTER_ADDR / MASTER_PORT point elsewhere; a refused connection means the host is up "
                              "and the port closed",
            "rdzv-timeout": "check --nnodes (min:max) against the nodes really started, that every node uses the "
                            "same --rdzv-endpoint and --rdzv-id, and raise --rdzv-conf timeout=... for slow starts",
            "rdzv-connect": "the --rdzv-endpoint host:port is not reachable from this node: the endpoint node's "
                            "agent must start first and the port be open",
            "rdzv-closed": "another node's agent closed the rendezvous after a failure: its log has the cause",
            "wait-timeout": "a rank waited for keys another rank never set: that rank failed or hangs before it",
            "listen-failed": "no local address could be bound: check MASTER_ADDR is an address of this node",
            "store-closed": "the store's host (rank 0 or torchrun's agent) died or was restarted: its first error is "
                            "the cause",
        }
        ev = [f"line {s['line']}: {s['text']}" for s in self.store[:4]]
        fix = [fixes[kind], COMM_FIX]
        return [Finding("comm.rendezvous", "warn" if kind == "barrier-waiting" else "fail", titles[kind], ev, fix,
                        {"kind": kind, "events": list(self.store)})]

    def _judge_usage(self) -> list[Finding]:
        if not self.usage:
            return []
        u = next((x for x in self.usage if x["kind"] == "duplicate-gpu"), self.usage[0])
        ev = [f"line {x['line']}: {x['text']}" for x in self.usage[:3]]
        ev += [f"line {w['line']}: {w['text']}" for w in self.warns[:2] if w["line"] != u["line"]]
        if u["kind"] == "duplicate-gpu":
            title = f"two ranks use the same GPU: {u['detail']}"
            fix = ["each rank must select its own GPU before any CUDA work or init_process_group: "
                   "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) (and device=f'cuda:{local_rank}', never a "
                   "hard-coded cuda:0); check CUDA_VISIBLE_DEVICES and --nproc_per_node against the GPUs of the node"]
        elif u["kind"] == "device-ordinal":
            title = "a rank asked for a GPU that is not visible to it (invalid device ordinal)"
            fix = ["more ranks per node than visible GPUs, or a device index taken from the global rank: "
                   "--nproc_per_node must not exceed the GPUs in CUDA_VISIBLE_DEVICES, and each rank uses "
                   "cuda:LOCAL_RANK (not RANK)"]
        else:
            warn = next((w["msg"] for w in self.warns if w["line"] <= u["line"]), None)
            title = f"NCCL refused a call as invalid: {u['detail']}" + (f" ({warn})" if warn else "")
            fix = ["the NCCL WARN line before the error says which argument: rerun with NCCL_DEBUG=WARN; every rank "
                   "must call the same collectives with the same sizes, dtypes and root, on tensors on its own GPU"]
        return [Finding("comm.invalid-usage", "fail", title, ev, fix + [COMM_FIX], {"events": list(self.usage)})]

    def _judge_error(self) -> Finding:
        errs = self.errors
        kinds = [e["detail"] if e["kind"] == "NCCL error" and e["detail"] else
                 e["kind"] if not e["detail"] else f"{e['kind']}: {e['detail']}" for e in errs]
        ev = [f"line {e['line']}: {e['text']}" for e in errs[:4]]
        if self.error_n > 4:
            ev.append(f"... {self.error_n - 4} more")
        ev += [f"line {w['line']}: {w['text']}" for w in self.warns[:3]]
        text = " ".join(kinds).lower()
        fix = [COMM_FIX, "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET to see which transport fails"]
        if "system" in text:
            fix.append("unhandled system error: usually the network interface or shared memory: set "
                       "NCCL_SOCKET_IFNAME to the interface that links the nodes, give containers --ipc=host or a "
                       "larger --shm-size, try NCCL_IB_DISABLE=1 to rule out InfiniBand")
        if "remote" in text or "aborted" in text:
            fix.append("a remote error or an aborted communicator means another rank failed first: look for the "
                       "earliest error or kill in the log")
        if "cuda" in text:
            fix.append("unhandled cuda error: a CUDA error on that rank (out of memory, illegal access); see the lines "
                       "before it, rerun with CUDA_LAUNCH_BLOCKING=1")
        if "internal" in text:
            fix.append("internal error: mismatched NCCL versions between nodes or a corrupted install; compare "
                       "torch.cuda.nccl.version() on every node (torchdoctor env)")
        title = f"NCCL error: {kinds[0]}" if kinds else "NCCL operations failed"
        return Finding("comm.nccl-error", "fail", title, ev, fix,
                       {"count": self.error_n, "errors": list(errs), "warnings": self.warn_n})

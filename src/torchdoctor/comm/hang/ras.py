"""NCCL's own witness of a running job: its RAS subsystem (NCCL >= 2.24; JSON output from 2.28), read with NCCL's
``ncclras`` client while the job hangs.

Every NCCL process runs a RAS thread; ``ncclras -f json`` asks the local one (port 28028) to collect, from every peer
it can reach, each communicator's ranks -- their status and how many collectives of each kind they ran -- and the ranks
it could not reach (``unresponsive``) or has given up on (``considered_dead``). The format read here is the one
NCCL's ``src/ras/client_support.cc`` writes (``jsonWriteHeader`` / ``jsonStartCommunicator`` / ``jsonWriteRankData`` /
``jsonWriteMissingRank`` / ``jsonWriteFooter``; NVIDIA/nccl 2.28.7 (ae7aed19) to 2.30.7 (5067397c)): a document with
``nccl_version``, ``communicators`` (each: ``hash``, ``size``, ``ranks_count``, ``missing_ranks_count``, ``ranks``
with ``rank``, ``host``, ``pid``, ``status`` {``init_state``, ``async_error`` (an ``ncclResult_t``),
``finalize_called``, ``destroy_flag``, ``abort_flag``} and ``collective_counts`` by NCCL's function name
(``AllReduce``, ``AllGather``, ...), and ``missing_ranks`` with ``status`` {``unresponsive``, ``considered_dead``}),
and ``ras`` {``collection_time_sec``, ``timeouts_count``}.

What it says is folded into the verdict as "NCCL RAS: ..." lines: missing ranks, ranks behind the others in their
collective counts, ranks with an asynchronous NCCL error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

#: ncclResult_t (nccl.h)
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
           4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}


@dataclass
class Communicator:
    hash: str
    size: int
    ranks: dict[int, dict] = field(default_factory=dict)  # rank -> {host, pid, counts, total, status}
    missing: dict[int, dict] = field(default_factory=dict)  # rank -> {host, pid, unresponsive, dead}

    def behind(self) -> dict[int, tuple[int, int]]:
        """Ranks whose collective count is below the highest: rank -> (its count, the highest)."""
        top = max((r["total"] for r in self.ranks.values()), default=0)
        return {k: (r["total"], top) for k, r in sorted(self.ranks.items()) if r["total"] < top}

    def errors(self) -> dict[int, str]:
        out = {}
        for k, r in sorted(self.ranks.items()):
            code = r["status"].get("async_error")
            if isinstance(code, int) and code not in (0, 7):
                out[k] = RESULTS.get(code, f"ncclResult {code}")
            elif r["status"].get("abort_flag"):
                out[k] = "aborted"
        return out


def parse(text: str) -> tuple[list[Communicator], str | None]:
    """The communicators in ``ncclras -f json`` output; (``[]``, why) when it is not that."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        return [], f"not the JSON ncclras writes ({e.msg} at line {e.lineno})"
    if not isinstance(doc, dict) or not isinstance(doc.get("communicators"), list):
        return [], "JSON without a communicators list (NCCL older than 2.28 writes text only)"
    out = []
    for c in doc["communicators"]:
        if not isinstance(c, dict):
            continue
        comm = Communicator(str(c.get("hash", "?")), _int(c.get("size")))
        for r in c.get("ranks") or ():
            if isinstance(r, dict) and isinstance(r.get("rank"), int):
                counts = {str(k): _int(v) for k, v in (r.get("collective_counts") or {}).items()}
                comm.ranks[r["rank"]] = {"host": r.get("host"), "pid": r.get("pid"), "counts": counts,
                                         "total": sum(counts.values()), "status": dict(r.get("status") or {})}
        for r in c.get("missing_ranks") or ():
            if isinstance(r, dict) and isinstance(r.get("rank"), int):
                st = r.get("status") or {}
                comm.missing[r["rank"]] = {"host": r.get("host"), "pid": r.get("pid"),
                                           "unresponsive": bool(st.get("unresponsive")),
                                           "dead": bool(st.get("considered_dead"))}
        out.append(comm)
    return out, None


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def lines(comms: list[Communicator]) -> list[str]:
    """What NCCL's RAS says, one line per fact, each starting with its witness."""
    out = []
    for c in comms:
        head = f"NCCL RAS: communicator {c.hash} ({c.size} ranks)"
        for rank, m in sorted(c.missing.items()):
            how = "considered dead" if m["dead"] else "unresponsive" if m["unresponsive"] else "missing"
            out.append(f"{head}: rank {rank} on {m['host']} (pid {m['pid']}) is {how}")
        for rank, (n, top) in c.behind().items():
            out.append(f"{head}: rank {rank} ran {n} collectives, the others up to {top}")
        for rank, err in c.errors().items():
            out.append(f"{head}: rank {rank} reports {err}")
    return out


def suspects(comms: list[Communicator]) -> list[int]:
    """The ranks RAS singles out: missing, behind, or in error."""
    out: set[int] = set()
    for c in comms:
        out |= set(c.missing) | set(c.behind()) | set(c.errors())
    return sorted(out)


def start(timeout_s: float = 5.0) -> tuple[subprocess.Popen | None, str | None]:
    """``ncclras -f json`` started against the local NCCL job (its RAS thread collects from every peer within
    ``timeout_s``), or (None, why not); :func:`collect` reads its answer."""
    exe = shutil.which("ncclras")
    if exe is None:
        return None, "ncclras is not on PATH"
    try:
        return subprocess.Popen([exe, "-f", "json", "-t", str(max(1, int(timeout_s)))], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), None
    except OSError as e:
        return None, f"ncclras could not start: {e.strerror or e}"


def collect(proc: subprocess.Popen, wait_s: float = 0.0) -> tuple[str | None, str | None]:
    """(its output, None), or (None, why not); ``proc`` is ended if it has not answered within ``wait_s``."""
    try:
        out, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "ncclras did not answer in time"
    if proc.returncode != 0:
        return None, f"ncclras failed: {(err.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1][:200]}"
    return out, None

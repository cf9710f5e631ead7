"""The communication family's verdicts: what :class:`~.comm.Comm`'s handlers kept, judged into findings.

Each function reads the family's collected state (``c``: timeouts, progress, heartbeat, errors, warnings, network,
store and usage lines) and never writes to it.
"""

from __future__ import annotations

from typing import Any

from ...findings import Finding

CONNECT_FIX = ("NCCL picked an interface or address the peer cannot reach: set NCCL_SOCKET_IFNAME to the interface "
               "that links the nodes (`ip -br addr` on each node; e.g. NCCL_SOCKET_IFNAME=eth0, or ^docker0,lo to "
               "exclude), and open the ports between the nodes (firewall, security group); NCCL_DEBUG=INFO "
               "NCCL_DEBUG_SUBSYS=INIT,NET shows the addresses it tries")
COMM_FIX = ("torchdoctor comm (under torchrun/srun, or --local N) checks that every rank can reach every other and "
            "names the one that cannot; --bench measures the bandwidth")


def judge(c: Any) -> list[Finding]:
    """The findings of one log: invalid usage, timeouts, the network, the store, then NCCL's own errors."""
    out = []
    usage = _judge_usage(c)
    out += usage
    if c.timeout_n or c.heartbeat:
        out.append(_judge_timeout(c))
    if c.gloo_timeouts and not c.timeout_n:
        out.append(_judge_gloo_timeout(c))
    network = _judge_network(c)
    out += network
    out += _judge_store(c)
    if (c.error_n or (c.abort_n and not out)) and not (network or usage):
        out.append(_judge_error(c))
    elif c.warn_n and not out:
        out.append(Finding("comm.nccl-warn", "info", f"{c.warn_n} NCCL warning(s), no NCCL failure",
                           [f"line {w['line']}: {w['text']}" for w in c.warns[:3]], [],
                           {"count": c.warn_n, "warnings": list(c.warns)}))
    return out


def _judge_timeout(c: Any) -> Finding:
    t = c.timeouts
    ev = [f"line {x['line']}: {x['text']}" for x in t[:3]]
    if c.timeout_n > 3:
        ev.append(f"... {c.timeout_n - 3} more timeout(s)")
    ev += [f"line {x['line']}: {x['text']}" for x in c.heartbeat[:2]]
    if c.abort_n:
        ev.append(f"'Some NCCL operations have failed or timed out' x{c.abort_n}: the ranks took the process "
                  "down")
    behind = _behind(c)
    if behind:
        ev.append(behind)
    ranks = sorted(c.timeout_ranks)
    first = c.timeout_first
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
        stuck = next((h["stuck_s"] for h in c.heartbeat if h["stuck_s"]), None)
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
                   {"count": c.timeout_n, "ranks": ranks[:256], "timeouts": list(t),
                    "earliest": dict(first) if first is not None else None,
                    "heartbeat_timeouts": list(c.heartbeat), "aborts": c.abort_n,
                    "progress": [c.progress[r] for r in sorted(c.progress, key=lambda r: (r is None, r))]})


def _behind(c: Any) -> str | None:
    """From the ranks' "last completed work" lines: the one(s) that completed the fewest collectives."""
    ranks = [p for p in c.progress.values() if p["rank"] is not None]
    if len(ranks) < 2:
        return None
    low = min(p["completed"] for p in ranks)
    behind = sorted(p["rank"] for p in ranks if p["completed"] == low)
    if len(behind) == len(ranks):
        return None
    return (f"rank(s) {', '.join(map(str, behind[:8]))} completed the fewest collectives (last completed work "
            f"{low}; the others got further): the rank that stopped is there")


def _judge_gloo_timeout(c: Any) -> Finding:
    g = c.gloo_timeouts[0]
    return Finding(
        "comm.nccl-timeout", "fail",
        f"gloo collective timed out: a {g['op']} waited {g['ms'] / 1000:.0f} s for its peer",
        [f"line {x['line']}: {x['text']}" for x in c.gloo_timeouts[:3]],
        [COMM_FIX, "one rank never reached the collective (a rank-only branch, uneven batches, a crash on the "
         "peer): the first error of another rank is the cause; init_process_group(timeout=...) raises the "
         "limit"], {"count": len(c.gloo_timeouts), "timeouts": list(c.gloo_timeouts), "backend": "gloo"})


def _judge_network(c: Any) -> list[Finding]:
    if not c.network and c.retries:
        last = c.retries[-1]["line"]
        after = [w for w in c.warns if w["line"] > last]
        ev = [f"line {r['line']}: {r['text']}" for r in c.retries[:3]]
        if not after:
            return [Finding("comm.network", "info", "NCCL retried connecting to a peer "
                            f"({c.retries[0]['detail'] or 'connection failed'}); nothing here says it failed",
                            ev, [], {"count": 0, "retries": list(c.retries)})]
        ev += [f"line {w['line']}: {w['text']}" for w in after[:2]]
        return [Finding("comm.network", "fail",
                        f"a rank could not connect to its peer: NCCL retried "
                        f"({c.retries[0]['detail'] or 'connection failed'}) and then warned",
                        ev, [COMM_FIX, CONNECT_FIX], {"count": len(c.retries), "retries": list(c.retries),
                                                      "warnings": after})]
    if not c.network:
        return []
    net = c.network
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
    if c.network_n > len(net[:4]):
        ev.append(f"{c.network_n} network line(s) in all")
    ev += [f"line {e['line']}: {e['text']}" for e in c.errors[:2]]
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
                    {"count": c.network_n, "events": list(net), "nccl_errors": list(c.errors)})]


def _judge_store(c: Any) -> list[Finding]:
    if not c.store:
        return []
    order = ("port-in-use", "barrier-crowded", "barrier-timeout", "connect-timeout", "connect-failed",
             "rdzv-timeout", "rdzv-connect", "rdzv-closed", "wait-timeout", "barrier-waiting", "listen-failed",
             "store-closed")
    errors = [s for s in c.store if not s["warning"]]
    if not errors:  # only c10's warnings: connects it retried (torchrun's IPv6 localhost, a slow rank 0)
        w = c.store[0]
        return [Finding("comm.rendezvous", "info",
                        f"c10d warned while connecting to the store ({w['detail'] or w['kind']}); it retries, and "
                        "nothing here says it failed", [f"line {s['line']}: {s['text']}" for s in c.store[:2]],
                        [], {"kind": w["kind"], "events": list(c.store)})]
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
    ev = [f"line {s['line']}: {s['text']}" for s in c.store[:4]]
    fix = [fixes[kind], COMM_FIX]
    return [Finding("comm.rendezvous", "warn" if kind == "barrier-waiting" else "fail", titles[kind], ev, fix,
                    {"kind": kind, "events": list(c.store)})]


def _judge_usage(c: Any) -> list[Finding]:
    if not c.usage:
        return []
    u = next((x for x in c.usage if x["kind"] == "duplicate-gpu"), c.usage[0])
    ev = [f"line {x['line']}: {x['text']}" for x in c.usage[:3]]
    ev += [f"line {w['line']}: {w['text']}" for w in c.warns[:2] if w["line"] != u["line"]]
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
        warn = next((w["msg"] for w in c.warns if w["line"] <= u["line"]), None)
        title = f"NCCL refused a call as invalid: {u['detail']}" + (f" ({warn})" if warn else "")
        fix = ["the NCCL WARN line before the error says which argument: rerun with NCCL_DEBUG=WARN; every rank "
               "must call the same collectives with the same sizes, dtypes and root, on tensors on its own GPU"]
    return [Finding("comm.invalid-usage", "fail", title, ev, fix + [COMM_FIX], {"events": list(c.usage)})]


def _judge_error(c: Any) -> Finding:
    errs = c.errors
    kinds = [e["detail"] if e["kind"] == "NCCL error" and e["detail"] else
             e["kind"] if not e["detail"] else f"{e['kind']}: {e['detail']}" for e in errs]
    ev = [f"line {e['line']}: {e['text']}" for e in errs[:4]]
    if c.error_n > 4:
        ev.append(f"... {c.error_n - 4} more")
    ev += [f"line {w['line']}: {w['text']}" for w in c.warns[:3]]
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
                   {"count": c.error_n, "errors": list(errs), "warnings": c.warn_n})

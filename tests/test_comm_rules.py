"""The verdict rules of `torchdoctor comm` over fabricated side-channel snapshots and rank identities."""

from __future__ import annotations

import pytest

from torchdoctor.comm.rules import STAGES, cross_rank, judge, network_fixes, stage_index
from torchdoctor.findings import worst

TIMEOUT = 30.0


def ident(rank, host="a", local_rank=None, **kw):
    """An identity as identity.probe() reports it, on a host with 8 GPUs."""
    lr = rank if local_rank is None else local_rank
    d = {"rank": rank, "host": host, "local_rank": lr, "pid": 1000 + rank, "torch": "2.4.0+cu124", "cuda": "12.4",
         "nccl": "2.21.5", "driver": "12.4", "device": f"cuda:{lr}", "device_name": "NVIDIA H100 80GB HBM3",
         "device_uuid": f"GPU-{host}-{lr}", "cuda_devices": 8, "env": {"NCCL_DEBUG": "WARN"}}
    d.update(kw)
    return d


def ok_final():
    return {"status": "ok", "stage": "done", "detail": "", "kind": "", "error": ""}


def broken(stage, kind="timeout", error=None, detail=""):
    error = error or f"no progress in {stage} for {TIMEOUT:g} s"
    return {"status": "broken", "stage": stage, "detail": detail, "kind": kind, "error": error}


def rec(identity, stage=None, final=None, ring=None, alive=False):
    if isinstance(stage, str):
        stage = {"name": stage, "detail": ""}
    elif isinstance(stage, tuple):
        stage = {"name": stage[0], "detail": stage[1]}
    return {"identity": identity, "stage": stage, "final": final, "ring": ring, "alive": alive}


def by_id(findings):
    out = {}
    for f in findings:
        out.setdefault(f.id, []).append(f)
    return out


def only(findings, id_):
    got = [f for f in findings if f.id == id_]
    assert len(got) == 1, [f.id for f in findings]
    return got[0]


# -- judge ------------------------------------------------------------------------------------------

def test_stage_index():
    assert stage_index("connect") == 0
    assert stage_index("done") == len(STAGES) - 1
    assert stage_index("all_reduce") < stage_index("ring") < stage_index("bench")
    assert stage_index(None) == -1
    assert stage_index("nope") == -1


def test_all_ok():
    ring = {"received": True, "sent": True}
    snap = {r: rec(ident(r, host="ab"[r // 2], local_rank=r % 2), "done", ok_final(), ring) for r in range(4)}
    rows, findings = judge(snap, "nccl", TIMEOUT)
    assert findings == []
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert all(r["status"] == "ok" and r["stage"] == "done" and r["detail"] == "" for r in rows)
    assert [r["host"] for r in rows] == ["a", "a", "b", "b"]
    assert [r["local_rank"] for r in rows] == [0, 1, 0, 1]
    assert rows[1]["device"] == "cuda:1 NVIDIA H100 80GB HBM3"


def test_missing_rank():
    snap = {r: rec(ident(r), "join", broken("join", error="ranks 2 did not join within 30 s")) for r in (0, 1, 3)}
    snap[2] = rec(None)
    rows, findings = judge(snap, "nccl", TIMEOUT)
    f = only(findings, "comm.rank-missing")
    assert [x.id for x in findings] == ["comm.rank-missing"]
    assert f.severity == "fail"
    assert f.title == "rank 2 never joined (no contact within 30 s)"
    assert f.data == {"rank": 2}
    assert f.evidence == ["ranks that joined: 0, 1, 3"]
    assert any("rank 2" in fx and "--nproc_per_node" in fx for fx in f.fix)
    assert rows[2] == {"rank": 2, "host": None, "local_rank": None, "device": None, "status": "missing",
                       "stage": "join", "detail": "never joined"}
    for r in (0, 1, 3):
        assert rows[r]["status"] == "ok"
        assert rows[r]["stage"] == "join"
        assert "rank 2 never joined" in rows[r]["detail"]


def test_missing_ranks_while_others_still_wait():
    snap = {0: rec(ident(0), "join", alive=True), 1: rec(None), 2: rec(None)}
    rows, findings = judge(snap, "gloo", 5)
    assert [(f.id, f.data["rank"]) for f in findings] == [("comm.rank-missing", 1), ("comm.rank-missing", 2)]
    assert findings[0].title == "rank 1 never joined (no contact within 5 s)"
    assert findings[0].evidence == ["ranks that joined: 0"]
    assert rows[0]["status"] == "ok" and rows[0]["detail"] == "still waiting in join"
    assert [r["status"] for r in rows] == ["ok", "missing", "missing"]


def test_nobody_joined():
    rows, findings = judge({0: rec(None), 1: rec(None)}, "gloo", TIMEOUT)
    assert findings[0].evidence == ["ranks that joined: none"]
    assert {r["status"] for r in rows} == {"missing"}


def test_dead_rank():
    snap = {r: rec(ident(r, host="ab"[r // 2], local_rank=r % 2), ("bench", "all_reduce 16M"),
                   broken("bench", detail="all_reduce 16M"), alive=True) for r in range(4)}
    snap[3] = rec(ident(3, host="b", local_rank=1), ("bench", "all_reduce 16M"), None, alive=False)
    rows, findings = judge(snap, "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-died"]
    f = findings[0]
    assert f.severity == "fail"
    assert f.title == "rank 3 (host b, local rank 1) died during bench all_reduce 16M"
    assert f.data == {"rank": 3, "stage": "bench", "detail": "all_reduce 16M", "process": None,
                      "returncode": None, "signal": None}
    assert "last stage entered: bench all_reduce 16M" in f.evidence[0]
    assert any("host b" in fx and "dmesg" in fx for fx in f.fix)
    assert not any("rendezvous store" in e for e in f.evidence)
    assert rows[3]["status"] == "broken"
    assert rows[3]["stage"] == "bench"
    assert rows[3]["detail"] == "died during bench all_reduce 16M"
    for r in (0, 1, 2):
        assert rows[r]["status"] == "ok"
        assert rows[r]["detail"] == "cut short in bench by another rank: rank 3 (host b, local rank 1) died"


def test_dead_rank_before_any_stage():
    snap = {0: rec(ident(0), "join", broken("join")), 1: rec(ident(1), None, None, alive=False)}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    f = only(findings, "comm.rank-died")
    assert f.title == "rank 1 (host a, local rank 1) died during join"
    assert f.data == {"rank": 1, "stage": None, "detail": None, "process": None, "returncode": None,
                      "signal": None}
    assert rows[1]["detail"] == "died during join"


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_stuck_rank(backend):
    snap = {r: rec(ident(r), "all_reduce", broken("all_reduce"), alive=True) for r in (0, 2, 3)}
    snap[1] = rec(ident(1), ("init", backend), None, alive=True)
    rows, findings = judge(snap, backend, TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-stuck"]
    f = findings[0]
    assert f.severity == "fail"
    assert f.title == f"rank 1 (host a, local rank 1) is alive but stuck in init {backend}"
    assert f.data == {"rank": 1, "stage": "init"}
    assert "(all_reduce)" in f.evidence[0]
    assert f.fix == network_fixes(backend)
    assert rows[1]["status"] == "broken" and rows[1]["detail"] == f"stuck in init {backend}"
    assert rows[0]["status"] == "ok" and "rank 1 (host a, local rank 1) is stuck" in rows[0]["detail"]


def test_stuck_in_device_stage_points_at_the_gpu():
    snap = {0: rec(ident(0), "all_reduce", broken("all_reduce"), alive=True),
            1: rec(ident(1), ("device", "cuda:1"), None, alive=True)}
    _, findings = judge(snap, "nccl", TIMEOUT)
    f = only(findings, "comm.rank-stuck")
    assert len(f.fix) == 1 and "nvidia-smi" in f.fix[0]


def test_alive_rank_at_the_failing_stage_is_not_stuck():
    """A rank still waiting where another just timed out is a victim too: a stage timeout, not a stuck rank."""
    snap = {0: rec(ident(0), "all_reduce", broken("all_reduce"), alive=True),
            1: rec(ident(1), "all_reduce", None, alive=True)}
    rows, findings = judge(snap, "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.stage-timeout"]
    assert rows[1] == {**rows[1], "status": "ok", "detail": "still waiting in all_reduce"}
    assert rows[0]["status"] == "broken"


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_wrong_result(backend):
    err = "all_reduce sum: 4096 of 4096 elements wrong; first at [0]: got 5, expected 6"
    snap = {r: rec(ident(r), "all_gather", broken("all_gather"), alive=True) for r in range(3)}
    snap[1] = rec(ident(1), "all_reduce", broken("all_reduce", kind="wrong", error=err), alive=True)
    rows, findings = judge(snap, backend, TIMEOUT)
    assert [f.id for f in findings] == ["comm.wrong-result"]
    f = findings[0]
    assert f.severity == "fail"
    assert f.title == "rank 1 (host a, local rank 1) got a wrong all_reduce result"
    assert f.evidence == [err]
    if backend == "nccl":
        assert "NCCL_P2P_DISABLE=1" in f.fix[0]
        assert f.fix[-1] == network_fixes(backend)[-1]
    else:
        assert "ECC" in f.fix[0] and not any("NCCL" in fx for fx in f.fix)
    assert f.data == {"rank": 1, "stage": "all_reduce"}
    assert rows[1]["status"] == "broken" and rows[1]["detail"] == err
    assert rows[0]["status"] == rows[2]["status"] == "ok"


def _ring_snapshot(n, deaf):
    snap = {}
    for r in range(n):
        ring = None if r in deaf else {"received": True, "sent": False}
        detail = f"send {r}->{(r + 1) % n}, recv {(r - 1) % n}->{r}"
        snap[r] = rec(ident(r), ("ring", detail), broken("ring", detail=detail), ring=ring, alive=True)
    return snap


def test_link_broken():
    rows, findings = judge(_ring_snapshot(4, deaf={2}), "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.link-broken"]
    f = findings[0]
    assert f.severity == "fail"
    assert f.title == "ring did not complete between ranks that are all alive (links 1->2)"
    assert f.data == {"stages": ["ring"], "links": ["1->2"]}
    assert "ring links that carried nothing: 1->2" in f.evidence
    assert "ranks 0, 1, 2, 3 timed out or failed in ring" in f.evidence[0]
    assert f.fix == network_fixes("nccl")
    assert all(r["status"] == "broken" and r["stage"] == "ring" for r in rows)


def test_link_broken_wraps_around_and_lists_every_deaf_rank():
    _, findings = judge(_ring_snapshot(3, deaf={0, 2}), "gloo", TIMEOUT)
    f = only(findings, "comm.link-broken")
    assert f.data["links"] == ["2->0", "1->2"]
    assert "(links 2->0, 1->2)" in f.title
    assert f.fix == network_fixes("gloo")


def test_stage_timeout_without_ring_data():
    snap = {r: rec(ident(r), "all_reduce", broken("all_reduce"), alive=True) for r in range(4)}
    rows, findings = judge(snap, "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.stage-timeout"]
    f = findings[0]
    assert f.title == "all_reduce did not complete between ranks that are all alive"
    assert f.data == {"stages": ["all_reduce"], "links": []}
    assert all(r["status"] == "broken" for r in rows)


def test_ring_timeout_with_every_link_carrying_data_is_a_stage_timeout():
    rows, findings = judge(_ring_snapshot(2, deaf=set()), "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.stage-timeout"]
    assert findings[0].data["links"] == []


def test_network_fixes():
    nccl = " ".join(network_fixes("nccl"))
    for needle in ("NCCL_DEBUG=INFO", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE=1", "CUDA_VISIBLE_DEVICES"):
        assert needle in nccl
    assert "GLOO_SOCKET_IFNAME" not in nccl
    gloo = " ".join(network_fixes("gloo"))
    assert "GLOO_SOCKET_IFNAME" in gloo
    assert "NCCL" not in gloo


def test_store_lost_blames_the_store_host():
    snap = {0: rec(ident(0), "all_reduce", None, alive=False)}
    snap.update({r: rec(ident(r), "all_reduce", broken("all_reduce"), alive=False) for r in (1, 2)})
    rows, findings = judge(snap, "nccl", TIMEOUT, store_lost="Connection reset by peer", store_host_rank=0)
    assert [f.id for f in findings] == ["comm.rank-died"]
    f = findings[0]
    assert f.data["rank"] == 0
    assert f.title == ("rank 0 (host a, local rank 0), which hosts the rendezvous store, died or became unreachable"
                       " during all_reduce")
    assert "the store stopped answering: Connection reset by peer" in f.evidence
    assert rows[0]["status"] == "broken" and rows[0]["detail"] == "died during all_reduce"


def test_store_host_whose_stage_was_never_read_is_not_said_to_be_in_join():
    """Before issue 10 a store host the survivors never read a stage of was reported "died during join"."""
    snap = {0: rec(ident(0), None, None, alive=False),
            1: rec(ident(1), ("bench", "all_reduce 8M"), broken("bench", kind="error", detail="all_reduce 8M"))}
    rows, findings = judge(snap, "gloo", TIMEOUT, store_lost="Connection reset by peer", store_host_rank=0)
    f = only(findings, "comm.rank-died")
    assert f.title == "rank 0 (host a, local rank 0), which hosts the rendezvous store, died or became unreachable"
    assert "join" not in f.title and "join" not in rows[0]["detail"]
    assert rows[0]["detail"] == "died (its last stage was never read)"
    assert f.evidence[0].endswith("last stage entered: never read")


def test_store_lost_overrides_a_store_host_that_looked_alive():
    """The heartbeat read fails once the store is gone: a store host without a final counts as died."""
    snap = {0: rec(ident(0), "all_reduce", None, alive=True),
            1: rec(ident(1, host="b", local_rank=0), "all_reduce", broken("all_reduce"), alive=True)}
    rows, findings = judge(snap, "gloo", TIMEOUT, store_lost="Broken pipe", store_host_rank=0)
    assert [(f.id, f.data["rank"]) for f in findings] == [("comm.rank-died", 0)]
    assert "which hosts the rendezvous store" in findings[0].title
    assert rows[0]["status"] == "broken"
    assert rows[1]["status"] == "ok" and "rank 0 (host a, local rank 0) died" in rows[1]["detail"]
    # the same records without a lost store: nobody died, the two are waiting on each other
    _, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.stage-timeout"]


def test_store_lost_missing_ranks_are_reported_as_unheard():
    snap = {0: rec(ident(0), "init", broken("init")), 1: rec(None)}
    _, findings = judge(snap, "gloo", TIMEOUT, store_lost="Broken pipe", store_host_rank=0)
    rows, findings = judge(snap, "gloo", TIMEOUT, store_lost="Broken pipe", store_host_rank=0)
    # rank 0 posted its final: the store host is not blamed; rank 1 is unknown, not "missing"
    assert [f.id for f in findings] == ["comm.store-lost"]
    assert "Broken pipe" in findings[0].title
    assert rows[1]["detail"] == "state unknown: the side channel was lost"


def test_store_host_without_identity_is_blamed_as_the_lost_store():
    snap = {0: rec(None), 1: rec(ident(1), "join", broken("join"))}
    _, findings = judge(snap, "gloo", TIMEOUT, store_lost="Broken pipe", store_host_rank=0)
    assert [(f.id, f.data["rank"]) for f in findings] == [("comm.rank-died", 0)]
    assert "hosts the rendezvous store" in findings[0].title


def test_store_lost_without_a_store_host_blames_nobody_extra():
    snap = {0: rec(ident(0), "init", None, alive=True), 1: rec(ident(1), "init", None, alive=True)}
    rows, findings = judge(snap, "nccl", TIMEOUT, store_lost="Broken pipe", store_host_rank=None)
    assert [f.id for f in findings] == ["comm.store-lost"]
    assert [r["detail"] for r in rows] == ["state unknown: the side channel was lost"] * 2


def test_store_host_alive_in_snapshot_is_blamed_once():
    snap = {0: rec(ident(0), ("init", "nccl"), None, alive=True),
            1: rec(ident(1), "all_reduce", broken("all_reduce"), alive=True)}
    rows, findings = judge(snap, "nccl", TIMEOUT, store_lost="Broken pipe", store_host_rank=0)
    assert [f.id for f in findings] == ["comm.rank-died"]
    assert rows[1]["detail"] == "cut short in all_reduce by another rank: rank 0 (host a, local rank 0) died"


def test_usage_error_is_one_finding():
    err = "--backend nccl needs a CUDA device on every rank; ranks 1 have none (use --backend gloo, or auto)"
    snap = {0: rec(ident(0), "init", broken("init", kind="usage", error=err)),
            1: rec(ident(1, device="cpu", cuda_devices=0), "init", broken("init", kind="usage", error=err))}
    rows, findings = judge(snap, "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.backend-unavailable"]
    f = findings[0]
    assert f.severity == "fail"
    assert f.title == err
    assert f.data == {"ranks": [0, 1]}
    assert "--backend gloo" in f.fix[0]
    assert [r["status"] for r in rows] == ["broken", "broken"]


def test_fault_findings_precede_and_severity_is_fail():
    snap = {0: rec(ident(0), "all_reduce", broken("all_reduce"), alive=True),
            1: rec(None),
            2: rec(ident(2), "init", None, alive=False)}
    _, findings = judge(snap, "nccl", TIMEOUT)
    assert [(f.id, f.data["rank"]) for f in findings] == [("comm.rank-missing", 1), ("comm.rank-died", 2)]
    assert worst(findings) == "fail"


def test_own_error_in_device_stage_is_blamed_on_that_rank():
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 MiB"
    snap = {r: rec(ident(r), "all_reduce", broken("all_reduce"), alive=False) for r in (0, 2)}
    snap[1] = rec(ident(1), ("device", "cuda:1"), broken("device", kind="error", error=oom), alive=False)
    _, findings = judge(snap, "nccl", TIMEOUT)
    f = only(findings, "comm.out-of-memory")
    assert f.data == {"ranks": [1], "stage": "device"}
    assert "nvidia-smi" in f.fix[0]
    assert f.title.startswith("rank 1 (host a, local rank 1) ran out of memory in device")


# -- cross_rank -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, severity", [("nccl", "fail"), ("gloo", "warn")])
def test_shared_gpu(backend, severity):
    idents = {0: ident(0, local_rank=0, cuda_devices=1),
              1: ident(1, local_rank=1, device="cuda:0", device_uuid="GPU-a-0", cuda_devices=1)}
    findings = cross_rank(idents, backend)
    assert [f.id for f in findings] == ["comm.shared-gpu"]
    f = findings[0]
    assert f.severity == severity
    assert f.title == "ranks 0, 1 share one GPU (cuda:0 NVIDIA H100 80GB HBM3 on host a)"
    assert f.data == {"host": "a", "ranks": [0, 1]}
    assert "torchrun --nproc_per_node 1" in f.fix[0]
    assert "host a" in f.fix[0]
    assert "host a has 1 visible GPU(s)" in f.evidence


def test_shared_gpu_title_without_device_name():
    idents = {r: ident(r, local_rank=r, device="cuda:0", device_uuid="GPU-x", device_name=None) for r in range(3)}
    f = only(cross_rank(idents, "nccl"), "comm.shared-gpu")
    assert f.title == "ranks 0, 1, 2 share one GPU (cuda:0 on host a)"


def test_shared_gpu_without_uuid_uses_visible_devices_and_index():
    same = {r: ident(r, device="cuda:0", device_uuid=None, env={"CUDA_VISIBLE_DEVICES": "0"}) for r in range(2)}
    assert [f.data["ranks"] for f in cross_rank(same, "nccl")] == [[0, 1]]
    apart = {r: ident(r, device="cuda:0", device_uuid=None, env={"CUDA_VISIBLE_DEVICES": str(r)}) for r in range(2)}
    assert cross_rank(apart, "nccl") == []


def test_same_uuid_on_different_hosts_is_not_shared():
    idents = {0: ident(0, host="a", local_rank=0, device_uuid="GPU-same"),
              1: ident(1, host="b", local_rank=0, device_uuid="GPU-same")}
    assert cross_rank(idents, "nccl") == []


def test_cpu_ranks_do_not_share_a_gpu():
    idents = {r: ident(r, device="cpu", device_uuid=None, device_name=None, cuda_devices=0, nccl=None, driver=None)
              for r in range(4)}
    assert cross_rank(idents, "gloo") == []


def test_distinct_gpus_and_same_versions_give_nothing():
    idents = {r: ident(r, host="ab"[r // 4], local_rank=r % 4) for r in range(8)}
    assert cross_rank(idents, "nccl") == []
    idents[5] = None  # a rank that never joined is skipped
    assert cross_rank(idents, "nccl") == []


def test_torch_version_mismatch():
    idents = {0: ident(0), 1: ident(1, torch="2.5.1+cu124"), 2: ident(2)}
    f = only(cross_rank(idents, "nccl"), "comm.torch-version-mismatch")
    assert f.severity == "fail"
    assert f.title == "torch versions differ between ranks"
    assert f.data == {"versions": {"2.4.0+cu124": [0, 2], "2.5.1+cu124": [1]}}
    assert "torch 2.5.1+cu124: ranks 1" in f.evidence
    assert "torch 2.4.0+cu124: ranks 0, 2" in f.evidence


@pytest.mark.parametrize("field, severity, other", [
    ("nccl", "fail", "2.18.1"), ("cuda", "warn", "12.1"), ("driver", "warn", "12.2"),
])
def test_other_version_mismatches(field, severity, other):
    idents = {0: ident(0), 1: ident(1, **{field: other})}
    findings = cross_rank(idents, "nccl")
    assert [f.id for f in findings] == [f"comm.{field}-version-mismatch"]
    assert findings[0].severity == severity
    assert findings[0].data["versions"][other] == [1]


def test_env_mismatch():
    idents = {0: ident(0, env={"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"}),
              1: ident(1, env={"NCCL_DEBUG": "INFO"}),
              2: ident(2, env={"NCCL_DEBUG": "INFO"})}
    f = only(cross_rank(idents, "nccl"), "comm.env-mismatch")
    assert f.severity == "warn"
    assert f.title == "NCCL_IB_DISABLE differs between ranks"
    assert f.data["variable"] == "NCCL_IB_DISABLE"
    assert f.data["values"]["1"] == [0]
    assert "NCCL_IB_DISABLE=1: ranks 0" in f.evidence
    assert "unset: ranks 1, 2" in f.evidence


def test_env_mismatch_one_finding_per_variable():
    idents = {0: ident(0, env={"NCCL_SOCKET_IFNAME": "eth0", "NCCL_P2P_DISABLE": "1"}),
              1: ident(1, env={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_P2P_DISABLE": "1"})}
    findings = cross_rank(idents, "nccl")
    assert [(f.id, f.data["variable"]) for f in findings] == [("comm.env-mismatch", "NCCL_SOCKET_IFNAME")]
    assert "NCCL_SOCKET_IFNAME=eth0: ranks 0" in findings[0].evidence
    assert "NCCL_SOCKET_IFNAME=ib0: ranks 1" in findings[0].evidence


def test_cuda_visible_devices_differing_is_not_flagged():
    idents = {r: ident(r, local_rank=0, device="cuda:0", device_uuid=f"GPU-{r}", env={"CUDA_VISIBLE_DEVICES": str(r)})
              for r in range(4)}
    assert cross_rank(idents, "nccl") == []


def test_no_device():
    cpu = {"device": "cpu", "device_uuid": None, "device_name": None, "cuda_devices": 0, "nccl": None,
           "driver": None}
    idents = {0: ident(0), 1: ident(1, host="b", env={"CUDA_VISIBLE_DEVICES": ""}, **cpu),
              2: ident(2, host="b", **cpu), 3: ident(3)}
    f = only(cross_rank(idents, "gloo"), "comm.no-device")
    assert f.severity == "fail"
    assert f.title == "ranks 1, 2 see no CUDA device while ranks 0, 3 do"
    assert f.data == {"ranks": [1, 2]}
    assert f.evidence == ["rank 1 (host b, local rank 1): CUDA_VISIBLE_DEVICES=",
                          "rank 2 (host b, local rank 2): CUDA_VISIBLE_DEVICES=(unset)"]


def test_no_device_is_not_also_a_version_mismatch():
    cpu = {"device": "cpu", "device_uuid": None, "device_name": None, "cuda_devices": 0, "nccl": None,
           "driver": None}
    idents = {0: ident(0), 1: ident(1, host="b", **cpu)}
    assert [f.id for f in cross_rank(idents, "gloo")] == ["comm.no-device"]


# -- terminated, frozen and hung ranks ------------------------------------------------------------------

def test_sigterm_everywhere_is_terminated_not_a_network_problem():
    snap = {r: rec(ident(r), ("bench", "all_reduce 8M"), broken("bench", kind="terminated", detail="all_reduce 8M"),
                   alive=True) for r in range(3)}
    rows, findings = judge(snap, "nccl", TIMEOUT)
    assert [f.id for f in findings] == ["comm.terminated"]
    f = findings[0]
    assert f.title == "the check was stopped from outside (SIGTERM) on ranks 0, 1, 2 during bench all_reduce 8M"
    assert not any("NCCL" in fx for fx in f.fix) and "sacct" in f.fix[0]
    assert all(r["status"] == "broken" for r in rows)


def test_sigterm_after_a_death_is_the_launcher_reacting():
    snap = {0: rec(ident(0), "bench", broken("bench", kind="terminated"), alive=True),
            1: rec(ident(1), ("bench", "all_gather 1M"), None, alive=False)}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-died"]
    assert rows[0]["status"] == "ok" and "rank 1 (host a, local rank 1) died" in rows[0]["detail"]


def test_a_terminated_final_does_not_make_slower_ranks_stuck():
    snap = {0: rec(ident(0), "done", broken("done", kind="terminated"), alive=True),
            1: rec(ident(1), "barrier", None, alive=True)}
    _, findings = judge(snap, "gloo", TIMEOUT)
    assert "comm.rank-stuck" not in by_id(findings)


@pytest.mark.parametrize("state, verb, fix, id_", [
    # alive (this host sees its process): stuck, and how to look at it
    ("stopped", "is frozen (stopped) in", "kill -CONT 4242", "comm.rank-stuck"),
    ("stopped", "is frozen (stopped) in", "py-spy dump --pid 4242", "comm.rank-stuck"),
    ("running", "stopped responding in", "py-spy dump --native --pid 4242", "comm.rank-stuck"),
    ("gone", "died during", "dmesg -T", "comm.rank-died"),
    (None, "died during", "dmesg -T", "comm.rank-died"),
])
def test_what_this_host_sees_of_a_silent_rank(state, verb, fix, id_):
    snap = {0: rec(ident(0), "ring", broken("ring"), alive=True),
            1: {**rec(ident(1, pid=4242), ("ring", "send 1->0"), None, alive=False), "process": state}}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings if f.severity == "fail"] == [id_]
    f = findings[0]
    assert f.title == f"rank 1 (host a, local rank 1) {verb} ring send 1->0"
    assert any(fix in fx for fx in f.fix)
    assert rows[1]["detail"] == f"{verb} ring send 1->0" and f.data["process"] == state
    assert rows[1]["status"] == "broken" and rows[0]["status"] == "ok"


def test_a_stopped_rank_says_it_is_alive_and_where_to_look():
    snap = {0: rec(ident(0), ("bench", "all_reduce 8M"), broken("bench"), alive=True),
            1: {**rec(ident(1, pid=4242), ("bench", "all_reduce 8M"), None, alive=False), "process": "stopped"}}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    f = only(findings, "comm.rank-stuck")
    assert f.data == {"rank": 1, "stage": "bench", "detail": "all_reduce 8M", "process": "stopped", "pid": 4242,
                      "tracer_pid": None, "tracer": None, "ended_by_launcher": False}
    assert any("state T in /proc/4242/stat" in e for e in f.evidence)
    assert any("TracerPid" in fx for fx in f.fix)
    assert "comm.rank-died" not in by_id(findings)
    assert rows[0]["detail"] == "cut short in bench by another rank: rank 1 (host a, local rank 1) is frozen"


def test_a_frozen_store_host_is_stuck_and_says_the_store_stopped_answering():
    snap = {0: {**rec(ident(0, pid=77), "all_reduce", None), "process": "stopped"},
            1: rec(ident(1), "all_reduce", broken("all_reduce"), alive=True)}
    _, findings = judge(snap, "gloo", TIMEOUT, store_lost="Broken pipe", store_host_rank=0)
    f = only(findings, "comm.rank-stuck")
    assert f.data["rank"] == 0 and f.data["process"] == "stopped"
    assert "it hosts the rendezvous store, which stopped answering: Broken pipe" in f.evidence
    assert "comm.rank-died" not in by_id(findings)


# -- Ctrl-C, and ranks --local never started ------------------------------------------------------------

def interrupted_at(stage, detail=""):
    return broken(stage, kind="interrupted", error="interrupted by the user (SIGINT, Ctrl-C)", detail=detail)


def test_ctrl_c_is_an_interruption_not_a_fault_and_not_sigterm():
    snap = {r: rec(ident(r), ("bench", "all_reduce 8M"), interrupted_at("bench", "all_reduce 8M"), alive=True)
            for r in range(3)}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.interrupted"]
    f = findings[0]
    assert f.severity == "skip" and worst(findings) != "fail"
    assert f.title == ("interrupted by the user (Ctrl-C) during bench all_reduce 8M: the stages after it were not "
                       "checked")
    assert "SIGTERM" not in f.title and not any("scancel" in fx for fx in f.fix)
    assert f.data == {"ranks": [0, 1, 2]}
    assert [(r["status"], r["detail"]) for r in rows] == [("interrupted", "interrupted in bench all_reduce 8M")] * 3


def test_ctrl_c_while_ranks_start_blames_none_of_them():
    """The launcher saw the Ctrl-C: ranks that exited on it (130, SIGINT) or had not joined yet are not faults."""
    snap = {0: {**rec(None), "exit": exited(130)},
            1: {**rec(None), "exit": {"returncode": -2, "signal": "SIGINT", "pid": 5001}}, 2: rec(None)}
    rows, findings = judge(snap, "gloo", TIMEOUT, interrupted=True)
    assert [f.id for f in findings] == ["comm.interrupted"]
    assert findings[0].title == "interrupted by the user (Ctrl-C) before any rank joined: nothing was checked"
    assert [(r["status"], r["detail"]) for r in rows] == [("interrupted", "interrupted before joining")] * 3
    # the same records without the Ctrl-C: deaths and a missing rank
    _, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-missing", "comm.rank-died", "comm.rank-died"]


def test_a_death_before_the_ctrl_c_is_still_the_fault():
    snap = {0: rec(ident(0), "all_reduce", interrupted_at("all_reduce"), alive=True),
            1: {**rec(ident(1), "all_reduce", None), "exit": exited(-9)}}
    rows, findings = judge(snap, "gloo", TIMEOUT, interrupted=True)
    assert [f.id for f in findings] == ["comm.rank-died", "comm.interrupted"]
    assert rows[1]["detail"] == "was killed by SIGKILL during all_reduce" and rows[0]["status"] == "interrupted"


def test_a_ctrl_c_after_every_rank_passed_changes_nothing():
    snap = {r: rec(ident(r), "done", ok_final()) for r in range(2)}
    rows, findings = judge(snap, "gloo", TIMEOUT, interrupted=True)
    assert findings == [] and [r["status"] for r in rows] == ["ok", "ok"]


def test_ranks_the_launcher_never_started_are_not_missing():
    snap = {0: {**rec(ident(0), "join", peer_died(1, "join"), alive=True), "launched": True},
            1: {**rec(None), "exit": exited(-9), "launched": True},
            **{r: {**rec(None), "launched": False} for r in range(2, 6)}}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-died", "comm.not-started"]
    assert findings[1].title == "ranks 2-5 were not started" and findings[1].severity == "skip"
    assert [(r["status"], r["detail"]) for r in rows[2:]] == [("missing", "not started")] * 4
    # started but never heard of: missing, as before
    snap[2]["launched"] = True
    _, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-missing", "comm.rank-died", "comm.not-started"]
    assert findings[2].title == "ranks 3-5 were not started"
    snap[3]["launched"] = True
    assert only(judge(snap, "gloo", TIMEOUT)[1], "comm.not-started").title == "ranks 4, 5 were not started"


# -- what the --local launcher saw (exit records) -----------------------------------------------------

def exited(returncode, pid=5000):
    sig = {-9: "SIGKILL", -11: "SIGSEGV", -15: "SIGTERM"}.get(returncode)
    return {"returncode": returncode, "signal": sig, "pid": pid}


def peer_died(r, stage):
    return broken(stage, kind="peer-died", error=f"rank {r} was killed by SIGKILL (seen by its launcher) while this "
                                                 f"rank was in {stage}")


def test_a_rank_killed_before_joining_is_dead_not_missing():
    snap = {0: rec(ident(0), "join", peer_died(1, "join"), alive=True), 1: {**rec(None), "exit": exited(-9)},
            2: rec(ident(2), "join", peer_died(1, "join"), alive=True)}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-died"]
    f = findings[0]
    assert f.title == "rank 1 was killed by SIGKILL before joining"
    assert f.data == {"rank": 1, "stage": None, "detail": None, "process": "gone", "returncode": -9,
                      "signal": "SIGKILL"}
    assert "its launcher saw its process 5000 end: was killed by SIGKILL (returncode -9)" in f.evidence[0]
    assert "before joining" in f.evidence[1]
    assert any("dmesg" in fx for fx in f.fix)
    assert rows[1] == {"rank": 1, "host": None, "local_rank": None, "device": None, "status": "broken",
                       "stage": None, "detail": "was killed by SIGKILL before joining"}
    assert rows[0]["status"] == rows[2]["status"] == "ok"
    assert rows[0]["detail"] == "cut short in join by another rank: rank 1 was killed by SIGKILL"
    # the same rank without its launcher's word: missing (what torchrun or srun launches get)
    snap[1] = rec(None)
    _, findings = judge(snap, "gloo", TIMEOUT)
    assert [f.id for f in findings] == ["comm.rank-missing"]


def test_exit_record_names_the_signal_and_stage_even_while_the_heartbeat_looked_alive():
    snap = {0: rec(ident(0), ("bench", "all_reduce 8M"), peer_died(1, "bench"), alive=True),
            1: {**rec(ident(1), ("bench", "all_reduce 8M"), None, alive=True), "exit": exited(-9)}}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    f = only(findings, "comm.rank-died")
    assert f.title == "rank 1 (host a, local rank 1) was killed by SIGKILL during bench all_reduce 8M"
    assert f.data["stage"] == "bench" and f.data["detail"] == "all_reduce 8M" and f.data["signal"] == "SIGKILL"
    assert "last stage entered: bench all_reduce 8M" in f.evidence
    assert rows[1]["detail"] == "was killed by SIGKILL during bench all_reduce 8M"


def test_a_rank_that_exited_with_an_error_code_points_at_its_own_output():
    snap = {0: rec(ident(0), "join", peer_died(1, "join"), alive=True), 1: {**rec(None), "exit": exited(1)}}
    _, findings = judge(snap, "gloo", TIMEOUT)
    f = only(findings, "comm.rank-died")
    assert f.title == "rank 1 exited with code 1 before joining"
    assert f.data["returncode"] == 1 and f.data["signal"] is None
    assert f.fix == ["read rank 1's own output (stderr) for the error it exited with"]


def test_a_native_crash_signal_is_not_blamed_on_the_oom_killer():
    snap = {0: rec(ident(0), "init", peer_died(1, "init"), alive=True),
            1: {**rec(ident(1), ("init", "gloo"), None), "exit": exited(-11)}}
    f = only(judge(snap, "gloo", TIMEOUT)[1], "comm.rank-died")
    assert f.title == "rank 1 (host a, local rank 1) was killed by SIGSEGV during init gloo"
    assert not any("dmesg" in fx for fx in f.fix) and "SIGSEGV" in f.fix[0]


def test_an_exit_after_a_final_status_is_not_a_death():
    """A rank posts its final status before it leaves: its exit record then adds nothing."""
    snap = {0: rec(ident(0), "done", ok_final(), alive=False), 1: {**rec(ident(1), "done", ok_final()),
                                                                    "exit": exited(0)}}
    rows, findings = judge(snap, "gloo", TIMEOUT)
    assert findings == [] and [r["status"] for r in rows] == ["ok", "ok"]


# -- ranks that never joined, as the --local launcher saw them (pid records) -----------------------------------

def started(pid=4242, host="a"):
    """What --local's launcher posts when it starts a rank: the verdict can look at its process before it joins."""
    return {"pid": pid, "host": host}


def join_timeout(missing="1"):
    return broken("join", error=f"ranks {missing} did not join within 30 s of the last rank that did")


def not_joined(state, tracer_pid=0, tracer=None, **extra):
    """A rank with no identity whose process this host looked at (what session.verdict adds to the snapshot)."""
    return {**rec(None), "started": started(), "process": state, "tracer_pid": tracer_pid, "tracer": tracer,
            **extra}


def test_a_rank_stopped_before_joining_is_stuck_not_missing():
    snap = {0: rec(ident(0), "join", join_timeout(), alive=True), 1: not_joined("stopped"),
            2: rec(ident(2), "join", join_timeout(), alive=True)}
    rows, findings = judge(snap, "gloo", TIMEOUT, local=True)
    assert [f.id for f in findings] == ["comm.rank-stuck"]
    f = findings[0]
    assert f.title == "rank 1 is frozen (stopped) before joining"
    assert f.data == {"rank": 1, "stage": None, "detail": None, "process": "stopped", "pid": 4242, "tracer_pid": 0,
                      "tracer": None, "ended_by_launcher": True}
    assert f.evidence[0] == "its launcher started it as process 4242; it never reached the rendezvous store"
    assert "state T in /proc/4242/stat" in f.evidence[1] and "TracerPid 0" in f.evidence[1]
    # not the advice for a rank nobody started: the launcher started it, and it is alive
    assert not any("nc -zv" in fx or "--nproc_per_node" in fx for fx in f.fix)
    assert rows[1] == {"rank": 1, "host": None, "local_rank": None, "device": None, "status": "broken",
                       "stage": None, "detail": "is frozen (stopped) before joining"}
    assert [rows[r]["detail"] for r in (0, 2)] == ["cut short in join by another rank: rank 1 is frozen"] * 2
    # under torchrun or srun nobody posts the pid: the same rank is missing, as before
    snap[1] = rec(None)
    assert [f.id for f in judge(snap, "gloo", TIMEOUT)[1]] == ["comm.rank-missing"]


def test_a_rank_still_running_its_start_when_the_others_gave_up_is_stuck_starting():
    snap = {0: rec(ident(0), "join", join_timeout(), alive=True), 1: not_joined("running")}
    rows, findings = judge(snap, "gloo", TIMEOUT, local=True)
    f = only(findings, "comm.rank-stuck")
    assert [g.id for g in findings if g.severity == "fail"] == ["comm.rank-stuck"]
    assert f.title == "rank 1 is stuck starting (alive and running, it never joined)"
    assert "the others waited 30 s after the last rank that joined" in f.evidence[0]
    assert "alive and running: still in its start" in f.evidence[1]
    assert rows[1]["status"] == "broken" and rows[1]["detail"] == f.title.removeprefix("rank 1 ")
    assert rows[0]["detail"] == "cut short in join by another rank: rank 1 is stuck starting"


def test_a_rank_still_starting_when_another_fault_ended_the_check_is_not_blamed():
    """Rank 2 died at once; rank 1 was still importing torch: the verdict came before it could join."""
    snap = {0: rec(ident(0), "join", peer_died(2, "join"), alive=True), 1: not_joined("running"),
            2: {**rec(None), "exit": exited(-9), "started": started(5000)}}
    rows, findings = judge(snap, "gloo", TIMEOUT, local=True)
    assert [(f.id, f.data["rank"]) for f in findings] == [("comm.rank-died", 2)]
    assert rows[1]["status"] == "missing" and rows[1]["detail"] == ("still starting when the check ended (its "
                                                                    "process runs)")


def test_a_rank_whose_process_ended_before_joining_without_a_record_died():
    snap = {0: rec(ident(0), "join", join_timeout(), alive=True), 1: not_joined("gone", tracer_pid=None)}
    rows, findings = judge(snap, "gloo", TIMEOUT, local=True)
    f = only(findings, "comm.rank-died")
    assert f.title == "rank 1 died before joining" and rows[1]["detail"] == "died before joining"
    assert f.evidence[0].startswith("its launcher started it as process 4242, which has ended")


# -- a stuck rank under --local: the launcher ends it after the verdict ------------------------------------------

@pytest.mark.parametrize("tracer_pid, tracer, evidence, cause", [
    (0, None, "TracerPid 0 in /proc/4242/status: no debugger held it",
     "no debugger held it: find what sent it SIGSTOP"),
    (777, "gdb", "TracerPid 777 (gdb) in /proc/4242/status: a debugger held it", "a debugger (gdb 777) held it"),
    (None, None, "SIGSTOP, Ctrl-Z, a debugger", "it could not be read here"),
])
def test_a_stopped_rank_under_local_is_described_as_it_was_not_as_a_live_pid(tracer_pid, tracer, evidence, cause):
    frozen = {**rec(ident(1, pid=4242), ("bench", "all_reduce 8M"), None, alive=False), "process": "stopped",
              "tracer_pid": tracer_pid, "tracer": tracer}
    snap = {0: rec(ident(0), ("bench", "all_reduce 8M"), broken("bench"), alive=True), 1: frozen}
    _, findings = judge(snap, "gloo", 5, local=True)
    f = only(findings, "comm.rank-stuck")
    assert f.data["tracer_pid"] == tracer_pid and f.data["tracer"] == tracer and f.data["ended_by_launcher"] is True
    assert any(evidence in e and "process 4242 on host a was, when this verdict was made, alive but stopped" in e
               for e in f.evidence), f.evidence
    assert any("ends it (SIGKILL) right after this verdict" in e and "process 4242 is gone by the time you read this"
               in e for e in f.evidence), f.evidence
    # pid 4242 is gone when the user reads this: no command aimed at it
    assert not any("4242" in fx for fx in f.fix), f.fix
    assert cause in f.fix[0]
    assert "before the verdict" in f.fix[1] and "--timeout (5 s)" in f.fix[1] and "torchrun" in f.fix[1]
    assert "py-spy dump --pid <pid>" in f.fix[1] and "TracerPid" in f.fix[1]
    # the same rank under torchrun or srun still exists: the live-process advice
    _, findings = judge(snap, "gloo", 5)
    f = only(findings, "comm.rank-stuck")
    assert any("py-spy dump --pid 4242" in fx for fx in f.fix) and any("kill -CONT 4242" in fx for fx in f.fix)
    assert f.data["ended_by_launcher"] is False and not any("gone by the time" in e for e in f.evidence)
    assert any("process 4242 on host a is alive but stopped" in e for e in f.evidence)


def test_a_hung_running_rank_under_local_is_ended_too_and_the_fix_says_how_to_look_next_time():
    hung = {**rec(ident(1, pid=4242), ("all_reduce", ""), None, alive=False), "process": "running",
            "tracer_pid": 0, "tracer": None}
    snap = {0: rec(ident(0), "all_reduce", broken("all_reduce"), alive=True), 1: hung}
    f = only(judge(snap, "gloo", TIMEOUT, local=True)[1], "comm.rank-stuck")
    assert any("a few seconds after this verdict" in e and "process 4242 is gone" in e for e in f.evidence)
    assert not any("4242" in fx for fx in f.fix) and "py-spy dump --native --pid <pid>" in f.fix[0]


# -- a signal --local's launcher received from outside -------------------------------------------------------

def terminated_at(stage, detail=""):
    return broken(stage, kind="terminated", detail=detail,
                  error="stopped from outside (SIGTERM to torchdoctor comm --local, passed on to every rank)")


def test_sigterm_to_the_local_launcher_is_stopped_from_outside_not_a_failure():
    snap = {r: rec(ident(r), ("bench", "all_reduce 8M"), terminated_at("bench", "all_reduce 8M"), alive=True)
            for r in range(3)}
    rows, findings = judge(snap, "gloo", 10, stopped_by="SIGTERM", local=True)
    assert [f.id for f in findings] == ["comm.terminated"]
    f = findings[0]
    assert f.severity == "skip" and worst(findings) != "fail"
    assert f.title == ("stopped from outside (SIGTERM to torchdoctor comm: `timeout`, `kill`, a scheduler) during "
                       "bench all_reduce 8M: the stages after it were not checked")
    assert f.data == {"ranks": [0, 1, 2], "signal": "SIGTERM"}
    assert "no rank died, hung or failed on its own before it" in f.evidence
    text = " ".join(f.fix + f.evidence)
    assert "sacct" not in text and "SLURM" not in text and "first process that failed" not in text
    assert "launchers stop every rank" not in text
    assert [(r["status"], r["detail"]) for r in rows] == [
        ("interrupted", "stopped from outside (SIGTERM) in bench all_reduce 8M")] * 3
    # inside a SLURM job its time limit or scancel is a likely sender: named with the job's id
    _, findings = judge(snap, "gloo", 10, stopped_by="SIGTERM", local=True, slurm_job="4321")
    assert any("sacct -j 4321" in fx for fx in findings[0].fix)
    # under torchrun or srun (no launcher record) the SIGTERM came from the agent: today's wording
    rows, findings = judge(snap, "gloo", 10)
    assert findings[0].severity == "fail" and "sacct" in findings[0].fix[0]


def test_sigterm_while_the_ranks_start_blames_none_of_them():
    """Ranks still importing torch are killed by the launcher on the signal; their exit records say so."""
    snap = {0: {**rec(None), "exit": {**exited(-9), "on_signal": "SIGTERM"}, "started": started(5000)},
            1: {**rec(None), "exit": {**exited(-15, pid=5001), "on_signal": "SIGTERM"}}, 2: rec(None)}
    rows, findings = judge(snap, "gloo", TIMEOUT, stopped_by="SIGTERM", local=True)
    assert [(f.id, f.severity) for f in findings] == [("comm.terminated", "skip")]
    assert findings[0].title.endswith("before any rank joined: nothing was checked")
    assert [(r["status"], r["detail"]) for r in rows] == [
        ("interrupted", "stopped from outside (SIGTERM) before joining")] * 3


def test_a_rank_that_saw_a_peer_end_on_the_signal_ended_on_it_too():
    snap = {0: rec(ident(0), "join", peer_died(1, "join"), alive=True),
            1: {**rec(None), "exit": {**exited(-9), "on_signal": "SIGTERM"}}}
    rows, findings = judge(snap, "gloo", TIMEOUT, stopped_by="SIGTERM", local=True)
    assert [f.id for f in findings] == ["comm.terminated"] and findings[0].severity == "skip"
    assert [r["status"] for r in rows] == ["interrupted", "interrupted"]


def test_a_death_before_the_sigterm_is_still_the_fault():
    snap = {0: rec(ident(0), "all_reduce", terminated_at("all_reduce"), alive=True),
            1: {**rec(ident(1), "all_reduce", None), "exit": exited(-9)}}
    rows, findings = judge(snap, "gloo", TIMEOUT, stopped_by="SIGTERM", local=True)
    assert [(f.id, f.severity) for f in findings] == [("comm.rank-died", "fail"), ("comm.terminated", "skip")]
    assert "no rank died, hung or failed on its own before it" not in findings[1].evidence
    assert rows[1]["detail"] == "was killed by SIGKILL during all_reduce" and rows[0]["status"] == "interrupted"


def test_sighup_to_the_local_launcher_names_the_terminal():
    snap = {r: rec(ident(r), "ring", terminated_at("ring"), alive=True) for r in range(2)}
    _, findings = judge(snap, "gloo", TIMEOUT, stopped_by="SIGHUP", local=True)
    f = only(findings, "comm.terminated")
    assert f.severity == "skip" and "SIGHUP to torchdoctor comm: its terminal closed" in f.title
    assert any("nohup" in fx for fx in f.fix)


def test_a_sigterm_sent_to_a_local_rank_itself_is_not_a_scheduler():
    """Under --local the launcher passed nothing on: the signal reached that rank's process directly."""
    snap = {0: rec(ident(0), ("bench", "all_reduce 8M"), broken("bench", detail="all_reduce 8M"), alive=True),
            1: rec(ident(1), ("bench", "all_reduce 8M"), broken("bench", kind="terminated", detail="all_reduce 8M"))}
    rows, findings = judge(snap, "gloo", TIMEOUT, local=True)
    f = only(findings, "comm.terminated")
    assert f.severity == "fail" and f.data == {"ranks": [1]}
    assert f.fix[0].startswith("a SIGTERM reached rank 1 directly, not through torchdoctor comm --local")
    assert not any("sacct" in fx or "scheduler" in fx for fx in f.fix)
    assert rows[0] == {**rows[0], "status": "ok", "detail": "cut short in bench by another rank"}

"""Ranks that die at a known stage (real processes, gloo): named at once, with their signal and their stage.

The deaths are injected with ``TORCHDOCTOR_COMM_TEST_DIE=RANK:STAGE[:SECONDS]``, read only by the rank's
session: the rank SIGKILLs itself, a real death no outside kill could time to a stage. Each check runs with
``--timeout 60`` and asserts the verdict came in under half of it: the behaviour asked for is "at once, from what
the launcher saw", against the old "never joined" after the whole timeout (not a speed threshold).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from test_comm_processes import COMM, _env, rank_processes, the_json
from torchdoctor.comm.session import TEST_DIE_ENV, injected_death

TIMEOUT = 60


def local(n: int, die: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *COMM, "--local", str(n), "--json", "--timeout", str(TIMEOUT), *args],
                          capture_output=True, text=True, timeout=3 * TIMEOUT, env=_env(**{TEST_DIE_ENV: die}))
    return proc, time.monotonic() - t0


def died(out: dict) -> list[dict]:
    return [f for f in out["findings"] if f["id"] == "comm.rank-died"]


def test_injected_death_spec():
    assert injected_death("1:connect", 1) == ("connect", 0.0)
    assert injected_death("0:bench all_reduce 8M:1.5", 0) == ("bench all_reduce 8M", 1.5)
    assert injected_death("1:connect", 0) is None
    assert injected_death(None, 0) is None and injected_death("", 0) is None
    with pytest.raises(ValueError, match="RANK:STAGE"):
        injected_death("connect", 0)


def test_local_rank_killed_before_joining_is_named_at_once_with_its_signal():
    proc, elapsed = local(3, "1:connect")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert elapsed < TIMEOUT / 2, elapsed
    out = the_json(proc.stdout)
    assert [f["id"] for f in out["findings"] if f["severity"] == "fail"] == ["comm.rank-died"]
    f = died(out)[0]
    assert f["title"] == "rank 1 was killed by SIGKILL before joining"
    assert f["data"]["rank"] == 1 and f["data"]["signal"] == "SIGKILL" and f["data"]["returncode"] == -9
    assert "comm.rank-missing" not in {g["id"] for g in out["findings"]}
    by_rank = {r["rank"]: r for r in out["ranks"]}
    assert by_rank[1]["status"] == "broken" and by_rank[1]["detail"] == "was killed by SIGKILL before joining"
    for r in (0, 2):
        assert by_rank[r]["status"] == "ok"
        assert by_rank[r]["detail"] == "cut short in join by another rank: rank 1 was killed by SIGKILL"


def test_local_rank_killed_while_its_peer_waits_in_init_is_named_at_once():
    """gloo's init waits on the store for the peer: nothing errors, only the launcher's word ends the wait."""
    proc, elapsed = local(2, "1:init")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert elapsed < TIMEOUT / 2, elapsed
    out = the_json(proc.stdout)
    f = died(out)[0]
    assert f["title"] == "rank 1 (host {}, local rank 1) was killed by SIGKILL during init gloo".format(
        out["ranks"][1]["host"])
    assert (f["data"]["stage"], f["data"]["signal"]) == ("init", "SIGKILL")
    assert out["ranks"][0]["status"] == "ok" and out["ranks"][0]["stage"] == "init"


def test_local_rank_killed_mid_benchmark_names_signal_and_item():
    proc, elapsed = local(2, "1:bench all_reduce 8M:1", "--bench", "--sizes", "8M", "--iters", "100000")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert elapsed < TIMEOUT / 2, elapsed
    out = the_json(proc.stdout)
    f = died(out)[0]
    assert f["title"].endswith("was killed by SIGKILL during bench all_reduce 8M")
    assert f["data"] == {**f["data"], "rank": 1, "stage": "bench", "detail": "all_reduce 8M", "signal": "SIGKILL"}
    assert out["ranks"][1]["detail"] == "was killed by SIGKILL during bench all_reduce 8M"


def test_store_host_rank0_killed_mid_benchmark_without_a_launcher_reports_its_stage():
    """Plain RANK/WORLD_SIZE launch (as srun): rank 0 hosts the store, which dies with it; the survivor read rank
    0's stage while it could."""
    t0 = time.monotonic()
    procs = rank_processes(2, "--json", "--timeout", str(TIMEOUT), "--bench", "--sizes", "8M", "--iters", "100000",
                           extra_env={TEST_DIE_ENV: "0:bench all_reduce 8M:1"})
    outs = {r: p.communicate(timeout=3 * TIMEOUT) for r, p in procs.items()}
    elapsed = time.monotonic() - t0
    assert procs[0].returncode == -9 and procs[1].returncode == 1, outs[1][1][-2000:]
    assert elapsed < TIMEOUT / 2, elapsed
    out = the_json(outs[1][0])  # the survivor's own verdict: no store is left to elect one reporter
    f = died(out)[0]
    assert f["data"]["rank"] == 0 and f["data"]["stage"] == "bench" and f["data"]["detail"] == "all_reduce 8M"
    assert f["title"].endswith("which hosts the rendezvous store, died or became unreachable during bench "
                               "all_reduce 8M")
    rows = {r["rank"]: r for r in out["ranks"]}
    assert rows[0]["detail"] == "died during bench all_reduce 8M"
    assert "join" not in rows[0]["detail"] and rows[1]["status"] == "ok"

"""``torchdoctor comm --pairs``: every pair of ranks measured once per direction in rounds of disjoint pairs; real
ranks on gloo, one made slow by an injected delay (``TORCHDOCTOR_COMM_TEST_SLOW``), one killed mid-round."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_comm_processes import COMM, _env, the_json
from torchdoctor.comm.pairs import TEST_SLOW_ENV, Link, findings, schedule
from torchdoctor.comm.session import TEST_DIE_ENV

TIMEOUT = 60


def local(n: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *COMM, "--local", str(n), "--json", "--timeout", str(TIMEOUT), "--pairs",
                           "--pair-size", "1M", *args], capture_output=True, text=True, timeout=3 * TIMEOUT,
                          env=_env(**env))


@pytest.mark.parametrize("n", range(2, 10))
def test_the_rounds_pair_every_rank_with_every_other_once_each_rank_once_a_round(n):
    rounds = schedule(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))


def test_every_link_is_measured_and_a_slow_rank_is_named():
    proc = local(4, **{TEST_SLOW_ENV: "2:0.05"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = the_json(proc.stdout)
    links = out["pairs"]["links"]
    assert sorted((x["src"], x["dst"]) for x in links) == [(s, d) for s in range(4) for d in range(4) if s != d]
    assert {x["kind"] for x in links} == {"same host"}
    [slow] = [f for f in out["findings"] if f["id"] == "comm.slow-rank"]
    assert slow["data"]["rank"] == 2 and slow["severity"] == "warn"
    assert {(x["src"], x["dst"]) for x in slow["data"]["links"]} == {(2, 0), (2, 1), (2, 3), (0, 2), (1, 2), (3, 2)}
    assert "comm.slow-link" not in {f["id"] for f in out["findings"]}  # the rank, not six separate links
    assert proc.stderr.count("[pairs] round") == 3  # progress per round (rank 0's)


def test_a_rank_killed_mid_round_is_named_with_its_round_and_pair():
    proc = local(4, **{TEST_DIE_ENV: "2:pairs round 2/3"})
    assert proc.returncode == 1
    out = the_json(proc.stdout)
    [died] = [f for f in out["findings"] if f["id"] == "comm.rank-died"]
    assert died["data"]["rank"] == 2 and died["data"]["stage"] == "pairs"
    assert died["data"]["detail"].startswith("round 2/3 (")


def link(src: int, dst: int, gbps: float, kind: str = "other host") -> Link:
    return Link(src, dst, gbps, 1 / gbps, kind, f"node{src // 2}", f"node{dst // 2}", f"cuda:{src % 2}",
                f"cuda:{dst % 2}")


def test_one_slow_link_is_named_with_its_hosts_and_devices_and_classes_are_judged_apart():
    links = [link(s, d, 10.0) for s in range(4) for d in range(4) if s != d and s // 2 != d // 2]
    links += [link(s, d, 100.0, "NVLink") for s in range(4) for d in range(4) if s != d and s // 2 == d // 2]
    links[links.index(link(0, 3, 10.0))] = link(0, 3, 3.0)  # one direction of one cable
    found = {f.id: f for f in findings(links)}
    assert set(found) == {"comm.slow-link"}  # NVLink's 100 GB/s does not make the network links slow
    assert "0->3 (node0 cuda:0 -> node1 cuda:1) 3 GB/s" in found["comm.slow-link"].title


def test_a_pair_option_alone_turns_pairs_on_and_the_matrix_columns_never_touch():
    proc = subprocess.run([sys.executable, *COMM, "--local", "2", "--timeout", str(TIMEOUT), "--pair-iters", "1",
                           "--pair-size", "64K"], capture_output=True, text=True, timeout=3 * TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = proc.stdout.split("row sends to column:\n")[1].splitlines()[1:3]
    assert [row.split()[:2] for row in rows][0][1] == "-" and len(rows[0].split()) == 3  # "0  -  x.xx"


def test_bad_pair_options_are_usage_errors():
    for args, says in ((["--pair-size", "1M,2M"], "--pair-size takes one size"),
                       (["--pair-iters", "0"], "--pair-iters must be at least 1"),
                       (["--pair-size", "lots"], "--pair-size:"),
                       (["--pair-size", "1K"], "--pair-size must be from 64K"),
                       (["--pair-size", "100G"], "--pair-size must be from 64K")):
        proc = subprocess.run([sys.executable, *COMM, "--local", "2", "--pairs", *args], capture_output=True,
                              text=True, timeout=60, env=_env())
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr

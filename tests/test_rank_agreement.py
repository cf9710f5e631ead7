"""Ranks decide alike or one of them hangs: raise vs record under a loss scaler, the eager re-run of a compiled
block that communicates, the weight check at attach under sharding (2 real ranks, tests/agreement_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import torchrun

HERE = Path(__file__).parent


def run(tmp_path: Path, mode: str) -> dict[int, dict]:
    torchrun("agreement_worker.py", str(tmp_path), mode, timeout=240)
    return {r: json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)}


def test_a_forward_inf_under_a_loss_scaler_stops_every_rank(tmp_path):
    r = run(tmp_path, "scaler-fwd")
    assert r[0]["error"]["first"]["phase"] == "fwd" and r[0]["error"]["bad_ranks"] == []
    # rank 1 saw only the inf gradients DDP brought it: not an overflow to skip, since rank 0's forward broke
    assert r[1]["error"]["bad_ranks"] == [0] and r[1]["overflows"] == []
    assert r[0]["steps"] == r[1]["steps"] == 2


def test_a_backward_overflow_on_one_rank_is_skipped_by_every_rank(tmp_path):
    r = run(tmp_path, "scaler-bwd")
    for rank in (0, 1):
        assert r[rank]["error"] is None and r[rank]["steps"] == 5
        assert [step for step, _ in r[rank]["overflows"]] == [1, 2]
    assert r[0]["overflows"] == r[1]["overflows"]


def test_an_invalid_op_behind_a_scalers_overflow_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1's backward makes a nan that fp32 without the loss scale makes too: rank 1 names it as an invalid op
    (the scaler would skip every step) and rank 0, whose own replay has nothing to show, raises with it -- the
    ranks never part (one raising while the other steps into its next collective)."""
    r = run(tmp_path, "scaler-invalid")
    assert r[1]["error"]["cause"] == "numerics.invalid_op" and r[1]["error"]["first"]["module"] == "1"
    assert r[0]["error"]["bad_ranks"] == [1] and r[0]["error"]["cause"] == "numerics.other_rank"
    assert r[0]["steps"] == r[1]["steps"] == 1 and r[0]["overflows"] == r[1]["overflows"] == []


def test_a_rerun_never_makes_a_collective_alone(tmp_path):
    r = run(tmp_path, "compiled-collective")
    bad, good = r[1]["error"], r[0]["error"]
    assert bad["first"]["module"] == "1" and any("stopped before a collective" in n for n in bad["notes"])
    assert good["bad_ranks"] == [1]
    assert r[0]["steps"] == r[1]["steps"] == 1


def test_sharded_weights_broken_on_one_rank_are_refused_on_every_rank(tmp_path):
    r = run(tmp_path, "attach-nan")
    assert r[1]["error"]["first"]["module"] == "0" and r[1]["error"]["first"]["slot"] == "weight"
    assert r[0]["error"]["first"] is None and r[0]["error"]["bad_ranks"] == [1]


def test_an_inf_in_one_ranks_weight_shard_is_named_by_every_rank(tmp_path):
    """FSDP2 gathers the weight for the forward, so every rank's output goes inf at the same module: the rank whose
    own shard holds the inf is the origin, and the other names it (not a generic overflow of its own)."""
    r = run(tmp_path, "weight-inf")
    assert (r[1]["error"]["first"]["module"], r[1]["error"]["cause"]) == ("2", "numerics.bad_weight")
    assert r[1]["error"]["bad_ranks"] == []
    assert r[0]["error"]["bad_ranks"] == [1] and r[0]["error"]["cause"] == "numerics.other_rank"
    assert "rank(s) [1]" in r[0]["error"]["diagnosis"] and "fp32's range" not in r[0]["error"]["diagnosis"]
    assert r[0]["steps"] == r[1]["steps"] == 1


def test_one_ranks_own_evaluation_needs_no_collective(tmp_path):
    r = run(tmp_path, "eval-one-rank")
    assert r[0]["error"]["first"]["phase"] == "fwd" and r[0]["error"]["bad_ranks"] == []
    assert r[1]["error"]["first"] is None and r[1]["error"]["bad_ranks"] == [0]
    assert r[0]["steps"] == r[1]["steps"]

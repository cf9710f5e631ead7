"""DDP with 2 real ranks on gloo under torchrun: every rank stops together, rank named everywhere."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import torchrun

HERE = Path(__file__).parent


def run_workers(tmp_path, mode: str) -> dict[int, dict]:
    torchrun("ddp_worker.py", str(tmp_path), mode, timeout=180)
    return {r: json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in (0, 1)}


def test_ddp_two_ranks_stop_together_and_name_the_bad_rank(tmp_path):
    results = run_workers(tmp_path, "train")
    assert set(results) == {0, 1}
    bad, good = results[1], results[0]
    # the rank with the inf names it; the other rank stops at the same step instead of hanging
    assert bad["error"]["first"]["phase"] == "fwd" and bad["error"]["first"]["step"] == 2
    assert bad["error"]["first"]["module"] == "0" and bad["error"]["first"]["slot"] == "output"
    # rank 0's forward was finite; the inf reached its gradients through DDP's all-reduce
    assert good["error"]["first"]["phase"] == "bwd"
    assert "rank(s) [1] produced non-finite activations" in good["error"]["report"]
    assert bad["steps"] == good["steps"] == 2
    assert all(line.startswith("[rank1] ") for line in bad["error"]["report"].splitlines())
    assert "check the data" in bad["error"]["report"]
    for rank in (0, 1):
        assert (tmp_path / f"torchdoctor-nonfinite-rank{rank}.txt").read_text().startswith(f"[rank{rank}] ")
        assert (tmp_path / f"torchdoctor-nonfinite-rank{rank}.json").exists()


def test_ddp_a_backward_fault_on_one_rank_is_named_there_by_every_rank(tmp_path):
    """Rank 1's batch makes sqrt's backward inf; after DDP's all-reduce both ranks hold inf gradients. Each replays
    its own micro-batch: rank 1's reproduces and names the module, rank 0's does not -- so rank 0 names rank 1
    (not itself, and not a transient of its own device)."""
    results = run_workers(tmp_path, "backward")
    bad, good = results[1], results[0]
    assert (bad["error"]["first"]["phase"], bad["error"]["first"]["module"], bad["error"]["first"]["slot"]) == (
        "bwd", "1", "grad_input")
    assert bad["error"]["replay"] == "reproduced" and bad["error"]["bad_ranks"] == []
    assert good["error"]["bad_ranks"] == [1] and "rank(s) [1]" in good["error"]["report"]
    assert "transient" not in good["error"]["report"].split("Replay:")[0]
    assert bad["steps"] == good["steps"] == 2
    assert bad["identical"] and good["identical"]


def test_ddp_a_transient_fault_on_one_rank_is_skipped_by_every_rank_alike(tmp_path):
    """transient='skip' under DDP: rank 1's inf does not come back when replayed, rank 0's reduced gradients do not
    reproduce on its own batch either -- no rank's replay reproduced, so every rank refuses that one step and the
    run goes on to the end, the ranks' weights still equal."""
    results = run_workers(tmp_path, "transient")
    for rank in (0, 1):
        assert results[rank]["error"] is None and results[rank]["steps"] == 5  # every try counts, the refused one too
        assert results[rank]["ranks_agree"]
    assert results[1]["transients"] == [[2, "not reproduced", []]]
    assert results[0]["transients"] == [[2, "not reproduced", [1]]]
    assert (tmp_path / "torchdoctor-transient-rank1.txt").exists()


def test_ddp_a_bad_evaluation_forward_on_one_rank_stops_both_at_the_next_step(tmp_path):
    results = run_workers(tmp_path, "eval")
    bad, good = results[1], results[0]
    assert bad["error"]["first"]["phase"] == "fwd"
    assert "torch.no_grad()" in bad["error"]["report"]
    assert good["error"]["first"] is None and "rank(s) [1]" in good["error"]["report"]
    assert bad["steps"] == good["steps"] == 2  # both stopped at the same step instead of hanging


def test_accelerate_prepared_model_and_optimizer_are_looked_through(tmp_path):
    results = run_workers(tmp_path, "accelerate")
    bad, good = results[1], results[0]
    assert bad["wrapped"] == "DistributedDataParallel" and bad["optimizer"] == "AcceleratedOptimizer"
    assert bad["error"]["first"]["module"] == "0" and bad["error"]["first"]["phase"] == "fwd"
    assert "rank(s) [1] produced non-finite activations" in good["error"]["report"]
    assert bad["steps"] == good["steps"] == 2
    assert bad["identical"] and good["identical"]  # the step was checked inside AcceleratedOptimizer.step

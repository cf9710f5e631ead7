"""The monitor on FSDP2, FSDP1 and tensor parallelism: 2 real ranks on gloo under torchrun (tests/fsdp_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import torchrun

HERE = Path(__file__).parent
LEVELS = ("none", "params", "modules")
USER_NAMES = ["", "blocks", "blocks.0", "blocks.0.act", "blocks.0.fc1", "blocks.0.fc2", "blocks.1", "blocks.1.act",
              "blocks.1.fc1", "blocks.1.fc2", "inp", "norm", "out"]


def run(tmp_path: Path, wrap: str) -> dict[int, dict]:
    torchrun("fsdp_worker.py", str(tmp_path), wrap)
    return {r: json.loads((tmp_path / f"{wrap}-rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.parametrize("wrap", ["fsdp2", "fsdp2mp", "fsdp1", "tp"])
def test_rank_one_nan_stops_both_ranks_before_the_update_at_every_level(tmp_path, wrap):
    results = run(tmp_path, wrap)
    for rank, by_level in results.items():
        for grads in LEVELS:
            res = by_level[grads]
            assert res["clean_steps"] == 2, (rank, grads)  # clean steps: no crash, no false alarm
            assert res["extra_syncs"] <= 1, (rank, grads, res["extra_syncs"])
            assert res["error"] is not None, (rank, grads)
            assert res["identical"], (rank, grads)  # parameters and optimizer state untouched, on both ranks
            assert res["steps"] == 2, (rank, grads)  # both stopped at the same step
            # the user's names and classes: no _fsdp_wrapped_module, no FSDP<Class>
            assert res["names"] == USER_NAMES, (rank, grads)
            assert res["classes"] == ["Block", "GELU", "LayerNorm", "Linear", "ModuleList", "Net"]
    for grads in LEVELS:
        bad, good = results[1][grads]["error"], results[0][grads]["error"]
        assert bad["first"] == {"step": 2, "phase": "fwd", "module": "inp", "cls": "Linear", "slot": "output",
                                "value": "nan"}
        assert bad["bad_ranks"] == [] and "check the data" in bad["report"]
        assert good["bad_ranks"] == [1], grads  # rank 0 names rank 1 as where it started
        if wrap == "tp":  # the nan reached rank 0 in the forward, through the row-parallel all-reduce
            assert good["first"]["module"] == "blocks.0.fc2" and good["first"]["phase"] == "fwd"
            assert "rank(s) [1] went non-finite earlier in this step" in good["report"]
        elif grads == "none":
            assert good["first"] is None and "rank(s) [1] found non-finite values" in good["report"]
        else:  # ... or in the backward, through the gradient reduce-scatter
            assert good["first"]["phase"] == "bwd" and good["first"]["slot"].startswith("grad:")
            assert "rank(s) [1] produced non-finite activations" in good["report"]
        for rank in (0, 1):
            text = (tmp_path / f"{wrap}-{grads}" / f"torchdoctor-nonfinite-rank{rank}.txt").read_text()
            assert text.startswith(f"[rank{rank}] ")
            assert "_fsdp" not in text and "FSDPBlock" not in text and "_orig_mod" not in text
    # weight lines say what they cover: this rank's shard (FSDP), or nothing where it holds none (FSDP1)
    report = results[1]["params"]["error"]["report"]
    if wrap == "tp":  # column-parallel fc1 is sharded; row-parallel fc2's bias is a whole replica
        fc2 = report[report.rindex("fwd   blocks.0.fc2 Linear"):]
        assert "weight (local shard)" in fc2 and "fwd   bias\n" in fc2
    elif wrap == "fsdp1":
        assert "weight (local shard)" in report or "on other ranks fwd   weight" in report
    else:
        assert "fwd   weight (local shard)" in report


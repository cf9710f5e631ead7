"""The monitor on real DeepSpeed engines on CPU: ZeRO 0-3, fp32 and bf16, 1 and 2 ranks, the loss scaler, the
HF Trainer with a DeepSpeed config (tests/ds_worker.py does the training; this file judges what it saw).

DeepSpeed JIT-builds a small shared-memory comm op with gcc the first time a process initialises it on CPU
(about a minute on 2 cores, cached in ~/.cache/torch_extensions): the fixture below builds it once per run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ds_single_env, free_port, torchrun

pytest.importorskip("deepspeed")

HERE = Path(__file__).parent
ENGINE_CASES = [f"z{stage}-{dtype}" for stage in range(4) for dtype in ("fp32", "bf16")]
OPTIMIZERS = {"z0-fp32": "AdamW", "z0-bf16": "FP16_UnfusedOptimizer", "z1": "DeepSpeedZeroOptimizer",
              "z2": "DeepSpeedZeroOptimizer", "z3": "DeepSpeedZeroOptimizer_Stage3"}


def _load(out: Path, cases: list[str], ranks: tuple[int, ...]) -> dict:
    results = {}
    for case in cases:
        for r in ranks:
            data = json.loads((out / f"{case}-rank{r}.json").read_text())
            assert "crash" not in data, data.get("crash")
            results[(case, r)] = data
    return results


@pytest.fixture(scope="module")
def one_rank(deepspeed_built, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ds1")
    cases = [*ENGINE_CASES, "scaler", "scaler-passed", "accumulation", "standalone-scaler", "hf"]
    proc = subprocess.run([sys.executable, str(HERE / "ds_worker.py"), str(out), *cases],
                          env=ds_single_env(free_port()), capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _load(out, cases, (0,))


@pytest.fixture(scope="module")
def two_ranks(deepspeed_built, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ds2")
    cases = ["z2-fp32", "z2-bf16", "z3-fp32", "z3-bf16", "scaler"]
    torchrun("ds_worker.py", str(out), *cases, timeout=600, DS_ACCELERATOR="cpu")
    return _load(out, cases, (0, 1))


def _detections(result: dict) -> dict[str, dict]:
    return {k: v for k, v in result.items() if k.startswith(("forward-", "backward-"))}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_every_zero_stage_is_checked_before_deepspeed_applies_the_step(one_rank, case):
    result = one_rank[(case, 0)]
    assert result["clean_steps"] == 2 and result["extra_syncs"] <= 1
    stage = case.split("-")[0]
    for name, det in _detections(result).items():
        assert det["engine"] == "deepspeed"
        assert det["optimizer"] == (OPTIMIZERS[case] if case in OPTIMIZERS else OPTIMIZERS[stage]), name
        assert det["names"] == ["", "act", "boom", "hidden", "inp", "out"], name  # no "module." prefix
        assert det["error"] is not None, name
        assert det["identical"] and not det["optimizer_stepped"], name  # weights, masters, state untouched
        first = det["error"]["first"]
        if name.startswith("forward"):
            assert (first["module"], first["phase"], first["slot"], first["value"]) == ("inp", "fwd", "output", "inf")
        elif name == "backward-params":  # the replay from the gradient at the model's output names the module (also
            # under ZeRO-3 on one rank, watched every module at grads="params": a backward fault is replayed there too)
            assert (first["module"], first["cls"], first["slot"]) == ("boom", "Boom", "grad_input")
        else:  # (ZeRO-3 hands every module fresh input tensors, so boom's input is not act's output tensor; it
            # holds its values, which names boom all the same: consumers.consumer_of)
            assert (first["module"], first["cls"], first["slot"]) == ("boom", "Boom", "grad_input")


def test_zero3_weights_are_measured_while_gathered(one_rank):
    for case in ("z3-fp32", "z3-bf16"):
        assert one_rank[(case, 0)]["zero3_weights"] == ["weight=measured", "bias=measured"] * 2
        report = one_rank[(case, 0)]["forward-params"]["error"]["report"]
        hidden = report[report.index("fwd   hidden Linear"):]
        assert "empty" not in report and hidden.split("\n")[1].endswith("fwd   weight")


@pytest.mark.parametrize("case", ["z2-fp32", "z2-bf16", "z3-fp32", "z3-bf16"])
def test_two_ranks_stop_together_and_the_bad_rank_is_named(two_ranks, case):
    bad, good = two_ranks[(case, 1)], two_ranks[(case, 0)]
    for name in _detections(bad):
        assert bad[name]["identical"] and good[name]["identical"], name
        assert not bad[name]["optimizer_stepped"] and not good[name]["optimizer_stepped"], name
        assert bad[name]["steps"] == good[name]["steps"] == 1, name
        assert bad[name]["error"]["first"] is not None and bad[name]["error"]["bad_ranks"] == []
        # rank 0's own gradients were finite before DeepSpeed reduced them: it says rank 1 found it
        assert good[name]["error"]["bad_ranks"] == [1], name
        assert "[rank0] Stopped at step 1: rank(s) [1] found non-finite values" in good[name]["error"]["report"]
    assert good["extra_syncs"] <= 1 and bad["extra_syncs"] <= 1


@pytest.mark.parametrize("case", ["scaler", "scaler-passed"])
def test_deepspeeds_dynamic_loss_scaler_skips_are_recorded_until_the_scale_collapses(one_rank, case):
    r = one_rank[(case, 0)]
    # two overflowing steps: DeepSpeed skipped them (nothing changed), the monitor recorded them with the scale
    assert [(o[0], o[1]) for o in r["overflows"]] == [(1, 16.0), (2, 8.0)]
    assert r["skipped_identical"] and r["recovered_step_applied"] and r["scale_after"] == 4.0
    # then every step overflows: stopped at DeepSpeed's floor, before DeepSpeed's own "cannot decrease" exception
    assert r["overflow_scales"] == [16.0, 8.0, 4.0, 2.0, 1.0] and r["final_scale"] == 1.0
    err = r["error"]
    assert "other" not in err and err["first"]["module"] == "boom"
    assert "the loss scale collapsed to 1 (DeepSpeed's minimum, min_loss_scale=1)" in err["report"]
    assert '"bf16": {"enabled": true}' in err["fix"] and "initial_scale_power" in err["fix"]
    assert "keep_fp32(model, 'boom')" in err["fix"]


def test_a_deepspeed_loss_scaler_passed_by_hand_is_hooked_like_gradscaler(one_rank):
    r = one_rank[("standalone-scaler", 0)]
    assert r["overflow_scales"] == [8.0, 4.0, 2.0, 1.0]
    assert r["error"]["first"]["module"] == "boom" and "collapsed to 1" in r["error"]["report"]


def test_hf_trainer_with_a_deepspeed_config(one_rank):
    r = one_rank[("hf", 0)]
    assert r["clean"] == {"steps": 3, "engine": "deepspeed", "optimizer": "DeepSpeedZeroOptimizer"}
    first = r["error"]["first"]
    assert (first["module"], first["value"], first["step"]) == ("transformer.ln_f", "nan", 0)
    assert r["identical"]  # stopped before DeepSpeed applied the step


def test_an_overflow_on_one_rank_is_skipped_and_recorded_by_both(two_ranks):
    bad, good = two_ranks[("scaler", 1)], two_ranks[("scaler", 0)]
    for r in (bad, good):
        assert [(o[0], o[1]) for o in r["overflows"]] == [(1, 16.0), (2, 8.0)]
        assert r["skipped_identical"] and r["recovered_step_applied"]
        assert r["overflow_scales"] == [16.0, 8.0, 4.0, 2.0, 1.0] and "other" not in r["error"]
    assert bad["error"]["first"]["module"] == "boom" and good["error"]["bad_ranks"] == [1]


def test_gradient_accumulation_counts_deepspeeds_steps(one_rank):
    r = one_rank[("accumulation", 0)]
    assert r["clean"] == [2, 2, 0]  # 4 micro-steps = 2 steps, none taken for a skipped one
    assert r["error"]["first"]["module"] == "inp" and r["error"]["first"]["phase"] == "fwd"
    assert r["identical"] and r["overflows"] == 0

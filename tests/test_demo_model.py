"""The demo model overflows in fp16 where the guide's mt5 did, and keep_fp32 fixes it."""

from __future__ import annotations

import math

import pytest
import torch

from torchdoctor.demo.model import TinyT5ForDemo, build_demo, train_steps
from torchdoctor.numerics.fp32 import keep_fp32

FP16_MAX = torch.finfo(torch.float16).max


def _trace_first_step(model: TinyT5ForDemo, batches: list, precision: str) -> list[tuple[str, float]]:
    """(module name, abs max of its output) for every forward call of one step, in hook order."""
    frames: list[tuple[str, float]] = []

    def record(name: str, output: object) -> None:
        tensor = getattr(output, "logits", output)
        if isinstance(tensor, torch.Tensor):
            frames.append((name, float(tensor.detach().float().abs().max())))

    handles = [
        module.register_forward_hook(lambda m, i, o, name=name: record(name, o))
        for name, module in model.named_modules()
    ]
    try:
        train_steps(model, batches, 1, precision)
    finally:
        for handle in handles:
            handle.remove()
    return frames


def test_fp32_and_bf16_stay_finite() -> None:
    for precision in ("fp32", "bf16"):
        model, batches = build_demo(seed=0)
        losses = train_steps(model, batches, 5, precision)
        assert all(math.isfinite(loss) for loss in losses), precision


def test_fp16_overflows_in_block_2_feed_forward_like_the_guide() -> None:
    model, batches = build_demo(seed=0)
    frames = _trace_first_step(model, batches, "fp16")
    first_bad = next(name for name, value in frames if not math.isfinite(value))
    assert first_bad.startswith("encoder.block.2.layer.1")
    # As in the guide: the feed-forward's output is finite but close to fp16's max ...
    peak = dict(frames)["encoder.block.2.layer.1.DenseReluDense"]
    assert 0.9 * FP16_MAX < peak < FP16_MAX
    # ... and the Dropout after it pushes it to inf.
    assert first_bad == "encoder.block.2.layer.1.dropout"

    model, batches = build_demo(seed=0)
    losses = train_steps(model, batches, 3, "fp16")
    assert not any(math.isfinite(loss) for loss in losses)


def test_keep_fp32_on_the_layer_fixes_fp16_training() -> None:
    model, batches = build_demo(seed=0)
    reference = train_steps(build_demo(seed=0)[0], batches, 5, "fp32")
    with keep_fp32(model.encoder.block[2].layer[1], model=model) as guard:
        losses = train_steps(model, batches, 5, "fp16")
    assert guard.names == ["encoder.block.2.layer.1"]
    assert all(math.isfinite(loss) for loss in losses)
    # Not only finite: the same training as fp32, within fp16's precision elsewhere.
    assert losses == pytest.approx(reference, rel=1e-2)


def test_build_is_deterministic_and_leaves_rng_alone() -> None:
    state = torch.random.get_rng_state()
    (a, batches_a), (b, batches_b) = build_demo(seed=3), build_demo(seed=3)
    train_steps(a, batches_a, 1, "fp32")
    assert torch.equal(torch.random.get_rng_state(), state)
    b_state = b.state_dict()
    assert all(torch.equal(batches_a[i][0], batches_b[i][0]) for i in range(len(batches_a)))
    assert not all(torch.equal(v, b_state[k]) for k, v in a.state_dict().items())  # a trained
    assert build_demo(seed=3)[0].state_dict().keys() == b_state.keys()


def test_module_names_mirror_t5() -> None:
    model, _ = build_demo()
    names = dict(model.named_modules())
    assert type(names["encoder.block.2.layer.0"]).__name__ == "TinyT5LayerSelfAttention"
    assert type(names["encoder.block.2.layer.1"]).__name__ == "TinyT5LayerFF"
    assert type(names["encoder.block.2.layer.1.layer_norm"]).__name__ == "TinyT5LayerNorm"
    assert type(names["encoder.block.2.layer.1.DenseReluDense"]).__name__ == "TinyT5DenseGatedGeluDense"
    for child in ("wi_0", "wi_1", "wo", "dropout"):
        assert f"encoder.block.2.layer.1.DenseReluDense.{child}" in names
    assert "encoder.block.2.layer.1.dropout" in names


def test_train_steps_rejects_unknown_precision() -> None:
    model, batches = build_demo()
    with pytest.raises(ValueError, match="precision"):
        train_steps(model, batches, 1, "fp8")

"""NumericsCallback inside a real transformers Trainer on CPU."""

from __future__ import annotations

import pytest
import torch

from conftest import gpt2_batch, tiny_gpt2
from torchdoctor import NonFiniteError
from torchdoctor.integrations.hf import NumericsCallback


def _trainer(model, tmp_path, callback, steps=3):
    from transformers import Trainer, TrainingArguments

    rows = []
    for i in range(8):
        b = gpt2_batch(i, batch=1)
        rows.append({k: v[0] for k, v in b.items()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="no", learning_rate=1e-3,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])


def test_clean_training_counts_optimizer_steps(tmp_path):
    cb = NumericsCallback(grads="modules")
    trainer = _trainer(tiny_gpt2(), tmp_path, cb)
    seen = {}
    orig = cb.on_train_end

    def on_end(*a, **k):
        seen["steps"] = cb.monitor.step_index
        return orig(*a, **k)

    cb.on_train_end = on_end
    trainer.train()
    assert seen["steps"] == 3
    assert cb.monitor is None  # closed at the end of training
    assert not any(m._forward_hooks for m in trainer.model.modules())


def test_overflow_stops_the_trainer_before_the_update(tmp_path):
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight.fill_(1e37)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, tmp_path, NumericsCallback())
    with pytest.raises(NonFiniteError) as exc:
        trainer.train()
    # c_proj's output stays finite (~1e38) in fp32; the final LayerNorm squares it: inf, then nan
    assert exc.value.first.phase == "fwd"
    assert exc.value.first.module == "transformer.ln_f" and exc.value.first.value == "nan"
    assert "squaring it" in exc.value.report
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert (tmp_path / "torchdoctor-nonfinite-rank0.txt").exists()
    # the stopped monitor released the model: a new one can attach (on_train_end never ran)
    from torchdoctor.compat import DebugUnderflowOverflow

    DebugUnderflowOverflow(trainer.model).remove()


def test_callback_refuses_what_the_trainer_provides_and_bad_options():
    with pytest.raises(TypeError, match="takes 'optimizer' from the Trainer"):
        NumericsCallback(optimizer=object())
    with pytest.raises(TypeError, match="NumericsCallback: .*foo"):
        NumericsCallback(foo=1)
    with pytest.raises(ValueError, match="grads='bogus'"):
        NumericsCallback(grads="bogus")

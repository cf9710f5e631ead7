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


# ---------------------------------------------------------------- the data, through the Trainer (issue 18)
class FeatureRegressor(torch.nn.Module):
    """A model the Trainer calls with float ``features`` and ``labels``; it scales the features in plain code
    before its first module, as a normalisation would."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, features, labels=None):
        pred = self.net((features - 0.5) * 2.0).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, labels), "logits": pred}


def _rows(kind: str, bad: int | None, value: float = float("nan")) -> tuple[torch.nn.Module, list[dict]]:
    """Eight training rows for ``kind``'s model, row ``bad`` holding ``value`` (in its labels or float input)."""
    from test_diagnosis_data import bert_batch, tiny_bert_regressor

    rows = []
    if kind == "bert-label":
        model = tiny_bert_regressor()
        for i in range(8):
            b = bert_batch(i, batch=1)
            rows.append({k: v[0] for k, v in b.items()})
        if bad is not None:
            rows[bad]["labels"] = torch.tensor(value)
    elif kind == "gpt2-embeds":
        model = tiny_gpt2()
        for i in range(8):
            b = gpt2_batch(i, batch=1)
            rows.append({"inputs_embeds": torch.randn(8, 32), "labels": b["labels"][0]})
        if bad is not None:
            rows[bad]["inputs_embeds"][3, 5] = value
    else:
        model = FeatureRegressor()
        g = torch.Generator().manual_seed(0)
        rows = [{"features": torch.rand(6, generator=g), "labels": torch.rand((), generator=g)} for _ in range(8)]
        if bad is not None:
            rows[bad]["features"][2] = value
    return model, rows


def _sequential_trainer(model, rows, tmp_path, callback, steps, accumulation):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, use_cpu=True, report_to="none",
        save_strategy="no", logging_strategy="no", learning_rate=1e-3, dataloader_num_workers=0, disable_tqdm=True,
        gradient_accumulation_steps=accumulation, train_sampling_strategy="sequential",
    )
    return Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])


@pytest.mark.parametrize(("kind", "name"), [("bert-label", "labels"), ("gpt2-embeds", "inputs_embeds"),
                                            ("feature", "features")])
@pytest.mark.parametrize("micro_batch", [0, 1, 2])
def test_a_nan_in_any_input_the_trainer_gives_the_model_is_the_data(tmp_path, kind, name, micro_batch):
    from torchdoctor.numerics.explain import causes
    from torchdoctor.numerics.explain.evidence import contradictions

    model, rows = _rows(kind, bad=2 * micro_batch + 1)  # batches of 2 rows, 3 micro-batches per step
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _sequential_trainer(model, rows, tmp_path, NumericsCallback(), steps=1, accumulation=3)
    with pytest.raises(NonFiniteError) as exc:
        trainer.train()
    report = exc.value.details
    assert report.cause == causes.BAD_INPUT, report.diagnosis
    assert report.diagnosis.startswith(f"{name} (input[{name}])") and f"micro-batch {micro_batch}," in report.diagnosis
    assert "plain code" not in report.diagnosis and "data loader" in report.fix
    assert contradictions(report) == [] and " in  (" not in exc.value.report
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_an_inf_loss_with_finite_gradients_is_a_warning_the_trainer_survives(tmp_path):
    """A target of 1e20: its squared error is inf, its gradient finite (and clipped by the Trainer). The Trainer's
    own log leaves the inf out (logging_nan_inf_filter); the callback says so and keeps the report."""
    from torchdoctor.numerics import NonFiniteWarning
    from torchdoctor.numerics.explain import causes

    model, rows = _rows("bert-label", bad=7, value=1e20)  # the last batch of 4 steps
    cb = NumericsCallback()
    trainer = _sequential_trainer(model, rows, tmp_path, cb, steps=4, accumulation=1)
    with pytest.warns(NonFiniteWarning, match="output\\[loss\\] is inf while every gradient is finite"):
        trainer.train()
    (report,) = cb.warnings
    assert cb.monitor is None and report.cause == causes.NONFINITE_LOSS and report.step == 3
    assert "The labels reach 1.00e+20" in report.diagnosis
    assert (tmp_path / "torchdoctor-nonfinite-loss-rank0.txt").exists()
    assert not (tmp_path / "torchdoctor-nonfinite-rank0.txt").exists()


@pytest.mark.both_levels
def test_a_backward_fault_under_the_trainers_grad_norm_is_named_where_it_began(tmp_path, watch_level):
    """The Trainer calls clip_grad_norm_ every step (to log grad_norm, even with max_grad_norm=0): a nan norm makes
    every gradient nan before optimizer.step(). At the default the replay, from the gradient the loss sent into the
    model, names the parameter-free module whose backward made it; every module watched at grads="modules" names the
    same; at grads="params" only a parameter gradient can be named."""
    from conftest import Boom

    model = tiny_gpt2()
    model.transformer.h[1].mlp.act = torch.nn.Sequential(model.transformer.h[1].mlp.act, Boom())
    grads = "modules" if watch_level == "every-module" else "params"
    trainer = _trainer(model, tmp_path, NumericsCallback(grads=grads))
    with pytest.raises(NonFiniteError) as exc:
        trainer.train()
    first = exc.value.first
    assert (first.step, first.phase, first.module, first.slot) == (0, "bwd", "transformer.h.1.mlp.act.1", "grad_input")
    assert exc.value.details.replay == "reproduced"  # (every module watched: the replay says it comes back)

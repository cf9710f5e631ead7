"""A non-finite value in what the model is given is "the data", wherever it first shows (issue 18, item 3).

The model's own frame holds every input it was given (positional, keyword, ``labels``), so a nan there is the
data in any micro-batch of a gradient-accumulation step, even when the module it reaches first is deep inside
the model and the value got there through plain code (GPT-2 adds position embeddings to ``inputs_embeds``
before its first Dropout). "Plain code between modules" is left for a value that was finite when it entered.
Real transformers models from configs (BERT regression, GPT-2, T5), real optimizers; every report is checked
against its own frames (:func:`torchdoctor.numerics.explain.evidence.contradictions`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import gpt2_batch, t5_batch, tiny_gpt2, tiny_t5
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.explain import causes
from torchdoctor.numerics.explain.evidence import contradictions

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

NAN = float("nan")


def tiny_bert_regressor(seed: int = 0):
    """BertForSequenceClassification with one label: an MSE loss on float labels, computed inside the model."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=32, num_labels=1)
    return BertForSequenceClassification(cfg)


def bert_batch(seed: int = 0, batch: int = 2, seq: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, 64, (batch, seq), generator=g), "labels": torch.rand(batch, generator=g)}


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def accumulate(tmp_path, model, batches, loss_of, **monitor):
    """One optimizer step over ``batches`` (gradient accumulation): the NonFiniteError's report."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path, **monitor), \
            pytest.raises(NonFiniteError) as exc:
        for b in batches:
            loss_of(model, b).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the update was refused
    return exc.value.details


def assert_the_data(report, name: str, micro_batch: int) -> None:
    assert report.cause == causes.BAD_INPUT, report.diagnosis
    assert report.diagnosis.startswith(f"{name} (") and f"micro-batch {micro_batch}," in report.diagnosis
    assert "check the data" in report.diagnosis and "the model did not make it" in report.diagnosis
    assert "data loader" in report.fix and "torchdoctor.mark(" in report.fix and "torch.isfinite(" in report.fix
    assert "plain code" not in report.diagnosis
    assert contradictions(report) == []
    text = report.text()
    assert " in  (" not in text and "  (" not in report.diagnosis  # the root is named by its class


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_nan_positional_input_in_any_micro_batch_is_the_data(tmp_path, bad):
    xs = [torch.randn(4, 8) for _ in range(3)]
    xs[bad][1, 3] = NAN
    report = accumulate(tmp_path, mlp(), xs, lambda m, x: m(x).pow(2).mean())
    assert_the_data(report, "positional input 0", bad)
    assert report.first.module == "0" and report.first.slot == "output"
    assert "torchdoctor.mark(x, 'input 0')" in report.fix
    # the model's own frame, which says what it was given, ends after the first bad one: it is cited
    assert [f.cls for f in report.cited] == ["Sequential"] and report.cited[0].lines[0].label == "input[0]"


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_nan_label_of_a_model_that_computes_its_own_loss_is_the_data(tmp_path, bad):
    batches = [bert_batch(i) for i in range(3)]
    batches[bad]["labels"][1] = NAN
    report = accumulate(tmp_path, tiny_bert_regressor(), batches, lambda m, b: m(**b).loss)
    assert_the_data(report, "labels", bad)
    assert report.first.module == "" and report.first.slot == "output[loss]"
    assert "Detected nan at step 0 (forward) in BertForSequenceClassification (the model), slot output[loss]" \
        in report.text()
    assert "batch['labels']" in report.fix


@pytest.mark.parametrize("bad", [0, 2])
def test_a_nan_in_gpt2_inputs_embeds_reached_through_plain_code_is_the_data(tmp_path, bad):
    """GPT-2 adds the position embeddings to inputs_embeds in plain code: its Dropout gets a new tensor."""
    model = tiny_gpt2()
    batches = []
    for i in range(3):
        b = gpt2_batch(i)
        batches.append({"inputs_embeds": torch.randn(2, 8, 32), "labels": b["labels"]})
    batches[bad]["inputs_embeds"][0, 4, 7] = NAN
    report = accumulate(tmp_path, model, batches, lambda m, b: m(**b).loss)
    assert_the_data(report, "inputs_embeds", bad)
    assert report.first.module == "transformer.drop"
    assert "transformer.drop (Dropout) is the first module" in report.diagnosis


def test_a_nan_in_t5_inputs_embeds_is_the_data(tmp_path):
    model = tiny_t5()
    b = t5_batch()
    embeds = torch.randn(2, 8, 32)
    embeds[1, 2, 3] = NAN
    report = accumulate(tmp_path, model, [{"inputs_embeds": embeds, "labels": b["labels"]}],
                        lambda m, b: m(**b).loss, grads="modules")
    assert_the_data(report, "inputs_embeds", 0)


def test_an_inf_input_names_the_mask_caveat(tmp_path):
    xs = [torch.randn(4, 8), torch.randn(4, 8)]
    xs[1][0, 0] = float("inf")
    report = accumulate(tmp_path, mlp(), xs, lambda m, x: m(x).pow(2).mean())
    assert_the_data(report, "positional input 0", 1)
    assert "is already inf" in report.diagnosis and "attention mask" in report.diagnosis


def test_a_batch_marked_before_the_model_is_the_data(tmp_path):
    """The fix's own suggestion: mark the batch before the call, in micro-batch 1."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs = [torch.randn(4, 8), torch.randn(4, 8)]
    xs[1][2, 2] = NAN
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path) as mon, pytest.raises(NonFiniteError) as exc:
        for x in xs:
            mon.mark(x, "x")
            model(x).pow(2).mean().backward()
        opt.step()
    report = exc.value.details
    assert_the_data(report, "positional input 0", 1)
    assert report.first.phase == "mark" and "you marked it 'x'" in report.diagnosis


class Sampler(nn.Module):
    def forward(self, x):
        return torch.multinomial(x.softmax(-1), 1)  # raises on nan probabilities: the model never returns


def test_a_nan_input_of_a_forward_that_raises_is_still_the_data(tmp_path):
    """No model frame (the forward raised): the first module of the call was given the value from outside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Sampler())
    x = torch.randn(3, 4)
    with NumericsMonitor(model, report_dir=tmp_path, manual_steps=True) as mon:
        model(x)  # micro-batch 0 of the step (it runs until mon.step())
        x = x.clone()
        x[0, 0] = NAN
        with pytest.raises(RuntimeError):
            model(x)
    report = mon.report
    assert report is not None and report.cause == causes.BAD_INPUT, report and report.diagnosis
    assert "micro-batch 1," in report.diagnosis and contradictions(report) == []


class Halves(nn.Module):
    """Plain code between two watched modules that makes a nan from finite values (0/0)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x)
        return self.b(h / (h - h))


@pytest.mark.parametrize("nested", [False, True])
def test_a_nan_made_by_plain_code_from_finite_inputs_is_between_modules_with_a_fix(tmp_path, nested):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), Halves()) if nested else Halves()
    report = accumulate(tmp_path, model, [torch.randn(4, 8), torch.randn(4, 8)], lambda m, x: m(x).pow(2).mean())
    assert report.cause == causes.BETWEEN_MODULES, report.diagnosis
    inside = "1 (Halves)" if nested else "Halves (the model)"
    assert f"in the forward of {inside}" in report.diagnosis and "every input the model was given" in report.diagnosis
    assert report.fix is not None and "torchdoctor.mark(" in report.fix and inside in report.fix
    assert contradictions(report) == []

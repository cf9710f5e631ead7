"""torchdoctor.compat side by side with transformers' own DebugUnderflowOverflow, under awkward use.

Each case runs both detectors on copies of one real model (transformers models built from tiny configs,
torch's LSTM and MultiheadAttention) over the same calls, and asks: does each call end the same way (the
same ValueError, or none), and does every line transformers printed appear in ours, in order? After
transformers' first ValueError its detector raises at every later call (its flag is never reset), so
calls are compared up to and including that one; what ours does afterwards is tested on its own.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers.debug_utils import DebugUnderflowOverflow as TheirDetector

from conftest import gpt2_batch, overflowing_gpt2, t5_batch, tiny_gpt2, tiny_t5
from test_compat import assert_subsequence
from torchdoctor.compat import DebugOption, DebugUnderflowOverflow
from torchdoctor.syncs import SyncCounter

Call = Callable[[nn.Module], object]


def run(cls, model: nn.Module, calls: list[Call], **kwargs) -> tuple[list[list[str]], list[str | None]]:
    """Every call under a fresh detector on a copy of ``model``: each call's printed lines and ValueError."""
    model = copy.deepcopy(model)
    cls(model, **kwargs)
    printed, outcomes = [], []
    for call in calls:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                call(model)
                outcomes.append(None)
            except ValueError as e:
                outcomes.append(str(e))
        printed.append(out.getvalue().split("\n"))
    return printed, outcomes


def assert_parity(model: nn.Module, calls: list[Call], **kwargs) -> tuple[list[str], list[str | None]]:
    """Same outcome per call and transformers' lines within ours, up to transformers' first ValueError;
    returns all our lines and our outcomes."""
    theirs, their_out = run(TheirDetector, model, calls, **kwargs)
    ours, our_out = run(DebugUnderflowOverflow, model, calls, **kwargs)
    first = next((i for i, o in enumerate(their_out) if o is not None), len(calls) - 1)
    assert our_out[: first + 1] == their_out[: first + 1]
    assert_subsequence(sum(theirs[: first + 1], []), sum(ours[: first + 1], []))
    return sum(ours, []), our_out


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
    return BertModel(cfg).eval()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------ item 9: what transformers never judges
class MaskedAttention(nn.Module):
    """Calls MultiheadAttention with an additive -inf causal mask as a keyword or positionally."""

    def __init__(self, positional: bool):
        super().__init__()
        self.positional = positional
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        mask = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), 1)
        if self.positional:  # transformers sees (and stops on) input[5]
            return self.mha(x, x, x, None, True, mask)[0]
        return self.mha(x, x, x, attn_mask=mask)[0]


@pytest.mark.parametrize("positional", [False, True])
def test_an_minus_inf_attn_mask_stops_only_where_transformers_stops(positional):
    model = MaskedAttention(positional)
    xs = [torch.randn(2, 4, 8) for _ in range(3)]
    ours, outcomes = assert_parity(model, [lambda m, x=x: m(x) for x in xs], trace_batch_nums=[1])
    if positional:  # transformers judges a positional mask: both stop at once
        assert outcomes[0] is not None and "input[5] has infs" in ours
    else:  # a keyword mask is shown in the trace, never judged
        assert outcomes == [None, None, None]
        assert any(line.endswith("input[attn_mask]") and "inf" in line for line in ours)
        assert not any("has infs" in line for line in ours)


class DictOut(nn.Module):
    """A submodule returning a dict with an -inf and a nan inside (a mask, a cache), and a parent
    that uses only the finite part: transformers prints "not a tensor" and goes on."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        h = self.inner(x)
        return {"hidden": h, "bias": torch.full_like(h, float("-inf")), "cache": [h * float("nan")]}


class UsesDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = DictOut()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.block(x)["hidden"])


def test_values_inside_dicts_are_shown_but_not_judged():
    x = torch.randn(2, 4)
    ours, outcomes = assert_parity(UsesDict(), [lambda m: m(x)] * 2, trace_batch_nums=[1])
    assert outcomes == [None, None]
    assert any(line.endswith("output[bias]") and "inf" in line for line in ours)
    assert not any("has infs" in line or "has nans" in line for line in ours)


def test_bert_with_padding_mask_traces_alike():
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    ours, outcomes = assert_parity(
        tiny_bert(), [lambda m: m(ids, attention_mask=mask)] * 2, trace_batch_nums=[0], abort_after_batch_num=1
    )
    assert outcomes[1] is not None and "abort_after_batch_num=1" in outcomes[1]
    assert any("*** Starting batch number=0 ***" in line for line in ours)


# ------------------------------------------------------------------ item 10: calls of a submodule only
def test_a_loop_calling_only_the_transformer_is_checked_at_once():
    ids = [gpt2_batch(i)["input_ids"] for i in range(3)]
    ours, outcomes = assert_parity(overflowing_gpt2().eval(), [lambda m, x=x: m.transformer(x) for x in ids])
    assert outcomes[0] is not None and "inf/nan detected" in outcomes[0]
    assert "Detected inf/nan during batch_number=0" in ours


def test_a_t5_encoder_called_alone_is_checked():
    model = tiny_t5(dropout_rate=0.0).half().eval()
    with torch.no_grad():
        model.encoder.block[1].layer[1].DenseReluDense.wo.weight.fill_(6e4)
    ids = t5_batch()["input_ids"]
    _, outcomes = assert_parity(model, [lambda m: m.get_encoder()(ids)] * 2)
    assert outcomes[0] is not None


def test_submodule_only_calls_keep_a_bounded_buffer_and_sync_once_per_call():
    model = tiny_gpt2().eval()
    ids = gpt2_batch()["input_ids"]
    d = DebugUnderflowOverflow(model)
    engine = d._engine
    for _ in range(200):
        model.transformer(ids)
    held = len(engine._recorder.rec.frames) + sum(len(r.frames) for r in engine._steps.history.records)
    assert held <= d.max_frames_to_save
    with SyncCounter() as c:
        model.transformer(ids)
    assert c.count == 1
    assert d.batch_number == 0  # transformers counts batches at the root module only
    d.remove()


# ------------------------------------------------------------------ generate(), LSTM, Llama
def test_gpt2_generate_traces_alike():
    model = tiny_gpt2().eval()
    ids = gpt2_batch()["input_ids"][:1]
    gen = lambda m: m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)  # noqa: E731
    ours, outcomes = assert_parity(model, [gen], trace_batch_nums=[0, 2])
    assert outcomes == [None]
    assert any("*** Starting batch number=2 ***" in line for line in ours)


def test_t5_generate_runs_the_encoder_alone_and_traces_alike():
    model = tiny_t5(dropout_rate=0.0).eval()
    ids = t5_batch()["input_ids"][:1]
    gen = lambda m: m.generate(ids, max_new_tokens=3, do_sample=False)  # noqa: E731
    _, outcomes = assert_parity(model, [gen], trace_batch_nums=[0, 1])
    assert outcomes == [None]


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1])


def test_lstm_tuple_of_tuples_output_and_a_nan_batch():
    torch.manual_seed(0)
    xs = [torch.randn(2, 5, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4)]
    xs[2][0, 1, 2] = float("nan")
    ours, outcomes = assert_parity(LSTMNet(), [lambda m, x=x: m(x) for x in xs])
    assert outcomes[:2] == [None, None] and outcomes[2] is not None
    assert any(line.endswith("output[1][1]") for line in ours)


def test_llama_trace_and_abort_after_batch():
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    ours, outcomes = assert_parity(model, [lambda m: m(ids)] * 3, trace_batch_nums=[1], abort_after_batch_num=1)
    assert outcomes[:1] == [None] and outcomes[1] is not None and "aborting after 2 batches" in outcomes[1]
    assert any("*** Starting batch number=1 ***" in line for line in ours)


# ------------------------------------------------------------------ item 13: the smaller defects
class Emits(nn.Module):
    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value
        self.lin = nn.Linear(1, 1)

    def forward(self, x):
        return self.lin(x), self.value


def test_int32_values_above_2_24_print_exactly():
    big = torch.tensor([123499999, -16777217], dtype=torch.int32)  # float32 would round to 1.24e+08
    ours, _ = assert_parity(Emits(big), [lambda m: m(torch.ones(1, 1))], trace_batch_nums=[0])
    assert "1.68e+07 1.23e+08 output[1]" in ours


def test_complex_inf_nan_reports_both():
    value = torch.tensor([complex(float("inf"), float("nan")), 1 + 1j])
    ours, outcomes = assert_parity(Emits(value), [lambda m: m(torch.ones(1, 1))])
    assert outcomes[0] is not None
    assert "output[1] has nans" in ours and "output[1] has infs" in ours


def test_max_frames_to_save_none_keeps_every_frame():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).half()
    xs = [torch.randn(2, 4).half() for _ in range(10)] + [torch.full((2, 4), 6e4).half()]
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    ours, outcomes = assert_parity(model, [lambda m, x=x: m(x) for x in xs], max_frames_to_save=None)
    assert outcomes[-1] is not None
    assert "Last 41 forward frames:" in ours  # 4 frames x 10 healthy batches + the bad one: all kept


def test_debug_option_is_importable_and_equal_to_transformers():
    from transformers.debug_utils import DebugOption as Theirs

    assert DebugOption.UNDERFLOW_OVERFLOW == Theirs.UNDERFLOW_OVERFLOW == "underflow_overflow"
    assert DebugOption.UNDERFLOW_OVERFLOW in [Theirs.UNDERFLOW_OVERFLOW]


def test_after_a_caught_valueerror_the_loop_is_still_watched_and_batchnorm_kept():
    """transformers raises again at every later call (its flag is never reset); ours goes on watching and
    reports the next inf, two batches later, with the running statistics of the bad batch undone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
    good = [torch.randn(8, 4) for _ in range(4)]
    bad = torch.randn(8, 4)
    bad[0, 0] = float("inf")
    calls = [good[0], bad, good[1], good[2], bad, good[3]]
    _, their_out = run(TheirDetector, model, [lambda m, x=x: m(x) for x in calls])
    assert their_out[2] is not None  # transformers: a healthy batch after the caught error raises again

    m = copy.deepcopy(model)
    DebugUnderflowOverflow(m)
    bn = m[1]
    outcomes = []
    with contextlib.redirect_stdout(io.StringIO()) as out:
        for x in calls:
            before = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
            try:
                m(x)
                outcomes.append(None)
            except ValueError:
                outcomes.append("ValueError")
                after = (bn.running_mean, bn.running_var, bn.num_batches_tracked)
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert outcomes == [None, "ValueError", None, None, "ValueError", None]
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
    assert out.getvalue().count("Detected inf/nan during batch_number=") == 2

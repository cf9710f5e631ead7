"""torchdoctor.compat against transformers.debug_utils itself, on the same model and batches."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from transformers.debug_utils import DebugUnderflowOverflow as TheirDetector
from transformers.debug_utils import detect_overflow as their_detect_overflow

from conftest import gpt2_batch, overflowing_gpt2, t5_batch, tiny_t5
from torchdoctor.compat import DebugUnderflowOverflow, detect_overflow
from torchdoctor.syncs import SyncCounter


def _run(cls, model, batches, **kwargs):
    model = copy.deepcopy(model)
    cls(model, **kwargs)
    out, err = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            for batch in batches:
                model(**batch)
        except ValueError as e:
            err = str(e)
    return out.getvalue().split("\n"), err


def assert_subsequence(theirs: list[str], ours: list[str]) -> None:
    """Every line transformers printed appears in ours, in the same order (extra lines allowed)."""
    it = iter(enumerate(ours))
    for line in theirs:
        for _, candidate in it:
            if candidate == line:
                break
        else:
            raise AssertionError(f"transformers' line {line!r} is missing (or out of order) in ours")


CASES = [
    ("detect", {}),
    ("detect-5-frames", {"max_frames_to_save": 5}),
    ("trace-and-abort", {"trace_batch_nums": [0, 1], "abort_after_batch_num": 1}),
    ("trace-later-batch", {"trace_batch_nums": [1]}),
]


@pytest.mark.parametrize("name, kwargs", CASES, ids=[c[0] for c in CASES])
def test_fp16_gpt2_output_contains_every_transformers_line(name, kwargs):
    model = overflowing_gpt2().eval()
    batches = [gpt2_batch(i) for i in range(3)]
    theirs, their_err = _run(TheirDetector, model, batches, **kwargs)
    ours, our_err = _run(DebugUnderflowOverflow, model, batches, **kwargs)
    assert their_err is not None and our_err == their_err
    assert any("inf" in line for line in theirs)
    assert_subsequence(theirs, ours)
    detected_in_untraced_batch = 0 not in kwargs.get("trace_batch_nums", [])
    assert any(line.startswith("torchdoctor diagnosis:") for line in ours) == detected_in_untraced_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_trace_parity_without_overflow(dtype):
    model = tiny_t5(dropout_rate=0.0).to(dtype).eval()
    batches = [t5_batch(i) for i in range(3)]
    kwargs = {"trace_batch_nums": [0, 2], "abort_after_batch_num": 2}
    theirs, their_err = _run(TheirDetector, model, batches, **kwargs)
    ours, our_err = _run(DebugUnderflowOverflow, model, batches, **kwargs)
    assert our_err == their_err == (
        "DebugUnderflowOverflow: aborting after 3 batches due to `abort_after_batch_num=2` arg"
    )
    assert_subsequence(theirs, ours)
    assert len(theirs) > 200


def test_one_host_sync_per_batch_against_thousands():
    model = tiny_t5(dropout_rate=0.0).eval()
    batch = t5_batch()
    counts = {}
    for name, cls in (("theirs", TheirDetector), ("ours", DebugUnderflowOverflow)):
        m = copy.deepcopy(model)
        cls(m)
        m(**batch)
        with SyncCounter() as c, torch.no_grad():
            m(**batch)
        counts[name] = c.count
    assert counts["ours"] == 1
    assert counts["theirs"] > 100


def test_defects_transformers_has_are_absent():
    model = overflowing_gpt2().eval()
    d = DebugUnderflowOverflow(model, trace_batch_nums=[0])
    # an inf inside a traced batch is printed, not raised -- and the next batch is not falsely aborted
    with contextlib.redirect_stdout(io.StringIO()) as out:
        model(**gpt2_batch(0))
    assert "output has infs" in out.getvalue()
    d.remove()
    assert not any(m._forward_hooks for m in model.modules())
    # constructing twice (Trainer.train() called twice) replaces the first detector: hooks never doubled
    DebugUnderflowOverflow(model)
    hooks = {name: len(m._forward_hooks) for name, m in model.named_modules()}
    second = DebugUnderflowOverflow(model)
    assert {name: len(m._forward_hooks) for name, m in model.named_modules()} == hooks
    with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(ValueError, match="inf/nan detected"):
        model(**gpt2_batch(0))
    assert out.getvalue().count("Detected inf/nan during batch_number=0") == 1  # one detector speaks
    second.remove()
    assert not any(m._forward_hooks for m in model.modules())


def test_bool_and_empty_inputs_do_not_crash():
    class Takes(torch.nn.Module):
        def forward(self, x, mask):
            return x[mask], x[:0]

    m = Takes()
    with contextlib.redirect_stdout(io.StringIO()) as out, DebugUnderflowOverflow(m, trace_batch_nums=[0]):
        m(torch.randn(4), torch.tensor([True, False, True, True]))
    text = out.getvalue()
    assert "0.00e+00 1.00e+00 input[1]" in text
    assert "empty output[1]" in text


@pytest.mark.parametrize(
    "value", [torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0]), torch.tensor([1.0, 2.0])]
)
def test_detect_overflow_matches_transformers(value, capsys):
    theirs = their_detect_overflow(value, "ctx")
    their_out = capsys.readouterr().out
    with SyncCounter() as c:
        ours = detect_overflow(value, "ctx")
    assert c.count == 1
    assert ours == theirs
    assert capsys.readouterr().out == their_out


def test_context_spanning_earlier_batches_matches_transformers():
    """A small model overflows in batch 2: the 21 frames shown reach back into batches 0 and 1."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # 4 x 6e4 > 65504: inf in batch 2 only
    xs = [torch.randn(3, 4).half() for _ in range(2)] + [torch.full((3, 4), 6e4).half()]

    def run(cls):
        m = copy.deepcopy(model)
        cls(m)
        out, err = io.StringIO(), None
        with contextlib.redirect_stdout(out):
            try:
                for x in xs:
                    m(x)
            except ValueError as e:
                err = str(e)
        return out.getvalue().split("\n"), err

    theirs, their_err = run(TheirDetector)
    ours, our_err = run(DebugUnderflowOverflow)
    assert their_err == our_err and their_err is not None
    assert "Detected inf/nan during batch_number=2" in theirs
    assert sum("*** Starting batch number=" in line for line in theirs) >= 2
    assert_subsequence(theirs, ours)


class NanAndInf(torch.nn.Module):
    def forward(self, x):
        return torch.cat([x / 0.0, (x - x) / 0.0])  # inf and nan in one tensor


@pytest.mark.parametrize("trace", [False, True])
def test_a_tensor_with_both_nan_and_inf_prints_both_lines(trace):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), NanAndInf())
    kwargs = {"trace_batch_nums": [0]} if trace else {}
    batches = [{"input": torch.ones(1, 2)}]

    def call(cls):
        m = copy.deepcopy(model)
        cls(m, **kwargs)
        out, err = io.StringIO(), None
        with contextlib.redirect_stdout(out):
            try:
                m(batches[0]["input"])
            except ValueError as e:
                err = str(e)
        return out.getvalue().split("\n"), err

    theirs, their_err = call(TheirDetector)
    ours, our_err = call(DebugUnderflowOverflow)
    assert their_err == our_err
    assert "output has nans" in theirs and "output has infs" in theirs
    assert_subsequence(theirs, ours)


class MayFail(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x, fail=False):
        h = self.a(x)
        if fail:
            raise RuntimeError("simulated OOM")
        return self.b(h)


def test_parity_after_a_forward_that_raised():
    torch.manual_seed(0)
    base = MayFail()
    xs = [(torch.randn(2, 4), False), (torch.randn(2, 4), True), (torch.full((2, 4), float("inf")), False)]
    printed = {}
    for cls in (TheirDetector, DebugUnderflowOverflow):
        m = copy.deepcopy(base)
        cls(m)
        out, errors = io.StringIO(), []
        with contextlib.redirect_stdout(out):
            for x, fail in xs:
                try:
                    m(x, fail=fail)
                except (RuntimeError, ValueError) as e:
                    errors.append(type(e).__name__)
        assert errors == ["RuntimeError", "ValueError"]
        printed[cls] = out.getvalue().split("\n")
    assert_subsequence(printed[TheirDetector], printed[DebugUnderflowOverflow])

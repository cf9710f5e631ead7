"""The per-step finiteness check of many tensors: both ways (per-tensor aminmax, fused inf-norm) agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdoctor.numerics.measure.stats import all_finite, finite_flags_of, fused_check_works

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BAD = {"none": None, "nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _grads(dtype, bad, where):
    torch.manual_seed(0)
    ts = [torch.randn(n, dtype=dtype) for n in (7, 300_000, 1, 64)]  # one spans many blocks
    ts.append(torch.randn(8, 8, dtype=dtype).t())  # non-contiguous
    if bad is not None:
        t = ts[where]
        t[(3, 5) if t.dim() == 2 else t.numel() // 2] = bad
    return ts


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("where", [0, 1, 2, 4])
def test_both_ways_see_every_nonfinite_value(fused, dtype, bad, where):
    flags = finite_flags_of(_grads(dtype, BAD[bad], where), fused=fused)
    assert len(flags) == 1 and flags[0].dtype is torch.bool and flags[0].dim() == 0
    assert bool(flags[0]) == (bad == "none")


@pytest.mark.parametrize("fused", [False, True])
def test_groups_per_dtype_and_skips_what_it_cannot_judge(fused):
    ts = [torch.ones(3), torch.ones(3, dtype=torch.float16), torch.empty(0), torch.ones(2, dtype=torch.int64),
          torch.ones(2, device="meta"), torch.tensor([1 + 1j, float("nan")], dtype=torch.complex64)]
    flags = finite_flags_of(ts, fused=fused)
    assert len(flags) == 2  # float32 (with the complex as real pairs) and float16
    assert not bool(all_finite(flags))
    assert bool(all_finite(finite_flags_of(ts[:5], fused=fused)))


def test_fused_path_is_probed_once_per_device():
    assert fused_check_works(torch.device("cpu")) is True  # CPU's foreach norm propagates nan and inf
    assert finite_flags_of([torch.tensor([1.0, float("nan")])])[0].item() is False  # auto: CPU takes aminmax


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=20),
                min_size=1, max_size=5))
def test_fused_and_per_tensor_agree_with_python(values):
    ts = [torch.tensor(v, dtype=torch.float32) for v in values]
    truth = all(abs(x) != float("inf") and x == x for v in values for x in v)
    for fused in (False, True):
        assert bool(all_finite(finite_flags_of(ts, fused=fused))) == truth

"""Labelling of forward inputs/outputs: property-based over arbitrary nested structures."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdoctor.numerics.measure.slots import NOT_A_TENSOR, input_slots, output_slots

leaves = st.one_of(
    st.just(None),
    st.integers(),
    st.text(max_size=3),
    st.builds(lambda n: torch.ones(n), st.integers(0, 3)),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(values, st.booleans())
def test_every_tensor_is_labelled_once_and_labels_are_unique(value, hf):
    slots = list(output_slots(value, hf=hf))
    tensors = [v for _, v in slots if isinstance(v, torch.Tensor)]
    assert len(tensors) == _count_tensors(value)
    labels = [label for label, v in slots if v is not NOT_A_TENSOR]
    assert len(labels) == len(set(labels))
    assert all(label.startswith("output") for label, _ in slots)


def _count_tensors(v, depth=0) -> int:
    if isinstance(v, torch.Tensor):
        return 1
    if depth >= 4:
        return 0
    if isinstance(v, (list, tuple)):
        return sum(_count_tensors(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return sum(_count_tensors(x, depth + 1) for x in v.values())
    return 0


def test_transformers_lines_come_first_and_unchanged():
    x = torch.ones(2)
    out = (x, (x, None, [x]), {"a": x})
    hf = [(label, v if not isinstance(v, torch.Tensor) else "T") for label, v in output_slots(out, hf=True)]
    assert hf == [
        ("output[0]", "T"),
        ("output[1][0]", "T"),
        ("output[1][1]", None),
        ("output[1][2]", NOT_A_TENSOR),  # what transformers prints for a list in a tuple ...
        ("output[1][2][0]", "T"),  # ... then ours
        ("output[2]", NOT_A_TENSOR),
        ("output[2][a]", "T"),
    ]


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    extra: object = None


def test_dataclass_outputs_and_keyword_inputs():
    labels = [label for label, _ in output_slots(Out(torch.ones(1)))]
    assert labels == ["output[loss]", "output[extra]"]
    labels = [label for label, _ in input_slots((torch.ones(1),), {"mask": torch.ones(1), "flag": True})]
    assert labels == ["input[0]", "input[mask]", "input[flag]"]

"""The first op of a replay that turns finite values into non-finite ones, and the module whose forward ran it
(torchdoctor.numerics.judge.invalid_finder): in the forward where the op runs, in the backward where the gradients,
finite until then, first go bad -- the module named is the one whose ``forward`` holds the line, in both."""

from __future__ import annotations

import torch
from torch import nn

from torchdoctor.numerics.judge.invalid_finder import FirstInvalidOp


class SqrtBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.where(h > 0, h.sqrt(), torch.zeros_like(h))  # the branch not taken: sqrt of a negative


def test_the_forward_op_and_the_backwards_first_node_are_named_with_their_modules():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("a", SqrtBlock())
    model.add_module("b", SqrtBlock())
    finder = FirstInvalidOp({id(m): name for name, m in model.named_modules()})
    with finder.watching():
        out = model(torch.randn(4, 8))
        assert bool(torch.isfinite(out).all())  # (the nan stays in the branch torch.where does not select)
        out.sum().backward()
    found, back = finder.found, finder.in_backward
    assert (found["phase"], found["op"], found["module"]) == ("forward", "aten.sqrt.default", "a"), found
    assert found["where"]["code"].startswith("return torch.where(h > 0, h.sqrt()")
    # the backward runs b first: its SqrtBackward0 reads the nan its forward saved
    assert (back["phase"], back["op"], back["module"], back["nan"]) == ("backward", "SqrtBackward0", "b", True), back
    assert back["where"] == found["where"]
    assert finder.stack == []  # (the module hooks are gone with the replay)
    out = model(torch.randn(4, 8))  # and nothing is tagged any more
    assert "torchdoctor_module" not in out.grad_fn.metadata


def test_a_node_made_from_finite_values_in_the_backward_is_found_there():
    """sqrt at 0: a finite forward (0) whose derivative is infinite -- found in the backward, by its node; no module
    was named to the finder, so none is said."""
    x = torch.zeros(3, requires_grad=True)
    finder = FirstInvalidOp()
    with finder.watching():
        x.sqrt().sum().backward()
    found = finder.found
    assert (found["phase"], found["op"], found["nan"], found["module"]) == ("backward", "SqrtBackward0", False, None)
    assert finder.in_backward is found


class _Sqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g / (2 * y)


class _Custom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sqrt.apply(x)


class _Cast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(torch.float32))  # (already fp32: the same tensor, the same node, comes back)


def test_a_node_no_torch_function_made_is_not_claimed_by_the_next_module():
    """A custom autograd.Function's node is made outside torch's functions: it stays untagged, and b's
    ``x.to(float32)`` -- which hands the same tensor back -- does not claim it."""
    model = nn.Sequential()
    model.add_module("a", _Custom())
    model.add_module("b", _Cast())
    finder = FirstInvalidOp({id(m): name for name, m in model.named_modules()})
    with finder.watching():
        model(torch.zeros(2, 3, requires_grad=True)).sum().backward()  # sqrt(0): an infinite derivative
    assert finder.in_backward is not None and finder.in_backward["op"] == "_SqrtBackward"
    assert finder.in_backward["module"] is None

"""Tests for torchdoctor.numerics.fp32 (keep_fp32 / Fp32Guard) on real modules."""

from __future__ import annotations

import copy
import inspect
import pickle
import re

import pytest
import torch
from torch import nn

from torchdoctor.numerics.fp32 import Fp32Guard, keep_fp32

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

FP16_MAX = torch.finfo(torch.float16).max


class _FF(nn.Module):
    """A gated feed-forward shaped like T5's, recording whether autocast was on inside it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(d, 4 * d, bias=False)
        self.wi_1 = nn.Linear(d, 4 * d, bias=False)
        self.wo = nn.Linear(4 * d, d, bias=False)
        self.autocast_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return self.wo(nn.functional.gelu(self.wi_0(x)) * self.wi_1(x))


class _Net(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([_FF(d), _FF(d)])
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _overflowing_linear() -> tuple[nn.Linear, torch.Tensor]:
    """A Linear whose output (64 * 40 * 40 = 102400) exceeds fp16's 65504."""
    lin = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.fill_(40.0)
    return lin, torch.full((2, 64), 40.0)


def test_autocast_fp16_region_computes_in_fp32() -> None:
    net = _net()
    x = torch.randn(4, 16)
    dtypes: dict[str, torch.dtype] = {}
    for name, module in net.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    with torch.autocast("cpu", dtype=torch.float16):
        guard = keep_fp32(net.blocks[1], model=net)
        net(x)
        assert torch.is_autocast_enabled("cpu")  # re-enabled after the region
    guard.remove()
    assert dtypes["blocks.1"] == torch.float32
    assert dtypes["blocks.1.wi_0"] == dtypes["blocks.1.wo"] == torch.float32
    assert dtypes["blocks.0"] == dtypes["blocks.0.wo"] == torch.float16
    assert dtypes["out"] == torch.float16  # autocast still applies downstream
    assert net.blocks[1].autocast_seen == [False]
    assert net.blocks[0].autocast_seen == [True]


def test_half_model_overflow_becomes_finite() -> None:
    lin, x = _overflowing_linear()
    lin.half()
    assert torch.isinf(lin(x.half())).all()
    with keep_fp32(lin):
        y = lin(x.half())
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert torch.allclose(y, torch.full_like(y, 64 * 40.0 * 40.0))
    # The parameters themselves are untouched: still fp16 nn.Parameters, nothing added.
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.dtype == torch.float16
    assert list(lin.state_dict()) == ["weight"]


def test_gradients_reach_fp16_params_in_their_dtype() -> None:
    reference = _net()
    half = copy.deepcopy(reference).half()
    x = torch.randn(4, 16)
    reference(x).sum().backward()
    with keep_fp32(half):
        xh = x.half().requires_grad_()
        out = half(xh)
        assert out.dtype == torch.float32
        out.sum().backward()
    assert xh.grad is not None and xh.grad.dtype == torch.float16
    for (name, p_ref), p_half in zip(reference.named_parameters(), half.parameters()):
        assert p_half.grad is not None, name
        assert p_half.grad.dtype == torch.float16, name
        # fp16 weights rounded, fp32 compute: gradients agree to fp16 precision.
        torch.testing.assert_close(p_half.grad.float(), p_ref.grad, rtol=2e-2, atol=2e-2)


def test_state_dict_unchanged_and_loadable() -> None:
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with keep_fp32(net, "blocks.*"):
        net(torch.randn(2, 16)).sum().backward()
        state = net.state_dict()
        assert list(state) == list(before)
        assert all(torch.equal(state[k], before[k]) for k in before)
        net.load_state_dict(_net(seed=1).state_dict())
    assert torch.equal(net.inp.weight, _net(seed=1).inp.weight)


def test_no_grad_and_cast_output() -> None:
    lin, x = _overflowing_linear()
    lin.half()
    lin.weight.data.fill_(0.5)
    with torch.no_grad(), keep_fp32(lin, cast_output=True):
        y = lin(x.half())
    assert y.dtype == torch.float16
    assert not y.requires_grad
    assert torch.isfinite(y).all()


def test_remove_restores_bit_identical_behaviour() -> None:
    net = _net()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        before = net(x)
        guard = keep_fp32(net, re.compile(r"blocks\.\d"))
        during = net(x)
        guard.remove()
        after = net(x)
    assert not torch.equal(before, during)  # the guard did change the numerics
    assert torch.equal(before, after)
    assert all("forward" not in m.__dict__ for m in net.modules())
    guard.remove()  # a second remove does nothing
    assert not guard.active


def test_remove_puts_back_a_previous_instance_forward() -> None:
    lin, x = _overflowing_linear()
    previous = lin.forward  # a bound method, like accelerate's convert_outputs_to_fp32 installs
    lin.forward = previous
    with keep_fp32(lin):
        assert lin.forward is not previous
    assert lin.__dict__["forward"] is previous


def test_signature_is_the_wrapped_forward() -> None:
    net = _net()
    with keep_fp32(net):
        assert list(inspect.signature(net.forward).parameters) == ["x"]


def test_pattern_glob_regex_and_names() -> None:
    net = _net()
    with keep_fp32(net, "blocks.*") as guard:
        # descendants of a match (blocks.0.wi_0, ...) are not guarded separately
        assert guard.names == ["blocks.0", "blocks.1"]
        assert all(m is net.get_submodule(n) for n, m in guard.modules)
    with keep_fp32(net, re.compile(r"blocks\.\d\.wi_.")) as guard:
        assert guard.names == ["blocks.0.wi_0", "blocks.0.wi_1", "blocks.1.wi_0", "blocks.1.wi_1"]
    with keep_fp32("blocks.1.wo", model=net) as guard:
        assert guard.names == ["blocks.1.wo"]
    with keep_fp32([net.out, net.blocks[0]], model=net) as guard:
        assert guard.names == ["out", "blocks.0"]
    with keep_fp32(net.out) as guard:
        assert guard.modules == [("", net.out)]
        assert "<Linear>" in repr(guard)


def test_pattern_without_match_lists_close_names() -> None:
    net = _net()
    with pytest.raises(ValueError, match="matches no module") as info:
        keep_fp32(net, "blocks.1.w0")
    assert "blocks.1.wo" in str(info.value)
    with pytest.raises(ValueError, match="regex"):
        keep_fp32(net, re.compile("decoder.*"))


@pytest.mark.parametrize(
    ("target", "kwargs", "message"),
    [
        (torch.zeros(2), {}, "must be an nn.Module"),
        (lambda x: x, {}, "must be an nn.Module"),
        ([], {}, "non-empty"),
        (nn.ModuleList([nn.Linear(2, 2)]), {}, "no forward of its own"),
        ("blocks.*", {}, "needs model="),
        (nn.Linear(2, 2), {"model": nn.Sequential(nn.Linear(2, 2))}, "not a submodule"),
    ],
)
def test_bad_targets_raise_value_error(target: object, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        keep_fp32(target, **kwargs)  # type: ignore[arg-type]


def test_double_apply_is_refused_and_atomic() -> None:
    net = _net()
    guard = keep_fp32(net.blocks[1], model=net)
    with pytest.raises(RuntimeError, match="blocks.1 is already kept in fp32"):
        keep_fp32(net, "blocks.*")
    assert "forward" not in net.blocks[0].__dict__  # nothing half-applied
    guard.remove()
    keep_fp32(net, "blocks.*").remove()


def test_exception_inside_region_restores_state() -> None:
    lin = nn.Linear(4, 4).half()
    with keep_fp32(lin), torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError):
        lin(torch.zeros(3, 5, dtype=torch.float16))  # wrong width
    assert torch.is_autocast_enabled("cpu") is False
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.dtype == torch.float16


def test_in_place_buffer_updates_are_kept() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).half()
    x = (torch.randn(32, 4) * 3 + 5).half()
    with keep_fp32(bn):
        bn(x)
    assert bn.running_mean.dtype == torch.float16
    assert bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(bn.running_mean.float(), 0.1 * x.float().mean(0), rtol=1e-2, atol=1e-2)


def test_shared_parameter_gets_one_copy_and_full_gradient() -> None:
    shared = nn.Linear(4, 4, bias=False)
    net = nn.Sequential(shared, nn.ReLU(), shared).half()
    x = torch.rand(2, 4).half()
    with keep_fp32(net):
        net(x).sum().backward()
    grad = shared.weight.grad
    shared.weight.grad = None
    reference = copy.deepcopy(net).float()
    reference(x.float()).sum().backward()
    assert grad is not None and grad.dtype == torch.float16
    torch.testing.assert_close(grad.float(), reference[0].weight.grad, rtol=1e-2, atol=1e-2)


def test_pickle_and_deepcopy_keep_the_guard() -> None:
    net = _net().half()
    x = torch.randn(2, 16).half()
    guard = keep_fp32(net, "blocks.*", cast_output=True)  # net.out is an fp16 Linear
    expected = net(x)
    for clone in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        assert torch.equal(clone(x), expected)
        found = Fp32Guard.attached_to(clone)
        assert found.names == ["blocks.0", "blocks.1"]
        found.remove()
        assert all("forward" not in m.__dict__ for m in clone.modules())
    guard.remove()
    assert b"_Fp32Forward" not in pickle.dumps(net)


def test_transformers_t5_glob_from_the_guide() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=3,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(0, 64, (2, 8))
    dtypes: dict[str, torch.dtype] = {}
    target = model.get_submodule("encoder.block.2.layer.1.DenseReluDense")
    target.register_forward_hook(lambda m, i, o: dtypes.__setitem__("ffn", o.dtype))
    target.wo.register_forward_hook(lambda m, i, o: dtypes.__setitem__("wo", o.dtype))
    with keep_fp32(model, "encoder.block.*.layer.1.DenseReluDense") as guard:
        assert guard.names == [f"encoder.block.{i}.layer.1.DenseReluDense" for i in range(3)]
        # Trainer reads forward's signature to drop unused dataset columns.
        assert list(inspect.signature(target.forward).parameters) == ["hidden_states"]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert dtypes == {"ffn": torch.float32, "wo": torch.float32}
    assert torch.isfinite(loss)
    assert target.wo.weight.grad is not None

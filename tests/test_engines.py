"""Engine adapters and wrappers in one process: names and classes looked through, optimizers found or warned
about, accelerate's prepared model and optimizer, loss scalers of both libraries behind one interface."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.engines import DeepSpeedEngine, Engine, MonitorWarning, select_engine
from torchdoctor.numerics.engines.scalers import LossScaler
from torchdoctor.numerics.engines.wrappers import (
    clean_name,
    named_user_modules,
    unwrap_model,
    user_class_name,
    wrapper_chain,
)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize(
    "name, clean",
    [
        ("blocks.0._fsdp_wrapped_module.fc1", "blocks.0.fc1"),
        ("_orig_mod.body.2", "body.2"),
        ("layers.1._checkpoint_wrapped_module.attn", "layers.1.attn"),
        ("encoder.block.2", "encoder.block.2"),
        ("", ""),
        ("_private_user_module.x", "_private_user_module.x"),  # only the wrappers' own segments go
    ],
)
def test_wrapper_segments_leave_names(name, clean):
    assert clean_name(name) == clean


def test_wrappers_around_the_root_and_inside_are_looked_through():
    model = mlp()
    model[2] = torch.compile(model[2], backend="eager")  # a compiled child: OptimizedModule around a Linear
    wrapped = torch.compile(nn.DataParallel(model), backend="eager")
    assert unwrap_model(wrapped) is model
    names = [n for n, _ in named_user_modules(wrapped)]
    assert names == ["", "0", "1", "2"]  # no "_orig_mod", no "module", no duplicate for the wrapper itself
    assert user_class_name(model) == "Sequential"


def test_fsdp2_classes_are_the_users():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    cls = type("FSDPLinear", (fsdp.FSDPModule, nn.Linear), {})
    cls.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_init"  # what fully_shard makes
    module = nn.Linear(2, 2)
    module.__class__ = cls
    assert user_class_name(module) == "Linear"


def test_an_optimizer_without_step_hooks_is_wrapped_and_still_stops_the_update():
    class Plain:  # anything with step() / zero_grad(): e.g. a third-party optimizer wrapper
        def __init__(self, params):
            self.inner = torch.optim.SGD(params, lr=0.1)

        def step(self):
            self.inner.step()

        def zero_grad(self):
            self.inner.zero_grad()

    model = mlp()
    opt = Plain(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # hookable: no warning
        mon = NumericsMonitor(model, optimizer=opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError) as exc:
        model(torch.full((2, 4), float("inf"))).sum().backward()
        opt.step()
    assert exc.value.first.module == "0"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    mon.close()
    assert "step" not in opt.__dict__ and "zero_grad" not in opt.__dict__  # put back


def test_an_unhookable_optimizer_is_a_warning_and_detection_still_holds():
    model = mlp()
    with pytest.warns(MonitorWarning, match="still detected .* a bad update cannot be stopped"):
        mon = NumericsMonitor(model, optimizer=object())
    assert mon.optimizer is None
    with pytest.raises(NonFiniteError) as exc:  # checked when the backward ends, as without an optimizer
        model(torch.full((2, 4), float("nan"))).sum().backward()
        model(torch.ones(2, 4))
    assert exc.value.first.module == "0"
    mon.close()


def test_accelerate_prepare_then_the_monitor(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    model = mlp()
    # an HF Trainer test earlier in the same process may have set accelerate's process-wide state
    from accelerate.state import AcceleratorState, PartialState
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    prepared, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with NumericsMonitor(prepared, optimizer=opt, report_dir=tmp_path) as mon:
        assert mon.optimizer is opt.optimizer  # the torch optimizer inside AcceleratedOptimizer
        for step in range(3):
            x = torch.randn(2, 4)
            if step == 2:
                x[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            try:
                acc.backward(prepared(x).float().sum())
                opt.step()
                opt.zero_grad()
            except NonFiniteError as e:
                assert e.first.step == 2 and e.first.module == "0"
                break
        else:
            pytest.fail("the inf was not caught")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_engine_selection():
    model = mlp()
    assert type(select_engine(wrapper_chain(model), torch.optim.SGD(model.parameters(), lr=1), None)) is Engine
    ds = pytest.importorskip("deepspeed")
    del ds
    param = nn.Parameter(torch.zeros(0))
    param.ds_id = 0  # a ZeRO-3 parameter: DeepSpeed even without its engine at hand
    holder = nn.Module()
    holder.p = param
    assert isinstance(select_engine(wrapper_chain(holder), None, None), DeepSpeedEngine)


def test_loss_scalers_of_both_libraries():
    scaler = LossScaler(torch.amp.GradScaler("cpu", init_scale=8.0))
    assert not scaler.deepspeed and scaler.hook_name == "update" and scaler.floor is None
    assert scaler.collapsed(0.5, 1.0) and not scaler.collapsed(2.0, 1.0)
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    ds = LossScaler(loss_scaler.DynamicLossScaler(init_scale=4.0, scale_window=10, min_scale=2.0, delayed_shift=1,
                                                  consecutive_hysteresis=False))
    assert ds.deepspeed and ds.dynamic and ds.hook_name == "update_scale" and ds.scale() == 4.0 and ds.floor == 2.0
    assert ds.collapsed(2.0, 1.0) and not ds.collapsed(4.0, 1.0)  # DeepSpeed's floor, not only min_loss_scale
    assert not LossScaler(loss_scaler.LossScaler(scale=1.0), hooked=False).dynamic  # a static scale skips nothing
    with pytest.raises(TypeError, match="no update\\(\\) method"):
        NumericsMonitor(mlp(), scaler=object())

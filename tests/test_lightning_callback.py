"""NumericsCallback inside a real Lightning Trainer on CPU, and the monitor on what Fabric sets up."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning as L  # noqa: E402

import torchdoctor  # noqa: E402
from torchdoctor import NonFiniteError, NumericsMonitor  # noqa: E402
from torchdoctor.integrations.lightning import LightningNumericsCallback, NumericsCallback  # noqa: E402

BAD_STEP = 3  # the optimizer step (0-based, as the monitor counts) whose forward goes inf


class Blowup(nn.Module):
    """Multiplies by 1e39 (inf in fp32) from the forward of batch ``at`` on (counted across every forward): a fault
    that stays, as a replay of the bad step finds it again."""

    def __init__(self, at: int | None):
        super().__init__()
        self.at = at
        self.calls = 0

    def forward(self, x):
        hit = self.at is not None and self.calls >= self.at
        self.calls += 1
        return x * 1e39 if hit else x


class Net(nn.Module):
    def __init__(self, bad_at: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.boom = Blowup(bad_at)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.boom(self.act(self.fc1(x))))


class Regressor(L.LightningModule):
    def __init__(self, bad_at: int | None = None, manual: bool = False):
        super().__init__()
        self.net = Net(bad_at)
        self.automatic_optimization = not manual
        self.snapshots: list[dict[str, torch.Tensor]] = []  # the weights at the start of each batch

    def on_train_batch_start(self, batch, batch_idx):
        self.snapshots.append({k: v.detach().clone() for k, v in self.state_dict().items()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)


def _trainer(tmp_path, callback, steps=6, **kw):
    from lightning.pytorch.loggers import CSVLogger

    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=CSVLogger(str(tmp_path), name="logs"), callbacks=[callback],
        num_sanity_val_steps=0, **kw,
    )


def _fit_until_error(tmp_path, module, callback, **kw):
    trainer = _trainer(tmp_path, callback, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own (few workers, no logger folder ...)
        with pytest.raises(NonFiniteError) as exc:
            trainer.fit(module, _loader())
    return trainer, exc.value


def _check_report(trainer, err, name="net.boom"):
    assert err.first.module == name
    assert "_forward_module" not in err.report
    log_dir = trainer.log_dir
    txt = f"{log_dir}/torchdoctor-nonfinite-rank0.txt"
    with open(f"{log_dir}/torchdoctor-nonfinite-rank0.json") as f:
        data = json.load(f)
    with open(txt) as f:
        assert name in f.read()
    assert "_forward_module" not in json.dumps(data)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_inf_forward_names_the_module_and_writes_to_log_dir(tmp_path, precision):
    module = Regressor(bad_at=BAD_STEP)
    cb = NumericsCallback()
    trainer, err = _fit_until_error(tmp_path, module, cb, precision=precision)
    _check_report(trainer, err)
    assert (err.first.step, err.first.phase) == (BAD_STEP, "fwd")
    assert cb.monitor is None  # closed when fit() raised
    assert not any(m._forward_hooks for m in module.modules())


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_bad_step_is_stopped_before_its_update(tmp_path, manual):
    module = Regressor(bad_at=BAD_STEP, manual=manual)
    trainer, err = _fit_until_error(tmp_path, module, NumericsCallback())
    _check_report(trainer, err)
    assert err.first.step == BAD_STEP
    assert len(module.snapshots) == BAD_STEP + 1
    before = module.snapshots[BAD_STEP]
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_gradient_accumulation(tmp_path):
    # 2 batches a step: forward number 7 is in step 3 (batches 6 and 7)
    module = Regressor(bad_at=2 * BAD_STEP + 1)
    trainer, err = _fit_until_error(tmp_path, module, NumericsCallback(), accumulate_grad_batches=2)
    _check_report(trainer, err)
    assert err.first.step == BAD_STEP  # the optimizer step, not the batch
    before = module.snapshots[2 * BAD_STEP]  # the weights at the start of step 3
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_16_mixed_scaler_overflows_are_recorded_not_raised(tmp_path):
    # on CPU precision="16-mixed" turns into bf16; a MixedPrecision plugin with a CPU GradScaler keeps fp16
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # every step's scaled gradients overflow
    cb = NumericsCallback()
    seen = {}
    orig = cb.on_fit_end

    def on_end(trainer, pl_module):
        seen["scaler"], seen["overflows"] = cb.monitor.scaler, list(cb.monitor.overflows)
        return orig(trainer, pl_module)

    cb.on_fit_end = on_end
    trainer = _trainer(tmp_path, cb, steps=3, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Regressor(bad_at=None), _loader())
    assert seen["scaler"] is scaler
    assert [o.step for o in seen["overflows"]] == [0, 1, 2]
    # training_step is the model's call: the scaled loss's gradient overflowed in its own code, after net returned
    assert (seen["overflows"][0].module, seen["overflows"][0].slot) == ("", "code after net.fc2")
    # the scaler skipped every step of the run: not raised, but a finding of its own at the end (no update applied)
    [report] = tmp_path.rglob("torchdoctor-nonfinite-rank0.json")
    saved = json.loads(report.read_text())
    assert saved["cause"] == "numerics.scaler_never_stepped" and "3 of 3 step(s) overflowed" in saved["diagnosis"]


def test_healthy_run_writes_no_report(tmp_path):
    module = Regressor(bad_at=None)
    cb = NumericsCallback(grads="modules")
    seen = {}
    orig = cb.on_fit_end

    def on_end(trainer, pl_module):
        seen["steps"] = cb.monitor.step_index
        return orig(trainer, pl_module)

    cb.on_fit_end = on_end
    trainer = _trainer(tmp_path, cb, steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader())
    assert seen["steps"] == 4
    assert cb.monitor is None
    assert not list(tmp_path.rglob("torchdoctor-*"))
    assert not any(m._forward_hooks for m in module.modules())


def test_report_dir_option_and_refusals(tmp_path):
    where = tmp_path / "reports"
    module = Regressor(bad_at=1)
    _fit_until_error(tmp_path, module, NumericsCallback(report_dir=str(where)))
    assert (where / "torchdoctor-nonfinite-rank0.txt").exists()
    with pytest.raises(TypeError, match="takes 'optimizer' from the Trainer"):
        NumericsCallback(optimizer=object())
    with pytest.raises(TypeError, match="NumericsCallback: .*foo"):
        NumericsCallback(foo=1)
    assert torchdoctor.LightningNumericsCallback is LightningNumericsCallback


# ---------------------------------------------------------------- Fabric
def test_fabric_wrappers_are_looked_through(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    original = Net(bad_at=1)
    opt = torch.optim.SGD(original.parameters(), lr=0.01)
    model, fopt = fabric.setup(original, opt)
    assert type(model).__name__ == "_FabricModule"
    x, y = next(iter(_loader()))
    mon = NumericsMonitor(model, fopt, report_dir=str(tmp_path))
    try:
        assert mon.model is original
        # the step hooks land on the torch optimizer (FabricSGD passes their attributes through to it)
        assert mon.optimizer is opt or mon.optimizer.optimizer is opt
        assert opt._optimizer_step_pre_hooks
        for i in range(2):
            fopt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if i == 0:
                fabric.backward(loss)
                fopt.step()
            else:
                before = {k: v.clone() for k, v in original.state_dict().items()}
                with pytest.raises(NonFiniteError) as exc:
                    fabric.backward(loss)
                    fopt.step()
    finally:
        mon.close()
    name = exc.value.first.module
    assert name == "boom"
    assert "_forward_module" not in exc.value.report
    for k, v in original.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torchdoctor.keep_fp32(original, name):
        assert original.boom(torch.ones(1)).dtype == torch.float32
    with torchdoctor.keep_fp32(model, name):  # the reported name also resolves on what Fabric set up
        pass

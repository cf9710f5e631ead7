"""NumericsMonitor on real transformers models: detection, localisation, syncs, lifecycle."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import boom_mlp, gpt2_batch, overflowing_gpt2, t5_batch, tiny_gpt2, tiny_t5
from torchdoctor import AbortAfterStep, NonFiniteError, NumericsMonitor
from torchdoctor.numerics.engines import MonitorWarning
from torchdoctor.syncs import SyncCounter

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)


def train_step(model, opt, batch):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def syncs_of_step(model, opt, batch) -> int:
    with SyncCounter() as c:
        train_step(model, opt, batch)
    return c.count


@pytest.mark.parametrize("grads", ["none", "params", "modules"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "fp16-autocast"])
def test_full_step_makes_at_most_one_more_host_sync(grads, precision):
    model = tiny_t5()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = t5_batch()
    dtype = torch.float16 if precision.startswith("fp16") else torch.bfloat16

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # AdamW state exists from here on
    with SyncCounter() as bare:
        step()
    with NumericsMonitor(model, optimizer=opt, grads=grads) as mon:
        step()
        with SyncCounter() as watched:
            step()
        assert mon.step_index == 2
    # AdamW on CPU calls .item() once per parameter tensor: the bare step is not sync-free
    assert bare.count > 0
    assert watched.count - bare.count <= 1


def test_forward_overflow_names_module_and_leaves_weights_untouched(tmp_path):
    model = overflowing_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # one clean step on a copy to give the optimizer real state
    good = tiny_gpt2().half()
    batch = gpt2_batch()
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path / "r") as mon:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(NonFiniteError) as exc:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
        err = exc.value
        assert isinstance(err, ValueError)
        assert err.first.phase == "fwd"
        assert err.first.module == "transformer.h.1.mlp.c_proj"
        assert err.first.cls == "Conv1D"
        assert err.first.slot == "output"
        assert err.first.value == "inf"
        assert err.first.step == 0
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert opt.state == {} or all("momentum_buffer" not in s for s in opt.state.values())
        assert mon.report is err.details
    txt = (tmp_path / "r" / "torchdoctor-nonfinite-rank0.txt").read_text()
    assert "transformer.h.1.mlp.c_proj Conv1D" in txt and "<-- first non-finite value" in txt
    data = json.loads((tmp_path / "r" / "torchdoctor-nonfinite-rank0.json").read_text())
    assert data["first"]["module"] == "transformer.h.1.mlp.c_proj"
    assert data["frames"][-1]["module"] == "transformer.h.1.mlp.c_proj"
    assert len(data["frames"]) <= 22
    del good


def test_optimizer_state_is_bit_identical_after_detection():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = gpt2_batch()
    with NumericsMonitor(model, optimizer=opt):
        train_step(model, opt, batch)  # clean step: AdamW state exists
        params = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict())
        bad = dict(batch)
        with torch.no_grad():
            model.transformer.wpe.weight[3, 0] = float("nan")  # broken weight, as after a bad update
        params[1] = model.transformer.wpe.weight.detach().clone()
        with pytest.raises(NonFiniteError) as exc:
            train_step(model, opt, bad)
        assert exc.value.first.module == "transformer.wpe"
        assert exc.value.first.slot == "weight"
        assert "already nan" in exc.value.report
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q) or (p.isnan() == q.isnan()).all()
    after = opt.state_dict()
    for k, s in state["state"].items():
        for name, v in s.items():
            assert torch.equal(after["state"][k][name], v), (k, name)


def test_backward_only_blowup_is_localized_at_module_level():
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with NumericsMonitor(model, optimizer=opt, grads="modules") as mon:
        out = model(x)
        out.sum().backward()
        with pytest.raises(NonFiniteError) as exc:
            opt.step()
    first = exc.value.first
    assert first.phase == "bwd"
    assert first.module == "boom"
    assert first.slot == "grad_input"
    assert "blow-up starts in the backward of boom" in exc.value.report
    assert mon.step_index == 0


@pytest.mark.parametrize("step", [0, 1])
def test_backward_blowup_at_params_level_is_named_where_it_began(step):
    """Every module watched at grads="params": the first step records module-level gradients too, and a later step's
    backward fault is replayed with them -- either way boom is named, no option needs to be advised."""
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.boom.enabled = False
    with NumericsMonitor(model, optimizer=opt, watch="every-module"):
        for _ in range(step):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        model.boom.enabled = True
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(NonFiniteError) as exc:
            opt.step()
    assert (exc.value.first.step, exc.value.first.phase) == (step, "bwd")
    assert (exc.value.first.module, exc.value.first.slot) == ("boom", "grad_input")
    assert "grads='modules'" not in exc.value.report
    assert exc.value.details.replay == "reproduced"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_backward_blowup_at_the_default_is_replayed_and_named_where_it_began():
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with NumericsMonitor(model, optimizer=opt, watch="boundaries"):
        model(torch.randn(4, 8)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(NonFiniteError) as exc:
            opt.step()
    first = exc.value.first
    assert (first.phase, first.module, first.slot) == ("bwd", "boom", "grad_input")  # as grads="modules" names it
    assert exc.value.details.replay == "reproduced"
    assert "grads='modules'" not in exc.value.report  # the module is named: no advice to name it
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    del grads


def _scaled_run(steps, mon_kwargs, pass_scaler=True):
    """A small tanh MLP under a GradScaler starting at 2**127: the first steps overflow, then it recovers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with NumericsMonitor(model, optimizer=opt, scaler=scaler if pass_scaler else None, **mon_kwargs) as mon:
        for _ in range(steps):
            loss = model(x).pow(2).mean() * 64
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return model, mon


@pytest.mark.parametrize("grads", ["params", "modules"])
def test_gradscaler_overflows_are_recorded_not_raised(grads):
    model, mon = _scaled_run(12, {"grads": grads})
    assert len(mon.overflows) >= 2  # the first steps overflow, then the scaler recovers
    assert [e.step for e in mon.overflows] == list(range(len(mon.overflows)))
    assert mon.overflows[0].scale == 2.0**127  # the scale the overflowing step ran at
    assert mon.step_index == 12
    assert len(mon.overflows) < 12
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if grads == "params":  # with every module watched, switched itself to localize the next overflow (at the
        # boundaries each overflow is replayed instead)
        assert mon.grads == ("params" if mon.watch_level == "boundaries" else "modules")
        assert all(o.module is not None for o in mon.overflows)


@pytest.mark.parametrize("watch", ["boundaries", "every-module"])
@pytest.mark.parametrize("grads", ["params", "modules"])
def test_skipped_steps_are_seen_without_passing_the_scaler(grads, watch):
    _, mon = _scaled_run(12, {"grads": grads, "watch": watch}, pass_scaler=False)
    assert len(mon.overflows) >= 2 and mon.overflows[0].step == 0
    assert mon.overflows[0].scale is None
    assert mon.overflows[0].module is not None
    # the gradient at the model's output: x 2**127 it is already inf as the loss sends it in -- seen as the first step
    # ran (every module and its gradients watched), and by the replay of a later one, at every level
    assert [(o.module, o.slot) for o in mon.overflows[:2]] == [("", "grad_output")] * 2


def test_collapsing_loss_scale_aborts():
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.randn(4, 8)
    with NumericsMonitor(model, optimizer=opt, scaler=scaler, grads="modules") as mon, pytest.raises(
        NonFiniteError
    ) as exc:
        for _ in range(10):
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert "loss scale collapsed" in exc.value.report
    assert [e.scale for e in mon.overflows] == [4.0, 2.0, 1.0, 0.5]  # 0.5 < min_loss_scale=1
    assert exc.value.first.module == "boom"


def test_scaler_update_is_restored_on_close():
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    mon = NumericsMonitor(model, optimizer=opt, scaler=scaler)
    assert "update" in scaler.__dict__
    mon.close()
    assert "update" not in scaler.__dict__


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputation_is_not_a_new_frame(reentrant):
    plain = tiny_gpt2()
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    plain.train()
    ckpt.train()
    batch = gpt2_batch()
    counts = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with NumericsMonitor(model, optimizer=opt, grads="modules") as mon:
            train_step(model, opt, batch)
            frames = mon._steps.history.records[-1].frames
            counts[name] = (
                sum(f.phase == "fwd" for f in frames),
                sum(f.phase == "bwd" for f in frames),
                mon.step_index,
            )
    assert counts["ckpt"][0] == counts["plain"][0]
    assert counts["ckpt"][2] == counts["plain"][2] == 1
    assert counts["ckpt"][1] == counts["plain"][1] > 0  # gradients still measured once per module output


def test_shared_module_and_no_grad_inference_count_steps_per_forward():
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    with NumericsMonitor(model) as mon, torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))
        assert mon.step_index == 3
        names = [f.info.name for f in mon._steps.history.records[-1].frames]
    assert names.count("0") == 2  # the shared module's two calls, under its first name


class Odd(torch.nn.Module):
    """Returns every awkward kind of value a forward can return."""

    def forward(self, x, *, mask=None, flag=True, ids=None):
        return {
            "ints": torch.arange(5),
            "bools": x > 0,
            "empty": x[:0],
            "complex": torch.complex(x, x),
            "meta": torch.empty(3, device="meta"),
            "none": None,
            "text": "hello",
            "nested": [x, (x * 2, None)],
        }


def test_awkward_values_never_crash_and_are_labelled(capsys):
    model = torch.nn.Sequential()
    model.add_module("odd", Odd())
    with NumericsMonitor(model.odd, trace_steps=[0]) as mon:
        model.odd(torch.randn(3), mask=torch.ones(3, dtype=torch.bool), ids=torch.tensor([1, 2]))
    out = capsys.readouterr().out
    for label in (
        "input[mask]", "input[ids]", "output[ints]", "output[bools]", "output[empty]",
        "output[complex]", "output[meta]", "output[none]", "output[text]", "output[nested][1][0]",
    ):
        assert label in out, label
    assert "empty fwd   output[empty]" in out
    assert "meta fwd   output[meta]" in out
    assert mon.step_index == 1
    trace = [json.loads(x) for x in Path("torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    assert trace[0]["module"] == "" and trace[0]["class"] == "Odd"


class Fails(torch.nn.Module):
    def forward(self, x):
        if x.abs().sum() > 1e6:
            raise RuntimeError("user error inside forward")
        return x * 2


def test_forward_that_raises_keeps_hooks_consistent():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Fails())
    with NumericsMonitor(model) as mon:
        with pytest.raises(RuntimeError, match="user error"):
            model(torch.full((1, 2), 1e7))
        assert mon._recorder.rec.frames == []  # the failed forward left nothing behind
        model(torch.ones(1, 2))
        frames_of_one_forward = len(mon._recorder.rec.frames)
        model(torch.ones(1, 2))  # a training forward's step closes when the next one starts
        assert mon.step_index == 1 and len(mon._recorder.rec.frames) == frames_of_one_forward
    assert not any(m._forward_hooks for m in model.modules())


def test_close_removes_every_hook_and_double_attach_is_refused():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    mon = NumericsMonitor(model, optimizer=opt)
    with pytest.raises(RuntimeError, match="already watched"):
        NumericsMonitor(model.transformer.h[0])
    mon.close()
    mon.close()  # twice is fine
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    with NumericsMonitor(model, optimizer=opt):  # and it can be attached again
        train_step(model, opt, gpt2_batch())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grads": "everything"}, "grads='everything' is not one of"),
        ({"max_frames": -1}, "max_frames must be an int >= 0"),
        ({"max_frames": 2.5}, "max_frames must be an int >= 0"),
        ({"trace_steps": "12"}, "trace_steps must be a list of step numbers"),
        ({"trace_steps": 1}, "trace_steps must be a list of step numbers"),
        ({"trace_steps": [1.7]}, "trace_steps must be a list of step numbers"),
        ({"abort_after_step": -1}, "abort_after_step must be an int >= 0"),
        ({"abort_after_step": "2"}, "abort_after_step must be an int >= 0"),
        ({"max_consecutive_overflows": 0}, "max_consecutive_overflows must be an int >= 1"),
        ({"min_loss_scale": -1}, "min_loss_scale must be a number >= 0"),
    ],
)
def test_bad_arguments_are_clear(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NumericsMonitor(torch.nn.Linear(2, 2), **kwargs)
    with pytest.raises(TypeError, match="needs an nn.Module"):
        NumericsMonitor("model")
    with pytest.warns(MonitorWarning, match="a bad update cannot be stopped"):  # an unhookable optimizer
        NumericsMonitor(torch.nn.Linear(2, 2), optimizer=object()).close()
    with pytest.raises(TypeError, match="report_dir must be a path"):
        NumericsMonitor(torch.nn.Linear(2, 2), report_dir=3)
    with pytest.raises(TypeError, match="stream must be a text stream"):
        NumericsMonitor(torch.nn.Linear(2, 2), stream="out.txt")


def test_report_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        NumericsMonitor(torch.nn.Linear(2, 2), report_dir=tmp_path / "afile")


def test_trace_steps_and_abort_after_step(capsys, tmp_path):
    model = tiny_t5()
    opt = torch.optim.AdamW(model.parameters())
    batch = t5_batch()
    with NumericsMonitor(model, optimizer=opt, trace_steps=[1], abort_after_step=2, report_dir=tmp_path) as mon:
        with pytest.raises(AbortAfterStep, match="after step 2"):
            for _ in range(10):
                train_step(model, opt, batch)
        assert mon.step_index == 3
    out = capsys.readouterr().out
    assert "*** Starting step=1 ***" in out and "*** Starting step=0 ***" not in out
    rows = [json.loads(x) for x in (tmp_path / "torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    assert rows and {r["step"] for r in rows} == {1}
    assert {r["phase"] for r in rows} == {"fwd"}
    assert any(r["module"] == "encoder.block.0.layer.1.DenseReluDense.wo" for r in rows)
    wo = next(r for r in rows if r["module"] == "encoder.block.0.layer.1.DenseReluDense.wo")
    assert [s["slot"] for s in wo["slots"]] == ["weight", "input[0]", "output"]
    assert all(isinstance(s["abs_max"], float) and math.isfinite(s["abs_max"]) for s in wo["slots"])


def test_mark_adds_an_ordered_frame_and_can_be_the_first_bad_one():
    lin = torch.nn.Linear(4, 4)
    with NumericsMonitor(lin) as mon:
        y = lin(torch.ones(1, 4))
        with SyncCounter() as c:
            mon.mark(y, "after lin")
            mon.mark(y / 0.0, "divided by zero")
        assert c.count == 0
        with pytest.raises(NonFiniteError) as exc:
            mon.step()
    assert exc.value.first.module == "divided by zero"
    assert exc.value.first.phase == "mark"


def test_evaluation_forwards_between_steps_are_checked_on_their_own():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    batch = gpt2_batch()
    with NumericsMonitor(model, optimizer=opt) as mon:
        train_step(model, opt, batch)
        with torch.no_grad():
            for _ in range(5):
                with SyncCounter() as c:
                    model(**batch)
                assert c.count == 1  # one read per evaluation forward
        assert mon._recorder.rec.frames == []  # nothing piled onto the next training step
        train_step(model, opt, batch)
        assert mon.step_index == 2
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("inf")
            with pytest.raises(NonFiniteError) as exc:
                model(**batch)
    assert exc.value.first.module == "transformer.h.0.mlp.c_fc"
    assert "torch.no_grad()" in exc.value.report


def test_a_model_with_broken_weights_is_refused_at_attach_without_leaving_hooks():
    model = tiny_gpt2()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")  # tied to the embedding: transformer.wte.weight
    with pytest.raises(NonFiniteError, match=r"parameter transformer\.wte\.weight .* already non-finite") as exc:
        NumericsMonitor(model)
    assert exc.value.first.module == "transformer.wte" and exc.value.first.slot == "weight"
    assert Path("torchdoctor-nonfinite-rank0.txt").exists()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_occasional_overflows_do_not_add_up_to_a_collapse():
    torch.manual_seed(0)
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    x = torch.randn(4, 8)
    with NumericsMonitor(model, optimizer=opt, scaler=scaler, max_consecutive_overflows=2) as mon:
        for i in range(9):
            model.boom.enabled = i % 3 == 0
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert [e.step for e in mon.overflows] == [0, 3, 6]  # never two in a row: no abort


def test_without_optimizer_steps_are_counted_by_step_and_backward_is_checked():
    model = boom_mlp()
    x = torch.randn(4, 8)
    with NumericsMonitor(model, grads="modules") as mon:
        model.boom.enabled = False  # healthy first
        for _ in range(3):
            model(x).sum().backward()
            mon.step()
        assert mon.step_index == 3
    model2 = boom_mlp()
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(model2, grads="modules"):
        model2(x).sum().backward()  # no step() and no optimizer: checked when the with block ends
    assert exc.value.first.phase == "bwd" and exc.value.first.module == "boom"


def test_scaler_without_optimizer_still_counts_steps_and_aborts():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(AbortAfterStep), NumericsMonitor(model, scaler=scaler, abort_after_step=1) as mon:
        for _ in range(5):
            scaler.scale(model(torch.randn(2, 8)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert mon.step_index == 2


class Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)  # nan for negative inputs


class LogThenSample(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.log = Log()

    def forward(self, x):
        return torch.multinomial(self.log(self.lin(x)).softmax(-1), 1)  # raises on the nan probabilities


def test_a_forward_that_raises_after_a_nan_still_reports_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(LogThenSample())
    with NumericsMonitor(model, report_dir=tmp_path) as mon, pytest.raises(RuntimeError) as exc:
        model(torch.randn(3, 4))
    assert mon.report is not None and mon.report.first.module == "0.log"
    assert "produced nan from finite inputs" in mon.report.diagnosis
    assert (tmp_path / "torchdoctor-nonfinite-rank0.txt").exists()
    if hasattr(exc.value, "__notes__"):
        assert any("torchdoctor" in n for n in exc.value.__notes__)


def test_causal_minus_inf_mask_is_not_a_false_alarm():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    assert torch.isinf(mask).any()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt, grads="modules") as mon:
        for _ in range(2):
            model(torch.randn(2, 5, 16), mask=mask, is_causal=True).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert mon.step_index == 2


def test_inference_mode_and_submodules_called_alone_under_no_grad():
    model = tiny_t5()
    batch = t5_batch()
    opt = torch.optim.AdamW(model.parameters())
    with NumericsMonitor(model, optimizer=opt) as mon:
        with torch.inference_mode():
            model(**batch)
        with torch.no_grad():
            for _ in range(3):
                model.encoder(input_ids=batch["input_ids"])  # as generate() does
        assert mon._recorder.rec.frames == []
        train_step(model, opt, batch)
        assert mon.step_index == 1


class SkipsBatches(torch.nn.Module):
    """a -> (maybe raise, as an OOM would) -> (poison when the batch says so: a data fault) -> b"""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        self.fail = False

    def forward(self, x):
        h = self.a(x)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return self.b(h * float("inf") if bool(x[0, 0] == 123.0) else h)


@pytest.mark.parametrize("grads", ["none", "params", "modules"])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_caught_failing_forward_does_not_blind_the_rest_of_the_step(grads, with_optimizer):
    torch.manual_seed(0)
    m = SkipsBatches()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    kwargs = {"optimizer": opt} if with_optimizer else {}
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(m, grads=grads, **kwargs):
        m(torch.randn(2, 4)).sum().backward()
        m.fail = True
        with pytest.raises(RuntimeError, match="out of memory"):
            m(torch.randn(2, 4))  # skipped, as OOM handlers do
        m.fail = False
        poisoned = torch.randn(2, 4)
        poisoned[0, 0] = 123.0
        m(poisoned).sum().backward()
        if with_optimizer:
            opt.step()
        else:
            m(torch.randn(2, 4))
    assert exc.value.first.phase == "fwd" and exc.value.first.module == "b"


class Interrupts(torch.nn.Module):
    interrupt = False

    def forward(self, x):
        if self.interrupt:
            raise KeyboardInterrupt
        return x * 1


def test_ctrl_c_inside_a_forward_does_not_leave_the_monitor_confused():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), Interrupts())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with NumericsMonitor(m, optimizer=opt) as mon:
        m[1].interrupt = True
        with pytest.raises(KeyboardInterrupt):
            m(torch.randn(2, 4))
        m[1].interrupt = False
        for _ in range(2):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            m(torch.randn(2, 4))  # an evaluation forward is still checked on its own
        assert mon.step_index == 2 and mon._recorder.rec.frames == [] and mon._recorder.root_depth == 0


def test_gradients_are_checked_when_the_next_forward_closes_the_step():
    model = boom_mlp()
    x = torch.randn(4, 8)
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(model) as mon:  # grads="params"
        model(x).sum().backward()
        model(x)  # closes step 0, whose gradients are inf
    assert exc.value.first.phase == "bwd" and mon.step_index == 0


def test_manual_steps_with_several_forwards_per_step():
    model = boom_mlp()
    model.boom.enabled = False
    with NumericsMonitor(model, manual_steps=True, grads="modules") as mon:
        for _ in range(2):
            for _ in range(4):  # gradient accumulation
                model(torch.randn(2, 8)).sum().backward()
            mon.step()
        assert mon.step_index == 2


def test_evaluation_pass_does_not_blame_a_minus_inf_mask():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt):
        with torch.no_grad():
            model.layers[1].linear2.weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteError) as exc, torch.no_grad():
            model(torch.randn(2, 5, 16), mask=mask, is_causal=True)
    assert exc.value.first.module == "layers.1.linear2" and exc.value.first.slot == "weight"


def test_two_monitors_on_one_optimizer_leave_no_wrapper_behind():
    model_a, model_b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([*model_a.parameters(), *model_b.parameters()], lr=0.1)
    first = NumericsMonitor(model_a, optimizer=opt)
    second = NumericsMonitor(model_b, optimizer=opt)
    first.close()
    second.close()
    assert "zero_grad" not in opt.__dict__


@pytest.mark.parametrize("grads", ["params", "modules"])
def test_without_the_optimizer_a_bad_gradient_is_still_caught(grads):
    """The user's optimizer is not hooked: the gradients are checked when the backward ends, before
    zero_grad() can erase them, and read with the step's flag (weights are not blamed afterwards)."""
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(model, grads=grads):
        for i in range(3):
            model.boom.enabled = i == 1
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert exc.value.details.step == 1
    if grads == "modules":
        assert exc.value.first.module == "boom" and exc.value.first.phase == "bwd"
    else:
        assert "optimizer=opt" in exc.value.report


def test_sparse_gradients_are_checked():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with NumericsMonitor(emb, optimizer=opt), pytest.raises(NonFiniteError) as exc:
        (emb(torch.tensor([1, 2])).sum() * float("inf")).backward()
        opt.step()
    assert exc.value.first.phase == "bwd"


class Exp(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x)


def test_an_fp32_overflow_is_not_told_to_use_fp32():
    model = torch.nn.Sequential(torch.nn.Identity(), Exp())
    with NumericsMonitor(model) as mon, pytest.raises(NonFiniteError) as exc, torch.no_grad():
        model(torch.full((2,), 100.0))
    assert exc.value.first.module == "1"
    assert "Higher precision will not help" in exc.value.report
    assert mon.report.fix is None and mon.report.fp32_region is None


def test_a_bad_mark_gets_no_module_fix():
    lin = torch.nn.Linear(2, 2)
    with NumericsMonitor(lin) as mon:
        mon.mark(lin(torch.ones(1, 2)) / 0.0, "after layer_norm")
        with pytest.raises(NonFiniteError) as exc:
            mon.step()
    # a mark after the model's forward (its output finite): the code after the model made it, no module to keep
    details = exc.value.details
    assert "marked 'after layer_norm'" in exc.value.report and details.fp32_region is None
    assert details.cause == "numerics.loss_outside_model" and "keep_fp32" not in details.fix


def test_without_the_optimizer_a_loss_from_any_output_is_checked():
    """The end-of-backward check must not depend on which output the loss came from."""
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(torch.nn.Sequential(model)):
        model.boom.enabled = True
        (model(torch.randn(4, 8)) * 2).sum().backward()  # a loss computed outside the model
        opt.step()
        opt.zero_grad()
    assert exc.value.details.step == 0


def test_gradients_repaired_before_the_step_are_not_blamed():
    model = boom_mlp()
    with NumericsMonitor(model, manual_steps=True) as mon:
        model(torch.randn(4, 8)).sum().backward()
        for p in model.parameters():
            p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a user's own gradient repair
        mon.step()
        assert mon.step_index == 1


def test_a_scaler_without_optimizer_records_overflows_even_after_zero_grad():
    model = boom_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with NumericsMonitor(model, scaler=scaler) as mon:
        for i in range(3):
            model.boom.enabled = i == 0
            scaler.scale(model(torch.randn(4, 8)).sum()).backward()
            scaler.step(opt)
            opt.zero_grad()
            scaler.update()
    assert [e.step for e in mon.overflows] == [0]


def test_options_accept_numpy_integers_and_generators():
    np = pytest.importorskip("numpy")
    mon = NumericsMonitor(
        torch.nn.Linear(2, 2), trace_steps=(s for s in [np.int64(1)]), abort_after_step=np.int64(3),
        max_frames=np.int64(5), min_loss_scale=np.float32(1.0),
    )
    assert mon.trace_steps == {1} and mon.abort_after_step == 3 and mon.max_frames == 5
    mon.close()


def test_nonfinite_error_pickles_and_meta_models_attach():
    import pickle

    model = boom_mlp()
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(model, grads="modules"):
        model(torch.randn(4, 8)).sum().backward()
    again = pickle.loads(pickle.dumps(exc.value))
    assert again.first == exc.value.first and again.report == exc.value.report
    with torch.device("meta"):
        meta_model = torch.nn.Linear(2, 2)
    NumericsMonitor(meta_model).close()


@pytest.mark.parametrize("grads", ["params", "modules"])
def test_one_host_sync_per_step_without_the_optimizer_too(grads):
    model = tiny_t5()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = t5_batch()
    train_step(model, opt, batch)
    bare = syncs_of_step(model, opt, batch)
    with NumericsMonitor(model, grads=grads, manual_steps=True) as mon:
        train_step(model, opt, batch)
        mon.step()

        def step_then_check():
            train_step(model, opt, batch)
            mon.step()

        with SyncCounter() as c:
            step_then_check()
    assert c.count - bare <= 1


def test_huge_finite_gradients_whose_sum_overflows_are_not_called_non_finite():
    model = torch.nn.Linear(64, 64, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with NumericsMonitor(model, optimizer=opt) as mon:
        model(torch.ones(2, 64)).sum().backward()
        model.weight.grad.fill_(3e38)  # finite, but the fast check's sum overflows: the exact one decides
        opt.step()
        assert mon.step_index == 1 and mon.report is None
        model(torch.ones(2, 64)).sum().backward()
        model.weight.grad[3, 3] = float("inf")
        with pytest.raises(NonFiniteError) as exc:
            opt.step()
    assert exc.value.first.slot == "grad:weight"


class Switch(torch.nn.Module):
    """Identity, or inf when switched on: a step that goes bad on demand."""

    on = False

    def forward(self, x):
        return x * float("inf") if self.on else x


def test_weights_in_context_frames_are_the_ones_that_frame_ran_with():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Switch())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ran_with = []
    # earlier steps' module frames exist only when every module is watched (at the default, their model frames)
    with NumericsMonitor(model, optimizer=opt, watch="every-module") as mon, pytest.raises(NonFiniteError) as exc:
        for step in range(3):
            model[1].on = step == 2
            ran_with.append(model[0].weight.detach().abs().max().item())
            model(torch.randn(2, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert exc.value.first.step == 2 and mon.report is not None and mon.report.step == 2
    shown = {f.step: next(ln.abs_max for ln in f.lines if ln.label == "weight")
             for f in exc.value.details.frames if f.name == "0" and f.phase == "fwd"}
    assert set(shown) == {0, 1, 2}
    assert len(set(ran_with)) == 3  # the updates did change the weight
    for step, value in shown.items():
        assert value == pytest.approx(ran_with[step], rel=1e-6)


def test_batchnorm_statistics_are_put_back_and_the_loop_is_still_watched(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(8, 4) for _ in range(6)]
    for i in (1, 4):
        batches[i][0, 0] = float("inf")
    bn, reported = model[1], []
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path):
        for x in batches:
            before = [t.clone() for t in (*bn.buffers(), *model.parameters())]
            try:
                model(x).sum().backward()
                opt.step()
            except NonFiniteError as e:
                reported.append(e.first.step)
                after = [*bn.buffers(), *model.parameters()]
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                assert any("buffer(s)" in note for note in e.details.notes)
            opt.zero_grad()
    assert reported == [1, 3]  # a refused step is tried again under the same number
    assert all(torch.isfinite(b.float()).all() for b in bn.buffers())


def test_a_loop_calling_only_a_submodule_is_checked_and_its_frames_stay_bounded():
    model = tiny_gpt2()
    ids = gpt2_batch()["input_ids"]
    with NumericsMonitor(model) as mon:  # no optimizer: steps end at each outermost call
        for _ in range(200):
            model.transformer(ids).last_hidden_state.sum().backward()
        held = len(mon._recorder.rec.frames) + sum(len(r.frames) for r in mon._steps.history.records)
        per_call = len(mon._recorder.rec.frames)
        assert per_call and held <= per_call + mon.max_frames
        assert mon.step_index == 199
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteError) as exc:
            for _ in range(2):  # the bad call's step is closed when the next call starts
                model.transformer(ids).last_hidden_state.sum().backward()
    assert exc.value.first.module.startswith("transformer.h.1")


def test_a_new_monitor_replaces_one_that_has_reported():
    model = boom_mlp()
    first = NumericsMonitor(model)
    with pytest.raises(NonFiniteError):
        model(torch.randn(4, 8)).sum().backward()
        first.step()
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    second = NumericsMonitor(model)  # first is still watching (a caught error), yet it reported
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    assert not first._hooks.active and second._hooks.active
    second.close()
    assert not any(m._forward_hooks for m in model.modules())


def test_gradients_left_by_a_reported_step_are_not_reported_again():
    model = boom_mlp()
    with NumericsMonitor(model) as mon:
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(NonFiniteError):
            mon.step()
        mon.step()  # nothing ran since: the inf gradients still there belong to the reported step
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(NonFiniteError):  # a new backward that blows up is reported again
            mon.step()


def test_a_report_leads_with_the_answer_and_marks_each_step_of_its_frames(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, NumericsMonitor(model, optimizer=opt, max_frames=40,
                                                                  report_dir=tmp_path):
        for step in range(2):
            x = torch.randn(3, 4)
            if step == 1:
                model[2].bias.data[0] = float("inf")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    lines = caught.value.report.splitlines()
    first = lines[0]
    assert first.startswith("Detected inf at step 1")
    at = {key: next(i for i, ln in enumerate(lines) if ln.startswith(key))
          for key in ("Diagnosis:", "Last ", "*** step 0 ***", "*** step 1 ***")}
    assert at["Diagnosis:"] < at["Last "] < at["*** step 0 ***"] < at["*** step 1 ***"]


def test_a_loop_that_catches_one_bad_batch_goes_on_clean():
    """The exception skips the loop's zero_grad(): the refused step's gradients must not poison the next ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome = []
    with NumericsMonitor(model, optimizer=opt):
        for step in range(4):
            x = torch.randn(3, 4)
            if step == 1:
                x[0, 0] = float("nan")
            try:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                outcome.append("ok")
            except NonFiniteError as e:
                outcome.append(e.details.cause)
    assert outcome == ["ok", "numerics.bad_input", "ok", "ok"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_bad_evaluation_forward_between_backward_and_step_does_not_let_the_step_through():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        model[0].weight.grad[0, 0] = float("nan")  # the training step's gradient goes bad
        with pytest.raises(NonFiniteError), torch.no_grad():
            model(torch.full((2, 4), float("nan")))  # an evaluation forward on a bad batch
        with pytest.raises(NonFiniteError):
            opt.step()  # the training step is still judged at its own boundary
    assert torch.isfinite(model[0].weight).all()


def test_buffers_replaced_after_attaching_are_said_not_put_back_then_guarded_again(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path):
        model.double()  # replaces the float buffers the monitor saw at attach
        bad = torch.randn(8, 4, dtype=torch.float64)
        bad[0, 0] = float("nan")
        with pytest.raises(NonFiniteError) as caught:
            model(bad).sum().backward()
            opt.step()
        assert any("could not be put back" in n for n in caught.value.details.notes)
        model[1].reset_running_stats()
        model(torch.randn(8, 4, dtype=torch.float64)).sum().backward()  # a clean step: the next one's start
        opt.step()  # copies the new buffers
        opt.zero_grad()
        before = model[1].running_mean.clone()
        with pytest.raises(NonFiniteError) as caught:
            model(bad).sum().backward()
            opt.step()
        assert torch.equal(model[1].running_mean, before)
        assert not any("could not be put back" in n for n in caught.value.details.notes)

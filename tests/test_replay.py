"""A step checked at its boundaries (``watch="boundaries"``, the default) is replayed when it goes bad: the replay
names the module, slot and phase, says whether the fault reproduced, and changes nothing the run keeps."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import boom_mlp
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.record import calls


class OnceInf(nn.Module):
    """Turns its input inf the ``at``-th time its forward runs (or while ``always``): a transient fault, or one that
    stays."""

    def __init__(self, always: bool = False, at: int = 1) -> None:
        super().__init__()
        self.runs = 0
        self.always = always
        self.at = at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x * float("inf") if self.always or self.runs == self.at else x


def net(inner: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 1))


def step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_fault_that_stays_is_reproduced_and_named(tmp_path):
    model = net(OnceInf(always=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, opt, report_dir=tmp_path, watch="boundaries"), pytest.raises(NonFiniteError) as e:
        step(model, opt, torch.randn(2, 4))
    d = e.value.details
    assert (d.first.phase, d.first.module, d.first.slot) == ("fwd", "1", "output") and d.replay == "reproduced"
    saved = json.loads((tmp_path / "torchdoctor-nonfinite-rank0.json").read_text())
    assert saved["replay"] == "reproduced" and saved["replay_reason"] is None


@pytest.mark.parametrize("at", [1, 2])  # step 0 (watched every module as it runs) or step 1 (at its boundaries)
def test_a_transient_fault_is_not_reproduced_raised_by_default_and_skipped_when_asked(tmp_path, at):
    model = net(OnceInf(at=at))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, opt, report_dir=tmp_path), pytest.raises(NonFiniteError) as e:
        for _ in range(at - 1):
            step(model, opt, torch.randn(2, 4))
        before = [p.detach().clone() for p in model.parameters()]
        step(model, opt, torch.randn(2, 4))
    d = e.value.details
    assert d.replay == "not reproduced" and d.cause == "numerics.transient" and d.step == at - 1
    # what the step's check saw: every module at step 0, the model's output at the boundaries
    assert (d.first.phase, d.first.module) == ("fwd", "1" if at == 1 else "")
    assert "host " in d.diagnosis and "device cpu" in d.diagnosis and "transient='skip'" in d.fix
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    model = net(OnceInf(at=at))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="did not reproduce"), \
            NumericsMonitor(model, opt, report_dir=tmp_path, transient="skip") as mon:
        for _ in range(at - 1):
            step(model, opt, torch.randn(2, 4))
        before = [p.detach().clone() for p in model.parameters()]
        step(model, opt, torch.randn(2, 4))  # skipped: its update refused, no exception
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        for _ in range(2):
            step(model, opt, torch.randn(2, 4))  # and the run goes on
        assert mon.step_index == at + 2
    assert len(mon.transients) == 1 and mon.transients[0].step == at - 1 and mon.report is None
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_skip_needs_the_optimizer():
    with pytest.raises(ValueError, match="transient="):
        NumericsMonitor(nn.Linear(2, 2), transient="ignore")


def test_an_input_changed_in_place_after_the_forward_is_not_replayed():
    model = net(nn.Identity())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with NumericsMonitor(model, opt), pytest.raises(NonFiniteError) as e:
        step(model, opt, x.clone())  # (step 0, watched every module: the bad one is a step checked at its boundaries)
        x[0, 0] = float("inf")
        model(x).pow(2).mean().backward()
        x.zero_()  # the loop reuses its buffer before the step
        opt.step()
    d = e.value.details
    assert d.replay == "not replayed" and "changed in place after its forward" in d.replay_reason
    assert d.cause == "numerics.unlocalized" and "watch='every-module'" in d.fix
    assert "every module it ran returned finite" not in d.diagnosis  # no claim about modules nobody watched


class SqrtAbs(nn.Module):
    """sqrt(|x|): finite forward, an inf derivative where x is exactly 0."""

    def forward(self, x):
        return x.abs().sqrt()


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_the_third_of_four_micro_batches_is_the_one_replayed(phase):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SqrtAbs(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with NumericsMonitor(model, opt), pytest.raises(NonFiniteError) as e:
        for micro in range(4):
            x = torch.randn(4, 8, generator=g)
            if micro == 2:  # the data of the third micro-batch: a nan, or a row of zeros (sqrt'(0) is inf)
                x[1] = float("nan") if phase == "fwd" else 0.0
            (model(x).sum() / 4).backward()
        opt.step()
    d = e.value.details
    assert d.replay == "reproduced" and "micro-batch 3 of 4" in " ".join(d.notes)
    if phase == "fwd":
        assert (d.first.phase, d.first.module, d.first.slot) == ("fwd", "0", "output")
        assert d.cause == "numerics.bad_input"
    else:
        assert (d.first.phase, d.first.module, d.first.slot) == ("bwd", "1", "grad_input")


class Dropped(nn.Module):
    """inf wherever dropout drops (the RNG decides where): reproduced only with the RNG state of the call."""

    def forward(self, x):
        return x / F.dropout(torch.ones_like(x), p=0.5, training=self.training) * 0.5


def test_the_replay_draws_the_same_random_numbers_and_leaves_the_rng_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), Dropped(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, opt), pytest.raises(NonFiniteError) as e:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        state = torch.get_rng_state()
        try:
            opt.step()
        finally:
            after = torch.get_rng_state()
    assert e.value.details.replay == "reproduced" and e.value.first.module == "1"
    assert torch.equal(state, after)


class Big(nn.Module):
    """A Linear whose output is above fp16's range (7e4) when computed in fp16, finite in fp32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(2e4)

    def forward(self, x):
        return self.lin(x)


def test_the_replay_runs_under_the_autocast_the_call_ran_in():
    torch.manual_seed(0)
    model = nn.Sequential(Big(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, opt), pytest.raises(NonFiniteError) as e:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.ones(2, 4))
        out.float().pow(2).mean().backward()
        opt.step()  # checked (and replayed) outside the autocast block
    d = e.value.details
    assert d.replay == "reproduced" and (d.first.module, d.first.slot) == ("0.lin", "output")
    assert d.cause == "numerics.low_precision_overflow"


def test_the_replay_changes_no_gradient_buffer_or_weight():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), OnceInf(always=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with NumericsMonitor(model, opt, manual_steps=True) as mon:
        stats = [b.clone() for b in model.buffers()]
        model(torch.randn(8, 4)).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        weights = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(NonFiniteError) as e:
            mon.step()  # before optimizer.step(): the gradients are still there after the check
        assert e.value.details.replay == "reproduced"
        for a, b in zip(grads, model.parameters()):
            assert torch.equal(a, b.grad) or (a.isnan() == b.grad.isnan()).all()
        for a, b in zip(stats, model.buffers()):
            assert torch.equal(a, b)  # put back as the step began (its forward and the replay's updated them)
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        assert opt.state == {} or all(not s for s in opt.state.values())


class Logits(nn.Module):
    """Returns logits; the loop computes the loss (the gradient at the model's output is as big as its output)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.fc1, self.boom, self.fc2 = nn.Linear(8, 16), boom_mlp().boom, nn.Linear(16, vocab)

    def forward(self, x):
        return self.fc2(self.boom(self.fc1(x)))


@pytest.mark.parametrize("vocab", [64, 4096])
def test_the_gradient_kept_at_the_models_output_stays_under_its_bound(monkeypatch, vocab):
    monkeypatch.setattr(calls, "GRAD_BYTES_KEPT", 64 * 1024)  # (the bound, scaled down with the model)
    torch.manual_seed(0)
    model = Logits(vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    original = calls._Keeper.__call__

    def spy(self, grad):
        original(self, grad)
        kept.append(self.call.grad_bytes)

    monkeypatch.setattr(calls._Keeper, "__call__", spy)
    model.boom.enabled = False
    with NumericsMonitor(model, opt), pytest.raises(NonFiniteError) as e:
        F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, vocab, (16,))).backward()
        opt.step()  # (step 0, watched every module; the bad step is checked at its boundaries)
        opt.zero_grad()
        kept.clear()
        model.boom.enabled = True
        F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, vocab, (16,))).backward()
        opt.step()
    d = e.value.details
    size = 16 * vocab * 4
    if size <= 64 * 1024:
        assert kept == [size] and d.replay == "reproduced" and d.first.module == "boom"
    else:
        assert kept == [0] and d.replay == "not replayed"
        assert "(output, 256 KiB) is above the 64 KiB kept per micro-batch" in d.replay_reason
        assert d.first.slot.startswith("grad:")  # where the step's check found it, said to be so
        assert any("not where it began" in n for n in d.notes)


class LoRALinear(nn.Module):
    """A frozen base Linear and a trainable low-rank adapter beside it (as peft's LoRA)."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


@pytest.mark.both_levels
def test_a_fault_in_a_frozen_modules_backward_is_named_there_not_at_the_nearest_adapter(watch_level):
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(nn.Linear(8, 8)), nn.Tanh(), LoRALinear(nn.Linear(8, 1)))
    with torch.no_grad():
        model[2].base.weight.fill_(3e37)  # finite forward on tanh's outputs, an inf gradient w.r.t. its input
        model[2].base.bias.zero_()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(4, 8) * 0.01
    grads = "modules" if watch_level == "every-module" else "params"
    with NumericsMonitor(model, opt, grads=grads), pytest.raises(NonFiniteError) as e:
        (model(x).sum() * 100).backward()
        opt.step()
    first = e.value.first
    assert (first.phase, first.module, first.slot) == ("bwd", "2.base", "grad_input")


class Between(nn.Module):
    """a -> (plain code, or an in-place activation then a module, between it and b) -> b; sqrt'(0) is inf. (A
    LeakyReLU: ReLU's backward would select 0 where its input is 0 and drop the inf before any weight sees it.)"""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.how = how
        self.act, self.sq = nn.LeakyReLU(inplace=True), SqrtAbs()

    def forward(self, x):
        h = self.a(x) * 0
        h = h.abs().sqrt() if self.how == "functional" else self.sq(self.act(h))
        return self.b(h)


@pytest.mark.both_levels
@pytest.mark.parametrize("how", ["functional", "in-place"])
def test_a_backward_fault_between_two_modules_is_not_named_on_the_module_before(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Between(how))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NumericsMonitor(model, opt, grads="modules"), pytest.raises(NonFiniteError) as e:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    first, d = e.value.first, e.value.details
    if how == "functional":  # the parent's own code after a made it: named as such, not a's backward
        assert (first.module, first.slot) == ("1", "code after 1.a")
        assert "plain code in the forward of 1 (Between), after it calls 1.a and before 1.b" in d.diagnosis
    else:  # LeakyReLU(inplace=True) returns a's output changed: the gradient at its new version is sq's backward's
        assert (first.module, first.slot) == ("1.sq", "grad_input")

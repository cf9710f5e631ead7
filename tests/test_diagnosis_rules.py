"""Every diagnosis rule, built for real and checked against the frames it was built from (issue 18, item 4).

Each test makes the situation its rule is for (real models, real optimizers, autocast), asserts the cause and
what the text claims -- the numbers it quotes are the frames' own, the dtypes and modules it names are those of
the frames -- and runs the general check :func:`~torchdoctor.numerics.explain.evidence.contradictions` over the report.
The last tests make sure that check can fail: an "invalid operation from finite inputs" told about a frame whose
input is above its compute dtype's range, a number no frame shows, an empty module name.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from conftest import boom_mlp, gpt2_batch, tiny_gpt2
from torchdoctor import NonFiniteError, NumericsMonitor, keep_fp32
from torchdoctor.demo.model import build_demo, train_steps
from torchdoctor.numerics.explain import causes
from torchdoctor.numerics.explain.evidence import contradictions
from torchdoctor.numerics.explain.ranges import compute_dtype, shown

pytestmark = pytest.mark.both_levels  # (conftest: once per watch level)

FP16_MAX = torch.finfo(torch.float16).max


def line_of(report, module: str, slot: str, phase: str = "fwd"):
    """The line ``slot`` of the last shown (or cited) frame of ``module``."""
    frames = [f for f in [*report.frames, *report.cited] if f.name == module and f.phase == phase]
    assert frames, (module, [f.name for f in report.frames])
    return next(ln for ln in frames[-1].lines if ln.label == slot)


def holds(report) -> None:
    assert contradictions(report) == [], report.text()


def raise_in(tmp_path, model, step, optimizer=True, **monitor):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NumericsMonitor(model, optimizer=opt if optimizer else None, report_dir=tmp_path, **monitor) as mon, \
            pytest.raises(NonFiniteError) as exc:
        step(model, opt, mon)
    return exc.value.details


# ---------------------------------------------------------------- weights
def test_bad_weight_with_the_optimizer_hooked_does_not_ask_for_the_optimizer(tmp_path):
    model = tiny_gpt2()
    batch = gpt2_batch()

    def step(m, opt, mon):
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            m.transformer.wpe.weight[3, 0] = float("nan")  # written outside the optimizer
        m(**batch).loss.backward()
        opt.step()

    report = raise_in(tmp_path, model, step)
    assert report.cause == causes.BAD_WEIGHT and report.first.module == "transformer.wpe"
    assert "give torchdoctor the optimizer" not in report.diagnosis and "optimizer=opt" not in report.diagnosis
    assert "outside the optimizer" in report.diagnosis and report.fix and "checkpoint" in report.fix
    assert math.isnan(line_of(report, "transformer.wpe", "weight").abs_max)
    holds(report)


def test_bad_weight_without_an_optimizer_asks_for_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight[0, 1] = float("inf")

    def step(m, opt, mon):
        m(torch.randn(2, 4)).sum().backward()
        mon.step()

    with pytest.raises(NonFiniteError) as exc:  # the weight check at attach sees it first
        raise_in(tmp_path, model, step, optimizer=False, manual_steps=True)
    assert "already non-finite before training" in str(exc.value)
    with torch.no_grad():
        model[1].weight.fill_(0.1)
    with NumericsMonitor(model, report_dir=tmp_path, manual_steps=True) as mon, pytest.raises(NonFiniteError) as exc:
        with torch.no_grad():
            model[1].weight[0, 1] = float("inf")  # after attach, with no optimizer to check it against
        model(torch.randn(2, 4)).sum().backward()
        mon.step()
    report = exc.value.details
    assert report.cause == causes.BAD_WEIGHT, report.diagnosis
    assert "give torchdoctor the optimizer (NumericsMonitor(model, optimizer=opt))" in report.diagnosis
    assert "cannot tell which came first" in report.diagnosis
    holds(report)


# ---------------------------------------------------------------- the run, the loss
def test_divergence_names_the_module_and_the_growth(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    with NumericsMonitor(model, optimizer=opt, report_dir=tmp_path), pytest.raises(NonFiniteError) as exc:
        for _ in range(50):
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    report = exc.value.details
    assert report.cause == causes.DIVERGENCE, report.diagnosis
    # "grew from A at step s0 to B at step s1": when s1 is this step, B is one of this step's measured values
    peak, at = report.diagnosis.split(" grew from ")[1].split(" to ")[1].split(" at step ")
    if int(at.split(" ")[0]) == report.step:
        assert peak in {shown(ln.abs_max) for f in report.frames if f.step == report.step for ln in f.lines}
    holds(report)


def test_model_loss_on_all_ignored_labels_quotes_the_labels(tmp_path):
    batch = gpt2_batch()
    batch["labels"][:] = -100

    def step(m, opt, mon):
        m(**batch).loss.backward()
        opt.step()

    report = raise_in(tmp_path, tiny_gpt2(), step)
    assert report.cause == causes.MODEL_LOSS and "GPT2LMHeadModel (the model) returned a nan" in report.diagnosis
    assert f"abs max = {shown(line_of(report, '', 'input[labels]').abs_max)}" in report.diagnosis
    holds(report)


def test_loss_outside_the_model(tmp_path):
    def step(m, opt, mon):
        out = m(torch.randn(4, 8))
        torch.log((out - out).abs()).mean().backward()
        opt.step()

    torch.manual_seed(0)
    report = raise_in(tmp_path, nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 1)), step)
    assert report.cause == causes.LOSS_OUTSIDE_MODEL
    holds(report)


def test_a_marked_value_inside_the_forward(tmp_path):
    class Marks(nn.Module):
        def __init__(self, mon_box):
            super().__init__()
            self.a, self.b, self.box = nn.Linear(4, 4), nn.Linear(4, 1), mon_box

        def forward(self, x):
            h = self.a(x)
            z = h / (h - h)
            self.box[0].mark(z, "z")
            return self.b(z)

    box = []
    torch.manual_seed(0)
    model = Marks(box)

    def step(m, opt, mon):
        box.append(mon)
        m(torch.randn(2, 4)).sum().backward()
        opt.step()

    report = raise_in(tmp_path, model, step)
    assert report.cause == causes.MARKED_VALUE and "marked 'z'" in report.diagnosis
    holds(report)


# ---------------------------------------------------------------- forward overflows
def test_fp16_overflow_near_the_limit_quotes_the_frames_numbers(tmp_path):
    model, batches = build_demo(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as exc, NumericsMonitor(model, optimizer=opt, report_dir=tmp_path):
        train_steps(model, batches, 1, "fp16", optimizer=opt)
    report = exc.value.details
    assert report.cause == causes.LOW_PRECISION_OVERFLOW
    near = report.evidence[0]
    assert f"reached {shown(line_of(report, near.module, near.slot).abs_max)}" in report.diagnosis
    assert f"float16's max {FP16_MAX:.2e}" in report.diagnosis and near.dtype == torch.float16
    holds(report)


def boundary_model() -> nn.Module:
    """Layer 2's output is ~3.3e5 (above fp16's 65504) while every input it gets is ~21."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.fill_(0.05)
        model[0].bias.zero_()
        model[2].weight.fill_(1000.0)
    return model


def boundary_input() -> torch.Tensor:
    return torch.rand(4, 16, generator=torch.Generator().manual_seed(0)) * 50 + 1


def autocast_step(x):
    def step(m, opt, mon):
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        out.float().mean().backward()
        opt.step()
    return step


def test_fp16_overflow_with_no_value_near_the_limit(tmp_path):
    x = boundary_input()
    report = raise_in(tmp_path, boundary_model(), autocast_step(x))
    assert report.cause == causes.LOW_PRECISION_OVERFLOW and report.first.module == "2"
    # 2 alone in fp32 leaves its ~3e5 output to overflow as 3 takes it in fp16 (the next test): the fix check finds
    # that on the bad step and prints the region that holds, 2 with the module after it
    assert report.fix == "torchdoctor.keep_fp32(model, '2') and torchdoctor.keep_fp32(model, '3')", report.text()
    assert report.fix_check == "fixed" and "keep_fp32('2') tried first, not enough" in report.fix_check_reason
    holds(report)


@pytest.mark.parametrize("consumer_weights", ["mixed", "positive"])  # layer 3 then makes nan (inf - inf) or inf
def test_after_keep_fp32_an_fp32_output_entering_an_fp16_module_is_a_boundary_overflow(tmp_path, consumer_weights):
    """The monitor's own fix for the test above, followed: layer 2 in fp32 makes ~3e5, and layer 3 under autocast
    computes in fp16 -- the report is never "an invalid operation from finite inputs"."""
    x = boundary_input()
    model = boundary_model()
    if consumer_weights == "positive":
        with torch.no_grad():
            model[3].weight.abs_()
    with keep_fp32(model, "2"):
        report = raise_in(tmp_path, model, autocast_step(x))
    assert report.first.value == ("inf" if consumer_weights == "positive" else "nan")
    assert report.cause == causes.BOUNDARY_OVERFLOW, report.diagnosis
    assert report.first.module == "3" and "invalid operation" not in report.diagnosis
    given = line_of(report, "3", "input[0]")
    bad = frame3 = next(f for f in report.frames if f.name == "3")
    assert given.dtype == torch.float32 and given.abs_max > FP16_MAX and compute_dtype(frame3) == torch.float16
    assert f"abs max {shown(given.abs_max)}" in report.diagnosis and f"float16's max {FP16_MAX:.2e}" in report.diagnosis
    assert "2 (Linear) made it in float32" in report.diagnosis and bad is frame3
    # the region is extended, never moved: '2' stays kept (the fix once read "keep_fp32(model, '3')" alone, which a
    # user could take as a replacement of '2'; tests/test_numerics_advice.py follows it literally)
    assert report.fp32_kept == ["2"] and "keep_fp32(model, '2')" not in report.fix  # (the guard on stays, not re-told)
    holds(report)
    # the fix is checked on the bad step itself, forward and backward, before it is printed
    assert report.fix_check == "fixed", report.text()
    if consumer_weights == "mixed":
        assert report.fix.startswith("torchdoctor.keep_fp32(model, '3'), in addition to the keep_fp32 already on '2'")
        assert report.fp32_region == "3"
        assert report.fix_check_reason == ("the bad step was run again with keep_fp32('3'): every value of its "
                                           "forward and backward finite")
    else:  # 3 in fp32 holds the forward, but with 3's weights all positive the gradient coming back through 2 (x1000)
        # overflows layer 0's fp16 weight gradient: the region the diagnosis names is not enough, bf16 is
        assert "keep_fp32('3'), keep_fp32('1') + keep_fp32('3') tried first, not enough" in report.fix_check_reason
        assert report.fix.startswith("train in bf16") and report.fp32_region is None
    with keep_fp32(model, "2"), keep_fp32(model, "3"), NumericsMonitor(model, report_dir=tmp_path), \
            torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(x)).all()


def test_a_large_fp32_input_of_a_module_computing_in_fp16_is_squared_in_fp16(tmp_path):
    """1e3 in fp32 fits fp16, but its square does not: the dtype the module computes in (its output's, fp16)
    decides, not its input's."""

    class Square(nn.Module):
        def forward(self, x):
            h = x.half()
            return h * h - h * h  # inf - inf = nan in fp16

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Square())
    with torch.no_grad():
        model[0].weight.fill_(0.0)
        model[0].bias.fill_(1e3)

    def step(m, opt, mon):
        m(torch.randn(2, 4)).float().sum().backward()
        opt.step()

    report = raise_in(tmp_path, model, step)
    given = line_of(report, "1", "input[0]")
    assert given.dtype == torch.float32 and report.cause == causes.SQUARE_OVERFLOW, report.diagnosis
    assert f"abs max {shown(given.abs_max)} is above sqrt(float16 max) = 2.56e+02" in report.diagnosis
    assert report.fp32_region == "1"
    holds(report)


def test_an_fp32_square_overflow_is_not_a_precision_problem(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with torch.no_grad():
        model[0].weight.fill_(1e37)

    def step(m, opt, mon):
        m(torch.ones(2, 4)).sum().backward()
        opt.step()

    report = raise_in(tmp_path, model, step)
    assert report.cause == causes.SQUARE_OVERFLOW and "sqrt(float32 max) = 1.84e+19" in report.diagnosis
    assert report.fp32_region is None and "learning rate" in report.fix
    holds(report)


def test_an_invalid_operation(tmp_path):
    class Gate(nn.Module):
        def forward(self, x):
            return x * (x - x) / (x - x)

    torch.manual_seed(0)

    def step(m, opt, mon):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()

    report = raise_in(tmp_path, nn.Sequential(nn.Linear(4, 4), Gate()), step)
    assert report.cause == causes.INVALID_OP and "1 (Gate) produced nan from finite inputs" in report.diagnosis
    holds(report)


def test_an_fp32_range_overflow(tmp_path):
    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    def step(m, opt, mon):
        m(torch.full((2, 4), 300.0)).sum().backward()
        opt.step()

    torch.manual_seed(0)
    report = raise_in(tmp_path, nn.Sequential(nn.Linear(4, 4), Exp()), step)
    assert report.cause == causes.RANGE_OVERFLOW and "float32" in report.diagnosis
    holds(report)


# ---------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, None])
def test_backward_rules_name_the_consumer_and_the_dtype(tmp_path, dtype):
    def step(m, opt, mon):
        with torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
            out = m(torch.randn(4, 8))
        out.float().pow(2).mean().backward()
        opt.step()

    report = raise_in(tmp_path, boom_mlp(), step, grads="modules")
    assert "blow-up starts in the backward of boom" in report.diagnosis
    if dtype is None:
        assert report.cause == causes.BACKWARD_NONFINITE
        assert report.fix_check == "not checked"  # (fp32 throughout: no wider dtype to try)
    else:
        assert report.cause == causes.BACKWARD_OVERFLOW
        assert ("train in bf16" in report.diagnosis) == (dtype == torch.float16)
        # boom's backward multiplies by 1e39, beyond fp32's range too: the fix check tries boom in fp32, the regions
        # around it and fp32 itself on the bad step, none makes it finite, so no keep_fp32 is printed as the fix
        assert report.fix_check == "not fixed" and report.fp32_region is None, report.text()
        assert "keep_fp32('boom')" in report.fix_check_reason and "fp32 (autocast off)" in report.fix_check_reason
        assert "not even fp32" in report.diagnosis and "beyond fp32's range" in report.diagnosis
        assert "keep_fp32(model" not in report.fix
    holds(report)


# ---------------------------------------------------------------- the check itself can fail
def boundary_report(tmp_path):
    x = boundary_input()
    model = boundary_model()
    with keep_fp32(model, "2"):
        return raise_in(tmp_path, model, autocast_step(x))


def test_the_check_refuses_an_invalid_operation_from_an_out_of_range_input(tmp_path):
    report = boundary_report(tmp_path)
    wrong = dataclasses.replace(
        report, cause=causes.INVALID_OP,
        diagnosis="3 (Linear) produced nan from finite inputs: an invalid operation (0/0, inf-inf, log or sqrt of a "
                  "negative number, a softmax over a fully masked row) inside its forward.",
        evidence=report.evidence[-1:])
    found = contradictions(wrong)
    assert any("above the max of torch.float16" in c for c in found), found


def test_the_check_refuses_a_number_or_a_name_the_frames_do_not_show(tmp_path):
    report = boundary_report(tmp_path)
    given = shown(line_of(report, "3", "input[0]").abs_max)
    found = contradictions(dataclasses.replace(report, diagnosis=report.diagnosis.replace(given, "8.23e+05")))
    assert any("8.23e+05" in c for c in found), found
    found = contradictions(dataclasses.replace(report, diagnosis=report.diagnosis.replace("3 (Linear)", " (Linear)")))
    assert any("empty name" in c for c in found) and any("without naming it" in c for c in found), found
    found = contradictions(dataclasses.replace(report, diagnosis=report.diagnosis.replace("float32", "bfloat16")))
    assert any("bfloat16" in c for c in found), found

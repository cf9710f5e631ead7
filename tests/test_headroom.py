"""``NumericsMonitor(headroom=True)``: a module drifting toward fp16's largest value is named before it overflows,
with its trend, once; other steps stay at the default level; the flag rides on the step's one host read."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics import HeadroomWarning
from torchdoctor.syncs import OpCounter


def drifting(steps: int, growth: float, every: int, report_dir, after_warning: int = 0):
    """A Linear whose weights grow ``growth`` per step under fp16 autocast (loss tiny: no gradient overflow): the
    monitor, the steps run, and the warnings caught."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8) * 100
    ran = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NumericsMonitor(model, opt, headroom=True, headroom_every=every, report_dir=report_dir) as mon:
            for _ in range(steps):
                with torch.no_grad():
                    model[2].weight.mul_(growth)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                (out.float() * 1e-6).mean().backward()
                opt.step()
                opt.zero_grad()
                ran += 1
                if mon.headroom_events and after_warning == 0:
                    break
                if mon.headroom_events:
                    after_warning -= 1
    return mon, ran, [w for w in caught if issubclass(w.category, HeadroomWarning)]


def test_a_module_drifting_toward_fp16s_largest_value_is_named_before_it_overflows(tmp_path):
    mon, ran, caught = drifting(400, 1.03, 10, tmp_path)
    (event,) = mon.headroom_events
    assert event.module == "2" and event.cls == "Linear" and event.dtype == "float16"
    assert event.step % 10 == 0 and event.step == ran - 1  # measured on a headroom step, warned there
    assert 65504 / 2 <= event.peak < 65504 and event.dtype_max == 65504
    assert 10 < event.growth_per_100 < 40  # 1.03 per step: 19x per 100 steps, with the batch's noise
    assert event.steps_left is not None and event.steps_left < 30
    assert len(caught) == 1 and "torchdoctor.keep_fp32(model, '2')" in str(caught[0].message)
    lines = (tmp_path / "torchdoctor-headroom.jsonl").read_text().splitlines()
    assert [json.loads(line)["module"] for line in lines] == ["2"]


def test_each_module_is_warned_about_once_and_the_run_goes_on_to_its_overflow(tmp_path):
    with pytest.raises(NonFiniteError) as e:
        drifting(400, 1.03, 10, tmp_path, after_warning=400)
    assert e.value.first.module == "2"  # the module the warning named is the one that overflowed
    assert len((tmp_path / "torchdoctor-headroom.jsonl").read_text().splitlines()) == 1


def test_a_healthy_run_gets_no_warning_and_steps_between_stay_at_the_boundaries(tmp_path):
    mon, ran, caught = drifting(30, 1.0, 10, tmp_path)
    assert ran == 30 and not mon.headroom_events and not caught
    assert not (tmp_path / "torchdoctor-headroom.jsonl").exists()


def test_a_headroom_step_adds_no_host_read(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().mean().backward()
        opt.step()
        opt.zero_grad()

    syncs = {}
    for headroom in (False, True):
        with NumericsMonitor(model, opt, headroom=headroom, headroom_every=3, report_dir=tmp_path):
            step()
            step()
            step()
            with OpCounter() as ops:  # step 3: a headroom step
                step()
        syncs[headroom] = ops.syncs
    assert syncs[True] == syncs[False]


@pytest.mark.parametrize("kwargs, error", [
    ({"headroom": "yes"}, "headroom must be True or False"),
    ({"headroom": True, "headroom_every": 0}, "headroom_every must be an int >= 1"),
    ({"headroom": True, "headroom_every": 2.5}, "headroom_every must be an int >= 1"),
])
def test_bad_headroom_options_are_refused(kwargs, error):
    with pytest.raises((TypeError, ValueError), match=error):
        NumericsMonitor(nn.Linear(2, 2), **kwargs)

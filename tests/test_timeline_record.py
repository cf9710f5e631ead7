"""Recording a run's numerics timeline (``NumericsMonitor(record=...)``): per step, per module, on the device, written
in chunks with one host read each, flushed before a NonFiniteError is raised, read back exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

import step0_worker as W
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.timeline.store import read_npy, read_run, write_npy
from torchdoctor.syncs import SyncCounter


def train(model, opt, xs, **options):
    with NumericsMonitor(model, opt, **options) as mon:
        for x in xs:
            model(x)[1].backward()
            opt.step()
            opt.zero_grad()
    return mon


def test_a_healthy_run_is_recorded_step_by_step_and_read_back(tmp_path):
    model = W.Net("none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, W.batches("none", 7), record=tmp_path / "run", record_flush=3)
    [r] = read_run(str(tmp_path / "run"))
    assert r.rank == 0 and r.settings["world_size"] == 1 and r.settings["record_every"] == 1
    assert r.steps.tolist() == list(range(7))
    assert sorted({(m, p) for m, _, p, _, _ in r.keys}) == sorted(
        (m, p) for m in ("block0.0", "block0.1", "block1.0", "block1.1", "head", "") for p in ("fwd", "bwd"))
    assert r.values.shape == (7, len(r.keys), 2) and bool((r.values >= 0).all())  # every key every step
    assert sorted((tmp_path / "run" / "rank0").glob("values-*.npy")) != [] and len(
        list((tmp_path / "run" / "rank0").glob("values-*.npy"))) == 3  # 3 + 3 + the last 1, at close
    # the recorded forward values are the monitor's own statistics of those tensors
    head = r.keys.index(("head", "Linear", "fwd", "output", "float32"))
    model2 = W.Net("none")
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    out = model2(W.batches("none", 1)[0])[0]
    assert r.values[0, head].tolist() == pytest.approx([out.abs().min().item(), out.abs().max().item()])
    del opt2


def test_every_nth_step_and_one_read_per_flush(tmp_path):
    model = W.Net("none")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # (AdamW on a CPU reads each parameter's step count)
    xs = W.batches("none", 9)
    with NumericsMonitor(model, opt, record=tmp_path / "run", record_every=3, record_flush=100) as mon:
        for i, x in enumerate(xs):
            with SyncCounter() as c:
                model(x)[1].backward()
                opt.step()
                opt.zero_grad()
            if i > 0:
                assert c.count == 1, (i, c.count)  # the step's one read: recording adds none until a flush
        assert mon.step_index == 9
    [r] = read_run(str(tmp_path / "run"))
    assert r.steps.tolist() == [0, 3, 6]
    # the attach line says what a recorded step is watched at, not only the level of the others
    assert mon.watching.endswith("watch=boundaries, recording every 3 steps (watched at every module)"), mon.watching
    assert r.settings["watching"] == mon.watching
    with NumericsMonitor(model, opt) as plain:
        assert "recording" not in plain.watching


def test_two_models_recording_into_one_folder_are_refused_and_a_replacing_monitor_takes_it_over(tmp_path):
    """Two monitors of one process (a generator and a discriminator) would mix their columns in one rank folder: the
    second is refused in one line, before it attaches anything. A monitor that replaces an earlier one on the same
    model (the earlier one has reported) takes the folder over; once a monitor is closed, its folder is free."""
    a, b = W.Net("none"), W.Net("none")
    opt_a = torch.optim.SGD(a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-3)
    first = NumericsMonitor(a, opt_a, record=tmp_path / "run")
    with pytest.raises(ValueError, match=r"being recorded by another monitor in this process; give each monitor "
                                         r"a folder of its own"):
        NumericsMonitor(b, opt_b, record=tmp_path / "run")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in b.modules())  # (refused before attaching)
    with NumericsMonitor(b, opt_b, record=tmp_path / "other"):
        pass
    with pytest.raises(NonFiniteError):  # it reports (a nan batch): a new monitor on the same model replaces it
        a(W.batches("nan-batch", 1)[0])[1].backward()
        opt_a.step()
    with pytest.raises(ValueError, match="being recorded by another monitor"):  # a's report left it open: still a's
        NumericsMonitor(b, opt_b, record=tmp_path / "run")
    with NumericsMonitor(a, opt_a, record=tmp_path / "run") as second:
        assert first._closed and not second._closed
    train(b, opt_b, W.batches("none", 2), record=tmp_path / "run")  # closed: free again
    [r] = read_run(str(tmp_path / "run"))
    assert r.steps.tolist() == [0, 0, 1]  # a's stopped step 0, then b's two (a later recording appends its chunks)


def test_a_run_that_goes_non_finite_is_on_disk_before_the_error(tmp_path):
    model = W.Net("none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs = W.batches("none", 5)
    recorded = None
    with pytest.raises(NonFiniteError) as e, NumericsMonitor(model, opt, record=tmp_path / "run",
                                                             record_flush=100):
        for step, x in enumerate(xs):
            if step == 3:  # a weight written between two steps: block0.0 overflows fp32 at step 3
                with torch.no_grad():
                    model.block0[0].weight.mul_(1e38)
            try:
                model(x)[1].backward()
                opt.step()
            finally:
                opt.zero_grad()
        recorded = "never"  # (not reached)
    assert recorded is None and e.value.first.step == 3
    [r] = read_run(str(tmp_path / "run"))
    assert r.steps.tolist() == [0, 1, 2, 3]
    first = e.value.first
    assert first.phase == "fwd"
    col = next(i for i, k in enumerate(r.keys) if k[:4] == (first.module, first.cls, "fwd", first.slot))
    assert not math.isfinite(r.values[3, col, 1].item())  # the step that stopped, as the report names it
    assert all(math.isfinite(v) for v in r.values[:3, col, 1].tolist())
    saved = json.loads((tmp_path / "run" / "rank0" / "report.json").read_text())
    assert saved["first"]["module"] == first.module and saved["step"] == 3


def test_npy_files_are_plain_npy(tmp_path):
    """The chunks are the .npy format (magic, header dict, raw little-endian data): what numpy reads."""
    t = torch.tensor([[1.5, -1.0], [float("inf"), float("nan")]], dtype=torch.float32)
    write_npy(str(tmp_path / "a.npy"), t)
    raw = (tmp_path / "a.npy").read_bytes()
    assert raw.startswith(b"\x93NUMPY\x01\x00") and b"'descr': '<f4'" in raw and b"'shape': (2, 2)" in raw
    back = read_npy(str(tmp_path / "a.npy"))
    assert back[0].tolist() == [1.5, -1.0] and math.isinf(back[1, 0].item()) and math.isnan(back[1, 1].item())
    numpy = pytest.importorskip("numpy")
    assert numpy.load(tmp_path / "a.npy")[0].tolist() == [1.5, -1.0]


def test_bad_record_options_are_refused():
    model = W.Net("none")
    with pytest.raises(ValueError, match="record_every"):
        NumericsMonitor(model, record="x", record_every=0)
    with pytest.raises(TypeError, match="record must be a folder path"):
        NumericsMonitor(model, record=3)

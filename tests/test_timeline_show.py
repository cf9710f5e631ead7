"""``torchdoctor numerics show``: a recording drawn as one self-contained page -- the first non-finite value marked
where the monitor found it, the step axis downsampled keeping each column's extremes and the first bad step, the
page's size bounded -- opened in headless Chromium with no network (tests/timeline_runs.py)."""

from __future__ import annotations

import base64
import json
import math
import re

import pytest
import torch
from torch import nn

from timeline_runs import NONFINITE_RGB, browse, external_references, hover, record_gpt2
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.cli import main
from torchdoctor.numerics.timeline.html import CSP
from torchdoctor.numerics.timeline.show import build
from torchdoctor.numerics.timeline.store import RankTimeline, TimelineWriter, read_run


def show(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["numerics", "show", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def page_data(text: str) -> tuple[dict, list[torch.Tensor]]:
    """The page's description and, per rank, its (abs max, abs min) blocks as (2, phase, row, column) tensors."""
    meta = json.loads(re.search(r'<script type="application/json" id="td-meta">(.*?)</script>', text, re.S).group(1))
    blocks = []
    for rank in meta["ranks"]:
        raw = re.search(rf'id="{rank["sources"][0]}">\s*(.*?)\s*</script>', text, re.S).group(1)
        data = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.float32)
        blocks.append(data.reshape(2, 2, len(rank["rows"]), len(rank["first"])))
    return meta, blocks


def recorded_cells(rec: RankTimeline, phase: str) -> int:
    cols = [i for i, k in enumerate(rec.keys) if k[2] == phase]
    v = rec.values[:, cols, 1]
    return int(((v >= 0) | v.isnan()).sum())


def test_a_gpt2_going_non_finite_is_marked_where_the_monitor_found_it(tmp_path, capsys):
    error = record_gpt2(tmp_path / "rec", scale_at=(4, 1e37))  # block 1's MLP weights blown up before step 4
    assert error is not None and error.first is not None and error.first.step == 4
    first = error.first
    [rec] = read_run(str(tmp_path / "rec"))
    col = next(i for i, k in enumerate(rec.keys) if k[:4] == (first.module, first.cls, first.phase, first.slot))
    assert not math.isfinite(rec.values[-1, col, 1].item()) and rec.steps.tolist()[-1] == 4
    assert all(math.isfinite(v) for v in rec.values[:-1, col, 1].tolist())  # finite before the step that stopped

    rc, out, _ = show(capsys, tmp_path / "rec", "-o", tmp_path / "page.html")
    phase = "forward" if first.phase == "fwd" else "backward"
    assert rc == 1 and f"first {first.value} (the monitor's report): step 4, {phase}, {first.module} " \
                       f"({first.cls}) {first.slot}" in out
    text = (tmp_path / "page.html").read_text()
    assert external_references(text) == [] and CSP in text  # nothing to fetch, and the page may fetch nothing
    meta, _ = page_data(text)
    state = browse(tmp_path / "page.html", tmp_path)
    fwd, bwd = state["panels"]
    p = 0 if first.phase == "fwd" else 1
    marked = state["panels"][p]["marker"]
    assert marked["step"] == 4 and meta["ranks"][0]["first"][marked["col"]] == 4
    assert meta["ranks"][0]["rows"][marked["row"]][:2] == [first.module, first.cls]
    assert marked["pixel"] == NONFINITE_RGB  # the cell drawn there is the non-finite colour
    # every recorded value was painted, nothing else (one pixel per cell at this size)
    assert (fwd["painted"], bwd["painted"]) == (recorded_cells(rec, "fwd"), recorded_cells(rec, "bwd"))
    assert fwd["display"] == [len(meta["ranks"][0]["first"]), len(meta["ranks"][0]["rows"])]
    # hover over that module's cell at step 0: its exact recorded values (float32, as few digits as tell them apart)
    tip = hover(tmp_path / "page.html", tmp_path, p, marked["row"], 0).splitlines()
    assert tip[0].startswith(f"{first.module} ({first.cls}) ") and tip[1] == "step 0"
    hi, lo = re.match(r"abs max (\S+), abs min (\S+) \((\w+)\)", tip[2]).groups()[:2]
    as_float32 = torch.tensor([float(hi), float(lo)], dtype=torch.float32).tolist()
    assert as_float32 == [rec.values[0, col, 1].item(), rec.values[0, col, 0].item()]


def test_the_demos_t5_in_fp16_is_marked_at_the_value_that_overflowed(tmp_path, capsys):
    from torchdoctor.demo.model import build_demo, train_steps

    model, batches = build_demo(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as e, NumericsMonitor(model, opt, record=tmp_path / "rec"):
        train_steps(model, batches, 3, "fp16", optimizer=opt)
    first = e.value.first
    rc, out, _ = show(capsys, tmp_path / "rec", "--json")
    assert rc == 1
    [rank] = json.loads(out)["ranks"]
    got = rank["first_nonfinite"]
    assert (got["step"], got["phase"], got["module"], got["class"], got["slot"], got["source"], got["drawn"]) == (
        first.step, first.phase, first.module, first.cls, first.slot, "report", True)
    # the value nearest its dtype's max is an fp16 one (the demo's feed-forward, calibrated just under 65504),
    # and its distance is what its value says
    near = rank["closest_to_max"]
    assert near["dtype"] == "float16" and near["abs_max"] <= 65504
    assert near["decades_below_max"] == pytest.approx(math.log10(65504 / near["abs_max"]), abs=1e-3)
    assert (tmp_path / "rec" / "timeline.html").exists()  # (the default output)
    assert (tmp_path / "rec" / "rank0" / "report.txt").read_text().startswith(f"Detected {first.value} at step")


def synthetic(tmp_path, steps: int, keys: int, bad: tuple[int, int] | None = None) -> RankTimeline:
    """A recording written by the real writer: ``keys`` forward rows of random values, one non-finite if asked."""
    writer = TimelineWriter(str(tmp_path / "rec"), 0, {"world_size": 1, "record_every": 1}, flush_every=500)
    names = [(f"layer{i}", "Linear", "fwd", "output", "bfloat16") for i in range(keys)]
    g = torch.Generator().manual_seed(0)
    values = (torch.rand(steps, keys, 2, generator=g) * 10.0 ** torch.randint(-3, 4, (steps, keys, 1), generator=g))
    values = values.sort(dim=2).values  # (abs min, abs max)
    if bad is not None:
        values[bad[0], bad[1], 1] = float("nan")
    for step in range(steps):
        writer.add(step, names, values[step])
    writer.close()
    [rec] = read_run(str(tmp_path / "rec"))
    return rec


def test_the_step_axis_keeps_each_columns_extremes_and_the_first_bad_step_alone(tmp_path, capsys):
    rec = synthetic(tmp_path, 1500, 3, bad=(1234, 1))
    rc, out, _ = show(capsys, tmp_path / "rec", "-o", tmp_path / "page.html", "--columns", "60")
    assert rc == 1 and "first nan (the first non-finite value recorded): step 1234, forward, layer1" in out
    meta, [data] = page_data((tmp_path / "page.html").read_text())
    rank = meta["ranks"][0]
    assert len(rank["first"]) <= 60
    assert sum(rank["count"]) == 1500 and rank["first"][0] == 0 and rank["last"][-1] == 1499
    steps = rec.steps.tolist()
    for c, (lo_step, hi_step) in enumerate(zip(rank["first"], rank["last"])):
        a, b = steps.index(lo_step), steps.index(hi_step) + 1
        assert b - a == rank["count"][c]
        for r in range(3):
            his = rec.values[a:b, r, 1].tolist()
            los = rec.values[a:b, r, 0].tolist()
            want_hi = math.nan if any(x != x for x in his) else max(his)
            got_hi, got_lo = data[0, 0, r, c].item(), data[1, 0, r, c].item()
            assert got_hi == want_hi or (got_hi != got_hi and want_hi != want_hi), (c, r)
            assert got_lo == min(los), (c, r)
    alone = rank["first"].index(1234)
    assert rank["last"][alone] == 1234 and math.isnan(data[0, 0, 1, alone].item())
    assert data[0, 1].min().item() == -1.0  # the backward was not recorded: every cell says so


@pytest.mark.parametrize("ranks,steps", [(1, 1300), (4, 500)])
def test_a_page_of_500_modules_stays_under_20_mb_at_any_length(ranks, steps):
    """The page's size depends on the rows and the columns, not on the steps: past the column budget (1,200 columns
    for one rank of 500 modules, 400 for four) more steps fold into the same columns, so these fill it as 10,000
    steps would."""
    modules = 500
    keys = [(f"m{i}", "Linear", ph, "output" if ph == "fwd" else "grad_output", "bfloat16")
            for ph in ("fwd", "bwd") for i in range(modules)]
    values = torch.rand(steps, len(keys), 2)
    runs = [RankTimeline(r, {"world_size": ranks, "record_every": 1}, keys, torch.arange(steps), values)
            for r in range(ranks)]
    text, summaries = build(runs, "size")
    assert len(text.encode()) < 20 * 2**20
    assert all(s.columns >= 100 for s in summaries) and summaries[0].columns == (1200 if ranks == 1 else 400)


def test_a_module_called_twice_in_a_step_keeps_both_calls_extremes(tmp_path):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.out = nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.shared(self.shared(x)))

    torch.manual_seed(0)
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(3, 4)
    with NumericsMonitor(model, opt, record=tmp_path / "rec"):
        model(x).sum().backward()
        opt.step()
    [rec] = read_run(str(tmp_path / "rec"))
    keys = [k for k in rec.keys if k[0] == "shared"]
    assert sorted(k[2] for k in keys) == ["bwd", "fwd"]  # one key per phase, not one per call
    with torch.no_grad():
        torch.manual_seed(0)
        fresh = Twice()
        h1 = fresh.shared(x)
        h2 = fresh.shared(h1)
    both = torch.cat([h1.abs().flatten(), h2.abs().flatten()])
    col = rec.keys.index(("shared", "Linear", "fwd", "output", "float32"))
    assert rec.values[0, col].tolist() == pytest.approx([both.min().item(), both.max().item()])


def test_a_folder_that_is_not_a_recording_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    newer = tmp_path / "newer" / "rank0"
    newer.mkdir(parents=True)
    (newer / "settings.json").write_text('{"format": 99}')
    broken = tmp_path / "broken" / "rank0"
    broken.mkdir(parents=True)
    (broken / "settings.json").write_text("{not json")
    cases = {"nowhere": "no such folder", "file.txt": "not a folder", "empty": "not a numerics recording",
             "newer": "recording format 99", "broken": "unreadable recording"}
    for name, words in cases.items():
        for argv in (["show", tmp_path / name], ["diff", tmp_path / name, tmp_path / name]):
            rc = main(["numerics", *map(str, argv)])
            err = capsys.readouterr().err
            assert rc == 2 and words in err and err.count("\n") == 1, (argv, err)

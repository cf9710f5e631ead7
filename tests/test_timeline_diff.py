"""``torchdoctor numerics diff``: two real recordings of a GPT-2 built from a config -- twins, one weight changed at
step 5, bf16 autocast against fp32 -- compared; what diff names is checked against the recordings themselves."""

from __future__ import annotations

import json

import pytest

from timeline_runs import browse, record_gpt2
from torchdoctor.cli import main
from torchdoctor.numerics.timeline.store import read_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, options in {"base": {}, "twin": {}, "scaled": {"scale_at": (5, 1.01)}, "bf16": {"bf16": True}}.items():
        assert record_gpt2(root / name, **options) is None
    return root


def diff(capsys, *args) -> tuple[int, dict, str]:
    rc = main(["numerics", "diff", *map(str, args), "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip() else {}, out.err


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b)) if max(abs(a), abs(b)) > 0 else 0.0


def forward_at(rec, step: int) -> list[tuple[str, str, float]]:
    """(module, dtype, abs max) of each forward output recorded at ``step``, in execution order."""
    i = rec.steps.tolist().index(step)
    return [(k[0], k[4], rec.values[i, j, 1].item()) for j, k in enumerate(rec.keys)
            if k[2] == "fwd" and rec.values[i, j, 1].item() >= 0]


def test_identical_seeded_runs_agree(runs, capsys):
    rc, got, _ = diff(capsys, runs / "base", runs / "twin")
    assert rc == 0 and got["verdict"] == "agree" and got["first"] is None
    assert got["steps_compared"] == 7 and got["rows"] > 20
    assert got["largest"] is None  # bit for bit: not even a difference within tolerance
    rc = main(["numerics", "diff", str(runs / "base"), str(runs / "twin")])
    assert rc == 0 and "AGREE: every value compared is within rtol 0.001; every value identical" in \
        capsys.readouterr().out


def test_a_weight_changed_at_step_5_is_named_with_what_still_agreed_before_it(runs, capsys):
    rc, got, _ = diff(capsys, runs / "base", runs / "scaled")
    assert rc == 1 and got["verdict"] == "diverge"
    first = got["first"]
    assert (first["step"], first["module"], first["phase"], first["rank"]) == (5, "transformer.h.1.mlp.c_fc", "fwd",
                                                                                0)
    assert 1 < first["b"] / first["a"] < 1.0101  # weights 1% larger (the bias unchanged): an output up to 1% larger
    [a], [b] = read_run(str(runs / "base")), read_run(str(runs / "scaled"))
    fa, fb = forward_at(a, 5), forward_at(b, 5)
    at = [m for m, _, _ in fa].index("transformer.h.1.mlp.c_fc")
    assert fa[:at] == fb[:at]  # every forward output before it that step: identical
    assert got["upstream_agreed"] == at and got["upstream"][0]["module"] == fa[at - 1][0]
    assert all(u["a"] == u["b"] for u in got["upstream"])
    for step in range(5):  # and every value of every earlier step
        i = a.steps.tolist().index(step)
        assert a.values[i].tolist() == b.values[i].tolist()
    assert [g["step"] for g in got["growth"]] == [5, 6]
    assert got["growth"][0]["differing"] >= 1 and got["growth"][0]["first"]["module"] == first["module"]


@pytest.mark.parametrize("rtol", [1e-3, 3e-3])
def test_fp32_against_bf16_autocast_names_the_first_module_beyond_rtol(runs, capsys, tmp_path, rtol):
    rc, got, _ = diff(capsys, runs / "base", runs / "bf16", "--rtol", rtol, "-o", tmp_path / "diff.html")
    assert rc == 1
    first = got["first"]
    [a], [b] = read_run(str(runs / "base")), read_run(str(runs / "bf16"))
    fa, fb = forward_at(a, 0), forward_at(b, 0)
    assert [m for m, _, _ in fa] == [m for m, _, _ in fb]
    beyond = [m for (m, _, x), (_, _, y) in zip(fa, fb) if rel(x, y) > rtol]
    assert (first["step"], first["phase"], first["module"]) == (0, "fwd", beyond[0])
    assert first["dtype_a"] == "float32" and first["dtype_b"] == "bfloat16"  # where bf16 compute begins to tell
    at = [m for m, _, _ in fa].index(beyond[0])
    assert got["upstream_agreed"] == at and all(rel(u["a"], u["b"]) <= rtol for u in got["upstream"])
    state = browse(tmp_path / "diff.html", tmp_path)
    a_panel, b_panel, ratio = state["panels"]
    assert (a_panel["kind"], ratio["kind"], ratio["phase"]) == ("values", "ratio", 0)
    assert ratio["marker"]["step"] == 0 and ratio["marker"]["col"] == 0
    assert ratio["painted"] == a_panel["painted"] == b_panel["painted"] > 0

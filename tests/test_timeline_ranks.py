"""``torchdoctor run --numerics --record DIR`` under torchrun with 2 ranks (gloo): each rank records its own folder,
``numerics show`` has a page per rank, ``numerics diff`` names the rank where two runs part, and folds the ranks of
two runs of different sizes. Real runs of tests/switch_worker.py (a DDP loop that knows nothing of torchdoctor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runs import PY, the, torchdoctor_run
from timeline_runs import browse
from torchdoctor.cli import main
from torchdoctor.numerics.timeline.store import read_run

WORKER = str(Path(__file__).with_name("switch_worker.py"))
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def recorded(tmp_path: Path, name: str, *worker_args: str) -> tuple[int, dict, Path]:
    out = tmp_path / f"out-{name}"
    out.mkdir()
    rec = tmp_path / name
    rc, rep, _, err = torchdoctor_run(tmp_path, "--numerics", "--record", str(rec), "--", *TORCHRUN, WORKER, "plain",
                                      str(out), "--ddp", "--steps", "4", *worker_args, timeout=300,
                                      OMP_NUM_THREADS="1")
    assert rep is not None, err[-3000:]
    return rc, rep, rec


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    healthy = recorded(tmp, "healthy")
    bad = recorded(tmp, "bad", "--bad-step", "2", "--bad-rank", "1")  # rank 1's input of step 2 is inf
    return tmp, healthy, bad


def test_each_rank_records_its_own_folder_and_the_page_has_both(two_runs, tmp_path, capsys):
    _, (rc, rep, rec), _ = two_runs
    assert rc == 0 and the(rep, "numerics.attached")["severity"] == "ok"
    attached = the(rep, "numerics.attached")  # run's verdict says where the recording is, as found on disk
    assert attached["data"]["recorded"] == ["rank0", "rank1"] and f"recorded 2 rank(s) in {rec}" in attached["title"]
    assert attached["fix"] == [f"torchdoctor numerics show {rec} -o timeline.html (the steps before it, module by "
                               "module)"]
    ranks = read_run(str(rec))
    assert [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        assert r.settings["rank"] == r.rank and r.settings["world_size"] == 2
        assert r.steps.tolist() == [0, 1, 2, 3] and {k[0] for k in r.keys} >= {"fc1", "act", "fc2"}
    assert ranks[0].values.tolist() != ranks[1].values.tolist()  # (each rank its own batches)
    assert main(["numerics", "show", str(rec), "-o", str(tmp_path / "page.html")]) == 0
    assert "rank 1: 3 module outputs x 4 recorded steps" in capsys.readouterr().out
    assert main(["numerics", "show", str(rec), "--ranks", "1", "-o", str(tmp_path / "one.html"), "--json"]) == 0
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["ranks"]] == [1]
    assert main(["numerics", "show", str(rec), "--ranks", "5"]) == 2
    assert "has no rank 5 (it has 0, 1)" in capsys.readouterr().err
    state = browse(tmp_path / "page.html", tmp_path, "#rank=1")
    assert (state["rank"], state["rank_name"]) == (1, "rank 1") and state["panels"][0]["painted"] == 3 * 4


def test_diff_names_the_rank_where_two_runs_part(two_runs, capsys):
    _, (_, _, healthy), (rc, rep, bad) = two_runs
    assert rc == 1 and the(rep, "numerics.nonfinite")["data"]["first_rank"] == 1
    rc = main(["numerics", "diff", str(healthy), str(bad), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 1 and not got["ranks_folded"]
    first = got["first"]
    # rank 0's step 2 was its own healthy forward; rank 1's first module saw the inf input
    assert (first["step"], first["rank"], first["phase"], first["module"]) == (2, 1, "fwd", "fc1")
    assert first["other_ranks"] == [] and first["b"] in ("inf", "nan") and got["upstream_agreed"] == 0
    # the bad run's page: each rank marked where its own monitor saw the first non-finite value -- rank 1 its forward,
    # rank 0 the gradient DDP brought it from rank 1 (a parameter's: the recording keeps no row of its own for it,
    # the marker goes on that module's row and says so)
    assert main(["numerics", "show", str(bad)]) == 1
    text = capsys.readouterr().out
    assert main(["numerics", "show", str(bad), "--json"]) == 1
    shown = {r["rank"]: r["first_nonfinite"] for r in json.loads(capsys.readouterr().out)["ranks"]}
    for r in read_run(str(bad)):
        want = r.report["first"]
        got = shown[r.rank]
        assert (got["step"], got["phase"], got["module"], got["slot"], got["drawn"]) == (
            want["step"], want["phase"], want["module"], want["slot"], True)
    assert (shown[1]["step"], shown[1]["module"]) == (2, "fc1")
    if shown[0]["slot"].startswith("grad:"):
        assert "a value the recording does not keep" in text


def test_runs_of_different_world_sizes_are_compared_with_their_ranks_folded(two_runs, tmp_path, capsys):
    tmp, (_, _, healthy), _ = two_runs
    one = tmp_path / "one"
    shutil.copytree(healthy / "rank0", one / "rank0")  # a one-rank recording: rank 0 alone
    rc = main(["numerics", "diff", str(healthy), str(one), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["ranks"] == [2, 1] and got["ranks_folded"]
    ranks = read_run(str(healthy))
    # folded: per step and key the larger abs max of the two ranks; rank 0 alone differs where rank 1's was larger
    larger = [(i, j) for i in range(4) for j, k in enumerate(ranks[0].keys)
              if ranks[1].values[i, ranks[1].keys.index(k), 1] > ranks[0].values[i, j, 1]]
    assert (rc == 1) == bool(larger)
    if larger:
        assert got["first"]["rank"] == "all" and got["first"]["step"] == min(i for i, _ in larger)

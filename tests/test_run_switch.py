"""``torchdoctor run --numerics``: the monitor attached in every Python process of a command, no code change.

Real runs of scripts that know nothing of torchdoctor (tests/switch_worker.py): a plain loop in fp16 autocast,
the same under torchrun with 2 ranks and under ``accelerate launch``, the HF Trainer, Lightning (1 and 2 ranks),
Fabric, ``deepspeed.initialize`` under the ``deepspeed`` launcher, ``step(closure)`` with AdamW and LBFGS; a script
with its own monitor, a healthy one, a command with no Python. Each is bounded (tests/runs.py); the scripts write
what each rank saw (tests/switch_worker.py's ``Result``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from conftest import free_port
from runs import PY, SRC, ids, the, torchdoctor_run
from torchdoctor.run.inside import BOOT_DIR, OPTIONS_VAR
from torchdoctor.run.inside.plain import pick_model

WORKER = str(Path(__file__).with_name("switch_worker.py"))
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def results(out: Path) -> dict[int, dict]:
    return {int(p.stem.removeprefix("result-rank")): json.loads(p.read_text()) for p in out.glob("result-rank*.json")}


def switched(tmp_path: Path, *worker_args: str, options: tuple[str, ...] = (), launcher: tuple[str, ...] = (PY,),
             **env: str) -> tuple[int, dict, str, dict[int, dict]]:
    """``run --numerics OPTIONS -- LAUNCHER switch_worker.py ARGS``: (exit code, report, stderr, per-rank results)."""
    out = tmp_path / "out"
    out.mkdir()
    env.setdefault("OMP_NUM_THREADS", "1")
    rc, rep, _, err = torchdoctor_run(tmp_path, "--numerics", *options, "--", *launcher, WORKER, worker_args[0],
                                      str(out), *worker_args[1:], timeout=300, **env)
    assert rep is not None, err[-3000:]
    return rc, rep, err, results(out)


def assert_stopped_before_update(rep: dict, got: dict[int, dict], *, step: int, module: str, rank=None,
                                 phase: str = "forward") -> dict:
    f = the(rep, "numerics.nonfinite")
    assert f["severity"] == "fail"
    assert (f["data"]["step"], f["data"]["phase"], f["data"]["module"]) == (step, phase, module), f["data"]
    assert f["data"]["first_rank"] == rank
    assert "process.exception" not in ids(rep)  # the monitor's NonFiniteError is not "your code"
    assert got, "no rank wrote its result"
    for r, res in got.items():
        assert res["error"] == "NonFiniteError", (r, res)
        assert res["steps_done"] == step, (r, res)  # the step named is the one that went bad
        assert res["identical"], (r, res)  # and its update was never applied
    return f


def attached(rep: dict) -> dict:
    f = the(rep, "numerics.attached")
    assert f["severity"] == "ok"
    return f


def test_a_plain_fp16_loop_is_stopped_at_the_module_that_overflowed(tmp_path):
    rc, rep, err, got = switched(tmp_path, "plain", "--fp16", "--bad-step", "2")
    assert rc == 1 and rep["exit_code"] == 1
    f = assert_stopped_before_update(rep, got, step=2, module="fc1")
    # fc1 alone in fp32 hands its ~1e6 output on to fc2, which takes it in fp16: the fix check, run on the bad step
    # before anything is printed, finds that and prints the change that made the step finite
    assert f["data"]["fix_check"] == "fixed" and "keep_fp32('fc1')" in f["data"]["fix_check_reason"]
    assert f["data"]["fix"].startswith("train in bf16")
    assert "[torchdoctor] watching Net (161 params) with SGD, grads=params" in err
    [marker] = attached(rep)["data"]["attached"]
    assert (marker["via"], marker["own"], marker["rank"]) == ("plain", False, None)


def test_torchrun_two_ranks_names_the_rank_that_went_first(tmp_path):
    rc, rep, err, got = switched(tmp_path, "plain", "--ddp", "--bad-step", "2", "--bad-rank", "1",
                                 launcher=tuple(TORCHRUN))
    assert rc != 0
    assert sorted(got) == [0, 1]
    f = assert_stopped_before_update(rep, got, step=2, module="fc1", rank=1)
    assert f["data"]["other_ranks"] == [0]
    for r in (0, 1):
        assert f"[torchdoctor][rank{r}] watching Net (161 params) with SGD, DDP, grads=params" in err
    assert sorted(m["rank"] for m in attached(rep)["data"]["attached"]) == [0, 1]


def test_accelerate_launch(tmp_path):
    pytest.importorskip("accelerate")
    launcher = (PY, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no")
    rc, rep, err, got = switched(tmp_path, "plain", "--bad-step", "2", launcher=launcher)
    assert rc != 0
    assert_stopped_before_update(rep, got, step=2, module="fc1")
    assert "[torchdoctor] watching Net (161 params) with SGD, grads=params" in err


@pytest.mark.parametrize("optimizer", ["adamw", "lbfgs"])
def test_step_with_a_closure_is_checked_before_its_update(tmp_path, optimizer):
    rc, rep, _, got = switched(tmp_path, "plain", "--optimizer", optimizer, "--closure", "--bad-step", "2")
    assert rc == 1
    assert_stopped_before_update(rep, got, step=2, module="fc1")


def test_the_hf_trainer_gets_the_callback(tmp_path):
    pytest.importorskip("transformers")
    rc, rep, err, got = switched(tmp_path, "hf", "--bad-step", "2")
    assert rc == 1
    assert_stopped_before_update(rep, got, step=2, module="transformer.h.1.mlp")
    assert "[torchdoctor] watching GPT2LMHeadModel (28K params) with AdamW, grads=params" in err
    assert [m["via"] for m in attached(rep)["data"]["attached"]] == ["hf"]


@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_gets_its_callback(tmp_path, devices):
    pytest.importorskip("lightning")
    rc, rep, err, got = switched(tmp_path, "lightning", "--bad-step", "2", "--bad-rank", str(devices - 1),
                                 "--devices", str(devices))
    assert rc == 1
    assert sorted(got) == list(range(devices))
    assert_stopped_before_update(rep, got, step=2, module="net.fc1", rank=devices - 1 if devices > 1 else None)
    markers = attached(rep)["data"]["attached"]
    assert [m["via"] for m in markers] == ["lightning"] * devices
    assert all(m["watching"] == "Regressor (161 params) with SGD, " + ("DDP, " if devices > 1 else "") +
               "grads=params, watch=boundaries" for m in markers), markers


def test_a_fabric_loop_is_looked_through(tmp_path):
    pytest.importorskip("lightning")
    rc, rep, err, got = switched(tmp_path, "fabric", "--bad-step", "2")
    assert rc == 1
    assert_stopped_before_update(rep, got, step=2, module="fc1")
    assert "watching Net (161 params) with SGD, Fabric, grads=params" in err


def test_the_engine_deepspeed_initialize_returns_under_the_deepspeed_launcher(tmp_path, deepspeed_built):
    launcher = (PY, "-m", "deepspeed.launcher.runner", "--num_accelerators", "1", "--master_port", str(free_port()))
    rc, rep, err, got = switched(tmp_path, "deepspeed", "--bad-step", "2", launcher=launcher, DS_ACCELERATOR="cpu")
    assert rc == 1
    assert_stopped_before_update(rep, got, step=2, module="fc1")
    [marker] = attached(rep)["data"]["attached"]
    assert marker["via"] == "deepspeed" and "DeepSpeed ZeRO-1" in marker["watching"]
    assert marker["rank"] == 0  # the launcher's RANK


def test_a_script_with_its_own_monitor_is_left_to_it(tmp_path):
    rc, rep, err, got = switched(tmp_path, "plain", "--own-monitor", "--bad-step", "2")
    assert rc == 1
    assert_stopped_before_update(rep, got, step=2, module="fc1")
    assert err.count("leaves it to it") == 1 and "watching Net" not in err
    [marker] = attached(rep)["data"]["attached"]
    assert marker["own"] and marker["via"] == "monitor"
    assert len(list((tmp_path / "out").glob("*.json"))) == 1  # one result; no second report anywhere


def test_a_healthy_run_passes_with_the_options_given(tmp_path):
    rc, rep, err, got = switched(tmp_path, "plain", options=("--grads", "modules", "--trace-steps", "1", "--watch",
                                                             "every-module", "--transient", "skip",
                                                             "--headroom-every", "2"))
    assert rc == 0 and rep["exit_code"] == 0
    assert "numerics.nonfinite" not in ids(rep)
    assert got[0]["steps_done"] == 5 and got[0]["error"] is None
    watching = attached(rep)["data"]["attached"][0]["watching"]
    assert "grads=modules, watch=every-module, headroom every 2 steps" in watching
    [run_dir] = (tmp_path / "torchdoctor-reports").iterdir()  # the run's own folder
    trace = [json.loads(line) for line in (run_dir / "torchdoctor-trace-rank0.jsonl").read_text().splitlines()]
    assert {t["step"] for t in trace} == {1}
    assert sorted(p.name for p in run_dir.iterdir()) == ["torchdoctor-trace-rank0.jsonl"]  # markers read, removed
    assert any(t["phase"] == "bwd" for t in trace)  # grads="modules": module output gradients traced too


@pytest.mark.parametrize("cmd, loaded", [(["sh", "-c", "echo no python here; exit 3"], 0),
                                         ([PY, "-c", "import torch, sys; sys.exit(3)"], 1)], ids=["sh", "no-training"])
def test_a_command_with_nothing_to_watch_gets_a_note_and_keeps_its_exit_code(tmp_path, cmd, loaded):
    rc, rep, _, _ = torchdoctor_run(tmp_path, "--numerics", "--", *cmd)
    assert rc == 3 and rep["exit_code"] == 3
    f = the(rep, "numerics.not-attached")
    assert f["severity"] == "info" and f["data"]["loaded"] == loaded
    assert not (tmp_path / "torchdoctor-reports").exists()  # nothing to report: no folder left behind


# ---------------------------------------------------------------- the bootstrap itself
def _python(tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (OPTIONS_VAR, "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def test_the_bootstrap_off_imports_nothing_and_runs_the_sitecustomize_it_hides(tmp_path):
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = ("import os, sys; print(sorted(m for m in sys.modules if m.startswith(('torch', 'torchdoctor'))), "
            "os.environ.get('OTHER_SITECUSTOMIZE_RAN'))")
    path = os.pathsep.join([BOOT_DIR, str(other)])
    off = _python(tmp_path, code, PYTHONPATH=path)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["[]", "1"]
    opts = json.dumps({"report_dir": str(tmp_path / "reports"), "path": str(Path(SRC)), "markers": True})
    on = _python(tmp_path, code, PYTHONPATH=path, **{OPTIONS_VAR: opts})
    assert on.returncode == 0, on.stderr
    assert "'torchdoctor.run.inside.startup'" in on.stdout and "'torch'" not in on.stdout  # hooks only
    assert on.stdout.rstrip().endswith("1")
    [loaded] = list((tmp_path / "reports").glob("torchdoctor-loaded-*.json"))
    assert json.loads(loaded.read_text())["pid"] > 0


def test_a_broken_bootstrap_never_stops_the_program(tmp_path):
    bad = _python(tmp_path, "print('ran')", PYTHONPATH=BOOT_DIR, **{OPTIONS_VAR: "{not json"})
    assert bad.returncode == 0 and bad.stdout == "ran\n"
    assert bad.stderr.startswith("[torchdoctor] --numerics is off in this process")


# ---------------------------------------------------------------- which model a plain loop trains
class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)

    def forward(self, x):
        return self.body(x)


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


def test_the_model_is_the_outermost_module_holding_the_optimizers_parameters():
    student, teacher = Student(), Student()
    wrapped = Wrapper(student)
    ids_ = {id(p) for p in student.parameters()}
    assert pick_model(ids_, [student, teacher, wrapped, student.body]) is wrapped
    assert pick_model(ids_, [teacher]) is None
    assert pick_model(set(), [student]) is None
    both = nn.ModuleDict({"ema": teacher, "model": student})  # a container with no forward is looked into
    assert pick_model(ids_, [both, student, teacher]) is student
    pair = Wrapper(nn.ModuleList([student, nn.Linear(9, 9)]))  # also holds trainable weights nobody steps
    assert pick_model(ids_, [pair, wrapped]) is wrapped


def test_the_switch_written_by_hand_takes_the_defaults(tmp_path):
    reports = tmp_path / "shared-reports"
    env = {k: v for k, v in os.environ.items() if k not in (OPTIONS_VAR, "PYTHONPATH", "TORCHDOCTOR_REPORT_DIR")}
    env.update(PYTHONPATH=os.pathsep.join([BOOT_DIR, SRC]), OMP_NUM_THREADS="1", TORCHDOCTOR_REPORT_DIR=str(reports),
               **{OPTIONS_VAR: "1"})
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([PY, WORKER, "plain", str(out), "--bad-step", "2"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "NonFiniteError" in proc.stderr
    assert "[torchdoctor] watching Net (161 params) with SGD, grads=params" in proc.stderr
    assert json.loads((reports / "torchdoctor-nonfinite-rank0.json").read_text())["step"] == 2
    assert results(out)[0]["identical"]
    assert not list(reports.glob("torchdoctor-loaded-*")) and not list(reports.glob("torchdoctor-attached-*"))

"""``torchdoctor precision`` and the user's own code: a factory's prints and warnings are shown (on stderr under
--json, whose stdout stays one JSON document), its exit -- sys.exit, or argparse refusing a command line -- is said
as its own in one line (exit 2); and a model the target dtype cannot run on this device (CPU fp16 autocast refuses
an LSTM) is one line, exit 2, with a valid --json. Real subprocesses of the command line, factories in a temp
folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).parent.parent / "src")

FACTORIES = '''
import argparse
import sys
import warnings

import torch
from torch import nn

print("importing mytrain")  # a training script's module-level output


def small():
    return nn.Linear(4, 1), (torch.randn(2, 4),)


def chatty():
    print("building the model")
    warnings.warn("a deprecated option")
    print("logged", file=sys.stderr)
    return small()


def parses():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4)
    args = parser.parse_args()  # a training script's build(): its own command line, all defaults here
    return nn.Linear(args.hidden, 1), (torch.randn(2, args.hidden),)


def needs_data():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.parse_args()
    return small()


def exits():
    sys.exit(3)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.lstm(x)[0]).float().pow(2).mean()


def recurrent():
    torch.manual_seed(0)
    return Recurrent(), (torch.randn(2, 5, 8),)


class RefusesHalf(nn.Module):
    """Raises as a kernel without an fp16 version does (torch's words for it)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.dtype == torch.float16:
            raise RuntimeError("\\"addmm\\" not implemented for 'Half'")
        return y.float().pow(2).mean()


def refuses_half():
    torch.manual_seed(0)
    return RefusesHalf(), (torch.randn(2, 4),)
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user")
    (path / "mytrain.py").write_text(textwrap.dedent(FACTORIES))
    return path


def precision(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "torchdoctor", "precision", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=folder)


def test_a_factorys_output_is_kept_and_json_stays_one_document(folder):
    proc = precision(folder, "mytrain:chatty", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["model"].startswith("Linear from mytrain:chatty")
    for line in ("importing mytrain", "building the model", "logged", "UserWarning: a deprecated option"):
        assert line in proc.stderr
    proc = precision(folder, "mytrain:chatty")
    assert proc.returncode == 0 and "importing mytrain\nbuilding the model\n" in proc.stdout
    assert "UserWarning: a deprecated option" in proc.stderr and "logged" in proc.stderr


def test_a_factory_that_parses_a_command_line_gets_its_own_not_torchdoctors(folder):
    proc = precision(folder, "mytrain:parses", "--json", "--batch-size", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["verdict"] == "safe"


def test_a_factorys_exit_is_said_as_its_own_in_one_line(folder):
    proc = precision(folder, "mytrain:needs_data", "--json")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "error: the following arguments are required: --data" in proc.stderr  # argparse's own words, kept
    line = f"{FACTORIES.splitlines().index('    parser.parse_args()') + 1}"
    assert lines[-1] == (f"torchdoctor precision: mytrain:needs_data: the factory exited (code 2) in argparse at "
                         f"mytrain.py:{line} in needs_data: it parses a command line, and runs here with sys.argv = "
                         "['mytrain'] (torchdoctor's arguments are not its own); give its options defaults, or point "
                         "torchdoctor at a function that builds the model without parsing")
    proc = precision(folder, "mytrain:exits")
    line = f"{FACTORIES.splitlines().index('    sys.exit(3)') + 1}"
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"torchdoctor precision: mytrain:exits: the factory called sys.exit(3) at mytrain.py:{line} in exits")


def test_a_model_the_dtype_cannot_run_on_this_device_is_one_line_exit_2_and_valid_json(folder):
    """A forward that refuses fp16 (as a kernel without an fp16 version does): one line, exit 2, valid --json; the
    same model in bf16 is measured."""
    proc = precision(folder, "mytrain:refuses_half")
    assert proc.returncode == 2 and proc.stdout == "importing mytrain\n" and "Traceback" not in proc.stderr
    # (a progress line may come first on a slow machine: "torchdoctor precision: <stage> (2 s)")
    assert proc.stderr.splitlines()[-1] == ("torchdoctor precision: the model runs in fp32 but its forward under fp16 "
                                            "autocast on cpu raised RuntimeError: \"addmm\" not implemented for "
                                            "'Half'")
    proc = precision(folder, "mytrain:refuses_half", "--json")
    result = json.loads(proc.stdout)
    assert proc.returncode == 2 and result["verdict"] == "cannot-run"
    assert [f["id"] for f in result["findings"]] == ["precision.cannot-run"]
    assert result["findings"][0]["fix"][0].startswith("measure it where it will train (--device cuda")
    proc = precision(folder, "mytrain:refuses_half", "--dtype", "bf16", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["verdict"] == "safe", proc.stderr[-2000:]


def test_an_lstm_is_said_as_this_machines_fp16_autocast_runs_it(folder):
    """CPU fp16 autocast sends an LSTM to oneDNN, which refuses it where the CPU has no fp16 support: the command
    says what autocast does here, either way."""
    import torch

    from torchdoctor.precision.load import _from_factory

    sys.path.insert(0, str(folder))
    try:
        loaded = _from_factory("mytrain:recurrent")
    finally:
        sys.path.remove(str(folder))
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            loaded.model(*loaded.batch)
        runs = True
    except RuntimeError:
        runs = False
    proc = precision(folder, "mytrain:recurrent", "--json")
    result = json.loads(proc.stdout)
    if runs:
        assert proc.returncode in (0, 1) and result["verdict"] != "cannot-run"
    else:
        assert proc.returncode == 2 and result["verdict"] == "cannot-run"
        assert result["findings"][0]["title"].startswith("the model runs in fp32 but its forward under fp16 autocast "
                                                         "on cpu raised RuntimeError")

"""`torchdoctor comm` where numpy is not installed (torch's wheel does not bring it: `pip install torchdoctor` alone),
and an exception a stage did not expect said as what it is -- a missing module with its `pip install`, a Python
error with where it was raised -- never with the network's fixes. Real processes, this venv's packages with numpy
left out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bounded import run_bounded
from torchdoctor.comm.errors import classify
from torchdoctor.comm.rules import judge

SRC = str(Path(__file__).parent.parent / "src")


@pytest.fixture(scope="module")
def python_without_numpy(tmp_path_factory) -> str:
    """A venv's python that sees every package of this environment except numpy (links) and the source: the ranks
    `comm --local` starts (``sys.executable -m torchdoctor``) see the same."""
    import torch

    site = Path(torch.__file__).parent.parent
    root = tmp_path_factory.mktemp("nonumpy")
    packages = root / "packages"
    packages.mkdir()
    for entry in site.iterdir():
        if not (entry.name == "numpy" or entry.name.startswith(("numpy.", "numpy-"))):
            (packages / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, check=True, timeout=60).stdout.strip()
    Path(own, "torchdoctor-test.pth").write_text(f"{packages}\n{SRC}\n")
    return str(python)


def without_numpy(python: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = run_bounded([python, *args], timeout=timeout, env=env).proc
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(errors="replace"),
                                       proc.stderr.decode(errors="replace"))


def test_the_identity_gather_and_pairs_need_no_numpy(python_without_numpy):
    probe = without_numpy(python_without_numpy, "-c", "import torch; torch.zeros(1).numpy()")
    assert "Numpy is not available" in probe.stderr  # numpy really is absent there
    proc = without_numpy(python_without_numpy, "-m", "torchdoctor", "comm", "--local", "2", "--pairs",
                         "--pair-size", "64K", "--json", "--timeout", "60")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [r["status"] for r in out["ranks"]] == ["ok", "ok"]
    assert {(x["src"], x["dst"]) for x in out["pairs"]["links"]} == {(0, 1), (1, 0)}


def test_torchs_numpy_error_is_the_missing_module_with_its_pip_install(python_without_numpy):
    code = ("import json, torch\nfrom torchdoctor.comm.errors import classify\n"
            "try:\n    torch.zeros(2).numpy()\nexcept Exception as e:\n    print(json.dumps(classify(e)))\n")
    proc = without_numpy(python_without_numpy, "-c", code)
    kind, error = json.loads(proc.stdout)
    assert (kind, error) == ("missing-module", "module numpy missing: RuntimeError: Numpy is not available")
    # the record every rank posts with it, judged: the module and its pip install, no network fix
    final = {"status": "broken", "stage": "all_gather", "detail": "identities", "kind": kind, "error": error}
    snap = {r: {"identity": {"rank": r, "host": "a", "local_rank": r, "pid": 10 + r, "device": "cpu"},
                "stage": {"name": "all_gather", "detail": "identities"}, "final": dict(final), "ring": None,
                "alive": False} for r in range(3)}
    rows, findings = judge(snap, "gloo", 30.0)
    assert [f.id for f in findings] == ["comm.missing-module"]
    f = findings[0]
    assert "the Python module numpy is not installed" in f.title and f.data["ranks"] == [0, 1, 2]
    assert f.fix == ["pip install numpy   # in the environment every rank runs in"]
    said = json.dumps([x.to_json() for x in findings])
    assert "GLOO_SOCKET_IFNAME" not in said and "firewall" not in said
    assert all(r["status"] == "broken" for r in rows)


def test_an_import_error_a_python_error_and_a_backend_error_are_told_apart():
    try:
        __import__("torchdoctor_no_such_module")
    except ImportError as e:
        assert classify(e) == ("missing-module", "module torchdoctor_no_such_module missing: ModuleNotFoundError: "
                                                 "No module named 'torchdoctor_no_such_module'")
    try:
        __import__("json").loads(object())
    except TypeError as e:
        kind, text = classify(e)
        assert kind == "python-error" and text.startswith("TypeError: the JSON object must be str")
        assert "(raised at " in text and "json" in text
    try:
        import torch

        torch.empty(3).view(2)  # a RuntimeError, as a backend raises them: the communication's family
    except RuntimeError as e:
        kind, text = classify(e)
        assert kind == "error" and text.startswith("RuntimeError: shape '[2]' is invalid")
    # an ImportError of a module that is there (a name missing from it) is not a missing module
    try:
        from json import no_such_name  # noqa: F401
    except ImportError as e:
        assert classify(e)[0] == "python-error"


def test_a_python_error_on_one_rank_is_its_own_fault_not_the_network():
    def rec(r, final, stage="all_gather"):
        return {"identity": {"rank": r, "host": "a", "local_rank": r, "pid": 10 + r, "device": "cpu"},
                "stage": {"name": stage, "detail": ""}, "final": final, "ring": None, "alive": False}

    snap = {0: rec(0, {"status": "broken", "stage": "all_gather", "detail": "", "kind": "python-error",
                       "error": "TypeError: bad (raised at x.py:3 in f)"}),
            1: rec(1, {"status": "broken", "stage": "all_gather", "detail": "", "kind": "timeout",
                       "error": "no progress in all_gather for 30 s"})}
    rows, findings = judge(snap, "gloo", 30.0)
    assert [f.id for f in findings] == ["comm.python-error"]
    assert "not a communication failure: TypeError: bad (raised at x.py:3 in f)" in findings[0].title
    assert rows[0]["status"] == "broken" and rows[1]["status"] == "ok"
    assert "cut short in all_gather by another rank" in rows[1]["detail"]

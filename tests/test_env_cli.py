"""``torchdoctor env`` / ``env --prebuild`` / ``report`` as users run them: real subprocesses on this machine."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).parent.parent / "src")


def td(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run([sys.executable, "-m", "torchdoctor", *args], capture_output=True, text=True, timeout=120,
                          env=full, cwd=cwd)


def test_env_json_is_facts_and_findings_and_the_exit_code_follows_them():
    proc = td("env", "--json")
    out = json.loads(proc.stdout)
    assert set(out) == {"facts", "findings"}
    import torch

    assert out["facts"]["torch"]["version"] == torch.__version__
    ids = [f["id"] for f in out["findings"]]
    assert len(ids) == len(set(ids)) or all(f["id"] == "gpu.arch-unsupported" for f in out["findings"]
                                            if ids.count(f["id"]) > 1)
    for f in out["findings"]:
        assert set(f) == {"id", "severity", "title", "evidence", "fix", "data"}
        if f["severity"] in ("warn", "fail"):
            assert f["fix"], f
    failed = any(f["severity"] == "fail" for f in out["findings"])
    assert proc.returncode == (1 if failed else 0), proc.stderr


@pytest.mark.skipif(not (os.path.exists("/usr/local/cuda-13.0/bin/nvcc") and os.path.exists("/usr/local/bin/nvcc")
                         and not os.path.exists("/usr/local/lib64")),
                    reason="the development machine's nvcc wrapper layout")
def test_env_names_this_machines_nvcc_wrapper_and_the_fix():
    """/usr/local/bin/nvcc is a wrapper: a CUDA build of torch (and DeepSpeed) would build with CUDA_HOME=/usr/local.
    With this machine's CPU torch that is a warning (exit 0); with a CUDA torch a failure (exit 1)."""
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    proc = subprocess.run([sys.executable, "-m", "torchdoctor", "env"], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": SRC})
    cpu = torch.version.cuda is None
    assert proc.returncode == (0 if cpu else 1), proc.stdout
    if cpu:
        assert ("[WARN] a CUDA build of torch would use CUDA_HOME=/usr/local, which is not a CUDA toolkit "
                "(no include/cuda_runtime.h, no libcudart.so*)") in proc.stdout
    else:
        assert "[FAIL] extension builds would use CUDA_HOME=/usr/local, which is not a CUDA toolkit" in proc.stdout
    assert "fix: export CUDA_HOME=/usr/local/cuda-13.0" in proc.stdout
    fixed = td("env", "--json", env={"CUDA_HOME": "/usr/local/cuda-13.0"})
    out = json.loads(fixed.stdout)
    home = [f for f in out["findings"] if f["id"] == "cuda.home-mismatch"]
    assert home and all(f["severity"] == "ok" for f in home)
    assert out["facts"]["cuda_home_for_cuda_torch"] == "/usr/local/cuda-13.0"
    assert out["facts"]["deepspeed_cuda_home"] == (None if cpu else "/usr/local/cuda-13.0")


def test_env_markdown_is_a_paste_ready_body():
    proc = td("env", "--markdown")
    assert proc.stdout.startswith("### Environment (torchdoctor env)\n")
    assert "\n### Findings\n" in proc.stdout and "- **torch**: " in proc.stdout


def test_prebuild_fills_in_the_guides_commands():
    proc = td("env", "--prebuild", env={"TORCH_CUDA_ARCH_LIST": "8.6"})
    assert proc.returncode == 0
    out = proc.stdout
    assert 'TORCH_CUDA_ARCH_LIST="8.6" DS_BUILD_CPU_ADAM=1 DS_BUILD_UTILS=1 MAX_JOBS=' in out
    # pip 25.3 removed --global-option: the runnable line must not depend on it
    install = next(line for line in out.splitlines() if "pip install ." in line and not line.startswith("#"))
    assert "--global-option" not in install and "MAX_JOBS=" in install
    assert "python setup.py build_ext -j" in out and "bdist_wheel" in out
    assert "DS_BUILD_AIO" not in out


def test_prebuild_with_nvme_offload_adds_aio_and_libaio(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}))
    proc = td("env", "--prebuild", "--ds-config", str(cfg))
    assert "DS_BUILD_CPU_ADAM=1 DS_BUILD_UTILS=1 DS_BUILD_AIO=1" in proc.stdout
    assert "sudo apt install libaio-dev" in proc.stdout


@pytest.mark.parametrize("content, message", [
    ("{not json", "line 1"), ("[1, 2]", "object"), (None, "no such file"),
])
def test_env_bad_ds_config_is_exit_2(tmp_path, content, message):
    cfg = tmp_path / "ds.json"
    if content is not None:
        cfg.write_text(content)
    proc = td("env", "--ds-config", str(cfg))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_markdown_and_json(tmp_path):
    from transformers import TrainingArguments

    ta = tmp_path / "args.json"
    ta.write_text(TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=3e-5, fp16=False,
                                    per_device_train_batch_size=4).to_json_string())
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "fp16": {"enabled": True, "initial_scale_power": 12}}))
    proc = td("report", "--ds-config", str(cfg), "--training-args", str(ta), "-o", str(tmp_path / "r.md"))
    assert proc.returncode == 0, proc.stderr
    md = proc.stdout
    heads = [line for line in md.splitlines() if line.startswith("### ")]
    assert heads == ["### Versions", "### Environment findings", "### DeepSpeed config",
                     "### TrainingArguments (non-default)"]
    import torch
    import transformers

    assert f"torch: {torch.__version__}\n" in md and f"transformers: {transformers.__version__}\n" in md
    assert '"initial_scale_power": 12' in md
    assert "| `learning_rate` | `3e-05` |" in md and "| `per_device_train_batch_size` | `4` |" in md
    assert "`num_train_epochs`" not in md  # untouched defaults are left out
    assert (tmp_path / "r.md").read_text() == md
    out = json.loads(td("report", "--json", "--training-args", "--learning_rate 1e-4 --bf16").stdout)
    assert out["training_args"]["changed"] == {"learning_rate": 1e-4, "bf16": True}
    assert out["ds_config"] is None and out["versions"]["torch"] == torch.__version__


def test_report_refuses_to_unpickle_training_args_bin(tmp_path):
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (Path.write_text, (marker, "x"))

    (tmp_path / "training_args.bin").write_bytes(pickle.dumps(Evil()))
    proc = td("report", "--training-args", str(tmp_path / "training_args.bin"))
    assert proc.returncode == 2 and "to_json_string()" in proc.stderr
    assert not marker.exists()

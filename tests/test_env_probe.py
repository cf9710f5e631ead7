"""The env probe on fabricated toolkits (fake nvcc / gcc scripts in temp dirs) and on this real machine."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from torchdoctor.env import probe


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_toolkit(root: Path, version: str, libcudart: bool = True, lib: str = "lib64", sleep: float = 0) -> Path:
    """A CUDA toolkit tree whose nvcc answers --version and --dryrun like the real one."""
    full = f"{version}.{88}"
    _script(root / "bin" / "nvcc", f"""{f"sleep {sleep}" if sleep else ""}
case "$*" in
  *--dryrun*) echo "#\\$ TOP={root}/bin/.." >&2 ;;
  *--version*) echo "Cuda compilation tools, release {version}, V{full}" ;;
esac
""")
    (root / lib).mkdir(parents=True, exist_ok=True)
    if libcudart:
        major = version.split(".")[0]
        (root / lib / f"libcudart.so.{major}").write_text("")
        (root / lib / "libcudart.so").write_text("")
    return root


def fake_gcc(folder: Path, version: str, name: str = "gcc") -> Path:
    return _script(folder / name, f"""case "$*" in
  *-dumpfullversion*) echo "{version}" ;;
  *) echo "{name} (fake) {version}" ;;
esac
""")


@pytest.fixture(autouse=True)
def _no_package_imports(request, monkeypatch):
    """Fabricated machines need no transformers/deepspeed import (1-2 s each); the real-machine test does."""
    if "real" not in request.node.name:
        monkeypatch.setattr(probe, "PACKAGES", ())


def collect(tmp_path: Path, **env) -> probe.Facts:
    base = {"HOME": str(tmp_path / "home"), "PATH": env.pop("PATH", "/nonexistent")}
    base.update({k: str(v) for k, v in env.items()})
    return probe.collect(base, patterns=(str(tmp_path / "usr-local" / "cuda*"),), conda_bases=())


def test_several_toolkits_path_order_and_cuda_home(tmp_path):
    a = fake_toolkit(tmp_path / "usr-local" / "cuda-12.1", "12.1")
    b = fake_toolkit(tmp_path / "usr-local" / "cuda-12.4", "12.4")
    os.symlink(b, tmp_path / "usr-local" / "cuda")  # the usual /usr/local/cuda -> cuda-12.4 link
    facts = collect(tmp_path, PATH=f"{a}/bin:/usr/bin", LD_LIBRARY_PATH=f"{b}/lib64:/opt/x", CUDA_HOME=b)
    assert [(t.root, t.version, t.version_full) for t in facts.toolkits] == [
        (str(a), "12.1", "12.1.88"), (str(b), "12.4", "12.4.88")]
    by_root = {t.root: t for t in facts.toolkits}
    assert by_root[str(b)].found_via[0] == "CUDA_HOME"
    assert any(v.startswith(str(tmp_path / "usr-local" / "cuda")) for v in by_root[str(b)].found_via[1:])
    assert by_root[str(a)].found_via[0] == "PATH"
    assert by_root[str(b)].libcudart == ["libcudart.so", "libcudart.so.12"]
    assert by_root[str(b)].lib_dir == str(b / "lib64")
    assert facts.nvcc_on_path == str(a / "bin" / "nvcc") and facts.nvcc_on_path_root == str(a)
    assert facts.cuda_home_env == str(b) and facts.deepspeed_cuda_home == str(b)
    assert [(e.var, e.index, e.toolkit) for e in facts.path_entries] == [("PATH", 0, str(a)),
                                                                         ("LD_LIBRARY_PATH", 0, str(b))]


def test_missing_libcudart_and_libs_under_targets(tmp_path):
    bare = fake_toolkit(tmp_path / "usr-local" / "cuda-12.2", "12.2", libcudart=False)
    targets = fake_toolkit(tmp_path / "usr-local" / "cuda-12.6", "12.6", lib="targets/x86_64-linux/lib")
    facts = collect(tmp_path)
    by_root = {t.root: t for t in facts.toolkits}
    assert by_root[str(bare)].libcudart == [] and by_root[str(bare)].lib_dir is None
    assert by_root[str(targets)].lib_dir == str(targets / "targets/x86_64-linux/lib")
    assert facts.nvcc_on_path is None and facts.path_entries == []


def test_nvcc_wrapper_on_path_is_traced_to_its_toolkit(tmp_path):
    """Like this machine: /usr/local/bin/nvcc is a script that execs the real one."""
    real = fake_toolkit(tmp_path / "usr-local" / "cuda-13.0", "13.0")
    bindir = tmp_path / "bin"
    _script(bindir / "nvcc", f'exec {real}/bin/nvcc "$@"\n')
    facts = collect(tmp_path, PATH=f"{bindir}:/usr/bin")
    assert [t.root for t in facts.toolkits] == [str(real)]
    assert facts.nvcc_on_path_root == str(real)
    # torch and DeepSpeed take the parent of nvcc's folder: not a toolkit
    assert facts.deepspeed_cuda_home == str(tmp_path)
    assert facts.toolkit(str(tmp_path)) is None
    assert [(e.path, e.toolkit) for e in facts.path_entries] == [(str(bindir), str(real))]


def test_host_compiler_order_toolkit_link_then_ccbin_then_cc_then_path(tmp_path):
    tk = fake_toolkit(tmp_path / "usr-local" / "cuda-12.1", "12.1")
    new = fake_gcc(tmp_path / "newgcc", "14.1.0")
    old = fake_gcc(tmp_path / "oldgcc", "12.3.0", name="gcc-12")
    path = f"{tmp_path / 'newgcc'}:{tk}/bin"
    facts = collect(tmp_path, PATH=path, CUDA_HOME=tk)
    assert (facts.host_compiler.path, facts.host_compiler.version, facts.host_compiler.source) == (
        str(new), "14.1.0", "PATH")
    assert [c.version for c in facts.compilers if c.name == "gcc"] == ["14.1.0"]
    facts = collect(tmp_path, PATH=path, CUDA_HOME=tk, CC=old)
    assert (facts.host_compiler.version, facts.host_compiler.source) == ("12.3.0", "CC")
    facts = collect(tmp_path, PATH=path, CUDA_HOME=tk, CC=new, NVCC_PREPEND_FLAGS=f"-ccbin {old}")
    assert facts.host_compiler.source == "-ccbin in NVCC_*_FLAGS"
    os.symlink(old, tk / "bin" / "gcc")  # the guide's fix: link the right gcc into the toolkit
    facts = collect(tmp_path, PATH=path, CUDA_HOME=tk, CC=new, NVCC_CCBIN=new)
    assert (facts.host_compiler.path, facts.host_compiler.version, facts.host_compiler.source) == (
        str(tk / "bin" / "gcc"), "12.3.0", "toolkit bin/gcc")


def test_a_stuck_nvcc_is_a_fact_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "TOOL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(probe.run, "__defaults__", (1.0, None))
    tk = fake_toolkit(tmp_path / "usr-local" / "cuda-12.4", "12.4", sleep=30)
    t0 = time.monotonic()
    facts = collect(tmp_path)
    assert time.monotonic() - t0 < 20
    assert [(t.root, t.version) for t in facts.toolkits] == [(str(tk), None)]
    assert facts.toolkits[0].error == "nvcc did not run"
    assert any("did not finish within 1 s" in e for e in facts.probe_errors)


def test_env_variables_recorded_and_others_not(tmp_path):
    facts = collect(tmp_path, TORCH_CUDA_ARCH_LIST="8.6", NCCL_DEBUG="INFO", DS_BUILD_OPS="0", CC="gcc",
                    SECRET_TOKEN="x", CUDA_VISIBLE_DEVICES="0,1")
    assert facts.env == {"CC": "gcc", "CUDA_VISIBLE_DEVICES": "0,1", "DS_BUILD_OPS": "0", "NCCL_DEBUG": "INFO",
                         "TORCH_CUDA_ARCH_LIST": "8.6"}


@pytest.mark.skipif(not os.path.exists("/usr/local/cuda-13.0/bin/nvcc"), reason="needs the real CUDA 13.0 toolkit")
def test_the_real_cuda_13_toolkit_on_this_machine():
    facts = probe.collect()
    tk = facts.toolkit("/usr/local/cuda-13.0")
    assert tk is not None and tk.version == "13.0" and tk.version_full.startswith("13.0.")
    assert tk.lib_dir == "/usr/local/cuda-13.0/lib64" and "libcudart.so" in tk.libcudart
    assert "/usr/local/cuda" in tk.found_via
    if shutil.which("nvcc"):
        assert facts.nvcc_on_path_root == "/usr/local/cuda-13.0"
    import torch

    assert facts.torch.version == torch.__version__ and facts.torch.cuda == torch.version.cuda
    assert facts.torch.gcc_table["13.0"] == [[6, 0, 0], [16, 0]]
    gcc = next(c for c in facts.compilers if c.name == "gcc")
    if gcc.path:
        assert gcc.version and gcc.version[0].isdigit()
    assert facts.packages["transformers"].import_ok is True
    assert facts.cpu_count >= 1 and facts.shm_gib and facts.ram_gib

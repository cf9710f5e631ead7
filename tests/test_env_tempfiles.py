"""`torchdoctor env` with tools that hang: what they leave in their temporary folder goes with them (nvcc writes its
``tmpxft_*`` files to $TMPDIR and keeps them while its host compiler runs; a hung compiler and nvcc are killed, the
files stayed), and a version that never came is said as unknown, never "None". Fabricated toolkits (shell scripts
answering like nvcc), the real probe and rules."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from torchdoctor.env import probe
from torchdoctor.env.rules import judge


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    return path


def toolkit(root: Path, nvcc_body: str) -> Path:
    """A toolkit tree (headers, libcudart) whose bin/nvcc runs ``nvcc_body``."""
    _script(root / "bin" / "nvcc", nvcc_body)
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("")
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so").write_text("")
    return root


@pytest.fixture
def fast(monkeypatch, tmp_path):
    monkeypatch.setattr(probe, "TOOL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(probe, "TOOL_GRACE_S", 0.5)
    monkeypatch.setattr(probe, "PACKAGES", ())
    monkeypatch.setattr(probe, "DEFAULT_CUDA_HOME", str(tmp_path / "usr-local" / "cuda"))


def collect(tmp_path: Path, **env) -> probe.Facts:
    base = {"HOME": str(tmp_path / "home"), "PATH": "/nonexistent", **{k: str(v) for k, v in env.items()}}
    return probe.collect(base, patterns=(str(tmp_path / "usr-local" / "cuda*"),), conda_bases=())


def test_what_a_hung_tool_wrote_to_its_temporary_folder_is_removed(tmp_path, fast, monkeypatch):
    outer = tmp_path / "tmp"
    outer.mkdir()
    monkeypatch.setenv("TMPDIR", str(outer))
    seen = tmp_path / "seen"
    # like nvcc whose host compiler hangs: its temporary files written, then a child waited on forever
    tk = toolkit(tmp_path / "usr-local" / "cuda-12.4", f"""case "$*" in
  *--version*) echo "Cuda compilation tools, release 12.4, V12.4.99" ;;
  *) dir="${{TMPDIR:-/tmp}}"; echo "$dir" >> {seen}
     : > "$dir/tmpxft_0000_00000000-1.cpp"; : > "$dir/tmpxft_0000_00000000"
     sleep 30 & wait ;;
esac
""")
    facts = collect(tmp_path, CUDA_HOME=tk)
    assert any(e.startswith(f"`{tk}/bin/nvcc --dryrun -c x.cu` hung") for e in facts.probe_errors)
    used = seen.read_text().split()
    assert used and all(Path(d) != outer and not Path(d).exists() for d in used)  # its own folder, gone
    assert list(outer.iterdir()) == []


def test_a_toolkit_whose_nvcc_gave_no_version_is_not_cuda_none(tmp_path, fast):
    """Its nvcc on PATH never answers --version (a probe whose deadline a hung tool ate says the same)."""
    tk = toolkit(tmp_path / "usr-local" / "cuda-12.4", f"""case "$*" in
  *--version*) sleep 30 & wait ;;
  *--dryrun*) echo "#\\$ TOP={tmp_path}/usr-local/cuda-12.4/bin/.." >&2 ;;
esac
""")
    facts = collect(tmp_path, PATH=f"{tk}/bin:/usr/bin")
    assert [(t.root, t.version) for t in facts.toolkits] == [(str(tk), None)]
    findings = judge(facts)
    path = next(f for f in findings if f.id == "cuda.path-order")
    assert path.severity == "ok" and path.evidence == [f"PATH[0] = {tk}/bin -> {tk} (CUDA ?)"]
    assert "None" not in json.dumps([f.to_json() for f in findings if f.severity == "ok"])

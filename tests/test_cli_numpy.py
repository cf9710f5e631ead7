"""`make demo` installs torch alone, without numpy: torch then warns "Failed to initialize NumPy" when it is imported,
and that warning used to sit in the middle of the demo's first run. torchdoctor never hands torch a numpy array, so
the command line silences that one warning. The environment here is real: this venv's packages, numpy left out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).parent.parent / "src")


@pytest.fixture
def site_without_numpy(tmp_path) -> str:
    """A folder holding every package of this environment except numpy (links), for ``python -S``."""
    import torch

    site = Path(torch.__file__).parent.parent
    out = tmp_path / "site"
    out.mkdir()
    for entry in site.iterdir():
        if not (entry.name == "numpy" or entry.name.startswith(("numpy.", "numpy-"))):
            (out / entry.name).symlink_to(entry)
    return str(out)


def python_without_numpy(site: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{SRC}"}
    # -S: no site-packages of this venv (where numpy is); only the folder above and the source
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, timeout=300, env=env)


def test_the_demo_does_not_show_torchs_numpy_warning(site_without_numpy):
    bare = python_without_numpy(site_without_numpy, "-c", "import torch")
    assert "Failed to initialize NumPy" in bare.stderr  # numpy really is absent there, and torch warns
    proc = python_without_numpy(site_without_numpy, "-m", "torchdoctor", "demo", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "numpy" not in (proc.stdout + proc.stderr).lower()
    assert "all finite: the fix works" in proc.stdout

"""Every command of the README's tour, run as a new user runs it: in a fresh venv holding torch alone (what
`pip install torchdoctor` brings: no numpy, transformers or deepspeed), after the real install of this checkout.
No tour command may depend on a package the install does not bring: each ends with a verdict (exit 0 or 1), never
a usage error, a traceback or a missing module. The commands are read from README.md, so a command added there is
checked here; a line that is not runnable as printed (a placeholder, a file the page only shows) is skipped, and
the reason said. Skipped as a whole, with pip's words, where pip cannot build the environment."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bounded import run_bounded

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
#: what a package the install did not bring looks like in a command's output
MISSING = ("No module named", "Numpy is not available", "ModuleNotFoundError")
#: torch's own warning when it is imported without numpy (torch/csrc/utils/tensor_numpy.cpp), which the programs a
#: `torchdoctor run` starts print themselves (torch runs on without numpy): their output, passed through and quoted
#: in its findings (where a line may wrap), not torchdoctor's
TORCH_NO_NUMPY_WARNING = re.compile(r"Failed to initialize NumPy:\s+No module named\s+'numpy'")


def tour() -> list[tuple[str, list[str]]]:
    """(command, the output lines the README shows under it) for every ``$ `` line of its fenced blocks."""
    out: list[tuple[str, list[str]]] = []
    inside, shown = False, None
    for line in README.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside, shown = not inside, None
        elif inside and line.startswith("$ "):
            shown = []
            out.append((line[2:].strip(), shown))
        elif inside and shown is not None:
            shown.append(line)
    return out


def test_the_tour_is_read_from_the_readme():
    commands = [c for c, _ in tour()]
    assert any(c.startswith("torchdoctor demo") for c in commands)
    assert any(c.startswith("torchdoctor comm --local") for c in commands)
    assert any(c.startswith("torchdoctor precision") for c in commands)


def _pip(venv: Path, *args: str, timeout: float = 900) -> None:
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        pytest.skip(f"pip could not build the torch-only environment (pip install {' '.join(args)}): "
                    f"{lines[-1] if lines else proc.returncode}")


def _link_torch(venv: Path) -> bool:
    """torch and the distributions it requires, linked from this suite's environment into ``venv``: the files pip
    would unpack from the same wheels (about 30 s of a 2-core machine's CPU), and pip sees them installed. False
    where one cannot be found here (then pip installs torch)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    site = next((venv / "lib").glob("python*/site-packages"))
    todo, seen = ["torch"], set()
    try:
        while todo:
            name = canonicalize_name(todo.pop())
            if name in seen:
                continue
            seen.add(name)
            dist = metadata.distribution(name)
            for text in dist.requires or ():
                req = Requirement(text)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(req.name)
            for top in {Path(str(f)).parts[0] for f in dist.files or ()} - {".."}:
                if not (site / top).exists():
                    (site / top).symlink_to(Path(str(dist.locate_file(top))))
            for ep in dist.entry_points.select(group="console_scripts"):  # (torchrun)
                script = venv / "bin" / ep.name
                script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {ep.module} import "
                                  f"{ep.attr.split('.')[0]}\nsys.exit({ep.attr}())\n")
                script.chmod(0o755)
    except (metadata.PackageNotFoundError, OSError, StopIteration):
        return False
    return True


@pytest.fixture(scope="module")
def torch_only(tmp_path_factory) -> Path:
    """A venv with the torch this suite runs on, then this checkout installed as a user installs it."""
    import torch

    venv = tmp_path_factory.mktemp("tour") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    if not _link_torch(venv):
        _pip(venv, f"torch=={torch.__version__.split('+')[0]}")
    _pip(venv, str(ROOT))
    have = subprocess.run([str(venv / "bin" / "python"), "-c", "import numpy"], capture_output=True, timeout=120)
    if have.returncode == 0:
        pytest.skip("pip brought numpy into the torch-only environment here: it is not the environment to test")
    return venv


def _runnable(command: str, work: Path) -> str | None:
    """Why a README line cannot run as printed, or None."""
    if "..." in command:
        return "a placeholder, not a command"
    words = shlex.split(command, comments=True)
    for word in words[1:]:
        if re.search(r"\.(log|json|py|gz|txt)$", word) and not (work / word).exists():
            return f"{word} is only shown on the page, not a file of the repository"
    return None


def test_every_tour_command_runs_with_torch_alone(torch_only, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "tests").symlink_to(ROOT / "tests")  # the README's paths are the repository's
    for name in ("hang_worker.py",):  # a script the README runs from its own folder
        shutil.copy(ROOT / "tests" / name, work / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{torch_only / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["NO_COLOR"] = "1"
    ran, skipped = [], []
    for command, shown in tour():
        why = _runnable(command, work)
        if why is not None:
            skipped.append(f"{command}: {why}")
            continue
        bounded = run_bounded(["bash", "-c", command], timeout=600, env=env, cwd=str(work), mem_bytes=8 << 30,
                              max_procs=512)
        proc = bounded.proc
        text = (proc.stdout + proc.stderr).decode(errors="replace")
        assert not bounded.timed_out, f"{command}: still running after 600 s\n{text[-3000:]}"
        ran.append(command)
        if not command.startswith("torchdoctor "):
            assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{text[-3000:]}"
            continue
        assert proc.returncode in (0, 1), f"{command}: exit {proc.returncode}\n{text[-3000:]}"
        readme = "\n".join(shown)
        text = TORCH_NO_NUMPY_WARNING.sub("", text)
        # (a program `torchdoctor run` starts prints its own tracebacks, and the report quotes them)
        for word in MISSING + ("BROKEN",) + (() if command.startswith("torchdoctor run ") else ("Traceback",)):
            assert word not in text or word in readme, f"{command}: {word!r} in its output\n{text[-3000:]}"
        first = next((ln for ln in shown if ln.strip()), "")
        if first.startswith("torchdoctor "):  # the README's first line of output, up to its first number
            head = re.split(r"[0-9(]", first, maxsplit=1)[0].strip()
            assert head in text, f"{command}: no {head!r} in its output\n{text[-3000:]}"
    assert any(c.startswith("torchdoctor comm") for c in ran) and any(c.startswith("torchdoctor demo") for c in ran)
    print("skipped: " + "; ".join(skipped))

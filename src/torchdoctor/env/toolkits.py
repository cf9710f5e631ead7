"""Finding the CUDA toolkits of a machine: every place one may live, the root each ``nvcc`` really runs from, its
version, and what a build needs there (``include/cuda_runtime.h``, ``libcudart``).

A toolkit is identified by the folder its nvcc runs from (``nvcc --dryrun`` prints ``#$ TOP=...``, which sees through
wrapper scripts and links); each nvcc runs ``--version`` and ``--dryrun`` once per probe, however many ways it was
found.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from .facts import BuildHome, PathEntry, Toolkit
from .tools import _Errors, _is_exe, _real, _run, busy, run

LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
MULTIARCH_LIB_DIRS = ("lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")  # Debian/Ubuntu: /usr as CUDA_HOME
INCLUDE_DIRS = ("include", "targets/x86_64-linux/include", "targets/sbsa-linux/include")
# where toolkits are installed by NVIDIA's packages and runfiles; conda environments are searched too
SEARCH_PATTERNS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/opt/cuda-*")
CONDA_BASES = ("~/miniconda3", "~/anaconda3", "~/miniforge3", "~/mambaforge", "/opt/conda")


def nvcc_version(nvcc: str, errors: _Errors) -> tuple[str | None, str | None, str | None]:
    """(``"13.0"``, ``"13.0.88"``, error) from ``nvcc --version``; asked once per nvcc (by real path) per probe."""
    return errors.once(("version", _real(nvcc)), lambda: _nvcc_version(nvcc, errors))


def _nvcc_version(nvcc: str, errors: _Errors) -> tuple[str | None, str | None, str | None]:
    res, why = _run([nvcc, "--version"], errors)
    if res is None:
        if why == "no time":
            return None, None, f"`{nvcc} --version` not run: the probe's deadline for tools had passed"
        return None, None, f"`{nvcc} --version` {why}" if why and why.startswith("hung") else "nvcc did not run"
    m = re.search(r"release (\d+\.\d+), V(\d+(?:\.\d+)*)", res[1])
    if res[0] != 0 or not m:
        return None, None, (res[2].strip() or res[1].strip() or f"exit {res[0]}")[:200]
    return m.group(1), m.group(2), None


def nvcc_top(nvcc: str, errors: _Errors) -> str | None:
    """The toolkit an ``nvcc`` really runs from: its ``--dryrun`` TOP (sees through wrapper scripts)."""
    with tempfile.TemporaryDirectory() as d:
        res = run([nvcc, "--dryrun", "-c", "x.cu", "-o", "x.o"], errors, cwd=d, shown=f"{nvcc} --dryrun -c x.cu")
    if res is None:
        return None
    m = re.search(r"^#\$ TOP=(.+)$", res[1] + res[2], re.M)
    return _real(m.group(1).strip()) if m else None


def _root_of(nvcc: str, errors: _Errors) -> str:
    """The root of the toolkit ``nvcc`` runs from; its --dryrun runs once per nvcc (by real path) per probe."""
    def find() -> str:
        return nvcc_top(nvcc, errors) or _real(os.path.join(os.path.dirname(_real(nvcc)), ".."))

    return errors.once(("root", _real(nvcc)), find)


def _split(value: str | None) -> list[str]:
    return (value or "").split(os.pathsep)


def _toolkit_above(entry: str) -> str | None:
    """The toolkit root a library folder belongs to: <root>/lib64, <root>/lib or <root>/targets/<arch>/lib, where
    <root> has bin/nvcc and looks like a toolkit (this folder holds libcudart, or <root> has the headers)."""
    e = entry.rstrip(os.sep)
    parts = e.split(os.sep)
    if len(parts) >= 4 and parts[-3] == "targets" and parts[-1] == "lib":
        root = os.path.dirname(os.path.dirname(os.path.dirname(e)))
    elif parts[-1] in ("lib64", "lib"):
        root = os.path.dirname(e)
    else:
        return None
    if root and _is_exe(os.path.join(root, "bin", "nvcc")) and (_libcudart_in(e) or _headers(root)):
        return root
    return None


def candidate_roots(env: Mapping[str, str], patterns=SEARCH_PATTERNS, conda_bases=CONDA_BASES) -> list[tuple[str, str]]:
    """(folder, how it was found) for every place a CUDA toolkit may live: the first ``nvcc`` on PATH ("PATH"),
    CUDA_HOME, CUDA_PATH, every later PATH entry holding an ``nvcc``, every LD_LIBRARY_PATH entry inside a toolkit
    (lib64, lib, targets/<arch>/lib below a folder with bin/nvcc: module-system installs such as /apps/cuda/12.1
    are found so), the standard install places and conda environments."""
    out: list[tuple[str, str]] = []
    later: list[tuple[str, str]] = []
    first = True
    for i, entry in enumerate(_split(env.get("PATH"))):
        if entry and _is_exe(os.path.join(entry, "nvcc")):
            folder = os.path.dirname(entry.rstrip(os.sep)) or os.sep
            if first:
                out.append((folder, "PATH"))  # `which nvcc`
            else:
                later.append((folder, f"PATH[{i}]"))
            first = False
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            out.append((env[var], var))
    out.extend(later)
    for i, entry in enumerate(_split(env.get("LD_LIBRARY_PATH"))):
        if entry and (root := _toolkit_above(entry) or _toolkit_above(_real(entry))):
            out.append((root, f"LD_LIBRARY_PATH[{i}]"))
    for pattern in patterns:
        out.extend((p, p) for p in sorted(glob.glob(pattern)))
    conda = [env["CONDA_PREFIX"]] if env.get("CONDA_PREFIX") else []
    home = env.get("HOME") or os.path.expanduser("~")
    for base in conda_bases:
        base = base.replace("~", home, 1) if base.startswith("~") else base
        conda.append(base)
        conda.extend(sorted(glob.glob(f"{base}/envs/*")))
    out.extend((p, "conda") for p in conda if os.path.exists(os.path.join(p, "bin", "nvcc")))
    return out


def _libcudart_in(d: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "libcudart.so*")))


def _libcudart(root: str, subdirs: tuple[str, ...] = LIB_DIRS) -> tuple[str | None, list[str]]:
    """(folder, libcudart.so* names) under ``root``; a Debian/Ubuntu nvidia-cuda-toolkit (root
    /usr/lib/nvidia-cuda-toolkit) has its libcudart beside it, in /usr/lib/<multiarch>."""
    dirs = [os.path.join(root, sub) for sub in subdirs]
    parent = os.path.dirname(root.rstrip(os.sep))
    if os.path.basename(parent) == "lib":
        dirs += [os.path.join(parent, os.path.basename(m)) for m in MULTIARCH_LIB_DIRS]
    for d in dirs:
        if names := _libcudart_in(d):
            return d, names
    return None, []


def _headers(root: str) -> str | None:
    """The folder holding cuda_runtime.h: <root>/include (torch adds -I<CUDA_HOME>/include) or, as in conda's
    toolkits, targets/<arch>/include (nvcc adds it itself)."""
    return next((os.path.join(root, d) for d in INCLUDE_DIRS
                 if os.path.exists(os.path.join(root, d, "cuda_runtime.h"))), None)


def probe_toolkits(env: Mapping[str, str], nvcc_on_path: str | None, errors: _Errors,
                   patterns=SEARCH_PATTERNS, conda_bases=CONDA_BASES) -> tuple[list[Toolkit], dict[str, str]]:
    """(every toolkit found, {folder holding an nvcc on PATH: the toolkit root it runs}); each distinct nvcc runs
    ``--dryrun`` and ``--version`` once, all of them at the same time."""
    with busy("searching for CUDA toolkits (PATH, CUDA_HOME, LD_LIBRARY_PATH, /usr/local/cuda*, /opt/cuda*, conda)"):
        found = [(folder, how, os.path.join(folder, "bin", "nvcc")) for folder, how in
                 candidate_roots(env, patterns, conda_bases)]
        found = [f for f in found if _is_exe(f[2])]
    if nvcc_on_path and not any(_real(n) == _real(nvcc_on_path) for _, _, n in found):
        found.insert(0, (os.path.dirname(os.path.dirname(nvcc_on_path)), "PATH", nvcc_on_path))
    nvccs = list(dict.fromkeys(n for _, _, n in found))
    with ThreadPoolExecutor(max_workers=max(1, min(16, 2 * len(nvccs)))) as pool:
        roots = {n: pool.submit(_root_of, n, errors) for n in nvccs}
        versions = {n: pool.submit(nvcc_version, n, errors) for n in nvccs}
        roots = {n: f.result() for n, f in roots.items()}
        versions = {n: f.result() for n, f in versions.items()}
    by_root: dict[str, Toolkit] = {}
    answers: dict[str, tuple] = {}
    for folder, how, nvcc in found:
        root = roots[nvcc]
        tk = by_root.get(root)
        if tk is None:
            tk = by_root[root] = Toolkit(root=root)
        label = how if _real(folder) == root else f"{how} ({folder})"
        if label not in tk.found_via:
            tk.found_via.append(label)
        own = _real(nvcc) == _real(os.path.join(root, "bin", "nvcc"))
        if own or root not in answers:  # the toolkit's own nvcc speaks for it; else the first that leads there
            answers[root] = versions[nvcc]
    for tk in by_root.values():
        real_nvcc = os.path.join(tk.root, "bin", "nvcc")
        tk.nvcc = real_nvcc if os.path.exists(real_nvcc) else None
        tk.version, tk.version_full, tk.error = answers[tk.root]
        tk.lib_dir, tk.libcudart = _libcudart(tk.root)
        if _headers(tk.root) is None:
            tk.missing.append("include/cuda_runtime.h")
    bins = {os.path.normpath(os.path.dirname(n)): roots[n] for _, how, n in found if how.startswith("PATH")}
    return sorted(by_root.values(), key=lambda t: t.root), bins


def probe_build_home(path: str, errors: _Errors) -> BuildHome:
    """``path`` as a CUDA_HOME: does ``bin/nvcc`` run, is there ``include/cuda_runtime.h`` and a libcudart?"""
    h = BuildHome(path)
    nvcc = os.path.join(path, "bin", "nvcc")
    if _is_exe(nvcc):
        h.nvcc = nvcc
        h.version, _, err = nvcc_version(nvcc, errors)
        h.toolkit_root = _root_of(nvcc, errors) if h.version else None
        if h.version is None:
            h.missing.append(f"bin/nvcc that runs ({err})")
    else:
        h.missing.append("bin/nvcc")
    h.include = _headers(path)
    if h.include is None:
        h.missing.append("include/cuda_runtime.h")
    h.lib_dir, _ = _libcudart(path, LIB_DIRS + MULTIARCH_LIB_DIRS)
    if h.lib_dir is None:
        h.missing.append("libcudart.so* (lib64, lib, targets/<arch>/lib)")
    return h


def path_entries(env: Mapping[str, str], toolkits: list[Toolkit], roots_of_nvcc: dict[str, str]) -> list[PathEntry]:
    """PATH and LD_LIBRARY_PATH entries that reach into a toolkit (or, for LD_LIBRARY_PATH, hold a libcudart), in
    search order."""
    out = []
    roots = [t.root for t in toolkits]
    lib_dirs = {_real(t.lib_dir): t.root for t in toolkits if t.lib_dir}

    def inside(path: str) -> str | None:
        real = _real(path)
        return next((r for r in roots if real == r or real.startswith(r + os.sep)), None)

    for var in ("PATH", "LD_LIBRARY_PATH"):
        for i, entry in enumerate(_split(env.get(var))):
            if not entry:
                continue
            tk = inside(entry)
            libs: list[str] = []
            if var == "PATH" and tk is None:
                tk = roots_of_nvcc.get(os.path.normpath(entry))  # it holds an nvcc wrapper for a toolkit elsewhere
            if var == "LD_LIBRARY_PATH":
                tk = tk or lib_dirs.get(_real(entry))  # e.g. Debian's /usr/lib/x86_64-linux-gnu
                libs = _libcudart_in(entry)
            if tk is not None or libs:
                out.append(PathEntry(var, i, entry, tk, libs))
    return out

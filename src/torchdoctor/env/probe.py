"""Probing the machine into :class:`~torchdoctor.env.facts.Facts` -- no judgement here.

Every external tool runs with a timeout; a missing or stuck tool becomes a fact (``None`` plus a line
in ``probe_errors`` naming the tool), never a crash. The slow probes (package imports, ``nvcc`` per toolkit,
``nvidia-smi``, compilers) run in parallel threads, each tool in its own session so that a timeout kills it with
everything it started; one deadline bounds them all, so several stuck tools cost about ``TOOL_TIMEOUT_S`` once.
Each ``nvcc`` runs ``--version`` and ``--dryrun`` once per probe, however many ways it was found.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import inspect
import json
import logging
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._system import GIB, cgroup_memory, kernel_driver_version, read_meminfo
from .facts import BuildHome, Compiler, Facts, Gpu, HostCompiler, PackageFacts, PathEntry, Toolkit, TorchFacts

TOOL_TIMEOUT_S = 5.0  # one tool's limit
TOOL_GRACE_S = 1.0  # the whole probe's tools end by TOOL_TIMEOUT_S + TOOL_GRACE_S (for tools that wait on others)
IMPORT_TIMEOUT_S = 4.0
PACKAGES = ("transformers", "accelerate", "deepspeed")
ENV_PREFIXES = ("NCCL_", "CUDA_", "DS_", "NVCC_", "TORCH_CUDA_ARCH_LIST", "TORCH_NCCL_")
ENV_NAMES = ("CC", "CXX", "CONDA_PREFIX")
LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
MULTIARCH_LIB_DIRS = ("lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")  # Debian/Ubuntu: /usr as CUDA_HOME
INCLUDE_DIRS = ("include", "targets/x86_64-linux/include", "targets/sbsa-linux/include")
# where toolkits are installed by NVIDIA's packages and runfiles; conda environments are searched too
SEARCH_PATTERNS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/opt/cuda-*")
CONDA_BASES = ("~/miniconda3", "~/anaconda3", "~/miniforge3", "~/mambaforge", "/opt/conda")
DEFAULT_CUDA_HOME = "/usr/local/cuda"  # torch's last guess for CUDA_HOME
HOST_COMPILER_SOURCES = ("-ccbin in NVCC_APPEND_FLAGS", "CC", "-ccbin in NVCC_PREPEND_FLAGS", "NVCC_CCBIN",
                         "toolkit bin/gcc", "PATH")


class _Errors(list):
    """The probe's notes (tools that failed or hung), plus its deadline for external tools and its memo of tool
    answers (one ``nvcc --version`` per nvcc, however many ways it was found). Safe to share between threads."""

    def __init__(self, deadline: float | None = None):
        super().__init__()
        self.deadline = deadline  # time.monotonic() by which every tool must have ended; None: per tool only
        self._lock = threading.Lock()
        self._memo: dict[Any, Future] = {}

    def note(self, what: str) -> None:
        with self._lock:
            self.append(what)

    def time_for(self, timeout: float | None = None) -> float:
        """Seconds the next tool may run: its own limit, cut to what is left before the deadline."""
        t = TOOL_TIMEOUT_S if timeout is None else timeout
        return t if self.deadline is None else min(t, self.deadline - time.monotonic())

    def once(self, key: Any, fn: Callable[[], Any]) -> Any:
        """``fn()``, computed once per key; concurrent callers with the same key wait for the first."""
        with self._lock:
            fut = self._memo.get(key)
            mine = fut is None
            if mine:
                fut = self._memo[key] = Future()
        if mine:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
        return fut.result()


def _secs(t: float) -> str:
    return f"{t:.1f}".removesuffix(".0")


def _spawn(cmd: list[str], timeout: float, env: Mapping[str, str] | None = None,
           cwd: str | None = None) -> tuple[int | None, str, str]:
    """(returncode, stdout, stderr); returncode None when it ran past ``timeout``: then it and every process it
    started (its session's process group: a shell script's ``sleep`` too) are killed, and the output so far kept."""
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=None if env is None else dict(env), cwd=cwd, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        p.kill()
    try:
        out, err = p.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:  # something left the group and still holds the pipes: stop reading
        out = err = ""
        for f in (p.stdout, p.stderr):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=1.0)
    return None, out or "", err or ""


def _run(cmd: list[str], errors: _Errors, timeout: float | None = None, env: Mapping[str, str] | None = None,
         cwd: str | None = None, shown: str | None = None) -> tuple[tuple[int, str, str] | None, str | None]:
    """(result or None, why not: "missing" | "hung: ..." | "no time" | "failed")."""
    shown = shown or shlex.join(cmd)
    t = errors.time_for(timeout) if isinstance(errors, _Errors) else (TOOL_TIMEOUT_S if timeout is None else timeout)
    if t <= 0.05:
        errors.note(f"`{shown}` not run: the probe's deadline for tools had passed (a tool above hung)")
        return None, "no time"
    try:
        rc, out, err = _spawn(cmd, t, env, cwd)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        errors.note(f"`{shown}` failed: {e}")
        return None, "failed"
    if rc is None:
        errors.note(f"`{shown}` hung: no answer within {_secs(t)} s; killed it and the processes it started")
        return None, f"hung: no answer within {_secs(t)} s"
    return (rc, out, err), None


def run(cmd: list[str], errors: _Errors, timeout: float | None = None, env: Mapping[str, str] | None = None,
        cwd: str | None = None, shown: str | None = None):
    """(returncode, stdout, stderr), or None when the tool is missing, failed or hung (noted in ``errors``)."""
    return _run(cmd, errors, timeout, env, cwd, shown)[0]


# -- torch and packages ---------------------------------------------------------------------------------
def probe_torch() -> TorchFacts:
    try:
        import torch
    except Exception as e:  # not installed, or broken
        return TorchFacts(installed=False, error=f"{type(e).__name__}: {e}")
    t = TorchFacts(version=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None))
    try:
        v = torch.backends.cudnn.version()
        t.cudnn = str(v) if v else None
    except Exception:
        pass
    try:
        v = torch.cuda.nccl.version()
        t.nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        pass
    t.cxx11_abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False))
    try:
        t.cuda_available = torch.cuda.is_available()
        t.arch_list = list(torch.cuda.get_arch_list()) if t.cuda else []
    except Exception as e:
        t.error = f"torch.cuda: {e}"
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its import warns "No CUDA runtime is found, using CUDA_HOME=..."
    try:
        from torch.utils import cpp_extension

        table = getattr(cpp_extension, "CUDA_GCC_VERSIONS", None)
        t.gcc_table = {k: [list(lo), list(hi)] for k, (lo, hi) in table.items()} if table else None
        t.cuda_home = cpp_extension.CUDA_HOME
        t.arch_names, t.supported_arches = torch_arch_tables(cpp_extension)
    except Exception as e:
        t.error = f"torch.utils.cpp_extension: {e}"
    finally:
        logger.setLevel(level)
    return t


def torch_arch_tables(cpp_extension) -> tuple[list[list[str]] | None, list[str] | None]:
    """``named_arches`` and ``supported_arches`` of the installed torch's ``_get_cuda_arch_flags`` (local variables
    there, so read from its source); (None, None) where this torch has them in another shape or not at all."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cpp_extension._get_cuda_arch_flags)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return None, None
    names = supported = None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        try:
            if node.targets[0].id == "named_arches":
                value = node.value  # collections.OrderedDict([(name, arches), ...]) or a dict
                if isinstance(value, ast.Call) and len(value.args) == 1:
                    value = value.args[0]
                pairs = ast.literal_eval(value)
                pairs = list(pairs.items()) if isinstance(pairs, dict) else list(pairs)
                names = [[str(a), str(b)] for a, b in pairs]
            elif node.targets[0].id == "supported_arches":
                supported = [str(a) for a in ast.literal_eval(node.value)]
        except (ValueError, TypeError, SyntaxError):
            continue
    return names, supported


_IMPORTER = """
import json, sys, time
for name in sys.argv[1:]:
    t0 = time.monotonic()
    try:
        mod = __import__(name)
        out = {"name": name, "ok": True, "version": str(getattr(mod, "__version__", ""))}
    except BaseException as e:
        out = {"name": name, "ok": False, "error": (type(e).__name__ + ": " + str(e)).splitlines()[0][:300]}
    out["seconds"] = round(time.monotonic() - t0, 2)
    print("TORCHDOCTOR-IMPORT " + json.dumps(out), flush=True)
"""


def probe_packages(names: tuple[str, ...], errors: _Errors) -> dict[str, PackageFacts]:
    """Versions from the installed metadata, then one subprocess imports them in turn (they share torch's
    import, which dominates) with their chatter captured; what has not finished by the timeout is noted."""
    from importlib import metadata

    facts: dict[str, PackageFacts] = {}
    for name in names:
        try:
            facts[name] = PackageFacts(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            facts[name] = PackageFacts(name)
    todo = [n for n in names if facts[n].version is not None]
    if not todo:
        return facts
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "-c", _IMPORTER, *todo]
    limit = errors.time_for(IMPORT_TIMEOUT_S)
    out = ""
    if limit > 0.05:
        try:
            out = _spawn(cmd, limit, env)[1]
        except OSError as e:
            errors.note(f"importing {', '.join(todo)} in a subprocess failed: {e}")
    for line in out.splitlines():
        if line.startswith("TORCHDOCTOR-IMPORT "):
            r = json.loads(line.split(" ", 1)[1])
            f = facts[r["name"]]
            f.import_ok = r["ok"]
            if r["ok"] and r["version"]:
                f.version = r["version"]  # as `print(module.__version__)` shows it
            f.import_error = r.get("error")
    for name in todo:
        if facts[name].import_ok is None:
            facts[name].import_error = f"import did not finish within {_secs(limit)} s"
            errors.note(f"importing {name} took longer than {_secs(limit)} s (not judged)")
    return facts


# -- GPUs and driver ------------------------------------------------------------------------------------
def probe_gpus(torch_facts: TorchFacts, errors: _Errors) -> tuple[list[Gpu], str | None, str | None]:
    gpus: list[Gpu] = []
    res = run(["nvidia-smi", "--query-gpu=index,name,compute_cap,memory.total,uuid,driver_version",
               "--format=csv,noheader,nounits"], errors)
    driver = source = None
    if res and res[0] == 0:
        for line in res[1].strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 6:
                mem = float(parts[3]) / 1024 if parts[3].replace(".", "").isdigit() else None
                gpus.append(Gpu(int(parts[0]), parts[1], parts[2], mem, parts[4]))
                driver, source = parts[5], "nvidia-smi"
    if not gpus and torch_facts.cuda_available:
        import torch

        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(Gpu(i, p.name, f"{p.major}.{p.minor}", round(p.total_memory / GIB, 1),
                            str(getattr(p, "uuid", "")) or None))
    if driver is None and (driver := kernel_driver_version()):
        source = "/proc/driver/nvidia/version"
    return gpus, driver, source


# -- CUDA toolkits ----------------------------------------------------------------------------------------
def _real(path: str) -> str:
    return os.path.realpath(path)


def _is_exe(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


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


def find_cuda_home(env: Mapping[str, str], nvcc_on_path: str | None) -> str | None:
    """CUDA_HOME as torch.utils.cpp_extension._find_cuda_home resolves it in a CUDA build of torch."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        if nvcc_on_path:
            home = os.path.dirname(os.path.dirname(nvcc_on_path))
        else:
            home = DEFAULT_CUDA_HOME if os.path.exists(DEFAULT_CUDA_HOME) else None
    return home or None


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


# -- compilers and build tools -------------------------------------------------------------------------
def compiler_version(path: str, errors: _Errors) -> str | None:
    return errors.once(("compiler", _real(path)), lambda: _compiler_version(path, errors))


def _compiler_version(path: str, errors: _Errors) -> str | None:
    res = run([path, "-dumpfullversion", "-dumpversion"], errors)
    if res and res[0] == 0 and re.fullmatch(r"\d+(\.\d+)*", res[1].strip()):
        return res[1].strip()
    res = run([path, "--version"], errors)
    if res and res[0] == 0:
        m = re.search(r"version (\d+(?:\.\d+)+)", res[1])
        return m.group(1) if m else None
    return None


def probe_compilers(env: Mapping[str, str], errors: _Errors) -> list[Compiler]:
    out = []
    for name in ("gcc", "g++", "clang"):
        path = shutil.which(name, path=env.get("PATH"))
        out.append(Compiler(name, path, compiler_version(path, errors) if path else None))
    return out


def _ccbin_from_flags(env: Mapping[str, str], var: str) -> str | None:
    """The last ``-ccbin`` / ``--compiler-bindir`` in ``var`` (nvcc takes the last one it sees)."""
    try:
        parts = shlex.split(env.get(var, ""))
    except ValueError:
        return None
    found = None
    for i, p in enumerate(parts):
        if p in ("-ccbin", "--compiler-bindir") and i + 1 < len(parts):
            found = parts[i + 1]
        elif p.startswith(("-ccbin=", "--compiler-bindir=")):
            found = p.split("=", 1)[1]
    return found


def host_compiler(env: Mapping[str, str], build_root: str | None, errors: _Errors) -> HostCompiler | None:
    """The host compiler nvcc would use in a torch / DeepSpeed extension build, as nvcc 13.0 picks it.

    nvcc takes the last -ccbin on its command line: NVCC_PREPEND_FLAGS come first, then the build's own flags --
    torch adds ``-ccbin $CC`` when CC is set -- then NVCC_APPEND_FLAGS. Without -ccbin, NVCC_CCBIN; without that,
    ``gcc`` from a PATH on which nvcc has put its own bin folder first (so ``<toolkit>/bin/gcc`` beats PATH).
    A -ccbin folder means its gcc; a bare name is looked up on that PATH.
    """
    tk_bin = os.path.join(build_root, "bin") if build_root else None
    search = os.pathsep.join(([tk_bin] if tk_bin else []) + [env.get("PATH", "")])
    choices: list[tuple[str, str]] = []
    if ccbin := _ccbin_from_flags(env, "NVCC_APPEND_FLAGS"):
        choices.append((ccbin, "-ccbin in NVCC_APPEND_FLAGS"))
    if env.get("CC"):
        choices.append((env["CC"], "CC"))
    if ccbin := _ccbin_from_flags(env, "NVCC_PREPEND_FLAGS"):
        choices.append((ccbin, "-ccbin in NVCC_PREPEND_FLAGS"))
    if env.get("NVCC_CCBIN"):
        choices.append((env["NVCC_CCBIN"], "NVCC_CCBIN"))
    if tk_bin and _is_exe(os.path.join(tk_bin, "gcc")):
        choices.append((os.path.join(tk_bin, "gcc"), "toolkit bin/gcc"))
    if (gcc := shutil.which("gcc", path=env.get("PATH"))) and not any(gcc == v for v, _ in choices):
        choices.append((gcc, "PATH"))
    if not choices:
        return None
    (value, source), rest = choices[0], choices[1:]
    path = os.path.join(value, "gcc") if os.path.isdir(value) else value
    if os.sep not in path:
        path = shutil.which(path, path=search) or path
    overridden = [f"{src}: {val}" if src in ("toolkit bin/gcc", "PATH") else f"{src}={val}" for val, src in rest]
    return HostCompiler(path, compiler_version(path, errors), source, overridden)


def probe_ninja(env: Mapping[str, str], errors: _Errors) -> str | None:
    path = shutil.which("ninja", path=env.get("PATH"))
    if not path:
        return None
    res = run([path, "--version"], errors)
    return res[1].strip() if res and res[0] == 0 else None


def probe_libaio() -> str | None:
    """Where the libaio development library is (the unversioned libaio.so comes with libaio-dev)."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu",
              "/usr/lib/aarch64-linux-gnu"):
        p = os.path.join(d, "libaio.so")
        if os.path.exists(p):
            return p
    return None


# -- the system ----------------------------------------------------------------------------------------
def probe_memory() -> tuple[float | None, float | None]:
    """(MemTotal, size of /dev/shm) in GiB."""
    total = read_meminfo().get("MemTotal")
    shm = None
    try:
        st = os.statvfs("/dev/shm")
        shm = round(st.f_blocks * st.f_frsize / GIB, 2)
    except OSError:
        pass
    return (round(total / GIB, 1) if total else None), shm


def probe_memory_limit() -> float | None:
    """This process's cgroup memory limit in GiB, when there is one below MemTotal."""
    limit, _ = cgroup_memory()
    total = read_meminfo().get("MemTotal")
    return round(limit / GIB, 1) if limit is not None and (total is None or limit < total) else None


def comm_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def collect(env: Mapping[str, str] | None = None, patterns=SEARCH_PATTERNS, conda_bases=CONDA_BASES) -> Facts:
    """Probe this machine. ``env`` defaults to ``os.environ``; tests pass their own PATH, CUDA_HOME, ...
    and search ``patterns`` / ``conda_bases`` so that fabricated toolkits in a temp dir are all there is.
    External tools still run in this process's environment."""
    env = dict(os.environ if env is None else env)
    t0 = time.monotonic()
    errors = _Errors(deadline=t0 + TOOL_TIMEOUT_S + TOOL_GRACE_S)
    facts = Facts(os=platform.platform(), python=platform.python_version())
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        packages = pool.submit(probe_packages, PACKAGES, errors)
        toolkits = pool.submit(probe_toolkits, env, nvcc, errors, patterns, conda_bases)
        compilers = pool.submit(probe_compilers, env, errors)
        ninja = pool.submit(probe_ninja, env, errors)
        facts.torch = probe_torch()  # in this process, while the others run
        gpus = pool.submit(probe_gpus, facts.torch, errors)
        facts.toolkits, nvcc_bins = toolkits.result()
        facts.nvcc_on_path_root = _root_of(nvcc, errors) if nvcc else None  # answered already
        facts.nvcc_on_path = nvcc
        facts.cuda_home_env, facts.cuda_path_env = env.get("CUDA_HOME"), env.get("CUDA_PATH")
        facts.cuda_home_for_cuda_torch = find_cuda_home(env, nvcc)
        facts.deepspeed_cuda_home, facts.deepspeed_cuda_home_note = _deepspeed_cuda_home(facts)
        homes = [h for h in dict.fromkeys((facts.cuda_home_env, facts.cuda_path_env, facts.cuda_home_for_cuda_torch,
                                           facts.torch.cuda_home,
                                           os.path.dirname(os.path.dirname(nvcc)) if nvcc else None)) if h]
        build_homes = [pool.submit(probe_build_home, h, errors) for h in homes]
        facts.build_homes = [f.result() for f in build_homes]
        build_root = _build_root(facts)
        facts.build_toolkit_root = build_root if facts.toolkit(build_root) else None
        host = pool.submit(host_compiler, env, build_root, errors)
        facts.packages = packages.result()
        facts.compilers = compilers.result()
        facts.ninja = ninja.result()
        facts.gpus, facts.driver, facts.driver_source = gpus.result()
        facts.host_compiler = host.result()
    facts.path_entries = path_entries(env, facts.toolkits, nvcc_bins)
    facts.libaio = probe_libaio()
    facts.ram_gib, facts.shm_gib = probe_memory()
    facts.memory_limit_gib = probe_memory_limit()
    facts.cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    facts.env = comm_env(env)
    facts.probe_errors = list(errors)
    facts.probe_seconds = round(time.monotonic() - t0, 2)
    return facts


def _deepspeed_cuda_home(facts: Facts) -> tuple[str | None, str]:
    """DeepSpeed's op builder takes torch.utils.cpp_extension.CUDA_HOME, which only a CUDA build of torch sets."""
    t = facts.torch
    if not t.installed:
        return None, "None: torch is not importable, and DeepSpeed takes CUDA_HOME from torch.utils.cpp_extension"
    if t.cuda is None:
        build = f"a ROCm (HIP {t.hip}) build" if t.hip else "a CPU build"
        would = (f"; a CUDA build of torch would use CUDA_HOME={facts.cuda_home_for_cuda_torch}"
                 if facts.cuda_home_for_cuda_torch else "")
        return None, (f"None: torch {t.version} is {build}, so torch.utils.cpp_extension.CUDA_HOME is None and "
                      f"DeepSpeed, which uses it, cannot build CUDA ops{would}")
    home = facts.cuda_home_for_cuda_torch
    if home is None:
        return None, "None: no CUDA_HOME / CUDA_PATH, no nvcc on PATH, no /usr/local/cuda"
    if facts.cuda_home_env:
        why = "$CUDA_HOME"
    elif facts.cuda_path_env:
        why = "$CUDA_PATH"
    elif facts.nvcc_on_path:
        why = f"the folder above the folder of `nvcc` on PATH ({facts.nvcc_on_path})"
    else:
        why = f"torch's default {DEFAULT_CUDA_HOME}"
    return home, f"{home}: torch.utils.cpp_extension.CUDA_HOME, from {why}"


def _build_root(facts: Facts) -> str | None:
    """The toolkit whose nvcc an extension build would run (for its bin/gcc link, and its version)."""
    for home in (facts.deepspeed_cuda_home, facts.torch.cuda_home, facts.cuda_home_for_cuda_torch):
        if not home:
            continue
        bh = facts.build_home(home)
        if bh and bh.toolkit_root and facts.toolkit(bh.toolkit_root):
            return bh.toolkit_root
        if tk := facts.toolkit(_real(home)):
            return tk.root
    return facts.nvcc_on_path_root

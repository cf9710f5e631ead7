"""Probing the machine into :class:`~torchdoctor.env.facts.Facts` -- no judgement here.

Every external tool runs with a timeout; a missing or stuck tool becomes a fact (``None`` plus a line
in ``probe_errors``), never a crash. The slow probes (package imports, ``nvcc`` per toolkit,
``nvidia-smi``) run in parallel threads, so the whole probe takes about as long as the slowest one.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from .facts import Compiler, Facts, Gpu, HostCompiler, PackageFacts, PathEntry, Toolkit, TorchFacts

TOOL_TIMEOUT_S = 5.0
IMPORT_TIMEOUT_S = 4.0
PACKAGES = ("transformers", "accelerate", "deepspeed")
ENV_PREFIXES = ("NCCL_", "CUDA_", "DS_", "NVCC_", "TORCH_CUDA_ARCH_LIST", "TORCH_NCCL_")
ENV_NAMES = ("CC", "CXX", "CONDA_PREFIX")
LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")
# where toolkits are installed by NVIDIA's packages and runfiles; conda environments are searched too
SEARCH_PATTERNS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/opt/cuda-*")
CONDA_BASES = ("~/miniconda3", "~/anaconda3", "~/miniforge3", "~/mambaforge", "/opt/conda")


class _Errors(list):
    def note(self, what: str) -> None:
        self.append(what)


def run(cmd: list[str], errors: _Errors, timeout: float = TOOL_TIMEOUT_S, env: Mapping[str, str] | None = None):
    """(returncode, stdout, stderr), or None when the tool is missing or timed out (noted in ``errors``)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=None if env is None else dict(env),
                           stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        errors.note(f"`{shlex.join(cmd)}` did not finish within {timeout:g} s")
        return None
    except OSError as e:
        errors.note(f"`{shlex.join(cmd)}` failed: {e}")
        return None
    return p.returncode, p.stdout, p.stderr


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
    except Exception as e:
        t.error = f"torch.utils.cpp_extension: {e}"
    finally:
        logger.setLevel(level)
    return t


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
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S, env=env,
                           stdin=subprocess.DEVNULL)
        out = p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
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
            facts[name].import_error = f"import did not finish within {IMPORT_TIMEOUT_S:g} s"
            errors.note(f"importing {name} took longer than {IMPORT_TIMEOUT_S:g} s (not judged)")
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
            gpus.append(Gpu(i, p.name, f"{p.major}.{p.minor}", round(p.total_memory / 2**30, 1),
                            str(getattr(p, "uuid", "")) or None))
    if driver is None:
        try:
            with open("/proc/driver/nvidia/version") as f:
                m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
            if m:
                driver, source = m.group(1), "/proc/driver/nvidia/version"
        except OSError:
            pass
    return gpus, driver, source


# -- CUDA toolkits ----------------------------------------------------------------------------------------
def nvcc_version(nvcc: str, errors: _Errors) -> tuple[str | None, str | None, str | None]:
    res = run([nvcc, "--version"], errors)
    if res is None:
        return None, None, "nvcc did not run"
    m = re.search(r"release (\d+\.\d+), V(\d+(?:\.\d+)*)", res[1])
    if res[0] != 0 or not m:
        return None, None, (res[2].strip() or res[1].strip() or f"exit {res[0]}")[:200]
    return m.group(1), m.group(2), None


def nvcc_top(nvcc: str, errors: _Errors) -> str | None:
    """The toolkit an ``nvcc`` really runs from: its ``--dryrun`` TOP (sees through wrapper scripts)."""
    with tempfile.TemporaryDirectory() as d:
        res = run([nvcc, "--dryrun", "-c", os.path.join(d, "x.cu"), "-o", os.path.join(d, "x.o")], errors)
    if res is None:
        return None
    m = re.search(r"^#\$ TOP=(.+)$", res[1] + res[2], re.M)
    return os.path.realpath(m.group(1).strip()) if m else None


def _root_of(nvcc: str, errors: _Errors) -> str:
    top = nvcc_top(nvcc, errors)
    return top or os.path.realpath(os.path.join(os.path.dirname(os.path.realpath(nvcc)), ".."))


def candidate_roots(env: Mapping[str, str], patterns=SEARCH_PATTERNS, conda_bases=CONDA_BASES) -> list[tuple[str, str]]:
    """(folder, how it was found) for every place a CUDA toolkit may live."""
    out = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            out.append((env[var], var))
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


def _libcudart(root: str) -> tuple[str | None, list[str]]:
    for sub in LIB_DIRS:
        d = os.path.join(root, sub)
        names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "libcudart.so*")))
        if names:
            return d, names
    return None, []


def probe_toolkits(env: Mapping[str, str], nvcc_on_path: str | None, errors: _Errors,
                   patterns=SEARCH_PATTERNS, conda_bases=CONDA_BASES) -> list[Toolkit]:
    by_root: dict[str, Toolkit] = {}
    found = candidate_roots(env, patterns, conda_bases)
    if nvcc_on_path:
        found.insert(0, (os.path.dirname(os.path.dirname(nvcc_on_path)), "PATH"))
    for folder, how in found:
        nvcc = os.path.join(folder, "bin", "nvcc")
        if not os.path.exists(nvcc):
            continue
        root = _root_of(nvcc, errors)
        tk = by_root.get(root)
        if tk is None:
            tk = by_root[root] = Toolkit(root=root)
        label = how if os.path.realpath(folder) == root else f"{how} ({folder})"
        if label not in tk.found_via:
            tk.found_via.append(label)
    for tk in by_root.values():
        real_nvcc = os.path.join(tk.root, "bin", "nvcc")
        tk.nvcc = real_nvcc if os.path.exists(real_nvcc) else None
        if tk.nvcc:
            tk.version, tk.version_full, tk.error = nvcc_version(tk.nvcc, errors)
        tk.lib_dir, tk.libcudart = _libcudart(tk.root)
    return sorted(by_root.values(), key=lambda t: t.root)


def deepspeed_cuda_home(env: Mapping[str, str], nvcc_on_path: str | None) -> str | None:
    """CUDA_HOME as torch.utils.cpp_extension (and so DeepSpeed's op builder) resolves it."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return home
    if nvcc_on_path:
        return os.path.dirname(os.path.dirname(nvcc_on_path))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def path_entries(env: Mapping[str, str], toolkits: list[Toolkit], roots_of_nvcc: dict[str, str]) -> list[PathEntry]:
    """PATH and LD_LIBRARY_PATH entries that reach into a toolkit, in search order."""
    out = []
    roots = [t.root for t in toolkits]

    def inside(path: str) -> str | None:
        real = os.path.realpath(path)
        return next((r for r in roots if real == r or real.startswith(r + os.sep)), None)

    for var in ("PATH", "LD_LIBRARY_PATH"):
        for i, entry in enumerate(p for p in env.get(var, "").split(os.pathsep)):
            if not entry:
                continue
            tk = inside(entry)
            if var == "PATH" and tk is None and entry in roots_of_nvcc:
                tk = roots_of_nvcc[entry]  # a folder holding an nvcc wrapper for a toolkit elsewhere
            if tk is not None:
                out.append(PathEntry(var, i, entry, tk))
    return out


# -- compilers and build tools -------------------------------------------------------------------------
def compiler_version(path: str, errors: _Errors) -> str | None:
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


def _ccbin_from_flags(env: Mapping[str, str]) -> str | None:
    for var in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        parts = shlex.split(env.get(var, ""))
        for i, p in enumerate(parts):
            if p in ("-ccbin", "--compiler-bindir") and i + 1 < len(parts):
                return parts[i + 1]
            if p.startswith(("-ccbin=", "--compiler-bindir=")):
                return p.split("=", 1)[1]
    return None


def host_compiler(env: Mapping[str, str], build_root: str | None, errors: _Errors) -> HostCompiler | None:
    """The host compiler nvcc would use: <toolkit>/bin/gcc, NVCC_CCBIN / -ccbin, CC (torch passes it), PATH."""
    choices = []
    if build_root and os.path.exists(os.path.join(build_root, "bin", "gcc")):
        choices.append((os.path.join(build_root, "bin", "gcc"), "toolkit bin/gcc"))
    if env.get("NVCC_CCBIN"):
        choices.append((env["NVCC_CCBIN"], "NVCC_CCBIN"))
    if ccbin := _ccbin_from_flags(env):
        choices.append((ccbin, "-ccbin in NVCC_*_FLAGS"))
    if env.get("CC"):
        choices.append((env["CC"], "CC"))
    if gcc := shutil.which("gcc", path=env.get("PATH")):
        choices.append((gcc, "PATH"))
    if not choices:
        return None
    path, source = choices[0]
    if os.path.isdir(path):
        path = os.path.join(path, "gcc")
    resolved = shutil.which(path, path=env.get("PATH")) or path
    return HostCompiler(resolved, compiler_version(resolved, errors), source)


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
    ram = shm = None
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"MemTotal:\s+(\d+) kB", f.read())
        ram = round(int(m.group(1)) / 2**20, 1) if m else None
    except OSError:
        pass
    try:
        st = os.statvfs("/dev/shm")
        shm = round(st.f_blocks * st.f_frsize / 2**30, 2)
    except OSError:
        pass
    return ram, shm


def comm_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def collect(env: Mapping[str, str] | None = None, patterns=SEARCH_PATTERNS, conda_bases=CONDA_BASES) -> Facts:
    """Probe this machine. ``env`` defaults to ``os.environ``; tests pass their own PATH, CUDA_HOME, ...
    and search ``patterns`` / ``conda_bases`` so that fabricated toolkits in a temp dir are all there is."""
    env = dict(os.environ if env is None else env)
    t0 = time.monotonic()
    errors = _Errors()
    facts = Facts(os=platform.platform(), python=platform.python_version())
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        packages = pool.submit(probe_packages, PACKAGES, errors)
        toolkits = pool.submit(probe_toolkits, env, nvcc, errors, patterns, conda_bases)
        compilers = pool.submit(probe_compilers, env, errors)
        ninja = pool.submit(probe_ninja, env, errors)
        nvcc_root = pool.submit(_root_of, nvcc, errors) if nvcc else None
        facts.torch = probe_torch()  # in this process, while the others run
        gpus = pool.submit(probe_gpus, facts.torch, errors)
        facts.packages = packages.result()
        facts.toolkits = toolkits.result()
        facts.compilers = compilers.result()
        facts.ninja = ninja.result()
        facts.gpus, facts.driver, facts.driver_source = gpus.result()
        facts.nvcc_on_path_root = nvcc_root.result() if nvcc_root else None
    facts.nvcc_on_path = nvcc
    facts.cuda_home_env, facts.cuda_path_env = env.get("CUDA_HOME"), env.get("CUDA_PATH")
    facts.deepspeed_cuda_home = deepspeed_cuda_home(env, nvcc)
    wrappers = {os.path.dirname(nvcc): facts.nvcc_on_path_root} if nvcc and facts.nvcc_on_path_root else {}
    facts.path_entries = path_entries(env, facts.toolkits, wrappers)
    build_root = _build_root(facts)
    facts.build_toolkit_root = build_root if facts.toolkit(build_root) else None
    facts.host_compiler = host_compiler(env, build_root, errors)
    facts.libaio = probe_libaio()
    facts.ram_gib, facts.shm_gib = probe_memory()
    facts.cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    facts.env = comm_env(env)
    facts.probe_errors = list(errors)
    facts.probe_seconds = round(time.monotonic() - t0, 2)
    return facts


def _build_root(facts: Facts) -> str | None:
    """The toolkit root an extension build would use (for its bin/gcc link)."""
    for home in (facts.deepspeed_cuda_home, facts.torch.cuda_home):
        if home and (tk := facts.toolkit(os.path.realpath(home))):
            return tk.root
    return facts.nvcc_on_path_root

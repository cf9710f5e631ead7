"""Probing the machine into :class:`~torchdoctor.env.facts.Facts` -- no judgement here.

Every external tool runs with a timeout; a missing or stuck tool becomes a fact (``None`` plus a line
in ``probe_errors`` naming the tool), never a crash. The slow probes (package imports, ``nvcc`` per toolkit,
``nvidia-smi``, compilers) run in parallel threads, each tool in its own session so that a timeout kills it with
everything it started; one deadline bounds them all, so several stuck tools cost about ``TOOL_TIMEOUT_S`` once.
Each ``nvcc`` runs ``--version`` and ``--dryrun`` once per probe, however many ways it was found.

Here: torch, the packages, GPUs, the system, and :func:`collect`, which runs them all with the toolkit search
(``toolkits.py``) and the compiler probes (``compilers.py``); ``tools.py`` runs every external tool.
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import textwrap
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from .._system import GIB, cgroup_memory, kernel_driver_version, read_meminfo
from .compilers import host_compiler, probe_compilers, probe_libaio, probe_ninja
from .facts import Facts, Gpu, PackageFacts, TorchFacts
from .toolkits import CONDA_BASES, SEARCH_PATTERNS, _root_of, path_entries, probe_build_home, probe_toolkits
from .tools import TOOL_TIMEOUT_S, _Errors, _real, _secs, _spawn, busy, run

# callers find the probe's parts here (``probe._Errors``, ``probe.host_compiler``, ...), and tests patch its limits
# here (TOOL_TIMEOUT_S is read from this module by collect)
__all__ = [
    "CONDA_BASES", "DEFAULT_CUDA_HOME", "IMPORT_TIMEOUT_S", "PACKAGES", "SEARCH_PATTERNS", "TOOL_GRACE_S",
    "TOOL_TIMEOUT_S", "Facts", "_Errors", "collect", "comm_env", "find_cuda_home", "host_compiler", "path_entries",
    "probe_build_home", "probe_compilers", "probe_gpus", "probe_libaio", "probe_memory", "probe_memory_limit",
    "probe_ninja", "probe_packages", "probe_toolkits", "probe_torch", "run", "torch_arch_tables",
]

TOOL_GRACE_S = 1.0  # the whole probe's tools end by TOOL_TIMEOUT_S + TOOL_GRACE_S (for tools that wait on others)
IMPORT_TIMEOUT_S = 4.0
PACKAGES = ("transformers", "accelerate", "deepspeed")
ENV_PREFIXES = ("NCCL_", "CUDA_", "DS_", "NVCC_", "TORCH_CUDA_ARCH_LIST", "TORCH_NCCL_")
ENV_NAMES = ("CC", "CXX", "CONDA_PREFIX")
DEFAULT_CUDA_HOME = "/usr/local/cuda"  # torch's last guess for CUDA_HOME


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
            with busy(f"import {', '.join(todo)} (in a subprocess)"):
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
    errors = _Errors(deadline=t0 + TOOL_TIMEOUT_S + TOOL_GRACE_S, tool_timeout=TOOL_TIMEOUT_S)
    facts = Facts(os=platform.platform(), python=platform.python_version())
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    with ThreadPoolExecutor(max_workers=8) as pool:
        packages = pool.submit(probe_packages, PACKAGES, errors)
        toolkits = pool.submit(probe_toolkits, env, nvcc, errors, patterns, conda_bases)
        compilers = pool.submit(probe_compilers, env, errors)
        ninja = pool.submit(probe_ninja, env, errors)
        with busy("import torch"):
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


# -- CUDA_HOME for builds ------------------------------------------------------------------------------
def find_cuda_home(env: Mapping[str, str], nvcc_on_path: str | None) -> str | None:
    """CUDA_HOME as torch.utils.cpp_extension._find_cuda_home resolves it in a CUDA build of torch."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        if nvcc_on_path:
            home = os.path.dirname(os.path.dirname(nvcc_on_path))
        else:
            home = DEFAULT_CUDA_HOME if os.path.exists(DEFAULT_CUDA_HOME) else None
    return home or None


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

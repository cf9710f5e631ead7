"""Judging the facts of ``torchdoctor env``: pure functions from :class:`Facts` to findings.

Every rule is ``check_<id with dots and dashes as underscores>(facts) -> list[Finding]`` and reads nothing but
its argument, so each is tested on fabricated machines. Where torch or DeepSpeed hold the rule (torch's
``CUDA_GCC_VERSIONS``, DeepSpeed's op-builder CUDA check), the rule says what that library will do.
Every fix is a command or an export line filled in for this machine.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..findings import Finding
from .facts import Facts, Gpu, Toolkit

# DeepSpeed 0.19.8, op_builder/builder.py `cuda_minor_mismatch_ok`: torch's CUDA and nvcc may differ in the minor
# version only when both are in the list of the same major. CUDA 13 has no list: 13.x vs 13.y is refused.
DS_MINOR_MISMATCH_OK: dict[int, tuple[str, ...]] = {
    10: ("10.0", "10.1", "10.2"),
    11: ("11.0", "11.1", "11.2", "11.3", "11.4", "11.5", "11.6", "11.7", "11.8"),
    12: ("12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.8", "12.9"),
}
DS_RULE = ("DeepSpeed's op builder (0.19.8) accepts a different minor version only when both are in one of "
           "{10.0-10.2}, {11.0-11.8}, {12.0-12.6, 12.8, 12.9}; CUDA 13 has no such list")

# torch.utils.cpp_extension._get_cuda_arch_flags (torch 2.13): TORCH_CUDA_ARCH_LIST may name architectures, which
# torch replaces textually, in this order, before splitting; every entry must then be one of `supported_arches`,
# with or without "+PTX". The probe reads both tables from the installed torch (TorchFacts.arch_names,
# .supported_arches); these copies are the fallback for a torch where it could not.
NAMED_ARCHES: tuple[tuple[str, str], ...] = (
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
)
SUPPORTED_ARCHES: tuple[str, ...] = (
    "3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0",
    "9.0a", "10.0", "10.0a", "11.0", "11.0a", "10.3", "10.3a", "12.0", "12.0a", "12.1", "12.1a",
)
# DeepSpeed 0.19.8's op builder (compute_capability_args) reads each entry as X.Y[+PTX] with int(): names
# ("Ampere"), suffixes ("9.0a") and "native" raise ValueError in JIT and prebuild alike; its JIT builds drop empty
# entries, its prebuild (setup.py, DS_BUILD_*=1) fails on them.
DS_ARCH_ENTRY = re.compile(r"\d+\.\d+(\+PTX)?")
CUDA13_MIN_ARCH = (7, 5)  # CUDA 13 dropped Maxwell, Pascal and Volta targets
BF16_MIN_CAP = (8, 0)
SHM_MIN_GIB = 1.0
_SEV = {"skip": 0, "ok": 1, "info": 2, "warn": 3, "fail": 4}


# -- small helpers ------------------------------------------------------------------------------------------
def _mm(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of "12.4", "12.4.1", "V13.0.88"; None when there is none."""
    m = re.search(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _mm_str(version: str | None) -> str | None:
    mm = _mm(version)
    return f"{mm[0]}.{mm[1]}" if mm else None


def _vtuple(version: str | None) -> tuple[int, ...] | None:
    """"12.2.0" -> (12, 2, 0); padded to three parts so (16,) and (16, 0) compare as torch's versions do."""
    parts = re.findall(r"\d+", (version or "").split("-")[0])[:3]
    if not parts:
        return None
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


def _pad(t: Iterable[int]) -> tuple[int, ...]:
    t = tuple(int(x) for x in t)
    return t + (0,) * (3 - len(t))


def _vstr(t: Iterable[int]) -> str:
    return ".".join(str(x) for x in t)


def _cap(capability: str | None) -> tuple[int, int] | None:
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", capability or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cap_str(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


def _cu_tag(cuda: str | None) -> str | None:
    """"13.0" -> "cu130", the suffix of PyTorch's wheel index for that CUDA."""
    mm = _mm(cuda)
    return f"cu{mm[0]}{mm[1]}" if mm else None


def _torch_base_version(facts: Facts) -> str | None:
    return facts.torch.version.split("+")[0] if facts.torch.version else None


def _pip_torch(facts: Facts, cuda: str) -> str:
    """The reinstall command for torch built for ``cuda``, keeping the installed torch version."""
    base = _torch_base_version(facts)
    spec = f"torch=={base}" if base else "torch"
    return f"pip install --force-reinstall {spec} --index-url https://download.pytorch.org/whl/{_cu_tag(cuda)}"


def _is_cuda_build(facts: Facts) -> bool:
    return facts.torch.installed and facts.torch.cuda is not None


def _is_cpu_build(facts: Facts) -> bool:
    return facts.torch.installed and facts.torch.cuda is None and facts.torch.hip is None


def _deepspeed_installed(facts: Facts) -> bool:
    p = facts.packages.get("deepspeed")
    return p is not None and p.version is not None


def _norm(path: str | None) -> str | None:
    return posixpath.normpath(path) if path else None


def _tk_label(tk: Toolkit | None) -> str:
    if tk is None:
        return "?"
    return f"{tk.root} (CUDA {tk.version or '?'})"


def _lib_dir(tk: Toolkit) -> str:
    return tk.lib_dir or f"{tk.root}/lib64"


def home_for(facts: Facts, tk: Toolkit) -> str:
    """The CUDA_HOME that makes ``tk`` the build toolkit: its root, unless the root lacks what a build needs and a
    usable CUDA_HOME leads to it (Debian's /usr for /usr/lib/nvidia-cuda-toolkit, which has no include/)."""
    if not tk.missing:
        return tk.root
    return next((h.path for h in facts.build_homes if not h.missing and _norm(h.toolkit_root) == _norm(tk.root)),
                tk.root)


def _exports(tk: Toolkit, facts: Facts | None = None) -> list[str]:
    """The guide's three lines that make ``tk`` the toolkit of builds, of PATH and of the dynamic loader."""
    home = home_for(facts, tk) if facts is not None else tk.root
    return [f"export CUDA_HOME={home}", f"export PATH={home}/bin:$PATH",
            f"export LD_LIBRARY_PATH={_lib_dir(tk)}:$LD_LIBRARY_PATH"]


def _install_toolkit(cuda: str) -> list[str]:
    return [f"conda install -c nvidia cuda-toolkit={cuda}   # then: export CUDA_HOME=$CONDA_PREFIX",
            f"or NVIDIA's installer (https://developer.nvidia.com/cuda-toolkit-archive, CUDA {cuda}) into "
            f"/usr/local/cuda-{cuda}, then:",
            f"export CUDA_HOME=/usr/local/cuda-{cuda}", f"export PATH=/usr/local/cuda-{cuda}/bin:$PATH",
            f"export LD_LIBRARY_PATH=/usr/local/cuda-{cuda}/lib64:$LD_LIBRARY_PATH"]


def _target_triple(facts: Facts) -> str:
    return "sbsa-linux" if re.search(r"aarch64|arm64", facts.os or "") else "x86_64-linux"


def toolkit_at(facts: Facts, path: str | None) -> Toolkit | None:
    """The found toolkit that ``path`` is (its root, or a folder the probe saw resolve to that root).

    The probe labels ``found_via`` "CUDA_HOME", "PATH", "/usr/local/cuda", ... when that folder's real path is the
    toolkit's root, and "PATH (/usr/local)" when only an nvcc in it leads there (a wrapper script): such a folder
    is not the toolkit (no lib64, no include), so it never matches.
    """
    p = _norm(path)
    if not p:
        return None
    for tk in facts.toolkits:
        if _norm(tk.root) == p:
            return tk
    nvcc_parent = _norm(posixpath.dirname(posixpath.dirname(facts.nvcc_on_path))) if facts.nvcc_on_path else None
    for tk in facts.toolkits:
        for label in tk.found_via:  # "PATH (/usr/local)" equals neither a path nor a bare label: never matches
            if (_norm(label) == p
                    or (label == "CUDA_HOME" and _norm(facts.cuda_home_env) == p)
                    or (label == "CUDA_PATH" and _norm(facts.cuda_path_env) == p)
                    or (label == "PATH" and nvcc_parent == p)):
                return tk
    return None


def build_toolkit(facts: Facts) -> Toolkit | None:
    """The toolkit extension builds would use: DeepSpeed's CUDA_HOME, else torch's, else (for a CPU build of torch)
    the one a CUDA build of torch would use, else the one nvcc on PATH runs from.

    The probe's ``build_toolkit_root`` (the same choice, made with real paths) wins when it names a found toolkit;
    a CUDA_HOME whose ``bin/nvcc`` is a wrapper leads to the toolkit that nvcc runs.
    """
    if tk := facts.toolkit(getattr(facts, "build_toolkit_root", None)):
        return tk
    for home in build_home_paths(facts):
        bh = facts.build_home(home)
        if bh and (tk := facts.toolkit(bh.toolkit_root)):
            return tk
        if tk := toolkit_at(facts, home):
            return tk
    return facts.toolkit(facts.nvcc_on_path_root)


def build_home_paths(facts: Facts) -> list[str]:
    """The CUDA_HOMEs extension builds use: DeepSpeed's and torch's, or, while torch is not a CUDA build (both are
    None then), the one a CUDA build of torch would use."""
    homes = [h for h in (facts.deepspeed_cuda_home, facts.torch.cuda_home) if h]
    if not homes and not _is_cuda_build(facts) and facts.cuda_home_for_cuda_torch:
        homes.append(facts.cuda_home_for_cuda_torch)
    return list(dict.fromkeys(homes))


def home_missing(facts: Facts, home: str) -> list[str] | None:
    """What an extension build with CUDA_HOME=``home`` needs and does not find there ([] when usable); None when
    the probe did not look at ``home`` and it is none of the toolkits found (fabricated facts). A missing libcudart
    of a found toolkit is left to cuda.libcudart-missing."""
    tk = toolkit_at(facts, home)
    if bh := facts.build_home(home):
        return [m for m in bh.missing if not (tk is not None and m.startswith("libcudart"))]
    return None if tk is None else list(tk.missing)


def usable_home(facts: Facts) -> tuple[str, Toolkit | None] | None:
    """The CUDA_HOME to recommend, with its toolkit: one that has bin/nvcc, include/cuda_runtime.h and libcudart,
    preferring the version torch was built with, then the toolkit `nvcc` on PATH runs. A Debian/Ubuntu
    nvidia-cuda-toolkit (headers in /usr/include) is recommended as /usr, never as /usr/lib/nvidia-cuda-toolkit."""
    def ok(tk: Toolkit) -> bool:
        return bool(tk.libcudart) and not tk.missing

    want = _mm(facts.torch.cuda) if _is_cuda_build(facts) else None
    homes = [(h.path, facts.toolkit(h.toolkit_root)) for h in facts.build_homes if not h.missing]
    tks = [t for t in facts.toolkits if ok(t)]
    nv = facts.toolkit(facts.nvcc_on_path_root)
    b = build_toolkit(facts)
    matches = [t for t in tks if want and _mm(t.version) == want]
    if matches:
        t = b if b in matches else matches[0]
        return t.root, t
    for path, t in homes:
        if t is not None and want and _mm(t.version) == want:
            return path, t
    if nv is not None and ok(nv):
        return nv.root, nv
    for path, t in homes:
        if nv is not None and t is nv:
            return path, t
    if homes:
        return homes[0]
    return (tks[0].root, tks[0]) if tks else None


def matching_toolkits(facts: Facts) -> list[Toolkit]:
    """Found toolkits whose major.minor equals torch's CUDA."""
    want = _mm(facts.torch.cuda) if _is_cuda_build(facts) else None
    return [t for t in facts.toolkits if want and _mm(t.version) == want]


def _preferred_match(facts: Facts) -> Toolkit | None:
    """The toolkit matching torch to recommend: the build toolkit if it matches, else one with libcudart (and
    nothing missing for builds)."""
    matches = matching_toolkits(facts)
    b = build_toolkit(facts)
    if b in matches:
        return b
    return next((t for t in matches if t.libcudart and not t.missing),
                next((t for t in matches if t.libcudart), matches[0] if matches else None))


def recommended_arch_list(facts: Facts) -> str | None:
    """TORCH_CUDA_ARCH_LIST for the visible GPUs ("8.6", "6.1;8.6"); None without GPUs."""
    caps = sorted({c for g in facts.gpus if (c := _cap(g.capability))})
    return ";".join(_cap_str(c) for c in caps) or None


def deepspeed_accepts(torch_cuda: str, nvcc: str) -> bool:
    """Whether DeepSpeed's op builder (0.19.8) accepts nvcc ``nvcc`` for torch built with CUDA ``torch_cuda``.

    Without ``DS_SKIP_CUDA_CHECK=1``: equal major.minor, or the same major with both versions in that major's list.
    """
    t, n = _mm_str(torch_cuda), _mm_str(nvcc)
    if t is None or n is None:
        return False
    if t == n:
        return True
    ok = DS_MINOR_MISMATCH_OK.get(int(n.split(".")[0]), ())
    return t in ok and n in ok


def _gpus_by_cap(gpus: Iterable[Gpu]) -> dict[tuple[int, int], list[Gpu]]:
    out: dict[tuple[int, int], list[Gpu]] = {}
    for g in gpus:
        if (c := _cap(g.capability)) is not None:
            out.setdefault(c, []).append(g)
    return dict(sorted(out.items()))


def _gpu_names(gpus: Iterable[Gpu]) -> str:
    return ", ".join(f"GPU {g.index} {g.name}" for g in gpus)


# -- torch -------------------------------------------------------------------------------------------------
def check_torch_missing(facts: Facts) -> list[Finding]:
    if facts.torch.installed:
        return []
    b = build_toolkit(facts)
    if b and b.version:
        fix = [f"pip install torch --index-url https://download.pytorch.org/whl/{_cu_tag(b.version)}"
               f"   # CUDA {_mm_str(b.version)}, like the toolkit at {b.root}"]
    elif facts.gpus or facts.driver:
        fix = ["pip install torch --index-url https://download.pytorch.org/whl/cu<XY>   # XY: a CUDA version the "
               "driver supports (`nvidia-smi` shows it as \"CUDA Version\"), e.g. cu128"]
    else:
        fix = ["pip install torch --index-url https://download.pytorch.org/whl/cpu   # no NVIDIA GPU or driver seen"]
    err = facts.torch.error
    broken = bool(err) and not err.startswith("ModuleNotFoundError")
    title = f"torch cannot be imported: {err.splitlines()[0]}" if broken else "torch is not installed in this Python"
    ev = ([f"import torch: {err}"] if err else []) + [f"python: {facts.python}"]
    return [Finding("torch.missing", "fail", title, ev, fix, {"python": facts.python, "error": err})]


def check_torch_probe_error(facts: Facts) -> list[Finding]:
    if not facts.torch.installed or not facts.torch.error:
        return []
    first = facts.torch.error.strip().splitlines()[0] if facts.torch.error.strip() else facts.torch.error
    return [Finding("torch.probe-error", "warn", f"torch could not be fully probed: {first}",
                    [facts.torch.error], ['python -c "import torch; print(torch.__version__, torch.version.cuda, '
                                          'torch.cuda.is_available())"   # shows the full error'],
                    {"version": facts.torch.version, "error": facts.torch.error})]


def check_torch_cpu_build(facts: Facts) -> list[Finding]:
    if not _is_cpu_build(facts) or not (facts.gpus or facts.driver):
        return []
    seen = []
    if facts.gpus:
        seen.append(f"NVIDIA GPUs: {_gpu_names(facts.gpus)}")
    if facts.driver:
        seen.append(f"NVIDIA driver {facts.driver}" + (f" (from {facts.driver_source})" if facts.driver_source else ""))
    b = build_toolkit(facts)
    if b and _mm(b.version):
        cuda = _mm_str(b.version)
        fix = [_pip_torch(facts, cuda) + f"   # CUDA {cuda}, like the toolkit at {b.root}"]
    else:
        base = _torch_base_version(facts)
        fix = [f"pip install --force-reinstall {'torch==' + base if base else 'torch'} --index-url "
               "https://download.pytorch.org/whl/cu<XY>   # XY: a CUDA version the driver supports (`nvidia-smi` "
               "shows it as \"CUDA Version\"), e.g. cu128 for 12.8"]
    return [Finding("torch.cpu-build", "fail",
                    f"torch {facts.torch.version} is a CPU-only build on a machine with an NVIDIA GPU",
                    [f"torch {facts.torch.version}: torch.version.cuda is None"] + seen, fix,
                    {"torch": facts.torch.version, "driver": facts.driver, "gpus": [g.name for g in facts.gpus],
                     "toolkit": b.version if b else None})]


def check_torch_cuda_unavailable(facts: Facts) -> list[Finding]:
    if not _is_cuda_build(facts) or facts.torch.cuda_available or not (facts.gpus or facts.driver):
        return []
    ev = [f"torch {facts.torch.version} (CUDA {facts.torch.cuda}): torch.cuda.is_available() is False"]
    if facts.gpus:
        ev.append(f"NVIDIA GPUs: {_gpu_names(facts.gpus)}")
    if facts.driver:
        ev.append(f"NVIDIA driver {facts.driver}")
    fix = []
    cvd = facts.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ev.append(f"CUDA_VISIBLE_DEVICES={cvd!r}")
        if cvd.strip() in ("", "-1", "none", "NoDevFiles"):
            fix.append("unset CUDA_VISIBLE_DEVICES   # it hides every GPU")
    fix += [f"the driver must support CUDA {facts.torch.cuda}: `nvidia-smi` shows the newest CUDA it supports "
            "(\"CUDA Version\"); if that is lower, update the NVIDIA driver",
            "or install torch built for the CUDA the driver supports: pip install --force-reinstall torch "
            "--index-url https://download.pytorch.org/whl/cu<XY>"]
    return [Finding("torch.cuda-unavailable", "warn",
                    f"torch {facts.torch.version} is a CUDA {facts.torch.cuda} build but cannot use the GPU",
                    ev, fix, {"torch": facts.torch.version, "cuda": facts.torch.cuda, "driver": facts.driver,
                              "CUDA_VISIBLE_DEVICES": cvd})]


# -- CUDA toolkits -----------------------------------------------------------------------------------------
def check_cuda_toolkit_missing(facts: Facts) -> list[Finding]:
    if not _is_cuda_build(facts) or facts.toolkits:
        return []
    ds = _deepspeed_installed(facts)
    cuda = _mm_str(facts.torch.cuda) or facts.torch.cuda
    why = (f"DeepSpeed {facts.packages['deepspeed'].version} builds its ops (JIT or DS_BUILD_*) with nvcc"
           if ds else "only extension builds (DeepSpeed ops, torch.utils.cpp_extension) need nvcc")
    ev = [f"torch {facts.torch.version} was built with CUDA {facts.torch.cuda}", "no nvcc on PATH, in CUDA_HOME, "
          "/usr/local/cuda*, /opt/cuda* or conda environments", why]
    return [Finding("cuda.toolkit-missing", "warn" if ds else "info",
                    f"no CUDA toolkit (nvcc) found; torch is built with CUDA {cuda}", ev, _install_toolkit(cuda),
                    {"torch_cuda": facts.torch.cuda, "deepspeed": ds})]


def check_cuda_torch_vs_nvcc(facts: Facts) -> list[Finding]:
    fid = "cuda.torch-vs-nvcc"
    if not _is_cuda_build(facts):
        why = "torch is not installed" if not facts.torch.installed else "torch is not a CUDA build"
        return [Finding(fid, "skip", f"torch's CUDA vs nvcc: {why}", data={"torch_cuda": facts.torch.cuda})]
    b = build_toolkit(facts)
    if b is None:
        return [Finding(fid, "skip", "torch's CUDA vs nvcc: no toolkit for extension builds found",
                        data={"torch_cuda": facts.torch.cuda})]
    if _mm(facts.torch.cuda) is None:
        return [Finding(fid, "skip", f"torch's CUDA vs nvcc: torch's CUDA version {facts.torch.cuda!r} is unreadable",
                        data={"torch_cuda": facts.torch.cuda})]
    if _mm(b.version) is None:
        ev = [f"toolkit {b.root}: `nvcc --version` gave no version" + (f" ({b.error})" if b.error else "")]
        return [Finding(fid, "skip", f"torch's CUDA vs nvcc: the version of {b.root} is unknown", ev,
                        data={"torch_cuda": facts.torch.cuda, "root": b.root})]
    t, n = _mm_str(facts.torch.cuda), _mm_str(b.version)
    data = {"torch_cuda": facts.torch.cuda, "nvcc": b.version, "root": b.root}
    ev = [f"torch {facts.torch.version} was built with CUDA {facts.torch.cuda}",
          f"extension builds use {b.root}/bin/nvcc: CUDA {b.version_full or b.version}"]
    if t == n:
        return [Finding(fid, "ok", f"nvcc {n} at {b.root} matches torch's CUDA {t}", ev, data=data)]
    accepted = deepspeed_accepts(t, n)
    same_major = _mm(t)[0] == _mm(n)[0]
    skip_check = facts.env.get("DS_SKIP_CUDA_CHECK") == "1"
    data.update(deepspeed_accepts=accepted, ds_skip_cuda_check=skip_check)
    if accepted:
        sev = "warn"
        title = (f"nvcc {n} differs from torch's CUDA {t}: DeepSpeed accepts it, torch.utils.cpp_extension warns "
                 "(minor-version mismatch)")
    else:
        sev = "warn" if skip_check and same_major else "fail"
        why = "a different major version" if not same_major else (
            "minor versions may differ only within its lists" + ("; CUDA 13 has none" if _mm(n)[0] >= 13 else ""))
        title = f"nvcc {n} differs from torch's CUDA {t}: DeepSpeed's op builder refuses it ({why})"
        if not same_major:
            title += "; torch.utils.cpp_extension refuses a different major version too"
        ev.append(f'DeepSpeed: "Installed CUDA version {n} does not match the version torch was compiled with '
                  f'{facts.torch.cuda}, unable to compile cuda/cpp extensions without a matching cuda version."')
        ev.append(DS_RULE)
        if skip_check:
            title += "; DS_SKIP_CUDA_CHECK=1 is set, so DeepSpeed builds anyway"
            ev.append("DS_SKIP_CUDA_CHECK=1 is set: DeepSpeed skips this check; the ops build against a CUDA torch "
                      "was not built with (risk: crashes or wrong results at runtime)")
    others = [tk for tk in matching_toolkits(facts) if tk is not b]
    fix: list[str] = []
    if others:
        good = next((tk for tk in others if tk.libcudart), others[0])
        ev.append(f"toolkit {_tk_label(good)} matches torch: use it")
        fix += _exports(good, facts)
    else:
        fix += _install_toolkit(t)
    fix.append(f"or install torch built for CUDA {n}: {_pip_torch(facts, n)}")
    if not accepted and same_major and not skip_check:
        fix.append("last resort: export DS_SKIP_CUDA_CHECK=1   # DeepSpeed builds anyway; risk: the ops use a CUDA "
                   "torch was not built with (crashes, wrong results)")
    return [Finding(fid, sev, title, ev, fix, data)]


def check_cuda_multiple_toolkits(facts: Facts) -> list[Finding]:
    if len(facts.toolkits) < 2:
        return []
    b = build_toolkit(facts)
    matches = matching_toolkits(facts)
    ev = [f"{tk.root}: CUDA {tk.version or '?'} (found via {', '.join(tk.found_via) or '?'})"
          + ("  <- extension builds use this one" if tk is b else "") for tk in facts.toolkits]
    data = {"toolkits": [{"root": tk.root, "version": tk.version, "found_via": list(tk.found_via)}
                         for tk in facts.toolkits], "build_root": b.root if b else None}
    if b is not None and matches and b not in matches:
        good = _preferred_match(facts)
        return [Finding("cuda.multiple-toolkits", "warn",
                        f"{len(facts.toolkits)} CUDA toolkits: builds use {_tk_label(b)}, but {_tk_label(good)} "
                        f"matches torch's CUDA {facts.torch.cuda}", ev, _exports(good, facts), data)]
    return [Finding("cuda.multiple-toolkits", "info", f"{len(facts.toolkits)} CUDA toolkits found", ev, [], data)]


def check_cuda_path_order(facts: Facts) -> list[Finding]:
    def first(var: str):
        return min((e for e in facts.path_entries if e.var == var and e.toolkit), key=lambda e: e.index, default=None)

    p, ld = first("PATH"), first("LD_LIBRARY_PATH")
    if p is None and ld is None:
        return []
    ev, problems = [], []
    for e in (p, ld):
        if e is not None:
            tk = facts.toolkit(e.toolkit)
            ev.append(f"{e.var}[{e.index}] = {e.path} -> {e.toolkit} (CUDA {tk.version if tk else '?'})")
    stray = [e for e in facts.path_entries if e.var == "LD_LIBRARY_PATH" and not e.toolkit and e.libcudart
             and (ld is None or e.index < ld.index)]
    if stray:
        e = stray[0]
        ev.append(f"LD_LIBRARY_PATH[{e.index}] = {e.path} holds {', '.join(e.libcudart)} outside any toolkit found: "
                  "the loader looks there first")
    if p is not None and ld is not None and _norm(p.toolkit) != _norm(ld.toolkit):
        problems.append(f"PATH runs nvcc from {p.toolkit}, LD_LIBRARY_PATH loads CUDA libraries from {ld.toolkit}")
    good = _preferred_match(facts)
    if good is not None:
        wrong = [e for e in (p, ld) if e is not None and _mm(getattr(facts.toolkit(e.toolkit), "version", None))
                 != _mm(facts.torch.cuda)]
        if wrong:
            reached = sorted({f"CUDA {getattr(facts.toolkit(e.toolkit), 'version', None) or '?'}" for e in wrong})
            problems.append(f"{' and '.join(e.var for e in wrong)} reach{'es' if len(wrong) == 1 else ''} "
                            f"{', '.join(reached)} first, while {_tk_label(good)} matches torch's CUDA "
                            f"{facts.torch.cuda}")
    data = {"PATH": p.toolkit if p else None, "LD_LIBRARY_PATH": ld.toolkit if ld else None,
            "match": good.root if good else None}
    if not problems:
        if p is not None and ld is not None:
            title = f"PATH and LD_LIBRARY_PATH agree on {p.toolkit}"
        else:
            e = p or ld
            title = f"{e.var} reaches {e.toolkit} first ({'LD_LIBRARY_PATH' if p else 'PATH'} reaches no toolkit)"
        return [Finding("cuda.path-order", "ok", title, ev, data=data)]
    target = good or build_toolkit(facts) or facts.toolkit(p.toolkit if p else ld.toolkit)
    fix = []
    if target is not None:
        fix = [f"export PATH={target.root}/bin:$PATH", f"export LD_LIBRARY_PATH={_lib_dir(target)}:$LD_LIBRARY_PATH"]
    return [Finding("cuda.path-order", "warn", "PATH / LD_LIBRARY_PATH order: " + "; ".join(problems), ev, fix,
                    data)]


def check_cuda_home_mismatch(facts: Facts) -> list[Finding]:
    """CUDA_HOME judged by what a build needs there: bin/nvcc that runs, include/cuda_runtime.h, libcudart.

    With a CPU (or ROCm) build of torch, torch.utils.cpp_extension.CUDA_HOME is None and DeepSpeed, which takes it,
    cannot build CUDA ops at all; the CUDA_HOME a CUDA build of torch would use is judged then, as a warning.
    """
    fid = "cuda.home-mismatch"
    if not facts.toolkits and not facts.build_homes:
        return []
    nvcc_parent = posixpath.dirname(posixpath.dirname(facts.nvcc_on_path)) if facts.nvcc_on_path else None
    cuda_torch = _is_cuda_build(facts)

    def origin(path: str) -> str:
        if _norm(path) == _norm(facts.cuda_home_env):
            return "$CUDA_HOME"
        if _norm(path) == _norm(facts.cuda_path_env):
            return "$CUDA_PATH"
        if nvcc_parent and _norm(path) == _norm(nvcc_parent):
            return f"the folder above the folder of `nvcc` on PATH ({facts.nvcc_on_path})"
        return "its default"

    if cuda_torch:
        users = [(who, home) for who, home in (("DeepSpeed", facts.deepspeed_cuda_home),
                                               ("torch.utils.cpp_extension", facts.torch.cuda_home)) if home]
    else:
        users = [("a CUDA build of torch (and DeepSpeed with it)", h) for h in build_home_paths(facts)]
    cpu_note = None
    if not cuda_torch:
        build = ("not importable" if not facts.torch.installed else
                 f"a ROCm build (HIP {facts.torch.hip})" if facts.torch.hip else "a CPU build")
        torch = f"torch {facts.torch.version}" if facts.torch.version else "torch"
        cpu_note = (f"{torch} is {build}: torch.utils.cpp_extension.CUDA_HOME is None, and DeepSpeed's op builder, "
                    "which takes it, cannot build CUDA ops (MissingCUDAException: \"CUDA_HOME does not exist, unable "
                    "to compile CUDA op(s)\")")
    target = usable_home(facts)
    out: list[Finding] = []
    missing = {home: home_missing(facts, home) for _, home in users}
    bad = [(who, home) for who, home in users if missing[home] != []]
    if bad:
        homes = sorted({h for _, h in bad})
        lacks = {h: missing[h] for h in homes if missing[h]}
        ev = [f"{who} {'builds' if cuda_torch else 'would build'} with CUDA_HOME={home} (from {origin(home)})"
              + (f", which lacks {', '.join(missing[home])}" if missing[home] else ", which is not a CUDA toolkit")
              for who, home in bad]
        if cpu_note:
            ev.insert(0, cpu_note)
        if facts.nvcc_on_path and facts.nvcc_on_path_root and any(_norm(h) == _norm(nvcc_parent) for _, h in bad):
            ev.append(f"`nvcc` on PATH is {facts.nvcc_on_path}, which runs the toolkit at {facts.nvcc_on_path_root} "
                      "(a wrapper script or link): the folder above its folder is not that toolkit")
        ev.append("toolkits found: " + ("; ".join(_tk_label(t) + (f" (lacks {', '.join(t.missing)})" if t.missing
                                                                   else "") for t in facts.toolkits) or "none"))
        if target is not None:
            path, tk = target
            fix = [f"export CUDA_HOME={path}"]
            if tk is not None and facts.toolkit(facts.nvcc_on_path_root) is not tk:
                fix.append(f"export PATH={path}/bin:$PATH")
        else:
            ev.append("no toolkit found has bin/nvcc, include/cuda_runtime.h and libcudart together")
            fix = _install_toolkit(_mm_str(facts.torch.cuda) or "<X.Y>")
        short = sorted({m.split(" (")[0] for ms in lacks.values() for m in ms})
        subject = "extension builds" if cuda_torch else "a CUDA build of torch"
        title = (f"{subject} would use CUDA_HOME={', '.join(homes)}, which is not a CUDA toolkit"
                 + (f" (no {', no '.join(short)})" if short
                    else f" (found: {', '.join(t.root for t in facts.toolkits) or 'none'})"))
        if not cuda_torch:
            title += "; torch is not a CUDA build now, so DeepSpeed cannot build CUDA ops anyway"
        out.append(Finding(fid, "fail" if cuda_torch else "warn", title, ev, fix,
                           {"bad": {who: home for who, home in bad}, "missing": lacks,
                            "target": target[0] if target else None, "torch_cuda_build": cuda_torch,
                            "nvcc_on_path": facts.nvcc_on_path, "nvcc_on_path_root": facts.nvcc_on_path_root}))
    env_bad = any(_norm(h) == _norm(facts.cuda_home_env) for _, h in bad)
    if facts.cuda_home_env and facts.nvcc_on_path_root and not env_bad:
        bh = facts.build_home(facts.cuda_home_env)
        home_tk = (facts.toolkit(bh.toolkit_root) if bh else None) or toolkit_at(facts, facts.cuda_home_env)
        home_root = home_tk.root if home_tk else facts.cuda_home_env
        if _norm(home_root) != _norm(facts.nvcc_on_path_root):
            nv = facts.toolkit(facts.nvcc_on_path_root)
            pick = _preferred_match(facts) or home_tk or nv
            ev = [f"CUDA_HOME={facts.cuda_home_env}: {_tk_label(home_tk) if home_tk else 'not a found toolkit'}",
                  f"`nvcc` on PATH ({facts.nvcc_on_path}) runs {_tk_label(nv) if nv else facts.nvcc_on_path_root}",
                  "extension builds compile with CUDA_HOME's nvcc; scripts and build tools that call `nvcc` get the "
                  "other one"]
            pick_home = home_for(facts, pick) if pick else facts.cuda_home_env
            fix = [f"export CUDA_HOME={pick_home}", f"export PATH={pick_home}/bin:$PATH"]
            out.append(Finding(fid, "warn", f"CUDA_HOME ({home_root}) and `nvcc` on PATH ({facts.nvcc_on_path_root})"
                               " are different toolkits", ev, fix,
                               {"cuda_home": facts.cuda_home_env, "cuda_home_root": home_tk.root if home_tk else None,
                                "nvcc_on_path_root": facts.nvcc_on_path_root,
                                "target": pick_home}))
    if not out and users:
        homes = sorted({h for _, h in users})
        ev = ([cpu_note] if cpu_note else []) + [f"{who}: CUDA_HOME={home} -> {_home_label(facts, home)}"
                                                 for who, home in users]
        title = (f"extension builds use CUDA_HOME={', '.join(homes)}, a CUDA toolkit" if cuda_torch else
                 f"a CUDA build of torch would use CUDA_HOME={', '.join(homes)}, a CUDA toolkit (torch is not a CUDA "
                 "build now)")
        out.append(Finding(fid, "ok", title, ev, data={"homes": homes, "torch_cuda_build": cuda_torch}))
    return out


def _home_label(facts: Facts, home: str) -> str:
    bh = facts.build_home(home)
    tk = (facts.toolkit(bh.toolkit_root) if bh else None) or toolkit_at(facts, home)
    if bh is None:
        return _tk_label(tk)
    parts = [f"bin/nvcc (CUDA {bh.version}" + (f", runs {bh.toolkit_root})" if bh.toolkit_root
                                                and _norm(bh.toolkit_root) != _norm(home) else ")"),
             f"headers in {bh.include}", f"libcudart in {bh.lib_dir}"]
    return ", ".join(parts)


def check_cuda_libcudart_missing(facts: Facts) -> list[Finding]:
    b = build_toolkit(facts)
    out = []
    triple = _target_triple(facts)
    for tk in facts.toolkits:
        if tk.libcudart:
            continue
        targets = f"{tk.root}/targets/{triple}/lib"
        ev = [f"toolkit {_tk_label(tk)}: no libcudart.so* in lib64, lib or targets/*/lib",
              f"lib_dir: {tk.lib_dir or 'none found'}"]
        if tk is b:
            ev.append("extension builds use this toolkit: linking against cudart fails")
        fix = [f"ls {tk.root}/lib64 {targets}",
               f"if libcudart.so sits in {targets}: sudo ln -s {targets} {tk.root}/lib64",
               f"export LD_LIBRARY_PATH={tk.root}/lib64:$LD_LIBRARY_PATH",
               f"or reinstall the toolkit's runtime (e.g. `conda install -c nvidia cuda-cudart-dev={tk.version}`)"
               if tk.version else "or reinstall the toolkit"]
        out.append(Finding("cuda.libcudart-missing", "fail" if tk is b else "warn",
                           f"CUDA toolkit {tk.root} has no libcudart", ev, fix,
                           {"root": tk.root, "lib_dir": tk.lib_dir, "version": tk.version, "build": tk is b}))
    if not out and facts.toolkits:
        out.append(Finding("cuda.libcudart-missing", "ok", "every CUDA toolkit found has libcudart",
                           [f"{tk.root}: {tk.lib_dir}/{tk.libcudart[0]}" for tk in facts.toolkits],
                           data={"lib_dirs": {tk.root: tk.lib_dir for tk in facts.toolkits}}))
    return out


# -- host compiler -----------------------------------------------------------------------------------------
HOST_COMPILER_WHY = {
    "-ccbin in NVCC_APPEND_FLAGS": "nvcc takes the last -ccbin, and NVCC_APPEND_FLAGS come after the build's own",
    "CC": "torch.utils.cpp_extension passes -ccbin $CC to nvcc",
    "-ccbin in NVCC_PREPEND_FLAGS": "no -ccbin after it: CC is unset, none in NVCC_APPEND_FLAGS",
    "NVCC_CCBIN": "no -ccbin on nvcc's command line",
    "toolkit bin/gcc": "nvcc puts its own bin folder first on PATH",
    "PATH": "no -ccbin, NVCC_CCBIN or <toolkit>/bin/gcc",
}


def _host_gcc_fix(source: str, major: int, root: str) -> list[str]:
    """The fix for the source that picks the host compiler (anything lower in nvcc's order would not win)."""
    gcc, gxx = f"/usr/bin/gcc-{major}", f"/usr/bin/g++-{major}"
    cc = f"export CC={gcc} CXX={gxx}"
    if source == "-ccbin in NVCC_APPEND_FLAGS":
        return [f"change -ccbin in NVCC_APPEND_FLAGS to -ccbin {gcc}   # it wins over CC and NVCC_CCBIN"]
    if source == "CC":
        return [f"{cc}   # torch passes CC to nvcc as -ccbin"]
    if source == "-ccbin in NVCC_PREPEND_FLAGS":
        return [f"change -ccbin in NVCC_PREPEND_FLAGS to -ccbin {gcc}", f"or: {cc}   # torch's -ccbin $CC comes later "
                "on nvcc's command line and wins"]
    if source == "NVCC_CCBIN":
        return [f"export NVCC_CCBIN={gcc}", f"or: {cc}   # torch passes CC to nvcc as -ccbin, which beats NVCC_CCBIN"]
    ln = "sudo ln -sf" if source == "toolkit bin/gcc" else "sudo ln -s"  # -f: replace the toolkit's link
    return [f"{ln} {gcc} {root}/bin/gcc", f"{ln} {gxx} {root}/bin/g++",
            f"or: {cc}   # torch passes CC to nvcc as -ccbin"]


def check_compiler_host_gcc(facts: Facts) -> list[Finding]:
    fid = "compiler.host-gcc"
    hc = facts.host_compiler
    b = build_toolkit(facts)
    if hc is None or not hc.path:
        sev = "fail" if b is not None else "info"
        return [Finding(fid, sev, "no host compiler found: nvcc needs a host compiler (gcc)",
                        ["no gcc on PATH, no CC, no NVCC_CCBIN, no <toolkit>/bin/gcc"],
                        ["sudo apt install build-essential   # yum groupinstall 'Development Tools'"],
                        {"toolkit": b.root if b else None})]
    name = posixpath.basename(hc.path)
    data = {"path": hc.path, "version": hc.version, "source": hc.source, "cuda": b.version if b else None}
    why = f"{hc.path} ({hc.version or 'version unknown'}), chosen by nvcc from: {hc.source}"
    if hc.source in HOST_COMPILER_WHY:
        why += f" ({HOST_COMPILER_WHY[hc.source]})"
    overridden = getattr(hc, "overridden", None) or []
    if "clang" in name:
        return [Finding(fid, "info", f"host compiler is clang ({hc.path} {hc.version or ''}".rstrip() + "): "
                        "torch's gcc table does not apply", [why], [], data)]
    if b is None or _mm(b.version) is None:
        return [Finding(fid, "skip", f"host compiler {name} {hc.version or ''}".rstrip() + ": no CUDA toolkit "
                        "version to check it against", [why], [], data)]
    cuda = _mm_str(b.version)
    bounds = (facts.torch.gcc_table or {}).get(cuda)
    version = _vtuple(hc.version)
    if bounds is None or version is None:
        what = (f"torch's CUDA_GCC_VERSIONS has no entry for CUDA {cuda}" if bounds is None
                else "its version is unknown")
        return [Finding(fid, "info", f"host compiler {name} {hc.version or ''}".rstrip() + f" not checked: {what}",
                        [why], [], data)]
    lo, hi = _pad(bounds[0]), _pad(bounds[1])
    rng = f">={_vstr(bounds[0])}, <{_vstr(bounds[1])}"
    data.update(min=list(bounds[0]), max=list(bounds[1]))
    ev = [why, f"CUDA {cuda} (toolkit {b.root}) accepts gcc {rng} (torch.utils.cpp_extension.CUDA_GCC_VERSIONS)"]
    if overridden:
        ev.append("also present, but lower in nvcc's order: " + "; ".join(overridden))
    if lo <= version < hi:
        return [Finding(fid, "ok", f"host compiler gcc {hc.version} is within CUDA {cuda}'s range {rng}", ev,
                        data=data)]
    major = hi[0] - 1  # the newest major CUDA accepts
    fix = [f"sudo apt install gcc-{major} g++-{major}"] + _host_gcc_fix(hc.source, major, b.root)
    side = "newer" if version >= hi else "older"
    return [Finding(fid, "fail", f"host compiler gcc {hc.version} is {side} than CUDA {cuda} accepts ({rng}): nvcc "
                    "and torch.utils.cpp_extension refuse it", ev, fix, data)]


# -- GPUs --------------------------------------------------------------------------------------------------
def _arch_entries(arch_list: Iterable[str]) -> list[tuple[str, tuple[int, int], str]]:
    """("sm" | "compute", (major, minor), suffix) for each of torch's arch strings ("sm_86", "compute_90a")."""
    out = []
    for a in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([a-z]?)", a.strip())
        if m:
            out.append((m.group(1), (int(m.group(2)), int(m.group(3))), m.group(4)))
    return out


def _runs_on(kind_cap: tuple[int, int], suffix: str, gpu: tuple[int, int]) -> bool:
    """Whether code for ``kind_cap`` runs on a GPU of capability ``gpu``: arch-specific ("a") code only on that
    exact GPU; otherwise SASS/PTX for X.Z runs on X.Y with Z <= Y (SASS) -- callers handle PTX across majors."""
    if suffix == "a":
        return kind_cap == gpu
    return kind_cap[0] == gpu[0] and kind_cap[1] <= gpu[1]


def check_gpu_arch_unsupported(facts: Facts) -> list[Finding]:
    fid = "gpu.arch-unsupported"
    if not _is_cuda_build(facts) or not facts.gpus:
        why = "no GPU visible" if _is_cuda_build(facts) else "torch is not a CUDA build"
        return [Finding(fid, "skip", f"GPU architectures vs torch's build: {why}")]
    if not facts.torch.arch_list:
        return [Finding(fid, "skip", "GPU architectures vs torch's build: torch reported no arch list "
                        "(torch.cuda.get_arch_list() is empty when CUDA is not available to torch)")]
    entries = _arch_entries(facts.torch.arch_list)
    has = " ".join(facts.torch.arch_list)
    sms = [c for k, c, s in entries if k == "sm"]
    out = []
    for cap, gpus in _gpus_by_cap(facts.gpus).items():
        xy = f"sm_{cap[0]}{cap[1]}"
        data = {"capability": _cap_str(cap), "gpus": [g.index for g in gpus], "arch_list": list(facts.torch.arch_list),
                "torch": facts.torch.version}
        ev = [f"{_gpu_names(gpus)}: compute capability {_cap_str(cap)} ({xy})",
              f"torch {facts.torch.version} (CUDA {facts.torch.cuda}) has kernels for: {has}"]
        exact = any(k == "sm" and c == cap for k, c, s in entries)
        compat = [f"sm_{c[0]}{c[1]}{s}" for k, c, s in entries if k == "sm" and _runs_on(c, s, cap)]
        ptx = [f"compute_{c[0]}{c[1]}{s}" for k, c, s in entries
               if k == "compute" and (c == cap if s == "a" else c <= cap)]
        if exact or compat:
            how = xy if exact else f"{compat[-1]} (binary-compatible within major {cap[0]})"
            out.append(Finding(fid, "ok", f"torch {facts.torch.version} runs natively on {gpus[0].name} "
                               f"({xy}): {how}", ev, data=data))
            continue
        newer = bool(sms) and cap > max(sms)
        if newer:
            fix = ["install a torch built for a newer CUDA that targets " + xy + ": pip install --force-reinstall "
                   "torch --index-url https://download.pytorch.org/whl/cu130"]
        else:
            fix = ["install a torch built for an older CUDA that still targets " + xy + ": pip install "
                   "--force-reinstall torch --index-url https://download.pytorch.org/whl/cu126"]
        fix += ['check: python -c "import torch; print(torch.cuda.get_arch_list())"   # must list ' + xy,
                f"or build torch from source with TORCH_CUDA_ARCH_LIST={_cap_str(cap)}"]
        if ptx:
            ev.append(f"only PTX ({', '.join(ptx)}) fits: the driver JIT-compiles every kernel on first use "
                      "(minutes at start-up, cached in ~/.nv/ComputeCache)")
            out.append(Finding(fid, "warn", f"torch {facts.torch.version} has no {xy} kernels for {gpus[0].name}: "
                               f"runs through PTX JIT ({ptx[-1]}), slow first start", ev, fix, data))
        else:
            if sms and any(c[0] == cap[0] for c in sms):
                ev.append(f"torch's own check passes (same major {cap[0]}), but SASS for a newer minor does not "
                          "run on this GPU")
            ev.append('kernels fail with "no kernel image is available for execution on the device"')
            out.append(Finding(fid, "fail", f"torch {facts.torch.version} does not support {gpus[0].name} ({xy}); "
                               f"the build has {has}", ev, fix, data))
    return out


@dataclass
class ArchList:
    """TORCH_CUDA_ARCH_LIST as torch.utils.cpp_extension reads it."""

    auto: bool = False  # "" or "native": torch builds for the visible GPUs, as when it is unset
    entries: list[tuple[tuple[int, int], str, bool]] = field(default_factory=list)  # ((8, 6), "a", +PTX) accepted
    unknown: list[str] = field(default_factory=list)  # torch: "Unknown CUDA arch (X) or GPU not supported"
    empty: int = 0  # empty entries (";;", a ';' or a space at either end): torch raises on them too
    names: list[str] = field(default_factory=list)  # architecture names expanded ("Ampere", ...)
    raw: list[str] = field(default_factory=list)  # the non-empty entries as written (spaces as ';'), before names


def parse_arch_list(value: str, names: Iterable[Iterable[str]] | None = None,
                    supported: Iterable[str] | None = None) -> ArchList:
    """TORCH_CUDA_ARCH_LIST as torch's ``_get_cuda_arch_flags`` reads it: "" and "native" detect the visible GPUs;
    otherwise spaces separate like ';', architecture names are replaced in torch's order, and each entry must be one
    of torch's ``supported_arches`` ("8.6", "9.0a", ...), optionally with "+PTX" ("8.1", "9.9+PTX" are refused)."""
    if value in ("", "native"):
        return ArchList(auto=True)
    names = [tuple(n) for n in (NAMED_ARCHES if names is None else names)]
    supported = list(SUPPORTED_ARCHES if supported is None else supported)
    valid = set(supported) | {a + "+PTX" for a in supported}
    out = ArchList(raw=[e for e in value.replace(" ", ";").split(";") if e])
    s = value.replace(" ", ";")
    for name, arches in names:
        if name in s:
            out.names.append(name)
            s = s.replace(name, arches)
    for entry in s.split(";"):
        m = re.fullmatch(r"(\d+)\.(\d+)([a-z]*)(\+PTX)?", entry)
        if entry == "":
            out.empty += 1
        elif entry in valid and m:
            out.entries.append(((int(m.group(1)), int(m.group(2))), m.group(3), bool(m.group(4))))
        else:
            out.unknown.append(entry)
    return out


def _arch_token(cap: tuple[int, int], suffix: str, ptx: bool) -> str:
    return f"{_cap_str(cap)}{suffix}{'+PTX' if ptx else ''}"


def _torch_arch_parse(facts: Facts, value: str) -> ArchList:
    return parse_arch_list(value, facts.torch.arch_names, facts.torch.supported_arches)


def arch_list_fixed(facts: Facts) -> str | None:
    """TORCH_CUDA_ARCH_LIST with what torch or DeepSpeed refuse taken out and the visible GPUs added (None: unset,
    auto-detect, or nothing left)."""
    value = facts.env.get("TORCH_CUDA_ARCH_LIST")
    if value is None:
        return None
    parsed = _torch_arch_parse(facts, value)
    if parsed.auto:
        return None
    b = build_toolkit(facts)
    tk_mm = _mm(b.version) if b else None
    cuda13 = bool(tk_mm and tk_mm[0] >= 13)
    ds = _deepspeed_installed(facts)
    keep: dict[tuple[tuple[int, int], str], bool] = {}
    for cap, suffix, ptx in parsed.entries:
        if cuda13 and cap < CUDA13_MIN_ARCH:
            continue
        key = (cap, "" if ds else suffix)  # DeepSpeed cannot read "9.0a"
        keep[key] = keep.get(key, False) or ptx
    for cap in _gpus_by_cap(facts.gpus):
        if not any(c == cap for c, _ in keep):
            keep[(cap, "")] = False
    return ";".join(_arch_token(c, sfx, ptx) for (c, sfx), ptx in sorted(keep.items())) or None


def check_gpu_arch_list(facts: Facts) -> list[Finding]:
    fid = "gpu.arch-list"
    rec = recommended_arch_list(facts)
    value = facts.env.get("TORCH_CUDA_ARCH_LIST")
    b = build_toolkit(facts)
    ds = _deepspeed_installed(facts)
    data = {"TORCH_CUDA_ARCH_LIST": value, "recommended": rec, "toolkit": b.version if b else None,
            "torch_tables": facts.torch.supported_arches is not None}
    query = "nvidia-smi --query-gpu=compute_cap --format=csv,noheader"
    parsed = _torch_arch_parse(facts, value) if value is not None else None
    if parsed is None or parsed.auto:
        shown = "is unset" if value is None else f"is {value!r} (torch detects the visible GPUs, as when it is unset)"
        ev, fix, sev = [], [], "info"
        if value == "native" and ds:
            sev = "warn"
            ev.append("DeepSpeed's op builder (0.19.8) does not know 'native': it reads entries as X.Y and fails with "
                      "ValueError: invalid literal for int() with base 10: 'native'")
        elif value == "" and ds:
            ev.append("DeepSpeed's JIT builds detect the GPUs too, but its prebuild (setup.py, DS_BUILD_*=1) reads "
                      "the empty value literally and fails with ValueError")
        if rec is None:
            ev.insert(0, "extension builds without a visible GPU need TORCH_CUDA_ARCH_LIST: torch's detection "
                         "finds no GPU and fails (IndexError: list index out of range)")
            fix.append(f"set TORCH_CUDA_ARCH_LIST for the target machine's GPUs (`{query}` there), e.g. "
                       'export TORCH_CUDA_ARCH_LIST="8.6"')
            title = f"TORCH_CUDA_ARCH_LIST {shown} and no GPU is visible"
        else:
            ev.insert(0, "builds target the GPUs of the machine they run on; set it to build once for these GPUs "
                         "(and to prebuild DeepSpeed ops)")
            fix.append(f'export TORCH_CUDA_ARCH_LIST="{rec}"')
            title = f"TORCH_CUDA_ARCH_LIST {shown}; the visible GPUs need {rec}"
        if value is not None and ds:
            fix.append("or: unset TORCH_CUDA_ARCH_LIST")
        if sev == "warn":
            title += ": DeepSpeed refuses 'native'"
        return [Finding(fid, sev, title, ev, fix, data)]
    caps = {c for c, _, _ in parsed.entries}
    problems: list[tuple[str, str]] = []
    for e in parsed.unknown:
        problems.append(("warn", f"torch refuses {e!r}: \"Unknown CUDA arch ({e}) or GPU not supported\""))
    if parsed.empty:
        problems.append(("warn", f"{parsed.empty} empty entr{'y' if parsed.empty == 1 else 'ies'} (';;', or a ';' or "
                                 "space at either end): torch raises \"Unknown CUDA arch () or GPU not supported\" "
                                 "and DeepSpeed's prebuild (setup.py) fails with ValueError; only DeepSpeed's JIT "
                                 "builds drop them"))
    if ds:
        unreadable = [e for e in parsed.raw if not DS_ARCH_ENTRY.fullmatch(e) and e not in parsed.unknown]
        if unreadable:
            problems.append(("warn", f"DeepSpeed's op builder (0.19.8) reads only X.Y[+PTX]: "
                                     f"{', '.join(repr(e) for e in unreadable)} make it fail with ValueError: invalid "
                                     "literal for int()"))
    for cap, gpus in _gpus_by_cap(facts.gpus).items():
        if cap not in caps:
            problems.append(("warn", f"leaves out {_cap_str(cap)} ({_gpu_names(gpus)})"))
    tk_mm = _mm(b.version) if b else None
    if tk_mm and tk_mm[0] >= 13:
        old = sorted({c for c in caps if c < CUDA13_MIN_ARCH})
        if old:
            problems.append(("warn", f"{', '.join(_cap_str(c) for c in old)} below 7.5: CUDA {b.version} ({b.root}) "
                                     "dropped pre-Turing targets; nvcc fails with \"Unsupported gpu architecture\""))
    data.update(parsed=sorted({_cap_str(c) for c in caps}, key=_cap), unparseable=parsed.unknown, empty=parsed.empty,
                names=parsed.names)
    ev = [f"TORCH_CUDA_ARCH_LIST={value!r}" + (f" (names: {', '.join(parsed.names)})" if parsed.names else "")]
    ev += [p for _, p in problems]
    if parsed.unknown:
        ev.append((f"torch {facts.torch.version}" if facts.torch.version else "torch") + " accepts "
                  + ", ".join(facts.torch.supported_arches or SUPPORTED_ARCHES) + " (each also with +PTX)"
                  + ("" if facts.torch.supported_arches else " -- torch 2.13's list; this torch's was not read"))
    if rec is None:
        ev.append(f"no GPU visible here: make sure it lists the target machine's GPUs (`{query}` there)")
    if problems:
        fixed = arch_list_fixed(facts)
        fix = ([f'export TORCH_CUDA_ARCH_LIST="{fixed}"'] if fixed else
               [f"set it to the target machine's capabilities as X.Y (`{query}` there), e.g. "
                'export TORCH_CUDA_ARCH_LIST="8.6"'])
        data["fixed"] = fixed
        sev = max((s for s, _ in problems), key=_SEV.__getitem__)
        return [Finding(fid, sev, f"TORCH_CUDA_ARCH_LIST={value!r}: " + "; ".join(p for _, p in problems), ev, fix,
                        data)]
    sev = "ok" if rec else "info"
    title = (f"TORCH_CUDA_ARCH_LIST={value!r} covers the visible GPUs ({rec})" if rec
             else f"TORCH_CUDA_ARCH_LIST={value!r}; no GPU is visible to check it against")
    return [Finding(fid, sev, title, ev, data=data)]


def check_precision_bf16_available(facts: Facts) -> list[Finding]:
    caps = _gpus_by_cap(facts.gpus)
    if not caps:
        return []
    data = {"capabilities": [_cap_str(c) for c in caps]}
    old = {c: g for c, g in caps.items() if c < BF16_MIN_CAP}
    if not old:
        return [Finding("precision.bf16-available", "info", "every GPU supports bf16 (compute capability >= 8.0): "
                        "prefer bf16 over fp16",
                        ["models pretrained in bf16 overflow in fp16 (NaN loss); bf16 has fp32's range and needs no "
                         "loss scaling"],
                        ["TrainingArguments(bf16=True)", 'DeepSpeed config: "bf16": {"enabled": true}'],
                        {**data, "bf16": True})]
    names = "; ".join(f"{_cap_str(c)}: {_gpu_names(g)}" for c, g in old.items())
    return [Finding("precision.bf16-available", "info", f"bf16 is not available on some GPUs (compute capability "
                    f"< 8.0: {names})",
                    ["on these GPUs train in fp16 with dynamic loss scaling; models pretrained in bf16 may overflow "
                     "in fp16 (NaN loss)"],
                    ["TrainingArguments(fp16=True)",
                     'DeepSpeed config: "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}   '
                     "# loss_scale 0 = dynamic; lower initial_scale_power if the first steps overflow"],
                    {**data, "bf16": False, "without_bf16": [_cap_str(c) for c in old]})]


# -- system and build tools --------------------------------------------------------------------------------
def check_system_shm_small(facts: Facts) -> list[Finding]:
    if facts.shm_gib is None:
        return []
    data = {"shm_gib": facts.shm_gib}
    if facts.shm_gib >= SHM_MIN_GIB:
        return [Finding("system.shm-small", "ok", f"/dev/shm is {facts.shm_gib:.1f} GiB", data=data)]
    return [Finding("system.shm-small", "warn", f"/dev/shm is only {facts.shm_gib * 1024:.0f} MiB",
                    ["NCCL and DataLoader workers (num_workers > 0) pass data through /dev/shm; docker's default is "
                     "64 MiB", "symptoms: \"Bus error\" in DataLoader workers, NCCL errors or hangs"],
                    ["docker run --shm-size=16g ...", "or docker run --ipc=host ...",
                     "kubernetes: mount an emptyDir with medium: Memory at /dev/shm"], data)]


def check_build_ninja_missing(facts: Facts) -> list[Finding]:
    if facts.ninja:
        return [Finding("build.ninja-missing", "ok", f"ninja {facts.ninja} found", data={"ninja": facts.ninja})]
    ds = _deepspeed_installed(facts)
    return [Finding("build.ninja-missing", "warn" if ds else "info", "ninja not found: extension builds need it",
                    ["torch.utils.cpp_extension.load (DeepSpeed's JIT op builds) raises \"Ninja is required to load "
                     "C++ extensions\""], ["pip install ninja"], {"ninja": None, "deepspeed": ds})]


def check_build_libaio_missing(facts: Facts, nvme_offload: bool = False) -> list[Finding]:
    if not nvme_offload:
        return []
    if facts.libaio:
        return [Finding("build.libaio-missing", "ok", f"libaio found ({facts.libaio}): DeepSpeed's async_io op can "
                        "build", data={"libaio": facts.libaio})]
    return [Finding("build.libaio-missing", "fail", "libaio not found: DeepSpeed's NVMe offload (async_io op) cannot "
                    "build", ["ZeRO-Infinity offload to NVMe uses the async_io op, which links libaio"],
                    ["sudo apt install libaio-dev   # yum install libaio-devel",
                     "then build the op: DS_BUILD_AIO=1 pip install deepspeed --no-cache-dir"], {"libaio": None})]


RULES: tuple[Callable[..., list[Finding]], ...] = (
    check_torch_missing,
    check_torch_probe_error,
    check_torch_cpu_build,
    check_torch_cuda_unavailable,
    check_cuda_toolkit_missing,
    check_cuda_home_mismatch,
    check_cuda_torch_vs_nvcc,
    check_cuda_libcudart_missing,
    check_compiler_host_gcc,
    check_gpu_arch_unsupported,
    check_build_libaio_missing,
    check_cuda_path_order,
    check_cuda_multiple_toolkits,
    check_gpu_arch_list,
    check_build_ninja_missing,
    check_system_shm_small,
    check_precision_bf16_available,
)


def judge(facts: Facts, nvme_offload: bool = False) -> list[Finding]:
    """Every rule's findings, in a fixed order, most important first."""
    out: list[Finding] = []
    for rule in RULES:
        out.extend(rule(facts, nvme_offload) if rule is check_build_libaio_missing else rule(facts))
    return out

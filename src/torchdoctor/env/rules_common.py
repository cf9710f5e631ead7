"""What the rules of ``torchdoctor env`` share: reading versions and compute capabilities, the fix lines
(exports, installs), and which toolkit / CUDA_HOME extension builds use and which one to recommend.

Pure functions of :class:`Facts`; the checks are in ``rules_cuda.py``, ``rules_gpu.py`` and ``rules_build.py``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

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

"""The rules about the rest of an extension build and the system: the host compiler nvcc picks vs torch's
``CUDA_GCC_VERSIONS``, ninja, libaio for NVMe offload, and /dev/shm."""

from __future__ import annotations

import posixpath

from ..findings import Finding
from .facts import Facts
from .rules_common import _deepspeed_installed, _mm, _mm_str, _pad, _vstr, _vtuple, build_toolkit

SHM_MIN_GIB = 1.0


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

"""The facts ``torchdoctor env`` gathers: plain dataclasses, JSON-able, with no judgement in them.

:mod:`torchdoctor.env.probe` fills them on a real machine; :mod:`torchdoctor.env.rules` judges them.
Tests build them by hand (every field has a default), so every rule is tested on fabricated machines.
Versions are strings as the tools print them ("12.4", "12.2.0"); ``None`` means "not found / unknown".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TorchFacts:
    installed: bool = True
    version: str | None = None
    cuda: str | None = None  # torch.version.cuda: the CUDA torch was built with; None for a CPU build
    hip: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    cxx11_abi: bool | None = None
    cuda_available: bool = False
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list(), e.g. ["sm_80", "compute_90"]
    # torch.utils.cpp_extension.CUDA_GCC_VERSIONS: CUDA "X.Y" -> [[min gcc], [max gcc, exclusive]]
    gcc_table: dict[str, list[list[int]]] | None = None
    # torch.utils.cpp_extension.CUDA_HOME (what torch extension builds use); None for a CPU build
    cuda_home: str | None = None
    # TORCH_CUDA_ARCH_LIST as torch.utils.cpp_extension._get_cuda_arch_flags reads it, from the installed torch's
    # source: the architecture names it expands ([name, value] in its order) and the entries it accepts ("8.6", "9.0a",
    # each also with "+PTX"). None: not readable from this torch (the rules fall back to torch 2.13's tables).
    arch_names: list[list[str]] | None = None
    supported_arches: list[str] | None = None
    error: str | None = None


@dataclass
class PackageFacts:
    name: str
    version: str | None = None  # from the installed metadata; None: not installed
    import_ok: bool | None = None  # None: not tried (not installed) or timed out
    import_error: str | None = None


@dataclass
class Gpu:
    index: int
    name: str
    capability: str  # "8.6"
    memory_gib: float | None = None
    uuid: str | None = None


@dataclass
class Toolkit:
    root: str  # real path of the toolkit's top folder
    found_via: list[str] = field(default_factory=list)  # "CUDA_HOME", "PATH", "/usr/local/cuda", "conda", ...
    nvcc: str | None = None  # <root>/bin/nvcc when present
    version: str | None = None  # "13.0", from its own `nvcc --version`
    version_full: str | None = None  # "13.0.88"
    lib_dir: str | None = None  # the folder holding libcudart (lib64, lib, targets/<arch>/lib)
    libcudart: list[str] = field(default_factory=list)  # libcudart.so* file names there
    error: str | None = None  # nvcc failed / timed out
    # what an extension build with CUDA_HOME=<root> needs and this toolkit lacks, e.g. "include/cuda_runtime.h"
    # (Debian's /usr/lib/nvidia-cuda-toolkit keeps its headers in /usr/include); empty: nothing known missing
    missing: list[str] = field(default_factory=list)


@dataclass
class BuildHome:
    """A CUDA_HOME judged by what an extension build needs there (torch.utils.cpp_extension runs
    ``<home>/bin/nvcc``, adds ``-I<home>/include`` and ``-L<home>/lib64`` and links ``-lcudart``)."""

    path: str  # as the build would see it, e.g. "/usr/local" or "/usr"
    nvcc: str | None = None  # <path>/bin/nvcc when it exists
    version: str | None = None  # from that nvcc's --version; None: missing or it did not run
    toolkit_root: str | None = None  # the toolkit that nvcc really runs from (its --dryrun TOP)
    include: str | None = None  # the folder with cuda_runtime.h: <path>/include (or targets/<arch>/include)
    lib_dir: str | None = None  # where libcudart.so* is (lib64, lib, targets/<arch>/lib, lib/<multiarch>)
    missing: list[str] = field(default_factory=list)  # what a build needs and does not find; empty: usable


@dataclass
class PathEntry:
    var: str  # "PATH" | "LD_LIBRARY_PATH"
    index: int  # position in the variable (0 = searched first)
    path: str
    toolkit: str | None  # root of the toolkit this entry points into, if any
    libcudart: list[str] = field(default_factory=list)  # LD_LIBRARY_PATH: libcudart.so* file names in this folder


@dataclass
class Compiler:
    name: str  # "gcc" | "g++" | "clang"
    path: str | None = None
    version: str | None = None  # "12.2.0"
    error: str | None = None


@dataclass
class HostCompiler:
    """The host compiler nvcc would use for an extension build, and why that one."""

    path: str | None
    version: str | None
    # what picks it, as nvcc and torch do (highest first): "-ccbin in NVCC_APPEND_FLAGS" | "CC" (torch passes
    # -ccbin $CC) | "-ccbin in NVCC_PREPEND_FLAGS" | "NVCC_CCBIN" | "toolkit bin/gcc" (nvcc puts its own bin first on
    # PATH) | "PATH"
    source: str
    # the lower choices that are present too, e.g. "NVCC_CCBIN=/usr/bin/gcc-14", "PATH: /usr/bin/gcc"
    overridden: list[str] = field(default_factory=list)


@dataclass
class Facts:
    os: str = ""
    python: str = ""
    torch: TorchFacts = field(default_factory=TorchFacts)
    packages: dict[str, PackageFacts] = field(default_factory=dict)  # transformers, accelerate, deepspeed, ...
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None  # NVIDIA driver version
    driver_source: str | None = None  # "nvml" | "nvidia-smi" | "/proc/driver/nvidia/version"
    ram_gib: float | None = None  # MemTotal
    memory_limit_gib: float | None = None  # this process's cgroup memory limit, when there is one
    shm_gib: float | None = None  # size of /dev/shm
    cpu_count: int | None = None
    toolkits: list[Toolkit] = field(default_factory=list)
    nvcc_on_path: str | None = None  # `which nvcc`
    nvcc_on_path_root: str | None = None  # the toolkit that nvcc really runs from (its TOP), if found
    cuda_home_env: str | None = None  # $CUDA_HOME
    cuda_path_env: str | None = None  # $CUDA_PATH
    # the CUDA_HOME a CUDA build of torch would use (torch.utils.cpp_extension._find_cuda_home): $CUDA_HOME /
    # $CUDA_PATH, else the parent of `which nvcc`'s folder, else /usr/local/cuda when it exists
    cuda_home_for_cuda_torch: str | None = None
    # the CUDA_HOME DeepSpeed's op builder uses: torch.utils.cpp_extension.CUDA_HOME, so None for a CPU (or ROCm)
    # build of torch -- DeepSpeed cannot build CUDA ops then; deepspeed_cuda_home_note says why it is what it is
    deepspeed_cuda_home: str | None = None
    deepspeed_cuda_home_note: str | None = None
    build_toolkit_root: str | None = None  # the found toolkit whose nvcc builds would run, if any
    build_homes: list[BuildHome] = field(default_factory=list)  # each CUDA_HOME candidate, judged for builds
    path_entries: list[PathEntry] = field(default_factory=list)  # PATH / LD_LIBRARY_PATH entries into toolkits
    compilers: list[Compiler] = field(default_factory=list)
    host_compiler: HostCompiler | None = None
    ninja: str | None = None  # version; None: not found
    libaio: str | None = None  # where libaio.so was found; None: not found
    env: dict[str, str] = field(default_factory=dict)  # TORCH_CUDA_ARCH_LIST, NCCL_*, CUDA_*, DS_*, CC, CXX, ...
    probe_errors: list[str] = field(default_factory=list)  # probes that failed or timed out
    probe_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def toolkit(self, root: str | None) -> Toolkit | None:
        return next((t for t in self.toolkits if root and t.root == root), None)

    def build_home(self, path: str | None) -> BuildHome | None:
        """The probe's verdict on ``path`` as a CUDA_HOME (trailing slashes ignored), if it looked at it."""
        norm = (path or "").rstrip("/") or "/"
        return next((h for h in self.build_homes if path and (h.path.rstrip("/") or "/") == norm), None)

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
    cuda_home: str | None = None  # torch.utils.cpp_extension.CUDA_HOME (what torch extension builds use)
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


@dataclass
class PathEntry:
    var: str  # "PATH" | "LD_LIBRARY_PATH"
    index: int  # position in the variable (0 = searched first)
    path: str
    toolkit: str | None  # root of the toolkit this entry points into, if any


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
    source: str  # "toolkit bin/gcc" | "NVCC_CCBIN" | "CC" | "PATH"


@dataclass
class Facts:
    os: str = ""
    python: str = ""
    torch: TorchFacts = field(default_factory=TorchFacts)
    packages: dict[str, PackageFacts] = field(default_factory=dict)  # transformers, accelerate, deepspeed, ...
    gpus: list[Gpu] = field(default_factory=list)
    driver: str | None = None  # NVIDIA driver version
    driver_source: str | None = None  # "nvml" | "nvidia-smi" | "/proc/driver/nvidia/version"
    ram_gib: float | None = None
    shm_gib: float | None = None  # size of /dev/shm
    cpu_count: int | None = None
    toolkits: list[Toolkit] = field(default_factory=list)
    nvcc_on_path: str | None = None  # `which nvcc`
    nvcc_on_path_root: str | None = None  # the toolkit that nvcc really runs from (its TOP), if found
    cuda_home_env: str | None = None  # $CUDA_HOME
    cuda_path_env: str | None = None  # $CUDA_PATH
    # the CUDA_HOME builds use (torch.utils.cpp_extension, so DeepSpeed): $CUDA_HOME / $CUDA_PATH, else the
    # parent of `which nvcc`'s folder, else /usr/local/cuda
    deepspeed_cuda_home: str | None = None
    build_toolkit_root: str | None = None  # the found toolkit that CUDA_HOME for builds resolves to, if any
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

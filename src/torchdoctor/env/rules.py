"""Judging the facts of ``torchdoctor env``: pure functions from :class:`Facts` to findings.

Every rule is ``check_<id with dots and dashes as underscores>(facts) -> list[Finding]`` and reads nothing but
its argument, so each is tested on fabricated machines. Where torch or DeepSpeed hold the rule (torch's
``CUDA_GCC_VERSIONS``, DeepSpeed's op-builder CUDA check), the rule says what that library will do.
Every fix is a command or an export line filled in for this machine.

The checks live by subject -- ``rules_cuda.py`` (torch's build, the toolkits, CUDA_HOME), ``rules_gpu.py`` (GPU
architectures, TORCH_CUDA_ARCH_LIST, bf16), ``rules_build.py`` (host compiler, ninja, libaio, /dev/shm) -- over what
they share in ``rules_common.py``; this module holds their order (:data:`RULES`) and :func:`judge`, and is where
callers import them from.
"""

from __future__ import annotations

from collections.abc import Callable

from ..findings import Finding
from .facts import Facts
from .rules_build import (
    check_build_libaio_missing,
    check_build_ninja_missing,
    check_compiler_host_gcc,
    check_system_shm_small,
)
from .rules_common import (
    DS_MINOR_MISMATCH_OK,
    build_home_paths,
    build_toolkit,
    deepspeed_accepts,
    home_for,
    home_missing,
    matching_toolkits,
    recommended_arch_list,
    toolkit_at,
    usable_home,
)
from .rules_cuda import (
    check_cuda_home_mismatch,
    check_cuda_libcudart_missing,
    check_cuda_multiple_toolkits,
    check_cuda_path_order,
    check_cuda_toolkit_missing,
    check_cuda_torch_vs_nvcc,
    check_torch_cpu_build,
    check_torch_cuda_unavailable,
    check_torch_missing,
    check_torch_probe_error,
)
from .rules_gpu import (
    NAMED_ARCHES,
    SUPPORTED_ARCHES,
    ArchList,
    arch_list_fixed,
    check_gpu_arch_list,
    check_gpu_arch_unsupported,
    check_precision_bf16_available,
    parse_arch_list,
)

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

# what callers import from here: every rule and the helpers prebuild, bundle and the tests use
__all__ = [
    "DS_MINOR_MISMATCH_OK", "NAMED_ARCHES", "RULES", "SUPPORTED_ARCHES", "ArchList", "arch_list_fixed",
    "build_home_paths", "build_toolkit", "deepspeed_accepts", "home_for", "home_missing", "judge", "matching_toolkits",
    "parse_arch_list", "recommended_arch_list", "toolkit_at", "usable_home", *(rule.__name__ for rule in RULES),
]


def judge(facts: Facts, nvme_offload: bool = False) -> list[Finding]:
    """Every rule's findings, in a fixed order, most important first."""
    out: list[Finding] = []
    for rule in RULES:
        out.extend(rule(facts, nvme_offload) if rule is check_build_libaio_missing else rule(facts))
    return out

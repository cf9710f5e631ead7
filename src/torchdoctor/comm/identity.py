"""Who this rank is: host, device, versions and communication settings (facts only, no judgement)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

from .._system import kernel_driver_version

ENV_PREFIXES = ("NCCL_",)
ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)


def comm_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def _nccl_version(torch) -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # no NCCL in this build
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _driver_version() -> str | None:
    """The NVIDIA driver version, from the kernel module's file or nvidia-smi (torch does not expose it)."""
    if version := kernel_driver_version():
        return version
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return first[0].strip() if out.returncode == 0 and first else None


def probe(rank: int, local_rank: int, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This process's identity; ``device`` is the CUDA device it will use (local rank modulo count)."""
    import torch

    env = os.environ if env is None else env
    ident: dict[str, Any] = {
        "rank": rank,
        "host": socket.gethostname(),
        "local_rank": local_rank,
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "driver": None,
        "device": "cpu",
        "device_name": None,
        "device_uuid": None,
        "cuda_devices": 0,
        "env": comm_env(env),
    }
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ident["cuda_devices"] = count
    if count:
        index = local_rank % count
        props = torch.cuda.get_device_properties(index)
        ident.update(
            device=f"cuda:{index}",
            device_name=props.name,
            device_uuid=str(getattr(props, "uuid", "")) or None,
            nccl=_nccl_version(torch),
            driver=_driver_version(),
        )
    return ident


def describe(ident: Mapping[str, Any] | None, rank: int) -> str:
    """``rank 1 (host b, local rank 0)``; just ``rank 1`` when it never told us who it is."""
    if not ident:
        return f"rank {rank}"
    return f"rank {rank} (host {ident.get('host')}, local rank {ident.get('local_rank')})"


def device_label(ident: Mapping[str, Any] | None) -> str:
    if not ident:
        return "?"
    if ident.get("device_name"):
        return f"{ident['device']} {ident['device_name']}"
    return str(ident.get("device", "?"))

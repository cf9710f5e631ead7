"""Who this rank is: host, device, versions and communication settings (facts only, no judgement)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

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


def _driver_version(torch) -> str | None:
    try:
        v = int(torch._C._cuda_getDriverVersion())  # CUDA driver API version, e.g. 12040
    except Exception:
        return None
    return f"{v // 1000}.{v % 1000 // 10}" if v else None


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
            driver=_driver_version(torch),
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

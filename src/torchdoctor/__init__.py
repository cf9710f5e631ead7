"""torchdoctor: why a PyTorch training run broke, and how to fix it.

The numerics monitor lives in :mod:`torchdoctor.numerics`; the transformers-compatible surface
(``DebugUnderflowOverflow``, ``detect_overflow``) in :mod:`torchdoctor.compat`. The names below are
imported on first use, so ``import torchdoctor`` (and ``torchdoctor --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "NumericsMonitor": "torchdoctor.numerics.monitor",
    "NonFiniteError": "torchdoctor.numerics.errors",
    "NonFiniteWarning": "torchdoctor.numerics.errors",
    "AbortAfterStep": "torchdoctor.numerics.errors",
    "HeadroomWarning": "torchdoctor.numerics.judge.headroom",
    "detect_overflow": "torchdoctor.numerics.overflow",
    "keep_fp32": "torchdoctor.numerics.fp32",
    "mark": "torchdoctor.numerics.monitor",
    "NumericsCallback": "torchdoctor.integrations.hf",  # needs transformers
    "LightningNumericsCallback": "torchdoctor.integrations.lightning",  # needs lightning (or pytorch_lightning)
}

if TYPE_CHECKING:
    from .integrations.hf import NumericsCallback
    from .integrations.lightning import LightningNumericsCallback
    from .numerics.errors import AbortAfterStep, NonFiniteError, NonFiniteWarning
    from .numerics.fp32 import keep_fp32
    from .numerics.judge.headroom import HeadroomWarning
    from .numerics.monitor import NumericsMonitor, mark
    from .numerics.overflow import detect_overflow


_SUBMODULES = ("cli", "comm", "compat", "deepspeed", "demo", "env", "findings", "logs", "integrations", "numerics",
               "precision", "syncs")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"torchdoctor.{name}")
    raise AttributeError(f"module 'torchdoctor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = ["AbortAfterStep", "HeadroomWarning", "LightningNumericsCallback", "NonFiniteError", "NonFiniteWarning",
           "NumericsCallback", "NumericsMonitor", "__version__", "detect_overflow", "keep_fp32", "mark"]

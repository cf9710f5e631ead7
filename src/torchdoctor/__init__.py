"""torchdoctor: why a PyTorch training run broke, and how to fix it.

The numerics monitor lives in :mod:`torchdoctor.numerics`; the transformers-compatible surface
(``DebugUnderflowOverflow``, ``detect_overflow``) in :mod:`torchdoctor.compat`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .numerics import AbortAfterStep, NonFiniteError, NumericsMonitor, detect_overflow

_LAZY = {"keep_fp32": ("torchdoctor.numerics.fp32", "keep_fp32")}


def __getattr__(name: str):  # keep_fp32 is imported on first use
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'torchdoctor' has no attribute {name!r}")


__all__ = ["AbortAfterStep", "NonFiniteError", "NumericsMonitor", "__version__", "detect_overflow", "keep_fp32"]

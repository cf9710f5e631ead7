"""``detect_overflow(tensor, ctx)``: check an intermediate value with one host read.

transformers' version reads twice (``isnan(var).any().item()`` and ``isinf(var).any().item()``);
here both answers are folded into one integer on the device and read once. Integer, bool, empty and
meta tensors cannot hold inf/nan and are answered without touching the device.
"""

from __future__ import annotations

import torch

from .measure.stats import skip_reason


def overflow_code(var: torch.Tensor) -> int:
    """0 when finite; bit 1 = has nan, bit 2 = has inf. One host sync for floating tensors."""
    if not (var.dtype.is_floating_point or var.dtype.is_complex) or skip_reason(var) is not None:
        return 0
    v = var.detach()
    if v.dtype.is_complex:
        v = torch.view_as_real(v)
    code = torch.isnan(v).any().to(torch.int8) + 2 * torch.isinf(v).any().to(torch.int8)
    return int(code.item())


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print ``"{ctx} has nans"`` / ``"{ctx} has infs"`` and return True if ``var`` holds any.

    Same output and return value as ``transformers.debug_utils.detect_overflow``; one host sync.
    """
    if not isinstance(var, torch.Tensor):
        raise TypeError(f"detect_overflow needs a tensor, got {type(var).__name__}")
    code = overflow_code(var)
    if code & 1:
        print(f"{ctx} has nans")
    if code & 2:
        print(f"{ctx} has infs")
    return bool(code)

"""Byte sizes as people type them: the one reading behind every size flag (``comm --sizes``, ``ds memory --gpu-mem``
and ``--cpu-mem``), so ``80GB`` means the same wherever it is typed.

- ``KB``, ``MB``, ``GB``, ``TB`` are decimal (10^3 ... 10^12 bytes), as disks, network links and nccl-tests' GB/s are;
- ``KiB``, ``MiB``, ``GiB``, ``TiB`` are binary (2^10 ... 2^40), as RAM and ``torch.cuda`` memory are counted;
- a single letter ``K``, ``M``, ``G``, ``T`` is binary too: that is what it has always meant here (``--sizes 64K``,
  ``--gpu-mem 80G``) and what nccl-tests' ``-b 64K`` means;
- ``B`` is bytes; a plain number is in the flag's own unit (bytes for ``--sizes``, GiB for ``--gpu-mem``), as before.

Units are read case-insensitively (``gib``, ``Gb`` and ``GB`` are one unit: nobody sizes memory in bits). The value
is exact (a :class:`~fractions.Fraction`): ``1.5GiB`` is 1610612736 bytes with no float rounding.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["SizeError", "parse_bytes", "UNITS", "GIB", "UNITS_HELP"]

GIB = 1 << 30
UNITS = {
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
UNITS_HELP = "GiB/MiB/KiB (and G/M/K) = 2^30/2^20/2^10 bytes, GB/MB/KB = 10^9/10^6/10^3"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_WHOLE = re.compile(r"\s*([0-9]+)\s*([A-Za-z]*)\s*")


class SizeError(ValueError):
    """A size that cannot be read; the message names it and shows what can be."""


def parse_bytes(text: str, *, plain: int = 1, decimals: bool = True, examples: str = "512, 64K, 80GiB, 80GB") \
        -> Fraction:
    """The number of bytes ``text`` says (see the module docstring), exactly.

    Args:
        text: what the user typed, e.g. ``"80GB"``, ``"80 GiB"``, ``"1.5G"``, ``"512"``.
        plain: bytes per unit of a number without a unit (1: bytes; :data:`GIB`: GiB).
        decimals: whether a fraction (``1.5G``) is allowed; the result may still be a fraction of a byte.
        examples: shown in the error message.

    Raises:
        SizeError: not a number with a known unit (the message names the text).
    """
    m = (_SIZE if decimals else _WHOLE).fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in UNITS):
        raise SizeError(f"{text!r} is not a size (examples: {examples})")
    return Fraction(m.group(1)) * (UNITS[unit] if unit else plain)


def human_bytes(n: int) -> str:
    """``1.5 GiB``, ``64 KiB``, ``12 B``: a byte count for a message (binary units, three significant digits)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"

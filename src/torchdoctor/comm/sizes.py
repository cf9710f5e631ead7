"""Message sizes for ``--sizes``: a list (``1K,1M,64M``) or a geometric range (``1K:64M``, ``8:1G:4``).

Each size is read by :func:`torchdoctor.units.parse_bytes`, as every size flag is: ``64K`` / ``64KiB`` = 64 x 2^10
bytes, ``64KB`` = 64 x 10^3, a plain number is bytes. Whole numbers only (``1.5K`` is refused: a message size is
typed as nccl-tests' ``-b``/``-e`` are).
"""

from __future__ import annotations

from ..units import SizeError as _UnitsError
from ..units import parse_bytes

MAX_BYTES = 1 << 40


class SizeError(ValueError):
    """A malformed ``--sizes`` value (exit code 2)."""


def parse_size(text: str) -> int:
    try:
        value = parse_bytes(text, plain=1, decimals=False, examples="512, 64K, 1M, 2G, 1MB")
    except _UnitsError as e:
        raise SizeError(str(e)) from None
    if not 0 < value <= MAX_BYTES:
        raise SizeError(f"{text!r}: a size must be between 1 byte and 1T")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """Bytes per message, ascending, without duplicates."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise SizeError(f"{text!r}: a range is START:END or START:END:FACTOR")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = 2
        if len(parts) == 3:
            if not parts[2].strip().isdigit() or int(parts[2]) < 2:
                raise SizeError(f"{text!r}: the factor must be an integer of at least 2")
            factor = int(parts[2])
        if hi < lo:
            raise SizeError(f"{text!r}: the range ends below its start")
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= factor
        return sizes
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise SizeError("--sizes is empty")
    return sorted({parse_size(t) for t in items})


def format_bytes(n: int) -> str:
    """``64M``, ``1K``; a size that is not a whole number of units shows decimals (``976.562K``)."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            if n % scale == 0:
                return f"{n // scale}{unit}"
            return f"{n / scale:.3f}".rstrip("0") + unit
    return f"{n}B"

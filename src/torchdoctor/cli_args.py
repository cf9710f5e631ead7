"""Argument types that more than one subcommand reads the same way (one clear line for a mistyped value)."""

from __future__ import annotations

import argparse


def number_list(text: str, what: str, example: str) -> list[int]:
    """Comma-separated whole numbers >= 0, in the order typed (``--trace-steps 1,3``, ``--ranks 0,3``); ``what`` and
    ``example`` word the error (``"step numbers"``, ``"1,3"``)."""
    try:
        numbers = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} like {example}, got {text!r}") from None
    if not numbers or any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected {what} >= 0 like {example}, got {text!r}")
    return numbers

"""A progress line on stderr for a wait that may be long: silence for a hung tool looks like a hung torchdoctor.

Nothing at all for a wait under ``first_s`` (2 s), so a fast ``torchdoctor env`` prints exactly what it printed
before. After that, ``<label>: <what it waits for> (<seconds> s)``: on a terminal one line rewritten in place
(``\\r``) every second and wiped at the end; anywhere else (a pipe, a log file, ``TERM=dumb``) a plain line at most
every ``every_s`` (5 s), so a CI log gets a few lines, not hundreds. Always stderr, never stdout: ``--json`` and
``--markdown`` output stays exactly the document. The line comes from a daemon thread, so a probe blocked in a
system call (a hung NFS mount) is still reported; a failing ``describe`` or stream never breaks the wait.

``comm --local``'s ``_JoinProgress`` prints the same shape from its poll loop; it could use this class.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

FIRST_S = 2.0  # nothing is printed for a wait shorter than this
EVERY_S = 5.0  # between plain lines (not a terminal)
TTY_EVERY_S = 1.0  # between rewrites of the one terminal line
MAX_NAMED = 4  # tools named in one line; the rest are counted


class Progress:
    """``with Progress("torchdoctor env", describe): ...`` -- ``describe()`` says what the block is waiting for."""

    def __init__(self, label: str, describe: Callable[[], str], stream: TextIO | None = None,
                 first_s: float = FIRST_S, every_s: float = EVERY_S, tty_every_s: float = TTY_EVERY_S) -> None:
        self.label, self.describe = label, describe
        self.stream = sys.stderr if stream is None else stream
        self.first_s, self.every_s, self.tty_every_s = first_s, every_s, tty_every_s
        self.lines = 0  # lines (or rewrites) shown so far
        self._tty = _is_terminal(self.stream)
        self._shown = 0  # length of the terminal line now on screen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchdoctor-progress", daemon=True)

    def __enter__(self) -> Progress:
        self.start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        if self._tty and self._shown:
            self._write("\r" + " " * self._shown + "\r")  # leave the terminal as it was

    def _loop(self) -> None:
        wait = self.first_s
        while not self._stop.wait(wait):
            self._show()
            wait = self.tty_every_s if self._tty else self.every_s

    def _show(self) -> None:
        try:
            what = self.describe()
        except Exception:
            what = "working"
        line = f"{self.label}: {what} ({time.monotonic() - self.start:.0f} s)"
        if self._tty:
            width = _columns(self.stream) - 1  # a line that wraps cannot be rewritten with \r
            if len(line) > width:
                line = line[:max(0, width - 3)] + "..."
            self._write("\r" + line + " " * max(0, self._shown - len(line)))
            self._shown = len(line)
        else:
            self._write(line + "\n")
        self.lines += 1

    def _write(self, text: str) -> None:
        with contextlib.suppress(Exception):  # a closed or full stderr must not break the probe
            self.stream.write(text)
            self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


def _columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to (stdout may be a pipe: ``env --json | jq``); 80 if unknown."""
    try:
        cols = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        cols = 0
    return cols if cols > 0 else shutil.get_terminal_size((80, 24)).columns


def waiting_for(running: list[str]) -> str:
    """``probing A; B; C; D; +2 more``: the longest-running first, since the first is likeliest to be stuck."""
    if not running:
        return "probing"
    named = "; ".join(running[:MAX_NAMED])
    more = len(running) - MAX_NAMED
    return f"probing {named}" + (f"; +{more} more" if more > 0 else "")


def probing(label: str, stream: TextIO | None = None) -> Progress:
    """The progress of :func:`torchdoctor.env.probe.collect` (run inside the block): which tools it waits for."""
    from .tools import running

    return Progress(label, lambda: waiting_for(running()), stream)

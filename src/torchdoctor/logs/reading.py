"""Reading a log's bytes into text for the scanner: the encoding sniffed once, lines carried across pieces, and the
wrap width decided once from the stream's first 64 KiB (held until then, so any chunking reads the same).

:class:`Reader` is a mixin of :class:`~torchdoctor.logs.analyze.Analyzer`; it hands whole text to the scanner's
``_scan_text`` (:mod:`.scan`).
"""

from __future__ import annotations

import codecs
from typing import Any

from .common import MAX_LINE
from .lines import WRAP_SAMPLE, wrap_width

SNIFF_BYTES = 4096   # bytes read before the encoding is chosen
_UNDECIDED = object()  # the wrap width before the stream's first WRAP_SAMPLE characters are in


def decoder_for(head: bytes) -> tuple[str, Any]:
    """The encoding and an incremental decoder for a log that starts with ``head`` (see ``Scanner.feed_bytes``)."""
    enc = "utf-8"
    if head.startswith(codecs.BOM_UTF8):
        enc = "utf-8-sig"
    elif head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        enc = "utf-16"  # the BOM says which end
    elif len(head) >= 4:
        even, odd = head[0::2], head[1::2]
        if odd.count(0) > 0.4 * len(odd) and even.count(0) < 0.1 * len(even):
            enc = "utf-16-le"
        elif even.count(0) > 0.4 * len(even) and odd.count(0) < 0.1 * len(odd):
            enc = "utf-16-be"
        else:
            try:
                head.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.start < len(head) - 3:  # not just a character cut at the end of the sniffed bytes
                    enc = "latin-1"
    return enc, codecs.getincrementaldecoder(enc)(errors="replace")


class Reader:
    """The input side of the analyzer: ``feed_line`` / ``feed_bytes`` / ``feed_block``, then ``_flush_input``."""

    def _init_reader(self) -> None:
        self._midline = False      # text was read since the last newline (a line not counted yet)
        self._carry = ""
        self._decoder: Any = None  # chosen from the first bytes (see feed_bytes)
        self._sniff_buf = b""
        self.encoding: str | None = None
        # hard wraps (lines.dewrap): the width is decided once, from the stream's first WRAP_SAMPLE characters (held
        # until then, so any chunking reads the same); a command's pipe is never wrapped by a terminal
        self._wrap: int | None | object = None if getattr(self, "_wraps", None) is False else _UNDECIDED
        self._held: list[str] = []
        self._held_n = 0
        self._wrap_carry = ""      # a last line of exactly the width: its rest may be the next piece's first line

    # ----------------------------------------------------------------------------------------------- input
    def feed_line(self, line: str) -> None:
        """One line of output, with or without its trailing newline. Never raises."""
        try:
            if not isinstance(line, str):
                line = bytes(line).decode("utf-8", "replace") if isinstance(line, (bytes, bytearray)) else str(line)
            self._feed_text(line if line.endswith("\n") else line + "\n")
        except Exception:  # noqa: BLE001 -- a log line must never stop the run it watches
            self._internal_errors += 1

    def feed_bytes(self, data: bytes) -> None:
        """Raw bytes as they come (any split). Never raises.

        The encoding is chosen once, from the first ``SNIFF_BYTES`` (held back until that many arrived): a UTF-8 /
        UTF-16 BOM; UTF-16LE/BE without one (PowerShell's ``>`` writes UTF-16LE; every other byte of ASCII text is
        NUL); else UTF-8, unless those bytes are not valid UTF-8 (Latin-1 then). Undecodable bytes become U+FFFD.
        """
        try:
            if self._decoder is None:
                self._sniff_buf += bytes(data)
                if len(self._sniff_buf) < SNIFF_BYTES:
                    return
                data, self._sniff_buf = self._sniff_buf, b""
                self.encoding, self._decoder = decoder_for(data)
            self._feed_text(self._decoder.decode(bytes(data)))
        except Exception:  # noqa: BLE001
            self._internal_errors += 1

    def feed_block(self, data: str | bytes, *, partial: bool = False) -> None:
        """Many whole lines at once (``torchdoctor run`` feeds each read of a pipe this way). Never raises.

        ``data`` ends with a newline (one is assumed when it does not, as ``feed_line`` does); bytes are decoded as
        UTF-8 with replacement (split them at a newline: a character cut in two becomes U+FFFD). ``partial=True``
        marks a piece of an overlong line that goes on in the next call: it is read and no line is counted. The
        block goes straight to the chunk scanner of :func:`analyze_stream` -- same results as ``feed_line`` for
        each of its lines, several times faster -- and is independent of ``feed_bytes``' pending partial line,
        so several streams (stdout and stderr) can each be cut into whole lines and fed in any interleaving.
        """
        try:
            text = str(data, "utf-8", "replace") if isinstance(data, (bytes, bytearray, memoryview)) else str(data)
            if not text:
                return
            if self._wrap is _UNDECIDED:  # blocks are a pipe's (torchdoctor run): no terminal cut them
                self._decide_wrap()
            if not partial and text[-1] != "\n":
                text += "\n"
            self._scan(text, len(text))
        except Exception:  # noqa: BLE001 -- a log line must never stop the run it watches
            self._internal_errors += 1

    def _flush_input(self) -> None:
        """The end of the input: a last line without a newline, a message head that never got its continuation."""
        try:
            if self._decoder is None:
                data, self._sniff_buf = self._sniff_buf, b""
                self.encoding, self._decoder = decoder_for(data)
                text = self._decoder.decode(data, final=True)
            else:
                text = self._decoder.decode(b"", final=True)
            self._feed_text(text, final=True)
        except Exception:  # noqa: BLE001
            self._internal_errors += 1
        self._tb_expire(1 << 62)  # tracebacks still open: cut before their exception line
        if self._join is not None:
            _, handler, seg, lineno, head = self._join
            self._join = None
            try:
                handler(head, seg, lineno)
            except Exception:  # noqa: BLE001
                self._internal_errors += 1

    # ------------------------------------------------------------------------------------------- scanning
    def _feed_text(self, text: str, final: bool = False) -> None:
        buf = self._carry + text if self._carry else text
        end = len(buf) if final else buf.rfind("\n") + 1
        if end:
            self._scan(buf, end)
        self._carry = buf[end:]
        if len(self._carry) > MAX_LINE:  # no newline for a long time (a progress bar redrawn with \r only)
            cut = self._carry.rfind("\r") + 1 or len(self._carry)
            self._scan(self._carry, cut)
            self._carry = self._carry[cut:]
        if final:  # the text held for the wrap width, and a last line of exactly that width
            if self._wrap is _UNDECIDED:
                self._decide_wrap()
            if self._wrap_carry:
                carry, self._wrap_carry = self._wrap_carry, ""
                self._scan_text(carry)
        if final and self._midline:  # the last line had no newline: it counts too
            self._lines += 1
            self._midline = False

    def _scan(self, buf: str, end: int) -> None:
        """Handle buf[:end] (whole lines, or a piece of an overlong one), once the wrap width is decided."""
        if not end:
            return
        text = buf[:end] if end < len(buf) else buf
        if self._wrap is _UNDECIDED:
            self._held.append(text)
            self._held_n += len(text)
            if self._held_n >= WRAP_SAMPLE:
                self._decide_wrap()
            return
        if self._wrap is None:
            self._scan_text(text)
            return
        if self._wrap_carry:
            text = self._wrap_carry + text
            self._wrap_carry = ""
        cut = text.rfind("\n", 0, len(text) - 1) + 1  # the start of the last line (it ends the piece)
        last = text[cut:].rstrip("\n")
        if last and len(last) % self._wrap == 0 and text.endswith("\n"):
            self._wrap_carry, text = text[cut:], text[:cut]
        self._scan_text(text)

    def _decide_wrap(self) -> None:
        """The stream's wrap width, from its first WRAP_SAMPLE characters; then the text held until now is read."""
        held = "".join(self._held)
        self._held, self._held_n = [], 0
        self._wrap = wrap_width(held[:WRAP_SAMPLE])
        if held:
            self._scan(held, len(held))

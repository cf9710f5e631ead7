"""The output side of ``torchdoctor run``: the child's stdout and stderr, read, passed on, and analysed.

* Each read of a pipe passes through unchanged (byte for byte, chunk by chunk as it arrives, so a ``\\r``
  progress bar is not held back) to our stdout or stderr, and is appended to the ``--log`` file if asked.
* The same bytes are fed to the log :class:`~torchdoctor.logs.analyze.Analyzer` in blocks of whole lines, each
  stream cut on its own (``Analyzer.feed_block``: as fast as ``torchdoctor logs``) and decoded on its own
  (:class:`StreamText`): a tool may write UTF-16 to one and UTF-8 to the other.
* When the reader of our stdout (or stderr) goes away (``torchdoctor run ... | head``), that pipe of the command
  is closed, so its next write there fails (SIGPIPE, or EPIPE) just as in a plain shell pipeline -- the command is
  not kept running with nobody reading its output.

The analyzer sits behind a guard (:class:`Analysis`): a bug in it must never disturb the command it watches.
"""

from __future__ import annotations

import os
import select
import selectors
import time
from typing import Any

from ..findings import Finding
from ..logs.reading import SNIFF_BYTES, decoder_for

_READ_CHUNK = 65536  # a pipe's default capacity: one read takes what it holds
_MAX_PARTIAL_LINE = 1 << 20  # a "line" longer than this is fed to the analyzer in pieces


def _write_all(fd: int, data: bytes) -> bool:
    """Write everything; False when the reader is gone (EPIPE) so the caller stops writing there."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # an inherited non-blocking stdout
            select.select([], [fd], [], 1.0)
            continue
        except (BrokenPipeError, OSError):
            return False
        view = view[n:]
    return True


class _Lines:
    """Cuts one stream into blocks of whole ``\\n`` lines for the analyzer (which reads ``\\r`` segments itself):
    each read of the pipe becomes one block (the lines it completes), the unfinished last line waits for the next
    read. A line longer than ``_MAX_PARTIAL_LINE`` is handed on in pieces, cut after a ``\\r`` where there is one.
    Bytes by default; ``text=True`` cuts decoded text (a UTF-16 stream: its newline is two bytes, and a ``0x0A``
    byte may be half of another character)."""

    def __init__(self, text: bool = False) -> None:
        self.nl, self.cr, self.empty = ("\n", "\r", "") if text else (b"\n", b"\r", b"")
        self.parts: list[Any] = []  # the unfinished line, as read (joined only when it ends: no quadratic copies)
        self.size = 0

    def feed(self, data: Any) -> list[tuple[Any, bool]]:
        """``(block, partial)`` pairs for :meth:`Analyzer.feed_block`."""
        out: list[tuple[Any, bool]] = []
        cut = data.rfind(self.nl) + 1
        if cut:
            block = self.empty.join((*self.parts, data[:cut])) if self.parts else data[:cut]
            self.parts, self.size = [], 0
            out.append((block, False))
            data = data[cut:]
        if data:
            self.parts.append(data)
            self.size += len(data)
            if self.size > _MAX_PARTIAL_LINE:
                rest = self.empty.join(self.parts)
                r = rest.rfind(self.cr) + 1 or len(rest)
                out.append((rest[:r], True))
                self.parts, self.size = ([rest[r:]], len(rest) - r) if r < len(rest) else ([], 0)
        return out

    def flush(self) -> list[tuple[Any, bool]]:
        rest = self.empty.join(self.parts)
        self.parts, self.size = [], 0
        return [(rest, False)] if rest else []


def decode_lines(block: bytes) -> str:
    """Whole lines of bytes as text: UTF-8, and a line that is not valid UTF-8 as Latin-1.

    Latin-1 maps every byte to one character, so an old tool's ``d\\xe9j\\xe0`` or a binary blob costs nothing but
    the looks of that one line: its digits and words reach the analyzer as written (``'replace'`` would do for
    the digits too, but it would drop the bytes the line was made of), and the lines around it stay UTF-8."""
    try:
        return str(block, "utf-8")  # nearly always: one C call for the whole block
    except UnicodeDecodeError as e:
        bad = e.start
    view, out, at = memoryview(block), [], 0
    while True:
        start = block.rfind(b"\n", at, bad) + 1 or at  # the line holding the first bad byte
        end = block.find(b"\n", bad) + 1 or len(block)
        out.append(str(view[at:start], "utf-8"))
        out.append(str(view[start:end], "latin-1"))
        at = end
        if at >= len(block):
            return "".join(out)
        try:
            out.append(str(view[at:], "utf-8"))
            return "".join(out)
        except UnicodeDecodeError as e:
            bad = at + e.start


class StreamText:
    """One output stream of the command as decoded blocks of lines for the analyzer (the pass-through is raw).

    The encoding is sniffed from the stream's first ``SNIFF_BYTES`` (or all of it, when it ends sooner) by the same
    test ``torchdoctor logs`` applies to a file (``reading.decoder_for``); until then the analyzer waits, the terminal
    and the log do not. A UTF-16 stream (a UTF-16 BOM, or the NUL-every-other-byte shape of UTF-16LE/BE text: a
    Windows-built tool, ``iconv -t UTF-16``) is decoded incrementally and cut into lines as text. Anything else is
    cut into lines as bytes and decoded by :func:`decode_lines` -- per line, not once for the stream as ``logs``
    does for a file: a pipe mixes what several programs print, and one bad byte must not cost the rest."""

    def __init__(self) -> None:
        self.head = b""
        self.encoding: str | None = None
        self._decoder: Any = None  # incremental, for UTF-16 only
        self._lines = _Lines()

    def feed(self, data: bytes) -> list[tuple[str, bool]]:
        if self.encoding is None:
            self.head += data
            if len(self.head) < SNIFF_BYTES and not self.head.startswith((b"\xff\xfe", b"\xfe\xff")):
                return []
            data = self._choose()
        return self._blocks(data)

    def flush(self) -> list[tuple[str, bool]]:
        out = self._blocks(self._choose()) if self.encoding is None else []
        if self._decoder is not None:
            out += self._lines.feed(self._text(self._decoder.decode(b"", final=True)))
            return out + self._lines.flush()
        return out + [(decode_lines(b), p) for b, p in self._lines.flush()]

    def _choose(self) -> bytes:
        data, self.head = self.head, b""
        enc, decoder = decoder_for(data)
        if enc.startswith("utf-16"):
            self.encoding, self._decoder, self._lines = enc, decoder, _Lines(text=True)
        else:  # utf-8, utf-8-sig, or latin-1 (which decode_lines gives line by line)
            self.encoding = "utf-8"
            if data.startswith(b"\xef\xbb\xbf"):
                data = data[3:]
        return data

    def _blocks(self, data: bytes) -> list[tuple[str, bool]]:
        if self._decoder is not None:
            return self._lines.feed(self._text(self._decoder.decode(data)))
        return [(decode_lines(b), p) for b, p in self._lines.feed(data)]

    @staticmethod
    def _text(text: str) -> str:
        # Python's "utf-16" codec writes a BOM at every encode(): a tool that encodes line by line repeats it
        return text.replace("\ufeff", "") if "\ufeff" in text else text


class Analysis:
    """The log analyzer behind a guard: a bug in it must never disturb the command it watches."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.analyzer: Any = None
        from .numerics_verdict import OutputScan

        self.numerics = OutputScan()  # the numerics monitor's Detected lines (guarded on its own)
        try:
            from ..logs.analyze import Analyzer

            self.analyzer = Analyzer(source="command")
        except Exception as e:  # noqa: BLE001 -- reported as a finding, the run goes on
            self.error = f"cannot start the log analyzer: {type(e).__name__}: {e}"

    def feed(self, blocks: list[tuple[Any, bool]]) -> None:
        for block, _ in blocks:
            self.numerics.feed(block)
        if self.analyzer is None:
            return
        try:
            for block, partial in blocks:
                self.analyzer.feed_block(block, partial=partial)
        except Exception as e:  # noqa: BLE001
            self.error = f"the log analyzer failed on a line: {type(e).__name__}: {e}"
            self.analyzer = None

    def _at_end(self, call: Any, default: Any) -> Any:
        if self.analyzer is not None:
            try:
                return call()
            except Exception as e:  # noqa: BLE001
                self.error = f"the log analyzer failed at the end: {type(e).__name__}: {e}"
        return default

    def kills(self) -> list[dict]:
        return self._at_end(lambda: self.analyzer.kills(), [])

    def set_run_evidence(self, **kw: Any) -> None:
        self._at_end(lambda: self.analyzer.set_run_evidence(**kw), None)

    def set_exit(self, code: int) -> None:
        self._at_end(lambda: self.analyzer.set_exit(code), None)

    def last_lines(self) -> list[str]:
        if self.analyzer is not None:
            try:
                return self.analyzer.last_lines()
            except Exception:  # noqa: BLE001 -- only evidence
                pass
        return []

    def finish(self) -> tuple[list[Finding], list[dict]]:
        report = self._at_end(lambda: self.analyzer.finish(), None)
        return (list(report.findings), list(report.timeline)) if report is not None else ([], [])


class Pump:
    """Moves the command's output from its pipes to our fds, the ``--log`` file and the analysis.

    Args:
        streams: ``(pipe, dest_fd, name)`` per output of the command (``dest_fd`` None: not passed on).
        log_file: an open binary file that gets every byte, in arrival order, flushed at once; None for none.
        start: the run's start (``time.monotonic()``), for ``reader_gone``'s time.
    """

    def __init__(self, streams: list[tuple[Any, int | None, str]], log_file: Any, analysis: Analysis,
                 start: float) -> None:
        self.analysis, self.log_file, self.start = analysis, log_file, start
        self.sel = selectors.DefaultSelector()
        self.outputs: dict[int, tuple[int | None, StreamText, Any, str]] = {}
        for pipe, dest, name in streams:
            self.outputs[pipe.fileno()] = (dest, StreamText(), pipe, name)
            self.sel.register(pipe.fileno(), selectors.EVENT_READ)
        self.last_data: float | None = None  # when the last bytes were read
        self.reader_gone: tuple[str, float] | None = None  # ("stdout"/"stderr", seconds): our reader went away
        self.log_bytes = 0
        self.log_error: str | None = None  # why the log stopped being written (a full disk)

    @property
    def open(self) -> bool:
        """Some output of the command may still come."""
        return bool(self.outputs)

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for output and move what came."""
        for key, _ in self.sel.select(timeout):
            fd = key.fd
            try:
                data = os.read(fd, _READ_CHUNK)
            except OSError:
                data = b""
            dest, text, pipe, name = self.outputs[fd]
            if not data:
                self._close(fd)
                continue
            self.last_data = time.monotonic()
            gone = dest is not None and not _write_all(dest, data)
            self._log(data)
            self.analysis.feed(text.feed(data))
            if gone:
                # Our reader went away (`torchdoctor run ... | head`): close this pipe, so the command's next
                # write to it fails (SIGPIPE, or EPIPE where it ignores SIGPIPE) as it would with no
                # torchdoctor in between -- rather than running on with nobody reading its output.
                self._close(fd)
                pipe.close()
                if self.reader_gone is None:
                    self.reader_gone = (name, self.last_data - self.start)

    def close(self) -> None:
        """Stop reading (the command is gone): what is left of each stream's last line goes to the analysis."""
        for fd in list(self.outputs):
            self._close(fd)
        self.sel.close()

    def _close(self, fd: int) -> None:
        self.analysis.feed(self.outputs.pop(fd)[1].flush())
        self.sel.unregister(fd)

    def _log(self, data: bytes) -> None:
        if self.log_file is None:
            return
        try:
            self.log_file.write(data)
            self.log_file.flush()
        except OSError as e:  # a full disk: the run goes on, the log stops, the user is told
            self.log_error = f"{e.strerror or e} (the log stops after {self.log_bytes:,} bytes)"
            self.log_file = None
        else:
            self.log_bytes += len(data)

"""The training-log analyzer: feed it a log (whole, or line by line as a run prints it), get findings.

Example usage::

    from torchdoctor.logs.analyze import Analyzer, analyze_stream

    with open("train.log", "rb") as f:
        report = analyze_stream(f)              # constant memory, any size
    a = Analyzer(source="command")
    for block in blocks_of_whole_lines:          # a live run (``torchdoctor run``): whole lines, any number
        a.feed_block(block)
    report = a.finish()
    print(report.findings, report.timeline, report.to_json())

The parts: :mod:`.patterns` (what a line looks like), :mod:`.scan` (reading, decoding, progress, messages over
lines), :mod:`.handlers` and :mod:`.handlers_crash` (a matched line becomes facts), :mod:`.scale_trajectory` (the
fp16 loss scale and its verdict), :mod:`.judge`, :mod:`.judge_process` and :mod:`.judge_crash` (the other verdicts:
a traceback, a segfault or a CUDA runtime error is never "clean"); this module puts them together. What it recognises
is in :mod:`.patterns` (DeepSpeed fp16 loss scaling, non-finite losses in Trainer dicts and
progress bars, NCCL timeouts and errors, CUDA and host out-of-memory, killed ranks and launcher exit codes,
CUDA/compiler build failures, DeepSpeed config assertions). All state is bounded: the timeline keeps its first and
last ``TIMELINE_HEAD``/``TIMELINE_TAIL`` events (the rest are counted), the loss-scale history its first and last
runs, every list of details a few dozen entries; counters are plain integers. ``feed_line`` / ``feed_block`` /
``feed_bytes`` never raise: a log can hold anything, and a doctor that crashes on a strange byte loses the evidence.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterable
from typing import Any, BinaryIO

from ..findings import Finding
from .common import (  # noqa: F401 -- re-exported: the bounds and the report are part of this module's API
    CHUNK_BYTES,
    MAX_DETAILS,
    MAX_KEYS,
    MAX_LINE,
    SCALE_RUNS_HEAD,
    SCALE_RUNS_TAIL,
    TEXT_MAX,
    TIMELINE_HEAD,
    TIMELINE_TAIL,
    LogReport,
    signal_name,
)
from .handlers import Handlers
from .judge import Judges
from .scan import Scanner


class Analyzer(Scanner, Handlers, Judges):
    """Streaming log analyzer: ``feed_line`` / ``feed_bytes`` / ``feed_block`` as the log arrives, then ``finish()``.

    ``source`` words the findings for where the text came from: ``"log"`` (a file or stdin) or ``"command"`` (the
    output of a command run by ``torchdoctor run``). ``wraps=False`` reads every line as it is; by default a log's
    hard wraps are found from its first 64 KiB and joined (never for a command's output, which no terminal cut).
    """

    def __init__(self, *, source: str = "log", wraps: bool | None = None) -> None:
        self._source = source
        # hard-wrapped lines (a terminal's cut kept in a paste): None finds out from the text, False never joins (a
        # command's pipe, `torchdoctor run`: no terminal cuts it)
        self._wraps = False if source == "command" else wraps
        self._run: dict[str, Any] | None = None  # what `torchdoctor run` saw itself (set_run_evidence)
        self._damage: tuple[str, str] | None = None  # the input ended early or damaged (input_damaged)
        self._init_scan()
        self._init_handlers()

    def kills(self) -> list[dict]:
        """The processes the log says were killed by a signal so far (``signum``, ``pid``, ``rank``, ``line``, ...)."""
        return [dict(x) for x in self._exits if x["signum"] is not None]

    def set_run_evidence(self, *, oom_killer: bool | None, memory_low: bool | None, evidence: list[str],
                         exit_code: int | None = None, host: str | None = None) -> None:
        """What ``torchdoctor run`` saw itself, for the ``process.killed`` finding of a SIGKILL in the log.

        Args:
            oom_killer: True: the kernel log names one of the command's processes in an OOM-killer line, or the
                cgroup's oom_kill counter rose; False: the kernel log was read and has no such line and memory
                never ran low; None: cannot tell.
            memory_low: whether MemAvailable (or the tree's RSS against its cgroup limit) came near exhaustion in
                the wrapper's samples; None: not sampled.
            evidence: the lines that say so (shown under the finding).
            exit_code: the command's own exit status (a SIGKILLed child of a command that then exits 0 is a
                warning, not a failure).
            host: the machine the evidence is about; a kill the log places on another host is not judged by it.
        """
        self._run = {"oom_killer": oom_killer, "memory_low": memory_low, "evidence": list(evidence),
                     "exit_code": exit_code, "host": host}

    def input_damaged(self, kind: str, why: str) -> None:
        """The input stopped before its end: ``kind`` ``"truncated"`` (a gzip file cut short) or ``"corrupt"`` (its
        data damaged), ``why`` in words. :meth:`finish` adds a warning that says so, with the lines read before."""
        self._damage = (kind, why)

    def _damage_finding(self) -> Finding:
        kind, why = self._damage  # type: ignore[misc]
        lines = f"{self._lines:,} line{'' if self._lines == 1 else 's'}"
        copy = ("check a copy with `gzip -t FILE` and copy the log again from where the job wrote it, if it is "
                "still there")
        if kind == "truncated":
            return Finding("logs.gzip-truncated", "warn",
                           f"the log ends early: its gzip data stops after {lines}; the findings are from those lines",
                           [why, "a gzip file cut short: copied while the job was still writing it, or a copy that "
                            "did not finish; what came after is not in the file"], [copy],
                           {"lines": self._lines, "why": why})
        return Finding("logs.gzip-corrupt", "warn",
                       f"the log's gzip data is damaged after {lines}; the findings are from those lines",
                       [why, "what comes after the damage is not read"], [copy], {"lines": self._lines, "why": why})

    def finish(self) -> LogReport:
        """Flush what is pending (a last line without a newline) and judge. Safe to call more than once."""
        self._flush_input()
        try:
            findings = self._judge()
        except Exception as e:  # noqa: BLE001 -- report the analyzer's own failure rather than nothing
            findings = [Finding("logs.analyzer-error", "warn", f"the log analyzer failed: {type(e).__name__}: {e}",
                                fix=["report this at the torchdoctor issue tracker with the log"])]
        if self._damage is not None:
            findings.insert(0, self._damage_finding())
        return LogReport(findings=findings, timeline=self._timeline.items(), lines=self._lines,
                         timeline_dropped=self._timeline.dropped, event_counts=dict(self._counts))


def analyze_stream(stream: BinaryIO, chunk_size: int = CHUNK_BYTES, *, wraps: bool | None = None) -> LogReport:
    """Analyse a binary stream (file, gzip file, stdin.buffer) in constant memory; text streams work too.

    A gzip stream that ends early or is damaged part-way (:class:`Gunzip`, or ``gzip.open``'s ``EOFError`` /
    ``BadGzipFile`` / ``zlib.error``) is analysed up to there, with a warning finding that says so
    (``logs.gzip-truncated``, ``logs.gzip-corrupt``) and how many lines were read. Whatever the bytes, it never raises
    for them: whether they are a text log at all is :func:`open_stream`'s question."""
    import gzip

    a = Analyzer(wraps=wraps)
    while True:
        try:
            chunk = stream.read(chunk_size)
        except EOFError as e:  # gzip.GzipFile at a file cut short
            a.input_damaged("truncated", f"the file ends inside its gzip data ({e})")
            break
        except (gzip.BadGzipFile, zlib.error) as e:
            a.input_damaged("corrupt", f"the gzip data is damaged: {e}")
            break
        if not chunk:
            gz = _gunzip_of(stream)
            if gz is not None and gz.problem is not None:
                a.input_damaged(*gz.problem)
            break
        if isinstance(chunk, str):
            try:
                a._feed_text(chunk)
            except Exception:  # noqa: BLE001
                a._internal_errors += 1
        else:
            a.feed_bytes(chunk)
    return a.finish()


def _gunzip_of(stream: Any) -> Gunzip | None:
    for _ in range(3):  # open_log's buffer, open_stream's head before it
        if isinstance(stream, Gunzip):
            return stream
        stream = getattr(stream, "raw", None)
    return None


def analyze_lines(lines: Iterable[str]) -> LogReport:
    """Analyse an iterable of text lines (tests, small logs)."""
    a = Analyzer()
    for line in lines:
        a.feed_line(line)
    return a.finish()


GZIP_MAGIC = b"\x1f\x8b"
_GZ_IN = 1 << 16  # compressed bytes read at a time


class UnreadableGzip(OSError):
    """A gzip stream that gives no text at all: a damaged header, or a file cut inside it. ``strerror`` says which."""


def _zlib_why(e: zlib.error) -> str:
    msg = str(e).split(": ", 1)[-1]  # "Error -3 while decompressing data: incorrect data check"
    return {"incorrect data check": "its CRC check failed (incorrect data check)",
            "incorrect length check": "its length check failed (incorrect length check)"}.get(msg, msg)


class Gunzip(io.RawIOBase):
    """A gzip stream (one member or several, NUL padding between them skipped as ``gzip -d`` does), decompressed
    as it is read, that gives every byte it can before damage instead of raising, as ``zcat`` prints what it can.

    ``gzip.GzipFile`` raises ``EOFError`` at the end of a file cut short (a half-copied log of a crashed job is
    exactly that) and ``BadGzipFile`` / ``zlib.error`` at a damaged block, so a reader of it gets nothing. Here the
    read ends there instead and :attr:`problem` says why: ``("truncated", why)`` or ``("corrupt", why)`` (a CRC or
    length check that fails, invalid compressed data, bytes after the gzip data that are not gzip); None when the
    stream was whole. A stream that fails before its first byte of text raises :class:`UnreadableGzip` (there is
    nothing to analyse). Memory stays bounded: each read gives at most what was asked for (a gzip bomb streams).
    When zlib refuses a chunk, the chunk is fed again a byte at a time from a copy of the state before it, so the
    text before the damage is kept to within one byte of input.
    """

    def __init__(self, source: Any, *, close_source: bool = False) -> None:
        super().__init__()
        self._src, self._close_source = source, close_source
        self._d = zlib.decompressobj(31)  # 16 + 15: a gzip header and trailer, the CRC and length checked
        self._in: Any = memoryview(b"")
        self._pos = 0
        self._src_done = False
        self._started = False   # bytes of the current member were given to zlib
        self._careful = False   # feeding a byte at a time (a chunk zlib refused)
        self._members = 0
        self._member_out = 0
        self._done = False
        self.produced = 0
        self.problem: tuple[str, str] | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._done:
            out = self._step(len(b))
            if out:
                n = len(out)
                b[:n] = out
                self.produced += n
                return n
        if self.produced == 0 and self.problem is not None:
            raise UnreadableGzip(0, self.problem[1])
        return 0

    def _end(self, kind: str, why: str) -> bytes:
        self.problem, self._done = (kind, why), True
        return b""

    def _step(self, n: int) -> bytes:
        if self._pos >= len(self._in) and not self._src_done:
            data = self._src.read(_GZ_IN) or b""
            self._in, self._pos, self._careful = memoryview(bytes(data)), 0, False
            self._src_done = not data
        if not self._started:
            if self._members:  # NUL padding after a member (tape blocks), as gzip -d skips it
                while self._pos < len(self._in) and self._in[self._pos] == 0:
                    self._pos += 1
            if self._pos >= len(self._in):
                self._done = self._src_done
                return b""
            self._started, self._member_out = True, 0
        piece = self._in[self._pos: self._pos + 1] if self._careful else self._in[self._pos:]
        saved = None if self._careful else self._d.copy()
        try:
            out = self._d.decompress(piece, n)
        except zlib.error as e:
            if saved is not None and len(piece) > 1:  # again from before this chunk, a byte at a time
                self._d, self._careful = saved, True
                return b""
            if self._members and self._member_out == 0:
                return self._end("corrupt", "the bytes after its gzip data are not gzip (" + _zlib_why(e) + "); "
                                 "they were ignored, as gzip -d does")
            return self._end("corrupt", "the gzip data is damaged: " + _zlib_why(e))
        # at the member's end the rest of the input is in unused_data (unconsumed_tail may still hold it too)
        self._pos += len(piece) - len(self._d.unused_data if self._d.eof else self._d.unconsumed_tail)
        self._member_out += len(out)
        if self._d.eof:
            self._members += 1
            self._started = False
            self._d = zlib.decompressobj(31)
        elif not out and self._src_done and self._pos >= len(self._in):
            return self._end("truncated", "the file ends inside its gzip data (before the end-of-stream marker)"
                             + ("" if self.produced else ", before any text"))
        return out

    def close(self) -> None:
        if not self.closed and self._close_source:
            self._src.close()
        super().close()


def open_log(path: str) -> BinaryIO:
    """Open a log for :func:`analyze_stream`: plain or gzip (by content, not by name; see :class:`Gunzip`)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == GZIP_MAGIC:
        return io.BufferedReader(Gunzip(open(path, "rb"), close_source=True))  # noqa: SIM115 -- to the caller
    return open(path, "rb")  # noqa: SIM115 -- returned to the caller


class _Prepended(io.RawIOBase):
    """``head`` (bytes already read) followed by the rest of ``stream``: a pipe cannot be rewound after sniffing."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        super().__init__()
        self._head, self._stream = head, stream
        self.raw = stream  # a Gunzip under it still reports where its data ended (analyze_stream)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        read1 = getattr(self._stream, "read1", None)  # what has arrived, without waiting for a full buffer
        data = read1(len(b)) if read1 is not None else self._stream.read(len(b))
        n = len(data)
        b[:n] = data
        return n


def open_stream(stream: BinaryIO) -> BinaryIO:
    """A binary stream (``sys.stdin.buffer``, a pipe, a file) for :func:`analyze_stream`, gunzipped when it starts
    with the gzip magic (``gzip -c train.log | torchdoctor logs -``). Sniffs by reading the first bytes, so it works on
    pipes (which cannot seek back); nothing is lost. A damaged or cut gzip stream gives what it holds
    (:class:`Gunzip`).

    Raises :class:`.content.NotText` (an ``OSError``) when the first bytes (after gzip) are no text log: a
    checkpoint, a pickle, safetensors, an archive, random bytes (:func:`.content.not_text` says which)."""
    head = stream.read(2) or b""
    if isinstance(head, str):  # a text stream: no gzip to find there
        return stream
    if len(head) == 1:  # a short read (a raw pipe): one more try for the second byte
        head += stream.read(1) or b""
    rest: Any = _Prepended(bytes(head), stream)
    gz = head == GZIP_MAGIC
    if gz:
        rest = Gunzip(rest)
    from .content import SNIFF, NotText, not_text

    sniff = b""
    while len(sniff) < SNIFF:  # what the analyzer holds back anyway before its first line (the wrap sample)
        piece = rest.read(SNIFF - len(sniff))
        if not piece:
            break
        sniff += piece
    why = not_text(sniff, gzipped=gz)
    if why is not None:
        raise NotText(why)
    return _Prepended(sniff, rest)  # type: ignore[return-value]

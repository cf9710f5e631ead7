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
    output of a command run by ``torchdoctor run``).
    """

    def __init__(self, *, source: str = "log") -> None:
        self._source = source
        self._run: dict[str, Any] | None = None  # what `torchdoctor run` saw itself (set_run_evidence)
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

    def finish(self) -> LogReport:
        """Flush what is pending (a last line without a newline) and judge. Safe to call more than once."""
        self._flush_input()
        try:
            findings = self._judge()
        except Exception as e:  # noqa: BLE001 -- report the analyzer's own failure rather than nothing
            findings = [Finding("logs.analyzer-error", "warn", f"the log analyzer failed: {type(e).__name__}: {e}",
                                fix=["report this at the torchdoctor issue tracker with the log"])]
        return LogReport(findings=findings, timeline=self._timeline.items(), lines=self._lines,
                         timeline_dropped=self._timeline.dropped, event_counts=dict(self._counts))


def analyze_stream(stream: BinaryIO, chunk_size: int = CHUNK_BYTES) -> LogReport:
    """Analyse a binary stream (file, gzip file, stdin.buffer) in constant memory; text streams work too."""
    a = Analyzer()
    while True:
        chunk = stream.read(chunk_size)
        if not chunk:
            break
        if isinstance(chunk, str):
            try:
                a._feed_text(chunk)
            except Exception:  # noqa: BLE001
                a._internal_errors += 1
        else:
            a.feed_bytes(chunk)
    return a.finish()


def analyze_lines(lines: Iterable[str]) -> LogReport:
    """Analyse an iterable of text lines (tests, small logs)."""
    a = Analyzer()
    for line in lines:
        a.feed_line(line)
    return a.finish()


GZIP_MAGIC = b"\x1f\x8b"


def open_log(path: str) -> BinaryIO:
    """Open a log for :func:`analyze_stream`: plain or gzip (by content, not by name)."""
    import gzip

    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == GZIP_MAGIC:
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")  # noqa: SIM115 -- returned to the caller


class _Prepended(io.RawIOBase):
    """``head`` (bytes already read) followed by the rest of ``stream``: a pipe cannot be rewound after sniffing."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        super().__init__()
        self._head, self._stream = head, stream

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
    """A binary stream (``sys.stdin.buffer``, a pipe) for :func:`analyze_stream`, gunzipped when it starts with the
    gzip magic (``gzip -c train.log | torchdoctor logs -``). Sniffs by reading the first two bytes, so it works on
    pipes (which cannot seek back); nothing is lost."""
    import gzip

    head = stream.read(2) or b""
    if isinstance(head, str):  # a text stream: no gzip to find there
        return stream
    if len(head) == 1:  # a short read (a raw pipe): one more try for the second byte
        head += stream.read(1) or b""
    rest = _Prepended(bytes(head), stream)
    if head == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=rest, mode="rb")  # type: ignore[return-value]
    return rest  # type: ignore[return-value]

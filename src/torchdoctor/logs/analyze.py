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

What it recognises is in :mod:`.patterns` (DeepSpeed fp16 loss scaling, non-finite losses in Trainer dicts and
progress bars, NCCL timeouts and errors, CUDA and host out-of-memory, killed ranks and launcher exit codes,
CUDA/compiler build failures, DeepSpeed config assertions). All state is bounded: the timeline keeps its first and
last ``TIMELINE_HEAD``/``TIMELINE_TAIL`` events (the rest are counted), the loss-scale history its first and last
runs, every list of details a few dozen entries; counters are plain integers. ``feed_line`` / ``feed_block`` /
``feed_bytes`` never raise: a log can hold anything, and a doctor that crashes on a strange byte loses the evidence.
"""

from __future__ import annotations

import codecs
import io
import re
import signal as _signal
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..findings import Finding
from . import patterns as P

TIMELINE_HEAD = 1000
TIMELINE_TAIL = 1000
SCALE_RUNS_HEAD = 32
SCALE_RUNS_TAIL = 32
MAX_DETAILS = 32            # entries kept per detail list (kills, timeouts, OOMs, build errors)
MAX_KEYS = 4096             # dedup sets stop growing here (later duplicates are then counted again)
CHUNK_BYTES = 1 << 20       # analyze_stream reads this much at a time
MAX_LINE = 1 << 20          # a "line" longer than this (tqdm without newlines) is processed in pieces
TEXT_MAX = 300              # characters of a line kept in the timeline and in evidence
SEG_MAX = 8192              # a candidate segment longer than this is matched in a window around the candidate
SEG_BEFORE = 2048           # ... starting this many characters before it (the rank, the key of a loss)

_RULES = tuple((key, rx, name) for key, rx, name in P.RULES)
_CURRENT = object()  # "the step the log is at now"
_SIGNAL_NAMES = {s.value: s.name for s in _signal.Signals}
_OOM_ERROR_LINE = re.compile(r"(?<!except )(?<!except\()\b(?:\w+\.)*OutOfMemoryError: \S|CUDA error: out of memory")


class _HeadTail:
    """The first ``head`` and the last ``tail`` items of a stream, and how many fell in between."""

    __slots__ = ("head", "tail", "dropped", "_head_n", "_tail_n")

    def __init__(self, head: int, tail: int) -> None:
        self.head: list[Any] = []
        self.tail: deque[Any] = deque(maxlen=tail)
        self.dropped = 0
        self._head_n, self._tail_n = head, tail

    def append(self, item: Any) -> None:
        if len(self.head) < self._head_n:
            self.head.append(item)
            return
        if len(self.tail) == self._tail_n:
            self.dropped += 1
        self.tail.append(item)

    def last(self) -> Any:
        if self.tail:
            return self.tail[-1]
        return self.head[-1] if self.head else None

    def items(self) -> list[Any]:
        return [*self.head, *self.tail]

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)


def _num(s: str | None) -> float | None:
    try:
        return float(s) if s is not None else None
    except ValueError:
        return None


def _fmt_scale(x: float | None) -> str:
    if x is None:
        return "?"
    return str(int(x)) if x == int(x) else f"{x:g}"


def _scale_val(x: float) -> int | float:
    return int(x) if x == int(x) and abs(x) < 2**63 else x


def _clip(text: str, n: int = TEXT_MAX) -> str:
    text = text.strip()
    return text if len(text) <= n else text[: n - 3] + "..."


def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number that names no signal here."""
    return _SIGNAL_NAMES.get(sig, f"signal {sig}")


def _add(lst: list, item: Any, limit: int = MAX_DETAILS) -> None:
    if len(lst) < limit:
        lst.append(item)


def _seen(keys: set, key: Any) -> bool:
    """True if ``key`` was seen before; remembers it while the set is small."""
    if key in keys:
        return True
    if len(keys) < MAX_KEYS:
        keys.add(key)
    return False


@dataclass
class LogReport:
    """What a log showed: findings (the verdicts), the timeline of notable lines, how many lines were read."""

    findings: list[Finding]
    timeline: list[dict]
    lines: int
    timeline_dropped: int = 0
    event_counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "findings": [f.to_json() for f in self.findings],
            "timeline": [dict(e) for e in self.timeline],
            "lines": self.lines,
            "timeline_dropped": self.timeline_dropped,
            "event_counts": dict(self.event_counts),
        }


class Analyzer:
    """Streaming log analyzer: ``feed_line`` / ``feed_bytes`` as the log arrives, then ``finish()``.

    Lines are numbered from 1 by ``\\n``; a ``\\r`` (tqdm redrawing its bar) splits a line into segments that are
    read separately but keep the line's number. Steps come from the last progress bar (``28/189 [``) or
    DeepSpeed ``step=N, skipped=S`` line before an event, or from the event itself (``Grad overflow on iteration
    N``).

    ``source`` words the findings for where the text came from: ``"log"`` (a file or stdin) or ``"command"`` (the
    output of a command run by ``torchdoctor run``).
    """

    def __init__(self, *, source: str = "log") -> None:
        self._source = source
        self._run: dict[str, Any] | None = None  # what `torchdoctor run` saw itself (set_run_evidence)
        self._lines = 0
        self._midline = False      # text was read since the last newline (a line not counted yet)
        self._carry = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._timeline = _HeadTail(TIMELINE_HEAD, TIMELINE_TAIL)
        self._counts: Counter[str] = Counter()
        self._internal_errors = 0
        self._seg_end = 0          # end of the segment being handled, in the buffer being scanned
        self._nf_end: int | None = None  # end of the last non-finite-loss segment in the current buffer
        # progress
        self._step: int | None = None
        self._max_step: int | None = None
        self._planned: int | None = None
        self._ds_skipped: int | None = None
        self._ds_step: int | None = None
        self._iterations = 0
        self._pending: dict[str, tuple[int, str, int, int]] = {}  # progress markers not parsed yet
        self._pseq = 0
        # fp16 loss scaling
        self._ovf = 0
        self._ovf_by_rank: Counter[int | None] = Counter()
        self._ovf_first: dict | None = None
        self._hyst = 0
        self._dyn_ovf = 0
        self._static_ovf = 0
        self._scaleless_ovf = 0
        self._scale_first: float | None = None
        self._scale_max: float | None = None
        self._scale_min: float | None = None
        self._scale_last: float | None = None
        self._scale_runs = _HeadTail(SCALE_RUNS_HEAD, SCALE_RUNS_TAIL)
        self._run_break = False
        self._increases = 0
        self._last_increase_line = 0
        self._last_drop_line = 0
        self._equal_streak = 0
        self._min_reached: str | None = None
        self._min_value: float | None = None   # the scale judged to be the minimum
        self._min_first: dict | None = None    # where it was first reached
        self._at_min_line = 0                  # the last line that left the scale at that minimum
        self._min_raised: dict | None = None
        self._static_scale: float | None = None
        # losses
        self._loss_nf = 0
        self._loss_first: dict | None = None
        self._loss_last: dict | None = None
        self._loss_recovered = False
        self._norm_nf = 0
        self._norm_first: dict | None = None
        # NCCL
        self._nccl_timeouts: list[dict] = []
        self._nccl_timeout_keys: set = set()
        self._nccl_timeout_n = 0
        self._nccl_timeout_ranks: set[int] = set()
        self._nccl_timeout_first: dict | None = None  # the lowest SeqNum of all timeouts: the collective that hung
        self._nccl_heartbeat: list[dict] = []
        self._nccl_abort_n = 0
        self._nccl_errors: list[dict] = []
        self._nccl_error_n = 0
        self._nccl_error_keys: set = set()
        self._nccl_warns: list[dict] = []
        self._nccl_warn_n = 0
        # memory
        self._cuda_oom: list[dict] = []
        self._cuda_oom_n = 0
        self._gpu_mem_max: tuple[float, float] | None = None
        self._cpu_mem_pct_max: float | None = None
        self._cpu_mem_last: dict | None = None
        self._host_oom: list[dict] = []
        self._host_oom_n = 0
        # processes
        self._exits: list[dict] = []
        self._exit_keys: set = set()
        self._exit_n = 0
        self._tr_host: str | None = None
        self._tr_rank: int | None = None
        self._sigterm_sent = 0
        self._cancel: dict | None = None
        # builds and configs
        self._cuda_mismatch: list[dict] = []
        self._cuda_home: list[dict] = []
        self._compiler: list[dict] = []
        self._build_keys: set = set()
        self._ds_config: list[dict] = []

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
        """Raw bytes as they come (any split, UTF-8 decoded with replacement). Never raises."""
        try:
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
            if not partial and text[-1] != "\n":
                text += "\n"
            self._scan(text, len(text))
        except Exception:  # noqa: BLE001 -- a log line must never stop the run it watches
            self._internal_errors += 1

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
        try:
            self._feed_text(self._decoder.decode(b"", final=True), final=True)
        except Exception:  # noqa: BLE001
            self._internal_errors += 1
        try:
            findings = self._judge()
        except Exception as e:  # noqa: BLE001 -- report the analyzer's own failure rather than nothing
            findings = [Finding("logs.analyzer-error", "warn", f"the log analyzer failed: {type(e).__name__}: {e}",
                                fix=["report this at the torchdoctor issue tracker with the log"])]
        return LogReport(findings=findings, timeline=self._timeline.items(), lines=self._lines,
                         timeline_dropped=self._timeline.dropped, event_counts=dict(self._counts))

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
        if final and self._midline:  # the last line had no newline: it counts too
            self._lines += 1
            self._midline = False

    def _scan(self, buf: str, end: int) -> None:
        """Handle buf[:end] (whole lines, or a piece of an overlong one): C-speed searches find the candidates."""
        pos = [m.start() for m in P.SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.EXIT_SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.LOSS_SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.NORM_SCAN_RE.finditer(buf, 0, end)]
        for needle in P.NEEDLES:
            i = buf.find(needle, 0, end)
            while i >= 0:
                pos.append(i)
                i = buf.find(needle, i + 1, end)
        pos.sort()
        base, nl, counted, prev, seg_end = self._lines, 0, 0, 0, -1
        self._nf_end = None
        for p in pos:
            if p < seg_end:
                continue
            # the segment around p: from the last \n or \r before it (never before the previous segment's end,
            # so a line without newlines is not searched back to its start for every candidate) to the next one
            ls = max(buf.rfind("\n", prev, p) + 1, prev)
            r = buf.rfind("\r", ls, p)
            s = r + 1 if r >= 0 else ls
            e = buf.find("\n", p, end)
            if e < 0:
                e = end
            r = buf.find("\r", p, e)
            if r >= 0:
                e = r
            if e - s > SEG_MAX:  # a huge line (a blob, a bar without \r): match in a window around the candidate
                s = max(s, p - SEG_BEFORE)
                e = min(e, s + SEG_MAX)
            if prev < s:
                self._progress_region(buf, prev, s)
            nl += buf.count("\n", counted, s)
            counted = s
            self._seg_end = e
            self._segment(buf[s:e], base + nl + 1)
            prev = seg_end = e
        if prev < end:
            self._progress_region(buf, prev, end)
        if self._loss_nf and not self._loss_recovered:
            start = self._nf_end if self._nf_end is not None else 0
            if start < end and P.FINITE_LOSS_RE.search(buf, start, end):
                self._loss_recovered = True
        self._lines = base + nl + buf.count("\n", counted, end)
        if end:
            self._midline = buf[end - 1] != "\n"

    def _progress_region(self, buf: str, a: int, b: int) -> None:
        """Note the last progress bar / DeepSpeed step line in buf[a:b]; parsed only when a step is needed."""
        t = max(buf.rfind(P.TQDM_MARKERS[0], a, b), buf.rfind(P.TQDM_MARKERS[1], a, b))
        d = buf.rfind(P.DS_STEP_MARKER, a, b)
        for p, kind in sorted(((t, "tqdm"), (d, "ds"))):
            if p >= 0:
                self._pseq += 1
                self._pending[kind] = (self._pseq, buf, a, p)

    def _resolve_progress(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for kind, (_, buf, a, p) in sorted(pending.items(), key=lambda kv: kv[1][0]):
            if kind == "tqdm":
                self._tqdm_at(buf, a, p)
            else:
                self._ds_step_line(self._segment_around(buf, p))

    @staticmethod
    def _segment_around(buf: str, p: int) -> str:
        lo, hi = max(0, p - SEG_BEFORE), min(len(buf), p + SEG_MAX)  # bounded, as in _scan
        ls = max(buf.rfind("\n", lo, p) + 1, lo)
        r = buf.rfind("\r", ls, p)
        s = r + 1 if r >= 0 else ls
        e = buf.find("\n", p, hi)
        e = hi if e < 0 else e
        r = buf.find("\r", p, e)
        return buf[s: r if r >= 0 else e]

    def _tqdm_at(self, buf: str, a: int, p: int) -> None:
        for _ in range(3):  # a stray "it/s" that is not a bar: try the one before
            if self._tqdm(self._segment_around(buf, p)):
                return
            p = max(buf.rfind(P.TQDM_MARKERS[0], a, p), buf.rfind(P.TQDM_MARKERS[1], a, p))
            if p < 0:
                return

    def _tqdm(self, seg: str) -> bool:
        m = None
        for m in P.TQDM_RE.finditer(seg):  # noqa: B007 -- the last bar in the segment
            pass
        if m is None:
            return False
        if P.TQDM_NOT_TRAINING_RE.search(seg, 0, m.start()):
            return True  # a loading/eval bar: not the training step, and no reason to look further back
        if m.group(1) is not None:
            self._set_step(int(m.group(1)))
            self._planned = int(m.group(2))
        else:
            self._set_step(int(m.group(3)))
        return True

    def _ds_step_line(self, seg: str) -> None:
        m = P.DS_STEP_RE.search(seg)
        if m:
            self._set_step(int(m.group(1)))
            self._ds_step = int(m.group(1))
            self._ds_skipped = int(m.group(2))

    def _set_step(self, n: int) -> None:
        self._step = n
        if self._max_step is None or n > self._max_step:
            self._max_step = n

    def _segment(self, seg: str, lineno: int) -> None:
        if "\x1b" in seg:
            seg = P.ANSI_RE.sub("", seg)
        if "it/s" in seg or "s/it" in seg:
            self._resolve_progress()
            self._tqdm(seg)
        if "skipped=" in seg:
            self._resolve_progress()
            self._ds_step_line(seg)
        fired: set[str] = set()
        for key, rx, name in _RULES:
            if key in seg and name not in fired:
                m = rx.search(seg)
                if m:
                    if not fired:
                        self._resolve_progress()
                    fired.add(name)
                    try:
                        getattr(self, name)(m, seg, lineno)
                    except Exception:  # noqa: BLE001 -- one odd line must not cost the rest of the log
                        self._internal_errors += 1

    def _event(self, lineno: int, event: str, seg: str, step: Any = _CURRENT) -> dict:
        e = {"line": lineno, "step": self._step if step is _CURRENT else step, "event": event, "text": _clip(seg)}
        self._timeline.append(e)
        self._counts[event] += 1
        return e

    @staticmethod
    def _rank(seg: str) -> int | None:
        m = P.RANK_PREFIX_RE.match(seg)
        return int(m.group(1)) if m else None

    # ------------------------------------------------------------------------------- fp16 loss scaling
    def _count_overflow(self, rank: int | None, e: dict) -> None:
        self._ovf += 1
        self._ovf_by_rank[rank if len(self._ovf_by_rank) < 1024 else None] += 1
        if self._ovf_first is None:
            self._ovf_first = e

    def _on_overflow(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = int(m["rank"]) if m["rank"] else self._rank(seg)
        att, new = _num(m["att"]), _num(m["new"])
        if att is None:
            e = self._event(lineno, "overflow-unscaled", seg)
            self._scaleless_ovf += 1
            self._count_overflow(rank, e)
            return
        e = self._event(lineno, "overflow", seg)
        self._count_overflow(rank, e)
        self._dyn_ovf += 1
        if m["hyst"] is not None:
            self._hyst += 1
            self._scale_point(att, att, lineno, hysteresis=True)
        elif new is not None:
            self._scale_point(att, new, lineno)

    def _on_grad_overflow(self, m: re.Match, seg: str, lineno: int) -> None:
        it = int(m.group(1))
        self._set_step(it)
        self._iterations = max(self._iterations, it + 1)  # iterations count from 0
        e = self._event(lineno, "overflow", seg, step=it)
        self._count_overflow(self._rank(seg), e)

    def _on_reducing(self, m: re.Match, seg: str, lineno: int) -> None:
        att, new = float(m.group(1)), float(m.group(2))
        self._dyn_ovf += 1
        self._scale_point(att, new, lineno)
        if att == new and not self._counts["scale-min"]:  # the overflow itself is on the line before
            self._event(lineno, "scale-min", seg)

    def _on_increasing(self, m: re.Match, seg: str, lineno: int) -> None:
        new = float(m.group(2))
        self._increases += 1
        self._last_increase_line = lineno
        self._run_break = True
        self._scale_last = new
        self._scale_max = new if self._scale_max is None else max(self._scale_max, new)
        self._event(lineno, "scale-up", seg)

    def _on_static_scale(self, m: re.Match, seg: str, lineno: int) -> None:
        self._static_ovf += 1
        self._static_scale = float(m.group(1))

    def _on_min_scale(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "scale-min", seg)
        if self._min_raised is None:
            self._min_raised = {"line": lineno, "step": self._step, "text": _clip(seg)}
        self._min_reached = "DeepSpeed's loss scaler raised 'Current loss scale already at minimum'"

    def _scale_point(self, att: float, new: float, lineno: int, hysteresis: bool = False) -> None:
        if self._scale_last is not None and att > self._scale_last:  # DynamicLossScaler raises the scale silently
            self._increases += 1
            self._last_increase_line = lineno
            self._run_break = True
        run = self._scale_runs.last()
        if run is not None and run["scale"] == _scale_val(att) and not self._run_break:
            run["overflows"] += 1
        else:
            self._scale_runs.append({"scale": _scale_val(att), "overflows": 1, "line": lineno, "step": self._step})
        self._run_break = False
        if self._scale_first is None:
            self._scale_first = att
        self._scale_max = att if self._scale_max is None else max(self._scale_max, att)
        self._scale_min = new if self._scale_min is None else min(self._scale_min, new)
        self._scale_last = new
        if hysteresis:
            return
        if new < att:
            self._last_drop_line = lineno
            self._equal_streak = 0
        elif new == att:
            self._equal_streak += 1
            if self._min_reached is None and (att <= 1 or self._equal_streak >= 3):
                self._min_reached = f"the loss scale stayed at {_fmt_scale(att)}: min_loss_scale reached"
        if new <= 1 and self._min_reached is None:
            self._min_reached = f"the loss scale fell to {_fmt_scale(new)} (DeepSpeed's default min_loss_scale is 1)"
        if self._min_reached is not None:
            if self._min_first is None:
                self._min_value = new
                self._min_first = {"line": lineno, "step": self._step}
            if new <= (self._min_value or 0):
                self._at_min_line = lineno

    # -------------------------------------------------------------------------------------- losses
    def _on_loss(self, m: re.Match, seg: str, lineno: int) -> None:
        e = self._event(lineno, "loss-nonfinite", seg)
        self._loss_nf += 1
        self._loss_recovered = False
        self._nf_end = self._seg_end
        d = {"line": lineno, "step": self._step, "key": m["key"], "value": m["val"], "text": e["text"]}
        sm = P.STEP_KEY_RE.search(seg)
        if sm:  # a metrics dict that names its own step
            d["step"] = e["step"] = int(sm.group(1))
        em = P.EPOCH_RE.search(seg)
        if em:
            d["epoch"] = float(em.group(1))
        if self._loss_first is None:
            self._loss_first = d
        self._loss_last = d

    def _on_norm(self, m: re.Match, seg: str, lineno: int) -> None:
        if "oss" in seg and P.LOSS_RE.search(seg):
            return  # the loss itself is non-finite: reported as such
        sm = P.STEP_KEY_RE.search(seg)
        e = self._event(lineno, "grad-norm-nonfinite", seg, step=int(sm.group(1)) if sm else _CURRENT)
        self._norm_nf += 1
        if self._norm_first is None:
            self._norm_first = {"line": lineno, "step": e["step"], "key": m["key"], "text": e["text"]}

    # -------------------------------------------------------------------------------------------- NCCL
    def _on_nccl_timeout(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = int(m["rank"]) if m["rank"] else self._rank(seg)
        key = (rank, m["seq"], m["op"])
        if _seen(self._nccl_timeout_keys, key):
            return
        self._event(lineno, "nccl-timeout", seg)
        self._nccl_timeout_n += 1
        if rank is not None and len(self._nccl_timeout_ranks) < MAX_KEYS:
            self._nccl_timeout_ranks.add(rank)
        d = {"line": lineno, "step": self._step, "rank": rank, "op": m["op"], "seq": int(m["seq"]),
             "numel": int(m["numel"]) if m["numel"] else None, "timeout_ms": int(m["tmo"]) if m["tmo"] else None,
             "ran_ms": int(m["ran"]) if m["ran"] else None, "text": _clip(seg)}
        _add(self._nccl_timeouts, d)
        if self._nccl_timeout_first is None or d["seq"] < self._nccl_timeout_first["seq"]:
            self._nccl_timeout_first = d

    def _on_nccl_heartbeat(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "nccl-heartbeat-timeout", seg)
        _add(self._nccl_heartbeat, {"line": lineno, "rank": int(m["rank"]) if m["rank"] else self._rank(seg),
                                    "text": _clip(seg)}, 8)

    def _on_nccl_abort(self, m: re.Match, seg: str, lineno: int) -> None:
        self._nccl_abort_n += 1
        if self._nccl_abort_n <= 8:
            self._event(lineno, "nccl-abort", seg)

    def _nccl_error(self, lineno: int, seg: str, kind: str, detail: str | None = None, **extra: Any) -> None:
        if _seen(self._nccl_error_keys, (kind, detail, self._rank(seg))):
            return
        self._event(lineno, "nccl-error", seg)
        self._nccl_error_n += 1
        _add(self._nccl_errors, {"line": lineno, "step": self._step, "kind": kind, "detail": detail,
                                 "rank": self._rank(seg), "text": _clip(seg), **extra})

    def _on_nccl_error(self, m: re.Match, seg: str, lineno: int) -> None:
        reason = (m["reason"] or "").strip() or None
        self._nccl_error(lineno, seg, "NCCL error", reason, version=m["ver"])

    def _on_nccl_code(self, m: re.Match, seg: str, lineno: int) -> None:
        self._nccl_error(lineno, seg, "nccl" + m["code"], (m["detail"] or "").strip() or None)

    def _on_nccl_aborted(self, m: re.Match, seg: str, lineno: int) -> None:
        self._nccl_error(lineno, seg, "communicator aborted", f"rank {m.group(1)}")

    def _on_nccl_warn(self, m: re.Match, seg: str, lineno: int) -> None:
        self._nccl_warn_n += 1
        if self._nccl_warn_n <= 16:
            self._event(lineno, "nccl-warn", seg)
            self._nccl_warns.append({"line": lineno, "text": _clip(seg)})

    # ------------------------------------------------------------------------------------------ memory
    def _on_cuda_oom(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "cuda-oom", seg)
        self._cuda_oom_n += 1
        d: dict[str, Any] = {"line": lineno, "step": self._step, "rank": self._rank(seg),
                             "tried_to_allocate": m["req"], "text": _clip(seg, 600)}
        g = P.CUDA_OOM_GPU_RE.search(seg)
        if g:
            d["gpu"] = int(g["gpu"] or g["gpu_old"])
            d["total_capacity"] = g["total"] or g["total_old"]
            d["free"] = g["free"] or g["free_old"]
        f = P.CUDA_OOM_FRAG_RE.search(seg)
        if f:
            d["reserved_unallocated"] = f["unalloc"]
        _add(self._cuda_oom, d, 16)

    def _on_cuda_oom_error(self, m: re.Match, seg: str, lineno: int) -> None:
        if "CUDA out of memory" in seg or not _OOM_ERROR_LINE.search(seg):
            return
        self._event(lineno, "cuda-oom", seg)
        self._cuda_oom_n += 1
        _add(self._cuda_oom, {"line": lineno, "step": self._step, "rank": self._rank(seg), "tried_to_allocate": None,
                              "text": _clip(seg, 600)}, 16)

    def _on_mem_gpu(self, m: re.Match, seg: str, lineno: int) -> None:
        max_ma, max_ca = float(m.group(2)), float(m.group(4))
        old = self._gpu_mem_max or (0.0, 0.0)
        self._gpu_mem_max = (max(old[0], max_ma), max(old[1], max_ca))

    def _on_mem_cpu(self, m: re.Match, seg: str, lineno: int) -> None:
        pct = float(m.group(2))
        self._cpu_mem_pct_max = pct if self._cpu_mem_pct_max is None else max(self._cpu_mem_pct_max, pct)
        self._cpu_mem_last = {"line": lineno, "used_gb": float(m.group(1)), "percent": pct}

    def _on_host_oom(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "host-oom", seg)
        self._host_oom_n += 1
        _add(self._host_oom, {"line": lineno, "text": _clip(seg)}, 8)

    # --------------------------------------------------------------------------------------- processes
    def _exit(self, lineno: int, seg: str, code: int, source: str, pid: int | None = None,
              rank: int | None = None, host: str | None = None) -> None:
        sig = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
        if pid is not None and _seen(self._exit_keys, (pid, sig if sig is not None else code)):
            for x in self._exits:  # the same death told again (torchrun's summary block): keep what it adds
                if x["pid"] == pid:
                    x["rank"] = x["rank"] if x["rank"] is not None else rank
                    x["host"] = x["host"] or host
            return
        self._exit_n += 1
        self._event(lineno, "killed" if sig is not None else "exit", seg)
        _add(self._exits, {"line": lineno, "step": self._step, "code": code,
                           "signal": signal_name(sig) if sig else None, "signum": sig, "pid": pid,
                           "rank": rank if rank is not None else self._rank(seg), "host": host,
                           "source": source, "text": _clip(seg)}, 64)

    def _on_ds_exit(self, m: re.Match, seg: str, lineno: int) -> None:
        code = int(m.group(1))
        r = P.DS_LOCAL_RANK_RE.search(seg)
        if code:
            self._exit(lineno, seg, code, "deepspeed launcher", rank=int(r.group(1)) if r else None)

    def _on_torchrun_failed(self, m: re.Match, seg: str, lineno: int) -> None:
        code = int(m.group(1))
        if code:
            self._exit(lineno, seg, code, "torchrun", pid=int(m.group(3)), rank=int(m.group(2)))

    def _on_torchrun_exitcode(self, m: re.Match, seg: str, lineno: int) -> None:
        code = int(m.group(1))
        if code:
            self._exit(lineno, seg, code, "torchrun", pid=int(m.group(2)) if m.group(2) else None,
                       rank=self._tr_rank, host=self._tr_host)
        self._tr_rank = self._tr_host = None

    def _on_torchrun_signal(self, m: re.Match, seg: str, lineno: int) -> None:
        self._exit(lineno, seg, -int(m.group(1)), "torchrun", pid=int(m.group(3)), rank=self._tr_rank,
                   host=self._tr_host)

    def _on_torchrun_host(self, m: re.Match, seg: str, lineno: int) -> None:
        self._tr_host = m.group(1)

    def _on_torchrun_rank(self, m: re.Match, seg: str, lineno: int) -> None:
        self._tr_rank = int(m.group(1))

    def _on_spawn(self, m: re.Match, seg: str, lineno: int) -> None:
        if m.group(2):
            sig = getattr(_signal, m.group(2), None)
            code = -int(sig) if sig is not None else -1
        else:
            code = int(m.group(3))
        if code:
            self._exit(lineno, seg, code, "torch.multiprocessing", rank=int(m.group(1)))

    def _on_subprocess_signal(self, m: re.Match, seg: str, lineno: int) -> None:
        self._exit(lineno, seg, -int(m.group(2)), "subprocess")

    def _on_bash_killed(self, m: re.Match, seg: str, lineno: int) -> None:
        self._exit(lineno, seg, -9, "shell", pid=int(m.group(1)) if m.group(1) else None)

    def _on_sigterm_sent(self, m: re.Match, seg: str, lineno: int) -> None:
        self._sigterm_sent += 1
        if self._sigterm_sent <= 8:
            self._event(lineno, "sigterm-sent", seg)

    def _on_slurm_cancel(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "cancelled", seg)
        self._cancel = {"line": lineno, "reason": m.group(2), "text": _clip(seg)}

    # ------------------------------------------------------------------------------------------ builds
    def _build(self, lst: list, lineno: int, seg: str, event: str, key: Any = None, **d: Any) -> None:
        if _seen(self._build_keys, (event, key if key is not None else _clip(seg))):
            return
        self._event(lineno, event, seg)
        _add(lst, {"line": lineno, "text": _clip(seg), **d}, 16)

    def _on_ds_cuda_mismatch(self, m: re.Match, seg: str, lineno: int) -> None:
        tail = m["tail"]
        verdict = ("info" if "APIs are compatible" in tail else "warn" if "DS_SKIP_CUDA_CHECK" in tail else "fail")
        self._build(self._cuda_mismatch, lineno, seg, "cuda-mismatch", system=m["sys"], torch=m["torch"],
                    verdict=verdict, source="deepspeed")

    def _on_torch_cuda_mismatch(self, m: re.Match, seg: str, lineno: int) -> None:
        verdict = "fail" if m["kind"] == "mismatches" else "info"
        self._build(self._cuda_mismatch, lineno, seg, "cuda-mismatch", system=m["sys"], torch=m["torch"],
                    verdict=verdict, source="torch")

    def _on_cuda_home(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._cuda_home, lineno, seg, "cuda-home")

    def _on_gcc_too_new(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._compiler, lineno, seg, "compiler-error", key=("gcc-too-new", m.group(1)), kind="gcc-too-new",
                    limit=int(m.group(1)))

    def _on_gcc_too_old(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._compiler, lineno, seg, "compiler-error", kind="gcc-too-old", need=int(m.group(1)))

    def _on_torch_compiler(self, m: re.Match, seg: str, lineno: int) -> None:
        kind = "gcc-too-new" if m["rel"] == "greater" else "gcc-too-old"
        self._build(self._compiler, lineno, seg, "compiler-error", kind=kind, compiler=m["cc"], version=m["ver"],
                    cuda=m["cuda"])

    def _on_nvcc_fatal(self, m: re.Match, seg: str, lineno: int) -> None:
        kind = "gpu-arch" if ("gpu architecture" in seg or "gpu-architecture" in seg) else "nvcc"
        self._build(self._compiler, lineno, seg, "compiler-error", kind=kind, detail=m.group(1).strip())

    def _on_ninja_stopped(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._compiler, lineno, seg, "build-failed", kind="ninja")

    def _on_ext_build(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._compiler, lineno, seg, "build-failed", kind="extension", extension=m.group(1))

    def _on_jit_load(self, m: re.Match, seg: str, lineno: int) -> None:
        kind = "ninja-missing" if "ninja" in m.group(2) else "op-incompatible"
        self._build(self._compiler, lineno, seg, "build-failed", kind=kind, op=m.group(1))

    def _on_compile_error(self, m: re.Match, seg: str, lineno: int) -> None:
        if "unsupported GNU version" in seg:
            return  # reported by its own rule
        self._build(self._compiler, lineno, seg, "compiler-error", kind="compile-error", file=m.group(1),
                    detail=_clip(m.group(2), 200))

    def _on_ds_bf16_fp16(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._ds_config, lineno, seg, "config-error", kind="bf16-and-fp16")

    def _on_ds_batch(self, m: re.Match, seg: str, lineno: int) -> None:
        tb, mb, gas, ws = (int(x) for x in m.groups())
        self._build(self._ds_config, lineno, seg, "config-error", kind="batch-size", train_batch_size=tb,
                    micro_batch=mb, gradient_accumulation_steps=gas, world_size=ws)

    # ------------------------------------------------------------------------------------------ judging
    def _judge(self) -> list[Finding]:
        self._resolve_progress()
        out: list[Finding] = []
        for fn in (self._judge_fp16, self._judge_grad, self._judge_loss, self._judge_nccl, self._judge_cuda_oom,
                   self._judge_process, self._judge_build, self._judge_config):
            out.extend(fn())
        if self._internal_errors:
            out.append(Finding("logs.analyzer-error", "info",
                               f"{self._internal_errors} line(s) could not be analysed (skipped)",
                               data={"count": self._internal_errors}))
        if self._lines == 0:
            if self._source == "command":
                out.append(Finding("logs.empty", "info", "the command printed nothing (no output to analyse)",
                                   evidence=["nothing on its stdout or stderr: if it writes its log to a file, "
                                             "run `torchdoctor logs FILE` on that file"]))
            else:
                out.append(Finding("logs.empty", "info", "the log is empty (0 lines)",
                                   evidence=["nothing to analyse: check the file name, or that the run wrote to it"]))
        elif not any(f.severity in ("warn", "fail") for f in out):
            ev = [f"{self._lines} lines read; checked for fp16 loss-scale collapse, non-finite loss, NCCL timeouts and "
                  "errors, CUDA and host out-of-memory, killed processes, CUDA/compiler build failures"]
            if self._max_step is not None:
                ev.append(f"last step seen: {self._step}" + (f" of {self._planned}" if self._planned else ""))
            out.append(Finding("logs.clean", "ok", f"no failure signatures in {self._lines} lines", evidence=ev,
                               data={"lines": self._lines, "last_step": self._step}))
        return out

    def _skipped(self) -> int:
        n = max(self._ovf_by_rank.values(), default=0)
        return max(n, self._ds_skipped or 0)

    def _scale_history(self) -> list[dict]:
        return [dict(r) for r in self._scale_runs.items()]

    def _scale_summary(self, limit: int = 10) -> str:
        runs = self._scale_history()
        parts = [f"{r['scale']}x{r['overflows']}" if r["overflows"] > 1 else str(r["scale"]) for r in runs]
        if len(parts) > limit:
            parts = [*parts[: limit // 2], "...", *parts[-(limit // 2):]]
        elif self._scale_runs.dropped:
            parts.insert(SCALE_RUNS_HEAD, "...")
        return " -> ".join(parts)

    def _judge_fp16(self) -> list[Finding]:
        skipped = self._skipped()
        if not (self._dyn_ovf or self._min_reached or (self._ds_skipped or 0) > 0):
            return []
        total = max(self._max_step or 0, self._iterations) or None
        frac = min(1.0, skipped / total) if total else None
        shrinking = (self._dyn_ovf >= 20 and self._scale_last is not None and self._scale_max is not None
                     and self._scale_last <= self._scale_max / 1024 and self._last_increase_line < self._last_drop_line)
        many_skipped = skipped >= 10 and frac is not None and frac >= 0.1
        first = self._ovf_first
        data: dict[str, Any] = {
            "skipped_steps": skipped,
            "total_steps": total,
            "planned_steps": self._planned,
            "min_scale_reached": self._min_reached is not None,
            "first_overflow_step": first["step"] if first else None,
            "first_overflow_line": first["line"] if first else None,
            "overflow_lines": self._ovf,
            "hysteresis_overflows": self._hyst,
            "scale_first": self._scale_first,
            "scale_max": self._scale_max,
            "scale_min": self._scale_min,
            "scale_last": self._scale_last,
            "scale_increases": self._increases,
            "scale_history": self._scale_history(),
            "scale_history_dropped": self._scale_runs.dropped,
        }
        ev = []
        if first:
            at = f" (step {first['step']})" if first["step"] is not None else ""
            ev.append(f"first overflow at line {first['line']}{at}: {first['text']}")
        if self._scale_max is not None:
            ev.append(f"loss scale {_fmt_scale(self._scale_first)} -> {_fmt_scale(self._scale_last)} "
                      f"(max {_fmt_scale(self._scale_max)}, min {_fmt_scale(self._scale_min)}), "
                      f"{self._increases} recover{'y' if self._increases == 1 else 'ies'}: {self._scale_summary()}")
        steps = f"{skipped} skipped step(s)" + (f" of {total} ({100 * frac:.0f}%)" if frac is not None else "")
        ev.append(steps + (f", {self._hyst} absorbed by hysteresis" if self._hyst else ""))
        if self._min_raised:
            ev.append(f"line {self._min_raised['line']}: {self._min_raised['text']}")
        fix = [
            'raise "initial_scale_power" to 32 in the fp16 block of the DeepSpeed config, with dynamic scaling: '
            '"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 1000, '
            '"hysteresis": 2, "min_loss_scale": 1} (32 usually works)',
            'on Ampere or newer GPUs (A100, H100, RTX 30xx+) train in bf16 instead: "bf16": {"enabled": true} and fp16 '
            "disabled (--bf16 with the HF Trainer); models pretrained in bf16 overflow in fp16",
            "find the first layer that overflows: wrap the model in torchdoctor.NumericsMonitor(model, optimizer=opt) "
            "(or torchdoctor.compat.DebugUnderflowOverflow, a drop-in for transformers'), then keep that module in "
            "fp32 (torchdoctor.keep_fp32)",
        ]
        if self._min_reached is not None:
            # Recovered: DeepSpeed did not give up, the scale rose again after the last time it sat at the
            # minimum, and no non-finite loss is left unanswered after that. Otherwise it stayed there to the end.
            mf = self._min_first or {}
            nan_after = (self._loss_last is not None and self._loss_last["line"] > self._at_min_line
                         and not self._loss_recovered)
            recovered = (self._min_raised is None and self._last_increase_line > self._at_min_line
                         and self._scale_last is not None and self._min_value is not None
                         and self._scale_last > self._min_value and not nan_after)
            data.update(recovered=recovered, min_scale=self._min_value, min_scale_first_line=mf.get("line"),
                        min_scale_first_step=mf.get("step"), min_scale_last_line=self._at_min_line or None)
            if recovered:
                at = f"line {mf['line']}" + (f" (step {mf['step']})" if mf.get("step") is not None else "")
                ev.append(f"the scale reached {_fmt_scale(self._min_value)} at {at}, last sat there at line "
                          f"{self._at_min_line}, then rose again to {_fmt_scale(self._scale_last)}"
                          + ("; the losses logged after it are finite" if self._loss_nf else ""))
                title = (f"fp16 loss scale fell to {_fmt_scale(self._min_value)} at {at} but recovered to "
                         f"{_fmt_scale(self._scale_last)}; {steps}")
                return [Finding("fp16.loss-scale-collapse", "warn", title, ev, fix, data)]
            title = f"fp16 loss scale collapsed: {self._min_reached}"
            if self._min_raised:
                title += "; the run stopped"
            elif self._scale_last is not None and self._min_value is not None \
                    and self._scale_last <= self._min_value:
                title += ", and stayed there to the end of the log"
            elif nan_after:
                title += "; the losses logged after it are not finite"
            return [Finding("fp16.loss-scale-collapse", "fail", title, ev, fix, data)]
        if shrinking or many_skipped:
            why = (f"the loss scale kept falling ({_fmt_scale(self._scale_max)} -> {_fmt_scale(self._scale_last)}) "
                   "without recovering" if shrinking else f"{steps} were skipped by fp16 overflow")
            return [Finding("fp16.loss-scale-collapse", "warn", f"fp16 loss scale is collapsing: {why}", ev, fix, data)]
        ev.append("dynamic loss scaling skips the odd overflowing step and lowers the scale; the run recovered")
        return [Finding("fp16.overflow", "info",
                        f"{skipped} fp16 overflow step(s) skipped, the loss scale recovered (normal with dynamic "
                        "loss scaling)", ev, [], data)]

    def _judge_grad(self) -> list[Finding]:
        n = self._scaleless_ovf + self._static_ovf + self._norm_nf
        if not n:
            return []
        ev = []
        if self._scaleless_ovf:
            first = next((e for e in self._timeline.items() if e["event"] == "overflow-unscaled"), None)
            ev.append(f"{self._scaleless_ovf} step(s) skipped with non-finite gradients and no dynamic loss scale "
                      "to lower (bf16/fp32, or a static scale)" + (f"; first at line {first['line']}" if first else ""))
        if self._static_ovf:
            ev.append(f"{self._static_ovf} overflow(s) at a static loss scale of {_fmt_scale(self._static_scale)}")
        if self._norm_nf:
            f = self._norm_first
            ev.append(f"{self._norm_nf} logged non-finite gradient norm(s); first at line {f['line']}: {f['text']}")
        sev = "fail" if n >= 20 else "warn" if n >= 3 else "info"
        if self._dyn_ovf and not (self._scaleless_ovf or self._static_ovf):
            sev = "info"  # the norms of steps the fp16 scaler skipped: judged by the fp16 finding
        fix = ["find where the inf/nan starts: torchdoctor.NumericsMonitor(model, optimizer=opt) stops at the first "
               "non-finite activation or gradient and names the module",
               "lower the learning rate or clip gradients (gradient_clipping: 1.0 in the DeepSpeed config, "
               "max_grad_norm with the HF Trainer)"]
        if self._static_ovf:
            fix.insert(0, 'use dynamic loss scaling: "fp16": {"loss_scale": 0} (a static scale cannot back off)')
        return [Finding("grad.nonfinite", sev, f"{n} step(s) with non-finite gradients", ev, fix,
                        {"unscaled_overflows": self._scaleless_ovf, "static_scale_overflows": self._static_ovf,
                         "nonfinite_grad_norms": self._norm_nf, "static_scale": self._static_scale})]

    def _judge_loss(self) -> list[Finding]:
        if not self._loss_nf:
            return []
        f, last = self._loss_first, self._loss_last
        at = f"step {f['step']}, line {f['line']}" if f["step"] is not None else f"line {f['line']}"
        ev = [f"first non-finite {f['key']} ({f['value']}) at {at}: {f['text']}"]
        if self._loss_nf > 1:
            ev.append(f"{self._loss_nf} non-finite loss value(s) in all; last at line {last['line']}")
        if self._loss_recovered:
            ev.append("finite losses were logged after the last non-finite one")
        if self._dyn_ovf:
            ev.append(f"the run also had {self._skipped()} fp16 overflow step(s): see fp16 findings")
        fix = [
            "models pretrained in bf16 (e.g. T5 and other TPU-trained checkpoints) often give nan loss in fp16: on "
            "Ampere or newer GPUs use bf16 (--bf16, or \"bf16\": {\"enabled\": true}) or fp32",
            "find the first layer that produces inf/nan: torchdoctor.NumericsMonitor(model, optimizer=opt), or "
            "torchdoctor.compat.DebugUnderflowOverflow (drop-in for transformers' debug=\"underflow_overflow\")",
            "if the loss diverged rather than overflowed: lower the learning rate, add warmup, clip gradients",
        ]
        if self._dyn_ovf:
            fix.insert(1, 'with DeepSpeed fp16, raise "initial_scale_power" to 32 in the fp16 block')
        sev = "warn" if self._loss_recovered else "fail"
        title = f"loss became {f['value']} at {at}" + (" (later losses were finite)" if self._loss_recovered else "")
        return [Finding("loss.nonfinite", sev, title, ev, fix,
                        {"first_step": f["step"], "first_line": f["line"], "first_text": f["text"],
                         "first_epoch": f.get("epoch"), "count": self._loss_nf, "recovered": self._loss_recovered})]

    def _judge_nccl(self) -> list[Finding]:
        out = []
        comm_fix = ("torchdoctor comm (under torchrun/srun, or --local N) checks that every rank can reach every "
                    "other and names the one that cannot; --bench measures the bandwidth")
        if self._nccl_timeout_n or self._nccl_heartbeat:
            t = self._nccl_timeouts
            ev = [f"line {x['line']}: {x['text']}" for x in t[:3]]
            if self._nccl_timeout_n > 3:
                ev.append(f"... {self._nccl_timeout_n - 3} more timeout(s)")
            ev += [f"line {x['line']}: {x['text']}" for x in self._nccl_heartbeat[:2]]
            if self._nccl_abort_n:
                ev.append(f"'Some NCCL operations have failed or timed out' x{self._nccl_abort_n}: the ranks "
                          "took the process down")
            ranks = sorted(self._nccl_timeout_ranks)
            first = self._nccl_timeout_first
            if first is not None:
                # collectives run in SeqNum order on every rank: the lowest one is where a rank stopped following
                later = sorted({x["seq"] for x in t if x["seq"] != first["seq"]})
                more = ""
                if later:
                    shown = ", ".join(map(str, later[:3])) + (", ..." if len(later) > 3 else "")
                    more = f" (earliest; later SeqNum {shown} timed out too)"
                secs = f" after {first['ran_ms'] / 1000:.0f} s" if first["ran_ms"] else ""
                title = (f"NCCL collective timed out: {first['op']} SeqNum={first['seq']}{more} on rank(s) "
                         f"{', '.join(map(str, ranks[:16])) or '?'}{secs}")
            else:
                title = "NCCL watchdog heartbeat timed out: a rank is hung"
            fix = [
                comm_fix,
                "with a healthy network a timeout means one rank never entered the collective: find the rank missing "
                "from these lines (stuck in data loading, a rank-0-only branch that calls a collective, uneven batch "
                "counts); TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 dumps every rank's last "
                "collectives",
                "raise the timeout only for legitimately long steps (checkpoint save, first compile): "
                "deepspeed.init_distributed(timeout=timedelta(minutes=60)), init_process_group(timeout=...), or "
                "TrainingArguments(ddp_timeout=3600)",
            ]
            out.append(Finding("comm.nccl-timeout", "fail", title, ev, fix,
                               {"count": self._nccl_timeout_n, "ranks": ranks[:256], "timeouts": list(t),
                                "earliest": dict(first) if first is not None else None,
                                "heartbeat_timeouts": list(self._nccl_heartbeat), "aborts": self._nccl_abort_n}))
        if self._nccl_error_n or (self._nccl_abort_n and not out):
            errs = self._nccl_errors
            kinds = [e["detail"] if e["kind"] == "NCCL error" and e["detail"] else
                     e["kind"] if not e["detail"] else f"{e['kind']}: {e['detail']}" for e in errs]
            ev = [f"line {e['line']}: {e['text']}" for e in errs[:4]]
            if self._nccl_error_n > 4:
                ev.append(f"... {self._nccl_error_n - 4} more")
            ev += [f"line {w['line']}: {w['text']}" for w in self._nccl_warns[:3]]
            text = " ".join(kinds).lower()
            fix = [comm_fix, "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET to see which transport fails"]
            if "system" in text:
                fix.append("unhandled system error: usually the network interface or shared memory: set "
                           "NCCL_SOCKET_IFNAME to the interface that links the nodes, give containers --ipc=host or "
                           "a larger --shm-size, try NCCL_IB_DISABLE=1 to rule out InfiniBand")
            if "remote" in text or "aborted" in text:
                fix.append("a remote error or an aborted communicator means another rank failed first: look for the "
                           "earliest error or kill in the log")
            if "cuda" in text:
                fix.append("unhandled cuda error: a CUDA error on that rank (out of memory, illegal access); see the "
                           "lines before it, rerun with CUDA_LAUNCH_BLOCKING=1")
            if "internal" in text:
                fix.append("internal error: mismatched NCCL versions between nodes or a corrupted install; compare "
                           "torch.cuda.nccl.version() on every node (torchdoctor env)")
            title = f"NCCL error: {kinds[0]}" if kinds else "NCCL operations failed"
            out.append(Finding("comm.nccl-error", "fail", title, ev, fix,
                               {"count": self._nccl_error_n, "errors": list(errs), "warnings": self._nccl_warn_n}))
        elif self._nccl_warn_n and not out:
            out.append(Finding("comm.nccl-warn", "info", f"{self._nccl_warn_n} NCCL warning(s), no NCCL failure",
                               [f"line {w['line']}: {w['text']}" for w in self._nccl_warns[:3]], [],
                               {"count": self._nccl_warn_n, "warnings": list(self._nccl_warns)}))
        return out

    def _judge_cuda_oom(self) -> list[Finding]:
        if not self._cuda_oom_n:
            return []
        first = self._cuda_oom[0]
        req = f" allocating {first['tried_to_allocate']}" if first.get("tried_to_allocate") else ""
        where = f" on GPU {first['gpu']}" if "gpu" in first else ""
        at = f" at step {first['step']}" if first["step"] is not None else ""
        ev = [f"line {first['line']}: {first['text']}"]
        if self._cuda_oom_n > 1:
            ev.append(f"{self._cuda_oom_n} out-of-memory line(s) in all")
        if self._gpu_mem_max:
            ev.append(f"DeepSpeed's memory report peaked at Max_MA {self._gpu_mem_max[0]} GB, "
                      f"Max_CA {self._gpu_mem_max[1]} GB")
        fix = [
            "torchdoctor ds memory --params <N> --config ds.json estimates the per-GPU model states for every ZeRO "
            "setup: move to ZeRO-3 or offload the optimizer to CPU if they do not fit",
            "lower train_micro_batch_size_per_gpu (per_device_train_batch_size) and raise "
            "gradient_accumulation_steps to keep the global batch; enable activation checkpointing "
            "(model.gradient_checkpointing_enable())",
        ]
        if any("reserved_unallocated" in o for o in self._cuda_oom):
            fix.append("memory reserved but unallocated is fragmentation: "
                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return [Finding("memory.cuda-oom", "fail", f"CUDA out of memory{where}{at}{req}", ev, fix,
                        {"count": self._cuda_oom_n, "events": list(self._cuda_oom),
                         "max_allocated_gb": self._gpu_mem_max[0] if self._gpu_mem_max else None,
                         "max_cached_gb": self._gpu_mem_max[1] if self._gpu_mem_max else None})]

    def _judge_process(self) -> list[Finding]:
        out = []
        kills = [x for x in self._exits if x["signum"] is not None]
        exits = [x for x in self._exits if x["signum"] is None]
        data_common = {"host_oom_lines": list(self._host_oom), "cpu_memory_percent_max": self._cpu_mem_pct_max,
                       "cancelled": self._cancel}
        if kills:
            primary = next((k for k in kills if k["signum"] == 9), None) or next(
                (k for k in kills if k["signum"] != 15), kills[0])
            sig = primary["signum"]
            who = (f"rank {primary['rank']}" if primary["rank"] is not None else "a process") + (
                f" (pid {primary['pid']})" if primary["pid"] else "") + (
                f" on {primary['host']}" if primary["host"] else "")
            ev = [f"line {k['line']}: {k['text']}" for k in kills[:4]]
            if len(kills) > 4:
                ev.append(f"... {len(kills) - 4} more")
            ev += [f"line {h['line']}: {h['text']}" for h in self._host_oom[:2]]
            if self._cpu_mem_pct_max is not None:
                ev.append(f"DeepSpeed's last host-memory report: {self._cpu_mem_last['used_gb']} GB used "
                          f"({self._cpu_mem_last['percent']}%), peak {self._cpu_mem_pct_max}%")
            if self._cancel:
                ev.append(f"line {self._cancel['line']}: {self._cancel['text']}")
            fix: list[str] = []
            sev = "fail"
            # what `torchdoctor run` saw on this machine; a kill reported for another host is not covered by it
            run = self._run
            if run is not None and primary["host"] and run.get("host") and primary["host"] != run["host"]:
                run = None
            sched = ("check who else sends SIGKILL: the job scheduler's record (Slurm: sacct -j JOBID -o "
                     "State,ExitCode,MaxRSS,ReqMem,Timelimit), a watchdog or parent process that kills its workers "
                     "with kill -9")
            if sig == 9:
                fix = [
                    "dmesg -T | grep -i oom (or journalctl -k | grep -i oom) on that host confirms an OOM kill",
                    "torchdoctor ds memory --params <N> --config ds.json estimates the host RAM per node for your ZeRO "
                    "setup: CPU offload (offload_optimizer / offload_param to cpu) and loading the full model on "
                    "every rank need it",
                    "with ZeRO-3, offload to NVMe instead of CPU, build the model under deepspeed.zero.Init (HF: "
                    "from_pretrained with the DeepSpeed config set up first), use fewer dataloader workers",
                ]
                if self._cancel:
                    cause = f"the job was cancelled by the scheduler ({self._cancel['reason'].lower()})"
                elif self._host_oom_n:
                    cause = "the kernel's OOM killer (confirmed by the log): host RAM ran out"
                elif run is not None and run["oom_killer"]:
                    cause = "the kernel's OOM killer (confirmed by the kernel log torchdoctor run read): memory ran out"
                    fix = fix[1:]
                elif run is not None and run["oom_killer"] is False:
                    cause = ("not the kernel's OOM killer: torchdoctor run found no OOM-killer entry for the "
                             "command's processes in the kernel log, and memory never ran low -- something else sent "
                             "SIGKILL")
                    fix = [sched]
                    if run.get("exit_code") == 0:
                        sev = "warn"  # the command carried on and succeeded
                elif run is not None and run["memory_low"] is False and (self._cpu_mem_pct_max or 0) < 80:
                    cause = ("host memory never ran low while torchdoctor run watched, so the OOM killer is less "
                             "likely than another sender (the kernel log, which would tell, could not be read)")
                    fix = [fix[0], sched, *fix[1:]]
                elif (self._cpu_mem_pct_max or 0) >= 80:
                    cause = (f"most likely the kernel's OOM killer: host RAM ran out (DeepSpeed last reported "
                             f"{self._cpu_mem_pct_max:g}% of host memory in use)")
                else:
                    cause = "most likely the kernel's OOM killer: host RAM ran out"
                if run is not None:
                    ev += run["evidence"]
            elif sig == 6:
                cause = "an abort (a C++ exception: NCCL watchdog, CUDA error)"
                if self._nccl_timeout_n or self._nccl_error_n:
                    cause = "an abort after the NCCL failure above"
                    sev = "warn"  # explained (and failed) by the comm finding
                fix = ["the cause is the error printed just before the abort; see the other findings"]
            elif sig == 11:
                cause = "a segmentation fault (a native extension or a CUDA/driver mismatch)"
                fix = ["rerun with python -X faulthandler to get the Python stack",
                       "torchdoctor env checks that torch, the CUDA toolkit and prebuilt extensions match"]
            elif sig == 7:
                cause = "a bus error: usually /dev/shm too small for dataloader workers or NCCL"
                fix = ["give the container --ipc=host or a larger --shm-size; or use fewer dataloader workers"]
            elif sig == 15:
                sev = "warn"
                cause = ("the scheduler stopped the job" if self._cancel else
                         "the launcher or the scheduler stopped it (torchrun sends SIGTERM to the other ranks after "
                         "one fails)")
                fix = ["look for the first rank that failed; if a time limit stopped the job, raise it or resume "
                       "from a checkpoint"]
            else:
                cause = f"signal {signal_name(sig)}"
            title = f"{who} was killed by {signal_name(sig)} ({-sig}): {cause}"
            out.append(Finding("process.killed", sev, title, ev, fix,
                               {"kills": kills, "host_oom": self._host_oom_n > 0, **data_common}))
        if exits:
            first = exits[0]
            codes = sorted({x["code"] for x in exits})
            ev = [f"line {x['line']}: {x['text']}" for x in exits[:3]]
            out.append(Finding(
                "process.exit-code", "warn",
                f"a training process exited with code {', '.join(map(str, codes))}"
                + (f" ({first['source']})" if first["source"] else ""),
                ev, ["the cause is the first error or traceback above the exit line; see the other findings"],
                {"exits": exits}))
        if not kills and self._host_oom_n:
            out.append(Finding(
                "process.killed", "fail", "the kernel's OOM killer killed a process (host RAM ran out)",
                [f"line {h['line']}: {h['text']}" for h in self._host_oom[:3]],
                ["torchdoctor ds memory --params <N> --config ds.json estimates the host RAM per node for your ZeRO "
                 "setup", "dmesg -T | grep -i oom shows which process was killed"],
                {"kills": [], "host_oom": True, **data_common}))
        return out

    def _judge_build(self) -> list[Finding]:
        out = []
        env_fix = ("torchdoctor env shows torch's CUDA, every CUDA toolkit on the machine, which one builds use, and "
                   "the host compiler")
        if self._cuda_mismatch:
            worst = min(self._cuda_mismatch, key=lambda d: ("fail", "warn", "info").index(d["verdict"]))
            ev = [f"line {d['line']}: {d['text']}" for d in self._cuda_mismatch[:3]]
            what = {"fail": "extensions cannot be built", "warn": "forced with DS_SKIP_CUDA_CHECK=1",
                    "info": "accepted: same major version, compatible APIs"}[worst["verdict"]]
            fix = [env_fix,
                   f"make the toolkit match torch: install CUDA {worst['torch']} and export "
                   f"CUDA_HOME=/usr/local/cuda-{worst['torch']} PATH=/usr/local/cuda-{worst['torch']}/bin:$PATH, or "
                   f"install the torch build for CUDA {worst['system']}",
                   "or prebuild the DeepSpeed ops on a matching machine: torchdoctor env --prebuild"]
            out.append(Finding(
                "build.cuda-mismatch", worst["verdict"],
                f"CUDA toolkit {worst['system']} does not match torch's CUDA {worst['torch']}: {what}",
                ev, fix if worst["verdict"] != "info" else [], {"mismatches": list(self._cuda_mismatch)}))
        if self._cuda_home:
            out.append(Finding(
                "build.cuda-home", "fail", "no CUDA toolkit found to compile CUDA ops (CUDA_HOME)",
                [f"line {d['line']}: {d['text']}" for d in self._cuda_home[:3]],
                [env_fix, "install the CUDA toolkit matching torch.version.cuda and export CUDA_HOME to it, or install "
                 "DeepSpeed with DS_BUILD_OPS=0 to skip CUDA op builds"],
                {"lines": list(self._cuda_home)}))
        if self._compiler:
            kinds = [d["kind"] for d in self._compiler]
            root = next((d for d in self._compiler if d["kind"] not in ("ninja", "extension", "compile-error")),
                        next((d for d in self._compiler if d["kind"] == "compile-error"), self._compiler[0]))
            titles = {
                "gcc-too-new": "the host compiler is newer than this CUDA toolkit supports",
                "gcc-too-old": "the host compiler is older than this CUDA toolkit needs",
                "gpu-arch": "nvcc does not know the GPU architecture requested (toolkit too old for the GPU)",
                "nvcc": "nvcc failed",
                "ninja-missing": "ninja is not installed: ops cannot be JIT-built",
                "op-incompatible": "a DeepSpeed op is not compatible with this system",
                "compile-error": "compiling an extension failed",
                "ninja": "building an extension failed",
                "extension": "building an extension failed",
            }
            fix = [env_fix]
            if "gcc-too-new" in kinds or "gcc-too-old" in kinds:
                v = next((d["limit"] for d in self._compiler if d.get("limit")), None)
                gcc, gxx = (f"gcc-{v}", f"g++-{v}") if v else ("gcc-N", "g++-N")
                fix.append(f"point the build at a supported compiler{f' (gcc {v} or older)' if v else ''}: "
                           f"export CC={gcc} CXX={gxx} (or NVCC_PREPEND_FLAGS='-ccbin /usr/bin/{gxx}'), or link it "
                           f"into the toolkit: sudo ln -s /usr/bin/{gcc} /usr/local/cuda/bin/gcc && "
                           f"sudo ln -s /usr/bin/{gxx} /usr/local/cuda/bin/g++")
            if "gpu-arch" in kinds:
                fix.append("set TORCH_CUDA_ARCH_LIST to architectures this toolkit supports, or install a newer CUDA "
                           "toolkit for this GPU")
            if "ninja-missing" in kinds:
                fix.append("pip install ninja")
            fix.append("prebuild the DeepSpeed ops once with the right settings: torchdoctor env --prebuild")
            ext = next((d.get("extension") for d in self._compiler if d.get("extension")), None)
            title = titles.get(root["kind"], "building an extension failed") + (f" (extension '{ext}')" if ext else "")
            out.append(Finding("build.compiler", "fail", title,
                               [f"line {d['line']}: {d['text']}" for d in self._compiler[:5]], fix,
                               {"errors": list(self._compiler)}))
        return out

    def _judge_config(self) -> list[Finding]:
        out = []
        for d in self._ds_config:
            if d["kind"] == "bf16-and-fp16":
                out.append(Finding("ds.config-error", "fail", "DeepSpeed config enables both fp16 and bf16",
                                   [f"line {d['line']}: {d['text']}"],
                                   ['enable one: "bf16": {"enabled": true} on Ampere or newer, else fp16; with the HF '
                                    'Trainer set both to "auto" and pass --bf16 or --fp16',
                                    "torchdoctor ds check ds.json lints the config before a run"], dict(d)))
            else:
                right = d["micro_batch"] * d["gradient_accumulation_steps"] * d["world_size"]
                out.append(Finding("ds.config-error", "fail",
                                   f"DeepSpeed batch sizes disagree: train_batch_size {d['train_batch_size']} != "
                                   f"{d['micro_batch']} x {d['gradient_accumulation_steps']} x {d['world_size']} ranks",
                                   [f"line {d['line']}: {d['text']}"],
                                   [f'set "train_batch_size": {right} (micro batch x gradient accumulation x world '
                                    'size), or "auto" with the HF Trainer',
                                    "torchdoctor ds check ds.json lints the config before a run"], dict(d)))
        return out


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

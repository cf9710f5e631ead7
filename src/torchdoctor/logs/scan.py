"""Scanning a log's text: candidate lines out to the rules, as their programs printed them (:mod:`.lines`).

A log is scanned in large chunks with a few C-speed searches (see :mod:`.patterns`); only the segments around
their hits reach Python. Lines are numbered from 1 by ``\\n`` (hard wraps joined keep the file's numbers); a ``\\r``
(tqdm redrawing its bar) splits a line into segments that are read separately but keep the line's number. The bytes
become text in :mod:`.reading`; where the run was (steps, progress bars) is :mod:`.progress`. A message printed over
several lines (torch's CUDA-mismatch text) is joined with the lines that follow it before it is matched (a family's
``JOINS``).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import deque
from functools import lru_cache, partial
from typing import Any

from . import nonfinite, scalers, tables
from . import patterns as P
from .common import (
    CURRENT,
    JOIN_MAX,
    SEG_BEFORE,
    SEG_MAX,
    TEXT_MAX,
    TIMELINE_HEAD,
    TIMELINE_TAIL,
    HeadTail,
    clip,
    num,
)
from .families import FAMILIES
from .handlers import loss_name
from .lines import Logical, bar_end, dewrap, rejoin, strip_prefixes, vocabulary
from .progress import Progress
from .reading import Reader

#: the prefilter over every family's anchors (patterns.SCAN_ANCHORS and each family's ANCHORS), and the needles
SCAN_RE = re.compile(P.by_first_char(tuple(dict.fromkeys(
    P.SCAN_ANCHORS + scalers.ANCHORS + nonfinite.ANCHORS + tuple(a for f in FAMILIES for a in f.ANCHORS)))))
NEEDLES = tuple(dict.fromkeys(P.NEEDLES + scalers.NEEDLES + nonfinite.NEEDLES
                              + tuple(n for f in FAMILIES for n in f.NEEDLES)))
#: the words of every message table: a word a wrap cut with a space is put back together only into one of these
VOCABULARY = vocabulary(*P.SCAN_ANCHORS, *P.NEEDLES, *(rx.pattern for _, rx, _ in P.RULES),
                        *(m.rx.pattern for m in scalers.MESSAGES), *(m.rx.pattern for m in nonfinite.MESSAGES),
                        *(a for f in FAMILIES for a in f.ANCHORS),
                        *(rx.pattern for f in FAMILIES for _, rx, _ in f.RULES))
@lru_cache(maxsize=4)
def _key_index(keys: tuple[str, ...]) -> tuple[re.Pattern[str], dict[str, tuple[str, ...]],
                                               dict[str, tuple[str, ...]], dict[str, tuple[int, ...]]]:
    """For a rule table's keys: one regex that finds them (longest first at a position, not overlapping), the keys
    inside each key (present whenever it is), the keys that may overlap its end (a suffix of it begins them: tested
    on their own), and each key's rule positions. Together exact: a key the search skips either lies inside a match
    or runs past its end."""
    unique = sorted(set(keys), key=lambda k: (-len(k), k))
    rx = re.compile(P.by_first_char(tuple(unique)))
    contained = {k: tuple(o for o in unique if o != k and o in k) for k in unique}
    overlap = {k: tuple(o for o in unique if o != k and o not in k
                        and any(k.endswith(o[:n]) for n in range(1, min(len(o), len(k)))))
               for k in unique}
    index: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        index.setdefault(k, []).append(i)
    return rx, contained, overlap, {k: tuple(v) for k, v in index.items()}


TAIL_CHARS = 4096    # characters of the end of the output kept for last_lines()


def _in_train_summary(buf: str, m: re.Match) -> bool:
    """The loss ``m`` found is the HF Trainer's end-of-training summary (``{'train_runtime': ..., 'train_loss': ...}``,
    printed once by ``Trainer.train()``): an average over the run, not a later step's loss."""
    pos = m.start()
    line_start = buf.rfind("\n", 0, pos) + 1
    return m["key"].startswith("train_") and buf.find("train_runtime", line_start, pos) >= 0


class Scanner(Reader, Progress):
    """The scanning side of :class:`~torchdoctor.logs.analyze.Analyzer`: text in (from :class:`.reading.Reader`),
    candidate lines out to the rules, with where the run was (:class:`.progress.Progress`); its handlers and judges
    are mixins, its failure families collaborators."""

    def _init_scan(self) -> None:
        from collections import Counter

        self._lines = 0
        self._init_reader()
        self._init_progress()
        self._tail: deque[str] = deque()  # the last TAIL_CHARS characters read, in pieces (the last error lines)
        self._tail_len = 0
        self._timeline = HeadTail(TIMELINE_HEAD, TIMELINE_TAIL)
        self._counts: Counter[str] = Counter()
        self._internal_errors = 0
        self._buf = ""             # the buffer being scanned, and where its scanned part ends
        self._buf_end = 0
        self._seg_start = self._seg_end = 0  # the segment being handled, in the buffer being scanned
        self._join: tuple | None = None  # a message head whose continuation is in the next buffer
        # the failure families (collaborators, families/) and the rules of all: (key, regex, name, bound handler)
        self._families = [family(self) for family in FAMILIES]
        self._rule_table = [(key, rx, name, getattr(self, name)) for key, rx, name in P.RULES] + [
            (m.key, m.rx, "_on_scaler", partial(self._on_scaler, m)) for m in scalers.MESSAGES] + [
            (m.key, m.rx, "_on_nonfinite_message", partial(self._on_nonfinite_message, m))
            for m in nonfinite.MESSAGES] + [
            (key, rx, name, getattr(f, name)) for f in self._families for key, rx, name in f.RULES]
        self._joins = {name: head for f in self._families for name, head in f.JOINS.items()}
        self._keys_re, self._contained, self._overlap, self._rule_index = _key_index(
            tuple(r[0] for r in self._rule_table))
        self._phys = ""            # the candidate line being handled, as the file has it ...
        self._line = Logical("")   # ... and as its program printed it (lines.strip_prefixes)
        self._deepspeed = False    # the log is a DeepSpeed job's (advice may name its config keys)

    def _scan_text(self, buf: str) -> None:
        """Handle ``buf`` (whole lines, or a piece of an overlong one): C-speed searches find the candidates.

        The text is made logical first (:mod:`.lines`): colour codes out, hard-wrapped lines joined (``joins`` keeps
        where, so line numbers stay the file's)."""
        if not buf:
            return
        raw_last = buf[-1]  # whether the line goes on in the next piece, whatever the cleaning leaves
        if "\x1b" in buf:
            buf = P.ANSI_RE.sub("", buf)
        buf, joins = dewrap(buf, self._wrap) if self._wrap else (buf, [])
        end = len(buf)
        self._buf, self._buf_end = buf, end
        if self._join is not None:
            self._finish_join(buf, end)
        if self._frame_pending is not None or self._cpp_pending is not None or self._archs_pending:
            self._finish_pending(buf, end)
        pos = [m.start() for m in SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.EXIT_SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.ERROR_SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.LOSS_SCAN_RE.finditer(buf, 0, end)]
        pos += [m.start() for m in P.NORM_SCAN_RE.finditer(buf, 0, end)]
        heads = [m.start() for m in tables.HEADER_SCAN_RE.finditer(buf, 0, end)]
        pos += heads
        if self._table is not None or any(tables.header(self._line_at(buf, p, end)) for p in heads[:16]):
            pos += tables.nonfinite_fields(buf, end)  # a table's rows: only those with a nan/inf field
        for needle in NEEDLES:
            i = buf.find(needle, 0, end)
            while i >= 0:
                pos.append(i)
                i = buf.find(needle, i + 1, end)
        if self._tb_open:
            self._tb_expire(self._lines)
        # a traceback's frames and exception line: looked for only from where one is open or starts (handlers_crash)
        tb_from = 0 if self._tb_open else next((p for p in pos if buf.startswith(P.TB_STARTS, p)), -1)
        if tb_from >= 0:
            for needle in P.TB_NEEDLES:
                i = buf.find(needle, tb_from, end)
                while i >= 0:
                    pos.append(i)
                    i = buf.find(needle, i + 1, end)
        pos.sort()
        base, nl, counted, prev, seg_end = self._lines, 0, 0, 0, -1
        self._norm_nf_end = None
        for p in pos:
            if p < seg_end:
                continue
            # the segment around p: from the last \n or \r before it (never before the previous segment's end,
            # so a line without newlines is not searched back to its start for every candidate) to the next one
            ls = max(buf.rfind("\n", prev, p) + 1, prev)
            r = buf.rfind("\r", ls, p)
            s = bar_end(buf, r + 1 if r >= 0 else ls, p)  # text after a progress bar is a line of its own
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
            self._seg_start, self._seg_end = s, e
            self._segment(buf[s:e], base + nl + 1 + (bisect_right(joins, s) if joins else 0))
            prev = seg_end = e
        if prev < end:
            self._progress_region(buf, prev, end)
        if self._nf_keys:
            self._finite_after(buf, end)
        # Trainer dicts (the key quoted): how many carry a grad norm, is a finite one the last
        n = buf.count("grad_norm'", 0, end) + buf.count('grad_norm"', 0, end)
        if n:
            self._hf_norms += n
            if self._hf_norm_nf_tail:
                start = self._norm_nf_end if self._norm_nf_end is not None else 0
                if start < end and P.HF_FINITE_NORM_RE.search(buf, start, end):
                    self._hf_norm_nf_tail = 0
        self._lines = base + nl + buf.count("\n", counted, end) + len(joins)
        self._midline = raw_last != "\n"
        if end:
            piece = buf[max(0, end - TAIL_CHARS):end]
            self._tail.append(piece)
            self._tail_len += len(piece)
            while self._tail_len - len(self._tail[0]) >= TAIL_CHARS:
                self._tail_len -= len(self._tail.popleft())

    def _finite_after(self, buf: str, end: int) -> None:
        """Per loss name, a finite value after its last non-finite one in this buffer (or anywhere in it, for one from
        an earlier buffer): the run recovered when every name that went non-finite did. A zero is no recovery (the
        Trainer's hidden NaN), and neither is the HF Trainer's end-of-training summary (an average over the run)."""
        for key, start in list(self._nf_keys.items()):
            for m in P.FINITE_LOSS_RE.finditer(buf, min(start, end), end):
                before = buf[buf.rfind("\n", 0, m.start()) + 1: m.start()][-200:]
                if loss_name(m["key"], before) == key and num(m["v"]) and not _in_train_summary(buf, m):
                    del self._nf_keys[key]
                    break
        for key in self._nf_keys:
            self._nf_keys[key] = 0  # the next buffer is all after it
        self._loss_recovered = not self._nf_keys

    def last_lines(self, n: int = 5, errors: bool = True) -> list[str]:
        """The last error-looking lines of the output (else its last lines): what a failure with no recognised
        cause is quoted by. ``errors=False``: its last ``n`` lines, whatever they are."""
        text = "".join(self._tail)
        cut = len(text) > TAIL_CHARS
        lines = [clip(P.ANSI_RE.sub("", ln)) for ln in text[-TAIL_CHARS:].replace("\r", "\n").split("\n")]
        lines = [ln for ln in lines[1 if cut else 0:] if ln]  # the first may be cut
        errs = [ln for ln in lines if P.ERRORISH_RE.search(ln)] if errors else []
        return (errs or lines)[-n:]

    # ------------------------------------------------------------------------------ messages over lines
    def _following(self, n: int) -> list[str] | None:
        """Up to ``n`` lines after the current segment, in this buffer, as their program printed them (prefixes off):
        of the same rank when the current line has one (ranks interleave), a few other ranks' lines skipped. None when
        the buffer ends before the first."""
        buf, at, end = self._buf, self._seg_end, self._buf_end
        if at + 1 < end and buf[at] == "\r" and buf[at + 1] == "\n":
            at += 1  # a CRLF line end (Windows, PowerShell)
        if at < end and buf[at] != "\n":
            return []  # the segment ended at a \r: a bar redraw, not a wrapped message
        if at + 1 >= end:
            return None
        rank = self._line.rank
        out: list[str] = []
        at += 1
        skipped = 0
        while len(out) < n and at < end:
            e = buf.find("\n", at, min(end, at + JOIN_MAX))
            if e < 0:
                e = min(end, at + JOIN_MAX)
            line = strip_prefixes(buf[at:e].strip())
            at = e + 1
            if rank is not None and line.rank is not None and line.rank != rank:
                skipped += 1
                if skipped > 4 * n:
                    break
                continue
            out.append(line.text.strip())
        return out

    def _try_join(self, rx: Any, name: str, handler: Any, seg: str, lineno: int) -> bool:
        """``seg`` starts a message that ``rx`` needs more lines for (a family's ``JOINS``): join the next ones (of the
        same rank) and retry."""
        head_rx = self._joins.get(name)
        head = head_rx.search(seg) if head_rx is not None else None
        if head is None:
            return False
        nxt = self._following(2)
        if nxt is None:  # the continuation comes with the next buffer
            self._join = (rx, handler, seg, lineno, head)
            return True
        joined = seg.rstrip()
        for line in nxt:
            joined += " " + line
            m = rx.search(joined)
            if m:
                handler(m, joined, lineno)
                return True
        handler(head, seg, lineno)  # cut: what the first line says
        return True

    def _finish_join(self, buf: str, end: int) -> None:
        rx, handler, seg, lineno, head = self._join
        self._join = None
        e = buf.find("\n", 0, min(end, JOIN_MAX))
        line = buf[: e if e >= 0 else min(end, JOIN_MAX)].strip()
        joined = seg.rstrip() + " " + line
        m = rx.search(joined)
        try:
            handler(m if m else head, joined if m else seg, lineno)
        except Exception:  # noqa: BLE001
            self._internal_errors += 1

    def _segment(self, seg: str, lineno: int) -> None:
        """One candidate line: made logical (prefixes off, kept as its rank and time), then matched by the rules.

        A line where a rule's key is present but no rule fires is tried once more with the words of the message
        tables put back together (a wrap that became a space inside a word)."""
        if "\x1b" in seg:
            seg = P.ANSI_RE.sub("", seg)
        if self._box is not None:
            seg = self._unbox(seg, lineno)
        line = strip_prefixes(seg)
        self._phys, self._line = seg, line
        if not self._deepspeed and ("eepspeed" in seg or "eepSpeed" in seg or "skipped=" in seg):
            self._deepspeed = True
        text = line.text
        if "it/s" in text or "s/it" in text:
            self._resolve_progress()
            self._tqdm(text)
        if "skipped=" in text:
            self._resolve_progress()
            self._ds_step_line(text)
        if self._table_line(text, lineno):
            return
        if "   " in text.strip():  # a terminal's padding inside a line: the word it cut is put together first
            text = self._rejoined(text)
            fired, keyed = self._rules(text, lineno)
        else:
            fired, keyed = self._rules(text, lineno)
            if keyed and not fired:  # a wrap that became one space: tried only where a rule's key did not fire
                fixed = self._rejoined(text)
                if fixed is not text:
                    fired = self._rules(fixed, lineno)[0]
                    text = fixed
        if self._tb_open:  # a traceback's frames and exception line: only while one is open (handlers_crash)
            try:
                m = (P.FRAME_RE.search(text) if 'File "' in text else
                     P.IPYTHON_FRAME_RE.match(text) if " in " in text else None)
                if m is not None:
                    self._on_frame(m, text, lineno)
                    fired = True
                else:
                    m = P.EXC_LINE_RE.search(text)
                    if m is not None:
                        self._resolve_progress()
                        n = self._tb_n
                        self._on_exc_line(m, text, lineno)
                        fired = fired or self._tb_n != n
            except Exception:  # noqa: BLE001
                self._internal_errors += 1
        if not fired:
            try:
                self._on_unknown_line(text, lineno)
            except Exception:  # noqa: BLE001
                self._internal_errors += 1

    @staticmethod
    def _line_at(buf: str, p: int, end: int) -> str:
        s = buf.rfind("\n", 0, p) + 1
        e = buf.find("\n", p, end)
        return strip_prefixes(buf[s: e if e >= 0 else end]).text

    def _unbox(self, seg: str, lineno: int) -> str:
        """A line inside pip's box (``╰─> [N lines of output]``) without the box's indent: the build's own line, so its
        traceback's exception line is one (an indented line never ends a traceback)."""
        first, last, prefix, indent = self._box  # type: ignore[misc]
        if lineno > last or "[end of output]" in seg:
            self._box = None
            return seg
        if lineno > first and seg.startswith(prefix) and seg[len(prefix):indent].isspace():
            lead = prefix.rstrip()  # a launcher's prefix before the box is kept, the box's indent is not
            return (lead + " " if lead else "") + seg[indent:]
        return seg

    def _table_line(self, text: str, lineno: int) -> bool:
        """A table's header (kept as the columns) or a row of it with a nan/inf under a loss column (a non-finite
        loss): :mod:`.tables`. True when the line was one of them."""
        if tables.HEADER_SCAN_RE.search(text):
            cols = tables.header(text)
            if cols is not None:
                self._table = cols
                return True
        if self._table is None or not tables.ROW_SCAN_RE.search(text):
            return False
        values = tables.row(text, self._table)
        if not values:
            return False
        bad = [(c, v) for c, v in values.items() if tables.nonfinite(v)]
        if bad:
            self._resolve_progress()
            self._nonfinite_loss(text, lineno, bad[0][0], bad[0][1])
        return True

    def _rejoined(self, text: str) -> str:
        fixed = rejoin(text, VOCABULARY)
        if fixed is not text:
            self._line = self._line._replace(text=fixed)
        return fixed

    def _rules(self, text: str, lineno: int) -> tuple[bool, bool]:
        """Run the rules whose key is in ``text``, in the table's order: whether one fired, and whether a specific key
        (five characters or more: not "oss" or "nccl") was there -- a line worth putting split words together for.

        The keys present are found by one C-speed search (``_keys_re``; see ``_key_index`` for why nothing is
        missed), so a line pays for the rules it may match, not for the whole table."""
        present = self._keys_re.findall(text)
        if not present:
            return False, False
        keys = set(present)
        for k in present:
            keys.update(self._contained[k])
            keys.update(o for o in self._overlap[k] if o in text)
        fired: set[str] = set()
        keyed = any(len(k) >= 5 for k in keys)
        for i in sorted({i for k in keys for i in self._rule_index[k]}):
            key, rx, name, handler = self._rule_table[i]
            if name not in fired:
                m = rx.search(text)
                if m is None and name not in self._joins:
                    continue
                if not fired:
                    self._resolve_progress()
                fired.add(name)
                try:
                    if m is not None:
                        handler(m, text, lineno)
                    elif not self._try_join(rx, name, handler, text, lineno):
                        fired.discard(name)
                except Exception:  # noqa: BLE001 -- one odd line must not cost the rest of the log
                    self._internal_errors += 1
        return bool(fired), keyed

    def _event(self, lineno: int, event: str, seg: str, step: Any = CURRENT) -> dict:
        e = {"line": lineno, "step": self._step if step is CURRENT else step, "event": event, "text": self._quote(seg)}
        if step is CURRENT and self._step_from == "bar" and self._step is not None:
            e["step_from"] = "bar"
            if self._planned:
                e["planned"] = self._planned
        line = self._line
        if seg is line.text:
            if line.rank is not None:
                e["rank"] = line.rank
            if line.time is not None:
                e["time"] = line.time
        self._timeline.append(e)
        self._counts[event] += 1
        return e

    def _quote(self, seg: str, n: int = TEXT_MAX) -> str:
        """What evidence quotes for ``seg``: the physical line as the file has it when ``seg`` is the line being
        handled (prefixes and all), else ``seg`` itself."""
        return clip(self._phys if seg is self._line.text else seg, n)

    # -------------------------------------------------------------- what a family may ask (families.LineContext)
    @property
    def step(self) -> int | None:
        """The training step the log is at (the last progress bar or step line before this one)."""
        return self._step

    def event(self, lineno: int, kind: str, text: str, step: Any = CURRENT) -> dict:
        return self._event(lineno, kind, text, step)

    def quote(self, text: str, n: int = TEXT_MAX) -> str:
        return self._quote(text, n)

    def rank_of(self, text: str) -> int | None:
        return self._rank(text)

    def host_of(self, text: str) -> str | None:
        """The host a line's prefix names (pdsh's ``worker-1:``, NCCL's ``node1:123:456 [0]``)."""
        return self._line.host if text is self._line.text else strip_prefixes(text).host

    def level_of(self, text: str) -> str | None:
        """The log level a line's prefix gives (glog's W/E/F, a logger's WARNING/ERROR)."""
        return self._line.level if text is self._line.text else strip_prefixes(text).level

    def following(self, n: int) -> list[str] | None:
        return self._following(n)

    def _rank(self, seg: str) -> int | None:
        """The rank a line's prefix gives (``[rank3]:``, ``3: ``, ``[1,3]<stderr>:``, ``[rank: 3]``)."""
        return self._line.rank if seg is self._line.text else strip_prefixes(seg).rank

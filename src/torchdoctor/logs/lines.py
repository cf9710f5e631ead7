"""Logical lines: what a rule reads, whatever the layout a log was printed or pasted in.

A physical line of a log is rarely the line its program printed. Launchers and loggers put prefixes in front
(torchrun's ``[rank3]:``, ``srun --label``'s ``3: ``, mpirun's ``[1,3]<stderr>:``, pdsh's ``worker-1: ``, timestamps,
DeepSpeed's ``[2024-..] [INFO] [engine.py:12:step]``, the HF/LlamaFactory ``[INFO|2024-..] module:12 >>``, loguru's
``| INFO     | mod:fn:12 -``, NeMo's ``[NeMo I 2024-.. mod:12]``, c10's and glog's ``[E424 01:11:21.16 file.cpp:629]``,
NCCL's ``node1:2211:2290 [0]``,
Lightning's ``[rank: 1]``, Ray's ``(RayTrainWorker pid=12, ip=..)``, a pasted ``> `` quote), a terminal cuts a long line
at its width and a paste keeps the cut (``... OpTy`` / ``pe=BROADCAST``), a copy through a web page turns that cut into
a space (``OpTy pe=``), and tqdm writes the next message on the line of its bar (``6.7s/it][INFO|..] ...``,
``7.5it/s]Killed``). Rules are written for the program's own line, so this module gives it back:

- :func:`dewrap` joins hard wraps in a chunk of text (a terminal's width found from the lines themselves) and says
  where, so line numbers stay those of the file;
- :func:`strip_prefixes` takes the prefixes off one line, keeping the rank, host, time and log level they carried;
- :func:`bar_end` finds where the text after a progress bar starts, so it is read as a line of its own;
- :func:`rejoin` puts back together the words of the rules' message tables that a wrap split with a space.

Everything here runs on the few candidate lines a chunk's C-speed searches found, except :func:`wrap_width`, which
looks at one sample of each chunk: a log with no wraps pays one ``split`` of 64 KiB per megabyte.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

# ------------------------------------------------------------------------------------------- prefixes
_LEVEL = r"(?:DEBUG|INFO|WARN(?:ING)?|ERROR|CRITICAL|FATAL|TRACE|NOTICE)"
_DATE = r"\d{4}[-/]\d\d[-/]\d\d"
_CLOCK = r"\d\d:\d\d:\d\d(?:[.,]\d+)?"
_STAMP = _DATE + r"[ T_]" + _CLOCK + r"(?:Z|[ ]?[+-]\d\d:?\d\d|[ ]UTC)?"
#: One prefix at the start of a line; :func:`strip_prefixes` takes them off one after another. Groups: ``r*`` a rank,
#: ``host``, ``ts*`` a time, ``lv*`` a log level (glog's one letter, or a word).
PREFIX_RE = re.compile(
    r"\[(?:rank|default)(?P<r1>\d+)\]:[ ]?"                                  # torchrun (--tee / log templates)
    r"|\[rank:?[ ]?(?P<r2>\d+)\][ ]?"                                         # Lightning's rank_prefixed_message
    r"|\[\d+,(?P<r3>\d+)\]<std(?:out|err)>:[ ]?"                              # mpirun --tag-output
    r"|(?P<r4>\d{1,5}):[ ]"                                                   # srun --label
    r"|\[(?P<lv1>" + _LEVEL + r")\|(?P<ts1>[^\]|]*)\][ ]\S+?:\d+[ ]>>[ ]"     # transformers-style / LlamaFactory
    r"|\[(?P<ts2>" + _STAMP + r")\][ ]\[(?P<lv2>" + _LEVEL + r")\][ ]\[[\w./-]+:\d+:\w+\][ ]"  # DeepSpeed logger
    r"|\[NeMo[ ](?P<lv3>[IWEDC])[ ](?P<ts3>" + _DATE + r"[ ]" + _CLOCK + r")[^\]]*\][ ]"     # NeMo
    # c10's [E424 01:11:21.16 ProcessGroupNCCL.cpp:629] / [W socket.cpp:663] (month*100+day: 3 or 4 digits)
    r"|\[(?P<lv4>[IWEF])(?:\d{3,4}[ ](?P<ts4>" + _CLOCK + r"))?[ ]+(?:\d+[ ]+)?[\w./-]+:\d+\][ ]?"
    # glog: I1204 12:00:00.1 2815 f.cc:3]
    r"|(?P<lv5>[IWEF])\d{3,4}[ ](?P<ts5>" + _CLOCK + r")[ ]+\d+[ ][\w./-]+:\d+\][ ]"
    r"|(?P<ts6>\[?" + _STAMP + r"\]?)(?:[ ]?[|:-])?[ ]+"                      # a timestamp, bare or in brackets
    r"|\[(?P<ts7>" + _CLOCK + r")\][ ]"                                       # [12:00:01]
    r"|\|?[ ]?(?P<lv6>" + _LEVEL + r")[ ]*\|[ ](?:[\w.<>-]+:[\w.<>-]+:\d+[ ]-[ ])?"  # loguru
    r"|\[(?P<lv7>" + _LEVEL + r")\][ ]?(?:\[[\w./-]+:\d+(?::\w+)?\][ ])?"   # [INFO] / [ERROR] [file.py:12:fn]
    r"|(?P<lv8>" + _LEVEL + r"):[\w.]*:"                                      # python logging's default format
    r"|(?P<lv9>" + _LEVEL + r")[ ]-[ ]"                                       # "INFO - "
    r"|\((?:\w+[ ])?pid=\d+(?:,[ ]ip=[\w.:-]+)?\)[ ]"                          # Ray's worker prefix
    r"|>[ ]?(?=\S)"                                                           # a quoted paste
    r"|\[\d+\][ ](?=\S)"                                                      # [80746] line numbers
    r"|(?P<nccl>[\w.-]+):\d+:\d+[ ]\[\d+\][ ]"                                  # NCCL's host:pid:tid [dev]
    # pdsh's host (a name with a digit: worker-1, node12), not a metric's name before its value (val-loss: NaN)
    r"|(?P<host>[a-z][a-z0-9-]*\d[a-z0-9-]*)(?=:[ ](?!(?i:nan|inf|-inf|none)\b)(?:\[|\S+[ ]*:|Traceback|[A-Z]))"
    r"(?::[ ])?"
)
_RANK_GROUPS = ("r1", "r2", "r3", "r4")
_TIME_GROUPS = ("ts1", "ts2", "ts3", "ts4", "ts5", "ts6", "ts7")
_LEVEL_GROUPS = ("lv1", "lv2", "lv3", "lv4", "lv5", "lv6", "lv7", "lv8", "lv9")
_LETTER_LEVEL = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "FATAL", "D": "DEBUG", "C": "CRITICAL"}
#: levels that make a line an error report by themselves (glog's F is FATAL: the process aborts after it)
ERROR_LEVELS = frozenset({"ERROR", "FATAL", "CRITICAL"})
MAX_PREFIXES = 8


class Logical(NamedTuple):
    """One line as its program printed it, and what its prefixes said."""

    text: str
    rank: int | None = None
    host: str | None = None
    time: str | None = None
    level: str | None = None


def strip_prefixes(line: str) -> Logical:
    """``line`` without its launcher / logger / time prefixes (any number, in any order), and what they carried.

    The rank is the first one a prefix gives (``[rank3]:`` before ``[Rank 3]`` inside the message), the time the first
    timestamp, the level the most severe one seen. A line that is only a prefix keeps its text (nothing is lost)."""
    rank = host = time = level = None
    pos, n = 0, len(line)
    for _ in range(MAX_PREFIXES):
        m = PREFIX_RE.match(line, pos)
        if m is None or m.end() == pos or m.end() >= n:
            break
        pos = m.end()
        if m["host"] is not None or m["nccl"] is not None:
            host = host or m["host"] or m["nccl"]
            continue
        for g in _RANK_GROUPS:
            if m[g] is not None:
                rank = int(m[g]) if rank is None else rank
                break
        for g in _TIME_GROUPS:
            if m[g] is not None:
                time = time or m[g].strip("[] ")
                break
        for g in _LEVEL_GROUPS:
            if m[g] is not None:
                lv = _LETTER_LEVEL.get(m[g], m[g])
                if level is None or (lv in ERROR_LEVELS and level not in ERROR_LEVELS):
                    level = "WARNING" if lv == "WARN" else lv
                break
    return Logical(line[pos:] if pos else line, rank, host, time, level)


# ------------------------------------------------------------------------------------------ hard wraps
WRAP_SAMPLE = 1 << 16   # characters of a chunk looked at to find a terminal's width
WRAP_MIN_WIDTH = 40     # narrower "widths" are not a terminal's
WRAP_MIN_LINES = 2      # lines of exactly the width, not ending in a space, before the chunk counts as wrapped
#: a line that starts this way is a line of its own, never the rest of the one before
_NEW_LINE_RE = re.compile(
    r"\[(?:rank|default)\d+\]:|\[rank: ?\d+\]|\d{1,5}: |\[\d+,\d+\]<std|\[?[IWEF]\d{3,4} \d\d:|\[?\d{4}-\d\d-\d\d[ T]"
    r"|Traceback \(|\s+File \"|\[(?:INFO|WARNING|ERROR|DEBUG)[\]|]|\{'|\{\"|\s*\d+%\|"
    r"|Killed\s*$|Segmentation fault|Aborted|[\w.]+(?:Error|Exception|Warning):")


def wrap_width(text: str) -> int | None:
    """The width a terminal cut this text's lines at, or None.

    The width is the longest line length (a CRLF's ``\\r`` not counted), when at least ``WRAP_MIN_LINES`` lines of
    exactly that length look cut (:func:`_cut`: tqdm pads its lines with spaces to the width, rules drawn with one
    character such as torchrun's ``=====`` are no cuts, a line whose brackets close at its end is whole) and are
    each followed by a continuation: a line that does not start like a line of its own -- neither in
    :data:`_NEW_LINE_RE`'s forms (a rank prefix, a timestamp, a frame, a progress bar) nor with a first word that
    starts lines elsewhere in the text (a line that follows no line of the width). And the cuts must look like cuts:
    continuations that begin with different words, or one cut inside a sentence (``sc|ale``, ``NC|CL``, ``10.1.|0.7``,
    ``failed| : refused``).
    Lines of one length that alternate with lines of another kind (fixed-format metric lines, then "Saving
    checkpoint") are not wraps: each is followed by the same whole word."""
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text[:WRAP_SAMPLE].split("\n")]
    if len(lines) < 2:
        return None
    counts = Counter(map(len, lines))
    width = max(counts)
    if width < WRAP_MIN_WIDTH or counts[width] < WRAP_MIN_LINES:
        return None
    after_full = {i + 1 for i, ln in enumerate(lines[:-1]) if len(ln) == width}
    starts = Counter(_first_word(ln) for i, ln in enumerate(lines) if i not in after_full)
    firsts: set[str] = set()
    inside_word = False
    cuts = 0
    for i in sorted(after_full):
        ln, nxt = lines[i - 1], lines[i]
        if _cut(ln) and nxt and not _NEW_LINE_RE.match(nxt) and not starts[_first_word(nxt)]:
            cuts += 1
            firsts.add(_first_word(nxt))
            inside_word = inside_word or _mid_sentence(ln, nxt)
    return width if cuts >= WRAP_MIN_LINES and (len(firsts) > 1 or inside_word) else None


def _mid_sentence(line: str, nxt: str) -> bool:
    """Whether the break between ``line`` and ``nxt`` falls inside a sentence: inside a word, number or address (no
    space on either side, and not a capital after a lower-case letter, digit or mark: ``...123.4s`` | ``Saving`` is
    a new sentence), or on a space with the sentence going on (`` : refused``, ``reducing `` | ``to 2048``)."""
    a, b = line[-1], nxt[0]
    if not (a.isspace() or b.isspace()):
        return not (b.isupper() and not a.isupper())
    if b == " ":
        return len(nxt) > 1 and nxt[1] in ":,;.)]}=-"
    return a == " " and b.islower()


def _first_word(line: str) -> str:
    parts = line.split(None, 1)
    return parts[0][:12] if parts else ""


def _cut(line: str) -> bool:
    """A line a terminal may have cut: not padded with spaces (tqdm pads to the width; a cut may fall on one space),
    not one character repeated (a rule of ``=====``), no carriage return inside, and not a line whose brackets all
    close at its end (``{'loss': 2.3, 'epoch': 0.1}``: whole)."""
    if line.endswith(("  ", "\t")) or not line.rstrip() or line.count(line[-1]) >= len(line) - 1 or "\r" in line:
        return False
    return not (line[-1] in ")]}" and all(line.count(o) == line.count(c) for o, c in ("()", "[]", "{}")))


def dewrap(text: str, width: int | None = None) -> tuple[str, list[int]]:
    """``text`` with its hard-wrapped lines joined, and the offsets (in the returned text) where a newline was taken
    out, in order (the caller adds one line per offset before a position to keep the file's line numbers).

    A line is joined with the next when it is exactly ``width`` long (found by :func:`wrap_width` when not given),
    looks cut (:func:`_cut`) and the next line does not start like a line of its own (a rank prefix, a timestamp,
    ``Traceback``, a frame)."""
    width = width or wrap_width(text)
    if width is None:
        return text, []
    parts = text.split("\n")
    out: list[str] = []
    joins: list[int] = []
    pos = 0
    cur = parts[0]
    for nxt in parts[1:]:
        body = cur[:-1] if cur.endswith("\r") else cur  # a CRLF paste: the \r is not part of the width
        if len(body) % width == 0 and body and _cut(body[-width:]) and nxt and not _NEW_LINE_RE.match(nxt) \
                and len(body) // width < 64:
            joins.append(pos + len(body))
            cur = body + nxt
            continue
        out.append(cur)
        pos += len(cur) + 1
        cur = nxt
    out.append(cur)
    return "\n".join(out), joins


# ------------------------------------------------------------------------------------------ progress bars
_RATES = ("it/s", "s/it")
BAR_TAIL = 120  # characters from a bar's rate to its closing bracket (tqdm's postfix: ", loss=0.1, lr=1e-5")


def bar_end(buf: str, start: int, pos: int) -> int:
    """Where the text before ``pos`` that follows a progress bar starts (tqdm writes the next message on the bar's
    line: ``75/6249 [08:38<11:33:05,  6.74s/it][INFO|...] ...``), else ``start``. Only a bar that ends before ``pos``
    counts."""
    q = max(buf.rfind(_RATES[0], start, pos), buf.rfind(_RATES[1], start, pos))
    if q < 0:
        return start
    k = buf.find("]", q, min(pos, q + BAR_TAIL))
    return k + 1 if k >= 0 else start


# ------------------------------------------------------------------------------------------ split words
_WORD_RE = re.compile(r"[A-Za-z_]+")
_ESCAPE_RE = re.compile(r"\\.")  # a regex escape (\d, \s, \[): not part of a word


def vocabulary(*sources: str) -> frozenset[str]:
    """The words (4 letters or more, CamelCase kept whole) of message tables: regex sources and anchors."""
    words: set[str] = set()
    for s in sources:
        words.update(w for w in _WORD_RE.findall(_ESCAPE_RE.sub(" ", s)) if len(w) >= 4 and not w.startswith("_"))
    return frozenset(words)


def rejoin(text: str, vocab: frozenset[str]) -> str:
    """``text`` with each ``word part`` put back together where the two make a word of ``vocab`` that neither is (a
    wrap that became whitespace: ``OpTy pe=BROADCAST``, ``Watchdog cau ght``, ``loss scal      e: 8192`` where a
    terminal padded the cut line to its width). Unchanged when no pair does."""
    words = list(_WORD_RE.finditer(text))
    cuts = []
    for a, b in zip(words, words[1:]):
        gap = text[a.end():b.start()]
        if gap and gap.isspace():  # one space, or a terminal's padding to its width
            joined = a.group() + b.group()
            if joined in vocab and a.group() not in vocab and b.group() not in vocab:
                cuts.append((a.end(), b.start()))
    if not cuts:
        return text
    out, last = [], 0
    for cut, resume in cuts:
        out.append(text[last:cut])
        last = resume
    out.append(text[last:])
    return "".join(out)

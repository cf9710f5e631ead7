"""Metrics printed as a table: a header row of column names, then one row of values per epoch or step.

Trainers that print this way (formats read from their source):

- fastai (fastai/fastai@2.7 ``fastai/callback/progress.py``, ``ProgressCallback``: the header ``epoch train_loss
  valid_loss <metrics> time`` once, then one row per epoch; fastai v1 ``fastai/basic_train.py`` ``Recorder``, and
  0.7's ``fit`` printed the names with spaces, ``epoch train loss valid loss accuracy``);
- ultralytics (ultralytics/ultralytics ``ultralytics/models/yolo/detect/train.py`` ``progress_string``:
  ``Epoch GPU_mem box_loss cls_loss dfl_loss Instances Size`` before each epoch's bar, whose description is the row:
  ``1/100 2.1G 1.234 nan 1.1 16 640: 100%|...``; yolov5's ``train.py`` the same with ``box obj cls``);
- and any script that prints ``print(f"{'epoch':>6} {'loss':>10} ...")`` then values under it.

A header is a line of 3 to 24 names and no number, one of them a loss (a name holding "loss"; a lone ``loss`` after
another word is joined to it, as fastai 0.7's ``train loss``). A row is a line of at least as many fields whose first
is a count (``3`` or ``3/100``), most of the rest numbers, sizes or times; fields past the header's count are allowed
only when a progress bar follows them (ultralytics). The value under a loss column is that loss.

Rows are read only where a value is nan or inf (the scanner finds those with :func:`nonfinite_fields`, and only while a
header is known or in the text with one): a finite row is not looked at, so a run whose table goes back to finite
numbers is not seen to recover (the loss finding then says the run stopped being finite, which the table showed).
"""

from __future__ import annotations

import re

MAX_COLS = 24
#: where a header may be: a loss name followed by another name (the scanner finds candidate lines with it)
HEADER_SCAN_RE = re.compile(r"oss[ \t]+[A-Za-z_(]")  # a literal first: one fast pass (the "l" is checked by header())
#: a nan/inf standing alone as a field (a row's value) -- a line holding one may be a row
ROW_SCAN_RE = re.compile(r"(?:^|[ \t])[-+]?(?i:nan|inf)(?:\.0+)?(?=[ \t\r\n]|$)", re.M)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?%?$")
_FIELD = re.compile(r"[-+]?(?:nan|inf)(?:\.0+)?$|\d+/\d+$|[\d.]+[KMGT]i?B?$|\d+:\d\d(?::\d\d)?$|[\d.]+s$", re.I)
_NAME = re.compile(r"[A-Za-z_][\w.()/%-]*$")
_NONFINITE = re.compile(r"[-+]?(?:nan|inf)(?:\.0+)?$", re.I)


def header(text: str) -> list[str] | None:
    """The column names of a table header line, or None when the line is not one."""
    toks = text.split()
    if not 3 <= len(toks) <= MAX_COLS or not all(_NAME.match(t) for t in toks):
        return None
    cols: list[str] = []
    for t in toks:
        if t.lower() == "loss" and cols and "loss" not in cols[-1].lower():
            cols[-1] = f"{cols[-1]}_{t}"  # fastai 0.7: "train loss" is one column
        else:
            cols.append(t)
    if not any("loss" in c.lower() for c in cols) or len(cols) < 3:
        return None
    return cols


def _value(tok: str) -> bool:
    return bool(_NUMBER.match(tok) or _FIELD.match(tok))


def row(text: str, cols: list[str]) -> dict[str, str] | None:
    """The loss columns' values of a row under ``cols`` (name -> value as printed), or None when the line is not a
    row of that table."""
    toks = text.split()
    n = len(cols)
    if len(toks) < n:
        return None
    if len(toks) > n and "%|" not in text and "it/s" not in text and "s/it" not in text:
        return None  # more fields than columns and no progress bar after them: another line
    fields = [t.rstrip(":") for t in toks[:n]]
    if not re.match(r"\d+(?:/\d+)?$", fields[0]) or sum(map(_value, fields)) < max(2, (n + 1) // 2):
        return None
    return {c: v for c, v in zip(cols, fields) if "loss" in c.lower()}


def nonfinite_fields(buf: str, end: int) -> list[int]:
    """Where ``buf[:end]`` holds ``nan`` or ``inf`` as a field of its own (Python prints them lower case): found with
    ``str.find``, each checked for whitespace around it (a ``.0`` padding allowed)."""
    out = []
    for word in ("nan", "inf"):
        i = buf.find(word, 0, end)
        while i >= 0:
            before = buf[i - 1] if i else "\n"
            j = i + 3
            while j < end and buf[j] in ".0":
                j += 1
            after = buf[j] if j < end else "\n"
            if before in " \t\n+-" and after in " \t\r\n":
                out.append(i)
            i = buf.find(word, i + 3, end)
    return out


def nonfinite(value: str) -> bool:
    return bool(_NONFINITE.match(value))

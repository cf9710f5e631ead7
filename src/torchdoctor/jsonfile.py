"""One reader for the JSON files users hand to torchdoctor (DeepSpeed configs, TrainingArguments JSON, model configs).

:func:`load_object` reads a file (or ``-``: standard input) that must hold one JSON object, and every way that can
go wrong is a :class:`JsonFileError` whose message is ready to print -- never a traceback:

- a missing file, a directory, an unreadable file (a symlink loop says so: "Too many levels of symbolic links");
  ``-`` when the process has no standard input (``<&-``): "standard input is closed";
- more than :data:`MAX_BYTES` (16 MiB; a config is a few KB): a file that size is refused before it is read, and a
  pipe, standard input or a device that never ends (``/dev/zero``, ``cat /dev/zero |``) is read up to the cap and
  refused there, so memory stays bounded whatever the source (a FIFO is read as it is written: ``<(...)`` works);
- a pickle: ``.bin``/``.pt``/``.pkl``... refused by name before it is opened, and pickle / ``torch.save`` bytes
  refused by their first bytes, never unpickled (unpickling runs whatever code the file names);
- bytes that are not UTF-8 (a BOM is fine), an empty file;
- invalid JSON: ``file:line:col: message``, then the line (cut around the column when it is long) and a caret
  under the column, with a hint for comments and trailing commas;
- a key given twice in one object (``json.load`` silently keeps the last; DeepSpeed refuses), at the second one;
- nesting deeper than :data:`MAX_DEPTH` (no config is; Python's recursive code would fail on it);
- a top level that is not an object.

``NaN`` / ``Infinity`` are accepted, as ``json.load`` (and so DeepSpeed and transformers) accepts them; the checks
judge them. To write JSON that stays valid whatever it holds, use :func:`dumps`, which every ``--json`` goes
through: non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"`` (see :func:`json_safe` for why
strings rather than null).
"""

from __future__ import annotations

import errno
import io
import json
import json.decoder
import json.scanner
import math
import os
import re
import stat
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["JsonFileError", "load_object", "read_limited", "stdin_closed", "STDIN_CLOSED", "located", "dumps",
           "json_safe", "MAX_DEPTH", "MAX_BYTES", "PICKLE_SUFFIXES", "PICKLE_HINT"]

MAX_DEPTH = 100
# The most torchdoctor reads of one JSON file. DeepSpeed configs, TrainingArguments and model config.json files are
# a few KB; the cap is what keeps `ds check /dev/zero` from reading until the machine runs out of memory.
MAX_BYTES = 16 << 20
_CHUNK = 1 << 20
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
PICKLE_HINT = "torchdoctor never unpickles files (loading a pickle runs any code inside it); pass a JSON file."
STDIN = "-"
STDIN_CLOSED = "standard input is closed"  # what every reader of `-` says when there is none (`<&-`)
_STDIN_NAME = "<stdin>"
_EXCERPT = 100  # longest source line shown whole; longer ones are cut around the column
_TOO_DEEP = object()


class JsonFileError(ValueError):
    """A JSON file torchdoctor cannot use. The message is ready to print (it starts with the file's name)."""


# -- duplicate keys, refused where they are ----------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


class _DuplicateKeyAt(Exception):
    def __init__(self, key: str, pos: int) -> None:
        self.key, self.pos = key, pos


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _key_positions(s: str, start: int) -> Iterator[tuple[str, int]]:
    """(key, offset) of the keys of the object whose ``{`` is at ``start`` (the text there is valid JSON)."""
    depth, i, n = 0, start, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            value, end = json.decoder.scanstring(s, i + 1)
            j = end
            while j < n and s[j] in " \t\r\n":
                j += 1
            if depth == 1 and j < n and s[j] == ":":
                yield value, i
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return
        i += 1


class _Decoder(json.JSONDecoder):
    """``json`` with duplicate keys refused at the position of the second one."""

    def __init__(self) -> None:
        super().__init__(object_pairs_hook=_no_duplicates)
        self.parse_object = self._parse_object
        self.scan_once = json.scanner.py_make_scanner(self)

    @staticmethod
    def _parse_object(s_and_end, *args, **kwargs):
        s, end = s_and_end
        try:
            return json.decoder.JSONObject(s_and_end, *args, **kwargs)
        except _DuplicateKey as e:
            seen = [pos for key, pos in _key_positions(s, end - 1) if key == e.key]
            raise _DuplicateKeyAt(e.key, seen[1] if len(seen) > 1 else end - 1) from None


# -- messages -------------------------------------------------------------------------------------------------


def located(name: str, text: str, pos: int, message: str) -> str:
    """``name:line:col: message``, then ``line N:`` and the source line (cut around the column when long), caret."""
    pos = max(0, min(pos, len(text)))
    line = text.count("\n", 0, pos) + 1
    start = text.rfind("\n", 0, pos) + 1
    col = pos - start + 1
    end = text.find("\n", pos)
    src = text[start: len(text) if end < 0 else end].rstrip("\r")
    lead = f"line {line}: "
    left, right = "", ""
    at = col - 1
    if len(src) > _EXCERPT:
        lo = max(0, at - 60)
        hi = min(len(src), lo + _EXCERPT)
        left, right = ("..." if lo > 0 else ""), ("..." if hi < len(src) else "")
        src, at = src[lo:hi], at - lo
    src = "".join(ch if ch.isprintable() or ch == "\t" else "?" for ch in src)
    caret = " " * len(lead + left) + "".join("\t" if ch == "\t" else " " for ch in src[:at]) + "^"
    return f"{name}:{line}:{col}: {message}\n    {lead}{left}{src}{right}\n    {caret}"


def _hint(text: str, pos: int) -> str:
    here = text[pos: pos + 2]
    if here.startswith(("//", "/*", "#")):
        return (" (a comment: DeepSpeed's own reader, hjson, skips comments, but JSON, the HF Trainer's json.load"
                " and torchdoctor do not -- remove it)")
    before = text[:pos].rstrip()
    if before.endswith(",") and here[:1] in ("}", "]"):
        return " (a trailing comma: remove the ',' before it)"
    return ""


def _kind(obj: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', re.S)


def _too_deep_at(text: str, limit: int) -> int | None:
    """The offset of the bracket that opens level ``limit + 1``; None when the text never goes that deep."""
    depth = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return m.start()
        elif c in "]}":
            depth -= 1
    return None


def _depth(obj: Any) -> int:
    """How deeply ``obj`` nests arrays and objects (0 for a scalar), without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in o)
    return deepest


# -- the reader ------------------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n:,} bytes"


def _read_at_most(f: Any, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the buffered stream ``f``: one byte more than allowed says the source is too big,
    without reading on. A short read is the end: a terminal's Ctrl-D is not sticky, and reading on would wait for more.
    """
    chunks, n = [], 0
    while n <= limit:
        want = min(_CHUNK, limit + 1 - n)
        b = f.read(want)
        chunks.append(b)
        n += len(b)
        if len(b) < want:
            break
    return b"".join(chunks)


def _source_kind(mode: int | None) -> str:
    if mode is None:
        return "a stream"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a file"


def _mode(f: Any) -> int | None:
    try:
        return os.fstat(f.fileno()).st_mode
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None


def _too_big(name: str, what: str, limit: int, mode: int | None, size: int | None = None) -> JsonFileError:
    if size is not None:
        head = f"{name}: {size:,} bytes, more than the {_mib(limit)} torchdoctor reads of {what}"
    else:
        head = (f"{name}: {_source_kind(mode)} that did not end within {_mib(limit)}, the most torchdoctor reads "
                f"of {what}")
    return JsonFileError(f"{head}; one is a few KB: is it the right file?")


def stdin_closed() -> bool:
    """Whether this process has no standard input (``<&-``: Python then sets ``sys.stdin`` to None).

    The descriptor 0 is not looked at: in such a process the first file it opens gets descriptor 0, and reading
    that for ``-`` would read some other file."""
    stdin = sys.stdin
    return stdin is None or getattr(stdin, "closed", False)


def read_limited(path: str, what: str, *, limit: int = MAX_BYTES, pickle_hint: str = PICKLE_HINT) -> tuple[str, bytes]:
    """(the name to show, the bytes) of the file at ``path`` (``-``: standard input), at most ``limit`` bytes.

    A regular file larger than ``limit`` is refused unread; a pipe, standard input or a device is read up to
    ``limit`` and refused when it goes on, so nothing reads without end. Pickle names are refused unopened.

    Raises:
        JsonFileError: the message names the file and says why (missing, a directory, unreadable, too big; for
            ``-``, that standard input is closed).
    """
    if not path:
        raise JsonFileError(f"an empty file name: pass {what} (a JSON file, or - for standard input)")
    if path == STDIN:
        if stdin_closed():
            raise JsonFileError(f"{_STDIN_NAME}: {STDIN_CLOSED}; pass {what} as a file, or pipe it in")
        try:
            stream = sys.stdin.buffer
            mode = _mode(stream)
            raw = _read_at_most(stream, limit)
        except OSError as e:
            if e.errno == errno.EBADF:
                raise JsonFileError(f"{_STDIN_NAME}: {STDIN_CLOSED}; pass {what} as a file, or pipe it in") from None
            raise JsonFileError(f"{_STDIN_NAME}: cannot read standard input: {e.strerror or e}") from None
        except (AttributeError, ValueError) as e:  # a replaced sys.stdin without a binary buffer, or closed
            raise JsonFileError(f"{_STDIN_NAME}: cannot read standard input: {e}") from None
        if len(raw) > limit:
            raise _too_big(_STDIN_NAME, what, limit, mode)
        return _STDIN_NAME, raw
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise JsonFileError(f"{path}: a {os.path.splitext(path)[1]} file is a pickle (torch.save), not JSON. "
                            + pickle_hint)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError
            if stat.S_ISREG(st.st_mode) and st.st_size > limit:
                raise _too_big(path, what, limit, st.st_mode, st.st_size)
            raw = _read_at_most(f, limit)
    except FileNotFoundError:
        if os.path.islink(path):
            raise JsonFileError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist ({what})") \
                from None
        raise JsonFileError(f"{path}: no such file ({what})") from None
    except IsADirectoryError:
        raise JsonFileError(f"{path}: is a directory; pass {what} (a JSON file)") from None
    except OSError as e:
        if os.path.isdir(path):
            raise JsonFileError(f"{path}: is a directory; pass {what} (a JSON file)") from None
        raise JsonFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(raw) > limit:  # a device, a pipe, or a file that grew while it was read
        raise _too_big(path, what, limit, st.st_mode)
    return path, raw


def load_object(path: str, what: str = "a JSON object", *, pickle_hint: str = PICKLE_HINT) -> dict:
    """The JSON object in the file at ``path`` (``-``: standard input).

    Args:
        path: the file.
        what: what the file should be, with its article, for the messages ("a DeepSpeed config").
        pickle_hint: appended when the file is a pickle (what to pass instead).

    Raises:
        JsonFileError: see the module docstring; the message names the file (``file:line:col`` when it can).
    """
    name, raw = read_limited(path, what, pickle_hint=pickle_hint)
    # Protocol 2+ pickles start with 0x80 <protocol>; torch.save's zip format with PK\x03\x04. Sniffed, never loaded.
    if (len(raw) >= 2 and raw[0] == 0x80 and 2 <= raw[1] <= 5) or raw.startswith(b"PK\x03\x04"):
        raise JsonFileError(f"{name}: this is a pickle / torch.save file, not JSON. " + pickle_hint)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
        good = raw[bom: e.start].decode("utf-8", errors="replace")
        line = good.count("\n") + 1
        col = len(good) - (good.rfind("\n") + 1) + 1
        raise JsonFileError(f"{name}:{line}:{col}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                            f"{what} is a UTF-8 JSON text file") from None
    if not text.strip():
        raise JsonFileError(f"{name}: the file is empty; {what} is a JSON object {{...}}")
    try:
        obj = _Decoder().decode(text)
    except json.JSONDecodeError as e:
        raise JsonFileError(located(name, text, e.pos, f"invalid JSON: {e.msg}{_hint(text, e.pos)}")) from None
    except _DuplicateKeyAt as e:
        raise JsonFileError(located(name, text, e.pos, f'duplicate key "{e.key}" in one object (json.load would '
                                                       "silently keep the last, DeepSpeed refuses it): keep one"))\
            from None
    except RecursionError:
        obj = _TOO_DEEP  # located below
    except ValueError as e:  # an integer longer than Python's int-to-str limit (4300 digits)...
        raise JsonFileError(f"{name}: invalid JSON: {e}") from None
    if obj is _TOO_DEEP or _depth(obj) > MAX_DEPTH:
        pos = _too_deep_at(text, MAX_DEPTH)
        msg = f"nested more than {MAX_DEPTH} levels deep; {what} never is"
        raise JsonFileError(located(name, text, pos, msg) if pos is not None else f"{name}: {msg}")
    if not isinstance(obj, dict):
        raise JsonFileError(f"{name}: the top level is {_kind(obj)}; {what} is a JSON object {{...}}")
    return obj


# -- writing -------------------------------------------------------------------------------------------------------


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no such numbers:
    ``json.dumps`` would write the invalid literals ``NaN`` / ``Infinity``). Tuples become lists."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that always writes valid JSON: non-finite floats as strings (:func:`json_safe`)."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)

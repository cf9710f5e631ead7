"""How DeepSpeed reads a config value, and the text and edits of the fixes that set one.

Pydantic's lax coercion inside DeepSpeed's models (``"16"`` is an int there, ``"true"`` a bool), the raw JSON value
everywhere else; what a spec accepts in words; the values to suggest; and the machine-readable edits
(``data["edits"]``) of a fix. Shared by :mod:`.validate` and :mod:`.rules`.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

from .schema import Spec

# -- reading values as DeepSpeed does --------------------------------------------------------------------------

_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})
_FALSE = frozenset({"0", "false", "no", "off", "f", "n"})
_NO = object()  # no default / no match


def _lax_bool(v: Any) -> bool | None:
    """How pydantic (DeepSpeed's config models) reads a boolean; None when it refuses the value."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
    return None


def _lax_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):  # pydantic takes whole floats that fit in 64 bits
        return int(v) if math.isfinite(v) and v.is_integer() and abs(v) < 2**63 else None
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _lax_float(v: Any) -> float | None:
    try:
        if isinstance(v, (bool, int, float)):
            return float(v)
        if isinstance(v, str):
            return float(v.strip())
    except (ValueError, OverflowError):
        return None
    return None


def _in_bounds(x: float, spec: Spec) -> bool:
    try:
        return ((spec.ge is None or x >= spec.ge) and (spec.gt is None or x > spec.gt)
                and (spec.le is None or x <= spec.le) and (spec.lt is None or x < spec.lt))
    except OverflowError:  # an int too large to compare with a float bound
        return False


def _choice(v: Any, spec: Spec, lax: bool) -> Any:
    for c in spec.values:
        if isinstance(c, str):
            if isinstance(v, str) and (v == c or (spec.icase and v.lower() == c.lower())):
                return c
        elif isinstance(c, int):
            n = _lax_int(v) if lax else (v if isinstance(v, int) and not isinstance(v, bool) else None)
            if n is not None and n == c:
                return c
    return _NO


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _judge(spec: Spec, v: Any, lax: bool) -> tuple[str, str] | None:
    """(severity, why) when DeepSpeed would refuse ``v`` (fail) or read it surprisingly (warn); None when fine."""
    k = spec.kind
    if k == "any":
        return None
    if v is None:
        return None if spec.nullable else ("fail", "null is not accepted here")
    if k in ("block", "dict"):
        return None if isinstance(v, dict) else ("fail", f"a {_json_type(v)}, not an object")
    if k == "bool":
        if isinstance(v, bool) or (lax and _lax_bool(v) is not None):
            return None
        if not lax and isinstance(v, str):
            return ("fail", 'a string, not a boolean: DeepSpeed reads this key as given, so any non-empty string '
                            '-- "false" too -- counts as true')
        return ("fail", f"a {_json_type(v)}, not a boolean")
    if k in ("int", "float"):
        if isinstance(v, bool):
            if not lax or spec.nobool:
                return ("fail", "a boolean where a number belongs")
            if not _in_bounds(int(v), spec):
                return ("fail", f"read as {int(v)}, which is out of range")
            return ("warn", "a boolean where a number belongs (DeepSpeed's config model reads true as 1, false"
                            " as 0)")
        if lax:
            x = _lax_int(v) if k == "int" else _lax_float(v)
        elif k == "int":
            x = v if isinstance(v, int) else None
        else:
            x = v if isinstance(v, (int, float)) else None
        if x is None:
            if k == "int" and isinstance(v, float) and math.isfinite(v) and v.is_integer() and lax:
                return ("fail", "a float its config model does not take as an integer")
            if k == "int" and isinstance(v, float) and math.isfinite(v) and v.is_integer():
                # outside the config models DeepSpeed's parser takes it (get_scalar_param keeps the float):
                # arithmetic on it works, only code that insists on an int refuses it -- so not a refusal
                if not _in_bounds(v, spec):
                    return ("fail", "out of range")
                return ("warn", "a float (JSON `1e5` and `100.0` are floats): DeepSpeed uses this key as given, so "
                                "it stays a float -- arithmetic accepts it, code that wants an integer (a "
                                "DataLoader's batch size, range()) refuses it; write it without a decimal point")
            return ("fail", f"a {_json_type(v)}, not {'an integer' if k == 'int' else 'a number'}"
                    if not isinstance(v, (int, float)) else "not an integer")
        if spec.finite and isinstance(x, float) and not math.isfinite(x):
            return ("fail", "not a finite number")
        if not _in_bounds(x, spec):
            return ("fail", "out of range")
        return None
    if k in ("str", "path"):
        return None if isinstance(v, str) else ("fail", f"a {_json_type(v)}, not a string")
    if k == "choice":
        return None if _choice(v, spec, lax) is not _NO else ("fail", "not one of the accepted values")
    return None


def _bounds_text(spec: Spec) -> str:
    if spec.ge is not None and spec.le is not None:
        return f" in [{spec.ge:g}, {spec.le:g}]"
    parts = [f"{sym} {getattr(spec, n):g}" for n, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
             if getattr(spec, n) is not None]
    return " " + " and ".join(parts) if parts else ""


def _expect(spec: Spec) -> str:
    k = spec.kind
    if k == "bool":
        s = "true or false"
    elif k == "int":
        s = "an integer" + _bounds_text(spec)
    elif k == "float":
        s = ("a finite number" if spec.finite else "a number") + _bounds_text(spec)
    elif k == "str":
        s = "a string"
    elif k == "path":
        s = "a path (a string)"
    elif k == "choice":
        s = "one of " + ", ".join(_show(v) for v in spec.values) + (" (any case)" if spec.icase else "")
    elif k in ("block", "dict"):
        s = "a JSON object {...}"
    else:
        s = "any value"
    return s + (" or null" if spec.nullable and k != "any" else "")


def _default(spec: Spec) -> Any:
    if spec.default is None:
        return _NO
    try:
        return json.loads(spec.default)
    except ValueError:
        return _NO


# Values for the fixes of the string keys that have no default.
_STR_EXAMPLES = {"optimizer.type": "AdamW", "scheduler.type": "WarmupLR", "nvme_path": "/local_nvme"}


def _examples(spec: Spec, v: Any, key: str = "") -> list[Any]:
    """Values to put in a fix of ``key``, best first: the nearest accepted choice, the value made whole and clamped
    into range, the default, a value of the right type. The walker keeps the first that passes the whole check."""
    out: list[Any] = []
    if spec.kind == "choice":
        strs = [c for c in spec.values if isinstance(c, str)]
        if isinstance(v, str) and strs:
            m = difflib.get_close_matches(v.lower(), [s.lower() for s in strs], n=1, cutoff=0.5)
            if m:
                out.append(next(s for s in strs if s.lower() == m[0]))
        ints = [c for c in spec.values if isinstance(c, int)]
        x = _lax_float(v)
        if ints and x is not None and math.isfinite(x):
            out.append(min(ints, key=lambda c: abs(c - x)))
    if spec.kind in ("int", "float"):
        x = _lax_float(v)
        if x is not None and math.isfinite(x) and not isinstance(v, bool):
            if spec.kind == "int" and not x.is_integer():
                x = math.copysign(1, x) if abs(x) < 1 else round(x)  # 0.0001 -> 1, not 0 (0 often means "off")
            lo = spec.ge if spec.ge is not None else (spec.gt + (1 if spec.kind == "int" else 0) if spec.gt is not None
                                                      else None)
            hi = spec.le if spec.le is not None else spec.lt
            if lo is not None and x < lo:
                x = lo
            if hi is not None and x > hi:
                x = hi
            out.append(int(x) if spec.kind == "int" else float(x))
    d = _default(spec)
    if d is not _NO and d is not None:
        out.append(d)
    if spec.kind == "bool":
        out.append(True)
    elif spec.kind in ("int", "float"):
        out.append(1)
    elif spec.kind == "choice" and spec.values:
        out.append(spec.values[0])
    elif spec.kind in ("str", "path"):
        out.append(_STR_EXAMPLES.get(key, _STR_EXAMPLES.get(key.rpartition(".")[2], "...")))
    else:
        out.append({} if spec.kind in ("block", "dict") else "...")
    unique: list[Any] = []
    for c in out:
        if not any(type(c) is type(u) and c == u for u in unique):
            unique.append(c)
    return unique


def _with(config: Any, path: tuple, value: Any) -> Any:
    """A copy of ``config`` with ``value`` at ``path`` (the dicts along the path copied, missing ones created)."""
    if not path:
        return value
    d = dict(config) if isinstance(config, dict) else {}
    d[path[0]] = _with(d.get(path[0]), path[1:], value)
    return d


def _set(path: tuple | list, value: Any) -> dict[str, Any]:
    """One machine-readable edit of a fix (``data["edits"]``): set ``value`` at the key ``path``."""
    return {"path": [str(p) for p in path], "value": value}


def _rm(path: tuple | list) -> dict[str, Any]:
    """One machine-readable edit of a fix: remove the key at ``path``."""
    return {"path": [str(p) for p in path], "remove": True}


_SNIPPET_START = re.compile(r'(?:^|: |e\.g\. |or |keep one: |then )(?=")')
_COLON = re.compile(r"\s*:\s*")
_NEXT_MEMBER = re.compile(r"\s*,\s*(?=\")")


def snippet_edits(line: str) -> list[dict[str, Any]]:
    """The edits the first JSON snippet of a fix line spells out (``'"fp16": {"hysteresis": 2}  (default)'`` ->
    set fp16.hysteresis to 2): the machine-readable form of a fix whose text is a config snippet, so the two never
    disagree. [] when the line has no JSON snippet (``'"params": {...}'`` is not one)."""
    dec = json.JSONDecoder()
    for m in _SNIPPET_START.finditer(line):
        members: dict[str, Any] = {}
        j = m.end()
        try:
            while True:
                key, j = json.decoder.scanstring(line, j + 1)
                colon = _COLON.match(line, j)
                if not colon:
                    raise ValueError("no colon")
                value, j = dec.raw_decode(line, colon.end())
                members[key] = value
                more = _NEXT_MEMBER.match(line, j)
                if not more:
                    break
                j = more.end()
        except ValueError:
            continue
        return _leaf_edits(members, ())
    return []


def _leaf_edits(d: dict, path: tuple) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k, v in d.items():
        out += _leaf_edits(v, (*path, k)) if isinstance(v, dict) and v else [_set((*path, k), v)]
    return out


def _show(v: Any, limit: int = 60) -> str:
    try:
        s = json.dumps(v, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _json_at(dotted: str, value_text: str) -> str:
    """``"a": {"b": VALUE}`` for the key path ``a.b``: a snippet to merge at the top level of the config."""
    parts = dotted.split(".")
    out = value_text
    for p in reversed(parts[1:]):
        out = f'{{"{p}": {out}}}'
    return f'"{parts[0]}": {out}'


def _suggest(key: str, candidates: list[str]) -> str | None:
    low = {c.lower(): c for c in candidates}
    if key.lower() in low:
        return low[key.lower()]
    m = difflib.get_close_matches(key.lower(), list(low), n=1, cutoff=0.7)
    return low[m[0]] if m else None

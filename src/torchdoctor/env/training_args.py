"""TrainingArguments for the bug-report bundle: read, and diffed against transformers' defaults.

TrainingArguments come from a JSON object (``trainer.args.to_json_string()``) or a command-line string
(``"--learning_rate 1e-4 --fp16 --report_to wandb tensorboard"``). :func:`training_args_diff` compares them with the
*dataclass field defaults* of ``transformers.TrainingArguments`` (never an instance: ``__post_init__`` touches
devices, TF32 flags and environment variables). ``to_json_string()`` output holds values ``__post_init__`` derived
from an untouched default, so these count as the default (checked against transformers 5.24's real output):

- ``output_dir``: ``None`` becomes ``"trainer_output"``.
- ``activation_checkpointing`` / ``gradient_checkpointing``: ``None`` becomes ``False``; the deprecated
  ``gradient_checkpointing[_kwargs]`` mirrors ``activation_checkpointing[_kwargs]``, so when both are given and
  equal only the new name is listed.
- ``report_to``: ``"none"`` becomes ``[]``; ``debug`` and ``fsdp``: ``""`` becomes ``[]`` (space-separated lists).
- ``accelerator_config``: ``None`` becomes the dict of ``AcceleratorConfig``'s defaults.
- ``include_num_input_tokens_seen``: ``True``/``False`` become ``"all"``/``"no"``.
- ``run_name`` equal to ``output_dir`` (older transformers derive it so).

Skipped altogether (:data:`SKIPPED_FIELDS`): ``disable_tqdm`` (``None`` becomes ``True`` or ``False`` from the
logging level of the process that dumped it, not from the user), ``logging_dir`` (older transformers derive
``<output_dir>/runs/<date>_<host>``), ``local_rank`` (set per process by the launcher or ``$LOCAL_RANK``).
``*_token`` fields are always ``"<HUB_TOKEN>"`` in ``to_json_string()`` output, so that placeholder is skipped; a
real token (from a command line) is listed as ``"<redacted>"``, never its value. Values ``__post_init__`` derives
from something the user *did* change (``do_eval`` from ``eval_strategy``, ``eval_steps`` from ``logging_steps``,
``metric_for_best_model``, ``torch_compile_backend``...) are listed: they are what the run used.

Command-line strings follow ``HfArgumentParser``: ``--key value``, ``--key=value``, ``--key-name`` as ``key_name``,
a bare ``--flag`` is ``True``, ``--no_flag`` is ``flag=False`` for bool fields whose default is ``True`` (the only
ones the parser gives a ``--no_`` form), list fields (``report_to``, ``label_names``...) take every value up to the
next option. Words before the first option (``python train.py``) are left out, and the diff's note says which.
Without transformers, values are read as literals (``true``/``false``, ``null``/``None``, ints, floats, JSON objects
and arrays), ``--no_x`` stays ``no_x``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import math
import os
import re
import shlex
import types
import typing
from collections.abc import Iterable
from typing import Any

from ..jsonfile import PICKLE_SUFFIXES
from .bundle import BundleError, read_json_object

__all__ = ["load_training_args", "TrainingArgs", "training_args_diff", "SKIPPED_FIELDS", "REDACTED", "SECRET_KEY"]

REDACTED = "<redacted>"
SECRET_KEY = re.compile(r"(?:^|_)(?:token|api_?key|password|secret)$", re.IGNORECASE)

SKIPPED_FIELDS = frozenset({"disable_tqdm", "logging_dir", "local_rank"})


class TrainingArgs(dict):
    """The arguments :func:`load_training_args` read (a plain dict of them), with ``notes``: what the reading left
    out and why, which :func:`training_args_diff` passes on so the report says so."""

    def __init__(self, *args: Any, notes: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notes = list(notes)

_PICKLE_HINT = (
    "torchdoctor never unpickles files (loading a pickle runs any code inside it). Pass the arguments as JSON "
    "instead: in your script, `open('training_args.json', 'w').write(trainer.args.to_json_string())`, then "
    "`--training-args training_args.json`; or pass the command-line arguments as one string."
)
_TRUE = ("yes", "true", "t", "y", "1")
_FALSE = ("no", "false", "f", "n", "0")
_NONE_TYPE = type(None)


# -- TrainingArguments: fields and coercion -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    type: Any
    default: Any  # dataclasses.MISSING when the field has none


@functools.lru_cache(maxsize=1)
def _ta_fields() -> tuple[dict[str, _Field], str] | None:
    """``{name: _Field}`` of transformers.TrainingArguments' init fields and ``"transformers X.Y.Z"``, or None."""
    try:
        import transformers
        from transformers import TrainingArguments
    except Exception:  # not installed, or broken: report without defaults
        return None
    try:
        hints = typing.get_type_hints(TrainingArguments)
    except Exception:
        hints = {}
    table: dict[str, _Field] = {}
    for f in dataclasses.fields(TrainingArguments):
        if not f.init:
            continue  # to_dict() leaves these out too
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        tp = hints.get(f.name, f.type)
        table[f.name] = _Field(f.name, Any if isinstance(tp, str) else tp, default)
    return table, f"transformers {transformers.__version__}"


@functools.lru_cache(maxsize=1)
def _accelerator_defaults() -> dict | None:
    """AcceleratorConfig's field defaults, what ``__post_init__`` fills ``accelerator_config=None`` with."""
    try:
        from transformers.trainer_pt_utils import AcceleratorConfig
    except Exception:
        return None
    out = {}
    for f in dataclasses.fields(AcceleratorConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return _norm(out)


def _members(tp: Any) -> list[Any]:
    """The members of a Union (``X | None`` included), else ``[tp]``."""
    if typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType):
        return list(typing.get_args(tp))
    return [tp]


def _list_item(tp: Any) -> Any | None:
    """The item type when ``tp`` is (or a Union member is) ``list[X]``; None when no list is accepted."""
    for m in _members(tp):
        if m is list:
            return Any
        if typing.get_origin(m) is list:
            args = typing.get_args(m)
            return args[0] if args else Any
    return None


def _accepts_bool(tp: Any) -> bool:
    return any(m is bool or (typing.get_origin(m) is typing.Literal and True in typing.get_args(m))
               for m in _members(tp))


def _str_to_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"not a boolean (use one of {', '.join(_TRUE + _FALSE)})")


def _scalar(tp: Any, raw: str) -> Any:
    """One command-line word as ``tp`` reads it. Raises ValueError."""
    members = _members(tp)
    if len(members) > 1:
        if _NONE_TYPE in members and str not in members and raw.strip().lower() in ("none", "null"):
            return None
        # list members are for several words (see _coerce); one word is read by the scalar members
        rest = [m for m in members if m is not _NONE_TYPE and _list_item(m) is None] or [
            m for m in members if m is not _NONE_TYPE]
        last: ValueError | None = None
        for m in sorted(rest, key=lambda m: m is str):  # str last: any other reading wins
            try:
                return _scalar(m, raw)
            except ValueError as e:
                last = e
        raise last or ValueError("no type accepts it")
    if tp is Any or tp is str:
        return raw
    if tp is bool:
        return _str_to_bool(raw)
    if tp is int:
        return int(raw)
    if tp is float:
        try:
            return int(raw)  # "500" stays 500, as to_json_string() shows whole-number floats
        except ValueError:
            return float(raw)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        for choice in typing.get_args(tp):
            if isinstance(choice, bool):
                try:
                    if _str_to_bool(raw) is choice:
                        return choice
                except ValueError:
                    pass
            elif str(choice) == raw:
                return choice
        raise ValueError(f"not one of {list(typing.get_args(tp))}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        choices = [m.value for m in tp]
        if raw in choices:
            return raw
        raise ValueError(f"not one of {choices}")
    if tp is dict or origin is dict:
        if not raw.lstrip().startswith("{"):
            raise ValueError("not a JSON object")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return value
    if tp is list or origin is list:
        item = _list_item(tp)
        return [_scalar(item, raw)]
    # Some other class (accelerate's ParallelismConfig...): a JSON object if it looks like one, else the word.
    if raw.lstrip().startswith("{"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _literal(raw: str) -> Any:
    """A word read without knowing its type: bool, null, int, float, JSON object/array, else the string."""
    low = raw.strip().lower()
    if low == "true":
        return True
    if low == "false":
        return False
    if low in ("null", "none"):
        return None
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    return raw


def _coerce(field: _Field | None, key: str, words: list[str]) -> Any:
    """The value of ``--key words...`` (``words`` empty for a bare flag). Raises BundleError."""
    if field is None:  # unknown key, or no transformers: literals
        if not words:
            return True
        values = [_literal(w) for w in words]
        return values[0] if len(values) == 1 else values
    tp = field.type
    item = _list_item(tp)
    try:
        if not words:
            if _accepts_bool(tp) or tp is Any:
                return True
            raise BundleError(f"--{key} needs a value")
        if item is not None and (len(words) > 1 or all(m is _NONE_TYPE or _list_item(m) for m in _members(tp))):
            return [_scalar(item, w) for w in words]
        if len(words) > 1:
            raise BundleError(f"--{key} takes one value, got {len(words)}: {' '.join(map(shlex.quote, words))}")
        return _scalar(tp, words[0])
    except ValueError as e:
        if isinstance(e, BundleError):
            raise
        raise BundleError(f"--{key} {' '.join(map(shlex.quote, words))}: {e}") from None


def _is_option(word: str) -> bool:
    if not word.startswith("-") or word in ("-", "--"):
        return False
    try:
        float(word)  # "-1", "-0.1", "-1e-5" are values
    except ValueError:
        return True
    return False


def _parse_cli(spec: str, table: dict[str, _Field] | None) -> dict:
    try:
        words = shlex.split(spec)
    except ValueError as e:
        raise BundleError(f"cannot split the arguments string like a shell would: {e}") from None
    groups: list[tuple[str, list[str], bool]] = []  # (key, values, given with '=')
    ignored: list[str] = []
    for w in words:
        if _is_option(w):
            key, eq, value = w.lstrip("-").partition("=")
            key = key.replace("-", "_")
            if not key:
                raise BundleError(f"{w!r}: an option without a name")
            groups.append((key, [value] if eq else [], bool(eq)))
        elif groups:
            key, values, eq = groups[-1]
            if eq:
                raise BundleError(f"{w!r} after --{key}={values[0]}: an --option=value takes one value")
            values.append(w)
        else:  # words before the first option (`python train.py`, `deepspeed train.py`) are not arguments
            ignored.append(w)
    if not groups:
        raise BundleError(
            f"{spec!r}: no such file, and no --options in it; pass a JSON file (trainer.args.to_json_string()) "
            "or the arguments as one string, e.g. \"--learning_rate 1e-4 --fp16\""
        )
    notes = []
    if ignored:
        shown = " ".join(w if w and not any(c.isspace() or c in "'\"\\" for c in w) else shlex.quote(w)
                         for w in ignored)
        notes.append(f"ignored before the first --option: {shown} (not arguments of TrainingArguments: a script "
                     "name, or a stray word?)")
    out = TrainingArgs(notes=notes)
    for key, values, _ in groups:
        field = table.get(key) if table is not None else None
        if table is not None and field is None and key.startswith("no_") and not values:
            target = table.get(key[3:])
            if target is not None and target.default is True and _accepts_bool(target.type):
                out[target.name] = False  # HfArgumentParser's --no_<field> (store_false) for bools defaulting to True
                continue
        out[key] = _coerce(field, key, values)
    return out


def load_training_args(spec: str) -> dict:
    """TrainingArguments as given: a JSON file (``trainer.args.to_json_string()`` output) or a command-line string.

    A file's string values are read with the field's type when they can be (``"1e-4"`` for ``learning_rate``),
    else kept. A command-line string is read as ``HfArgumentParser`` would (see the module docstring). Keys that
    are not TrainingArguments fields are kept as given; :func:`training_args_diff` lists them.

    Raises:
        BundleError: a pickle (``training_args.bin``: refused unread), a directory, a missing ``*.json`` file, invalid
            JSON, a non-object JSON, a string without ``--options``, or a value its field's type cannot read.
    """
    if not spec or not spec.strip():
        raise BundleError("the training arguments are empty; pass a JSON file or a string of --options")
    path = spec.strip()
    looks_like_file = not path.startswith("-") and not any(c.isspace() for c in path)
    if os.path.isdir(path):
        raise BundleError(f"{path}: is a directory; pass the training arguments JSON file (to_json_string output)")
    if path.lower().endswith(PICKLE_SUFFIXES) and looks_like_file:
        # Refused by name, existing or not (never opened): training_args.bin is torch.save, i.e. pickle.
        raise BundleError(f"{path}: training_args.bin and other {os.path.splitext(path)[1]} files are pickles. "
                          + _PICKLE_HINT)
    # Anything that exists and is not a folder is read as a file: a FIFO or <(...) too, and /dev/zero is refused
    # at jsonfile's size cap instead of being taken for a string of options. lexists: a symlink loop or a dangling
    # link is a file name too, and jsonfile says what is wrong with it (as for every other JSON input).
    if os.path.lexists(path):
        args = read_json_object(path, "a TrainingArguments file (to_json_string() output)", _PICKLE_HINT)
        info = _ta_fields()  # after the file is read: a file that cannot be read is said before transformers loads
        table = info[0] if info else None
        if table is None:
            return args
        out = {}
        for k, v in args.items():
            field = table.get(k)
            if field is not None and isinstance(v, str) and field.type not in (str, Any):
                with contextlib.suppress(ValueError):  # unreadable: kept as written, the diff shows it
                    v = _scalar(field.type, v)
            out[k] = v
        return out
    if looks_like_file and path.lower().endswith((".json", ".yaml", ".yml", ".txt")):
        raise BundleError(f"{path}: no such file (training arguments)")
    info = _ta_fields()
    return _parse_cli(spec, info[0] if info else None)


# -- TrainingArguments: the diff ------------------------------------------------------------------------


def _norm(v: Any) -> Any:
    """JSON-shaped value: enums to their value, tuples/sets to lists, recursively."""
    if isinstance(v, enum.Enum):
        return _norm(v.value)
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((_norm(x) for x in v), key=repr)
    if isinstance(v, dict):
        return {str(k): _norm(x) for k, x in v.items()}
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _word_list(v: Any, none_is: list[str]) -> Any:
    """report_to / debug / fsdp: a string or list of names, as the list ``__post_init__`` makes of it."""
    if v is None:
        return list(none_is)
    if isinstance(v, str):
        v = v.split()
    if isinstance(v, list):
        names = [str(x) for x in v]
        return [] if names == ["none"] else names
    return v


def _is_default(name: str, value: Any, default: Any, args: dict) -> bool:
    if default is dataclasses.MISSING:
        return False
    default = _norm(default)
    if _same(value, default):
        return True
    if name == "output_dir":
        return default is None and value == "trainer_output"
    if name in ("activation_checkpointing", "gradient_checkpointing"):
        return default is None and value is False
    if name == "report_to":
        return _same(_word_list(value, ["all"]), _word_list(default, ["all"]))  # None meant "all" before 5.0
    if name in ("debug", "fsdp"):
        return _same(_word_list(value, []), _word_list(default, []))
    if name == "accelerator_config":
        # Keys left out take their default; the JSON may hold fewer keys than the dataclass has.
        defaults = _accelerator_defaults()
        return (default is None and isinstance(value, dict) and defaults is not None
                and all(k in defaults and _same(x, defaults[k]) for k, x in value.items()))
    if name == "include_num_input_tokens_seen" and isinstance(value, bool):
        return _same("all" if value else "no", default)
    if name == "run_name":
        return default is None and value is not None and value == _norm(args.get("output_dir"))
    return False


def _is_placeholder(key: str, value: Any) -> bool:
    """``to_dict()`` writes every ``*_token`` field as ``"<FIELD_NAME>"`` whatever it holds."""
    return value is None or value == f"<{key.upper()}>" or value == REDACTED


def training_args_diff(args: dict) -> dict:
    """The arguments in ``args`` that differ from transformers.TrainingArguments' defaults.

    Returns:
        dict: ``{"changed": {key: value}, "unknown": [keys that are not TrainingArguments fields],
        "defaults_from": "transformers X.Y.Z" | None, "note": str | None}``. Unknown keys are in ``changed`` too
        (with their values: they may be the script's own arguments). Secret-looking keys (``*_token``,
        ``*api_key``, ``*password``, ``*secret``) never carry their value, only ``"<redacted>"``.
    """
    info = _ta_fields()
    given_notes = list(getattr(args, "notes", ()))
    args = {k: _norm(v) for k, v in args.items()}
    if info is None:
        changed = {k: (REDACTED if SECRET_KEY.search(k) else v) for k, v in args.items()
                   if not (SECRET_KEY.search(k) and _is_placeholder(k, v))}
        return {
            "changed": changed,
            "unknown": [],
            "defaults_from": None,
            "note": "; ".join([*given_notes, "transformers is not importable here, so its defaults are unknown: "
                               "every argument given is listed, and none could be checked against the "
                               "TrainingArguments fields"]),
        }
    table, source = info
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if old in args and new in args and old in table and new in table and _same(args[old], args[new]):
            args.pop(old)  # the deprecated alias mirrors the new name after __post_init__
    changed: dict[str, Any] = {}
    unknown: list[str] = []
    skipped: list[str] = []
    for key, value in args.items():
        field = table.get(key)
        if SECRET_KEY.search(key):
            if not _is_placeholder(key, value):
                changed[key] = REDACTED
                if field is None:
                    unknown.append(key)
            continue
        if field is None:
            changed[key] = value
            unknown.append(key)
        elif key in SKIPPED_FIELDS:
            if not _is_default(key, value, field.default, args) and not (key == "disable_tqdm" and value is False):
                skipped.append(key)  # worth a word only when it is not what an untouched run shows
        elif not _is_default(key, value, field.default, args):
            changed[key] = value
    notes = list(given_notes)
    if skipped:
        notes.append(f"not compared: {', '.join(skipped)} (set by the environment or derived by TrainingArguments, "
                     "not chosen by the user)")
    return {"changed": changed, "unknown": unknown, "defaults_from": source, "note": "; ".join(notes) or None}

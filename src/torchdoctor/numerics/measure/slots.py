"""Name every value a module receives or returns: the *slots* of a frame.

A module's forward gets positional and keyword arguments and returns anything: a tensor, a tuple or
list, a dict, a dataclass or a transformers ``ModelOutput``, nested. This module walks such values
and yields ``(label, value)`` pairs for the leaves, with labels in the transformers layout:
``input[0]``, ``input[attention_mask]``, ``output``, ``output[0]``, ``output[0][1]``,
``output[loss]``.

``hf_compat=True`` reproduces exactly the lines transformers' ``DebugUnderflowOverflow`` prints
(it expands only the positional-input tuple, an output tuple and a tuple inside it, and prints
``not a tensor`` for anything else) and adds our extra lines (keyword inputs, contents of dicts,
lists, dataclasses) right after the line transformers would print.

Each leaf also says whether transformers itself reaches it (``visible``): only those are judged in
compat mode, so that a value transformers never looks at (an ``-inf`` ``attn_mask=`` keyword, a
tensor inside a ``ModelOutput``) is shown but never stops a run transformers would let go on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

NOT_A_TENSOR = "not a tensor"

# Containers deeper than this are labelled "not a tensor" instead of being walked.
_MAX_DEPTH = 4


def _children(value: Any) -> list[tuple[str, Any]] | None:
    """Named children of a container, or None when ``value`` is a leaf."""
    if isinstance(value, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(value)]
    if isinstance(value, Mapping):  # dict, OrderedDict, transformers ModelOutput
        return [(str(k), v) for k, v in value.items()]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    return None


_OPAQUE_TYPES: set[type] = set()  # types seen not to be containers (a transformers Cache): asked once each


def is_container(value: Any) -> bool:
    """Is ``value`` one the labelling walks into (a tuple, list, mapping or dataclass instance), not a leaf?"""
    cls = type(value)
    if cls in _OPAQUE_TYPES:
        return False
    if isinstance(value, (tuple, list, Mapping)) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return True
    if len(_OPAQUE_TYPES) < 256:
        _OPAQUE_TYPES.add(cls)
    return False


def _walk(
    value: Any, label: str, depth: int, hf_visible_depth: int, hf: bool, visible: bool = True
) -> Iterator[tuple[str, Any, bool]]:
    """Yield ``(label, leaf, visible)`` under ``value``.

    ``hf_visible_depth`` is how many more tuple levels transformers itself would expand here; when a
    container is one transformers would not expand, in compat mode we first yield its
    "not a tensor" line (the line transformers prints) and then our expansion of it.
    """
    if isinstance(value, torch.Tensor) or value is None:
        yield label, value, visible
        return
    children = _children(value)
    if children is None or depth >= _MAX_DEPTH:
        yield label, NOT_A_TENSOR, visible
        return
    hf_expands = isinstance(value, tuple) and hf_visible_depth > 0
    if hf and not hf_expands:
        yield label, NOT_A_TENSOR, visible
    for name, child in children:
        # ModelOutput drops None fields from .items(); dataclass fields may be None: keep them labelled
        depth_left = hf_visible_depth - 1 if hf_expands else 0
        yield from _walk(child, f"{label}[{name}]", depth + 1, depth_left, hf, visible and hf_expands)


def visible_inputs(args: tuple, kwargs: Mapping[str, Any] | None, hf: bool = False) -> Iterator[tuple[str, Any, bool]]:
    """``(label, value, visible)`` of a forward call's arguments: ``input[i]``, then ``input[name]``."""
    for i, a in enumerate(args):
        yield from _walk(a, f"input[{i}]", 1, 0, hf)
    if kwargs:
        for k, v in kwargs.items():
            # keyword inputs are our addition: transformers never saw them, so never "not a tensor" first
            yield from _walk(v, f"input[{k}]", 1, 0, False, visible=False)


def visible_outputs(output: Any, hf: bool = False) -> Iterator[tuple[str, Any, bool]]:
    """``(label, value, visible)`` of a forward's return value: ``output``, ``output[i]``, ``output[i][j]``,
    ``output[key]``."""
    if isinstance(output, tuple):
        for i, o in enumerate(output):
            yield from _walk(o, f"output[{i}]", 1, 1, hf)
    else:
        yield from _walk(output, "output", 0, 0, hf)


INPUT_LABELS = tuple(f"input[{i}]" for i in range(8))
OUTPUT_LABELS = tuple(f"output[{i}]" for i in range(8))
_KEYWORD_LABELS: dict[str, str] = {}


def _leaf(value: Any) -> bool:
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def labelled_inputs(args: tuple, kwargs: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """``(label, value)`` of a call's arguments as :func:`visible_inputs` (not compat) gives them, the common
    shapes (tensors, None, scalars; labels made once) without its generators: the monitor's hot path.

    A keyword argument that is None or a plain flag/number/string (``attention_mask=None``, ``use_cache=False``)
    is left out: transformers' layout never shows keywords, ours shows those that carry values to check, and a
    T5 block's eight ``None`` keywords were a third of its lines (and of the monitor's work per call)."""
    out = []
    for i, a in enumerate(args):
        out += labelled_arg(INPUT_LABELS[i] if i < 8 else f"input[{i}]", a)
    if kwargs:
        for k, v in kwargs.items():
            if v is None or (_leaf(v) and not isinstance(v, torch.Tensor)):
                continue
            label = _KEYWORD_LABELS.get(k)
            if label is None:
                label = f"input[{k}]"
                if len(_KEYWORD_LABELS) < 4096:
                    _KEYWORD_LABELS[k] = label
            if isinstance(v, torch.Tensor):
                out.append((label, v))
            elif not is_container(v):  # (an object such as a transformers Cache: one line, no walk)
                out.append((label, NOT_A_TENSOR))
            else:
                out.extend((lb, x) for lb, x, _ in _walk(v, label, 1, 0, False))
    return out


def labelled_arg(label: str, value: Any) -> list[tuple[str, Any]]:
    """``(label, value)`` of one positional argument (its leaves when it is a container)."""
    return labelled_item(label, value, 0)


def labelled_item(label: str, value: Any, tuple_depth: int) -> list[tuple[str, Any]]:
    """``(label, value)`` of one argument (``tuple_depth`` 0) or one element of an output tuple (1): the value
    itself when it is a leaf, else its leaves."""
    if _leaf(value) or not is_container(value):
        return [(label, value if value is None or isinstance(value, torch.Tensor) else NOT_A_TENSOR)]
    return [(lb, v) for lb, v, _ in _walk(value, label, 1, tuple_depth, False)]


def labelled_outputs(output: Any) -> list[tuple[str, Any]]:
    """``(label, value)`` of a forward's return value as :func:`visible_outputs` (not compat) gives them."""
    if isinstance(output, torch.Tensor):
        return [("output", output)]
    if isinstance(output, tuple):
        out = []
        for i, o in enumerate(output):
            out += labelled_item(OUTPUT_LABELS[i] if i < 8 else f"output[{i}]", o, 1)
        return out
    return [(lb, v) for lb, v, _ in _walk(output, "output", 0, 0, False)]


def input_slots(args: tuple, kwargs: Mapping[str, Any] | None, hf: bool = False) -> Iterator[tuple[str, Any]]:
    """Slots of a forward call's arguments: ``input[i]`` then ``input[name]`` for keywords."""
    for label, value, _ in visible_inputs(args, kwargs, hf):
        yield label, value


def output_slots(output: Any, hf: bool = False) -> Iterator[tuple[str, Any]]:
    """Slots of a forward's return value: ``output``, ``output[i]``, ``output[i][j]``, ``output[key]``."""
    for label, value, _ in visible_outputs(output, hf):
        yield label, value

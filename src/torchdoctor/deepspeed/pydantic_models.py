"""DeepSpeed's config models as pydantic classes: the class a models-table entry names, the models an annotation
names, every model class loaded now. Read by :mod:`.schema` and :mod:`.schema_auto` alike."""

from __future__ import annotations

import typing
from typing import Any


def model_class(where: str) -> type:
    """The class named by a ``"module:Qualname"`` entry of the models table."""
    import importlib

    module, _, qualname = where.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def models_in(ann: Any) -> list[type]:
    """The pydantic models an annotation names (``X``, ``Optional[X]``, ``X | Y``...)."""
    import pydantic

    if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in models_in(a)]


def pydantic_models() -> dict[str, list[type]]:
    """Every pydantic model class loaded now, by class name (a ValidationError names its model only by name)."""
    import pydantic

    out: dict[str, list[type]] = {}
    todo = [pydantic.BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out.get(sub.__name__, []):
                out.setdefault(sub.__name__, []).append(sub)
                todo.append(sub)
    return out

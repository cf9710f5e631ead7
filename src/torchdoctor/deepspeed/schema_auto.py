"""Which of DeepSpeed's own defaults are the string "auto" (``pipeline.stages``, ``data_types.keep_in_fp32_modules``,
...): read from the installed DeepSpeed's models and readers, part by part.

The HF stack's accelerate walks every value of a config and refuses an "auto" it cannot fill, so these keys
matter under ``--for hf`` even though plain DeepSpeed resolves them itself. Kept apart from :mod:`.schema` (the
key tables) because it reads a different thing: defaults, by letting DeepSpeed's readers parse a recording dict.
"""

from __future__ import annotations

import enum
from typing import Any

from .pydantic_models import model_class, models_in
from .schema_tables import _FALLBACK_DS_AUTO, _FALLBACK_MODELS


class _DefaultsRecorder(dict):
    """Records the defaults DeepSpeed's readers pass to ``get(key, default)`` as ``{dotted key: default}``.

    An empty-dict default (``param_dict.get("data_types", {})``) is answered with an empty child recorder, so the
    keys read from nested blocks are recorded under their dotted names too.
    """

    def __init__(self, log: dict[str, Any], prefix: str = "", probe: bool = False) -> None:
        super().__init__(**({"__torchdoctor_probe__": None} if probe else {}))  # non-empty: some readers skip {}
        self.log, self.prefix = log, prefix

    def get(self, key, *default):
        if isinstance(key, str) and default:
            d = default[0]
            if isinstance(d, dict) and not d:
                return _DefaultsRecorder(self.log, f"{self.prefix}{key}.")
            self.log.setdefault(self.prefix + key, d)
        return super().get(key, *default)

    def __copy__(self):
        return self


def _is_auto(v: Any) -> bool:
    if isinstance(v, enum.Enum):
        v = v.value
    return isinstance(v, str) and v == "auto"


def _auto_in_models(models: dict[str, str]) -> set[str]:
    """Fields of DeepSpeed's config models, nested models included, whose default is "auto"."""
    found: set[str] = set()

    def walk(model: type, prefix: str, seen: frozenset) -> None:
        for name, field in model.model_fields.items():
            keys = {name, field.alias or name}
            if field.default_factory is None and _is_auto(field.default):
                found.update(prefix + k for k in keys)
            for sub in models_in(field.annotation):
                if sub not in seen:
                    for k in keys:
                        walk(sub, f"{prefix}{k}.", seen | {sub})

    for block, where in models.items():
        if "." not in block:  # nested blocks are reached from their parent
            model = model_class(where)
            walk(model, block + ".", frozenset({model}))
    return found


def _auto_in_config_reader() -> set[str]:
    """Keys ``DeepSpeedConfig`` reads with the default "auto" (``data_types.keep_in_fp32_modules``...)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    log: dict[str, Any] = {}
    cfg = DeepSpeedConfig.__new__(DeepSpeedConfig)
    cfg.world_size, cfg.global_rank = 1, 0
    cfg._initialize_params(_DefaultsRecorder(log, probe=True))
    if len(log) < 10:  # the recorder did not see the reads: DeepSpeed changed how it parses
        raise RuntimeError(f"only {len(log)} defaults recorded")
    return {k for k, v in log.items() if _is_auto(v)}


def _auto_in_pipeline() -> set[str]:
    from deepspeed.runtime.config import get_pipeline_config

    return {f"pipeline.{k}" for k, v in get_pipeline_config({}).items() if _is_auto(v)}


def _auto_in_expert_parallel() -> set[str]:
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.runtime.constants import EXPERT_PARALLEL

    log: dict[str, Any] = {}
    parse_autoep_config(_DefaultsRecorder(log, probe=True))
    return {f"{EXPERT_PARALLEL}.{k}" for k, v in log.items() if _is_auto(v)}


def ds_auto_from_deepspeed(models: dict[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """:data:`_FALLBACK_DS_AUTO` read from the installed DeepSpeed, part by part (a part that cannot be read -- a
    private function moved -- keeps the bundled keys)."""
    models = models if models is not None else _FALLBACK_MODELS
    readers = {"pipeline": _auto_in_pipeline, "config": _auto_in_config_reader,
               "models": lambda: _auto_in_models(models),
               "expert_parallel": _auto_in_expert_parallel}
    out: dict[str, tuple[str, ...]] = {}
    for part, read in readers.items():
        try:
            out[part] = tuple(sorted(read()))
        except Exception:
            out[part] = _FALLBACK_DS_AUTO[part]
    return out

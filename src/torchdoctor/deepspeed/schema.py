"""What DeepSpeed accepts: the key tables read from the installed DeepSpeed, or the bundled copy.

The facts :mod:`.validate` and :mod:`.rules` judge a config against (like ``env/facts``): the pydantic models of the
blocks DeepSpeed validates (key names and aliases, types, enum values, bounds, defaults, deprecated names; these
models forbid extra keys), the top-level keys ``DeepSpeedConfig`` reads (recorded by letting it parse a recording
dict), the keys DeepSpeed removed, its optimizer and LR-scheduler names and signatures, and the keys whose own
default is "auto" (read by :mod:`.schema_auto`). deepspeed is imported lazily; when it is missing or its tables
cannot be read, the bundled copy in :mod:`.schema_tables` is used and :attr:`Schema.source` says so.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import pathlib
import types
import typing
from typing import Any

from .pydantic_models import model_class, models_in, pydantic_models
from .quiet import quiet_deepspeed
from .schema_tables import (
    _FALLBACK_BLOCKS,
    _FALLBACK_DS_AUTO,
    _FALLBACK_MODELS,
    _FALLBACK_OPTIMIZERS,
    _FALLBACK_REMOVED,
    _FALLBACK_SCHEDULERS,
    _FALLBACK_TOP_LEVEL,
    FALLBACK_VERSION,
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one key accepts. ``kind``: bool int float str path choice block dict any.

    ``lax`` blocks (pydantic) coerce like pydantic does ("16" is an int, "true" a bool); elsewhere DeepSpeed reads
    the raw JSON value, so only the JSON type itself is right. ``default`` is JSON text; ``deprecated`` names the
    replacement ("" when DeepSpeed names none).
    """

    kind: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    values: tuple = ()
    icase: bool = False
    ref: str | None = None
    nullable: bool = False
    finite: bool = False
    nobool: bool = False
    default: str | None = None
    deprecated: str | None = None

    @classmethod
    def parse(cls, text: str) -> Spec:
        kind, *tokens = text.split()
        kw: dict[str, Any] = {}
        for tok in tokens:
            name, _, value = tok.partition("=")
            if name in ("ge", "gt", "le", "lt"):
                kw[name] = float(value)
            elif name == "values":
                kw["values"] = tuple(_literal(v) for v in value.split(","))
            elif name in ("icase", "nullable", "finite", "nobool"):
                kw[name] = True
            elif name in ("ref", "default", "deprecated"):
                kw[name] = value.replace("~", " ")
            else:
                raise ValueError(f"bad spec token {tok!r} in {text!r}")
        return cls(kind, **kw)

    def text(self) -> str:
        out = [self.kind]
        for name in ("ge", "gt", "le", "lt"):
            v = getattr(self, name)
            if v is not None:
                out.append(f"{name}={v:g}")
        if self.values:
            out.append("values=" + ",".join(str(v) for v in self.values))
        out += [n for n in ("icase", "nullable", "finite", "nobool") if getattr(self, n)]
        for name in ("ref", "default", "deprecated"):
            v = getattr(self, name)
            if v is not None:
                out.append(f"{name}={v.replace(' ', '~')}")
        return " ".join(out)


def _literal(v: str) -> Any:
    try:
        return json.loads(v)
    except ValueError:
        return v


@dataclasses.dataclass(frozen=True)
class Schema:
    """DeepSpeed's key tables, from the installed DeepSpeed or the bundled copy (``source`` says which)."""

    source: str
    blocks: dict[str, dict[str, Spec]]
    strict: frozenset[str]  # blocks DeepSpeed validates with extra="forbid": unknown keys stop it
    removed: dict[str, dict[str, str]]  # block -> key -> DeepSpeed's message
    optimizers: tuple[str, ...]  # DeepSpeed's own (lowercase; "Adam" is lowered to "adam")
    torch_optimizers: tuple[str, ...]  # torch.optim classes DeepSpeed falls back to (exact case)
    schedulers: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]  # name -> (params, required params)
    from_deepspeed: bool
    version: str  # the DeepSpeed version the tables describe
    ds_auto: frozenset[str] = frozenset()  # keys whose own DeepSpeed default is "auto": DeepSpeed reads "auto" there
    models: dict[str, str] = dataclasses.field(default_factory=dict)  # strict block -> "module:Class" validating it


# A key no config has: put in a block, it shows whether DeepSpeed's parser validates that block strictly.
_PROBE = "__torchdoctor_probe__"

# Knowledge from DeepSpeed's custom pydantic validators (not in the field metadata), applied to both sources.
_VALIDATOR_OVERLAY = {
    "fp16": {"loss_scale": "float ge=0 finite nobool default=0"},  # _validate_loss_scale: a finite number >= 0
}

# Top-level keys DeepSpeed reads outside DeepSpeedConfig._initialize_params.
_TOP_EXTRA = ("sequence_parallel_size", "vocabulary_size")

# Top-level types (DeepSpeed reads these raw with get_scalar_param, no coercion).
_TOP_SPECS = {
    "train_batch_size": "int gt=0 nullable",
    "train_micro_batch_size_per_gpu": "int gt=0 nullable",
    "gradient_accumulation_steps": "int gt=0 nullable",
    "gradient_clipping": "float ge=0 finite default=1.0",
    "steps_per_print": "int gt=0 nullable",
    "log_level": "choice values=debug,info,warning,error,critical icase nullable",
    "communication_data_type": "choice values=fp16,bf16,fp32 icase nullable",
    "seq_parallel_communication_data_type": "choice values=fp16,bf16,fp32 icase nullable",
    "wall_clock_breakdown": "bool",
    "memory_breakdown": "bool",
    "prescale_gradients": "bool",
    "zero_allow_untested_optimizer": "bool",
    "zero_force_ds_cpu_optimizer": "bool",
    "dataloader_drop_last": "bool",
    "disable_allgather": "bool",
    "dump_state": "bool",
    "fp16": "block ref=fp16",
    "bf16": "block ref=bf16",
    "bfloat16": "block ref=bf16 deprecated=bf16",
    "zero_optimization": "block ref=zero_optimization",
    "optimizer": "block ref=optimizer",
    "scheduler": "block ref=scheduler",
}
_OPTIMIZER_BLOCK = {"type": "str", "params": "dict nullable", "legacy_fusion": "bool"}
_SCHEDULER_BLOCK = {"type": "str", "params": "dict nullable"}

# "auto" values the HF stack fills: transformers 5.24 HfTrainerDeepSpeedConfig.trainer_config_process/_finalize and
# accelerate 1.15 DeepSpeedPlugin (plugin_to_config_mapping, Accelerator._prepare_deepspeed).
HF_AUTO_KEYS = frozenset({
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.total_num_steps",
    "scheduler.params.warmup_num_steps", "fp16.enabled", "bf16.enabled",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
})



def _spec_of_field(field: Any, block: str, name: str, strict: frozenset[str] | dict) -> str:
    """The spec text of a pydantic field (DeepSpeedConfigModel), in the bundled tables' notation."""
    import pydantic

    ann = field.annotation
    nullable = False
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(ann))
        ann = args[0] if len(args) == 1 else Any
    tokens: list[str] = []
    if ann is bool:
        kind = "bool"
    elif ann is int:
        kind = "int"
    elif ann is float:
        kind = "float"
    elif ann is str:
        kind = "str"
    elif isinstance(ann, type) and issubclass(ann, enum.Enum):
        kind = "choice"
        values = list(dict.fromkeys(m.value for m in ann))
        tokens.append("values=" + ",".join(str(v) for v in values))
    elif isinstance(ann, type) and issubclass(ann, pathlib.PurePath):
        kind = "path"
    elif isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
        sub = f"{block}.{name}"
        kind = "block" if sub in strict else "dict"
        if kind == "block":
            tokens.append(f"ref={sub}")
    else:
        kind = "any"
    for m in field.metadata:
        for bound in ("ge", "gt", "le", "lt"):
            v = getattr(m, bound, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                tokens.append(f"{bound}={v:g}")
    if nullable:
        tokens.append("nullable")
    default = field.default
    if field.default_factory is None and default is not pydantic.fields.PydanticUndefined:
        if isinstance(default, enum.Enum):
            default = default.value
        if default is None or isinstance(default, (bool, int, float, str)):
            txt = json.dumps(default)
            if " " not in txt:
                tokens.append(f"default={txt}")
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("deprecated"):
        tokens.append("deprecated=" + str(extra.get("new_param", "")).replace(" ", "~"))
    return " ".join([kind, *tokens])


def _strict_model_of(key: str) -> type | None:
    """The pydantic model DeepSpeed's parser validates top-level ``key`` with, when it forbids unknown keys.

    Found by parsing ``{key: {PROBE: 1}}`` with ``DeepSpeedConfig``'s own reader: a block it validates strictly
    stops it with an ``extra_forbidden`` error at ``(..., PROBE)``. The error names the model (``CompileConfig``);
    its location leads to the model of the block itself (``("tensorboard", PROBE)`` in ``DeepSpeedMonitorConfig``
    is its ``tensorboard`` field's model).
    """
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = DeepSpeedConfig.__new__(DeepSpeedConfig)
    cfg.world_size, cfg.global_rank = 1, 0
    try:
        cfg._initialize_params({key: {_PROBE: 1}})
    except pydantic.ValidationError as e:
        locs = [tuple(err["loc"]) for err in e.errors() if err["type"] == "extra_forbidden"
                and tuple(err["loc"])[-1:] == (_PROBE,)]
        named = pydantic_models().get(e.title, [])
        if not locs or len(named) != 1:
            return None
        model = named[0]
        for part in locs[0][:-1]:
            field = model.model_fields.get(part) or next(
                (f for f in model.model_fields.values() if f.alias == part), None)
            subs = models_in(field.annotation) if field is not None else []
            if len(subs) != 1:
                return None
            model = subs[0]
        return model
    except Exception:  # a reader that refuses a dict there in its own way: not a pydantic block
        return None
    return None


def _models_from_deepspeed(top: tuple[str, ...]) -> dict[str, str]:
    """Every block DeepSpeed validates with an extra="forbid" pydantic model -> ``"module:Class"``.

    The top-level ones come from :func:`_strict_model_of` (what the parser does, not a list kept here); the nested
    ones are the fields of those models whose type is again a model forbidding extra keys
    (``zero_optimization.offload_param``). A key whose top-level spec is another block's old name (``bfloat16``,
    read as ``bf16``) shares that block.
    """
    out: dict[str, type] = {}

    def walk(block: str, model: type, seen: frozenset) -> None:
        out[block] = model
        for name, field in model.model_fields.items():
            for sub in models_in(field.annotation):
                if sub.model_config.get("extra") == "forbid" and sub not in seen:
                    walk(f"{block}.{name}", sub, seen | {sub})

    for key in top:
        ref = Spec.parse(_TOP_SPECS[key]).ref if key in _TOP_SPECS else None
        if ref not in (None, key):
            continue
        model = _strict_model_of(key)
        if model is not None:
            walk(key, model, frozenset({model}))
    if not {"fp16", "bf16", "zero_optimization"} <= set(out):  # the probe did not work: DeepSpeed changed
        raise RuntimeError(f"only {sorted(out)} found to be validated strictly")
    return {b: f"{m.__module__}:{m.__qualname__}" for b, m in out.items()}


def _blocks_from_deepspeed(models: dict[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for block, where in models.items():
        model = model_class(where)
        fields: dict[str, str] = {}
        for name, field in model.model_fields.items():
            spec = _spec_of_field(field, block, name, models)
            fields[name] = spec
            if field.alias and field.alias != name:
                fields[field.alias] = spec
        out[block] = fields
    return out


class _Recorder(dict):
    """A dict that records which keys are looked up: what ``DeepSpeedConfig`` reads is what it knows."""

    def __init__(self) -> None:
        super().__init__(__torchdoctor_probe__=None)  # non-empty: some readers skip an empty dict
        self.seen: set[str] = set()

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        outer = self

        class _Keys:
            def __contains__(self, key):
                outer.seen.add(key)
                return False

            def __iter__(self):
                return iter(())

        return _Keys()

    def __copy__(self):
        return self


def _top_level_from_deepspeed() -> tuple[str, ...]:
    from deepspeed.runtime.config import DeepSpeedConfig

    rec = _Recorder()
    cfg = DeepSpeedConfig.__new__(DeepSpeedConfig)
    cfg.world_size, cfg.global_rank = 1, 0
    cfg._initialize_params(rec)
    seen = {k for k in rec.seen if isinstance(k, str) and not k.startswith("__")}
    if len(seen) < 20:  # the recorder did not see the reads: DeepSpeed changed how it parses
        raise RuntimeError(f"only {len(seen)} top-level keys recorded")
    return tuple(sorted(seen))


def _schedulers_from_deepspeed() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    from deepspeed.runtime import lr_schedules

    return {name: _signature(getattr(lr_schedules, name)) for name in lr_schedules.VALID_LR_SCHEDULES}


def _signature(cls: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    import inspect

    params = [p for p in list(inspect.signature(cls).parameters.values())[1:]  # after `optimizer`
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values()):
        return (), ()
    return tuple(p.name for p in params), tuple(p.name for p in params if p.default is p.empty)


def _torch_tables() -> tuple[tuple[str, ...], dict[str, tuple[tuple[str, ...], tuple[str, ...]]]]:
    try:
        import torch.optim
        import torch.optim.lr_scheduler as sched
    except Exception:  # torch missing or broken: the type checks then only know DeepSpeed's names
        return (), {}
    optims = tuple(sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type)
                          and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer))
    scheds: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for n, c in vars(sched).items():
        if isinstance(c, type) and not n.startswith("_") and (issubclass(c, sched.LRScheduler)
                                                               or n == "ReduceLROnPlateau") and n != "LRScheduler":
            try:
                scheds[n] = _signature(c)
            except (TypeError, ValueError):
                scheds[n] = ((), ())
    return optims, scheds


def _assemble(source: str, from_ds: bool, version: str, top: tuple[str, ...], blocks: dict[str, dict[str, str]],
              removed: dict[str, dict[str, str]], optimizers: tuple[str, ...],
              schedulers: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
              ds_auto: dict[str, tuple[str, ...]], models: dict[str, str]) -> Schema:
    torch_optims, torch_scheds = _torch_tables()
    top_specs = {k: _TOP_SPECS.get(k, f"block ref={k}" if k in models else "any") for k in (*top, *_TOP_EXTRA)}
    all_blocks = {"": top_specs, **blocks, "optimizer": _OPTIMIZER_BLOCK, "scheduler": _SCHEDULER_BLOCK}
    for block, overlay in _VALIDATOR_OVERLAY.items():
        all_blocks[block] = {**all_blocks[block], **overlay}
    return Schema(
        source=source,
        blocks={b: {k: Spec.parse(s) for k, s in fields.items()} for b, fields in all_blocks.items()},
        strict=frozenset(models),
        removed=removed,
        optimizers=optimizers,
        torch_optimizers=torch_optims,
        schedulers={**torch_scheds, **schedulers},
        from_deepspeed=from_ds,
        version=version,
        ds_auto=frozenset(k for keys in ds_auto.values() for k in keys),
        models=dict(models),
    )


def deepspeed_tables() -> dict[str, Any]:
    """DeepSpeed's own tables, read from the installed DeepSpeed (raises when it cannot be imported or read).

    The raw material of :func:`schema`; the tests compare it with the bundled copy.
    """
    with quiet_deepspeed():
        import deepspeed

        version = str(getattr(deepspeed, "__version__", "?"))
        try:
            import deepspeed.runtime.config as ds_config

            tables: dict[str, Any] = {"version": version}
            try:
                tables["top"] = _top_level_from_deepspeed()
            except Exception:  # private API moved: keep the bundled list, the rest still comes from DeepSpeed
                tables["top"] = None
            tables["models"] = _models_from_deepspeed(tables["top"] or _FALLBACK_TOP_LEVEL)
            tables["blocks"] = _blocks_from_deepspeed(tables["models"])
            tables["removed"] = {  # a DeepSpeed without these tables still accepts those keys
                "": dict(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})),
                "zero_optimization": dict(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {})),
            }
            tables["optimizers"] = tuple(ds_config.DEEPSPEED_OPTIMIZERS)
            tables["schedulers"] = _schedulers_from_deepspeed()
            from .schema_auto import ds_auto_from_deepspeed  # reads models with this module's helpers

            tables["auto"] = ds_auto_from_deepspeed(tables["models"])
        except Exception as e:
            raise _TablesUnreadable(f"deepspeed {version}'s tables could not be read: {type(e).__name__}") from e
    return tables


class _TablesUnreadable(RuntimeError):
    """deepspeed imports, but its config models are not where (or what) this version expects."""


@functools.lru_cache(maxsize=1)
def schema() -> Schema:
    """DeepSpeed's key tables: from the installed DeepSpeed when it imports, else the bundled 0.19.8 copy."""
    try:
        t = deepspeed_tables()
    except Exception as e:  # not installed, or its import fails (CUDA mismatch...): the bundled copy still works
        if isinstance(e, _TablesUnreadable):
            reason = str(e)
        elif isinstance(e, ImportError) and e.name == "deepspeed":
            reason = "deepspeed not installed"
        else:
            reason = f"deepspeed import failed: {type(e).__name__}"
        return _assemble(f"bundled DeepSpeed {FALLBACK_VERSION} tables ({reason})", False, FALLBACK_VERSION,
                         _FALLBACK_TOP_LEVEL, _FALLBACK_BLOCKS, _FALLBACK_REMOVED, _FALLBACK_OPTIMIZERS,
                         _FALLBACK_SCHEDULERS, _FALLBACK_DS_AUTO, _FALLBACK_MODELS)
    top = t["top"] if t["top"] is not None else _FALLBACK_TOP_LEVEL
    return _assemble(f"deepspeed {t['version']}", True, t["version"], top, t["blocks"], t["removed"], t["optimizers"],
                     t["schedulers"], t["auto"], t["models"])


"""Lint a DeepSpeed config before the run: ``torchdoctor ds check CONFIG.json``.

Pure logic: :func:`load` reads the file (:func:`torchdoctor.jsonfile.load_object`: strict JSON, duplicate keys
refused as DeepSpeed refuses them) and :func:`check` judges the dict against facts the caller passes in (GPU
capabilities, where libaio is, the world size). Nothing here probes the machine.

What the checks know comes from DeepSpeed itself where it exposes it (:func:`schema`, imported lazily):

- the pydantic models of the blocks DeepSpeed validates (``fp16``, ``bf16``, ``zero_optimization`` and its
  ``offload_param`` / ``offload_optimizer``): key names and aliases, types, enum values, bounds, defaults and
  deprecated names. These models forbid extra keys, so an unknown key there stops DeepSpeed at start (fail);
- the top-level keys ``DeepSpeedConfig`` reads, recorded by letting it parse an empty recording dict. DeepSpeed
  ignores unknown top-level keys silently (warn);
- the keys DeepSpeed 0.19 removed and refuses, with its own messages; its optimizer and LR-scheduler names and the
  scheduler signatures (unknown ``scheduler.params`` are a ``TypeError`` at start).

When deepspeed is not importable the same tables come from the bundled copies below, taken from DeepSpeed 0.19.8
(``tests/test_ds_check.py`` compares them with the installed DeepSpeed). ``"auto"`` follows DeepSpeed: its pydantic
blocks drop ``"auto"`` values and use the default (so ``fp16.enabled: "auto"`` trains in fp32); everywhere else the
string reaches the code and breaks it -- except where ``"auto"`` is DeepSpeed's own default for the key
(``pipeline.stages``, ``data_types.keep_in_fp32_modules``, ``zero_optimization.zenflow.*``,
``expert_parallel.*``: :attr:`Schema.ds_auto`, read from DeepSpeed's readers and models), which is fine anywhere.
Only the HF Trainer (with accelerate) fills ``"auto"``, and only for :data:`HF_AUTO_KEYS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import io
import json
import logging
import math
import pathlib
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

from ..findings import Finding
from ..jsonfile import JsonFileError, load_object

__all__ = ["ConfigError", "load", "check", "schema", "Schema", "Spec", "HF_AUTO_KEYS", "FOR_CHOICES"]

FOR_CHOICES = ("deepspeed", "hf")
FALLBACK_VERSION = "0.19.8"  # the DeepSpeed the bundled tables were taken from


ConfigError = JsonFileError  # what :func:`load` raises; the message is ready to print


# -- loading -------------------------------------------------------------------------------------------------


def load(path: str) -> dict:
    """The DeepSpeed config object in the JSON file at ``path`` (``-``: standard input).

    Raises:
        ConfigError: (:class:`torchdoctor.jsonfile.JsonFileError`) missing or unreadable file, not UTF-8, invalid
            JSON (``file:line:col: message`` and the line with a caret), a duplicate key, nesting deeper than any
            config, or a top level that is not a JSON object.
    """
    return load_object(path, "a DeepSpeed config")


# -- what DeepSpeed accepts: the schema ---------------------------------------------------------------------------


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


# Blocks DeepSpeed builds from pydantic models, and the nested models that are blocks of their own.
_MODELS = {
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_param": ("deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadParamConfig"),
    "zero_optimization.offload_optimizer": ("deepspeed.runtime.zero.offload_config",
                                            "DeepSpeedZeroOffloadOptimizerConfig"),
}

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

# fmt: off
# -- bundled copy of DeepSpeed 0.19.8's tables (used when deepspeed is not importable) --
_FALLBACK_TOP_LEVEL = (
    "activation_checkpointing", "aio", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger",
    "communication_data_type", "compile", "csv_monitor", "data_efficiency", "data_types", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel", "flops_profiler",
    "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor",
    "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown", "optimizer", "pipeline",
    "prescale_gradients", "scheduler", "seq_parallel_communication_data_type", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization", "autotuning",
)
_FALLBACK_BLOCKS: dict[str, dict[str, str]] = {
    'fp16': {
        'enabled': 'bool default=false',
        'auto_cast': 'bool default=false',
        'loss_scale': 'float default=0',
        'initial_scale_power': 'int default=16',
        'loss_scale_window': 'int default=1000',
        'hysteresis': 'int default=2',
        'consecutive_hysteresis': 'bool default=false',
        'min_loss_scale': 'int default=1',
        'fp16_master_weights_and_grads': 'bool default=false',
    },
    'bf16': {
        'enabled': 'bool default=false',
        'immediate_grad_update': 'bool default=false',
        'check_grad_overflow': 'bool default=true',
        'bf16_master_weights_and_grads': 'bool default=false',
        'bf16_optimizer_states': 'bool default=false',
    },
    'zero_optimization': {
        'stage': 'choice values=0,1,2,3 default=0',
        'contiguous_gradients': 'bool default=true',
        'reduce_scatter': 'bool default=true',
        'reduce_bucket_size': 'int gt=0 default=500000000',
        'use_multi_rank_bucket_allreduce': 'bool default=true',
        'allgather_partitions': 'bool default=true',
        'allgather_bucket_size': 'int ge=0 default=500000000',
        'overlap_comm': 'bool nullable default=null',
        'compute_grad_norm': 'bool default=true',
        'load_from_fp32_weights': 'bool default=true',
        'elastic_checkpoint': 'bool default=false',
        'offload_param': 'block ref=zero_optimization.offload_param nullable default=null',
        'offload_optimizer': 'block ref=zero_optimization.offload_optimizer nullable default=null',
        'zenflow': 'dict nullable default=null',
        'sub_group_size': 'int ge=0 default=1000000000',
        'cpu_offload_param': 'bool nullable default=null deprecated=offload_param',
        'cpu_offload_use_pin_memory': 'bool nullable default=null deprecated=offload_param~or~offload_optimizer',
        'cpu_offload': 'bool nullable default=null deprecated=offload_optimizer',
        'prefetch_bucket_size': 'int ge=0 default=50000000',
        'stage3_prefetch_bucket_size': 'int ge=0 default=50000000',
        'param_persistence_threshold': 'int ge=0 default=100000',
        'stage3_param_persistence_threshold': 'int ge=0 default=100000',
        'model_persistence_threshold': 'int ge=0 default=9223372036854775807',
        'stage3_model_persistence_threshold': 'int ge=0 default=9223372036854775807',
        'max_live_parameters': 'int ge=0 default=1000000000',
        'stage3_max_live_parameters': 'int ge=0 default=1000000000',
        'max_reuse_distance': 'int ge=0 default=1000000000',
        'stage3_max_reuse_distance': 'int ge=0 default=1000000000',
        'gather_16bit_weights_on_model_save': 'bool default=false',
        'stage3_gather_16bit_weights_on_model_save': 'bool default=false',
        'module_granularity_threshold': 'int default=0',
        'stage3_module_granularity_threshold': 'int default=0',
        'use_all_reduce_for_fetch_params': 'bool default=false',
        'stage3_use_all_reduce_for_fetch_params': 'bool default=false',
        'allgather_sequential': 'bool default=false',
        'stage3_allgather_sequential': 'bool default=false',
        'stage3_gather_fp16_weights_on_model_save': 'bool default=false deprecated=gather_16bit_weights_on_model_save',
        'ignore_unused_parameters': 'bool default=true',
        'legacy_stage1': 'bool default=false',
        'round_robin_gradients': 'bool default=false',
        'parameter_alignment': 'bool default=false',
        'zero_hpz_partition_size': 'int ge=0 default=1',
        'zero_quantized_weights': 'bool default=false',
        'zero_quantized_nontrainable_weights': 'bool default=false',
        'zero_quantized_gradients': 'bool default=false',
        'memory_efficient_linear': 'bool default=true',
        'pipeline_loading_checkpoint': 'bool default=false',
        'override_module_apply': 'bool default=true',
        'log_trace_cache_warnings': 'bool default=false',
        'enable_sanity_checks': 'bool default=false',
        'save_muon_momentum_buffer_in_memory': 'bool default=false',
        'leaf_module': 'dict',
    },
    'zero_optimization.offload_param': {
        'device': 'choice values=none,cpu,nvme default="none"',
        'nvme_path': 'path nullable default=null',
        'buffer_count': 'int ge=0 default=5',
        'buffer_size': 'int ge=0 default=100000000',
        'max_in_cpu': 'int ge=0 default=1000000000',
        'pin_memory': 'bool default=true',
    },
    'zero_optimization.offload_optimizer': {
        'device': 'choice values=none,cpu,nvme default="none"',
        'nvme_path': 'path nullable default=null',
        'buffer_count': 'int ge=0 default=4',
        'pin_memory': 'bool default=true',
        'pipeline_read': 'bool default=false',
        'pipeline_write': 'bool default=false',
        'fast_init': 'bool default=false',
        'ratio': 'float ge=0 le=1 default=1.0',
        'super_offload': 'bool default=false',
        'cpuadam_cores_perc': 'float ge=0 le=1 default=0.8',
    },
}
_FALLBACK_REMOVED: dict[str, dict[str, str]] = {
    '': {
        'nebula': (
            "Nebula checkpointing has been removed. A leftover 'nebula' block would be ignored and checkpoints "
            'would silently fall back to local torch.save. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'compression_training': (
            "The DeepSpeed compression library has been removed. A leftover 'compression_training' block would be"
            ' ignored and the model would train unquantized. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'amp': (
            "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast' "
            'instead. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'quantize_training': (
            "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed. See "
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'sparse_gradients': (
            'Sparse compression of dense torch.nn.Embedding gradients has been removed. A leftover '
            "'sparse_gradients' flag would be ignored and those gradients would be reduced dense. Gradients from "
            'an embedding constructed with sparse=True are still reduced sparsely and need no config flag. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'eigenvalue': (
            "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed; the standalone 'eigenvalue' "
            'configuration block is no longer supported. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'sparse_attention': (
            "DeepSpeed Sparse Attention has been removed; the 'sparse_attention' configuration block is no longer"
            ' supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'elasticity': (
            "Elastic training has been removed; the 'elasticity' configuration block is no longer supported. Set "
            'train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps directly. '
        ),
        'graph_harvesting': (
            "Graph harvesting has been removed; the 'graph_harvesting' configuration option is no longer "
            'supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'curriculum_learning': (
            "Legacy top-level 'curriculum_learning' has been removed. Use "
            "'data_efficiency.data_sampling.curriculum_learning' instead. See "
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'progressive_layer_drop': (
            "Progressive Layer Dropping has been removed; the 'progressive_layer_drop' configuration block is no "
            'longer supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
    },
    'zero_optimization': {
        'mics_shard_size': (
            "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_shard_size' is no longer supported. "
            'See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'mics_hierarchical_params_gather': (
            "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_hierarchical_params_gather' is no "
            'longer supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'zeropp_loco_param': (
            "LoCo-Zero++ has been removed; 'zero_optimization.zeropp_loco_param' is no longer supported. Remove "
            'this key to use standard ZeRO++ quantized gradients without LoCo error feedback. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
    },
}
_FALLBACK_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
_FALLBACK_SCHEDULERS_TEXT = {  # name: (params after `optimizer`, the required ones), space-separated
    "LRRangeTest": ("lr_range_test_min_lr lr_range_test_step_size lr_range_test_step_rate lr_range_test_staircase"
                    " last_batch_iteration", ""),
    "OneCycle": ("cycle_min_lr cycle_max_lr decay_lr_rate cycle_first_step_size cycle_second_step_size"
                 " cycle_first_stair_count cycle_second_stair_count decay_step_size cycle_momentum cycle_min_mom"
                 " cycle_max_mom decay_mom_rate last_batch_iteration", "cycle_min_lr cycle_max_lr"),
    "WarmupLR": ("warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration", ""),
    "WarmupDecayLR": ("total_num_steps warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration",
                      "total_num_steps"),
    "WarmupCosineLR": ("total_num_steps warmup_min_ratio warmup_num_steps cos_min_ratio warmup_type"
                       " last_batch_iteration", "total_num_steps"),
}
_FALLBACK_SCHEDULERS = {n: (tuple(p.split()), tuple(r.split())) for n, (p, r) in _FALLBACK_SCHEDULERS_TEXT.items()}
# Keys whose DeepSpeed default is "auto" itself, so "auto" there is DeepSpeed's own value (not a placeholder for the
# HF Trainer), by where DeepSpeed keeps them (see _ds_auto_from_deepspeed for how each is read):
_FALLBACK_DS_AUTO: dict[str, tuple[str, ...]] = {
    "pipeline": ("pipeline.stages",),  # runtime/config.py get_pipeline_config
    "config": ("data_types.keep_in_fp32_modules",),  # constants.py KEEP_IN_FP32_MODULES_DEFAULT
    "models": ("zero_optimization.zenflow.select_interval", "zero_optimization.zenflow.select_strategy",
               "zero_optimization.zenflow.update_interval"),  # runtime/zenflow/zenflow_config.py ZenFlowConfig
    "expert_parallel": ("expert_parallel.combine_impl", "expert_parallel.routed_scaling_factor",
                        "expert_parallel.row_weighting_impl", "expert_parallel.score_apply",
                        "expert_parallel.score_func", "expert_parallel.top_k"),  # auto_ep_config.parse_autoep_config
}
# fmt: on


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    """Keep DeepSpeed's import-time lines ("Setting accelerator to CPU") off our stdout (it would break --json).

    DeepSpeed's logger writes to the ``sys.stdout`` of the moment it is created, so a handler created while stdout
    is redirected is pointed back at the real stdout afterwards: the user's own DeepSpeed logging is left as it was.
    """
    real = sys.stdout
    buf = io.StringIO()
    ds_logger = logging.getLogger("DeepSpeed")
    was_disabled = ds_logger.disabled
    ds_logger.disabled = True
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        ds_logger.disabled = was_disabled
        for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for h in getattr(lg, "handlers", ()):
                if isinstance(h, logging.StreamHandler) and h.stream is buf:
                    h.setStream(real)


def _spec_of_field(field: Any, block: str, name: str) -> str:
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
        kind = "block" if sub in _MODELS else "dict"
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


def _blocks_from_deepspeed() -> dict[str, dict[str, str]]:
    import importlib

    out: dict[str, dict[str, str]] = {}
    for block, (module, cls_name) in _MODELS.items():
        model = getattr(importlib.import_module(module), cls_name)
        fields: dict[str, str] = {}
        for name, field in model.model_fields.items():
            spec = _spec_of_field(field, block, name)
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


def _auto_in_models() -> set[str]:
    """Fields of DeepSpeed's config models, nested models included, whose default is "auto"."""
    import importlib

    import pydantic

    found: set[str] = set()

    def models_in(ann: Any) -> list[type]:
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            return [ann]
        return [m for a in typing.get_args(ann) for m in models_in(a)]

    def walk(model: type, prefix: str, seen: frozenset) -> None:
        for name, field in model.model_fields.items():
            keys = {name, field.alias or name}
            if field.default_factory is None and _is_auto(field.default):
                found.update(prefix + k for k in keys)
            for sub in models_in(field.annotation):
                if sub not in seen:
                    for k in keys:
                        walk(sub, f"{prefix}{k}.", seen | {sub})

    for block, (module, cls_name) in _MODELS.items():
        if "." not in block:  # nested blocks are reached from their parent
            model = getattr(importlib.import_module(module), cls_name)
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


def _ds_auto_from_deepspeed() -> dict[str, tuple[str, ...]]:
    """:data:`_FALLBACK_DS_AUTO` read from the installed DeepSpeed, part by part (a part that cannot be read -- a
    private function moved -- keeps the bundled keys)."""
    readers = {"pipeline": _auto_in_pipeline, "config": _auto_in_config_reader, "models": _auto_in_models,
               "expert_parallel": _auto_in_expert_parallel}
    out: dict[str, tuple[str, ...]] = {}
    for part, read in readers.items():
        try:
            out[part] = tuple(sorted(read()))
        except Exception:
            out[part] = _FALLBACK_DS_AUTO[part]
    return out


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
              ds_auto: dict[str, tuple[str, ...]]) -> Schema:
    torch_optims, torch_scheds = _torch_tables()
    top_specs = {k: _TOP_SPECS.get(k, "any") for k in (*top, *_TOP_EXTRA)}
    all_blocks = {"": top_specs, **blocks, "optimizer": _OPTIMIZER_BLOCK, "scheduler": _SCHEDULER_BLOCK}
    for block, overlay in _VALIDATOR_OVERLAY.items():
        all_blocks[block] = {**all_blocks[block], **overlay}
    return Schema(
        source=source,
        blocks={b: {k: Spec.parse(s) for k, s in fields.items()} for b, fields in all_blocks.items()},
        strict=frozenset(_MODELS),
        removed=removed,
        optimizers=optimizers,
        torch_optimizers=torch_optims,
        schedulers={**torch_scheds, **schedulers},
        from_deepspeed=from_ds,
        version=version,
        ds_auto=frozenset(k for keys in ds_auto.values() for k in keys),
    )


def deepspeed_tables() -> dict[str, Any]:
    """DeepSpeed's own tables, read from the installed DeepSpeed (raises when it cannot be imported or read).

    The raw material of :func:`schema`; the tests compare it with the bundled copy.
    """
    with _quiet_deepspeed():
        import deepspeed

        version = str(getattr(deepspeed, "__version__", "?"))
        try:
            import deepspeed.runtime.config as ds_config

            tables: dict[str, Any] = {"version": version, "blocks": _blocks_from_deepspeed()}
            try:
                tables["top"] = _top_level_from_deepspeed()
            except Exception:  # private API moved: keep the bundled list, the rest still comes from DeepSpeed
                tables["top"] = None
            tables["removed"] = {  # a DeepSpeed without these tables still accepts those keys
                "": dict(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})),
                "zero_optimization": dict(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {})),
            }
            tables["optimizers"] = tuple(ds_config.DEEPSPEED_OPTIMIZERS)
            tables["schedulers"] = _schedulers_from_deepspeed()
            tables["auto"] = _ds_auto_from_deepspeed()
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
                         _FALLBACK_SCHEDULERS, _FALLBACK_DS_AUTO)
    top = t["top"] if t["top"] is not None else _FALLBACK_TOP_LEVEL
    return _assemble(f"deepspeed {t['version']}", True, t["version"], top, t["blocks"], t["removed"], t["optimizers"],
                     t["schedulers"], t["auto"])


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
            if k == "int" and isinstance(v, float) and math.isfinite(v) and v.is_integer():
                return ("fail", "a float: DeepSpeed uses this key as given, and it must be an integer (write it"
                                " without a decimal point)")
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


# -- the walk over the config: unknown keys, bad values, removed and deprecated keys ------------------------------

_DEPRECATED_FIX = {
    "cpu_offload": '"zero_optimization": {"offload_optimizer": {"device": "cpu"}}',
    "cpu_offload_param": '"zero_optimization": {"offload_param": {"device": "cpu"}}',
    "cpu_offload_use_pin_memory": '"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": true}}'
                                  ' (and the same "pin_memory" in "offload_param")',
}


class _Walker:
    """Walks the config against the schema. With ``verify``, a value a fix suggests is one the whole check accepts
    at that key in this config (:meth:`_value_for`), not just one of the right type."""

    def __init__(self, sch: Schema, config: dict | None = None, for_: str = "deepspeed", verify: bool = False) -> None:
        self.sch = sch
        self.root, self.for_, self.verify = config, for_, verify
        self.findings: list[Finding] = []
        self.homes: dict[str, list[tuple[str, str]]] = {}  # lowercase key -> [(block, key as DeepSpeed spells it)]
        for block, specs in sch.blocks.items():
            for k, spec in specs.items():
                if spec.deprecated is None:
                    self.homes.setdefault(k.lower(), []).append((block, k))

    def walk(self, block: str, obj: dict, prefix: str, path: tuple = ()) -> None:
        specs = self.sch.blocks[block]
        removed = self.sch.removed.get(block, {})
        lax = block in self.sch.strict
        for raw_key, val in obj.items():
            key = str(raw_key)
            dotted = prefix + key
            if key in removed:
                self.findings.append(Finding(
                    "config.removed-key", "fail", f'"{dotted}" is no longer supported by DeepSpeed',
                    [removed[key].strip(), f"DeepSpeed {self.sch.version} refuses to start with it "
                                           "(DeepSpeedConfigError)."],
                    [f'remove "{dotted}" from the config'], {"key": dotted}))
                continue
            spec = specs.get(key)
            if spec is None:
                self._unknown(block, key, dotted, val, prefix, obj, path)
                continue
            if isinstance(val, str) and val == "auto":
                continue  # judged by config.auto-outside-hf
            if block == "" and key == "zero_optimization" and isinstance(val, bool):
                self.findings.append(Finding(
                    "config.deprecated", "warn", f'"zero_optimization": {_show(val)} is the deprecated boolean form',
                    ["DeepSpeed reads true as ZeRO stage 1 and false as stage 0, and logs a deprecation warning."],
                    [f'write the block: "zero_optimization": {{"stage": {1 if val else 0}}}'], {"key": dotted}))
                continue
            if spec.deprecated is not None:
                self._deprecated(dotted, key, spec, val, prefix, lax, path)
            bad = _judge(spec, val, lax)
            if bad:
                self._bad(block, key, dotted, val, spec, *bad, path=(*path, raw_key))
                continue
            if spec.kind == "block" and isinstance(val, dict) and spec.ref in self.sch.blocks:
                self.walk(spec.ref, val, dotted + ".", (*path, raw_key))
        if block == "optimizer":
            self._optimizer(obj)
        elif block == "scheduler":
            self._scheduler(obj)

    def _value_for(self, path: tuple, dotted: str, candidates: list[Any]) -> Any:
        """The first candidate that, set at ``path``, leaves nothing to report at ``dotted`` (the first one when
        not verifying); :data:`_NO` when none does."""
        if not (self.verify and self.root is not None):
            return candidates[0]
        for c in candidates:
            found = _findings(_with(self.root, path, c), world_size=None, for_=self.for_, caps=[], libaio="libaio",
                              verify=False)
            if not any(f.severity in ("fail", "warn") and f.data.get("key") == dotted for f in found):
                return c
        return _NO

    def _moved(self, target: str, val: Any, path: tuple) -> tuple[Any, str]:
        """The value for a fix that renames or moves a key to ``target`` (``path``): the user's own when the target
        accepts it, else the nearest accepted one and a note saying why."""
        tspec = self._spec_at(target)
        if tspec is None or (isinstance(val, str) and val == "auto"):
            return val, ""
        lax = target.rpartition(".")[0] in self.sch.strict
        candidates = ([val] if _judge(tspec, val, lax) is None else []) + _examples(tspec, val, target)
        value = self._value_for(path, target, candidates)
        if value is _NO or (type(value) is type(val) and value == val):
            return val, ""
        return value, f"  ({_show(val)} is not accepted there: {_expect(tspec)})"

    def _unknown(self, block: str, key: str, dotted: str, val: Any, prefix: str, obj: dict, path: tuple) -> None:
        specs = self.sch.blocks[block]
        strict = block in self.sch.strict
        current = [k for k, s in specs.items() if s.deprecated is None]
        rename = _suggest(key, current)
        homes = [(b, k) for b, k in self.homes.get(key.lower(), []) if b != block]
        title = f'unknown key "{dotted}"'
        fix: list[str] = []
        data: dict[str, Any] = {"key": dotted, "block": block or "(top level)"}
        target = None
        if rename is not None and (rename.lower() == key.lower() or not homes):
            target = prefix + rename
            title += f'; did you mean "{target}"?'
            if rename in obj:
                fix.append(f'"{target}" is set too ({_show(obj[rename])}): merge what you meant into it and remove '
                           f'"{dotted}"')
            else:
                value, note = self._moved(target, val, (*path, rename))
                fix.append(f"rename it: {_json_at(target, _show(value))}{note}")
        elif homes:
            home, real = homes[0]
            target = f"{home}.{real}" if home else real
            title += f'; it belongs in {"the top level" if not home else repr(home).replace(chr(39), chr(34))}'
            value, note = self._moved(target, val, tuple(target.split(".")))
            fix.append(f"move it: {_json_at(target, _show(value))}{note}")
        else:
            fix.append(f'remove "{dotted}"' + (f' ("{block}" accepts: {", ".join(current)})'
                                                if block and len(current) <= 12 else ""))
        data["suggestion"] = target
        if strict:
            evidence = [f'DeepSpeed validates "{block}" with a pydantic model that forbids unknown keys: '
                        f'deepspeed.initialize() stops with "Extra inputs are not permitted".']
        elif block:
            evidence = [f'DeepSpeed reads only {", ".join(current)} in "{block}": this key is ignored.']
        else:
            evidence = ["DeepSpeed ignores unknown top-level keys without a warning: this setting has no effect."]
        if target and not strict:
            tspec = self._spec_at(target)
            if tspec is not None and tspec.kind == "block":
                evidence.append(f'So the run goes without your "{target}" settings (DeepSpeed uses its defaults).')
        self.findings.append(Finding("config.unknown-key", "fail" if strict else "warn", title, evidence, fix, data))

    def _spec_at(self, dotted: str) -> Spec | None:
        block, _, key = dotted.rpartition(".")
        return self.sch.blocks.get(block, {}).get(key)

    def _deprecated(self, dotted: str, key: str, spec: Spec, val: Any, prefix: str, strict: bool,
                    path: tuple) -> None:
        new = spec.deprecated or ""
        title = f'"{dotted}" is deprecated' + (f'; use "{new}"' if new else "")
        fix = _DEPRECATED_FIX.get(key)
        if fix is None and new and " " not in new:
            value, note = self._moved(prefix + new, val, (*path, new))
            fix = f"rename it: {_json_at(prefix + new, _show(value))}{note}"
        self.findings.append(Finding(
            "config.deprecated", "warn", title,
            ["DeepSpeed still maps it to its replacement and logs a deprecation warning; giving both is an error."
             if strict else f'DeepSpeed reads "{dotted}" only when "{new}" is absent.'],
            [fix or f'remove "{dotted}"'], {"key": dotted, "replacement": new or None}))

    def _bad(self, block: str, key: str, dotted: str, val: Any, spec: Spec, severity: str, why: str,
             path: tuple) -> None:
        at, at_path, under = dotted, path, ""
        new = spec.deprecated
        if new and new in self.sch.blocks[block] and self.sch.blocks[block][new].deprecated is None:
            # a deprecated name: the fix sets the value under the current name (the rename finding says so too)
            at, at_path, under = dotted[: len(dotted) - len(key)] + new, (*path[:-1], new), " under its current name"
        example = self._value_for(at_path, at, _examples(spec, val, at))
        expect = _expect(spec)
        where = f'DeepSpeed validates "{block}" with a pydantic model: deepspeed.initialize() stops with an error'
        evidence = [f"{_show(val)} is {why}."]
        if severity == "fail" and block in self.sch.strict:
            evidence.append(where + ".")
        elif severity == "fail" and "as given" not in why:
            evidence.append("DeepSpeed uses values outside its config models as given, without conversion.")
        self.findings.append(Finding(
            "config.bad-value", severity, f"{dotted} = {_show(val)}: expected {expect}", evidence,
            [f"set it to {expect}{under}, e.g. {_json_at(at, _show(example))}" if example is not _NO
             else f'set it to {expect}{under} (no single value settles it here: see the other findings for "{at}")'],
            {"key": dotted, "value": val if isinstance(val, (str, int, float, bool, type(None))) else _show(val),
             "expected": expect}))

    def _optimizer(self, opt: dict) -> None:
        name = opt.get("type")
        if isinstance(name, str) and name != "auto":
            known = name.lower() in self.sch.optimizers or name in self.sch.torch_optimizers
            if not known and (self.sch.torch_optimizers or not name[:1].isupper()):
                cands = list(self.sch.optimizers) + list(self.sch.torch_optimizers)
                s = _suggest(name, cands)
                self.findings.append(Finding(
                    "config.bad-value", "fail",
                    f'optimizer.type = "{name}": not an optimizer DeepSpeed knows'
                    + (f'; did you mean "{s}"?' if s else ""),
                    [f"DeepSpeed accepts its own optimizers ({', '.join(self.sch.optimizers)}; any case) or a "
                     "torch.optim class name (exact case); otherwise it stops with "
                     f'"{name} is not a supported DeepSpeed Optimizer".'],
                    [f'"optimizer": {{"type": "{s or "AdamW"}"}}  (params unchanged)'],
                    {"key": "optimizer.type", "value": name, "suggestion": s}))
        params = opt.get("params")
        if isinstance(params, dict) and "max_grad_norm" in params:
            clip = params["max_grad_norm"]
            self.findings.append(Finding(
                "config.bad-value", "fail", "optimizer.params.max_grad_norm is refused by DeepSpeed",
                ["DeepSpeed raises \"'max_grad_norm' is not supported as an optimizer parameter\": gradient clipping "
                 "is the top-level key gradient_clipping."],
                [f'remove optimizer.params.max_grad_norm and set "gradient_clipping": {_show(clip)}'],
                {"key": "optimizer.params.max_grad_norm"}))

    def _scheduler(self, sch_block: dict) -> None:
        name = sch_block.get("type")
        if not isinstance(name, str) or name == "auto":
            return
        if name not in self.sch.schedulers:
            ds_names = [n for n in self.sch.schedulers if n[:1].isupper()]
            s = _suggest(name, ds_names)
            self.findings.append(Finding(
                "config.bad-value", "fail",
                f'scheduler.type = "{name}": not a scheduler DeepSpeed knows' + (f'; did you mean "{s}"?' if s else ""),
                ["DeepSpeed looks the name up (exact case) in deepspeed.runtime.lr_schedules, then in "
                 f'torch.optim.lr_scheduler, and stops with "DeepSpeed does not recognize LR scheduler {name}".'],
                [f'"scheduler": {{"type": "{s or "WarmupLR"}", "params": {{...}}}}'],
                {"key": "scheduler.type", "value": name, "suggestion": s}))
            return
        params = sch_block.get("params")
        required = self.sch.schedulers[name][1]
        needs = ", ".join(f'"{r}": ...' for r in required)
        if "params" not in sch_block or params is None:
            self.findings.append(Finding(
                "config.bad-value", "fail", f'scheduler "{name}" has no "params"',
                ["DeepSpeed builds the scheduler as Scheduler(optimizer, **params): without params that is a "
                 "TypeError at start."],
                [f'"scheduler": {{"type": "{name}", "params": {{{needs}}}}}'
                 + (f"  (fill in {', '.join(required)})" if required else "")], {"key": "scheduler.params"}))
            return
        if not isinstance(params, dict):
            return
        accepted, required = self.sch.schedulers[name]
        if not accepted:
            return  # **kwargs: anything goes
        for key in params:
            if key not in accepted:
                s = _suggest(str(key), list(accepted))
                self.findings.append(Finding(
                    "config.unknown-key", "fail",
                    f'unknown key "scheduler.params.{key}" for {name}' + (f'; did you mean "{s}"?' if s else ""),
                    [f"{name} takes {', '.join(accepted)}; DeepSpeed passes params as keyword arguments, so an "
                     "unknown one is a TypeError at start."],
                    [f"rename it: {_json_at(f'scheduler.params.{s}', _show(params[key]))}" if s
                     else f'remove "scheduler.params.{key}"'],
                    {"key": f"scheduler.params.{key}", "suggestion": s}))
        missing = [r for r in required if r not in params]
        if missing:
            self.findings.append(Finding(
                "config.bad-value", "fail", f"scheduler {name} needs {', '.join(missing)}",
                [f"{name}'s constructor has no default for {', '.join(missing)}: TypeError at start."],
                [", ".join(f'"{m}": ...' for m in missing) + ' in "scheduler.params"'
                 + (' (with the HF Trainer: "auto")' if "total_num_steps" in missing else "")],
                {"key": "scheduler.params", "missing": missing}))


def _autos(obj: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}{k}"
            if isinstance(v, str) and v == "auto":
                yield path
            else:
                yield from _autos(v, path + ".")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            path = f"{prefix.rstrip('.')}[{i}]"
            if isinstance(v, str) and v == "auto":
                yield path
            else:
                yield from _autos(v, path + ".")


# -- the rules ---------------------------------------------------------------------------------------------------

_OVERFLOW_LINE = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: X, reducing to Y"
_COLLAPSE = ('If the scale keeps falling to min_loss_scale ("Attempted loss scale: 1, reducing to 1"), gradients '
             "overflow at every scale, so the overflow is in the values themselves: raising initial_scale_power (the "
             "HF guide suggests 32) only moves the starting point -- from 2^32 the scale is back at 2^16 after about "
             "16 skipped steps. The usual cause is a model pretrained in bf16 run in fp16: use bf16 (Ampere or "
             "newer) or fp32.")


class _Ctx:
    """The config as DeepSpeed will read it."""

    def __init__(self, config: dict, for_: str, sch: Schema) -> None:
        self.config, self.for_, self.sch = config, for_, sch

    def block(self, path: str) -> dict:
        d: Any = self.config
        for part in path.split(".") if path else ():
            nxt = d.get(part) if isinstance(d, dict) else None
            if part == "bf16" and d is self.config and nxt is None:
                nxt = self.config.get("bfloat16")  # DeepSpeed's old name, read when "bf16" is absent
            d = nxt
        return d if isinstance(d, dict) else {}

    def eff(self, block: str, key: str, conv, default: Any) -> Any:
        """What DeepSpeed uses for ``block.key``: the default when absent (or an "auto" its model drops); None
        when it cannot be known here (the HF Trainer fills it, or the value is invalid and reported elsewhere)."""
        d = self.block(block)
        if key not in d:
            return default
        v = d[key]
        if isinstance(v, str) and v == "auto":
            if self.for_ == "hf" and (f"{block}.{key}" if block else key) in HF_AUTO_KEYS:
                return None
            return default if block in self.sch.strict else None
        return None if v is None else conv(v)

    def stage(self) -> int | None:
        z = self.config.get("zero_optimization")
        if isinstance(z, bool):
            return int(z)
        return self.eff("zero_optimization", "stage", lambda v: n if (n := _lax_int(v)) in (0, 1, 2, 3) else None, 0)

    def device(self, which: str) -> str | None:
        return self.eff(f"zero_optimization.{which}", "device",
                        lambda v: v if v in ("none", "cpu", "nvme") else None, "none")


def _caps(gpu_capabilities: list[str]) -> list[tuple[int, int]]:
    out = []
    for c in gpu_capabilities:
        major, _, minor = str(c).partition(".")
        try:
            out.append((int(major), int(minor or 0)))
        except ValueError:
            continue
    return out


def _gpus_text(caps: list[tuple[int, int]]) -> str:
    counts: dict[tuple[int, int], int] = {}
    for c in caps:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n}x sm {a}.{b}" for (a, b), n in sorted(counts.items()))


def _auto_rule(ctx: _Ctx) -> list[Finding]:
    dropped: list[str] = []  # in a pydantic block: DeepSpeed drops "auto" and uses the default
    passed: list[str] = []  # elsewhere: the string "auto" reaches the code
    notes: list[str] = []
    for dotted in _autos(ctx.config):
        if dotted in ctx.sch.ds_auto:
            continue  # DeepSpeed's own default for the key: "auto" is what it reads there anyway
        if ctx.for_ == "hf" and dotted in HF_AUTO_KEYS:
            continue
        parts = dotted.split(".")
        if parts[0] == "bfloat16":
            parts[0] = "bf16"
        if any(".".join(parts[:i]) in ctx.sch.strict for i in range(1, len(parts))):
            spec = ctx.sch.blocks.get(".".join(parts[:-1]), {}).get(parts[-1])
            d = _default(spec) if spec is not None else _NO
            dropped.append(f"{dotted} (-> {_show(d)})" if d is not _NO else dotted)
            if dotted in ("fp16.enabled", "bf16.enabled", "bfloat16.enabled"):
                notes.append(f'{dotted} "auto" becomes false: {parts[0]} is silently off and the run trains in fp32.')
            elif dotted == "zero_optimization.stage":
                notes.append('zero_optimization.stage "auto" becomes 0: ZeRO is silently off.')
        else:
            passed.append(dotted)
    if not dropped and not passed:
        return []
    keys = [*dropped, *passed]
    n = len(keys)
    evidence = list(notes)
    if dropped:
        evidence.append("DeepSpeed's config models drop \"auto\" and use their defaults: " + ", ".join(dropped) + ".")
    if passed:
        evidence.append('DeepSpeed receives the string "auto" and does not resolve it, so it fails at start or where '
                        "the value is used: " + ", ".join(passed) + ".")
    if ctx.for_ == "deepspeed":
        title = (f'{n} "auto" value{"s" if n > 1 else ""}, but plain DeepSpeed does not fill "auto"'
                 + (' -- fp16.enabled "auto" means fp16 off' if "fp16.enabled" in "".join(dropped) else ""))
        evidence.append('Only the HF Trainer (transformers + accelerate) replaces "auto" with TrainingArguments values;'
                        " deepspeed.initialize() does not.")
        fix = ["replace each with the value the run should use"
               + (', e.g. "fp16": {"enabled": true}' if "fp16.enabled" in "".join(dropped) else ""),
               "or, when the config is for the HF Trainer (TrainingArguments(deepspeed=...)), check it with --for hf"]
        severity = "fail"
    else:
        title = f'{n} "auto" value{"s" if n > 1 else ""} the HF Trainer does not fill'
        evidence.append("transformers and accelerate fill only: " + ", ".join(sorted(HF_AUTO_KEYS)) + ".")
        fix = ["replace each with the value the run should use"]
        severity = "fail" if passed else "warn"
    return [Finding("config.auto-outside-hf", severity, title, evidence, fix,
                    {"dropped": [k.split(" ")[0] for k in dropped], "passed_on": passed, "for": ctx.for_})]


def _precision_rules(ctx: _Ctx, caps: list[tuple[int, int]]) -> list[Finding]:
    out: list[Finding] = []
    fp16_on = ctx.eff("fp16", "enabled", _lax_bool, False)
    bf16_on = ctx.eff("bf16", "enabled", _lax_bool, False)
    ampere = bool(caps) and all(c >= (8, 0) for c in caps)
    hf = ctx.for_ == "hf"
    if fp16_on and bf16_on:
        keep_bf16 = '"fp16": {"enabled": false}, "bf16": {"enabled": true}'
        keep_fp16 = '"fp16": {"enabled": true}, "bf16": {"enabled": false}'
        older = bool(caps) and not ampere
        out.append(Finding(
            "precision.fp16-and-bf16", "fail", "fp16 and bf16 are both enabled",
            ["DeepSpeed asserts at start: \"bfloat16 and fp16 modes cannot be simultaneously enabled\"."]
            + ([f"GPUs here: {_gpus_text(caps)}."] if caps else []),
            [f"keep one: {keep_fp16} (GPUs older than sm 8.0 have no native bf16)" if older else
             f"keep one: {keep_bf16} (Ampere/sm 8.0 or newer)",
             f"or {keep_bf16}" if older else f"or {keep_fp16} (GPUs older than sm 8.0)"],
            {"fp16": True, "bf16": True}))
        return out
    if fp16_on:
        fix = ['"bf16": {"enabled": true} and remove the "fp16" block (or set "fp16": {"enabled": false})']
        if hf:
            fix.append('with the HF Trainer: "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"} and train '
                       "with --bf16 instead of --fp16")
        why = ("fp16's largest value is 65504: models pretrained in bf16 (TPU-trained ones especially) often produce "
               "activations beyond it, which become inf and then a NaN loss. bf16 has fp32's range (3.4e38) and "
               "needs no loss scaling.")
        if ampere:
            out.append(Finding(
                "precision.prefer-bf16", "warn", f"fp16 on GPUs with native bf16 ({_gpus_text(caps)}): prefer bf16",
                [f"Every visible GPU is sm 8.0 (Ampere) or newer: {_gpus_text(caps)}.", why], fix,
                {"gpu_capabilities": [f"{a}.{b}" for a, b in caps]}))
        elif not caps:
            out.append(Finding(
                "precision.prefer-bf16", "info", "fp16 is enabled; on Ampere (sm 8.0) or newer GPUs bf16 is safer",
                ["No GPU is visible here, so the training GPUs could not be checked.", why], fix,
                {"gpu_capabilities": []}))
    if bf16_on and caps and any(c < (8, 0) for c in caps):
        old = [c for c in caps if c < (8, 0)]
        out.append(Finding(
            "precision.bf16-unsupported", "warn", f"bf16 on GPUs without native bf16 ({_gpus_text(old)})",
            ["GPUs older than sm 8.0 (Ampere) have no bf16 units: torch emulates bf16 there (slowly) and DeepSpeed's "
             "bf16 kernels need sm 8.0 or newer."],
            ['"fp16": {"enabled": true, "loss_scale": 0}, "bf16": {"enabled": false}  (fp16 with dynamic loss '
             "scaling), or fp32 (no precision blocks)"],
            {"gpu_capabilities": [f"{a}.{b}" for a, b in caps]}))
    return out


def _loss_scale_rules(ctx: _Ctx) -> list[Finding]:
    if ctx.eff("fp16", "enabled", _lax_bool, False) is not True:
        return []
    out: list[Finding] = []
    ls = ctx.eff("fp16", "loss_scale", _lax_float, 0.0)
    if ls is None or not math.isfinite(ls) or ls < 0:
        return out  # reported as config.bad-value
    isp = ctx.eff("fp16", "initial_scale_power", _lax_int, 16)
    win = ctx.eff("fp16", "loss_scale_window", _lax_int, 1000)
    hyst = ctx.eff("fp16", "hysteresis", _lax_int, 2)
    cons = ctx.eff("fp16", "consecutive_hysteresis", _lax_bool, False)
    minls = ctx.eff("fp16", "min_loss_scale", _lax_int, 1)

    def finding(sev: str, title: str, evidence: list[str], fix: str, key: str, value: Any) -> None:
        out.append(Finding("fp16.loss-scale", sev, title, evidence, [fix], {"key": f"fp16.{key}", "value": value}))

    if ls > 0:
        dyn_keys = [k for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                                "min_loss_scale") if k in ctx.block("fp16")]
        finding("warn", f"fp16.loss_scale = {ls:g}: a static loss scale, no dynamic loss scaling",
                ["With loss_scale > 0 DeepSpeed keeps the scale fixed: a step whose gradients overflow is skipped "
                 '("OVERFLOW! Skipping step") and the scale is never lowered, so a scale that is too high skips step '
                 "after step, and one that is too low flushes small gradients to zero."]
                + ([f"{', '.join(dyn_keys)} only apply to dynamic scaling (loss_scale 0) and are ignored."]
                   if dyn_keys else []),
                '"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}  (dynamic scaling, '
                "DeepSpeed's default)", "loss_scale", ls)
        return out
    for key, value in (("loss_scale_window", win), ("min_loss_scale", minls)):
        if value is not None and value <= 0:
            out.append(Finding(
                "config.bad-value", "fail", f"fp16.{key} = {value}: expected an integer > 0 with dynamic loss scaling",
                [f"DeepSpeed's fp16 model refuses it when fp16 is on with loss_scale 0: \"fp16.{key} must be > 0 when "
                 'dynamic loss scaling is enabled (loss_scale=0)".'],
                [f'"fp16": {{"{key}": {1000 if key == "loss_scale_window" else 1}}}  (DeepSpeed\'s default)'],
                {"key": f"fp16.{key}", "value": value, "expected": "an integer > 0"}))
    if hyst is not None and hyst <= 0:
        finding("fail", f"fp16.hysteresis = {hyst}: the dynamic loss scale is never lowered",
                ["DynamicLossScaler halves the scale only when hysteresis is 1 or its countdown reaches 1; from "
                 f"{hyst} the countdown only goes down, so every step whose gradients overflow is skipped at the same "
                 "scale, for the rest of the run (each skip logged at INFO only)."],
                '"fp16": {"hysteresis": 2}  (DeepSpeed\'s default)', "hysteresis", hyst)
    if isp is not None and isp < 8:
        steps = (16 - isp) * win if win and win > 0 else None
        finding("warn", f"fp16.initial_scale_power = {isp}: the loss scale starts at 2^{isp}",
                ["A gradient survives in fp16 only if gradient x scale >= 6e-8 (fp16's smallest subnormal): at "
                 f"2^{isp} gradients below {math.ldexp(1.0, -24 - isp) if isp > -990 else math.inf:.1e} flush to "
                 f"zero (at DeepSpeed's default 2^16: {math.ldexp(1.0, -40):.1e}). The scale only doubles after "
                 f"loss_scale_window ({win}) clean steps"
                 + (f", so reaching 2^16 takes {steps} steps." if steps else ".")],
                '"fp16": {"initial_scale_power": 16}  (DeepSpeed\'s default: if it is too high, the first '
                "overflowing steps are skipped while it halves)", "initial_scale_power", isp)
    elif isp is not None and isp > 32:
        skipped = isp - 16 + max((hyst or 1) - 1, 0)
        finding("warn", f"fp16.initial_scale_power = {isp}: the loss scale starts at 2^{isp}",
                [f"Each overflowing step is skipped and halves the scale (after hysteresis {hyst} counts down): coming "
                 f"down to DeepSpeed's default 2^16 costs {skipped} skipped steps when the gradients overflow there.",
                 _COLLAPSE],
                '"fp16": {"initial_scale_power": 16}  (DeepSpeed\'s default; the HF guide\'s advice stops at 32)',
                "initial_scale_power", isp)
    if win is not None and 0 < win < 100:
        finding("warn", f"fp16.loss_scale_window = {win}: the loss scale is raised every {win} clean steps",
                [f"DynamicLossScaler doubles the scale after every {win} steps without overflow; when the doubled "
                 "scale overflows, that step is skipped"
                 + (f" (up to {hyst} of them, hysteresis)" if hyst and hyst > 1 else "")
                 + " and the scale halves again: a run at its largest safe scale throws away about one step in "
                 f"{win}."],
                '"fp16": {"loss_scale_window": 1000}  (DeepSpeed\'s default)', "loss_scale_window", win)
    if cons and hyst is not None and hyst > 1:
        finding("warn", f"fp16.consecutive_hysteresis = true with hysteresis {hyst}: scattered overflows never "
                        "lower the scale",
                [f"DeepSpeed refills hysteresis after every clean step, so the scale only halves when {hyst} "
                 "overflows come in a row: a run that overflows every other step skips half its steps and the scale "
                 "never adapts (each skip is logged at INFO only)."],
                '"fp16": {"consecutive_hysteresis": false}  (DeepSpeed\'s default)', "consecutive_hysteresis", True)
    if minls is not None and minls > 1 and isp is not None and 0 <= isp <= 1000 and minls >= 2**isp:
        finding("warn", f"fp16.min_loss_scale = {minls} is not below the initial scale 2^{isp}",
                ["The dynamic scale never goes below min_loss_scale, and an overflow at the minimum stops the run: "
                 '"Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." With the '
                 "floor at the start, one or two rounds of overflow end the run."],
                '"fp16": {"min_loss_scale": 1}  (DeepSpeed\'s default)', "min_loss_scale", minls)
    return out


def _logging_rule(ctx: _Ctx) -> list[Finding]:
    if ctx.eff("fp16", "enabled", _lax_bool, False) is not True:
        return []
    ls = ctx.eff("fp16", "loss_scale", _lax_float, 0.0)
    if ls is None or ls != 0:
        return []  # static scaling logs its skips at WARNING
    level = ctx.config.get("log_level")
    if level is not None and not isinstance(level, str):
        return []
    if isinstance(level, str) and level.lower() in ("debug", "info"):
        return []
    shown = f'"log_level" is "{level}"' if level is not None else '"log_level" is not set'
    evidence = [
        f"DeepSpeed's dynamic loss scaler logs every skipped step at INFO: \"{_OVERFLOW_LINE}\" "
        "(deepspeed/runtime/fp16/loss_scaler.py).",
        "DeepSpeed's logger (\"DeepSpeed\", deepspeed/utils/logging.py) and its stdout handler start at WARNING; "
        f"only the config key \"log_level\" lowers both, when the engine starts. Here {shown}.",
        "So skipped steps and a falling scale stay invisible until the run stops with \"Current loss scale already "
        "at minimum - cannot decrease scale anymore. Exiting run.\" or the loss is NaN.",
    ]
    if ctx.for_ == "hf":
        evidence.append("The HF Trainer's --log_level info does not help: it sets the DeepSpeed logger's level but "
                        "not its handler's, which stays at WARNING.")
    evidence.append("The deepspeed launcher's --log_level (default info) applies to the launcher process only.")
    evidence.append(_COLLAPSE)
    return [Finding(
        "logging.overflow-hidden", "warn", "fp16 overflow messages will not be printed (DeepSpeed logs them at INFO)",
        evidence,
        ['"log_level": "info" at the top level of the config (DeepSpeed then prints its other INFO lines too)',
         'or in the training script: from deepspeed.utils.logging import set_log_level_from_string; '
         'set_log_level_from_string("info")'],
        {"log_level": level})]


def _batch_rule(ctx: _Ctx, world_size: int | None) -> list[Finding]:
    raw = {k: ctx.config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps")}
    vals: dict[str, int | None] = {}
    for k, v in raw.items():
        if v is None:
            vals[k] = None
        elif isinstance(v, int) and not isinstance(v, bool) and v > 0:
            vals[k] = v
        else:
            return []  # "auto" (filled by the HF Trainer or reported) or a bad value (reported)
    tbs, mb, gas = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    ws = world_size
    ws_note = ("world size = the data-parallel ranks: GPUs / (tensor x pipeline x sequence parallel degree)")

    def fail(title: str, evidence: list[str], fix: list[str]) -> list[Finding]:
        return [Finding("config.batch-size", "fail", title, evidence + [ws_note], fix,
                        {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": mb,
                         "gradient_accumulation_steps": gas, "world_size": ws})]

    if tbs is None and mb is None:
        if ctx.for_ == "hf":
            return []
        return fail("neither train_batch_size nor train_micro_batch_size_per_gpu is set",
                    ['DeepSpeed stops at start: "Either train_batch_size or train_micro_batch_size_per_gpu needs to be '
                     'provided".'],
                    ['"train_micro_batch_size_per_gpu": 1 (the per-GPU batch; DeepSpeed derives train_batch_size)'])
    if tbs is not None and mb is not None and gas is not None:
        if ws is not None:
            if tbs == mb * gas * ws:
                return []
            fix = [f'"train_batch_size": {mb * gas * ws}  (= {mb} x {gas} x {ws})']
            if tbs % (mb * ws) == 0:
                fix.append(f'or "gradient_accumulation_steps": {tbs // (mb * ws)}  (keeps train_batch_size {tbs})')
            if tbs % (gas * ws) == 0:
                fix.append(f'or "train_micro_batch_size_per_gpu": {tbs // (gas * ws)}')
            fix.append("or remove train_batch_size and let DeepSpeed derive it")
            return fail(f"train_batch_size {tbs} != micro batch {mb} x accumulation {gas} x world size {ws} "
                        f"= {mb * gas * ws}",
                        ["DeepSpeed asserts train_batch_size == train_micro_batch_size_per_gpu x "
                         "gradient_accumulation_steps x world_size at start."], fix)
        if tbs % (mb * gas):
            return fail(f"train_batch_size {tbs} is not a multiple of micro batch {mb} x accumulation {gas} "
                        f"= {mb * gas}: no world size fits",
                        ["DeepSpeed asserts train_batch_size == train_micro_batch_size_per_gpu x "
                         "gradient_accumulation_steps x world_size at start."],
                        [f'"train_batch_size": {mb * gas} x <world size>, or remove it and let DeepSpeed derive it'])
        implied = tbs // (mb * gas)
        return [Finding("config.batch-size", "info", f"the batch sizes only fit a world size of {implied}",
                        [f"train_batch_size {tbs} = micro batch {mb} x accumulation {gas} x {implied}; on any other "
                         "number of data-parallel ranks DeepSpeed's batch assertion fails.", ws_note],
                        [f"run on {implied} data-parallel ranks, or pass --world-size N to check another size, or "
                         "remove train_batch_size and let DeepSpeed derive it"],
                        {"implied_world_size": implied})]
    if ws is None:
        return []
    # DeepSpeed derives the missing value with floor division, then asserts the product
    if tbs is not None and mb is not None:
        d_gas = tbs // mb // ws
        if d_gas * mb * ws != tbs or d_gas < 1:
            return fail(f"train_batch_size {tbs} does not split into micro batch {mb} x world size {ws}",
                        [f"DeepSpeed derives gradient_accumulation_steps = {tbs} // {mb} // {ws} = {d_gas}, and "
                         f"{mb} x {d_gas} x {ws} = {mb * d_gas * ws} != {tbs}: its batch assertion fails."],
                        [f'"train_batch_size": {mb * max(d_gas, 1) * ws}  (with gradient_accumulation_steps '
                         f"{max(d_gas, 1)})", '"gradient_accumulation_steps": N with train_batch_size = '
                                              f"{mb} x N x {ws}"])
    elif tbs is not None and gas is not None:
        d_mb = tbs // ws // gas
        if d_mb * gas * ws != tbs or d_mb < 1:
            return fail(f"train_batch_size {tbs} does not split into accumulation {gas} x world size {ws}",
                        [f"DeepSpeed derives train_micro_batch_size_per_gpu = {tbs} // {ws} // {gas} = {d_mb}, and "
                         f"{d_mb} x {gas} x {ws} = {d_mb * gas * ws} != {tbs}: its batch assertion fails."],
                        [f'"train_batch_size": {max(d_mb, 1) * gas * ws}  (micro batch {max(d_mb, 1)})',
                         '"train_micro_batch_size_per_gpu": N instead of train_batch_size'])
    elif tbs is not None:
        d_mb = tbs // ws
        if d_mb * ws != tbs or d_mb < 1:
            return fail(f"train_batch_size {tbs} is not a multiple of world size {ws}",
                        [f"DeepSpeed derives train_micro_batch_size_per_gpu = {tbs} // {ws} = {d_mb} (accumulation 1) "
                         "and its batch assertion fails."],
                        [f'"train_batch_size": {max(d_mb, 1) * ws}', '"train_micro_batch_size_per_gpu": N instead'])
    return []


def _zero_rules(ctx: _Ctx, libaio: str | None) -> list[Finding]:
    out: list[Finding] = []
    stage = ctx.stage()
    param_dev, opt_dev = ctx.device("offload_param"), ctx.device("offload_optimizer")
    if stage is not None and stage < 3 and param_dev in ("cpu", "nvme"):
        out.append(Finding(
            "zero.offload-param-stage", "fail",
            f'zero_optimization.offload_param ({param_dev}) with ZeRO stage {stage}: parameters are not offloaded',
            [f"DeepSpeed hands offload_param only to the ZeRO-3 engine; at stage {stage} it is ignored without a "
             "word and the parameters stay on the GPU. Stages 1 and 2 can offload only the optimizer."],
            ['"zero_optimization": {"stage": 3, "offload_param": {"device": "' + param_dev + '"'
             + (', "nvme_path": "/local_nvme"' if param_dev == "nvme" else "") + "}}",
             'or keep stage ' + str(stage) + ' and remove offload_param ("offload_optimizer": {"device": "cpu"} '
             "is what stages 1-2 can offload)"],
            {"stage": stage, "device": param_dev}))
    if stage is not None and stage in (1, 2) and opt_dev == "nvme":
        out.append(Finding(
            "zero.nvme-stage", "warn",
            f"zero_optimization.offload_optimizer to NVMe with ZeRO stage {stage}: the optimizer goes to CPU memory",
            [f"The ZeRO stage 1/2 optimizer treats any offload device as CPU: nvme_path is never used at stage {stage}."
             " Only ZeRO-3 swaps optimizer state to NVMe."],
            ['"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}',
             'or "offload_optimizer": {"device": "cpu"} to say what happens'],
            {"stage": stage}))
    nvme = []
    for which, dev in (("offload_param", param_dev), ("offload_optimizer", opt_dev)):
        if dev != "nvme" or stage not in (3, None):  # below stage 3 NVMe is not used (the findings above say so)
            continue
        nvme.append(which)
        path = ctx.eff(f"zero_optimization.{which}", "nvme_path", lambda v: v if isinstance(v, str) else None, None)
        raw = ctx.block(f"zero_optimization.{which}").get("nvme_path")
        if path is None and not (ctx.for_ == "hf" and raw == "auto") or path == "":
            out.append(Finding(
                "zero.nvme-path", "fail", f'zero_optimization.{which} is on "nvme" without an nvme_path',
                ["ZeRO-3 stops at start without it: " + (
                    "an assertion ('\"nvme_path\" in DeepSpeed Config cannot be None if remote device is nvme')."
                    if which == "offload_param" else "a TypeError from os.path.join(None, 'zero_stage_3').")],
                [f'"zero_optimization": {{"{which}": {{"device": "nvme", "nvme_path": "/local_nvme"}}}}  (a '
                 "directory on a local NVMe drive, writable by every rank)"],
                {"block": f"zero_optimization.{which}"}))
    if nvme and libaio is None:
        out.append(Finding(
            "build.libaio-missing", "fail",
            f"NVMe offload ({', '.join(nvme)}) needs libaio, which is not installed here",
            ["DeepSpeed swaps to NVMe with its async_io op, which builds against libaio; libaio.so (from libaio-dev) "
             "was not found in the system library directories."],
            ["sudo apt install libaio-dev   (RHEL/Fedora: sudo dnf install libaio-devel)",
             "then build the op: DS_BUILD_AIO=1 pip install deepspeed --no-cache-dir --force-reinstall "
             "(or let DeepSpeed JIT-build it on first use); `ds_report` should then show async_io [OKAY]"],
            {"offload": nvme}))
    z = ctx.block("zero_optimization")
    if ctx.eff("zero_optimization", "compute_grad_norm", _lax_bool, True) is False and stage not in (1, 2, None):
        out.append(Finding(
            "config.bad-value", "fail", f"zero_optimization.compute_grad_norm = false needs ZeRO stage 1 or 2 "
                                        f"(stage is {stage})",
            ['DeepSpeed\'s ZeRO model refuses it: "compute_grad_norm=false is supported only with ZeRO Stage 1 or 2".'],
            ['remove "compute_grad_norm" (default true)'], {"key": "zero_optimization.compute_grad_norm"}))
    ratio = ctx.eff("zero_optimization.offload_optimizer", "ratio", _lax_float, 1.0)
    if (isinstance(z.get("offload_optimizer"), dict) and ratio is not None and ratio < 1.0
            and stage is not None and stage != 3):
        out.append(Finding(
            "config.bad-value", "fail", f"zero_optimization.offload_optimizer.ratio = {ratio:g} needs ZeRO stage 3",
            ['DeepSpeed asserts: "Partial offloading only supported for ZeRO Stage 3."'],
            ['"zero_optimization": {"stage": 3}, or remove "ratio"'],
            {"key": "zero_optimization.offload_optimizer.ratio"}))
    for block, key in (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
                       ("bf16", "bf16_optimizer_states")):
        if ctx.eff(block, key, _lax_bool, False) and stage == 0:
            out.append(Finding(
                "config.bad-value", "fail", f"{block}.{key} needs ZeRO stage 1, 2 or 3",
                [f"DeepSpeed asserts at start that {key} is only supported with ZeRO stage 1, 2 or 3."],
                [f'"zero_optimization": {{"stage": 2}}, or remove "{key}"'], {"key": f"{block}.{key}"}))
    if ctx.eff("bf16", "bf16_optimizer_states", _lax_bool, False) and ctx.eff(
            "bf16", "bf16_master_weights_and_grads", _lax_bool, False) is False:
        out.append(Finding(
            "config.bad-value", "fail", "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads",
            ['DeepSpeed asserts: "bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled."'],
            ['"bf16": {"bf16_master_weights_and_grads": true}'
             + (', "zero_optimization": {"stage": 2}  (it needs ZeRO stage 1, 2 or 3 too)' if stage == 0 else ""),
             'or remove "bf16_optimizer_states"'], {"key": "bf16.bf16_optimizer_states"}))
    return out


def _findings(config: dict, *, world_size: int | None, for_: str, caps: list[str], libaio: str | None,
              verify: bool) -> list[Finding]:
    sch = schema()
    walker = _Walker(sch, config, for_, verify)
    walker.walk("", config, "")
    ctx = _Ctx(config, for_, sch)
    gpu_caps = _caps(caps)
    return [*walker.findings, *_auto_rule(ctx), *_precision_rules(ctx, gpu_caps), *_loss_scale_rules(ctx),
            *_logging_rule(ctx), *_batch_rule(ctx, world_size), *_zero_rules(ctx, libaio)]


def check(config: dict, *, world_size: int | None, for_: str, gpu_capabilities: list[str], libaio: str | None,
          path: str = "") -> list[Finding]:
    """Findings for a DeepSpeed config dict (as :func:`load` returns it).

    Args:
        config: the config object.
        world_size: data-parallel ranks the run will have (None: unknown; the batch check then does what it can).
        for_: ``"deepspeed"`` (passed to ``deepspeed.initialize``) or ``"hf"`` (passed to the HF Trainer, which fills
            the ``"auto"`` values in :data:`HF_AUTO_KEYS`).
        gpu_capabilities: compute capabilities of the GPUs the run will use, e.g. ``["8.6", "8.6"]`` (may be empty).
        libaio: where libaio.so is, or None when it is not installed (NVMe offload needs it).
        path: the file's name, for the titles.

    Returns:
        One finding per problem (``config.ok`` when there is none worse than info). Never raises on any JSON object.
    """
    if for_ not in FOR_CHOICES:
        raise ValueError(f"for_ must be one of {FOR_CHOICES}, not {for_!r}")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    sch = schema()
    findings = _findings(config, world_size=world_size, for_=for_, caps=gpu_capabilities, libaio=libaio, verify=True)
    if not any(f.severity in ("warn", "fail") for f in findings):
        findings.append(Finding(
            "config.ok", "ok", f"{path or 'the config'}: no problems found",
            [f"{len(config)} top-level keys checked against {sch.source}, for {for_}"
             + (f", world size {world_size}" if world_size else "") + "."],
            [], {"schema": sch.source}))
    return findings

"""ZeRO model-state memory estimates: how much host RAM per node and GPU memory per GPU a ZeRO setup needs.

Pure: numbers in, rows out; :mod:`.memory_rules` judges them into findings and `torchdoctor ds memory`
(:mod:`.memory_run`) does the I/O.

**Model states only.** Weights, gradients and optimizer states (Adam). Activations, the CUDA context,
communication buckets, prefetch/persistence buffers, the dataloader and the framework itself are *not*
included, here or in DeepSpeed's estimators; every output says so.

Units: GiB = 2**30 bytes. DeepSpeed's estimators print the same 2**30 figures labelled "GB".

Rows DeepSpeed's estimators compute (``estimate_zero2_model_states_mem_needs`` in
``deepspeed/runtime/zero/stage_1_and_2.py``, ``estimate_zero3_model_states_mem_needs`` in ``stage3.py``) are
reproduced with DeepSpeed's own arithmetic (same operation order, same ``int()`` truncation), so they agree to the
byte. With P total params, L the largest layer's direct params, G = gpus_per_node x nodes ranks, gpn ranks per
node, N nodes, f = 1.5 (``additional_buffer_factor``); host figures are per node, GPU figures per GPU:

- ZeRO-2, offload_optimizer=cpu: GPU 2P; host P x max(4G, 16) x f.  none: GPU 2P + 18P/G; host 4P x gpn x f.
- ZeRO-3 (4L = 16-bit weights + gradients of the largest layer, gathered whole on one GPU):
  param cpu + optimizer cpu: GPU 4L; host 18P/N x f with zero.Init, else P x max(4 gpn, 18/N) x f.
  param none + optimizer cpu: GPU 4L + 2P/G; host 16P/N x f, else P x max(4 gpn, 16/N) x f.
  none + none: GPU 4L + 18P/G; host 4L x gpn x f with zero.Init, else 4P x gpn x f.

Two quirks are kept for parity: DeepSpeed's ZeRO-2 offload host figure multiplies by *all* G ranks and does not
divide the optimizer states by N (so on several nodes it is up to N times what one node really holds), and its
zero.Init rows with CPU offload have no "one fp32 layer per rank" floor.

**Bytes per parameter.** The textbook split is: fp16/bf16 mixed precision = 2 (16-bit weights) + 2 (16-bit
gradients) + 12 (fp32 master weights 4 + Adam m 4 + v 4) = 16; fp32 = 4 (weights) + 4 (gradients) + 8 (Adam m, v)
= 16. DeepSpeed's ZeRO optimizers hold one more 4-byte copy, which its estimators count ("18 = 2 grads_16bit +
4 grads_32bit + 4 params_32bit + 8 optimizer_states"):

- fp16/bf16: the gradient partition is upcast to an fp32 copy (+4) -> 20 bytes/param in all.
- fp32 with ZeRO >= 1: the optimizer steps its own fp32 partition, a clone of the weights
  (``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``, +4) -> 20. Plain fp32 (ZeRO-0) steps
  the weights in place -> 16.

fp16 and bf16 use the same optimizers and buffers, so their rows are equal. What each stage shards over G
(the rest is on every GPU); bytes per GPU, fp16|bf16 then fp32:

- ZeRO-0 (plain data parallel): nothing sharded: 20P; fp32 16P (no master copy).
- ZeRO-1: weights and grads replicated, fp32 grads + master + Adam sharded: 4P + 16P/G; fp32 8P + 12P/G (*).
- ZeRO-2: weights replicated, grads + fp32 grads + master + Adam sharded: 2P + 18P/G; fp32 4P + 16P/G.
- ZeRO-3: everything sharded, plus the largest layer's weights + grads gathered: 4L + 18P/G; fp32 8L + 20P/G.

(*) in fp32 the fp32 gradient partition is a view of the gradients, not a copy.

Offloading the optimizer moves the fp32 gradient partition, the master weights and Adam m, v (16 bytes/param)
to the host, in both precisions; offloading the parameters (ZeRO-3) moves the weight shards (2 or 4 bytes).
Without zero.Init every rank first builds the whole model in fp32 on the host (4 bytes/param x gpn ranks per
node) before ZeRO partitions it: that start-up peak is the usual reason processes are killed at start.

New rows (not in DeepSpeed's estimators), with the same accounting: ZeRO-0 (plain data parallel) and ZeRO-1
(offload_optimizer none|cpu; with cpu the GPU keeps weights and full gradients, (w+g)P, and the host figure is
DeepSpeed's ZeRO-2 offload one: same optimizer class, same buffers), fp32 training, and NVMe offload for ZeRO-3.
ZeRO-3's DeepSpeed rows skip offload_param without offload_optimizer; so do these.

**NVMe assumption** (ZeRO-3 only: ZeRO-1/2 treat ``offload_optimizer.device: nvme`` exactly like ``cpu`` --
``stage_1_and_2.py`` sets ``cpu_offload`` for any device but none -- so their states stay in host RAM). NVMe moves
the same states off host RAM as CPU offload does, except what DeepSpeed keeps in pinned host buffers, taken from
its defaults (or the config's values, see :class:`NvmeSettings`):

- offload_param nvme, per rank: ``min(P/G, max_in_cpu)`` weights stay in a pinned host buffer
  (``_create_param_groups_fp16_flat_cpu_memory``; max_in_cpu defaults to 1e9 elements, so small shards never
  leave the host) plus ``buffer_count x buffer_size`` swap buffers (5 x 1e8 elements), 2 or 4 bytes each.
- offload_optimizer nvme, per rank: ``buffer_count`` (4) pinned fp32 swap buffers of the largest sub-group,
  taken as ``min(P/G, sub_group_size)`` (sub_group_size defaults to 1e9).
- with zero.Init each rank still materialises a layer in fp32 on the host: the host figure is at least 4L x gpn
  (the floor DeepSpeed uses in its no-offload zero.Init row); without zero.Init the 4P x gpn start-up peak stays.

The result is multiplied by the same buffer factor f. GPU figures equal the CPU-offload rows'.

**Findings** (:func:`judge`) look at one row: the configured one (``--config``), else the *likely* one, the fastest
setup that fits the GPU (:data:`PREFERENCE`: no offload at ZeRO-0, 1, 2, 3, then CPU offload, then NVMe; zero.Init
first). ``memory.host-oom-at-start``: that row needs more host RAM per node than there is -- ``fail`` for a
configured row or when no row fits both, ``warn`` for the likely row when another fits (the fixes list those, as
config snippets, with the guide's remedies: NVMe instead of CPU offload, zero.Init, fewer ranks per node).
``memory.gpu-oom``: no row fits the GPU, or the configured one does not. ``memory.fits``: the row fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .model_count import count_params  # lives with the model counting; this import path is kept

__all__ = [
    "GIB",
    "BUFFER_FACTOR",
    "PRECISIONS",
    "NOTE",
    "NvmeSettings",
    "Inputs",
    "Row",
    "RowKey",
    "Configured",
    "zero012_bytes",
    "zero3_bytes",
    "estimate",
    "configured_from_ds_config",
    "count_params",
    "describe",
]

GIB = 2**30
BUFFER_FACTOR = 1.5
PRECISIONS = ("fp16", "bf16", "fp32")
DEVICES = ("none", "cpu", "nvme")
NOTE = ("model states only (weights, gradients, optimizer states): activations, the CUDA context, communication "
        "buffers and the dataloader are not included")
NVME_PATH = "/local_nvme"

# bytes per parameter -------------------------------------------------------------------------------------------
INIT_BYTES = 4  # each rank builds the model in fp32 on the host before ZeRO partitions it (no zero.Init)
FP32_GRAD = 4  # the fp32 gradient partition the optimizer steps with (a copy in fp16/bf16, the grad itself in fp32)
MASTER = 4  # fp32 master partition (DeepSpeed's ZeRO optimizers clone it even when the weights are fp32)
ADAM = 8  # Adam m and v, fp32
HOST_OPTIMIZER = FP32_GRAD + MASTER + ADAM  # 16: what offload_optimizer moves to the host


def weight_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _grad_copy(precision: str) -> int:
    """The fp32 copy of the gradient partition: only when gradients are 16-bit."""
    return 0 if precision == "fp32" else FP32_GRAD


@dataclass(frozen=True)
class NvmeSettings:
    """DeepSpeed's pinned host buffers under NVMe offload (defaults of 0.19.8's offload configs).

    Args:
        param_buffer_count: ``offload_param.buffer_count`` (5).
        param_buffer_size: ``offload_param.buffer_size`` in elements (1e8).
        param_max_in_cpu: ``offload_param.max_in_cpu``: weight elements per rank kept in host RAM (1e9).
        optimizer_buffer_count: ``offload_optimizer.buffer_count`` (4).
        sub_group_size: ``zero_optimization.sub_group_size`` in elements (1e9).
    """

    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    param_max_in_cpu: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    sub_group_size: int = 1_000_000_000

    def to_json(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Inputs:
    """What the estimate needs. ``largest_layer`` None = unknown (ZeRO-3 figures are then lower bounds);
    ``cpu_gib``/``gpu_gib`` None = unknown (fits is then None)."""

    total_params: int
    largest_layer: int | None = None
    gpus_per_node: int = 1
    nodes: int = 1
    cpu_gib: float | None = None
    gpu_gib: float | None = None
    buffer_factor: float = BUFFER_FACTOR
    nvme: NvmeSettings = field(default_factory=NvmeSettings)

    def __post_init__(self) -> None:
        for name in ("total_params", "gpus_per_node", "nodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.largest_layer is not None and (not isinstance(self.largest_layer, int) or self.largest_layer <= 0):
            raise ValueError(f"largest_layer must be a positive integer, got {self.largest_layer!r}")
        if self.largest_layer is not None and self.largest_layer > self.total_params:
            raise ValueError(f"largest_layer ({self.largest_layer}) cannot exceed total_params ({self.total_params})")
        for name in ("cpu_gib", "gpu_gib"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of GiB, got {v!r}")

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def to_json(self) -> dict[str, Any]:
        return {
            "total_params": self.total_params,
            "largest_layer_params": self.largest_layer,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "cpu_mem_gib": self.cpu_gib,
            "gpu_mem_gib": self.gpu_gib,
            "additional_buffer_factor": self.buffer_factor,
            "nvme": self.nvme.to_json(),
        }


# (stage, offload_param, offload_optimizer, zero_init, precision)
RowKey = tuple[int, str, str, "bool | None", str]


@dataclass(frozen=True)
class Row:
    """One setup and its model-state needs: host bytes per node, GPU bytes per GPU."""

    stage: int
    offload_param: str
    offload_optimizer: str
    zero_init: bool | None
    precision: str
    cpu_bytes: int
    gpu_bytes: int
    source: str  # "deepspeed" (DeepSpeed's estimators have this row) or "torchdoctor"
    cpu_lower_bound: bool = False  # the largest layer is unknown and enters this figure
    gpu_lower_bound: bool = False
    fits_cpu: bool | None = None
    fits_gpu: bool | None = None

    @property
    def key(self) -> RowKey:
        return (self.stage, self.offload_param, self.offload_optimizer, self.zero_init, self.precision)

    @property
    def cpu_gib(self) -> float:
        return self.cpu_bytes / GIB

    @property
    def gpu_gib(self) -> float:
        return self.gpu_bytes / GIB

    @property
    def fits(self) -> bool | None:
        """False if either need exceeds what is known to be there, True if both are known to fit, else None."""
        if self.fits_cpu is False or self.fits_gpu is False:
            return False
        if self.fits_cpu and self.fits_gpu:
            return True
        return None

    @property
    def label(self) -> str:
        return describe(self.key)

    def to_json(self, configured: bool = False) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "zero_init": self.zero_init,
            "precision": self.precision,
            "cpu_gib": round(self.cpu_gib, 4),
            "gpu_gib": round(self.gpu_gib, 4),
            "fits": self.fits,
            "fits_cpu": self.fits_cpu,
            "fits_gpu": self.fits_gpu,
            "cpu_bytes": self.cpu_bytes,
            "gpu_bytes": self.gpu_bytes,
            "cpu_lower_bound": self.cpu_lower_bound,
            "gpu_lower_bound": self.gpu_lower_bound,
            "source": self.source,
            "configured": configured,
        }


# the formulas ----------------------------------------------------------------------------------------------------


def zero012_bytes(stage: int, total_params: int, gpus_per_node: int = 1, nodes: int = 1,
                  offload_optimizer: str = "none", precision: str = "fp16",
                  buffer_factor: float = BUFFER_FACTOR) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU) for ZeRO-0, -1 or -2.

    ZeRO-2 in fp16/bf16 is DeepSpeed's ``estimate_zero2_model_states_mem_needs`` term for term. ``nvme`` is
    treated as ``cpu``, as DeepSpeed's stage 1/2 optimizer does.
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"zero012_bytes: stage must be 0, 1 or 2, got {stage}")
    if offload_optimizer not in DEVICES:
        raise ValueError(f"offload_optimizer must be one of {DEVICES}, got {offload_optimizer!r}")
    if stage == 0 and offload_optimizer != "none":
        raise ValueError("optimizer offload needs ZeRO stage 1 or higher")
    p, w = total_params, weight_bytes(precision)
    g = w  # gradients are kept in the weights' dtype
    total_gpus = nodes * gpus_per_node
    if offload_optimizer != "none":
        gpu_mem = (w + (g if stage == 1 else 0)) * p
        cpu_mem = p * max(INIT_BYTES * total_gpus, HOST_OPTIMIZER) * buffer_factor
    else:
        if stage == 0:
            master = MASTER if precision != "fp32" else 0  # plain fp32 steps the weights in place
            gpu_mem = (w + g + _grad_copy(precision) + master + ADAM) * p
        elif stage == 1:
            gpu_mem = (w + g) * p + int((_grad_copy(precision) + MASTER + ADAM) * p / total_gpus)
        else:
            gpu_mem = w * p + int((g + _grad_copy(precision) + MASTER + ADAM) * p / total_gpus)
        cpu_mem = p * INIT_BYTES * gpus_per_node * buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_bytes(total_params: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1,
                offload_param: str = "cpu", offload_optimizer: str = "cpu", zero_init: bool = True,
                precision: str = "fp16", buffer_factor: float = BUFFER_FACTOR,
                nvme: NvmeSettings | None = None) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU) for ZeRO-3.

    Without NVMe in fp16/bf16 this is DeepSpeed's ``estimate_zero3_model_states_mem_needs`` term for term
    (``cpu_offload`` = offload_optimizer, ``cpu_offload_params`` = offload_param).
    """
    if offload_param not in DEVICES or offload_optimizer not in DEVICES:
        raise ValueError(f"offload devices must be among {DEVICES}")
    if offload_param != "none" and offload_optimizer == "none":
        raise ValueError("offload_param without offload_optimizer is not estimated (DeepSpeed's estimator skips it)")
    nvme = nvme or NvmeSettings()
    p, lp, w = total_params, largest_layer, weight_bytes(precision)
    total_gpus = nodes * gpus_per_node
    gpus_factor = 1 / nodes
    largest_layer_memory = (w + w) * lp  # weights + grads of the largest layer, gathered on one GPU
    shard = w + FP32_GRAD + MASTER + ADAM  # 18 in fp16/bf16
    if offload_param != "none":
        gpu_mem = largest_layer_memory
    elif offload_optimizer != "none":
        gpu_mem = largest_layer_memory + int(w * p / total_gpus)
    else:
        gpu_mem = largest_layer_memory + int(shard * p / total_gpus)

    if "nvme" not in (offload_param, offload_optimizer):  # DeepSpeed's rows, DeepSpeed's arithmetic
        if offload_optimizer == "cpu":
            host = HOST_OPTIMIZER + (w if offload_param == "cpu" else 0)  # 18 or 16
            if zero_init:
                cpu_mem = p * host * gpus_factor * buffer_factor
            else:
                cpu_mem = p * max(INIT_BYTES * gpus_per_node, host * gpus_factor) * buffer_factor
        elif zero_init:
            cpu_mem = lp * INIT_BYTES * gpus_per_node * buffer_factor
        else:
            cpu_mem = p * INIT_BYTES * gpus_per_node * buffer_factor
        return int(cpu_mem), int(gpu_mem)

    per_rank = p / total_gpus
    steady = 0.0  # host bytes per node once training runs
    if offload_param == "cpu":
        steady += w * p * gpus_factor
    elif offload_param == "nvme":
        steady += gpus_per_node * w * (min(per_rank, nvme.param_max_in_cpu)
                                       + nvme.param_buffer_count * nvme.param_buffer_size)
    if offload_optimizer == "cpu":
        steady += HOST_OPTIMIZER * p * gpus_factor
    elif offload_optimizer == "nvme":
        steady += gpus_per_node * nvme.optimizer_buffer_count * min(per_rank, nvme.sub_group_size) * 4
    if zero_init:
        cpu_mem = max(steady, lp * INIT_BYTES * gpus_per_node) * buffer_factor
    else:
        cpu_mem = max(p * INIT_BYTES * gpus_per_node, steady) * buffer_factor
    return int(cpu_mem), int(gpu_mem)


# (stage, offload_param, offload_optimizer) in table order; ZeRO-3 starts with DeepSpeed's three
SETUPS: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"), (1, "none", "cpu"),
    (2, "none", "none"), (2, "none", "cpu"),
    (3, "cpu", "cpu"), (3, "none", "cpu"), (3, "none", "none"),
    (3, "none", "nvme"), (3, "cpu", "nvme"), (3, "nvme", "cpu"), (3, "nvme", "nvme"),
)
# fastest first: the setup people settle on is the first one that fits the GPU
PREFERENCE: tuple[tuple[int, str, str, bool | None], ...] = (
    (0, "none", "none", None), (1, "none", "none", None), (2, "none", "none", None),
    (3, "none", "none", True), (3, "none", "none", False),
    (2, "none", "cpu", None), (1, "none", "cpu", None),
    (3, "none", "cpu", True), (3, "none", "cpu", False),
    (3, "cpu", "cpu", True), (3, "cpu", "cpu", False),
    (3, "none", "nvme", True), (3, "none", "nvme", False),
    (3, "cpu", "nvme", True), (3, "cpu", "nvme", False),
    (3, "nvme", "cpu", True), (3, "nvme", "cpu", False),
    (3, "nvme", "nvme", True), (3, "nvme", "nvme", False),
)


def _fit(need: int, avail_gib: float | None, lower_bound: bool) -> bool | None:
    if avail_gib is None:
        return None
    if need > avail_gib * GIB:
        return False
    return None if lower_bound else True


def estimate(inputs: Inputs, precisions: tuple[str, ...] = PRECISIONS) -> list[Row]:
    """Every row, for each precision, in table order (ZeRO-0, 1, 2, then ZeRO-3 with zero.Init before without)."""
    rows: list[Row] = []
    L = inputs.largest_layer
    for precision in precisions:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        for stage, param, opt in SETUPS:
            for zero_init in ((True, False) if stage == 3 else (None,)):
                if stage < 3:
                    cpu, gpu = zero012_bytes(stage, inputs.total_params, inputs.gpus_per_node, inputs.nodes, opt,
                                             precision, inputs.buffer_factor)
                    cpu_lb = gpu_lb = False
                else:
                    cpu, gpu = zero3_bytes(inputs.total_params, L or 0, inputs.gpus_per_node, inputs.nodes, param,
                                           opt, bool(zero_init), precision, inputs.buffer_factor, inputs.nvme)
                    uses_l_on_host = bool(zero_init) and (opt == "none" or "nvme" in (param, opt))
                    cpu_lb, gpu_lb = L is None and uses_l_on_host, L is None
                ds = precision != "fp32" and ((stage == 2) or (stage == 3 and "nvme" not in (param, opt)))
                rows.append(Row(stage, param, opt, zero_init, precision, cpu, gpu,
                                "deepspeed" if ds else "torchdoctor", cpu_lb, gpu_lb,
                                _fit(cpu, inputs.cpu_gib, cpu_lb), _fit(gpu, inputs.gpu_gib, gpu_lb)))
    return rows


# reading a DeepSpeed config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Configured:
    """The row a DeepSpeed config selects, with what had to be assumed (``notes``)."""

    stage: int
    offload_param: str
    offload_optimizer: str
    zero_init: bool | None
    precision: str
    notes: tuple[str, ...] = ()
    nvme: NvmeSettings = field(default_factory=NvmeSettings)

    @property
    def key(self) -> RowKey:
        return (self.stage, self.offload_param, self.offload_optimizer, self.zero_init, self.precision)


def _enabled(section: Any) -> bool | str:
    if not isinstance(section, dict):
        return False
    v = section.get("enabled", False)
    if isinstance(v, str) and v.lower() == "auto":
        return "auto"
    return v is True or (isinstance(v, str) and v.lower() == "true")


def _device(zero: dict, key: str, legacy: str, notes: list[str]) -> str:
    section = zero.get(key)
    if isinstance(section, dict):
        dev = str(section.get("device", "none")).lower()
        if dev not in DEVICES:
            raise ValueError(f"zero_optimization.{key}.device must be none, cpu or nvme, got {section.get('device')!r}")
        return dev
    if section not in (None, False):
        raise ValueError(f"zero_optimization.{key} must be an object like {{\"device\": \"cpu\"}}, got {section!r}")
    if zero.get(legacy) is True:
        notes.append(f"zero_optimization.{legacy} is deprecated; read as {key}.device=cpu")
        return "cpu"
    return "none"


def _positive_int(section: Any, key: str, default: int, where: str, notes: list[str]) -> int:
    if not isinstance(section, dict) or key not in section:
        return default
    v = section[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
        notes.append(f"{where}.{key}={v!r} is not a number; DeepSpeed's default {default:g} assumed")
        return default
    return int(v)


def configured_from_ds_config(cfg: dict, precision: str | None = None, zero_init: bool | None = None) -> Configured:
    """The row ``cfg`` (a DeepSpeed config dict) selects.

    ``precision`` / ``zero_init`` override what the config says. There is no zero.Init key in a DeepSpeed config:
    it is code (``with deepspeed.zero.Init(...)``), which the HF Trainer / ``from_pretrained`` enter on their own
    when the config has stage 3 (and accelerate with ``zero3_init_flag: true``); stage 3 therefore assumes it
    unless ``zero_init=False``.

    Raises:
        ValueError: a stage other than 0-3, an unknown offload device, fp16 and bf16 both enabled.
    """
    notes: list[str] = []
    zero = cfg.get("zero_optimization", {})
    if isinstance(zero, bool):  # legacy: "zero_optimization": true means stage 1
        stage, zero = (1 if zero else 0), {}
    elif isinstance(zero, dict):
        raw = zero.get("stage", 0)
        if isinstance(raw, str) and raw.strip().isdigit():
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {raw!r}")
        stage = raw
    else:
        raise ValueError(f"zero_optimization must be an object, got {zero!r}")

    opt = _device(zero, "offload_optimizer", "cpu_offload", notes)
    param = _device(zero, "offload_param", "cpu_offload_param", notes)
    if param != "none" and stage != 3:
        notes.append(f"offload_param is valid only with stage 3; ignored at stage {stage}")
        param = "none"
    if opt != "none" and stage == 0:
        notes.append("offload_optimizer needs ZeRO stage 1 or higher; ignored at stage 0")
        opt = "none"
    if opt == "nvme" and stage in (1, 2):
        notes.append(f"ZeRO-{stage} treats offload_optimizer.device=nvme as cpu (stage_1_and_2.py): the optimizer "
                     "states stay in host RAM; NVMe offload needs stage 3")
        opt = "cpu"
    if param != "none" and opt == "none":
        notes.append("offload_param without offload_optimizer is not estimated; read as offload_optimizer=cpu")
        opt = "cpu"

    fp16 = _enabled(cfg.get("fp16"))
    bf16 = _enabled(cfg.get("bf16")) or _enabled(cfg.get("bfloat16"))
    if fp16 is True and bf16 is True:
        raise ValueError("fp16 and bf16 are both enabled; DeepSpeed refuses that "
                         "('bfloat16 and fp16 modes cannot be simultaneously enabled')")
    if precision is None:
        if fp16 is True:
            precision = "fp16"
        elif bf16 is True:
            precision = "bf16"
        elif "auto" in (fp16, bf16):
            precision = "fp16" if fp16 == "auto" and bf16 != "auto" else "bf16"
            notes.append(f'{precision}.enabled is "auto": the HF Trainer fills it from --fp16/--bf16, so 16-bit is '
                         'assumed (fp16 and bf16 need the same); passed to DeepSpeed directly "auto" is dropped and '
                         "the run is fp32 (--precision fp32)")
        else:
            precision = "fp32"

    if stage == 3:
        if zero_init is None:
            zero_init = True
            notes.append("zero.Init assumed: the HF Trainer/from_pretrained use it with a stage-3 config (create "
                         "TrainingArguments/HfDeepSpeedConfig before the model); plain DeepSpeed needs "
                         "`with deepspeed.zero.Init(config_dict_or_path=...)` (--zero-init no if you do not)")
    else:
        zero_init = None

    pz = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else {}
    oz = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    d = NvmeSettings()
    nvme = NvmeSettings(
        param_buffer_count=_positive_int(pz, "buffer_count", d.param_buffer_count, "offload_param", notes),
        param_buffer_size=_positive_int(pz, "buffer_size", d.param_buffer_size, "offload_param", notes),
        param_max_in_cpu=_positive_int(pz, "max_in_cpu", d.param_max_in_cpu, "offload_param", notes),
        optimizer_buffer_count=_positive_int(oz, "buffer_count", d.optimizer_buffer_count, "offload_optimizer",
                                             notes),
        sub_group_size=_positive_int(zero, "sub_group_size", d.sub_group_size, "zero_optimization", notes),
    )
    return Configured(stage, param, opt, zero_init, precision, tuple(notes), nvme)


def describe(key: RowKey) -> str:
    """'ZeRO-3, offload_param=cpu, offload_optimizer=cpu, zero.Init' for people."""
    stage, param, opt, zero_init, precision = key
    parts = [f"ZeRO-{stage}" + (" (plain data parallel)" if stage == 0 else "")]
    if param != "none":
        parts.append(f"offload_param={param}")
    if opt != "none":
        parts.append(f"offload_optimizer={opt}")
    if stage > 0 and param == "none" and opt == "none":
        parts.append("no offload")
    if zero_init is not None:
        parts.append("zero.Init" if zero_init else "no zero.Init")
    parts.append(precision)
    return ", ".join(parts)

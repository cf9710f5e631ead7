"""Which ``"auto"`` values the HF Trainer fills, read from transformers and accelerate themselves.

With ``TrainingArguments(deepspeed=config)`` two stacks touch the config before ``deepspeed.initialize``:
transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize`` replace ``"auto"``
with ``TrainingArguments`` values (``fill_match`` / ``fill_only``), accelerate's ``DeepSpeedPlugin`` fills its own
few (ZeRO stage, offload devices), and then ``Accelerator._prepare_deepspeed`` calls
``deepspeed_config_process``, which raises ``ValueError: `X` not found in kwargs`` for every ``"auto"`` still left --
before the first step. :func:`hf_fill` runs that very code on a copy of the config (real ``TrainingArguments``
defaults, a stand-in model that has a ``hidden_size``), so the table of what is filled is never a hand copy; only
when transformers or accelerate is missing does it fall back to :data:`~.schema.HF_AUTO_KEYS`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import types
from typing import Any

from .quiet import quiet_deepspeed
from .schema import HF_AUTO_KEYS

# What accelerate's _prepare_deepspeed passes to deepspeed_config_process (a local dict there, so not readable):
# gradient clipping, the 16-bit save flag, and the batch sizes it computed. The hidden-size keys, the DummyOptim /
# DummyScheduler keys it adds are filled by transformers first with the HF Trainer.
_PREPARE_KWARGS = ("gradient_clipping", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                   "train_micro_batch_size_per_gpu", "train_batch_size")
_NOT_FOUND = re.compile(r"`([^`]+)` not found in kwargs")
_NO_ZERO = "Please specify the ZeRO optimization config in the DeepSpeed config."  # accelerate's text (fallback)
_HIDDEN = 1024  # the stand-in model's hidden size: only decides *whether* the hidden-size keys are filled


def not_found_message(key: str) -> str:
    """accelerate's message for an "auto" nobody filled (its text, for the bundled fallback)."""
    return (f"`{key}` not found in kwargs. Please specify `{key}` without `auto` (set to correct value) in the "
            "DeepSpeed config file or pass it in kwargs.")


@dataclasses.dataclass(frozen=True)
class HfFill:
    """What the HF Trainer does with a config's ``"auto"`` values."""

    source: str  # "transformers X, accelerate Y" or the bundled table and why
    fills: dict[str, str]  # dotted key -> what fills it ("TrainingArguments.learning_rate")
    unfilled: tuple[str, ...]  # "auto" keys nothing fills: accelerate stops with ValueError before training
    message: str | None  # accelerate's own message for the first of them
    filled: dict | None  # the config as deepspeed.initialize gets it with default TrainingArguments (None: bundled)
    refused: str | None = None  # accelerate's own refusal of the config (its ValueError), when it has one


def _dict_autos(obj: Any, prefix: str = "") -> list[str]:
    """The "auto" values accelerate's deepspeed_config_process sees: it walks nested dicts, not lists."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, dict):
                out += _dict_autos(v, f"{prefix}{k}.")
            elif isinstance(v, str) and v == "auto":
                out.append(f"{prefix}{k}")
    return out


def _bundled(config: dict, reason: str) -> HfFill:
    autos = _dict_autos(config)
    unfilled = tuple(k for k in autos if k not in HF_AUTO_KEYS)
    refused = None if "zero_optimization" in config else _NO_ZERO  # accelerate 1.15 DeepSpeedPlugin.__post_init__
    return HfFill(f"bundled table ({reason})", {k: "the HF Trainer" for k in autos if k in HF_AUTO_KEYS}, unfilled,
                  not_found_message(unfilled[0]) if unfilled else None, None, refused)


@functools.lru_cache(maxsize=1)
def _training_args() -> Any:
    """Default ``TrainingArguments`` (made once: it sets up the device, about a second)."""
    import tempfile

    from transformers import TrainingArguments

    return TrainingArguments(output_dir=tempfile.gettempdir(), report_to="none")


def _run_hf(config: dict) -> HfFill:
    import accelerate
    import transformers
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import deepspeed as hf_ds

    fills: dict[str, str] = {}

    class Recording(hf_ds.HfTrainerDeepSpeedConfig):
        """transformers' own class; fill_match only notes which TrainingArguments field filled an "auto"."""

        def fill_match(self, ds_key_long, hf_val, hf_key=None, must_match=True):
            node, key = self.find_config_node(ds_key_long)
            if node is not None and node.get(key) == "auto":
                fills[ds_key_long] = (" | ".join(f"TrainingArguments.{k}" for k in hf_key.split("|")) if hf_key
                                      else f"transformers ({hf_val!r})")
            return super().fill_match(ds_key_long, hf_val, hf_key, must_match)

        def fill_only(self, ds_key_long, hf_val, hf_key=None):
            return self.fill_match(ds_key_long, hf_val, hf_key, must_match=False)

    args = _training_args()
    hf = Recording(copy.deepcopy(config))
    try:
        hf.trainer_config_process(args)
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=_HIDDEN))
        hf.mismatches.clear()  # non-"auto" values that differ from the *default* arguments: not this check's business
        hf.trainer_config_finalize(args, model, 1000)
        before = copy.deepcopy(hf.config)
        try:
            plugin = DeepSpeedPlugin(hf_ds_config=hf)  # fills zero stage / offload devices from its own settings
        except ValueError as e:  # accelerate refuses the config itself ("Please specify the ZeRO optimization...")
            left = tuple(k for k in _dict_autos(before) if k not in HF_AUTO_KEYS)
            return HfFill(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}", fills, left,
                          not_found_message(left[0]) if left else None, before, str(e).strip())
        for key in _dict_autos(before):
            if key not in _dict_autos(plugin.deepspeed_config):
                fills[key] = "accelerate's DeepSpeedPlugin (zero_stage, offload_*_device, ... / ACCELERATE_DEEPSPEED_*)"
        cfg = plugin.deepspeed_config
        micro, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
        kwargs = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
        if isinstance(micro, int) and isinstance(gas, int):
            kwargs.update({"train_micro_batch_size_per_gpu": micro, "train_batch_size": micro * gas * args.world_size})
        unfilled: list[str] = []
        message = None
        for _ in range(1000):  # one ValueError per "auto" left: note it, stand a value in, ask again
            try:
                plugin.deepspeed_config_process(must_match=False, **kwargs)
                break
            except ValueError as e:
                m = _NOT_FOUND.search(str(e))
                if not m or m.group(1) in unfilled:
                    raise
                unfilled.append(m.group(1))
                message = message or str(e)
                node, key = plugin.hf_ds_config.find_config_node(m.group(1))
                node[key] = None
        filled = copy.deepcopy(plugin.deepspeed_config)
    finally:
        hf_ds.unset_hf_deepspeed_config()
    filled.pop("steps_per_print", None)  # accelerate sets inf to silence DeepSpeed: not the user's config
    for key in unfilled:
        node: Any = filled
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = "auto"
    return HfFill(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}", fills,
                  tuple(unfilled), message, filled)


def hf_fill(config: dict) -> HfFill:
    """What the HF Trainer fills in ``config`` (not modified), and the ``"auto"`` values it leaves."""
    try:
        with quiet_deepspeed():
            return _run_hf(config)
    except ImportError as e:
        return _bundled(config, f"{e.name or 'transformers'} not installed")
    except Exception as e:  # transformers / accelerate moved or refuse the config in their own way
        return _bundled(config, f"the HF integration could not be run: {type(e).__name__}: {str(e)[:120]}")

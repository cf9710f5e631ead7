"""Counting a Hugging Face model's parameters from its config.json, on the meta device (no weights, offline).

Which class is built decides the count: a language model with an untied head (``tie_word_embeddings: false``,
Llama's default) has a ``vocab x hidden`` matrix more than its base model, often the largest layer. The class is,
in order: ``--model-class``; the config's ``architectures[0]`` (what ``save_pretrained`` writes); else, for a config
written by hand or by a script (no ``architectures``), the language-model class transformers' own auto mappings give
for its ``model_type`` -- sequence-to-sequence LM for encoder-decoder models, masked LM for encoders, causal LM for
decoders -- and only without any of those the base model. The result always names the class and where it came from,
so a user who trains another head knows to pass ``--model-class``.

Counting: :func:`count_params` (the rule DeepSpeed's estimators use, without its ``data_ptr`` dedup that collapses
on the meta device).
"""

from __future__ import annotations

import os
from typing import Any

from ..jsonfile import JsonFileError, load_object

MAX_COUNT = 10**16  # as memory_run's --params: far beyond any model, every figure stays a finite float

# (auto class, transformers' model_type -> class-name table) in the order tried for a config without architectures
_LM_MAPPINGS = (
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
)


class ModelCountError(ValueError):
    """The config cannot be counted (bad path or JSON, custom code, transformers missing or refusing it)."""


def count_params(model: Any) -> tuple[int, int, str]:
    """(total params, largest layer's direct params, that module's name) of an ``nn.Module``.

    Total: ``model.parameters()`` yields a shared (tied) Parameter once. DeepSpeed's ``model_to_params`` dedups by
    ``p.data_ptr()`` instead, which agrees on real tensors but collapses on the meta device (every data_ptr is 0),
    so it cannot be used on a model built without weights. Largest layer: DeepSpeed's rule, the max over modules of
    ``sum(p.numel() for p in m.parameters(recurse=False))`` (a tied weight counts in each module that holds it).
    """
    total = sum(p.numel() for p in model.parameters())
    best, name = 0, ""
    for n, m in model.named_modules():
        k = sum(p.numel() for p in m.parameters(recurse=False))
        if k > best:
            best, name = k, n
    return int(total), int(best), name


def _model_class(transformers, name: str):
    """The transformers class called ``name`` if it builds a model from a config (a model or an Auto class)."""
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type):
        return None
    if issubclass(cls, transformers.PreTrainedModel) or (name.startswith("AutoModel") and hasattr(cls, "from_config")):
        return cls
    return None


def choose_class(cfg: Any, transformers, requested: str | None = None) -> tuple[Any, str]:
    """(class to build, why that one) for a transformers config.

    Raises:
        ModelCountError: ``requested`` is not a transformers model class.
    """
    if requested:
        cls = _model_class(transformers, requested)
        if cls is None:
            raise ModelCountError(f"--model-class {requested}: transformers {transformers.__version__} has no model "
                                  "class of that name (e.g. LlamaForCausalLM, LlamaModel, AutoModelForCausalLM)")
        return cls, "--model-class"
    archs = [a for a in (getattr(cfg, "architectures", None) or []) if isinstance(a, str)]
    unknown = ""
    if archs:
        cls = _model_class(transformers, archs[0])
        if cls is not None:
            return cls, "architectures[0] in config.json"
        unknown = f"architectures[0] {archs[0]!r} is not a class of transformers {transformers.__version__}; "
    from transformers.models.auto import modeling_auto

    model_type = getattr(cfg, "model_type", None)
    tried = [(auto, getattr(modeling_auto, table, {})) for auto, table in _LM_MAPPINGS]
    if not getattr(cfg, "is_encoder_decoder", False):
        tried = tried[1:]
    if getattr(cfg, "is_decoder", False):  # a decoder (BertLMHeadModel-style): the causal LM before the masked one
        tried.sort(key=lambda t: t[0] == "AutoModelForMaskedLM")  # stable: only the masked LM moves last
    for auto, names in tried:
        cls = _model_class(transformers, names.get(model_type, "")) if model_type in names else None
        if cls is not None:
            return cls, (f"{unknown or 'no architectures in config.json; '}model_type {model_type!r} -> {auto} "
                         "(transformers' own mapping)")
    return transformers.AutoModel, (f"{unknown or 'no architectures in config.json; '}model_type {model_type!r} has "
                                    "no language-model class: the base model (AutoModel), without a head")


def _config_path(path: str) -> str:
    """The config file ``--model`` names: ``path/config.json`` for a folder, else ``path`` itself.

    Whatever exists under that name -- a file, a FIFO or ``<(...)``, a device, a directory, a symlink loop or a
    dangling link -- is handed to jsonfile's capped reader, which says what it is (``is a directory``, ``a character
    device that did not end within 16 MiB``, ``Too many levels of symbolic links``), as for every JSON input; only
    a name that is not there at all is "no such file" or "the folder has no config.json"."""
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.lexists(cfg_path):
            raise ModelCountError(f"--model {path}: the folder has no config.json")
        return cfg_path
    if os.path.lexists(path):
        return path
    raise ModelCountError(f"--model {path}: no such file or folder")


def config_from(raw: dict, transformers) -> tuple[Any, str | None]:
    """(the transformers config of the JSON object already read, None), or (None, why transformers refused it, in
    one line). Built by ``AutoConfig.from_pretrained`` on a copy in a folder of its own, so transformers' own reading
    applies (its model_type table and quirks) without opening the user's file again: a FIFO or ``<(...)`` is read
    once, through jsonfile's cap, and a file that changed in between is not read twice."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="torchdoctor-config-") as folder:
        copy = os.path.join(folder, "config.json")
        with open(copy, "w", encoding="utf-8") as f:
            json.dump(raw, f)  # NaN / Infinity kept as written: transformers' json.load takes them, as ours did
        try:
            return transformers.AutoConfig.from_pretrained(folder, local_files_only=True), None
        except Exception as e:  # noqa: BLE001 -- any refusal is the user's config, said in one line
            lines = str(e).strip().splitlines() or [type(e).__name__]  # transformers' messages run over lines
            return None, lines[0].replace(copy, "config.json").replace(folder, "the model folder")


def model_counts(path: str, model_class: str | None = None) -> dict[str, Any]:
    """Count a Hugging Face model's parameters from its config, built on the meta device (no weights, offline).

    Returns {"total_params", "largest_layer", "largest_layer_module", "class", "class_from", "other_classes",
    "head_tied", "config"}: ``class_from`` says why that class was built, ``other_classes`` the other heads
    transformers knows for this model type (pass one with ``--model-class``), ``head_tied`` whether the output head
    shares the input embedding's weights (counted once) or not (counted on its own), None without a head.

    Raises:
        ModelCountError: no such path, a folder without config.json, unreadable JSON, transformers missing, a config
            transformers cannot build, or a ``model_class`` it does not have.
    """
    cfg_path = _config_path(path)
    try:
        raw = load_object(cfg_path, "a Hugging Face model config (config.json)")
    except JsonFileError as e:
        raise ModelCountError(f"--model: {e}") from None
    if "auto_map" in raw:
        raise ModelCountError(f"--model {cfg_path}: the model needs its own code (auto_map), which torchdoctor does "
                              "not run; pass --params and --largest-layer instead")
    if "model_type" not in raw:
        raise ModelCountError(f"--model {cfg_path}: no \"model_type\" key, so transformers cannot tell which model "
                              "it is")
    try:
        import logging

        import torch
        import transformers
    except ImportError as e:
        raise ModelCountError(f"--model needs transformers and torch ({e}); or pass --params and --largest-layer") \
            from None

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg, why = config_from(raw, transformers)
    if cfg is None:
        raise ModelCountError(f"--model {cfg_path}: transformers {transformers.__version__} cannot read it: {why}")
    cls, why = choose_class(cfg, transformers, model_class)
    try:
        with torch.device("meta"):
            model = cls.from_config(cfg) if cls.__name__.startswith("AutoModel") else cls._from_config(cfg)
    except Exception as e:
        raise ModelCountError(f"--model {cfg_path}: cannot build {cls.__name__} from its config: "
                              f"{type(e).__name__}: {e}") from None
    total, largest, name = count_params(model)
    if total > MAX_COUNT:
        raise ModelCountError(f"--model {cfg_path}: {total:.3g} parameters is out of range (at most 1e16, as for "
                              "--params)")
    if total <= 0:
        raise ModelCountError(f"--model {cfg_path}: the model has no parameters")
    return {"total_params": total, "largest_layer": largest, "largest_layer_module": name,
            "class": type(model).__name__, "class_from": why, "other_classes": _other_classes(cfg, type(model)),
            "head_tied": _head_tied(model), "config": cfg_path}


def _head_tied(model: Any) -> bool | None:
    """Whether the built model's output head is its input embedding (None: no head). Read from the model, not the
    config: transformers versions differ (5.x ties T5 whatever ``tie_word_embeddings`` says)."""
    try:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    except Exception:  # a model class without the embedding accessors
        return None
    if out is None or inp is None or getattr(out, "weight", None) is None:
        return None
    return out.weight is getattr(inp, "weight", None)


def _other_classes(cfg: Any, built: type) -> list[str]:
    """Model classes transformers maps this config's model_type to, other than the one built (for --model-class)."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(cfg, "model_type", None)
    names = {getattr(modeling_auto, "MODEL_MAPPING_NAMES", {}).get(model_type)}
    names |= {getattr(modeling_auto, table, {}).get(model_type) for _, table in _LM_MAPPINGS}
    return sorted(n for n in names if isinstance(n, str) and n != built.__name__)

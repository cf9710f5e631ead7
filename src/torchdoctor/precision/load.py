"""What ``torchdoctor precision`` measures: a model and one batch for it.

MODEL is either a Hugging Face model folder -- ``config.json`` and safetensors weights (``model.safetensors``, or the
shards a ``model.safetensors.index.json`` lists); never a pickle: ``pytorch_model.bin``/``.pt`` are refused as
``report`` refuses them, since unpickling runs code -- or ``module:factory``, a callable importable from the working
directory or ``PYTHONPATH`` that returns ``(model, batch)``, the batch a dict of keyword arguments for the forward or
a tuple of positional ones.

For a folder, the class is the one ``config.json`` names (``architectures[0]``; else transformers' language-model
class for its ``model_type``: :func:`~torchdoctor.deepspeed.model_count.choose_class`), built in fp32 and given the
weights (a bf16 checkpoint is widened exactly). The batch is ``--batch-size`` rows of ``--seq-len`` tokens: from
``--batch`` (a text file, one example per line, or JSONL with ``"text"`` or ``"input_ids"``), tokenized by the
folder's tokenizer when there is one, else random ids; ``labels`` are the inputs (padding left out) when the model
takes them, so its own loss is the one measured; an encoder-decoder model derives its decoder inputs from them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..jsonfile import PICKLE_SUFFIXES, JsonFileError, load_object

MAX_SEQ_LEN = 1 << 16
MAX_BATCH_SIZE = 4096
MAX_BATCH_FILE_BYTES = 64 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                    "tokenizer.model", "sentencepiece.bpe.model")


class PrecisionUsageError(ValueError):
    """A user mistake in what ``torchdoctor precision`` was given: said in one line, exit 2."""


@dataclass
class Loaded:
    model: Any
    batch: Any  # dict of keyword arguments, or a tuple of positional ones
    what: str  # the model, in one line
    batch_what: str  # the batch, in one line
    notes: list[str] = field(default_factory=list)


DEFAULT_SEQ_LEN = 128


def load(spec: str, batch_file: str | None, seq_len: int | None, batch_size: int, device: str,
         json_out: bool = False) -> Loaded:
    """The model and batch ``spec`` names, on ``device``, the model in fp32 and in training mode. A factory's own
    output is the user's: it is shown (on stderr when ``json_out``, so that stdout stays one JSON document)."""
    from ..deepspeed.quiet import quiet_deepspeed

    if os.path.isdir(spec):
        with quiet_deepspeed():  # transformers imports DeepSpeed when it is installed: its lines would break --json
            loaded = _from_folder(spec, batch_file, seq_len, batch_size)
    elif ":" in spec and not os.path.exists(spec):
        if batch_file is not None:
            raise PrecisionUsageError("--batch is for a model folder; a factory returns its own batch")
        loaded = _from_factory(spec, json_out)
    elif os.path.exists(spec):
        raise PrecisionUsageError(f"{spec}: not a folder; pass a Hugging Face model folder (config.json and "
                                  "*.safetensors) or module:factory")
    else:
        raise PrecisionUsageError(f"{spec}: no such folder, and not module:factory (a callable returning "
                                  "(model, batch))")
    return _placed(loaded, device)


def _placed(loaded: Loaded, device: str) -> Loaded:
    import torch

    model = loaded.model
    model.to(device=device, dtype=torch.float32)
    model.train()

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device) if not x.is_floating_point() else x.to(device=device, dtype=torch.float32)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        return x

    loaded.batch = move(loaded.batch)
    return loaded


# ---------------------------------------------------------------------------------------------------- a factory
@contextlib.contextmanager
def users_code(spec: str, module_name: str, doing: str, json_out: bool) -> Iterator[None]:
    """Run the user's code (importing their module, calling their factory) as their own: its prints and warnings
    shown (stdout sent to stderr under ``--json``), ``sys.argv`` theirs (``[module]``: torchdoctor's own arguments
    are not their script's), and an exit it takes -- ``sys.exit``, or argparse refusing a command line -- said as
    theirs in one line (exit 2), never torchdoctor's silent end."""
    argv = sys.argv
    sys.argv = [module_name]
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext():
            yield
    except SystemExit as e:
        frames = traceback.extract_tb(e.__traceback__)
        parsing = next((f for f in reversed(frames) if os.path.basename(f.filename) == "argparse.py"), None)
        raised = next((f for f in reversed(frames) if os.path.basename(f.filename) != "argparse.py"), None)
        at = f" at {os.path.basename(raised.filename)}:{raised.lineno} in {raised.name}" if raised else ""
        if parsing is not None:
            raise PrecisionUsageError(
                f"{spec}: {doing} exited (code {e.code}) in argparse{at}: it parses a command line, and runs here "
                f"with sys.argv = [{module_name!r}] (torchdoctor's arguments are not its own); give its options "
                "defaults, or point torchdoctor at a function that builds the model without parsing") from None
        raise PrecisionUsageError(f"{spec}: {doing} called sys.exit({e.code!r}){at}") from None
    finally:
        sys.argv = argv


def _from_factory(spec: str, json_out: bool = False) -> Loaded:
    import torch

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PrecisionUsageError(f"{spec}: write module:factory (e.g. mytrain:build), a callable returning "
                                  "(model, batch)")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the working directory's modules are importable
    try:
        with users_code(spec, module_name, f"importing {module_name}", json_out):
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise PrecisionUsageError(f"{spec}: cannot import {module_name}: {e}") from None
    except PrecisionUsageError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's module raised while importing: their error, one line
        raise PrecisionUsageError(f"{spec}: importing {module_name} raised {type(e).__name__}: {e}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise PrecisionUsageError(f"{spec}: {module_name} has no {attr}")
    if not callable(factory):
        raise PrecisionUsageError(f"{spec}: {attr} is a {type(factory).__name__}, not a callable")
    try:
        with users_code(spec, module_name, "the factory", json_out):
            made = factory()
    except PrecisionUsageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise PrecisionUsageError(f"{spec}: the factory raised {type(e).__name__}: {e}") from None
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise PrecisionUsageError(f"{spec}: the factory must return (model, batch); it returned a "
                                  f"{type(made).__name__}")
    model, batch = made
    if not isinstance(model, torch.nn.Module):
        raise PrecisionUsageError(f"{spec}: the factory's model is a {type(model).__name__}, not a torch.nn.Module")
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if not isinstance(batch, (dict, tuple, list)):
        raise PrecisionUsageError(f"{spec}: the factory's batch is a {type(batch).__name__}: return a dict of keyword "
                                  "arguments for the forward or a tuple of positional ones")
    count = sum(p.numel() for p in model.parameters())
    return Loaded(model, batch if isinstance(batch, dict) else tuple(batch),
                  f"{type(model).__name__} from {spec} ({_count(count)} parameters)", "the factory's batch")


# ---------------------------------------------------------------------------------------------------- a folder
def _weights(folder: str) -> list[str]:
    names = os.listdir(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            raw = load_object(index, "a safetensors index")
        except JsonFileError as e:
            raise PrecisionUsageError(str(e)) from None
        shards = sorted(set((raw.get("weight_map") or {}).values()))
        missing = [s for s in shards if not os.path.exists(os.path.join(folder, s))]
        if missing or not shards:
            raise PrecisionUsageError(f"{index}: " + (f"shard {missing[0]} is missing" if missing else
                                                      "no weight_map"))
        return [os.path.join(folder, s) for s in shards]
    safes = sorted(n for n in names if n.endswith(".safetensors"))
    if safes:
        return [os.path.join(folder, n) for n in safes]
    pickles = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise PrecisionUsageError(
            f"{folder}: its weights are {pickles[0]}, a pickle; torchdoctor never unpickles files (loading a pickle "
            "runs any code inside it). Save them as safetensors: model.save_pretrained(folder, "
            "safe_serialization=True)")
    return []


def _from_folder(folder: str, batch_file: str | None, seq_len: int | None, batch_size: int) -> Loaded:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise PrecisionUsageError(f"{folder}: no config.json (a Hugging Face model folder has one)")
    try:
        raw = load_object(cfg_path, "a Hugging Face model config (config.json)")
    except JsonFileError as e:
        raise PrecisionUsageError(str(e)) from None
    if "auto_map" in raw:
        raise PrecisionUsageError(f"{cfg_path}: the model needs its own code (auto_map), which torchdoctor does not "
                                  "run; write a factory that builds it (module:factory)")
    weights = _weights(folder)
    try:
        import torch  # noqa: F401 -- (its absence said in the same line as transformers')
        import transformers
    except ImportError as e:
        raise PrecisionUsageError(f"a model folder needs transformers and torch ({e})") from None
    import logging

    from ..deepspeed.model_count import choose_class, config_from

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg, why = config_from(raw, transformers)
    if cfg is None:
        raise PrecisionUsageError(f"{cfg_path}: transformers {transformers.__version__} cannot read it: {why}")
    cls, _ = choose_class(cfg, transformers)
    _check_memory(weights, raw)
    try:
        model = cls.from_config(cfg) if cls.__name__.startswith("AutoModel") else cls._from_config(cfg)
    except Exception as e:  # noqa: BLE001
        raise PrecisionUsageError(f"{cfg_path}: cannot build {cls.__name__}: {type(e).__name__}: {e}") from None
    model.float()
    notes = []
    if weights:
        notes += _load_weights(model, weights)
        source = ", ".join(os.path.basename(w) for w in weights[:2]) + (" ..." if len(weights) > 2 else "")
    else:
        source = "no weights"
        notes.append("the folder has no weights: the model is randomly initialized, so its values are those of a "
                     "fresh model, not of a pretrained one (a bf16 checkpoint's large values are not there)")
    batch, batch_what = _batch(model, cfg, folder, batch_file, seq_len, batch_size)
    count = sum(p.numel() for p in model.parameters())
    return Loaded(model, batch, f"{type(model).__name__} ({_count(count)} parameters, {source})", batch_what, notes)


def _check_memory(weights: list[str], raw: dict) -> None:
    """Refuse a model whose fp32 copy plus gradients cannot fit in the RAM available now (before building it)."""
    from .._system import read_meminfo

    stored = sum(os.path.getsize(w) for w in weights)
    if not stored:
        return
    narrow = str(raw.get("torch_dtype") or raw.get("dtype") or "float32") in ("bfloat16", "float16")
    need = stored * (2 if narrow else 1) * 3  # fp32 weights, their gradients, and the activations (a rough third)
    info = read_meminfo() or {}
    available = info.get("MemAvailable")
    if available and need > available:
        raise PrecisionUsageError(f"the model needs about {need / 2**30:.1f} GiB in fp32 with its gradients, "
                                  f"{available / 2**30:.1f} GiB are available; measure a smaller configuration of it "
                                  "(fewer layers) with a factory")


def _load_weights(model: Any, weights: list[str]) -> list[str]:
    from safetensors.torch import load_file

    state: dict = {}
    for w in weights:
        try:
            state.update(load_file(w))
        except Exception as e:  # noqa: BLE001 -- a truncated or foreign file: say which
            raise PrecisionUsageError(f"{w}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    result = model.load_state_dict(state, strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [k for k in result.missing_keys if k not in tied]
    notes = []
    if missing:
        notes.append(f"{len(missing)} parameter(s) not in the weights keep their random initialization, e.g. "
                     f"{missing[0]}")
    if result.unexpected_keys:
        notes.append(f"{len(result.unexpected_keys)} tensor(s) in the weights belong to no parameter, e.g. "
                     f"{result.unexpected_keys[0]}")
    return notes


def _batch(model: Any, cfg: Any, folder: str, batch_file: str | None, seq_len: int | None,
           batch_size: int) -> tuple[dict, str]:
    import torch

    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if hasattr(cfg, "get_text_config"):
        vocab = int(getattr(cfg.get_text_config(), "vocab_size", vocab) or vocab)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, int(limit)) if limit else DEFAULT_SEQ_LEN
    elif limit and seq_len > int(limit):
        raise PrecisionUsageError(f"--seq-len {seq_len}: the model takes at most {limit} positions")
    pad = getattr(cfg, "pad_token_id", None)
    pad = 0 if not isinstance(pad, int) else pad
    if batch_file is None:
        if vocab <= 0:
            raise PrecisionUsageError("the config has no vocab_size: pass --batch with token ids, or a factory")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        mask = torch.ones_like(ids)
        what = f"{batch_size} x {seq_len} random token ids (no --batch)"
    else:
        rows, how = _rows(batch_file, folder, batch_size)
        rows = [r[:seq_len] for r in rows if r]
        if not rows:
            raise PrecisionUsageError(f"--batch {batch_file}: no tokens in it")
        bad = next((t for r in rows for t in r if not 0 <= t < vocab), None) if vocab > 0 else None
        if bad is not None:
            raise PrecisionUsageError(f"--batch {batch_file}: token id {bad} is outside the vocabulary "
                                      f"(0..{vocab - 1})")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        what = f"{len(rows)} row(s) of --batch {os.path.basename(batch_file)}, {how}, up to {width} tokens"
    batch: dict = {"input_ids": ids, "attention_mask": mask}
    params = inspect.signature(model.forward).parameters
    if "labels" in params:  # (an encoder-decoder model derives its decoder inputs from them)
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    else:
        what += " (the model takes no labels)"
        if "decoder_input_ids" in params:  # an encoder-decoder model without a head: its decoder needs inputs too
            batch["decoder_input_ids"] = ids
    return {k: v for k, v in batch.items() if k in params or "kwargs" in params}, what


def _rows(path: str, folder: str, batch_size: int) -> tuple[list[list[int]], str]:
    """Token id rows from a text or JSONL file (the first ``batch_size`` examples), and how they were read."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BATCH_FILE_BYTES + 1)
    except OSError as e:
        raise PrecisionUsageError(f"--batch {path}: {e.strerror or e}") from None
    if len(data) > MAX_BATCH_FILE_BYTES:
        data = data[:MAX_BATCH_FILE_BYTES]  # the first examples are enough; a cut last line is dropped below
        data = data[:data.rfind(b"\n") + 1]
    text = data.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip()][:batch_size]
    if not lines:
        raise PrecisionUsageError(f"--batch {path}: the file is empty")
    if path.endswith((".jsonl", ".json")):
        examples = []
        for n, ln in enumerate(lines, 1):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise PrecisionUsageError(f"--batch {path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not ("input_ids" in obj or "text" in obj):
                raise PrecisionUsageError(f"--batch {path}:{n}: each line must be an object with \"text\" or "
                                          "\"input_ids\"")
            examples.append(obj)
        with_ids = sum("input_ids" in e for e in examples)
        if 0 < with_ids < len(examples):
            raise PrecisionUsageError(f"--batch {path}: some lines give input_ids and others text; give one kind")
        if with_ids:
            rows = []
            for n, e in enumerate(examples, 1):
                ids = e["input_ids"]
                if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                    raise PrecisionUsageError(f"--batch {path}:{n}: input_ids must be a list of whole numbers")
                rows.append(ids)
            return rows, "token ids as given"
        texts = [str(e.get("text", "")) for e in examples]
    else:
        texts = lines
    tokenizer = _tokenizer(folder)
    if tokenizer is None:
        raise PrecisionUsageError(f"--batch {path} holds text, but {folder} has no tokenizer: add the tokenizer "
                                  "files, or give token ids as JSONL ({\"input_ids\": [...]} per line)")
    return [list(tokenizer(t)["input_ids"]) for t in texts], "tokenized by the folder's tokenizer"


def _tokenizer(folder: str) -> Any | None:
    if not any(os.path.exists(os.path.join(folder, n)) for n in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise PrecisionUsageError(f"{folder}: its tokenizer cannot be loaded ({type(e).__name__}: {e})") from None


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)

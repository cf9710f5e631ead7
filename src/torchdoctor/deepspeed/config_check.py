"""Lint a DeepSpeed config before the run: ``torchdoctor ds check CONFIG.json``.

Pure logic: :func:`load` reads the file (:func:`torchdoctor.jsonfile.load_object`: strict JSON, duplicate keys
refused as DeepSpeed refuses them) and :func:`check` judges the dict against facts the caller passes in (GPU
capabilities, where libaio is, the world size). Nothing here probes the machine.

What the checks know comes from DeepSpeed itself where it exposes it (:func:`schema`, imported lazily):

- every block DeepSpeed validates with a pydantic model that forbids extra keys, found by letting
  ``DeepSpeedConfig``'s parser read a probe key in each top-level block it reads (``fp16``, ``zero_optimization``,
  ``compile``, the monitors, ``comms_logger``, ``tensor_parallel``... and their nested models): key names and
  aliases, types, enum values, bounds, defaults and deprecated names. An unknown key there stops DeepSpeed (fail);
- the top-level keys ``DeepSpeedConfig`` reads, recorded by letting it parse a recording dict. DeepSpeed ignores
  unknown top-level keys silently (warn); keys starting with ``_`` are the JSON-comment convention (nothing to say,
  except inside a strict block, where DeepSpeed refuses them too);
- the keys DeepSpeed 0.19 removed and refuses, with its own messages; its optimizer and LR-scheduler names and the
  scheduler signatures (unknown ``scheduler.params`` are a ``TypeError`` at start).

When deepspeed is not importable the same tables come from the bundled copy (:mod:`.schema_tables`, DeepSpeed
0.19.8; ``tests/test_ds_check.py`` compares it with the installed DeepSpeed). ``"auto"`` follows DeepSpeed: its
pydantic blocks drop ``"auto"`` values and use the default (so ``fp16.enabled: "auto"`` trains in fp32: warn);
everywhere else the string reaches the code and breaks it (fail) -- except where ``"auto"`` is DeepSpeed's own
default for the key (:attr:`Schema.ds_auto`). With ``--for hf`` :mod:`.hf_fill` runs transformers' and
accelerate's own filling code on a copy: an ``"auto"`` it leaves makes accelerate raise before training (fail).

Every warn or fail says in ``data["edits"]`` whether its first fix is a config edit (``[]`` when the value is the
user's to choose); ``tests/test_ds_check_realworld.py`` applies them and holds the result to DeepSpeed's parser
(:mod:`.parse`). The parts: :mod:`.schema` (the tables), :mod:`.validate` (the walk over keys and values, read as
:mod:`.values` says) and :mod:`.rules` (the semantic rules); this module loads the file and puts them together.
"""

from __future__ import annotations

from ..findings import Finding
from ..jsonfile import JsonFileError, load_object
from .hf_fill import hf_fill
from .rules import (
    _auto_rule,
    _batch_rule,
    _caps,
    _Ctx,
    _hf_refused_rule,
    _logging_rule,
    _loss_scale_rules,
    _precision_rules,
    _zero_rules,
)
from .schema import HF_AUTO_KEYS, Schema, Spec, deepspeed_tables, schema
from .schema_tables import FALLBACK_VERSION
from .validate import _Walker
from .values import snippet_edits

__all__ = ["ConfigError", "load", "check", "schema", "Schema", "Spec", "HF_AUTO_KEYS", "FOR_CHOICES",
           "deepspeed_tables", "FALLBACK_VERSION"]

FOR_CHOICES = ("deepspeed", "hf")



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


def _findings(config: dict, *, world_size: int | None, for_: str, caps: list[str], libaio: str | None,
              verify: bool) -> list[Finding]:
    sch = schema()
    recheck = (lambda c: _findings(c, world_size=None, for_=for_, caps=[], libaio="libaio", verify=False)) if verify \
        else None
    walker = _Walker(sch, config, for_, recheck)
    walker.walk("", config, "")
    ctx = _Ctx(config, for_, sch, hf_fill(config) if for_ == "hf" else None)
    gpu_caps = _caps(caps)
    out = [*walker.findings, *_hf_refused_rule(ctx), *_auto_rule(ctx), *_precision_rules(ctx, gpu_caps),
           *_loss_scale_rules(ctx), *_logging_rule(ctx), *_batch_rule(ctx, world_size), *_zero_rules(ctx, libaio)]
    for f in out:  # a fix that is a config snippet gets its machine-readable edits (the tests apply them)
        if f.severity in ("warn", "fail") and "edits" not in f.data:
            f.data["edits"] = snippet_edits(f.fix[0]) if f.fix else []
    return out


def check(config: dict, *, world_size: int | None, for_: str, gpu_capabilities: list[str], libaio: str | None,
          path: str = "") -> list[Finding]:
    """Findings for a DeepSpeed config dict (as :func:`load` returns it).

    Args:
        config: the config object.
        world_size: data-parallel ranks the run will have (None: unknown; the batch check then does what it can).
        for_: ``"deepspeed"`` (passed to ``deepspeed.initialize``) or ``"hf"`` (passed to the HF Trainer, which fills
            the ``"auto"`` values :func:`.hf_fill.hf_fill` finds it fills).
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

"""The inputs of the bug-report bundle ``torchdoctor report`` prints: the DeepSpeed config, and the error its
readers raise for a user mistake. The TrainingArguments are read and diffed in :mod:`.training_args`, the report
(versions, Markdown, JSON) is rendered by :mod:`.bundle_render`.

Everything here is pure: the caller probes (:mod:`torchdoctor.env.probe`), judges, and passes :class:`Facts` and
findings in. The only I/O is reading the two files the user names, and nothing is ever unpickled: a
``training_args.bin`` (``torch.save`` of the TrainingArguments, a pickle) is refused by its name, or by its first
bytes, before any of it is parsed, because unpickling a file runs whatever code it names.
"""

from __future__ import annotations

from ..jsonfile import PICKLE_HINT, JsonFileError, load_object

__all__ = ["BundleError", "load_ds_config", "uses_nvme", "read_json_object"]


class BundleError(ValueError):
    """A user mistake in what ``torchdoctor report`` was given: the CLI prints the message and exits 2."""


# -- files ----------------------------------------------------------------------------------------------


def read_json_object(path: str, what: str, pickle_hint: str = PICKLE_HINT) -> dict:
    """A JSON object from ``path`` (:func:`torchdoctor.jsonfile.load_object`); :class:`BundleError` otherwise."""
    try:
        return load_object(path, what, pickle_hint=pickle_hint)
    except JsonFileError as e:
        raise BundleError(str(e)) from None


def load_ds_config(path: str) -> dict:
    """The DeepSpeed config JSON object at ``path`` (as ``--deepspeed ds_config.json`` would read it; ``-``: stdin).

    Raises:
        BundleError: missing file, a directory, a pickle (``.bin``/``.pt``/``.pkl``... or pickle bytes), not UTF-8,
            invalid JSON (``file:line:col`` and the line), a duplicate key, nesting deeper than any config, or a
            top level that is not an object.
    """
    return read_json_object(path, "a DeepSpeed config")


def uses_nvme(ds_config: dict) -> bool:
    """Whether ZeRO offloads the optimizer or the parameters to NVMe (so DeepSpeed's async I/O op needs libaio)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    if not isinstance(zero, dict):
        return False
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, dict) and str(section.get("device", "")).lower() == "nvme":
            return True
    return False

"""The bug-report bundle as ``torchdoctor report`` prints it: versions as the tools print them, the environment
findings, the DeepSpeed config (secrets redacted) and the TrainingArguments diff, as Markdown or JSON.

Pure: facts, findings and the inputs :mod:`torchdoctor.env.bundle` read come in, text or a JSON object goes out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..findings import Finding
from ..findings import render_markdown as render_findings
from ..jsonfile import json_safe
from .facts import Facts
from .rules import build_toolkit
from .training_args import REDACTED, SECRET_KEY, training_args_diff

# -- versions -------------------------------------------------------------------------------------------

# key -> the label a person recognises (what prints that string)
_VERSION_LABELS = {
    "python": "python",
    "os": "os",
    "torch": "torch",
    "torch_cuda": "torch.version.cuda",
    "torch_hip": "torch.version.hip",
    "cudnn": "torch.backends.cudnn.version()",
    "nccl": "torch.cuda.nccl.version()",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "deepspeed": "deepspeed",
    "nvcc": "nvcc (build toolkit)",
    "gpus": "gpus",
    "driver": "nvidia driver",
}


def _gpu_summary(facts: Facts) -> str | None:
    if not facts.gpus:
        return None
    groups: dict[tuple[str, str], int] = {}
    for g in facts.gpus:
        groups[(g.name, g.capability)] = groups.get((g.name, g.capability), 0) + 1
    parts = [f"{n} x {name} ({cap})" if n > 1 else f"{name} ({cap})" for (name, cap), n in groups.items()]
    return ", ".join(parts)


def versions(facts: Facts) -> dict[str, str | None]:
    """Versions as the tools print them; None: not installed / not found.

    Keys: python, os, torch, torch_cuda (``torch.version.cuda``; None for a CPU build), torch_hip, cudnn, nccl,
    transformers, accelerate, deepspeed, nvcc (the toolkit DeepSpeed's op builds use,
    :func:`torchdoctor.env.rules.build_toolkit`, "12.4" as ``nvcc --version`` says "release 12.4"), gpus
    ("8 x NVIDIA H200 (9.0)"), driver.
    """

    def pkg(name: str) -> str | None:
        p = facts.packages.get(name)
        return p.version if p else None

    tk = build_toolkit(facts)  # the same toolkit env's rules judge
    t = facts.torch
    return {
        "python": facts.python or None,
        "os": facts.os or None,
        "torch": t.version if t.installed else None,
        "torch_cuda": t.cuda,
        "torch_hip": t.hip,
        "cudnn": t.cudnn,
        "nccl": t.nccl,
        "transformers": pkg("transformers"),
        "accelerate": pkg("accelerate"),
        "deepspeed": pkg("deepspeed"),
        "nvcc": tk.version if tk else None,
        "gpus": _gpu_summary(facts),
        "driver": facts.driver,
    }


def _one_liner(v: dict[str, str | None]) -> str:
    mods = ["torch"] + [m for m in ("transformers", "accelerate", "deepspeed") if v.get(m)]
    prints = ["torch.__version__", "torch.version.cuda"] + [f"{m}.__version__" for m in mods[1:]]
    return f"python -c 'import {', '.join(mods)}; print({', '.join(prints)})'"


# -- rendering ------------------------------------------------------------------------------------------

_SEVERITY_ORDER = {"fail": 0, "warn": 1, "info": 2, "ok": 3, "skip": 4}


def _redact_config(obj: Any) -> Any:
    """The DeepSpeed config with secret-looking string values (monitor api keys, tokens) replaced."""
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(v, str) and SECRET_KEY.search(str(k)) else _redact_config(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_config(x) for x in obj]
    return obj


def _as_diff(ta: dict) -> dict:
    """``ta`` is normally training_args_diff's result; raw arguments are diffed here."""
    if set(ta) == {"changed", "unknown", "defaults_from", "note"}:
        return ta
    return training_args_diff(ta)


def _cell(value: Any) -> str:
    text = json.dumps(value, default=str).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render_markdown(facts: Facts, findings: Iterable[Finding], ds_config: dict | None, ta: dict | None) -> str:
    """The bundle as a GitHub issue body: Versions, Environment findings, DeepSpeed config, TrainingArguments."""
    v = versions(facts)
    out = ["### Versions", "", "```"]
    for key, label in _VERSION_LABELS.items():
        if key == "torch_hip" and v[key] is None:
            continue
        value = v[key]
        if value is None:
            value = "None" if key in ("torch_cuda", "cudnn", "nccl") else "not found"
            if key in ("torch", "transformers", "accelerate", "deepspeed"):
                value = "not installed"
        out.append(f"{label}: {value}")
    out += ["```", "", "Reproduce with:", "", "```sh", _one_liner(v), "```", ""]

    out += ["### Environment findings", ""]
    findings = sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity])
    shown = [f for f in findings if f.severity in ("fail", "warn", "info")]
    omitted = len(findings) - len(shown)
    if not shown:
        shown, omitted = findings, 0
    out.append(render_findings(shown) if shown else "(no findings)")
    if omitted:
        out.append(f"\n({omitted} passing or skipped check{'s' if omitted != 1 else ''} not shown)")
    out.append("")

    out += ["### DeepSpeed config", ""]
    if ds_config is None:
        out.append("(not given)")
    else:
        out += ["```json", json.dumps(_redact_config(ds_config), indent=2, default=str), "```"]
    out.append("")

    out += ["### TrainingArguments (non-default)", ""]
    if ta is None:
        out.append("(not given)")
    else:
        diff = _as_diff(ta)
        unknown = set(diff["unknown"])
        if diff["changed"]:
            out += ["| argument | value |", "|---|---|"]
            for key, value in diff["changed"].items():
                mark = " *" if key in unknown else ""
                out.append(f"| `{key}`{mark} | {_cell(value)} |")
        else:
            out.append("(all defaults)")
        notes = []
        if unknown:
            notes.append("\\* not a TrainingArguments field (kept as given): " + ", ".join(f"`{k}`" for k in
                                                                                        diff["unknown"]))
        if diff["defaults_from"]:
            notes.append(f"Defaults from {diff['defaults_from']}.")
        if diff["note"]:
            notes.append(diff["note"][:1].upper() + diff["note"][1:] + ("" if diff["note"].endswith(".") else "."))
        for note in notes:
            out += ["", note]
    out += ["", "<sub>Generated by `torchdoctor report`.</sub>"]
    return "\n".join(out) + "\n"


def to_json(facts: Facts, findings: Iterable[Finding], ds_config: dict | None, ta: dict | None) -> dict:
    """The bundle for ``--json``: versions, findings, ds_config (secrets redacted), training_args (the diff), facts.

    JSON has no NaN or infinity: non-finite floats (``--num_train_epochs 1e400``, ``"loss_scale": NaN``) are the
    strings ``"nan"``, ``"inf"``, ``"-inf"`` (:func:`torchdoctor.jsonfile.json_safe`).
    """
    return json_safe({
        "versions": versions(facts),
        "findings": [f.to_json() for f in findings],
        "ds_config": None if ds_config is None else _redact_config(ds_config),
        "training_args": None if ta is None else _as_diff(ta),
        "facts": facts.to_json(),
    })

"""``ds memory``'s words and verdicts: the rows :mod:`.memory` estimates, described, compared with the machine
and judged (which setup is likely, what to change when none fits), as findings.

Kept apart from the arithmetic in :mod:`.memory` so that each is read in one sitting: that module holds the
bytes (DeepSpeed's estimators' formulas and ours), this one what to tell the user about them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ..findings import Finding
from .memory import (
    GIB,
    HOST_OPTIMIZER,
    INIT_BYTES,
    NOTE,
    NVME_PATH,
    PREFERENCE,
    Configured,
    Inputs,
    NvmeSettings,
    Row,
    RowKey,
    estimate,
    weight_bytes,
)

__all__ = ["likely_row", "judge", "config_snippet", "ZERO_INIT_HOWTO", "fmt_count"]


# words and snippets ----------------------------------------------------------------------------------------------


def fmt_count(n: int | float) -> str:
    """7000000000 -> '7.00B', 131072000 -> '131.1M'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}" if suffix in "TB" else f"{n / div:.1f}{suffix}"
    return f"{int(n)}"


def config_snippet(key: RowKey, nvme: NvmeSettings | None = None, nvme_path: str = NVME_PATH) -> str:
    """The ``zero_optimization`` block that selects this row (NVMe buffer settings that differ from DeepSpeed's
    defaults included), followed by "+ zero.Init" when the row assumes the model is built under it."""
    stage, param, opt, zero_init, _ = key
    d, nvme = NvmeSettings(), nvme or NvmeSettings()
    z: dict[str, Any] = {"stage": stage}
    for name, dev in (("offload_optimizer", opt), ("offload_param", param)):
        if dev == "cpu":
            z[name] = {"device": "cpu", "pin_memory": True}
        elif dev == "nvme":
            z[name] = {"device": "nvme", "nvme_path": nvme_path}
    if param == "nvme" and nvme.param_max_in_cpu != d.param_max_in_cpu:
        z["offload_param"]["max_in_cpu"] = nvme.param_max_in_cpu
    if opt == "nvme" and nvme.sub_group_size != d.sub_group_size:
        z["sub_group_size"] = nvme.sub_group_size
    text = '"zero_optimization": ' + json.dumps(z)
    if zero_init:
        text += " + zero.Init"
    elif zero_init is False:
        text += " (no zero.Init)"
    return text


ZERO_INIT_HOWTO = ("zero.Init: the HF Trainer / from_pretrained enter it on their own with a stage-3 config (create "
                   "TrainingArguments(deepspeed=...) or HfDeepSpeedConfig before the model); accelerate: "
                   "zero3_init_flag: true; plain DeepSpeed: `with deepspeed.zero.Init(config_dict_or_path=ds_config): "
                   "model = MyModel()`")
# smaller pinned NVMe buffers: weights stay on NVMe, 1e8-element optimizer sub-groups
TUNED_NVME = {"param_max_in_cpu": 0, "sub_group_size": 100_000_000}


def _gib(x: float) -> str:
    return f"{x:.2f}"


def _avail(gib: float) -> str:
    """Memory available, as the table header shows it: one decimal, none for whole numbers (24, 23.5)."""
    text = f"{gib:.1f}" if gib >= 1 else f"{gib:.2f}"
    return text[:-2] if text.endswith(".0") else text


def _need(row: Row, what: str) -> str:
    """``13.04 GiB``; a figure the unknown largest layer adds to says so (``13.04 GiB + the largest layer``)."""
    gib, lower = (row.cpu_gib, row.cpu_lower_bound) if what == "cpu" else (row.gpu_gib, row.gpu_lower_bound)
    if not lower:
        return f"{_gib(gib)} GiB"
    return "the largest layer's share (unknown)" if gib < 0.005 else f"{_gib(gib)} GiB + the largest layer"


def _host_terms(row: Row, inputs: Inputs) -> list[str]:
    """Why the host figure is what it is, with the numbers."""
    p, gpn, n, f = inputs.total_params, inputs.gpus_per_node, inputs.nodes, inputs.buffer_factor
    P = fmt_count(p)
    out: list[str] = []
    init = INIT_BYTES * p * gpn * f / GIB
    if row.zero_init is not True:
        g = inputs.total_gpus if (row.stage in (1, 2) and row.offload_optimizer != "none") else gpn
        out.append(f"start-up: every rank builds the whole model in fp32 on the host before ZeRO partitions it: "
                   f"4 B x {P} params x {g} ranks x {f:g} = {_gib(INIT_BYTES * p * g * f / GIB)} GiB"
                   + (" (DeepSpeed's ZeRO-1/2 offload estimate counts all ranks of all nodes)"
                      if g != gpn else ""))
    if row.offload_optimizer != "none" and row.stage in (1, 2):
        out.append(f"offloaded optimizer states: 16 B x {P} params x {f:g} = {_gib(HOST_OPTIMIZER * p * f / GIB)} GiB "
                   "(DeepSpeed's ZeRO-1/2 estimate does not divide them by nodes)")
    if row.stage == 3:
        w = weight_bytes(row.precision)
        if row.offload_optimizer == "cpu":
            out.append(f"offloaded optimizer states: 16 B x {P} params / {n} node(s) x {f:g} = "
                       f"{_gib(HOST_OPTIMIZER * p / n * f / GIB)} GiB")
        if row.offload_param == "cpu":
            out.append(f"offloaded weights: {w} B x {P} params / {n} node(s) x {f:g} = {_gib(w * p / n * f / GIB)} GiB")
        if row.offload_param == "nvme":
            per_rank = min(p / inputs.total_gpus, inputs.nvme.param_max_in_cpu)
            out.append(f"offload_param=nvme still keeps up to max_in_cpu={inputs.nvme.param_max_in_cpu:,} weights "
                       f"per rank in pinned host RAM ({fmt_count(per_rank)} here) plus {inputs.nvme.param_buffer_count}"
                       f" x {inputs.nvme.param_buffer_size:,}-element swap buffers")
        if row.offload_optimizer == "nvme":
            sub = min(p / inputs.total_gpus, inputs.nvme.sub_group_size)
            out.append(f"offload_optimizer=nvme keeps {inputs.nvme.optimizer_buffer_count} pinned fp32 swap buffers "
                       f"of one sub-group (up to sub_group_size={inputs.nvme.sub_group_size:,}; {fmt_count(sub)} "
                       "here) per rank")
        if row.zero_init and (row.offload_optimizer == "none" or "nvme" in (row.offload_param, row.offload_optimizer)):
            out.append(f"zero.Init: each rank materialises one layer in fp32: 4 B x largest layer x {gpn} ranks x "
                       f"{f:g}" + (f" = {_gib(INIT_BYTES * inputs.largest_layer * gpn * f / GIB)} GiB"
                                   if inputs.largest_layer else " (largest layer unknown)"))
        if row.zero_init is False:
            out.append(f"with zero.Init the start-up peak ({_gib(init)} GiB) goes away")
    return out


# judging ---------------------------------------------------------------------------------------------------------


def _by_key(rows: list[Row]) -> dict[RowKey, Row]:
    return {r.key: r for r in rows}


def likely_row(rows: list[Row], precision: str) -> Row | None:
    """Without a config: the fastest setup that fits the GPU (the one people settle on), in :data:`PREFERENCE`
    order: no offload at ZeRO-0, 1, 2, 3, then CPU offload, then NVMe; zero.Init before without. A row whose GPU
    figure is a lower bound that fits (largest layer unknown) counts only if no row surely fits. None when the GPU
    memory is unknown."""
    by = _by_key(rows)
    ordered = [by[(s, p, o, z, precision)] for s, p, o, z in PREFERENCE if (s, p, o, z, precision) in by]
    for want in (True, None):
        for r in ordered:
            if r.fits_gpu is want and (want is True or r.gpu_lower_bound):
                return r
    return None


def _preferred(rows: list[Row], precision: str) -> list[Row]:
    by = _by_key(rows)
    return [by[(s, p, o, z, precision)] for s, p, o, z in PREFERENCE if (s, p, o, z, precision) in by]


def _row_line(r: Row, nvme: NvmeSettings | None = None) -> str:
    return (f"{r.label}: {_need(r, 'cpu')} host RAM per node, {_need(r, 'gpu')} per GPU -- "
            f"{config_snippet(r.key, nvme)}")


def _alternatives(rows: list[Row], precision: str, exclude: Row | None, limit: int = 3) -> list[Row]:
    """Rows that fit the host RAM and are not known to overflow the GPU, fastest first."""
    out = [r for r in _preferred(rows, precision)
           if (exclude is None or r.key != exclude.key) and r.fits_cpu is True and r.fits_gpu is not False]
    return out[:limit]


def _recompute(inputs: Inputs, row: Row, **changes: Any) -> Row:
    return _by_key(estimate(replace(inputs, **changes), (row.precision,)))[row.key]


def _host_fixes(rows: list[Row], inputs: Inputs, row: Row) -> list[str]:
    """Concrete remedies for a row that needs more host RAM than there is, each with its number."""
    fixes: list[str] = []
    alts = _alternatives(rows, row.precision, row)
    fixes += [f"use {_row_line(r, inputs.nvme)}" for r in alts]
    if row.stage == 3 and ("cpu" in (row.offload_param, row.offload_optimizer)
                           or "nvme" in (row.offload_param, row.offload_optimizer)):
        tuned = replace(inputs.nvme, param_max_in_cpu=min(inputs.nvme.param_max_in_cpu, TUNED_NVME["param_max_in_cpu"]),
                        sub_group_size=min(inputs.nvme.sub_group_size, TUNED_NVME["sub_group_size"]))
        nv_key = (3, "nvme" if row.offload_param != "none" else "none", "nvme", row.zero_init, row.precision)
        nv = _by_key(estimate(replace(inputs, nvme=tuned), (row.precision,)))[nv_key]
        if nv.cpu_bytes < row.cpu_bytes:
            what = "move the offload from cpu to NVMe" if nv_key != row.key else "shrink the pinned NVMe buffers"
            fixes.append(f"{what} (ZeRO-Infinity; DeepSpeed keeps max_in_cpu weights and buffer_count sub-groups "
                         f"in pinned host RAM, so lower them): {_row_line(nv, tuned)}")
    if row.stage in (1, 2) and row.offload_optimizer != "none":
        fixes.append(f"NVMe offload needs ZeRO-3: ZeRO-{row.stage} keeps offloaded optimizer states in host RAM even "
                     'with "device": "nvme"')
    if row.stage == 3 and row.zero_init is False:
        zi = _by_key(rows).get(row.key[:3] + (True, row.precision))
        if zi is not None:
            fixes.append(f"build the model under zero.Init: {_need(zi, 'cpu')} host RAM per node")
    if any(r.zero_init for r in alts) or row.zero_init is False:
        fixes.append(ZERO_INIT_HOWTO)
    if inputs.cpu_gib is not None:
        for gpn in range(inputs.gpus_per_node - 1, 0, -1):
            r = _recompute(inputs, row, gpus_per_node=gpn)
            if r.fits_cpu is True and r.fits_gpu is not False:
                fixes.append(f"fewer ranks per node: {gpn} (`deepspeed --num_gpus {gpn}` / `torchrun "
                             f"--nproc_per_node {gpn}`): {_need(r, 'cpu')} host RAM per node, {_need(r, 'gpu')} per "
                             f"GPU with {inputs.nodes} node(s)")
                break
        for n in range(inputs.nodes + 1, 65):
            r = _recompute(inputs, row, nodes=n)
            if r.cpu_bytes >= row.cpu_bytes:
                break  # this setup's host need does not shrink with more nodes
            if r.fits_cpu is True:
                fixes.append(f"spread the same setup over {n} nodes of {inputs.gpus_per_node} GPUs: "
                             f"{_need(r, 'cpu')} host RAM per node")
                break
    if row.zero_init is not True:
        fixes.append("load the weights in 16-bit (`from_pretrained(..., dtype=torch.bfloat16)`): the start-up "
                     "figure assumes each rank builds the model in fp32 (4 B/param); not counted above")
    return fixes


def _pick_lines(rows: list[Row], precision: str) -> list[str]:
    out = []
    fit_cpu = [r for r in _preferred(rows, precision) if r.fits_cpu is True]
    if fit_cpu:
        out.append("setups that fit the host RAM, fastest first: "
                   + "; ".join(f"{r.label} ({_need(r, 'gpu')} per GPU)" for r in fit_cpu[:4]))
    return out


def judge(rows: list[Row], inputs: Inputs, precision: str,
          configured: Configured | None = None) -> tuple[list[Finding], Row | None]:
    """Findings for the configured row (``configured``) or, without one, the :func:`likely_row`.

    Returns (findings, the judged row or None).
    """
    findings: list[Finding] = []
    own = [r for r in rows if r.precision == precision]
    head = (f"{fmt_count(inputs.total_params)} params"
            + (f", largest layer {fmt_count(inputs.largest_layer)}" if inputs.largest_layer else "")
            + f", {inputs.nodes} node(s) x {inputs.gpus_per_node} GPU(s), {precision}")
    base_evidence = [head, NOTE]
    if configured is not None:
        base_evidence += list(configured.notes)

    if inputs.largest_layer is None:
        findings.append(Finding(
            "memory.largest-layer-unknown", "info",
            "largest layer unknown: the ZeRO-3 figures marked +L leave it out",
            ["ZeRO-3 gathers the largest layer whole on one GPU (16-bit weights + grads: 4 B x its params); in "
             "language models it is usually the embedding, vocab x hidden (32000 x 4096 = 131M for Llama-2-7B)"],
            ["pass --largest-layer N, or --model path/to/config.json to count it exactly"]))
    if inputs.cpu_gib is None:
        findings.append(Finding("memory.cpu-mem-unknown", "info", "host RAM unknown: host fit not judged", [],
                                ["pass --cpu-mem GiB (per node)"]))

    row = None
    if configured is not None:
        row = _by_key(own).get(configured.key)
        why = "the configured setup"
    elif inputs.gpu_gib is not None:  # which setup "fits the GPU" needs the GPU's memory (a CPU login node: no)
        row = likely_row(own, precision)
        why = "the fastest setup that fits the GPU (no --config given)"

    if inputs.gpu_gib is not None and all(r.fits_gpu is False for r in own):
        least = min(own, key=lambda r: r.gpu_bytes)
        findings.append(Finding(
            "memory.gpu-oom", "fail",
            f"no ZeRO setup fits {_avail(inputs.gpu_gib)} GiB per GPU: the least is {_need(least, 'gpu')} "
            f"({least.label})",
            base_evidence + [f"ZeRO-3 with everything offloaded still gathers the largest layer on one GPU: "
                             f"{_need(least, 'gpu')}"],
            ["GPUs with more memory",
             'split each layer over GPUs with tensor parallelism (DeepSpeed AutoTP training: "tensor_parallel": '
             '{"autotp_size": 2}, ZeRO stage <= 2; not modelled here)'],
            {"least": least.to_json()}))
    elif row is not None and row.fits_gpu is False:
        alts = _alternatives(own, precision, row)
        findings.append(Finding(
            "memory.gpu-oom", "fail",
            f"{row.label} needs {_need(row, 'gpu')} per GPU, {_avail(inputs.gpu_gib)} GiB available",
            base_evidence + [f"judged: {why}"],
            [f"use {_row_line(r, inputs.nvme)}" for r in alts]
            or ["add GPUs (ZeRO-1/2/3 divide the sharded states by all GPUs)"],
            {"row": row.to_json(configured=configured is not None)}))

    if row is not None and row.fits_cpu is False:
        alts = _alternatives(own, precision, row)
        sev = "fail" if (configured is not None or not alts) else "warn"
        evidence = base_evidence + [f"judged: {why}"] + _host_terms(row, inputs) + [
            "the kernel's OOM killer ends such processes at start-up without a Python traceback "
            "(launcher: `exits with return code = -9`)"]
        findings.append(Finding(
            "memory.host-oom-at-start", sev,
            f"{row.label} needs {_need(row, 'cpu')} host RAM per node, {_avail(inputs.cpu_gib)} GiB available",
            evidence, _host_fixes(own, inputs, row), {"row": row.to_json(configured=configured is not None)}))
    elif row is None and inputs.cpu_gib is not None and all(r.fits_cpu is False for r in own):
        least = min(own, key=lambda r: r.cpu_bytes)
        findings.append(Finding(
            "memory.host-oom-at-start", "fail",
            f"every setup needs more host RAM than {_avail(inputs.cpu_gib)} GiB per node: the least is "
            f"{_need(least, 'cpu')} ({least.label})",
            base_evidence + _host_terms(least, inputs),
            _host_fixes(own, inputs, least), {"row": least.to_json()}))

    if inputs.gpu_gib is None:
        needs = "; ".join(f"{r.label}: {_need(r, 'gpu')}" for r in _preferred(own, precision)[:6])
        findings.append(Finding(
            "memory.gpu-mem-unknown", "info",
            "GPU memory unknown: pass --gpu-mem; no setup picked, the GPU fit is not judged" if row is None else
            "GPU memory unknown: pass --gpu-mem; the GPU fit of the configured setup is not judged",
            _pick_lines(own, precision) + [f"per GPU, fastest first: {needs}"],
            ["pass --gpu-mem GiB (per GPU) for the GPUs the job will run on, e.g. --gpu-mem 80 (A100/H100 80GB), "
             "--gpu-mem 24 (RTX 4090)"]))

    bad = any(f.severity in ("fail", "warn") and f.id in ("memory.gpu-oom", "memory.host-oom-at-start")
              for f in findings)
    if row is not None and not bad and row.fits is True:
        cpu = (f"{_need(row, 'cpu')} host RAM per node of {_avail(inputs.cpu_gib)}" if inputs.cpu_gib is not None
               else f"{_need(row, 'cpu')} host RAM per node (available unknown)")
        gpu = (f"{_need(row, 'gpu')} per GPU of {_avail(inputs.gpu_gib)}" if inputs.gpu_gib is not None
               else f"{_need(row, 'gpu')} per GPU (available unknown)")
        findings.append(Finding(
            "memory.fits", "ok", f"{row.label} fits: {gpu}, {cpu}",
            base_evidence + [f"judged: {why}", "leave room for activations: they grow with batch size and "
                             "sequence length (activation checkpointing shrinks them)"],
            [], {"row": row.to_json(configured=configured is not None)}))
    elif row is not None and not bad:  # not known to fit: what it needs, without a "fits" verdict
        findings.append(Finding(
            "memory.needs", "info", f"{row.label} needs {_need(row, 'gpu')} per GPU and {_need(row, 'cpu')} host RAM "
            "per node; whether that fits is not known (see above)",
            base_evidence + [f"judged: {why}"], [], {"row": row.to_json(configured=configured is not None)}))
    return findings, row

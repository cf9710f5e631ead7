"""``torchdoctor ds memory``: will this model's ZeRO model states fit the GPUs and the host RAM, and which setup?

Every ZeRO-0..3 setup (CPU/NVMe offload, with and without zero.Init, fp16/bf16/fp32) as a row of host GiB per
node and GiB per GPU (the formulas, and how they match DeepSpeed's estimators, are in :mod:`.memory`), the
configured row (``--config ds.json``) or the likely one marked, and findings: ``memory.host-oom-at-start`` (the
processes the kernel kills at start-up), ``memory.gpu-oom``, ``memory.fits`` (only for a row known to fit both),
``memory.needs`` (a row whose fit is not known). Without ``--gpu-mem`` and no GPU here (a CPU login node, where
runs are planned) no row is "likely" and nothing is said to fit: the GPU side is "GPU memory unknown: pass
--gpu-mem". A figure the unknown largest layer adds to is printed ``13.04+L``, never as a bound like ``≥0.00``.
Model states only: activations are not included.

The model comes from ``--params 7B [--largest-layer 131M]`` or ``--model`` (a Hugging Face config.json, or a
folder holding one), built on the meta device: exact counts, no weights, no network. The class built is the
config's ``architectures[0]``, else the language-model class of its ``model_type`` (so an untied LM head is
counted), or ``--model-class``; the output names it and why (:mod:`.model_count`).
"""

from __future__ import annotations

import argparse
import re
import sys
from fractions import Fraction
from typing import Any

from .. import _system
from ..jsonfile import JsonFileError, dumps, load_object
from ..units import GIB, UNITS_HELP, SizeError, parse_bytes
from .model_count import MAX_COUNT

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXAMPLES = [
    ("torchdoctor ds memory --params 7B --gpus-per-node 8 --gpu-mem 80GiB", "every ZeRO setup for a 7B model"),
    ("torchdoctor ds memory --model path/to/config.json --config ds.json", "count a HF model exactly; judge the "
     "configured row"),
    ("torchdoctor ds memory --params 70B --nodes 4 --cpu-mem 1TiB --json", "four nodes, as JSON"),
]
EXIT_CODES = [(EXIT_OK, "nothing failed"), (EXIT_PROBLEMS, "the configured setup does not fit, or none does"),
              (EXIT_USAGE, "bad usage or an unreadable file"), (130, "interrupted (Ctrl-C)")]

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
MAX_RANKS = 10**6  # --nodes, --gpus-per-node
MAX_MEMORY = 1 << 60  # --cpu-mem, --gpu-mem: 1024 TiB, past any node
_COUNT = re.compile(r"^([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([kKmMbBgGtT]?)$")


class UsageError(ValueError):
    """Bad input: printed as one line, exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--params", metavar="N", help="total parameters: 7e9, 7B, 1.3b, 350M")
    model.add_argument("--model", metavar="PATH",
                       help="a Hugging Face config.json or a folder with one: built on the meta device (no weights) "
                            "for the exact parameter count and largest layer")
    parser.add_argument("--model-class", metavar="NAME",
                        help="the transformers class --model builds, e.g. LlamaForCausalLM, LlamaModel, "
                             "AutoModelForSequenceClassification (default: the config's architectures, else the "
                             "language-model class of its model_type)")
    parser.add_argument("--largest-layer", metavar="N",
                        help="the largest layer's own parameters (ZeRO-3 gathers it whole on one GPU), e.g. 131M "
                             "(vocab x hidden for most language models); counted for you with --model")
    parser.add_argument("--gpus-per-node", metavar="N", help="ranks per node (default: the GPUs visible here, or 1)")
    parser.add_argument("--nodes", metavar="N", default="1", help="number of nodes (default 1)")
    parser.add_argument("--cpu-mem", metavar="SIZE",
                        help=f"host RAM per node, e.g. 256 or 256GiB; a plain number is GiB ({UNITS_HELP}) "
                             "(default: this machine's, from /proc/meminfo and its cgroup limit)")
    parser.add_argument("--gpu-mem", metavar="SIZE",
                        help="memory per GPU, e.g. 80 or 80GiB; a plain number is GiB; 80GB is 80 x 10^9 bytes = "
                             "74.5 GiB (a GPU sold as \"80GB\" has about 80 GiB: pass 80) (default: the first visible "
                             "GPU's)")
    parser.add_argument("--config", metavar="ds.json",
                        help="a DeepSpeed config: marks and judges the row it selects (stage, offload devices, "
                             "fp16/bf16, NVMe buffer sizes)")
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"),
                        help="the table's precision (default: from --config, else bf16; fp16 needs the same)")
    parser.add_argument("--zero-init", choices=("yes", "no"),
                        help="whether --config's ZeRO-3 model is built under deepspeed.zero.Init (default: yes, as "
                             "the HF Trainer does; no config key says it)")
    parser.add_argument("--json", action="store_true", help='print {"rows": [...], "findings": [...], "inputs": {...}}')


# parsing ---------------------------------------------------------------------------------------------------------


def parse_count(text: str, what: str) -> int:
    """'7e9', '7B', '1.3b', '350M', '7_000_000' -> int; :class:`UsageError` otherwise: not a count, not a whole
    number ('1.5'), not positive, or above :data:`MAX_COUNT` ('1e400'). Read exactly (no float rounding)."""
    m = _COUNT.match(str(text).strip())
    if not m:
        raise UsageError(f"{what}: cannot read {text!r} as a count (examples: 7e9, 7B, 1.3b, 350M)")
    mant, exp, suffix = m.groups()
    mantissa = Fraction(mant.replace("_", ""))
    exp = exp or "0"
    if len(exp.lstrip("+-").lstrip("0")) > 3:  # 1e1000, 1e-1000, 1e999999999: no count, and 10**e would take ages
        value = Fraction(0) if not mantissa else Fraction(1, 2) if exp.startswith("-") else Fraction(MAX_COUNT + 1)
    else:
        value = mantissa * Fraction(10) ** int(exp) * _SUFFIX[suffix.lower()]
    if value <= 0:
        raise UsageError(f"{what}: must be positive, got {text!r}")
    if value > MAX_COUNT:
        raise UsageError(f"{what}: {text!r} is out of range (at most 1e16 parameters)")
    if value.denominator != 1:
        raise UsageError(f"{what}: {text!r} is not a whole number of parameters; give a count such as 7e9, 7B, "
                         "1.3b or 350M")
    return int(value)


def parse_int(text: str, what: str) -> int:
    s = str(text).strip()
    if not re.fullmatch(r"[0-9]+", s) or not s.strip("0"):
        raise UsageError(f"{what}: must be a positive whole number, got {text!r}")
    if len(s.lstrip("0")) > 7 or int(s) > MAX_RANKS:
        raise UsageError(f"{what}: {text!r} is out of range (at most {MAX_RANKS:,})")
    return int(s)


def parse_gib(text: str, what: str) -> float:
    """``--gpu-mem`` / ``--cpu-mem`` in GiB: ``80`` and ``80G`` / ``80GiB`` are 80 x 2^30 bytes, ``80GB`` is 80 x 10^9
    (:func:`torchdoctor.units.parse_bytes`, the reading every size flag shares)."""
    try:
        n = parse_bytes(text, plain=GIB, examples="80 or 80GiB = 80 x 2^30 bytes, 80GB = 80 x 10^9")
    except SizeError as e:
        raise UsageError(f"{what}: {e}") from None
    if n <= 0:
        raise UsageError(f"{what}: must be a positive amount of memory, got {text!r}")
    if n > MAX_MEMORY:
        raise UsageError(f"{what}: {text!r} is out of range (at most 1024 TiB)")
    return float(n / GIB)


# probing ---------------------------------------------------------------------------------------------------------


def host_ram_gib() -> tuple[float | None, str]:
    """This machine's RAM in GiB: MemTotal, lowered to the cgroup memory limit when one is set (the guide's
    "available or allowed" memory: a container's limit kills as surely as the machine's). The readers and the rule
    are :mod:`torchdoctor._system`'s, shared with ``env`` and ``run``."""
    ram = _system.host_memory_limit()
    if ram is None:
        return None, "unknown (no /proc/meminfo; pass --cpu-mem)"
    total = _system.read_meminfo().get("MemTotal")
    source = "this machine's MemTotal" if ram == total else "this process's cgroup memory limit"
    return ram / _system.GIB, source


def visible_gpus() -> tuple[int, float | None, str]:
    """(count, memory of the first in GiB, description); (0, None, ...) without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0, None, "no GPU visible"
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        return n, props.total_memory / 2**30, f"{n} x {props.name}"
    except Exception as e:  # a broken driver must not stop an estimate
        return 0, None, f"GPU probe failed: {e}"


def model_counts(path: str, model_class: str | None = None) -> dict[str, Any]:
    """:func:`.model_count.model_counts`, its errors as usage errors (exit 2)."""
    from .model_count import ModelCountError
    from .model_count import model_counts as count

    try:
        return count(path, model_class)
    except ModelCountError as e:
        raise UsageError(str(e)) from None


# output ----------------------------------------------------------------------------------------------------------


def _fits_word(r) -> str:
    """``yes``, ``no (host)``, or what is known of each side: ``host yes, GPU ?`` (the legend says why ``?``)."""
    if r.fits is True:
        return "yes"
    bad = [w for w, ok in (("host", r.fits_cpu), ("GPU", r.fits_gpu)) if ok is False]
    if bad:
        return "no (" + ", ".join(bad) + ")"
    return f"host {'yes' if r.fits_cpu else '?'}, GPU {'yes' if r.fits_gpu else '?'}"


def _figure(gib: float, lower_bound: bool) -> str:
    """A table figure; ``+L`` where the unknown largest layer adds to it (never a bare ``≥0.00``)."""
    return f"{gib:.2f}+L" if lower_bound else f"{gib:.2f}"


def legend(rows, marked_likely: bool, gpu_known: bool, configured: bool = False) -> list[str]:
    """The lines under the table that explain its marks (only those that occur)."""
    marks = (["> configured row"] if configured else []) + (
        ["* likely row (the fastest setup that fits the GPU)"] if marked_likely else [])
    if not gpu_known and not configured:
        marks.append("no likely row: GPU memory unknown: pass --gpu-mem")
    out = ["  " + "; ".join(marks) + "."] if marks else []
    if any(r.cpu_lower_bound or r.gpu_lower_bound for r in rows):
        out.append("  +L = plus a term for the largest layer, unknown (pass --largest-layer N, or --model): ZeRO-3 "
                   "gathers it whole on each GPU (4 B x its params), zero.Init builds it in fp32 on each rank's host.")
    reasons = []
    if not gpu_known and any(r.fits is None and r.fits_gpu is None for r in rows):
        reasons.append("GPU memory unknown (pass --gpu-mem)")
    if any(r.fits is None and ((r.fits_cpu is None and r.cpu_lower_bound) or (r.fits_gpu is None and r.gpu_lower_bound))
           for r in rows):
        reasons.append("a +L figure fits only if the largest layer is small enough")
    if any(r.fits is None and r.fits_cpu is None and not r.cpu_lower_bound for r in rows):
        reasons.append("host RAM unknown (pass --cpu-mem)")
    if reasons:
        out.append("  ? = cannot tell: " + "; ".join(reasons) + ".")
    return out


def render_table(rows, configured_key, judged_key, judged_label: str) -> str:
    head = ("", "stage", "offload_param", "offload_optimizer", "zero.Init", "host GiB/node", "GiB/GPU", "fits", "", "")
    lines = []
    body = []
    for r in rows:
        mark = ">" if r.key == configured_key else ("*" if r.key == judged_key else "")
        note = "configured" if r.key == configured_key else (judged_label if r.key == judged_key else "")
        zi = "" if r.zero_init is None else ("yes" if r.zero_init else "no")
        cpu = _figure(r.cpu_gib, r.cpu_lower_bound)
        gpu = _figure(r.gpu_gib, r.gpu_lower_bound)
        src = "DS" if r.source == "deepspeed" else ""
        body.append((mark, str(r.stage), r.offload_param, r.offload_optimizer, zi, cpu, gpu, _fits_word(r), src,
                     "<- " + note if note else ""))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    right = {5, 6}
    for cells in [head, *body]:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        lines.append(" ".join(parts).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..findings import render_text, use_color
    from . import memory as M
    from . import memory_rules as R

    try:
        if args.params is None and args.model is None:
            raise UsageError("give the model size: --params 7B [--largest-layer 131M], or --model path/config.json")
        if args.params is not None and args.model is not None:
            raise UsageError("give --params or --model, not both")
        if args.model_class is not None and args.model is None:
            raise UsageError("--model-class chooses the class --model builds; give --model too")
        model_info = None
        if args.model is not None:
            if args.largest_layer is not None:
                raise UsageError("--largest-layer is counted from --model; drop one of them")
            model_info = model_counts(args.model, args.model_class)
            total, largest = model_info["total_params"], model_info["largest_layer"]
        else:
            total = parse_count(args.params, "--params")
            largest = parse_count(args.largest_layer, "--largest-layer") if args.largest_layer is not None else None
        nodes = parse_int(args.nodes, "--nodes")
        gpu_probe: tuple[int, float | None, str] | None = None
        if args.gpus_per_node is not None:
            gpn, gpn_source = parse_int(args.gpus_per_node, "--gpus-per-node"), "--gpus-per-node"
        else:
            gpu_probe = visible_gpus()
            gpn = max(gpu_probe[0], 1)
            gpn_source = f"visible GPUs ({gpu_probe[2]})" if gpu_probe[0] else "default 1 (no GPU visible)"
        if args.cpu_mem is not None:
            cpu_gib, cpu_source = parse_gib(args.cpu_mem, "--cpu-mem"), f"--cpu-mem {args.cpu_mem.strip()}"
        else:
            cpu_gib, cpu_source = host_ram_gib()
            if cpu_gib is not None:
                cpu_source += " (pass --cpu-mem for the training nodes)"
        if args.gpu_mem is not None:
            gpu_gib, gpu_source = parse_gib(args.gpu_mem, "--gpu-mem"), f"--gpu-mem {args.gpu_mem.strip()}"
        else:
            gpu_probe = gpu_probe or visible_gpus()
            gpu_gib = gpu_probe[1]
            gpu_source = (f"first visible GPU ({gpu_probe[2]})" if gpu_gib else
                          "no GPU visible here: pass --gpu-mem for the GPUs the job will run on")
        zero_init = None if args.zero_init is None else args.zero_init == "yes"
        configured = None
        nvme = M.NvmeSettings()
        if args.config is not None:
            try:
                cfg = load_object(args.config, "a DeepSpeed config")
            except JsonFileError as e:
                raise UsageError(f"--config: {e}") from None
            try:
                configured = M.configured_from_ds_config(cfg, args.precision, zero_init)
            except ValueError as e:
                raise UsageError(f"--config {args.config}: {e}") from None
            nvme = configured.nvme
        precision = args.precision or (configured.precision if configured else "bf16")
        try:
            inputs = M.Inputs(total, largest, gpn, nodes, cpu_gib, gpu_gib, nvme=nvme)
        except ValueError as e:
            raise UsageError(str(e)) from None
    except UsageError as e:
        print(f"torchdoctor ds memory: {e}", file=sys.stderr)
        return EXIT_USAGE

    rows = M.estimate(inputs)
    findings, judged = R.judge(rows, inputs, precision, configured)
    configured_key = configured.key if configured else None
    judged_label = "likely: fastest setup that fits the GPU"

    if args.json:
        inp = inputs.to_json()
        inp.update({
            "precision": precision,
            "gpus_per_node_source": gpn_source,
            "cpu_mem_source": cpu_source,
            "gpu_mem_source": gpu_source,
            "config": args.config,
            "model": model_info,
        })
        out = {
            "inputs": inp,
            "rows": [r.to_json(configured=r.key == configured_key) for r in rows],
            "findings": [f.to_json() for f in findings],
            "configured": None if configured is None else {
                "stage": configured.stage, "offload_param": configured.offload_param,
                "offload_optimizer": configured.offload_optimizer, "zero_init": configured.zero_init,
                "precision": configured.precision, "notes": list(configured.notes)},
            "judged": None if judged is None else judged.to_json(configured=judged.key == configured_key),
            "note": M.NOTE + "; GiB = 2**30 bytes (DeepSpeed prints the same figures labelled GB)",
        }
        print(dumps(out, indent=1))
    else:
        what = (f"{model_info['class']} from {model_info['config']}: " if model_info else "")
        what += f"{total:,} params ({R.fmt_count(total)})"
        if largest is not None:
            what += f", largest layer {largest:,} ({R.fmt_count(largest)}"
            what += f", {model_info['largest_layer_module'] or 'the root module'})" if model_info else ")"
        else:
            what += ", largest layer unknown (--largest-layer)"
        print(f"torchdoctor ds memory -- {what}")
        if model_info:
            head = {True: " (output head tied to the input embedding: counted once)",
                    False: " (output head untied: its own weights counted)"}.get(model_info["head_tied"], "")
            print(f"  counted {model_info['class']}{head}: {model_info['class_from']}" + (
                f"; another class: --model-class {' | '.join(model_info['other_classes'])}"
                if model_info["other_classes"] else "; another class: --model-class NAME"))
        print(f"  {nodes} node(s) x {gpn} GPU(s) per node [{gpn_source}]; {precision}")
        print(f"  host RAM per node: {'unknown' if cpu_gib is None else f'{cpu_gib:.1f} GiB'} [{cpu_source}]")
        print(f"  memory per GPU:    {'unknown' if gpu_gib is None else f'{gpu_gib:.1f} GiB'} [{gpu_source}]")
        if configured is not None:
            print(f"  configured ({args.config}): {M.describe(configured.key)}")
        print(f"  NOTE: {M.NOTE}.")
        print("  GiB = 2**30 bytes; DeepSpeed's estimators print the same numbers labelled \"GB\".")
        print()
        own = [r for r in rows if r.precision == precision]
        print(render_table(own, configured_key, judged.key if judged and configured is None else None,
                           judged_label))
        print()
        other = "fp16 needs the same as bf16" if precision != "fp32" else "fp16/bf16: --precision bf16"
        print(f"  DS = DeepSpeed's estimators compute this row too (same numbers); {other}; all precisions in --json.")
        print("\n".join(legend(own, judged is not None and configured is None, gpu_gib is not None,
                                configured is not None)))
        if nodes > 1:
            print("  ZeRO-1/2 offload host figures follow DeepSpeed's: every rank's start-up copy and all optimizer "
                  "states counted on each node (an overestimate on several nodes).")
        print()
        print(render_text(findings, color=use_color(sys.stdout)))
    return EXIT_PROBLEMS if any(f.severity == "fail" for f in findings) else EXIT_OK

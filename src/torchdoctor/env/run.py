"""``torchdoctor env``: the CUDA-build doctor -- what is installed, what will be used, and what breaks.

Facts first (torch and its CUDA, every CUDA toolkit on the machine, PATH order, host compiler, GPUs),
then findings with fixes. ``--prebuild`` prints the guide's DeepSpeed prebuild commands for this machine.
"""

from __future__ import annotations

import argparse
import sys

from ..findings import render_markdown, render_text, use_color
from ..jsonfile import dumps

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXAMPLES = [
    ("torchdoctor env", "facts, then findings with fixes"),
    ("torchdoctor env --ds-config ds.json", "with the libaio checks when the config offloads to NVMe"),
    ("torchdoctor env --prebuild", "the DeepSpeed prebuild commands for this machine"),
    ("torchdoctor env --markdown", "an issue body to paste"),
]
EXIT_CODES = [(EXIT_OK, "nothing failed"), (EXIT_PROBLEMS, "a check failed"),
              (EXIT_USAGE, "bad usage or an unreadable --ds-config"), (130, "interrupted (Ctrl-C)")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help='print {"facts": ..., "findings": [...]}')
    out.add_argument("--markdown", action="store_true", help="print a paste-ready issue body")
    out.add_argument("--prebuild", action="store_true",
                     help="print the DeepSpeed prebuild commands for this machine (TORCH_CUDA_ARCH_LIST filled in)")
    parser.add_argument("--ds-config", metavar="FILE", default=None,
                        help="a DeepSpeed config: NVMe offload in it turns on the libaio checks (and DS_BUILD_AIO=1)")


def facts_summary(facts) -> list[tuple[str, str]]:
    """(label, value) lines: what a person needs to see before the findings."""
    t = facts.torch
    if not t.installed:
        torch_line = f"not importable ({t.error})"
    else:
        build = f"CUDA {t.cuda}" if t.cuda else (f"HIP {t.hip}" if t.hip else "CPU build")
        extra = ", ".join(x for x in (f"cuDNN {t.cudnn}" if t.cudnn else "", f"NCCL {t.nccl}" if t.nccl else "") if x)
        torch_line = f"{t.version} ({build}{', ' + extra if extra else ''}; CUDA available: {t.cuda_available})"
    pkgs = []
    for name, p in facts.packages.items():
        if p.version is None:
            pkgs.append(f"{name} not installed")
        elif p.import_ok is False:
            pkgs.append(f"{name} {p.version} (import fails: {p.import_error})")
        else:
            pkgs.append(f"{name} {p.version}")
    gpus = "; ".join(f"{g.index}: {g.name} (sm {g.capability}"
                     + (f", {g.memory_gib:.0f} GiB)" if g.memory_gib else ")") for g in facts.gpus) or "none visible"
    tks = "; ".join(
        f"{tk.root} (nvcc {tk.version_full or tk.version or '?'}, "
        f"{'libcudart in ' + tk.lib_dir if tk.libcudart else 'no libcudart'}; via {', '.join(tk.found_via)})"
        for tk in facts.toolkits) or "none found"
    nvcc = facts.nvcc_on_path or "not on PATH"
    if facts.nvcc_on_path and facts.nvcc_on_path_root:
        nvcc += f" (runs {facts.nvcc_on_path_root})"
    hc = facts.host_compiler
    comp = f"{hc.path} {hc.version or '?'} (from {hc.source})" if hc else "none found"
    lines = [
        ("python", f"{facts.python} on {facts.os}"),
        ("torch", torch_line),
        ("packages", ", ".join(pkgs)),
        ("GPUs", gpus),
        ("driver", f"{facts.driver} (from {facts.driver_source})" if facts.driver else "none found"),
        ("CUDA toolkits", tks),
        ("nvcc on PATH", nvcc),
        ("CUDA_HOME for builds", (facts.deepspeed_cuda_home or f"none: torch is a CPU build (a CUDA torch would use "
                                  f"{facts.cuda_home_for_cuda_torch or 'none'})")
         + f" (CUDA_HOME={facts.cuda_home_env or 'unset'})"),
        ("host compiler", comp),
        ("build tools", f"ninja {facts.ninja or 'not found'}; libaio-dev {facts.libaio or 'not found'}"),
        ("system", f"{facts.cpu_count} CPUs, RAM {facts.ram_gib} GiB, /dev/shm {facts.shm_gib} GiB"),
    ]
    if facts.env:
        lines.append(("variables", " ".join(f"{k}={v}" for k, v in facts.env.items())))
    if facts.probe_errors:
        lines.append(("probe problems", "; ".join(facts.probe_errors)))
    return lines


def _nvme(path: str | None) -> bool | str:
    if not path:
        return False
    from .bundle import BundleError, load_ds_config, uses_nvme

    try:
        return uses_nvme(load_ds_config(path))
    except BundleError as e:
        return str(e)


def run(args: argparse.Namespace) -> int:
    nvme = _nvme(args.ds_config)
    if isinstance(nvme, str):
        print(f"torchdoctor env: --ds-config: {nvme}", file=sys.stderr)
        return EXIT_USAGE
    from . import prebuild, probe, rules
    from .progress import probing

    with probing("torchdoctor env"):  # stderr, and only when the probe takes over 2 s
        facts = probe.collect()
    findings = rules.judge(facts, nvme_offload=nvme)
    if args.prebuild:
        print(prebuild.commands(facts, rules.recommended_arch_list(facts), nvme=nvme))
        return EXIT_OK
    if args.json:
        print(dumps({"facts": facts.to_json(), "findings": [f.to_json() for f in findings]}, indent=1))
    elif args.markdown:
        print("### Environment (torchdoctor env)\n")
        print("\n".join(f"- **{k}**: {v}" for k, v in facts_summary(facts)))
        print("\n### Findings\n")
        print(render_markdown(f for f in findings if f.severity != "skip"))
    else:
        width = max(len(k) for k, _ in facts_summary(facts))
        print(f"torchdoctor env (probed in {facts.probe_seconds:.1f} s)")
        for k, v in facts_summary(facts):
            print(f"  {k:<{width}}  {v}")
        print()
        print(render_text((f for f in findings if f.severity != "skip"), color=use_color(sys.stdout)))
    return EXIT_PROBLEMS if any(f.severity == "fail" for f in findings) else EXIT_OK

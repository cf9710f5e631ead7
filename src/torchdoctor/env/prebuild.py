"""``torchdoctor env --prebuild``: the guide's DeepSpeed prebuild commands, filled in for this machine."""

from __future__ import annotations

from . import rules
from .facts import Facts


def arch_list_line(facts: Facts, recommended: str | None) -> tuple[str, list[str]]:
    """(TORCH_CUDA_ARCH_LIST value, notes): from the visible GPUs, else the variable's value, else a placeholder."""
    notes = []
    if recommended:
        notes.append(f"TORCH_CUDA_ARCH_LIST={recommended!r}: the compute capabilities of the visible GPUs "
                     f"({', '.join(sorted({g.name for g in facts.gpus}))})")
        return recommended, notes
    if value := facts.env.get("TORCH_CUDA_ARCH_LIST"):
        fixed = rules.arch_list_fixed(facts)
        if fixed and fixed != value:
            notes.append(f"no GPU is visible here: using your TORCH_CUDA_ARCH_LIST={value!r} as {fixed!r}, without "
                         "what torch or DeepSpeed refuse (`torchdoctor env` says what)")
            return fixed, notes
        if fixed:
            notes.append(f"no GPU is visible here: using your TORCH_CUDA_ARCH_LIST={value!r}")
            return value, notes
    notes.append("no GPU is visible here: replace <ARCH> with the target machine's compute capabilities, from "
                 "`nvidia-smi --query-gpu=compute_cap --format=csv,noheader` there (e.g. 8.6, or 8.0;9.0 for mixed "
                 "GPUs)")
    return "<ARCH>", notes


def commands(facts: Facts, recommended: str | None, nvme: bool = False, jobs: int | None = None) -> str:
    arch, notes = arch_list_line(facts, recommended)
    jobs = jobs or max(1, min(facts.cpu_count or 8, 16))
    ops = "DS_BUILD_CPU_ADAM=1 DS_BUILD_UTILS=1" + (" DS_BUILD_AIO=1" if nvme else "")
    lines = [f"# {n}" for n in notes]
    if nvme:
        state = f"found at {facts.libaio}" if facts.libaio else "NOT found: install it first"
        lines += [f"# NVMe offload needs libaio-dev ({state}):",
                  "sudo apt install libaio-dev   # yum install libaio-devel"]
    if facts.torch.installed and facts.torch.cuda is None and facts.torch.hip is None:
        lines.append(f"# torch {facts.torch.version} is not a CUDA build: DeepSpeed cannot build CUDA ops with it; "
                     "install a CUDA build of torch first (`torchdoctor env` says which)")
    home = next(iter(rules.build_home_paths(facts)), None)
    target = rules.usable_home(facts)
    if home and target and rules.home_missing(facts, home) and target[0] != home:
        lines.append(f"export CUDA_HOME={target[0]}   # CUDA_HOME={home} is not a CUDA toolkit (`torchdoctor env`)")
    lines += [
        "",
        "# 1. build and install here",
        "git clone https://github.com/deepspeedai/DeepSpeed/",
        "cd DeepSpeed",
        "rm -rf build",
        # pip 25.3 removed --global-option (the guide's `--global-option="build_ext" --global-option="-jN"`):
        # torch's BuildExtension takes the parallel jobs from MAX_JOBS instead, with any pip
        f'TORCH_CUDA_ARCH_LIST="{arch}" {ops} MAX_JOBS={jobs} pip install . \\',
        "  --no-build-isolation --no-cache-dir -v --disable-pip-version-check 2>&1 | tee build.log",
        f'# (the guide\'s form, pip < 25.3 only: ... pip install . --global-option="build_ext" '
        f'--global-option="-j{jobs}" --no-cache -v ...)',
        "",
        "# 2. or build a wheel once, for several machines with the same setup",
        "git clone https://github.com/deepspeedai/DeepSpeed/",
        "cd DeepSpeed",
        "rm -rf build",
        f'TORCH_CUDA_ARCH_LIST="{arch}" {ops} \\',
        f"  python setup.py build_ext -j{jobs} bdist_wheel",
        "pip install dist/deepspeed-*.whl   # on each machine",
        "",
        "# check what was built",
        "ds_report",
    ]
    return "\n".join(lines)

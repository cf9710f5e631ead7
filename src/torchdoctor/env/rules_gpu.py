"""The rules about the GPUs: torch's kernels vs each GPU's architecture, TORCH_CUDA_ARCH_LIST as torch and
DeepSpeed read it, and bf16 support."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..findings import Finding
from .facts import Facts
from .rules_common import (
    _cap,
    _cap_str,
    _deepspeed_installed,
    _gpu_names,
    _gpus_by_cap,
    _is_cuda_build,
    _mm,
    build_toolkit,
    recommended_arch_list,
)

# torch.utils.cpp_extension._get_cuda_arch_flags (torch 2.13): TORCH_CUDA_ARCH_LIST may name architectures, which
# torch replaces textually, in this order, before splitting; every entry must then be one of `supported_arches`,
# with or without "+PTX". The probe reads both tables from the installed torch (TorchFacts.arch_names,
# .supported_arches); these copies are the fallback for a torch where it could not.
NAMED_ARCHES: tuple[tuple[str, str], ...] = (
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
)
SUPPORTED_ARCHES: tuple[str, ...] = (
    "3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0",
    "9.0a", "10.0", "10.0a", "11.0", "11.0a", "10.3", "10.3a", "12.0", "12.0a", "12.1", "12.1a",
)
# DeepSpeed 0.19.8's op builder (compute_capability_args) reads each entry as X.Y[+PTX] with int(): names
# ("Ampere"), suffixes ("9.0a") and "native" raise ValueError in JIT and prebuild alike; its JIT builds drop empty
# entries, its prebuild (setup.py, DS_BUILD_*=1) fails on them.
DS_ARCH_ENTRY = re.compile(r"\d+\.\d+(\+PTX)?")
CUDA13_MIN_ARCH = (7, 5)  # CUDA 13 dropped Maxwell, Pascal and Volta targets
BF16_MIN_CAP = (8, 0)
_SEV = {"skip": 0, "ok": 1, "info": 2, "warn": 3, "fail": 4}


# -- GPUs --------------------------------------------------------------------------------------------------
def _arch_entries(arch_list: Iterable[str]) -> list[tuple[str, tuple[int, int], str]]:
    """("sm" | "compute", (major, minor), suffix) for each of torch's arch strings ("sm_86", "compute_90a")."""
    out = []
    for a in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([a-z]?)", a.strip())
        if m:
            out.append((m.group(1), (int(m.group(2)), int(m.group(3))), m.group(4)))
    return out


def _runs_on(kind_cap: tuple[int, int], suffix: str, gpu: tuple[int, int]) -> bool:
    """Whether code for ``kind_cap`` runs on a GPU of capability ``gpu``: arch-specific ("a") code only on that
    exact GPU; otherwise SASS/PTX for X.Z runs on X.Y with Z <= Y (SASS) -- callers handle PTX across majors."""
    if suffix == "a":
        return kind_cap == gpu
    return kind_cap[0] == gpu[0] and kind_cap[1] <= gpu[1]


def check_gpu_arch_unsupported(facts: Facts) -> list[Finding]:
    fid = "gpu.arch-unsupported"
    if not _is_cuda_build(facts) or not facts.gpus:
        why = "no GPU visible" if _is_cuda_build(facts) else "torch is not a CUDA build"
        return [Finding(fid, "skip", f"GPU architectures vs torch's build: {why}")]
    if not facts.torch.arch_list:
        return [Finding(fid, "skip", "GPU architectures vs torch's build: torch reported no arch list "
                        "(torch.cuda.get_arch_list() is empty when CUDA is not available to torch)")]
    entries = _arch_entries(facts.torch.arch_list)
    has = " ".join(facts.torch.arch_list)
    sms = [c for k, c, s in entries if k == "sm"]
    out = []
    for cap, gpus in _gpus_by_cap(facts.gpus).items():
        xy = f"sm_{cap[0]}{cap[1]}"
        data = {"capability": _cap_str(cap), "gpus": [g.index for g in gpus], "arch_list": list(facts.torch.arch_list),
                "torch": facts.torch.version}
        ev = [f"{_gpu_names(gpus)}: compute capability {_cap_str(cap)} ({xy})",
              f"torch {facts.torch.version} (CUDA {facts.torch.cuda}) has kernels for: {has}"]
        exact = any(k == "sm" and c == cap for k, c, s in entries)
        compat = [f"sm_{c[0]}{c[1]}{s}" for k, c, s in entries if k == "sm" and _runs_on(c, s, cap)]
        ptx = [f"compute_{c[0]}{c[1]}{s}" for k, c, s in entries
               if k == "compute" and (c == cap if s == "a" else c <= cap)]
        if exact or compat:
            how = xy if exact else f"{compat[-1]} (binary-compatible within major {cap[0]})"
            out.append(Finding(fid, "ok", f"torch {facts.torch.version} runs natively on {gpus[0].name} "
                               f"({xy}): {how}", ev, data=data))
            continue
        newer = bool(sms) and cap > max(sms)
        if newer:
            fix = ["install a torch built for a newer CUDA that targets " + xy + ": pip install --force-reinstall "
                   "torch --index-url https://download.pytorch.org/whl/cu130"]
        else:
            fix = ["install a torch built for an older CUDA that still targets " + xy + ": pip install "
                   "--force-reinstall torch --index-url https://download.pytorch.org/whl/cu126"]
        fix += ['check: python -c "import torch; print(torch.cuda.get_arch_list())"   # must list ' + xy,
                f"or build torch from source with TORCH_CUDA_ARCH_LIST={_cap_str(cap)}"]
        if ptx:
            ev.append(f"only PTX ({', '.join(ptx)}) fits: the driver JIT-compiles every kernel on first use "
                      "(minutes at start-up, cached in ~/.nv/ComputeCache)")
            out.append(Finding(fid, "warn", f"torch {facts.torch.version} has no {xy} kernels for {gpus[0].name}: "
                               f"runs through PTX JIT ({ptx[-1]}), slow first start", ev, fix, data))
        else:
            if sms and any(c[0] == cap[0] for c in sms):
                ev.append(f"torch's own check passes (same major {cap[0]}), but SASS for a newer minor does not "
                          "run on this GPU")
            ev.append('kernels fail with "no kernel image is available for execution on the device"')
            out.append(Finding(fid, "fail", f"torch {facts.torch.version} does not support {gpus[0].name} ({xy}); "
                               f"the build has {has}", ev, fix, data))
    return out


@dataclass
class ArchList:
    """TORCH_CUDA_ARCH_LIST as torch.utils.cpp_extension reads it."""

    auto: bool = False  # "" or "native": torch builds for the visible GPUs, as when it is unset
    entries: list[tuple[tuple[int, int], str, bool]] = field(default_factory=list)  # ((8, 6), "a", +PTX) accepted
    unknown: list[str] = field(default_factory=list)  # torch: "Unknown CUDA arch (X) or GPU not supported"
    empty: int = 0  # empty entries (";;", a ';' or a space at either end): torch raises on them too
    names: list[str] = field(default_factory=list)  # architecture names expanded ("Ampere", ...)
    raw: list[str] = field(default_factory=list)  # the non-empty entries as written (spaces as ';'), before names


def parse_arch_list(value: str, names: Iterable[Iterable[str]] | None = None,
                    supported: Iterable[str] | None = None) -> ArchList:
    """TORCH_CUDA_ARCH_LIST as torch's ``_get_cuda_arch_flags`` reads it: "" and "native" detect the visible GPUs;
    otherwise spaces separate like ';', architecture names are replaced in torch's order, and each entry must be one
    of torch's ``supported_arches`` ("8.6", "9.0a", ...), optionally with "+PTX" ("8.1", "9.9+PTX" are refused)."""
    if value in ("", "native"):
        return ArchList(auto=True)
    names = [tuple(n) for n in (NAMED_ARCHES if names is None else names)]
    supported = list(SUPPORTED_ARCHES if supported is None else supported)
    valid = set(supported) | {a + "+PTX" for a in supported}
    out = ArchList(raw=[e for e in value.replace(" ", ";").split(";") if e])
    s = value.replace(" ", ";")
    for name, arches in names:
        if name in s:
            out.names.append(name)
            s = s.replace(name, arches)
    for entry in s.split(";"):
        m = re.fullmatch(r"(\d+)\.(\d+)([a-z]*)(\+PTX)?", entry)
        if entry == "":
            out.empty += 1
        elif entry in valid and m:
            out.entries.append(((int(m.group(1)), int(m.group(2))), m.group(3), bool(m.group(4))))
        else:
            out.unknown.append(entry)
    return out


def _arch_token(cap: tuple[int, int], suffix: str, ptx: bool) -> str:
    return f"{_cap_str(cap)}{suffix}{'+PTX' if ptx else ''}"


def _torch_arch_parse(facts: Facts, value: str) -> ArchList:
    return parse_arch_list(value, facts.torch.arch_names, facts.torch.supported_arches)


def arch_list_fixed(facts: Facts) -> str | None:
    """TORCH_CUDA_ARCH_LIST with what torch or DeepSpeed refuse taken out and the visible GPUs added (None: unset,
    auto-detect, or nothing left)."""
    value = facts.env.get("TORCH_CUDA_ARCH_LIST")
    if value is None:
        return None
    parsed = _torch_arch_parse(facts, value)
    if parsed.auto:
        return None
    b = build_toolkit(facts)
    tk_mm = _mm(b.version) if b else None
    cuda13 = bool(tk_mm and tk_mm[0] >= 13)
    ds = _deepspeed_installed(facts)
    keep: dict[tuple[tuple[int, int], str], bool] = {}
    for cap, suffix, ptx in parsed.entries:
        if cuda13 and cap < CUDA13_MIN_ARCH:
            continue
        key = (cap, "" if ds else suffix)  # DeepSpeed cannot read "9.0a"
        keep[key] = keep.get(key, False) or ptx
    for cap in _gpus_by_cap(facts.gpus):
        if not any(c == cap for c, _ in keep):
            keep[(cap, "")] = False
    return ";".join(_arch_token(c, sfx, ptx) for (c, sfx), ptx in sorted(keep.items())) or None


def check_gpu_arch_list(facts: Facts) -> list[Finding]:
    fid = "gpu.arch-list"
    rec = recommended_arch_list(facts)
    value = facts.env.get("TORCH_CUDA_ARCH_LIST")
    b = build_toolkit(facts)
    ds = _deepspeed_installed(facts)
    data = {"TORCH_CUDA_ARCH_LIST": value, "recommended": rec, "toolkit": b.version if b else None,
            "torch_tables": facts.torch.supported_arches is not None}
    query = "nvidia-smi --query-gpu=compute_cap --format=csv,noheader"
    parsed = _torch_arch_parse(facts, value) if value is not None else None
    if parsed is None or parsed.auto:
        shown = "is unset" if value is None else f"is {value!r} (torch detects the visible GPUs, as when it is unset)"
        ev, fix, sev = [], [], "info"
        if value == "native" and ds:
            sev = "warn"
            ev.append("DeepSpeed's op builder (0.19.8) does not know 'native': it reads entries as X.Y and fails with "
                      "ValueError: invalid literal for int() with base 10: 'native'")
        elif value == "" and ds:
            ev.append("DeepSpeed's JIT builds detect the GPUs too, but its prebuild (setup.py, DS_BUILD_*=1) reads "
                      "the empty value literally and fails with ValueError")
        if rec is None:
            ev.insert(0, "extension builds without a visible GPU need TORCH_CUDA_ARCH_LIST: torch's detection "
                         "finds no GPU and fails (IndexError: list index out of range)")
            fix.append(f"set TORCH_CUDA_ARCH_LIST for the target machine's GPUs (`{query}` there), e.g. "
                       'export TORCH_CUDA_ARCH_LIST="8.6"')
            title = f"TORCH_CUDA_ARCH_LIST {shown} and no GPU is visible"
        else:
            ev.insert(0, "builds target the GPUs of the machine they run on; set it to build once for these GPUs "
                         "(and to prebuild DeepSpeed ops)")
            fix.append(f'export TORCH_CUDA_ARCH_LIST="{rec}"')
            title = f"TORCH_CUDA_ARCH_LIST {shown}; the visible GPUs need {rec}"
        if value is not None and ds:
            fix.append("or: unset TORCH_CUDA_ARCH_LIST")
        if sev == "warn":
            title += ": DeepSpeed refuses 'native'"
        return [Finding(fid, sev, title, ev, fix, data)]
    caps = {c for c, _, _ in parsed.entries}
    problems: list[tuple[str, str]] = []
    for e in parsed.unknown:
        problems.append(("warn", f"torch refuses {e!r}: \"Unknown CUDA arch ({e}) or GPU not supported\""))
    if parsed.empty:
        problems.append(("warn", f"{parsed.empty} empty entr{'y' if parsed.empty == 1 else 'ies'} (';;', or a ';' or "
                                 "space at either end): torch raises \"Unknown CUDA arch () or GPU not supported\" "
                                 "and DeepSpeed's prebuild (setup.py) fails with ValueError; only DeepSpeed's JIT "
                                 "builds drop them"))
    if ds:
        unreadable = [e for e in parsed.raw if not DS_ARCH_ENTRY.fullmatch(e) and e not in parsed.unknown]
        if unreadable:
            problems.append(("warn", f"DeepSpeed's op builder (0.19.8) reads only X.Y[+PTX]: "
                                     f"{', '.join(repr(e) for e in unreadable)} make it fail with ValueError: invalid "
                                     "literal for int()"))
    for cap, gpus in _gpus_by_cap(facts.gpus).items():
        if cap not in caps:
            problems.append(("warn", f"leaves out {_cap_str(cap)} ({_gpu_names(gpus)})"))
    tk_mm = _mm(b.version) if b else None
    if tk_mm and tk_mm[0] >= 13:
        old = sorted({c for c in caps if c < CUDA13_MIN_ARCH})
        if old:
            problems.append(("warn", f"{', '.join(_cap_str(c) for c in old)} below 7.5: CUDA {b.version} ({b.root}) "
                                     "dropped pre-Turing targets; nvcc fails with \"Unsupported gpu architecture\""))
    data.update(parsed=sorted({_cap_str(c) for c in caps}, key=_cap), unparseable=parsed.unknown, empty=parsed.empty,
                names=parsed.names)
    ev = [f"TORCH_CUDA_ARCH_LIST={value!r}" + (f" (names: {', '.join(parsed.names)})" if parsed.names else "")]
    ev += [p for _, p in problems]
    if parsed.unknown:
        ev.append((f"torch {facts.torch.version}" if facts.torch.version else "torch") + " accepts "
                  + ", ".join(facts.torch.supported_arches or SUPPORTED_ARCHES) + " (each also with +PTX)"
                  + ("" if facts.torch.supported_arches else " -- torch 2.13's list; this torch's was not read"))
    if rec is None:
        ev.append(f"no GPU visible here: make sure it lists the target machine's GPUs (`{query}` there)")
    if problems:
        fixed = arch_list_fixed(facts)
        fix = ([f'export TORCH_CUDA_ARCH_LIST="{fixed}"'] if fixed else
               [f"set it to the target machine's capabilities as X.Y (`{query}` there), e.g. "
                'export TORCH_CUDA_ARCH_LIST="8.6"'])
        data["fixed"] = fixed
        sev = max((s for s, _ in problems), key=_SEV.__getitem__)
        return [Finding(fid, sev, f"TORCH_CUDA_ARCH_LIST={value!r}: " + "; ".join(p for _, p in problems), ev, fix,
                        data)]
    sev = "ok" if rec else "info"
    title = (f"TORCH_CUDA_ARCH_LIST={value!r} covers the visible GPUs ({rec})" if rec
             else f"TORCH_CUDA_ARCH_LIST={value!r}; no GPU is visible to check it against")
    return [Finding(fid, sev, title, ev, data=data)]


def check_precision_bf16_available(facts: Facts) -> list[Finding]:
    caps = _gpus_by_cap(facts.gpus)
    if not caps:
        return []
    data = {"capabilities": [_cap_str(c) for c in caps]}
    old = {c: g for c, g in caps.items() if c < BF16_MIN_CAP}
    if not old:
        return [Finding("precision.bf16-available", "info", "every GPU supports bf16 (compute capability >= 8.0): "
                        "prefer bf16 over fp16",
                        ["models pretrained in bf16 overflow in fp16 (NaN loss); bf16 has fp32's range and needs no "
                         "loss scaling"],
                        ["TrainingArguments(bf16=True)", 'DeepSpeed config: "bf16": {"enabled": true}'],
                        {**data, "bf16": True})]
    names = "; ".join(f"{_cap_str(c)}: {_gpu_names(g)}" for c, g in old.items())
    return [Finding("precision.bf16-available", "info", f"bf16 is not available on some GPUs (compute capability "
                    f"< 8.0: {names})",
                    ["on these GPUs train in fp16 with dynamic loss scaling; models pretrained in bf16 may overflow "
                     "in fp16 (NaN loss)"],
                    ["TrainingArguments(fp16=True)",
                     'DeepSpeed config: "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}   '
                     "# loss_scale 0 = dynamic; lower initial_scale_power if the first steps overflow"],
                    {**data, "bf16": False, "without_bf16": [_cap_str(c) for c in old]})]

"""The rules about torch's build and the CUDA toolkits: torch missing or a CPU build, torch's CUDA vs nvcc (as
DeepSpeed's op builder decides it), several toolkits, PATH / LD_LIBRARY_PATH order, CUDA_HOME, libcudart."""

from __future__ import annotations

import posixpath

from ..findings import Finding
from .facts import Facts
from .rules_common import (
    DS_RULE,
    _cu_tag,
    _deepspeed_installed,
    _exports,
    _gpu_names,
    _install_toolkit,
    _is_cpu_build,
    _is_cuda_build,
    _lib_dir,
    _mm,
    _mm_str,
    _norm,
    _pip_torch,
    _preferred_match,
    _target_triple,
    _tk_label,
    _torch_base_version,
    build_home_paths,
    build_toolkit,
    deepspeed_accepts,
    home_for,
    home_missing,
    matching_toolkits,
    toolkit_at,
    usable_home,
)


# -- torch -------------------------------------------------------------------------------------------------
def check_torch_missing(facts: Facts) -> list[Finding]:
    if facts.torch.installed:
        return []
    b = build_toolkit(facts)
    if b and b.version:
        fix = [f"pip install torch --index-url https://download.pytorch.org/whl/{_cu_tag(b.version)}"
               f"   # CUDA {_mm_str(b.version)}, like the toolkit at {b.root}"]
    elif facts.gpus or facts.driver:
        fix = ["pip install torch --index-url https://download.pytorch.org/whl/cu<XY>   # XY: a CUDA version the "
               "driver supports (`nvidia-smi` shows it as \"CUDA Version\"), e.g. cu128"]
    else:
        fix = ["pip install torch --index-url https://download.pytorch.org/whl/cpu   # no NVIDIA GPU or driver seen"]
    err = facts.torch.error
    broken = bool(err) and not err.startswith("ModuleNotFoundError")
    title = f"torch cannot be imported: {err.splitlines()[0]}" if broken else "torch is not installed in this Python"
    ev = ([f"import torch: {err}"] if err else []) + [f"python: {facts.python}"]
    return [Finding("torch.missing", "fail", title, ev, fix, {"python": facts.python, "error": err})]


def check_torch_probe_error(facts: Facts) -> list[Finding]:
    if not facts.torch.installed or not facts.torch.error:
        return []
    first = facts.torch.error.strip().splitlines()[0] if facts.torch.error.strip() else facts.torch.error
    return [Finding("torch.probe-error", "warn", f"torch could not be fully probed: {first}",
                    [facts.torch.error], ['python -c "import torch; print(torch.__version__, torch.version.cuda, '
                                          'torch.cuda.is_available())"   # shows the full error'],
                    {"version": facts.torch.version, "error": facts.torch.error})]


def check_torch_cpu_build(facts: Facts) -> list[Finding]:
    if not _is_cpu_build(facts) or not (facts.gpus or facts.driver):
        return []
    seen = []
    if facts.gpus:
        seen.append(f"NVIDIA GPUs: {_gpu_names(facts.gpus)}")
    if facts.driver:
        seen.append(f"NVIDIA driver {facts.driver}" + (f" (from {facts.driver_source})" if facts.driver_source else ""))
    b = build_toolkit(facts)
    if b and _mm(b.version):
        cuda = _mm_str(b.version)
        fix = [_pip_torch(facts, cuda) + f"   # CUDA {cuda}, like the toolkit at {b.root}"]
    else:
        base = _torch_base_version(facts)
        fix = [f"pip install --force-reinstall {'torch==' + base if base else 'torch'} --index-url "
               "https://download.pytorch.org/whl/cu<XY>   # XY: a CUDA version the driver supports (`nvidia-smi` "
               "shows it as \"CUDA Version\"), e.g. cu128 for 12.8"]
    return [Finding("torch.cpu-build", "fail",
                    f"torch {facts.torch.version} is a CPU-only build on a machine with an NVIDIA GPU",
                    [f"torch {facts.torch.version}: torch.version.cuda is None"] + seen, fix,
                    {"torch": facts.torch.version, "driver": facts.driver, "gpus": [g.name for g in facts.gpus],
                     "toolkit": b.version if b else None})]


def check_torch_cuda_unavailable(facts: Facts) -> list[Finding]:
    if not _is_cuda_build(facts) or facts.torch.cuda_available or not (facts.gpus or facts.driver):
        return []
    ev = [f"torch {facts.torch.version} (CUDA {facts.torch.cuda}): torch.cuda.is_available() is False"]
    if facts.gpus:
        ev.append(f"NVIDIA GPUs: {_gpu_names(facts.gpus)}")
    if facts.driver:
        ev.append(f"NVIDIA driver {facts.driver}")
    fix = []
    cvd = facts.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ev.append(f"CUDA_VISIBLE_DEVICES={cvd!r}")
        if cvd.strip() in ("", "-1", "none", "NoDevFiles"):
            fix.append("unset CUDA_VISIBLE_DEVICES   # it hides every GPU")
    fix += [f"the driver must support CUDA {facts.torch.cuda}: `nvidia-smi` shows the newest CUDA it supports "
            "(\"CUDA Version\"); if that is lower, update the NVIDIA driver",
            "or install torch built for the CUDA the driver supports: pip install --force-reinstall torch "
            "--index-url https://download.pytorch.org/whl/cu<XY>"]
    return [Finding("torch.cuda-unavailable", "warn",
                    f"torch {facts.torch.version} is a CUDA {facts.torch.cuda} build but cannot use the GPU",
                    ev, fix, {"torch": facts.torch.version, "cuda": facts.torch.cuda, "driver": facts.driver,
                              "CUDA_VISIBLE_DEVICES": cvd})]


# -- CUDA toolkits -----------------------------------------------------------------------------------------
def check_cuda_toolkit_missing(facts: Facts) -> list[Finding]:
    if not _is_cuda_build(facts) or facts.toolkits:
        return []
    ds = _deepspeed_installed(facts)
    cuda = _mm_str(facts.torch.cuda) or facts.torch.cuda
    why = (f"DeepSpeed {facts.packages['deepspeed'].version} builds its ops (JIT or DS_BUILD_*) with nvcc"
           if ds else "only extension builds (DeepSpeed ops, torch.utils.cpp_extension) need nvcc")
    ev = [f"torch {facts.torch.version} was built with CUDA {facts.torch.cuda}", "no nvcc on PATH, in CUDA_HOME, "
          "/usr/local/cuda*, /opt/cuda* or conda environments", why]
    return [Finding("cuda.toolkit-missing", "warn" if ds else "info",
                    f"no CUDA toolkit (nvcc) found; torch is built with CUDA {cuda}", ev, _install_toolkit(cuda),
                    {"torch_cuda": facts.torch.cuda, "deepspeed": ds})]


def check_cuda_torch_vs_nvcc(facts: Facts) -> list[Finding]:
    fid = "cuda.torch-vs-nvcc"
    if not _is_cuda_build(facts):
        why = "torch is not installed" if not facts.torch.installed else "torch is not a CUDA build"
        return [Finding(fid, "skip", f"torch's CUDA vs nvcc: {why}", data={"torch_cuda": facts.torch.cuda})]
    b = build_toolkit(facts)
    if b is None:
        return [Finding(fid, "skip", "torch's CUDA vs nvcc: no toolkit for extension builds found",
                        data={"torch_cuda": facts.torch.cuda})]
    if _mm(facts.torch.cuda) is None:
        return [Finding(fid, "skip", f"torch's CUDA vs nvcc: torch's CUDA version {facts.torch.cuda!r} is unreadable",
                        data={"torch_cuda": facts.torch.cuda})]
    if _mm(b.version) is None:
        ev = [f"toolkit {b.root}: `nvcc --version` gave no version" + (f" ({b.error})" if b.error else "")]
        return [Finding(fid, "skip", f"torch's CUDA vs nvcc: the version of {b.root} is unknown", ev,
                        data={"torch_cuda": facts.torch.cuda, "root": b.root})]
    t, n = _mm_str(facts.torch.cuda), _mm_str(b.version)
    data = {"torch_cuda": facts.torch.cuda, "nvcc": b.version, "root": b.root}
    ev = [f"torch {facts.torch.version} was built with CUDA {facts.torch.cuda}",
          f"extension builds use {b.root}/bin/nvcc: CUDA {b.version_full or b.version}"]
    if t == n:
        return [Finding(fid, "ok", f"nvcc {n} at {b.root} matches torch's CUDA {t}", ev, data=data)]
    accepted = deepspeed_accepts(t, n)
    same_major = _mm(t)[0] == _mm(n)[0]
    skip_check = facts.env.get("DS_SKIP_CUDA_CHECK") == "1"
    data.update(deepspeed_accepts=accepted, ds_skip_cuda_check=skip_check)
    if accepted:
        sev = "warn"
        title = (f"nvcc {n} differs from torch's CUDA {t}: DeepSpeed accepts it, torch.utils.cpp_extension warns "
                 "(minor-version mismatch)")
    else:
        sev = "warn" if skip_check and same_major else "fail"
        why = "a different major version" if not same_major else (
            "minor versions may differ only within its lists" + ("; CUDA 13 has none" if _mm(n)[0] >= 13 else ""))
        title = f"nvcc {n} differs from torch's CUDA {t}: DeepSpeed's op builder refuses it ({why})"
        if not same_major:
            title += "; torch.utils.cpp_extension refuses a different major version too"
        ev.append(f'DeepSpeed: "Installed CUDA version {n} does not match the version torch was compiled with '
                  f'{facts.torch.cuda}, unable to compile cuda/cpp extensions without a matching cuda version."')
        ev.append(DS_RULE)
        if skip_check:
            title += "; DS_SKIP_CUDA_CHECK=1 is set, so DeepSpeed builds anyway"
            ev.append("DS_SKIP_CUDA_CHECK=1 is set: DeepSpeed skips this check; the ops build against a CUDA torch "
                      "was not built with (risk: crashes or wrong results at runtime)")
    others = [tk for tk in matching_toolkits(facts) if tk is not b]
    fix: list[str] = []
    if others:
        good = next((tk for tk in others if tk.libcudart), others[0])
        ev.append(f"toolkit {_tk_label(good)} matches torch: use it")
        fix += _exports(good, facts)
    else:
        fix += _install_toolkit(t)
    fix.append(f"or install torch built for CUDA {n}: {_pip_torch(facts, n)}")
    if not accepted and same_major and not skip_check:
        fix.append("last resort: export DS_SKIP_CUDA_CHECK=1   # DeepSpeed builds anyway; risk: the ops use a CUDA "
                   "torch was not built with (crashes, wrong results)")
    return [Finding(fid, sev, title, ev, fix, data)]


def check_cuda_multiple_toolkits(facts: Facts) -> list[Finding]:
    if len(facts.toolkits) < 2:
        return []
    b = build_toolkit(facts)
    matches = matching_toolkits(facts)
    ev = [f"{tk.root}: CUDA {tk.version or '?'} (found via {', '.join(tk.found_via) or '?'})"
          + ("  <- extension builds use this one" if tk is b else "") for tk in facts.toolkits]
    data = {"toolkits": [{"root": tk.root, "version": tk.version, "found_via": list(tk.found_via)}
                         for tk in facts.toolkits], "build_root": b.root if b else None}
    if b is not None and matches and b not in matches:
        good = _preferred_match(facts)
        return [Finding("cuda.multiple-toolkits", "warn",
                        f"{len(facts.toolkits)} CUDA toolkits: builds use {_tk_label(b)}, but {_tk_label(good)} "
                        f"matches torch's CUDA {facts.torch.cuda}", ev, _exports(good, facts), data)]
    return [Finding("cuda.multiple-toolkits", "info", f"{len(facts.toolkits)} CUDA toolkits found", ev, [], data)]


def check_cuda_path_order(facts: Facts) -> list[Finding]:
    def first(var: str):
        return min((e for e in facts.path_entries if e.var == var and e.toolkit), key=lambda e: e.index, default=None)

    p, ld = first("PATH"), first("LD_LIBRARY_PATH")
    if p is None and ld is None:
        return []
    ev, problems = [], []
    for e in (p, ld):
        if e is not None:
            tk = facts.toolkit(e.toolkit)
            ev.append(f"{e.var}[{e.index}] = {e.path} -> {e.toolkit} (CUDA {(tk.version if tk else None) or '?'})")
    stray = [e for e in facts.path_entries if e.var == "LD_LIBRARY_PATH" and not e.toolkit and e.libcudart
             and (ld is None or e.index < ld.index)]
    if stray:
        e = stray[0]
        ev.append(f"LD_LIBRARY_PATH[{e.index}] = {e.path} holds {', '.join(e.libcudart)} outside any toolkit found: "
                  "the loader looks there first")
    if p is not None and ld is not None and _norm(p.toolkit) != _norm(ld.toolkit):
        problems.append(f"PATH runs nvcc from {p.toolkit}, LD_LIBRARY_PATH loads CUDA libraries from {ld.toolkit}")
    good = _preferred_match(facts)
    if good is not None:
        wrong = [e for e in (p, ld) if e is not None and _mm(getattr(facts.toolkit(e.toolkit), "version", None))
                 != _mm(facts.torch.cuda)]
        if wrong:
            reached = sorted({f"CUDA {getattr(facts.toolkit(e.toolkit), 'version', None) or '?'}" for e in wrong})
            problems.append(f"{' and '.join(e.var for e in wrong)} reach{'es' if len(wrong) == 1 else ''} "
                            f"{', '.join(reached)} first, while {_tk_label(good)} matches torch's CUDA "
                            f"{facts.torch.cuda}")
    data = {"PATH": p.toolkit if p else None, "LD_LIBRARY_PATH": ld.toolkit if ld else None,
            "match": good.root if good else None}
    if not problems:
        if p is not None and ld is not None:
            title = f"PATH and LD_LIBRARY_PATH agree on {p.toolkit}"
        else:
            e = p or ld
            title = f"{e.var} reaches {e.toolkit} first ({'LD_LIBRARY_PATH' if p else 'PATH'} reaches no toolkit)"
        return [Finding("cuda.path-order", "ok", title, ev, data=data)]
    target = good or build_toolkit(facts) or facts.toolkit(p.toolkit if p else ld.toolkit)
    fix = []
    if target is not None:
        fix = [f"export PATH={target.root}/bin:$PATH", f"export LD_LIBRARY_PATH={_lib_dir(target)}:$LD_LIBRARY_PATH"]
    return [Finding("cuda.path-order", "warn", "PATH / LD_LIBRARY_PATH order: " + "; ".join(problems), ev, fix,
                    data)]


def check_cuda_home_mismatch(facts: Facts) -> list[Finding]:
    """CUDA_HOME judged by what a build needs there: bin/nvcc that runs, include/cuda_runtime.h, libcudart.

    With a CPU (or ROCm) build of torch, torch.utils.cpp_extension.CUDA_HOME is None and DeepSpeed, which takes it,
    cannot build CUDA ops at all; the CUDA_HOME a CUDA build of torch would use is judged then, as a warning.
    """
    fid = "cuda.home-mismatch"
    if not facts.toolkits and not facts.build_homes:
        return []
    nvcc_parent = posixpath.dirname(posixpath.dirname(facts.nvcc_on_path)) if facts.nvcc_on_path else None
    cuda_torch = _is_cuda_build(facts)

    def origin(path: str) -> str:
        if _norm(path) == _norm(facts.cuda_home_env):
            return "$CUDA_HOME"
        if _norm(path) == _norm(facts.cuda_path_env):
            return "$CUDA_PATH"
        if nvcc_parent and _norm(path) == _norm(nvcc_parent):
            return f"the folder above the folder of `nvcc` on PATH ({facts.nvcc_on_path})"
        return "its default"

    if cuda_torch:
        users = [(who, home) for who, home in (("DeepSpeed", facts.deepspeed_cuda_home),
                                               ("torch.utils.cpp_extension", facts.torch.cuda_home)) if home]
    else:
        users = [("a CUDA build of torch (and DeepSpeed with it)", h) for h in build_home_paths(facts)]
    cpu_note = None
    if not cuda_torch:
        build = ("not importable" if not facts.torch.installed else
                 f"a ROCm build (HIP {facts.torch.hip})" if facts.torch.hip else "a CPU build")
        torch = f"torch {facts.torch.version}" if facts.torch.version else "torch"
        cpu_note = (f"{torch} is {build}: torch.utils.cpp_extension.CUDA_HOME is None, and DeepSpeed's op builder, "
                    "which takes it, cannot build CUDA ops (MissingCUDAException: \"CUDA_HOME does not exist, unable "
                    "to compile CUDA op(s)\")")
    target = usable_home(facts)
    out: list[Finding] = []
    missing = {home: home_missing(facts, home) for _, home in users}
    bad = [(who, home) for who, home in users if missing[home] != []]
    if bad:
        homes = sorted({h for _, h in bad})
        lacks = {h: missing[h] for h in homes if missing[h]}
        ev = [f"{who} {'builds' if cuda_torch else 'would build'} with CUDA_HOME={home} (from {origin(home)})"
              + (f", which lacks {', '.join(missing[home])}" if missing[home] else ", which is not a CUDA toolkit")
              for who, home in bad]
        if cpu_note:
            ev.insert(0, cpu_note)
        if facts.nvcc_on_path and facts.nvcc_on_path_root and any(_norm(h) == _norm(nvcc_parent) for _, h in bad):
            ev.append(f"`nvcc` on PATH is {facts.nvcc_on_path}, which runs the toolkit at {facts.nvcc_on_path_root} "
                      "(a wrapper script or link): the folder above its folder is not that toolkit")
        ev.append("toolkits found: " + ("; ".join(_tk_label(t) + (f" (lacks {', '.join(t.missing)})" if t.missing
                                                                   else "") for t in facts.toolkits) or "none"))
        if target is not None:
            path, tk = target
            fix = [f"export CUDA_HOME={path}"]
            if tk is not None and facts.toolkit(facts.nvcc_on_path_root) is not tk:
                fix.append(f"export PATH={path}/bin:$PATH")
        else:
            ev.append("no toolkit found has bin/nvcc, include/cuda_runtime.h and libcudart together")
            fix = _install_toolkit(_mm_str(facts.torch.cuda) or "<X.Y>")
        short = sorted({m.split(" (")[0] for ms in lacks.values() for m in ms})
        subject = "extension builds" if cuda_torch else "a CUDA build of torch"
        title = (f"{subject} would use CUDA_HOME={', '.join(homes)}, which is not a CUDA toolkit"
                 + (f" (no {', no '.join(short)})" if short
                    else f" (found: {', '.join(t.root for t in facts.toolkits) or 'none'})"))
        if not cuda_torch:
            title += "; torch is not a CUDA build now, so DeepSpeed cannot build CUDA ops anyway"
        out.append(Finding(fid, "fail" if cuda_torch else "warn", title, ev, fix,
                           {"bad": {who: home for who, home in bad}, "missing": lacks,
                            "target": target[0] if target else None, "torch_cuda_build": cuda_torch,
                            "nvcc_on_path": facts.nvcc_on_path, "nvcc_on_path_root": facts.nvcc_on_path_root}))
    env_bad = any(_norm(h) == _norm(facts.cuda_home_env) for _, h in bad)
    if facts.cuda_home_env and facts.nvcc_on_path_root and not env_bad:
        bh = facts.build_home(facts.cuda_home_env)
        home_tk = (facts.toolkit(bh.toolkit_root) if bh else None) or toolkit_at(facts, facts.cuda_home_env)
        home_root = home_tk.root if home_tk else facts.cuda_home_env
        if _norm(home_root) != _norm(facts.nvcc_on_path_root):
            nv = facts.toolkit(facts.nvcc_on_path_root)
            pick = _preferred_match(facts) or home_tk or nv
            ev = [f"CUDA_HOME={facts.cuda_home_env}: {_tk_label(home_tk) if home_tk else 'not a found toolkit'}",
                  f"`nvcc` on PATH ({facts.nvcc_on_path}) runs {_tk_label(nv) if nv else facts.nvcc_on_path_root}",
                  "extension builds compile with CUDA_HOME's nvcc; scripts and build tools that call `nvcc` get the "
                  "other one"]
            pick_home = home_for(facts, pick) if pick else facts.cuda_home_env
            fix = [f"export CUDA_HOME={pick_home}", f"export PATH={pick_home}/bin:$PATH"]
            out.append(Finding(fid, "warn", f"CUDA_HOME ({home_root}) and `nvcc` on PATH ({facts.nvcc_on_path_root})"
                               " are different toolkits", ev, fix,
                               {"cuda_home": facts.cuda_home_env, "cuda_home_root": home_tk.root if home_tk else None,
                                "nvcc_on_path_root": facts.nvcc_on_path_root,
                                "target": pick_home}))
    if not out and users:
        homes = sorted({h for _, h in users})
        ev = ([cpu_note] if cpu_note else []) + [f"{who}: CUDA_HOME={home} -> {_home_label(facts, home)}"
                                                 for who, home in users]
        title = (f"extension builds use CUDA_HOME={', '.join(homes)}, a CUDA toolkit" if cuda_torch else
                 f"a CUDA build of torch would use CUDA_HOME={', '.join(homes)}, a CUDA toolkit (torch is not a CUDA "
                 "build now)")
        out.append(Finding(fid, "ok", title, ev, data={"homes": homes, "torch_cuda_build": cuda_torch}))
    return out


def _home_label(facts: Facts, home: str) -> str:
    bh = facts.build_home(home)
    tk = (facts.toolkit(bh.toolkit_root) if bh else None) or toolkit_at(facts, home)
    if bh is None:
        return _tk_label(tk)
    parts = [f"bin/nvcc (CUDA {bh.version or '?'}" + (f", runs {bh.toolkit_root})" if bh.toolkit_root
                                                and _norm(bh.toolkit_root) != _norm(home) else ")"),
             f"headers in {bh.include}", f"libcudart in {bh.lib_dir}"]
    return ", ".join(parts)


def check_cuda_libcudart_missing(facts: Facts) -> list[Finding]:
    b = build_toolkit(facts)
    out = []
    triple = _target_triple(facts)
    for tk in facts.toolkits:
        if tk.libcudart:
            continue
        targets = f"{tk.root}/targets/{triple}/lib"
        ev = [f"toolkit {_tk_label(tk)}: no libcudart.so* in lib64, lib or targets/*/lib",
              f"lib_dir: {tk.lib_dir or 'none found'}"]
        if tk is b:
            ev.append("extension builds use this toolkit: linking against cudart fails")
        fix = [f"ls {tk.root}/lib64 {targets}",
               f"if libcudart.so sits in {targets}: sudo ln -s {targets} {tk.root}/lib64",
               f"export LD_LIBRARY_PATH={tk.root}/lib64:$LD_LIBRARY_PATH",
               f"or reinstall the toolkit's runtime (e.g. `conda install -c nvidia cuda-cudart-dev={tk.version}`)"
               if tk.version else "or reinstall the toolkit"]
        out.append(Finding("cuda.libcudart-missing", "fail" if tk is b else "warn",
                           f"CUDA toolkit {tk.root} has no libcudart", ev, fix,
                           {"root": tk.root, "lib_dir": tk.lib_dir, "version": tk.version, "build": tk is b}))
    if not out and facts.toolkits:
        out.append(Finding("cuda.libcudart-missing", "ok", "every CUDA toolkit found has libcudart",
                           [f"{tk.root}: {tk.lib_dir}/{tk.libcudart[0]}" for tk in facts.toolkits],
                           data={"lib_dirs": {tk.root: tk.lib_dir for tk in facts.toolkits}}))
    return out

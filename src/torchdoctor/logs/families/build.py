"""Builds and compiled extensions: the CUDA toolkit against torch's CUDA, no toolkit at all, host compilers too new for
nvcc or too old for PyTorch's own headers, a compiler killed mid-build, and an extension built for another torch
(``undefined symbol``) that fails when it is imported.

Message table (each regex names where its text is printed):

- DeepSpeed 0.19.8 ``ops/op_builder/builder.py``: "Installed CUDA version X does not match the version torch was
  compiled with Y" (and its "APIs are compatible" / ``DS_SKIP_CUDA_CHECK`` variants), "CUDA_HOME does not exist,
  unable to compile CUDA op(s)", "Unable to run {nvcc}, unable to compile CUDA op(s)", "Unable to JIT load the {op} op
  due to ...", "PyTorch version mismatch! DeepSpeed ops were compiled and installed with a different version than
  what is being used at runtime." (and "CUDA version mismatch! ...").
- torch 2.13 ``torch/utils/cpp_extension.py``: ``CUDA_MISMATCH_MESSAGE`` "The detected CUDA version (%s) mismatches
  the version that was used to compilePyTorch (%s)" (printed over two lines, as a tuple, or only as its ``raise``
  line), "CUDA_HOME environment variable is not set. Please set it to your CUDA install root.", "No CUDA runtime is
  found, using CUDA_HOME='%s'", "CUDA was not found on the system", "The current installed version of {cc} ({v}) is
  less|greater than the minimum|maximum required version by CUDA {cuda}", "Error building extension '{name}'".
- PyTorch's own headers: ``c10/util/C++17.h`` (torch ~2.0-2.5) "You're trying to build PyTorch with a too old version
  of GCC. We need GCC 9 or later.", "You need C++17 to compile PyTorch"; torch 2.13 ``ATen/ATen.h`` "C++17 or later
  compatible compiler is required to use ATen.".
- CUDA's ``host_config.h``: "unsupported GNU version! gcc versions later than N are not supported!"; nvcc "nvcc
  fatal : ...", "nvcc error : 'cicc' died due to signal 9"; gcc "fatal error: Killed signal terminated program
  cc1plus"; ninja "ninja: build stopped: ...".
- Dao-AILab/flash-attention ``setup.py`` (v2.0-v2.7, copied by mamba-ssm, causal-conv1d and others):
  ``raise_if_cuda_home_none`` "{name} was requested, but nvcc was not found. Are you sure your environment has nvcc
  available?" (a warning in later versions, before the build fails), and ``get_cuda_bare_metal_version`` running
  ``CUDA_HOME/bin/nvcc -V``: CPython's "FileNotFoundError: [Errno 2] No such file or directory:
  '/usr/local/cuda/bin/nvcc'" when the toolkit is not there.
- CPython's ``dlopen`` error passed into ``ImportError`` (reproduced with torch 2.13): "ImportError: {path}.so:
  undefined symbol: {mangled}"; torch's op registry "operator torchvision::nms does not exist" (torchvision's C++
  ops not loaded: built for another torch); facebookresearch/xformers@ca6d2aa0d432 ``xformers/_cpp_lib.py``
  "xFormers can't load C++/CUDA extensions. xFormers was built for: ...".
"""

from __future__ import annotations

import re
from typing import Any

from ...findings import Finding
from ..common import add, clip, seen
from .base import Family

DS_CUDA_MISMATCH_RE = re.compile(
    r"Installed CUDA version (?P<sys>\d+\.\d+) does not match the version torch was compiled with (?P<torch>\d+\.\d+)"
    r"(?P<tail>.*)")
TORCH_CUDA_MISMATCH_RE = re.compile(
    r"The detected CUDA version \((?P<sys>[\d.]+)\) (?P<kind>mismatches|has a minor version mismatch with) the version"
    r" that was used to compile\s*PyTorch \((?P<torch>[\d.]+)\)")
#: Its first line alone (the message printed over two lines, or cut): joined with the next lines (JOINS).
TORCH_CUDA_MISMATCH_HEAD_RE = re.compile(
    r"The detected CUDA version \((?P<sys>[\d.]+)\) (?P<kind>mismatches|has a minor version mismatch with)(?P<torch>)")
#: torch 2.x ``raise RuntimeError(CUDA_MISMATCH_MESSAGE, cuda_str_version, torch.version.cuda)`` prints a tuple.
TORCH_CUDA_MISMATCH_ARGS_RE = re.compile(
    r"The detected CUDA version \(%s\) (?P<kind>mismatches|has a minor version mismatch with) .*?['\"],\s*"
    r"['\"](?P<sys>[\d.]+)['\"],\s*['\"](?P<torch>[\d.]+)['\"]")
#: The traceback's raise line: torch's _check_cuda_version raises it only on a major-version mismatch.
TORCH_CUDA_MISMATCH_RAISE_RE = re.compile(r"raise RuntimeError\(CUDA_MISMATCH_MESSAGE\b")
CUDA_HOME_RE = re.compile(r"CUDA_HOME does not exist, unable to compile CUDA op\(s\)|CUDA was not found on the system"
                          r"|Unable to run (\S+), unable to compile CUDA op\(s\)"
                          r"|CUDA_HOME environment variable is not set"
                          r"|was requested, but nvcc was not found"
                          r"|No such file or directory: '[^']*/bin/nvcc'")
NO_CUDA_RUNTIME_RE = re.compile(r"No CUDA runtime is found, using CUDA_HOME='(?P<home>[^']*)'")
GCC_TOO_NEW_RE = re.compile(r"unsupported GNU version! gcc versions later than (\d+) are not supported")
#: PyTorch's own headers (not CUDA's): the compiler is too old for PyTorch itself
TORCH_GCC_RE = re.compile(r"We need (?P<cc>GCC|Clang) (?P<need>\d+) or later|You need C\+\+17 to compile PyTorch"
                          r"|C\+\+17 or later compatible compiler is required to use (?:ATen|PyTorch)")
TORCH_COMPILER_RE = re.compile(
    r"The current installed version of (?P<cc>\S+) \((?P<ver>[\d.]+)\) is (?P<rel>less|greater) than the"
    r" (?:minimum|maximum) required version by CUDA (?P<cuda>[\d.]+)")
COMPILER_KILLED_RE = re.compile(
    r"(?P<cc>\S+): fatal error: Killed signal terminated program (?P<prog>\S+)"
    r"|nvcc error\s*: '(?P<prog2>\w+)' died due to signal (?P<sig>\d+)")
NVCC_FATAL_RE = re.compile(r"nvcc fatal\s*:\s*(.*)")
NINJA_STOPPED_RE = re.compile(r"ninja: build stopped: (.*)")
EXT_BUILD_RE = re.compile(r"Error building extension '([\w.-]+)'")
JIT_LOAD_RE = re.compile(r"Unable to JIT load the (\w+) op due to (it not being compatible|ninja not being installed)")
COMPILE_ERROR_RE = re.compile(r"^\s*(\S+?(?::\d+){1,2}|\S+\(\d+\)): (?:fatal )?error: (.*)")
# an extension built for another torch
UNDEFINED_SYMBOL_RE = re.compile(r": undefined symbol: (?P<sym>\S+)")  # the library is the word before it
MISSING_OP_RE = re.compile(r"operator (?P<op>\w+)::(?P<fn>\w+) does not exist")
DS_OPS_MISMATCH_RE = re.compile(r"(?P<what>PyTorch|CUDA) version mismatch! DeepSpeed ops were compiled and installed "
                                r"with a different version")
XFORMERS_RE = re.compile(r"xFormers can't load C\+\+/CUDA extensions|xFormers was built for a different version")

#: the CUDA versions torch wheels are published for (download.pytorch.org/whl/cuXYZ): 1.x's and 2.x's
TORCH_CUDA_BUILDS = frozenset({"10.2", "11.1", "11.3", "11.6", "11.7", "11.8", "12.1", "12.4", "12.6", "12.8", "12.9",
                               "13.0"})
ENV_FIX = ("torchdoctor env shows torch's CUDA, every CUDA toolkit on the machine, which one builds use, and the host "
           "compiler")
#: the torch-dependent packages people meet this with, and how each is reinstalled for the torch in use
REBUILD_HINTS = {
    "flash_attn": "pip install flash-attn --no-build-isolation (builds against the torch installed; or pick the "
                  "release wheel whose name matches torch's version, CUDA and C++ ABI)",
    "torchvision": "install the torchvision release made for this torch (pytorch.org's table: torch 2.5 <-> "
                   "torchvision 0.20, ...), from the same index (CUDA build) as torch",
    "torchaudio": "install the torchaudio release made for this torch, from the same index as torch",
    "apex": "rebuild apex against this torch: pip install -v --no-build-isolation --no-cache-dir ./ in its checkout",
    "mmcv": "install the mmcv wheel built for this torch and CUDA (mim install mmcv, or the find-links URL for "
            "cu{xy}/torch{x.y}), or build it: MMCV_WITH_OPS=1 pip install mmcv --no-binary mmcv",
    "xformers": "pip install xformers --index-url the same CUDA index as torch (its wheels are pinned to one torch)",
    "deepspeed": "reinstall DeepSpeed's prebuilt ops for this torch (DS_BUILD_OPS=1 pip install deepspeed "
                 "--no-cache-dir), or let them JIT-build (no DS_BUILD_*): torchdoctor env --prebuild",
    "bitsandbytes": "pip install -U bitsandbytes (its binaries are matched to the CUDA version at import)",
}


class Build(Family):
    """Builds and compiled extensions: handlers record, :meth:`judge` decides."""

    RULES = (
        ("Installed CUDA version", DS_CUDA_MISMATCH_RE, "on_ds_cuda_mismatch"),
        ("The detected CUDA version", TORCH_CUDA_MISMATCH_RE, "on_torch_cuda_mismatch"),
        ("The detected CUDA version (%s)", TORCH_CUDA_MISMATCH_ARGS_RE, "on_torch_cuda_mismatch"),
        ("CUDA_MISMATCH_MESSAGE", TORCH_CUDA_MISMATCH_RAISE_RE, "on_torch_cuda_mismatch_raise"),
        ("CUDA", CUDA_HOME_RE, "on_cuda_home"),
        ("nvcc was not found", CUDA_HOME_RE, "on_cuda_home"),
        ("/bin/nvcc'", CUDA_HOME_RE, "on_cuda_home"),
        ("No CUDA runtime is found", NO_CUDA_RUNTIME_RE, "on_no_cuda_runtime"),
        ("unsupported GNU version", GCC_TOO_NEW_RE, "on_gcc_too_new"),
        ("We need ", TORCH_GCC_RE, "on_torch_gcc"),
        ("C++17", TORCH_GCC_RE, "on_torch_gcc"),
        ("The current installed version of", TORCH_COMPILER_RE, "on_torch_compiler"),
        ("Killed signal terminated", COMPILER_KILLED_RE, "on_compiler_killed"),
        ("died due to signal", COMPILER_KILLED_RE, "on_compiler_killed"),
        ("nvcc fatal", NVCC_FATAL_RE, "on_nvcc_fatal"),
        ("ninja: build stopped", NINJA_STOPPED_RE, "on_ninja_stopped"),
        ("Error building extension", EXT_BUILD_RE, "on_ext_build"),
        ("Unable to JIT load", JIT_LOAD_RE, "on_jit_load"),
        ("error: ", COMPILE_ERROR_RE, "on_compile_error"),
        ("undefined symbol", UNDEFINED_SYMBOL_RE, "on_undefined_symbol"),
        ("does not exist", MISSING_OP_RE, "on_missing_op"),
        ("version mismatch! DeepSpeed ops", DS_OPS_MISMATCH_RE, "on_ds_ops_mismatch"),
        ("xFormers", XFORMERS_RE, "on_xformers"),
    )
    ANCHORS = ("Installed CUDA version", "GNU version", "We need GCC", "We need Clang", "vcc fatal",
               "ja: build stopped", "Error building extension", "CUDA op(s)", "CUDA was not found",
               "The detected CUDA version", "The current installed version of", "CUDA_MISMATCH_MESSAGE",
               "Unable to JIT load", "Unable to run", "CUDA_HOME", "No CUDA runtime", "C++17",
               "DeepSpeed ops were compiled", "xFormers")
    NEEDLES = ("nvcc was not found",)  # (a warning's words); "undefined symbol", "does not exist", "died due to
    # signal": on an error line ("rror")
    CAUSE_EVENTS = frozenset({"cuda-mismatch", "cuda-home", "compiler-error", "build-failed", "undefined-symbol"})
    #: handler -> the regex its first line matches when the message goes on over the next lines
    JOINS = {"on_torch_cuda_mismatch": TORCH_CUDA_MISMATCH_HEAD_RE}

    def __init__(self, log: Any) -> None:
        super().__init__(log)
        self.cuda_mismatch: list[dict] = []
        self.cuda_home: list[dict] = []
        self.no_runtime: list[dict] = []
        self.compiler: list[dict] = []
        self.extensions: list[dict] = []
        self._keys: set = set()

    @property
    def failed(self) -> bool:
        return bool(self.cuda_mismatch or self.cuda_home or self.compiler or self.extensions)

    def _add(self, lst: list, lineno: int, text: str, event: str, key: Any = None, **d: Any) -> None:
        if seen(self._keys, (event, key if key is not None else self.log.quote(text))):
            return
        self.log.event(lineno, event, text)
        add(lst, {"line": lineno, "text": self.log.quote(text), **d}, 16)

    # ---------------------------------------------------------------------------------------- handlers
    def on_ds_cuda_mismatch(self, m: re.Match, text: str, lineno: int) -> None:
        tail = m["tail"]
        verdict = ("info" if "APIs are compatible" in tail else "warn" if "DS_SKIP_CUDA_CHECK" in tail else "fail")
        self._add(self.cuda_mismatch, lineno, text, "cuda-mismatch", system=m["sys"], torch=m["torch"],
                  verdict=verdict, source="deepspeed")

    def on_torch_cuda_mismatch(self, m: re.Match, text: str, lineno: int) -> None:
        verdict = "fail" if m["kind"] == "mismatches" else "info"
        self._add(self.cuda_mismatch, lineno, text, "cuda-mismatch", key=("torch", m["sys"]), system=m["sys"],
                  torch=m["torch"] or None, verdict=verdict, source="torch")

    def on_torch_cuda_mismatch_raise(self, m: re.Match, text: str, lineno: int) -> None:
        """The traceback's ``raise RuntimeError(CUDA_MISMATCH_MESSAGE...`` line: the message itself may be cut."""
        self._add(self.cuda_mismatch, lineno, text, "cuda-mismatch", key=("torch-raise",), system=None, torch=None,
                  verdict="fail", source="torch traceback")

    def on_cuda_home(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(self.cuda_home, lineno, text, "cuda-home")

    def on_no_cuda_runtime(self, m: re.Match, text: str, lineno: int) -> None:
        add(self.no_runtime, {"line": lineno, "home": m["home"], "text": self.log.quote(text)}, 4)

    def on_gcc_too_new(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(self.compiler, lineno, text, "compiler-error", key=("gcc-too-new", m.group(1)), kind="gcc-too-new",
                  limit=int(m.group(1)))

    def on_torch_gcc(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(self.compiler, lineno, text, "compiler-error", key=("torch-gcc",), kind="torch-gcc-too-old",
                  compiler=(m["cc"] or "GCC").lower(), need=int(m["need"]) if m["need"] else 9)

    def on_torch_compiler(self, m: re.Match, text: str, lineno: int) -> None:
        kind = "gcc-too-new" if m["rel"] == "greater" else "gcc-too-old"
        self._add(self.compiler, lineno, text, "compiler-error", kind=kind, compiler=m["cc"], version=m["ver"],
                  cuda=m["cuda"])

    def on_compiler_killed(self, m: re.Match, text: str, lineno: int) -> None:
        prog = m["prog"] or m["prog2"]
        self._add(self.compiler, lineno, text, "compiler-error", key=("killed", prog), kind="compiler-killed",
                  program=prog, signal=int(m["sig"]) if m["sig"] else 9)

    def on_nvcc_fatal(self, m: re.Match, text: str, lineno: int) -> None:
        kind = "gpu-arch" if ("gpu architecture" in text or "gpu-architecture" in text) else "nvcc"
        self._add(self.compiler, lineno, text, "compiler-error", kind=kind, detail=m.group(1).strip())

    def on_ninja_stopped(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(self.compiler, lineno, text, "build-failed", kind="ninja")

    def on_ext_build(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(self.compiler, lineno, text, "build-failed", kind="extension", extension=m.group(1))

    def on_jit_load(self, m: re.Match, text: str, lineno: int) -> None:
        kind = "ninja-missing" if "ninja" in m.group(2) else "op-incompatible"
        self._add(self.compiler, lineno, text, "build-failed", kind=kind, op=m.group(1))

    def on_compile_error(self, m: re.Match, text: str, lineno: int) -> None:
        if "unsupported GNU version" in text or TORCH_GCC_RE.search(text):
            return  # reported by its own rule
        self._add(self.compiler, lineno, text, "compiler-error", kind="compile-error", file=m.group(1),
                  detail=clip(m.group(2), 200))

    def _extension(self, lineno: int, text: str, package: str, detail: str, **d: Any) -> None:
        self._add(self.extensions, lineno, text, "undefined-symbol", key=("ext", package), package=package,
                  detail=detail, **d)

    def on_undefined_symbol(self, m: re.Match, text: str, lineno: int) -> None:
        before = text[:m.start()].split()
        lib, sym = (before[-1].strip("'\"") if before else "?"), m["sym"]
        name = lib.replace("\\", "/").rsplit("/", 1)[-1].split(".")[0] or "an extension"
        self._extension(lineno, text, _package_of(lib), f"{name} needs {sym}", library=lib, symbol=sym,
                        demangled=_demangle_hint(sym))

    def on_missing_op(self, m: re.Match, text: str, lineno: int) -> None:
        if m["op"] in ("torchvision", "torchaudio", "mmcv", "xformers", "flash_attn", "detectron2", "apex"):
            self._extension(lineno, text, m["op"], f"its C++ operator {m['op']}::{m['fn']} is not registered")

    def on_ds_ops_mismatch(self, m: re.Match, text: str, lineno: int) -> None:
        self._extension(lineno, text, "deepspeed", f"its prebuilt ops were built for another {m['what']}")

    def on_xformers(self, m: re.Match, text: str, lineno: int) -> None:
        self._extension(lineno, text, "xformers", "it was built for another PyTorch or Python")

    # ---------------------------------------------------------------------------------------- verdicts
    def judge(self) -> list[Finding]:
        out = []
        if self.extensions:
            out.append(self._judge_extensions())
        if self.cuda_mismatch:
            out.append(self._judge_mismatch())
        if self.cuda_home:
            out.append(Finding(
                "build.cuda-home", "fail", "no CUDA toolkit found to compile CUDA ops (CUDA_HOME)",
                [f"line {d['line']}: {d['text']}" for d in self.cuda_home[:3]],
                [ENV_FIX, "install the CUDA toolkit matching torch.version.cuda (the 'devel' images in containers) "
                 "and export CUDA_HOME to it (e.g. CUDA_HOME=/usr/local/cuda-12.4), or use a prebuilt wheel of the "
                 "package instead of building it; DeepSpeed: DS_BUILD_OPS=0 skips CUDA op builds"],
                {"lines": list(self.cuda_home)}))
        elif self.no_runtime:
            d = self.no_runtime[0]
            out.append(Finding(
                "build.cuda-home", "warn",
                f"torch found no CUDA runtime (it guessed CUDA_HOME={d['home']}): no GPU or driver visible to this "
                "process, or a CPU-only torch",
                [f"line {x['line']}: {x['text']}" for x in self.no_runtime[:2]],
                ["harmless when building extensions on a machine without a GPU; where the job should use a GPU: "
                 "python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' "
                 "-- a version without +cu / cuda None is a CPU-only torch (reinstall from the CUDA index), False "
                 "with a CUDA torch is a driver or CUDA_VISIBLE_DEVICES problem", ENV_FIX],
                {"lines": list(self.no_runtime)}))
        if self.compiler:
            out.append(self._judge_compiler())
        return out

    def _judge_extensions(self) -> Finding:
        e = self.extensions[0]
        pkg = e["package"]
        ev = [f"line {x['line']}: {x['text']}" for x in self.extensions[:3]]
        if e.get("demangled"):
            ev.append(f"{e['symbol']} is {e['demangled']}: a symbol of torch's own libraries, so {pkg} was built "
                      "against a torch whose C++ API differs from the one installed")
        fix = [REBUILD_HINTS.get(pkg, f"reinstall {pkg} so that it is built against the torch installed (pip "
                                      f"install --force-reinstall --no-cache-dir --no-build-isolation {pkg}), or "
                                      "install the torch version it was built for"),
               "pip show torch " + pkg + " and python -c 'import torch; print(torch.__version__, torch.version.cuda, "
               "torch._C._GLIBCXX_USE_CXX11_ABI)' say which torch is installed; a prebuilt wheel's name says which "
               "torch, CUDA and C++ ABI it was built for", ENV_FIX]
        return Finding("build.undefined-symbol", "fail",
                       f"{pkg} was built for another torch: {e['detail']}", ev, fix,
                       {"package": pkg, "events": list(self.extensions)})

    def _judge_mismatch(self) -> Finding:
        rank = ("fail", "warn", "info").index
        # the most severe, and of those one that names the versions (a cut message or a raise line does not)
        worst = min(self.cuda_mismatch, key=lambda d: (rank(d["verdict"]), d["system"] is None, d["torch"] is None))
        ev = [f"line {d['line']}: {d['text']}" for d in self.cuda_mismatch[:3]]
        what = {"fail": "extensions cannot be built", "warn": "forced with DS_SKIP_CUDA_CHECK=1",
                "info": "accepted: same major version, compatible APIs"}[worst["verdict"]]
        want = worst["torch"] or "X.Y (python -c 'import torch; print(torch.version.cuda)')"
        system = worst["system"]
        if system is None:
            other = ", or install the torch build for the toolkit you have (nvcc --version)"
        elif system in TORCH_CUDA_BUILDS:
            other = (f", or install the torch build for CUDA {system} (pip install torch --index-url "
                     f"https://download.pytorch.org/whl/cu{system.replace('.', '')})")
        else:
            other = f" (no torch release is built for CUDA {system}: the toolkit is what has to change)"
        fix = [ENV_FIX,
               f"make the toolkit match torch: install CUDA {want} and export "
               f"CUDA_HOME=/usr/local/cuda-{worst['torch'] or 'X.Y'} "
               f"PATH=/usr/local/cuda-{worst['torch'] or 'X.Y'}/bin:$PATH{other}",
               "or prebuild the DeepSpeed ops on a matching machine: torchdoctor env --prebuild"]
        if worst["system"] is None:
            ev.append("torch's _check_cuda_version raises CUDA_MISMATCH_MESSAGE when nvcc's CUDA version differs from "
                      "torch.version.cuda (torch 2.x: the major version); the message with the versions is cut from "
                      "the log")
        if worst["source"] in ("torch traceback", "torch"):
            fix.append("DeepSpeed's op builder (ops/op_builder/builder.py: JIT ops, DS_BUILD_* installs) accepts a "
                       "major-version mismatch with DS_SKIP_CUDA_CHECK=1, at your own risk; torch's own "
                       "_check_cuda_version (torch.utils.cpp_extension) has no such switch")
        versions = (f"CUDA toolkit {worst['system']} does not match torch's CUDA {worst['torch']}"
                    if worst["system"] and worst["torch"] else
                    f"CUDA toolkit {worst['system']} does not match torch's CUDA" if worst["system"] else
                    "the CUDA toolkit does not match torch's CUDA (the versions are cut from the log)")
        return Finding("build.cuda-mismatch", worst["verdict"], f"{versions}: {what}", ev,
                       fix if worst["verdict"] != "info" else [], {"mismatches": list(self.cuda_mismatch)})

    def _judge_compiler(self) -> Finding:
        comp = self.compiler
        kinds = [d["kind"] for d in comp]
        root = next((d for d in comp if d["kind"] not in ("ninja", "extension", "compile-error")),
                    next((d for d in comp if d["kind"] == "compile-error"), comp[0]))
        need = next((d["need"] for d in comp if d["kind"] == "torch-gcc-too-old"), 9)
        titles = {
            "gcc-too-new": "the host compiler is newer than this CUDA toolkit supports",
            "gcc-too-old": "the host compiler is older than this CUDA toolkit needs",
            "torch-gcc-too-old": f"the host compiler is older than PyTorch's own headers need (GCC {need} or later, "
                                 "C++17)",
            "gpu-arch": "nvcc does not know the GPU architecture requested (toolkit too old for the GPU)",
            "nvcc": "nvcc failed",
            "ninja-missing": "ninja is not installed: ops cannot be JIT-built",
            "op-incompatible": "a DeepSpeed op is not compatible with this system",
            "compile-error": "compiling an extension failed",
            "compiler-killed": "the compiler was killed (SIGKILL) in the middle of the build: most likely the kernel's "
                               "OOM killer, with too many compile jobs running at once",
            "ninja": "building an extension failed",
            "extension": "building an extension failed",
        }
        fix = [ENV_FIX]
        if "torch-gcc-too-old" in kinds:
            fix.insert(0, f"build with GCC {need} or newer: the requirement is PyTorch's (c10/ATen headers), whatever "
                          f"the CUDA toolkit allows -- gcc --version shows the default; install a newer one (e.g. "
                          f"gcc-{max(need, 11)}/g++-{max(need, 11)}, or conda install -c conda-forge gxx=11) and "
                          f"export CC=gcc-{max(need, 11)} CXX=g++-{max(need, 11)} before the build; it must also be "
                          "one nvcc accepts for this toolkit")
        if "gcc-too-new" in kinds or "gcc-too-old" in kinds:
            v = next((d["limit"] for d in comp if d.get("limit")), None)
            gcc, gxx = (f"gcc-{v}", f"g++-{v}") if v else ("gcc-N", "g++-N")
            fix.append(f"point the build at a supported compiler{f' (gcc {v} or older)' if v else ''}: "
                       f"export CC={gcc} CXX={gxx} (or NVCC_PREPEND_FLAGS='-ccbin /usr/bin/{gxx}'), or link it into "
                       f"the toolkit: sudo ln -s /usr/bin/{gcc} /usr/local/cuda/bin/gcc && "
                       f"sudo ln -s /usr/bin/{gxx} /usr/local/cuda/bin/g++")
        if "gpu-arch" in kinds:
            fix.append("set TORCH_CUDA_ARCH_LIST to architectures this toolkit supports, or install a newer CUDA "
                       "toolkit for this GPU")
        if "compiler-killed" in kinds:
            prog = next(d["program"] for d in comp if d["kind"] == "compiler-killed")
            fix.insert(0, f"build with fewer parallel compile jobs: each {prog} on CUDA/template-heavy code can take "
                          "several GB of RAM, and ninja starts one per CPU core by default -- MAX_JOBS=4 (or 1-2 on a "
                          "small machine) before the build, e.g. MAX_JOBS=2 pip install ... (read by "
                          "torch.utils.cpp_extension, which DeepSpeed's setup.py and JIT op builds use)")
            fix.insert(1, "dmesg -T | grep -i -E 'killed process|out of memory' confirms the OOM killer; add swap or "
                          "build on a machine with more RAM")
        if "ninja-missing" in kinds:
            fix.append("pip install ninja")
        fix.append("prebuild the DeepSpeed ops once with the right settings: torchdoctor env --prebuild")
        ext = next((d.get("extension") for d in comp if d.get("extension")), None)
        title = titles.get(root["kind"], "building an extension failed") + (f" (extension '{ext}')" if ext else "")
        return Finding("build.compiler", "fail", title, [f"line {d['line']}: {d['text']}" for d in comp[:5]], fix,
                       {"errors": list(comp)})


_PACKAGE_PARTS = (("flash_attn", "flash_attn"), ("torchvision", "torchvision"), ("torchaudio", "torchaudio"),
                  ("xformers", "xformers"), ("mmcv", "mmcv"), ("apex", "apex"), ("amp_C", "apex"),
                  ("fused_layer_norm", "apex"), ("deepspeed", "deepspeed"), ("bitsandbytes", "bitsandbytes"),
                  ("detectron2", "detectron2"), ("torch_scatter", "torch_scatter"), ("torch_sparse", "torch_sparse"),
                  ("vllm", "vllm"), ("causal_conv1d", "causal_conv1d"), ("selective_scan", "mamba_ssm"),
                  ("mamba", "mamba_ssm"))


def _package_of(lib: str) -> str:
    """The installed package a shared library belongs to: a known one by its path, else the folder after
    site-packages, else the library's own name."""
    low = lib.replace("\\", "/")
    for part, pkg in _PACKAGE_PARTS:
        if part in low:
            return pkg
    m = re.search(r"(?:site|dist)-packages/([\w.-]+)", low)
    if m:
        return m.group(1).split(".")[0]
    return low.rsplit("/", 1)[-1].split(".")[0] or "the extension"


def _demangle_hint(sym: str) -> str | None:
    """A C++ symbol of torch's libraries (c10, at, torch, caffe2) named in words, without a demangler."""
    if not re.match(r"_ZNK?\d", sym):
        return None
    parts, rest = [], sym[3:].lstrip("K")
    while rest and rest[0].isdigit() and len(parts) < 4:
        n = re.match(r"\d+", rest).group()
        parts.append(rest[len(n): len(n) + int(n)])
        rest = rest[len(n) + int(n):]
    if not parts or parts[0] not in ("c10", "at", "torch", "caffe2"):
        return None
    return "::".join(parts)

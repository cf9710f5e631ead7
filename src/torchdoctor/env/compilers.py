"""The compilers and build tools an extension build uses: gcc / g++ / clang on PATH, the host compiler nvcc would
pick (the order nvcc 13.0 and torch's ``-ccbin $CC`` give), ninja and libaio."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Mapping

from .facts import Compiler, HostCompiler
from .tools import _Errors, _is_exe, _real, run

HOST_COMPILER_SOURCES = ("-ccbin in NVCC_APPEND_FLAGS", "CC", "-ccbin in NVCC_PREPEND_FLAGS", "NVCC_CCBIN",
                         "toolkit bin/gcc", "PATH")


def compiler_version(path: str, errors: _Errors) -> str | None:
    return errors.once(("compiler", _real(path)), lambda: _compiler_version(path, errors))


def _compiler_version(path: str, errors: _Errors) -> str | None:
    res = run([path, "-dumpfullversion", "-dumpversion"], errors)
    if res and res[0] == 0 and re.fullmatch(r"\d+(\.\d+)*", res[1].strip()):
        return res[1].strip()
    res = run([path, "--version"], errors)
    if res and res[0] == 0:
        m = re.search(r"version (\d+(?:\.\d+)+)", res[1])
        return m.group(1) if m else None
    return None


def probe_compilers(env: Mapping[str, str], errors: _Errors) -> list[Compiler]:
    out = []
    for name in ("gcc", "g++", "clang"):
        path = shutil.which(name, path=env.get("PATH"))
        out.append(Compiler(name, path, compiler_version(path, errors) if path else None))
    return out


def _ccbin_from_flags(env: Mapping[str, str], var: str) -> str | None:
    """The last ``-ccbin`` / ``--compiler-bindir`` in ``var`` (nvcc takes the last one it sees)."""
    try:
        parts = shlex.split(env.get(var, ""))
    except ValueError:
        return None
    found = None
    for i, p in enumerate(parts):
        if p in ("-ccbin", "--compiler-bindir") and i + 1 < len(parts):
            found = parts[i + 1]
        elif p.startswith(("-ccbin=", "--compiler-bindir=")):
            found = p.split("=", 1)[1]
    return found


def host_compiler(env: Mapping[str, str], build_root: str | None, errors: _Errors) -> HostCompiler | None:
    """The host compiler nvcc would use in a torch / DeepSpeed extension build, as nvcc 13.0 picks it.

    nvcc takes the last -ccbin on its command line: NVCC_PREPEND_FLAGS come first, then the build's own flags --
    torch adds ``-ccbin $CC`` when CC is set -- then NVCC_APPEND_FLAGS. Without -ccbin, NVCC_CCBIN; without that,
    ``gcc`` from a PATH on which nvcc has put its own bin folder first (so ``<toolkit>/bin/gcc`` beats PATH).
    A -ccbin folder means its gcc; a bare name is looked up on that PATH.
    """
    tk_bin = os.path.join(build_root, "bin") if build_root else None
    search = os.pathsep.join(([tk_bin] if tk_bin else []) + [env.get("PATH", "")])
    choices: list[tuple[str, str]] = []
    if ccbin := _ccbin_from_flags(env, "NVCC_APPEND_FLAGS"):
        choices.append((ccbin, "-ccbin in NVCC_APPEND_FLAGS"))
    if env.get("CC"):
        choices.append((env["CC"], "CC"))
    if ccbin := _ccbin_from_flags(env, "NVCC_PREPEND_FLAGS"):
        choices.append((ccbin, "-ccbin in NVCC_PREPEND_FLAGS"))
    if env.get("NVCC_CCBIN"):
        choices.append((env["NVCC_CCBIN"], "NVCC_CCBIN"))
    if tk_bin and _is_exe(os.path.join(tk_bin, "gcc")):
        choices.append((os.path.join(tk_bin, "gcc"), "toolkit bin/gcc"))
    if (gcc := shutil.which("gcc", path=env.get("PATH"))) and not any(gcc == v for v, _ in choices):
        choices.append((gcc, "PATH"))
    if not choices:
        return None
    (value, source), rest = choices[0], choices[1:]
    path = os.path.join(value, "gcc") if os.path.isdir(value) else value
    if os.sep not in path:
        path = shutil.which(path, path=search) or path
    overridden = [f"{src}: {val}" if src in ("toolkit bin/gcc", "PATH") else f"{src}={val}" for val, src in rest]
    return HostCompiler(path, compiler_version(path, errors), source, overridden)


def probe_ninja(env: Mapping[str, str], errors: _Errors) -> str | None:
    path = shutil.which("ninja", path=env.get("PATH"))
    if not path:
        return None
    res = run([path, "--version"], errors)
    return res[1].strip() if res and res[0] == 0 else None


def probe_libaio() -> str | None:
    """Where the libaio development library is (the unversioned libaio.so comes with libaio-dev)."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu",
              "/usr/lib/aarch64-linux-gnu"):
        p = os.path.join(d, "libaio.so")
        if os.path.exists(p):
            return p
    return None

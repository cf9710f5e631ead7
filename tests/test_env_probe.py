"""The env probe on fabricated toolkits (fake nvcc / gcc scripts in temp dirs) and on this real machine."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from torchdoctor._system import GIB
from torchdoctor.env import probe, rules


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_toolkit(root: Path, version: str, libcudart: bool = True, lib: str = "lib64", sleep: float = 0) -> Path:
    """A CUDA toolkit tree whose nvcc answers --version and --dryrun like the real one."""
    full = f"{version}.{88}"
    _script(root / "bin" / "nvcc", f"""{f"sleep {sleep}" if sleep else ""}
case "$*" in
  *--dryrun*) echo "#\\$ TOP={root}/bin/.." >&2 ;;
  *--version*) echo "Cuda compilation tools, release {version}, V{full}" ;;
esac
""")
    (root / lib).mkdir(parents=True, exist_ok=True)
    if libcudart:
        major = version.split(".")[0]
        (root / lib / f"libcudart.so.{major}").write_text("")
        (root / lib / "libcudart.so").write_text("")
    return root


def fake_gcc(folder: Path, version: str, name: str = "gcc") -> Path:
    return _script(folder / name, f"""case "$*" in
  *-dumpfullversion*) echo "{version}" ;;
  *) echo "{name} (fake) {version}" ;;
esac
""")


@pytest.fixture(autouse=True)
def _no_package_imports(request, monkeypatch, tmp_path):
    """Fabricated machines need no transformers/deepspeed import (1-2 s each) and never see this machine's
    /usr/local/cuda as torch's last guess for CUDA_HOME; the real-machine tests do."""
    if "real" not in request.node.name:
        monkeypatch.setattr(probe, "PACKAGES", ())
        monkeypatch.setattr(probe, "DEFAULT_CUDA_HOME", str(tmp_path / "usr-local" / "cuda"))


def cuda_torch(monkeypatch, cuda: str = "12.4", home_from=None):
    """Pretend torch is a CUDA build (this machine's is a CPU build): torch.version.cuda and its CUDA_HOME."""
    real = probe.probe_torch

    def fake():
        t = real()
        t.cuda, t.version = cuda, "2.5.1+cu" + cuda.replace(".", "")
        t.cuda_home = home_from() if home_from else None
        return t

    monkeypatch.setattr(probe, "probe_torch", fake)


def collect(tmp_path: Path, **env) -> probe.Facts:
    base = {"HOME": str(tmp_path / "home"), "PATH": env.pop("PATH", "/nonexistent")}
    base.update({k: str(v) for k, v in env.items()})
    return probe.collect(base, patterns=(str(tmp_path / "usr-local" / "cuda*"),), conda_bases=())


def test_several_toolkits_path_order_and_cuda_home(tmp_path):
    a = fake_toolkit(tmp_path / "usr-local" / "cuda-12.1", "12.1")
    b = fake_toolkit(tmp_path / "usr-local" / "cuda-12.4", "12.4")
    os.symlink(b, tmp_path / "usr-local" / "cuda")  # the usual /usr/local/cuda -> cuda-12.4 link
    facts = collect(tmp_path, PATH=f"{a}/bin:/usr/bin", LD_LIBRARY_PATH=f"{b}/lib64:/opt/x", CUDA_HOME=b)
    assert [(t.root, t.version, t.version_full) for t in facts.toolkits] == [
        (str(a), "12.1", "12.1.88"), (str(b), "12.4", "12.4.88")]
    by_root = {t.root: t for t in facts.toolkits}
    assert by_root[str(b)].found_via[0] == "CUDA_HOME"
    assert any(v.startswith(str(tmp_path / "usr-local" / "cuda")) for v in by_root[str(b)].found_via[1:])
    assert by_root[str(a)].found_via[0] == "PATH"
    assert by_root[str(b)].libcudart == ["libcudart.so", "libcudart.so.12"]
    assert by_root[str(b)].lib_dir == str(b / "lib64")
    assert facts.nvcc_on_path == str(a / "bin" / "nvcc") and facts.nvcc_on_path_root == str(a)
    assert facts.cuda_home_env == str(b) and facts.cuda_home_for_cuda_torch == str(b)
    assert facts.deepspeed_cuda_home is None  # this machine's torch is a CPU build
    assert [(e.var, e.index, e.toolkit) for e in facts.path_entries] == [("PATH", 0, str(a)),
                                                                         ("LD_LIBRARY_PATH", 0, str(b))]


def test_missing_libcudart_and_libs_under_targets(tmp_path):
    bare = fake_toolkit(tmp_path / "usr-local" / "cuda-12.2", "12.2", libcudart=False)
    targets = fake_toolkit(tmp_path / "usr-local" / "cuda-12.6", "12.6", lib="targets/x86_64-linux/lib")
    facts = collect(tmp_path)
    by_root = {t.root: t for t in facts.toolkits}
    assert by_root[str(bare)].libcudart == [] and by_root[str(bare)].lib_dir is None
    assert by_root[str(targets)].lib_dir == str(targets / "targets/x86_64-linux/lib")
    assert facts.nvcc_on_path is None and facts.path_entries == []


def test_nvcc_wrapper_on_path_is_traced_to_its_toolkit(tmp_path):
    """Like this machine: /usr/local/bin/nvcc is a script that execs the real one."""
    real = fake_toolkit(tmp_path / "usr-local" / "cuda-13.0", "13.0")
    bindir = tmp_path / "bin"
    _script(bindir / "nvcc", f'exec {real}/bin/nvcc "$@"\n')
    facts = collect(tmp_path, PATH=f"{bindir}:/usr/bin")
    assert [t.root for t in facts.toolkits] == [str(real)]
    assert facts.nvcc_on_path_root == str(real)
    # a CUDA build of torch (and DeepSpeed with it) would take the parent of nvcc's folder: not a toolkit
    assert facts.cuda_home_for_cuda_torch == str(tmp_path)
    assert facts.toolkit(str(tmp_path)) is None
    home = facts.build_home(str(tmp_path))
    assert (home.version, home.toolkit_root) == ("13.0", str(real))  # its bin/nvcc runs, the wrapper
    assert home.missing == ["include/cuda_runtime.h", "libcudart.so* (lib64, lib, targets/<arch>/lib)"]
    assert [(e.path, e.toolkit) for e in facts.path_entries] == [(str(bindir), str(real))]


def test_host_compiler_order_as_nvcc_and_torch_pick_it(tmp_path):
    """nvcc takes the last -ccbin: NVCC_PREPEND_FLAGS, torch's `-ccbin $CC`, NVCC_APPEND_FLAGS; then NVCC_CCBIN;
    then gcc on a PATH with its own bin folder first (so <toolkit>/bin/gcc beats PATH)."""
    tk = fake_toolkit(tmp_path / "usr-local" / "cuda-12.1", "12.1")
    new = fake_gcc(tmp_path / "newgcc", "14.1.0")
    old = fake_gcc(tmp_path / "oldgcc", "12.3.0", name="gcc-12")
    mid = fake_gcc(tmp_path / "midgcc", "13.2.0", name="gcc-13")
    path = f"{tmp_path / 'newgcc'}:{tk}/bin"

    def hc(**env):
        h = collect(tmp_path, PATH=path, CUDA_HOME=tk, **env).host_compiler
        return h.path, h.version, h.source

    assert hc() == (str(new), "14.1.0", "PATH")
    os.symlink(old, tk / "bin" / "gcc")  # the guide's fix: link the right gcc into the toolkit
    assert hc() == (str(tk / "bin" / "gcc"), "12.3.0", "toolkit bin/gcc")
    assert hc(NVCC_CCBIN=mid) == (str(mid), "13.2.0", "NVCC_CCBIN")  # NVCC_CCBIN beats the toolkit's link
    assert hc(NVCC_CCBIN=mid, NVCC_PREPEND_FLAGS=f"-ccbin {new}")[2] == "-ccbin in NVCC_PREPEND_FLAGS"
    assert hc(NVCC_CCBIN=new, NVCC_PREPEND_FLAGS=f"-ccbin {new}", CC=mid) == (str(mid), "13.2.0", "CC")
    assert hc(CC=mid, NVCC_APPEND_FLAGS=f"-O2 --compiler-bindir={tmp_path / 'newgcc'}") == (
        str(new), "14.1.0", "-ccbin in NVCC_APPEND_FLAGS")  # a folder: its gcc
    # a bare name is looked up the way nvcc does: its own bin folder first
    assert hc(CC="gcc")[:2] == (str(tk / "bin" / "gcc"), "12.3.0")
    facts = collect(tmp_path, PATH=path, CUDA_HOME=tk, NVCC_CCBIN=mid)
    assert facts.host_compiler.overridden == [f"toolkit bin/gcc: {tk / 'bin' / 'gcc'}", f"PATH: {new}"]
    assert [c.version for c in facts.compilers if c.name == "gcc"] == ["14.1.0"]


REAL_NVCC = "/usr/local/cuda-13.0/bin/nvcc"


def _real_nvcc_picks(env: dict, cc: str | None, cwd: Path, nvcc: str) -> str:
    """The host compiler the real nvcc runs for a torch extension build (torch appends -ccbin $CC)."""
    import subprocess

    (cwd / "x.cu").write_text("")
    cmd = [nvcc, "--dryrun", "-c", "x.cu", "-o", "x.o"] + (["-ccbin", cc] if cc else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=30)
    lines = [ln[3:] for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("#$ ")]
    search = next(ln.split("=", 1)[1] for ln in lines if ln.startswith("PATH="))
    first = next(ln for ln in lines if " -E -x c++" in ln)
    exe = first.split(" -")[0].replace('"', "")
    return exe if os.sep in exe else shutil.which(exe, path=search)


@pytest.mark.skipif(not (os.path.exists(REAL_NVCC) and shutil.which("gcc")), reason="needs the real CUDA 13.0 nvcc")
def test_host_compiler_order_agrees_with_the_real_nvcc(tmp_path):
    """A toolkit whose bin/ holds the real nvcc (a link; its nvcc.profile points at the real toolkit) and a gcc."""
    root = tmp_path / "cuda"
    (root / "bin").mkdir(parents=True)
    os.symlink(REAL_NVCC, root / "bin" / "nvcc")
    profile = Path(REAL_NVCC + ".profile").read_text().replace("$(_HERE_)/..", "/usr/local/cuda-13.0")
    (root / "bin" / "nvcc.profile").write_text(profile)
    real_gcc = shutil.which("gcc")  # nvcc asks the host compiler what it targets: each is the real gcc, by another path
    gccs = {n: _script(tmp_path / n / "gcc", f'exec {real_gcc} "$@"\n') for n in "abc"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("NVCC_") and k not in ("CC", "CXX")}
    cases = [{}, {"NVCC_CCBIN": str(gccs["a"])}, {"NVCC_CCBIN": str(gccs["a"]), "CC": str(gccs["b"])},
             {"NVCC_PREPEND_FLAGS": f"-ccbin {gccs['c']}", "CC": str(gccs["b"])},
             {"NVCC_PREPEND_FLAGS": f"-ccbin {gccs['c']}", "NVCC_CCBIN": str(gccs["a"])},
             {"NVCC_APPEND_FLAGS": f"-ccbin {gccs['c']}", "CC": str(gccs["b"])},
             {"NVCC_CCBIN": str(tmp_path / "b")}, {"CC": "gcc"}]
    for with_link in (False, True):
        if with_link:
            os.symlink(gccs["a"], root / "bin" / "gcc")
        for case in cases:
            env = {**base, **case}
            want = _real_nvcc_picks(env, case.get("CC"), tmp_path, str(root / "bin" / "nvcc"))
            got = probe.host_compiler(env, str(root), probe._Errors())
            assert os.path.realpath(got.path) == os.path.realpath(want), (case, with_link, got)


def test_a_stuck_nvcc_is_a_fact_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "TOOL_TIMEOUT_S", 1.0)
    tk = fake_toolkit(tmp_path / "usr-local" / "cuda-12.4", "12.4", sleep=30)
    t0 = time.monotonic()
    facts = collect(tmp_path)
    assert time.monotonic() - t0 < 4
    assert [(t.root, t.version) for t in facts.toolkits] == [(str(tk), None)]
    assert facts.toolkits[0].error == f"`{tk}/bin/nvcc --version` hung: no answer within 1 s"
    assert f"`{tk}/bin/nvcc --version` hung: no answer within 1 s; killed it and the processes it started" in \
        facts.probe_errors


def _stuck_toolkit(root: Path, pids: Path) -> Path:
    """A toolkit whose nvcc never answers: a shell waiting on a `sleep` it started (a grandchild of the probe)."""
    _script(root / "bin" / "nvcc", f"sleep 20 &\necho $! >> {pids}\nwait\n")
    return root


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except OSError:
        return False


def test_several_stuck_tools_cost_one_timeout_and_leave_no_process(tmp_path, monkeypatch):
    """Two hanging nvcc's (on PATH and as CUDA_HOME): the probe ends after about one TOOL_TIMEOUT_S, every tool
    it started is gone (their `sleep` too), and probe_errors names each tool that hung."""
    monkeypatch.setattr(probe, "TOOL_TIMEOUT_S", 1.5)
    monkeypatch.setattr(probe, "TOOL_GRACE_S", 0.5)
    pids = tmp_path / "pids"
    one = _stuck_toolkit(tmp_path / "stuck1", pids)
    two = _stuck_toolkit(tmp_path / "usr-local" / "cuda-12.4", pids)
    t0 = time.monotonic()
    facts = collect(tmp_path, PATH=f"{one}/bin:/usr/bin", CUDA_HOME=two)
    took = time.monotonic() - t0
    assert took < 1.5 + 0.5 + 1.5, took
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 4  # --version and --dryrun, once per nvcc although `two` was found twice
    deadline = time.monotonic() + 2
    while any(map(_alive, started)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, started))
    for nvcc in (one / "bin" / "nvcc", two / "bin" / "nvcc"):
        assert any(e.startswith(f"`{nvcc} --version` hung") for e in facts.probe_errors), facts.probe_errors
        assert any(e.startswith(f"`{nvcc} --dryrun -c x.cu` hung") for e in facts.probe_errors)


def test_each_nvcc_runs_once_however_it_was_found(tmp_path):
    log = tmp_path / "calls"
    tk = fake_toolkit(tmp_path / "usr-local" / "cuda-12.4", "12.4")
    body = (tk / "bin" / "nvcc").read_text().replace("#!/bin/sh\n", f"#!/bin/sh\necho \"$1\" >> {log}\n")
    (tk / "bin" / "nvcc").write_text(body)
    os.symlink(tk, tmp_path / "usr-local" / "cuda")
    facts = collect(tmp_path, PATH=f"{tk}/bin:/usr/bin", CUDA_HOME=tmp_path / "usr-local" / "cuda",
                    LD_LIBRARY_PATH=f"{tk}/lib64")
    assert facts.toolkits[0].found_via[:2] == ["PATH", "CUDA_HOME"]
    assert sorted(log.read_text().split()) == ["--dryrun", "--version"]


def test_toolkits_reached_only_through_ld_library_path_or_later_path_entries(tmp_path):
    """Module-system installs (/apps/cuda/X.Y) outside the searched places: every PATH entry with an nvcc and every
    LD_LIBRARY_PATH entry inside a toolkit (lib64, targets/<arch>/lib) makes a toolkit; the loader's first one
    (12.1) differs from PATH's (12.4)."""
    apps = tmp_path / "apps" / "cuda"
    t121 = fake_toolkit(apps / "12.1", "12.1")
    t124 = fake_toolkit(apps / "12.4", "12.4")
    t118 = fake_toolkit(apps / "11.8", "11.8", lib="targets/x86_64-linux/lib")
    t126 = fake_toolkit(apps / "12.6", "12.6")
    facts = collect(tmp_path, PATH=f"{t124}/bin:/usr/bin:{t126}/bin",
                    LD_LIBRARY_PATH=f"{t121}/lib64:{t124}/lib64:{t118}/targets/x86_64-linux/lib")
    by_root = {t.root: t.found_via for t in facts.toolkits}
    assert by_root == {str(t118): ["LD_LIBRARY_PATH[2]"], str(t121): ["LD_LIBRARY_PATH[0]"],
                       str(t124): ["PATH", "LD_LIBRARY_PATH[1]"], str(t126): ["PATH[2]"]}
    assert [(e.var, e.index, e.toolkit) for e in facts.path_entries] == [
        ("PATH", 0, str(t124)), ("PATH", 2, str(t126)), ("LD_LIBRARY_PATH", 0, str(t121)),
        ("LD_LIBRARY_PATH", 1, str(t124)), ("LD_LIBRARY_PATH", 2, str(t118))]
    order = [f for f in rules.judge(facts) if f.id == "cuda.path-order"]
    assert [f.severity for f in order] == ["warn"]
    assert f"LD_LIBRARY_PATH loads CUDA libraries from {t121}" in order[0].title
    many = [f for f in rules.judge(facts) if f.id == "cuda.multiple-toolkits"]
    assert many[0].title.startswith("4 CUDA toolkits")


def test_ld_library_path_outside_toolkits(tmp_path):
    """A lib folder is no toolkit unless the folder above looks like one; a stray libcudart is recorded."""
    _script(tmp_path / "usr" / "bin" / "nvcc", "exit 1\n")  # like /usr/local/bin/nvcc: a wrapper, not a toolkit
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    stray = tmp_path / "venv-libs"
    stray.mkdir()
    (stray / "libcudart.so.12").write_text("")
    facts = collect(tmp_path, LD_LIBRARY_PATH=f"{tmp_path / 'usr' / 'lib'}:{stray}")
    assert facts.toolkits == []
    assert [(e.var, e.index, e.toolkit, e.libcudart) for e in facts.path_entries] == [
        ("LD_LIBRARY_PATH", 1, None, ["libcudart.so.12"])]


def _debian_cuda(usr: Path, version: str = "12.0") -> Path:
    """Debian/Ubuntu's nvidia-cuda-toolkit: /usr/bin/nvcc execs /usr/lib/nvidia-cuda-toolkit/bin/nvcc (its TOP),
    the headers are in /usr/include and libcudart in /usr/lib/x86_64-linux-gnu."""
    real = usr / "lib" / "nvidia-cuda-toolkit"
    _script(real / "bin" / "nvcc", f"""case "$*" in
  *--dryrun*) echo "#\\$ TOP={real}/bin/.." >&2 ;;
  *--version*) echo "Cuda compilation tools, release {version}, V{version}.140" ;;
esac
""")
    _script(usr / "bin" / "nvcc", f'exec {real}/bin/nvcc "$@"\n')
    (usr / "include").mkdir(parents=True)
    (usr / "include" / "cuda_runtime.h").write_text("")
    (usr / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (usr / "lib" / "x86_64-linux-gnu" / "libcudart.so.12").write_text("")
    return real


def test_debian_layout_is_a_usable_cuda_home_as_usr(tmp_path, monkeypatch):
    usr = tmp_path / "usr"
    real = _debian_cuda(usr)
    cuda_torch(monkeypatch, "12.0", home_from=lambda: str(usr))
    facts = collect(tmp_path, PATH=f"{usr}/bin")
    tk = facts.toolkit(str(real))
    assert (tk.version, tk.missing) == ("12.0", ["include/cuda_runtime.h"])
    assert (tk.lib_dir, tk.libcudart) == (str(usr / "lib" / "x86_64-linux-gnu"), ["libcudart.so.12"])
    assert facts.deepspeed_cuda_home == str(usr) and facts.build_toolkit_root == str(real)
    home = facts.build_home(str(usr))
    assert (home.missing, home.include, home.toolkit_root) == ([], str(usr / "include"), str(real))
    findings = rules.judge(facts)
    assert [(f.id, f.severity) for f in findings if f.id in ("cuda.home-mismatch", "cuda.libcudart-missing")] == [
        ("cuda.home-mismatch", "ok"), ("cuda.libcudart-missing", "ok")]
    from torchdoctor.env import prebuild

    assert "export CUDA_HOME" not in prebuild.commands(facts, None)
    # CUDA_HOME at the toolkit's TOP has no include/: the fix is /usr, never a folder without headers
    facts = collect(tmp_path, PATH=f"{usr}/bin", CUDA_HOME=real)
    home = [f for f in rules.judge(facts) if f.id == "cuda.home-mismatch"]
    assert [f.severity for f in home] == ["fail"]
    assert home[0].fix == [f"export CUDA_HOME={usr}"]
    assert f"export CUDA_HOME={usr}   #" in prebuild.commands(facts, None)


def test_deepspeed_cuda_home_is_torchs_and_none_for_a_cpu_torch(tmp_path, monkeypatch):
    tk = fake_toolkit(tmp_path / "usr-local" / "cuda-12.4", "12.4")
    facts = collect(tmp_path, CUDA_HOME=tk)  # this machine's torch: a CPU build
    assert facts.torch.cuda is None and facts.torch.cuda_home is None
    assert facts.deepspeed_cuda_home is None and facts.cuda_home_for_cuda_torch == str(tk)
    assert facts.deepspeed_cuda_home_note.startswith(f"None: torch {facts.torch.version} is a CPU build, so "
                                                     "torch.utils.cpp_extension.CUDA_HOME is None")
    assert facts.deepspeed_cuda_home_note.endswith(f"a CUDA build of torch would use CUDA_HOME={tk}")
    cuda_torch(monkeypatch, "12.4", home_from=lambda: str(tk))
    facts = collect(tmp_path, CUDA_HOME=tk)
    assert facts.deepspeed_cuda_home == str(tk) and facts.deepspeed_cuda_home_note == (
        f"{tk}: torch.utils.cpp_extension.CUDA_HOME, from $CUDA_HOME")
    assert facts.build_home(str(tk)).missing == ["include/cuda_runtime.h"]  # the fake toolkit has no headers


def test_memory_comes_from_the_shared_reader(tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "read_meminfo", lambda: {"MemTotal": 32 * GIB})
    monkeypatch.setattr(probe, "cgroup_memory", lambda: (8 * GIB, 0))
    facts = collect(tmp_path)
    assert (facts.ram_gib, facts.memory_limit_gib) == (32.0, 8.0)
    monkeypatch.setattr(probe, "read_meminfo", lambda: {})
    monkeypatch.setattr(probe, "cgroup_memory", lambda: (None, None))
    assert probe.probe_memory()[0] is None and probe.probe_memory_limit() is None


def test_arch_tables_are_torchs_own_and_parse_as_torch_does():
    """The probe reads named_arches / supported_arches from the installed torch; parse_arch_list with them refuses
    exactly what torch's _get_cuda_arch_flags refuses."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    names, supported = probe.torch_arch_tables(cpp_extension)
    assert names and names[0] == ["Kepler+Tesla", "3.7"] and ["Ampere", "8.0;8.6+PTX"] in names
    assert supported and "8.6" in supported and "9.0a" in supported and "8.1" not in supported
    for value in ["8.6", "8.6;;", "8.1", "9.9+PTX", "Ampere", "9.0a", "9.0a+PTX", "10.0f", " ", "8.6 ",
                  "Ampere+Tegra;Hopper", "Kepler+Tesla", "80", "8.0 8.6+PTX", "sm_86", "12.1a"]:
        parsed = rules.parse_arch_list(value, names, supported)
        refused = bool(parsed.unknown or parsed.empty)
        old = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = value
        try:
            flags = cpp_extension._get_cuda_arch_flags()
        except ValueError:
            flags = None
        finally:
            if old is None:
                del os.environ["TORCH_CUDA_ARCH_LIST"]
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = old
        assert refused == (flags is None), (value, parsed, flags)
        if flags is not None:
            sms = sorted({f.split("code=sm_")[1] for f in flags if "code=sm_" in f})
            assert sms == sorted({f"{c[0]}{c[1]}{sfx}" for c, sfx, _ in parsed.entries}), value


def test_env_variables_recorded_and_others_not(tmp_path):
    facts = collect(tmp_path, TORCH_CUDA_ARCH_LIST="8.6", NCCL_DEBUG="INFO", DS_BUILD_OPS="0", CC="gcc",
                    SECRET_TOKEN="x", CUDA_VISIBLE_DEVICES="0,1")
    assert facts.env == {"CC": "gcc", "CUDA_VISIBLE_DEVICES": "0,1", "DS_BUILD_OPS": "0", "NCCL_DEBUG": "INFO",
                         "TORCH_CUDA_ARCH_LIST": "8.6"}


@pytest.mark.skipif(not os.path.exists("/usr/local/cuda-13.0/bin/nvcc"), reason="needs the real CUDA 13.0 toolkit")
def test_the_real_cuda_13_toolkit_on_this_machine():
    facts = probe.collect()
    tk = facts.toolkit("/usr/local/cuda-13.0")
    assert tk is not None and tk.version == "13.0" and tk.version_full.startswith("13.0.")
    assert tk.lib_dir == "/usr/local/cuda-13.0/lib64" and "libcudart.so" in tk.libcudart
    assert "/usr/local/cuda" in tk.found_via
    if shutil.which("nvcc"):
        assert facts.nvcc_on_path_root == "/usr/local/cuda-13.0"
    import torch

    assert facts.torch.version == torch.__version__ and facts.torch.cuda == torch.version.cuda
    assert facts.torch.gcc_table["13.0"] == [[6, 0, 0], [16, 0]]
    assert facts.torch.supported_arches and "9.0a" in facts.torch.supported_arches and facts.torch.arch_names
    if shutil.which("nvcc") == "/usr/local/bin/nvcc" and not os.environ.get("CUDA_HOME"):
        assert facts.cuda_home_for_cuda_torch == "/usr/local"  # the wrapper: a CUDA torch would build there
        assert "include/cuda_runtime.h" in facts.build_home("/usr/local").missing
    if facts.torch.cuda is None:
        assert facts.deepspeed_cuda_home is None and "CPU build" in facts.deepspeed_cuda_home_note
    gcc = next(c for c in facts.compilers if c.name == "gcc")
    if gcc.path:
        assert gcc.version and gcc.version[0].isdigit()
    assert facts.packages["transformers"].import_ok is True
    assert facts.cpu_count >= 1 and facts.shm_gib and facts.ram_gib

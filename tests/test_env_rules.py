"""The rules of `torchdoctor env` over fabricated machines: one or more tests per finding id and branch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torchdoctor.env import prebuild
from torchdoctor.env.facts import (
    BuildHome,
    Facts,
    Gpu,
    HostCompiler,
    PackageFacts,
    PathEntry,
    Toolkit,
    TorchFacts,
)
from torchdoctor.env.rules import (
    RULES,
    arch_list_fixed,
    build_toolkit,
    check_build_libaio_missing,
    check_build_ninja_missing,
    check_compiler_host_gcc,
    check_cuda_home_mismatch,
    check_cuda_libcudart_missing,
    check_cuda_multiple_toolkits,
    check_cuda_path_order,
    check_cuda_toolkit_missing,
    check_cuda_torch_vs_nvcc,
    check_gpu_arch_list,
    check_gpu_arch_unsupported,
    check_precision_bf16_available,
    check_system_shm_small,
    check_torch_cpu_build,
    check_torch_cuda_unavailable,
    check_torch_missing,
    check_torch_probe_error,
    deepspeed_accepts,
    judge,
    parse_arch_list,
    recommended_arch_list,
    toolkit_at,
)

# torch.utils.cpp_extension.CUDA_GCC_VERSIONS as the probe stores it (lists); no "11.8" entry, as in torch
GCC_TABLE = {"11.7": [[6, 0, 0], [12, 0]], "12.4": [[6, 0, 0], [14, 0]], "12.6": [[6, 0, 0], [14, 0]],
             "12.8": [[6, 0, 0], [15, 0]], "13.0": [[6, 0, 0], [16, 0]]}
CU124_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
A100 = ("NVIDIA A100-SXM4-80GB", "8.0")


# -- builders ----------------------------------------------------------------------------------------------
def tk(version: str | None, root: str | None = None, lib: bool = True, via: list[str] | None = None,
       lib_dir: str | None = None) -> Toolkit:
    root = root or f"/usr/local/cuda-{version}"
    major = (version or "0").split(".")[0]
    return Toolkit(root=root, found_via=via if via is not None else [root], nvcc=f"{root}/bin/nvcc", version=version,
                   version_full=f"{version}.1" if version else None,
                   lib_dir=(lib_dir or f"{root}/lib64") if lib else None,
                   libcudart=["libcudart.so", f"libcudart.so.{major}"] if lib else [])


def torch_cuda(cuda: str | None = "12.4", version: str | None = None, arch=None, home: str | None = None,
               **kw) -> TorchFacts:
    tag = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    return TorchFacts(version=version or f"2.5.1+{tag}", cuda=cuda, cuda_available=cuda is not None,
                      arch_list=list(CU124_ARCHS if arch is None else arch) if cuda else [],
                      gcc_table={k: [list(a), list(b)] for k, (a, b) in GCC_TABLE.items()}, cuda_home=home, **kw)


def gpus(*specs: tuple[str, str]) -> list[Gpu]:
    return [Gpu(i, name, cap, 80.0) for i, (name, cap) in enumerate(specs)]


def machine(torch: TorchFacts | None = None, toolkits: list[Toolkit] | None = None, home: str | None = "first",
            gpu: list[Gpu] | None = None, ds: str | None = "0.19.8", path: bool = True, **kw) -> Facts:
    """A consistent machine: the first toolkit is CUDA_HOME, nvcc on PATH, DeepSpeed's and torch's CUDA_HOME."""
    torch = torch or torch_cuda()
    toolkits = [tk("12.4", via=["CUDA_HOME", "PATH", "/usr/local/cuda-12.4"])] if toolkits is None else toolkits
    root = toolkits[0].root if toolkits and home == "first" else home
    if torch.cuda_home is None and torch.installed:
        torch.cuda_home = root
    entries = [PathEntry("PATH", 2, f"{root}/bin", root), PathEntry("LD_LIBRARY_PATH", 0, f"{root}/lib64", root)]
    f = Facts(os="Linux-6.8.0-x86_64-with-glibc2.39", python="3.12.3", torch=torch,
              packages={"deepspeed": PackageFacts("deepspeed", ds, ds is not None)},
              gpus=gpus(A100) if gpu is None else gpu, driver="570.86.15", driver_source="nvidia-smi",
              shm_gib=32.0, toolkits=toolkits,
              nvcc_on_path=f"{root}/bin/nvcc" if root else None, nvcc_on_path_root=root,
              cuda_home_env=root, deepspeed_cuda_home=root,
              path_entries=entries if root and path else [],
              host_compiler=HostCompiler("/usr/bin/gcc", "12.2.0", "PATH"), ninja="1.11.1",
              libaio="/usr/lib/x86_64-linux-gnu/libaio.so", env={"TORCH_CUDA_ARCH_LIST": "8.0"})
    for k, v in kw.items():
        setattr(f, k, v)
    return f


WRAPPER_HOME = BuildHome("/usr/local", nvcc="/usr/local/bin/nvcc", version="13.0", toolkit_root="/usr/local/cuda-13.0",
                         missing=["include/cuda_runtime.h", "libcudart.so* (lib64, lib, targets/<arch>/lib)"])


def real_machine() -> Facts:
    """The machine of the issue: /usr/local/bin/nvcc is a wrapper script for /usr/local/cuda-13.0/bin/nvcc, so a CUDA
    build of torch would take CUDA_HOME=/usr/local; torch is a CPU build (its CUDA_HOME and DeepSpeed's are None);
    no GPU, no driver."""
    cuda13 = tk("13.0", via=["PATH (/usr/local)", "/usr/local/cuda-13.0"])
    t = TorchFacts(version="2.13.0+cpu", cuda=None, gcc_table={"13.0": [[6, 0, 0], [16, 0]]}, cuda_home=None)
    return Facts(os="Linux-6.8.0-x86_64-with-glibc2.39", python="3.12.3", torch=t,
                 packages={"deepspeed": PackageFacts("deepspeed", "0.19.8", True)}, toolkits=[cuda13],
                 nvcc_on_path="/usr/local/bin/nvcc", nvcc_on_path_root="/usr/local/cuda-13.0",
                 cuda_home_for_cuda_torch="/usr/local", deepspeed_cuda_home=None,
                 build_homes=[WRAPPER_HOME, BuildHome("/usr/local/cuda-13.0", "/usr/local/cuda-13.0/bin/nvcc", "13.0",
                                                      "/usr/local/cuda-13.0", "/usr/local/cuda-13.0/include",
                                                      "/usr/local/cuda-13.0/lib64")],
                 path_entries=[PathEntry("PATH", 3, "/usr/local/bin", "/usr/local/cuda-13.0")],
                 compilers=[], host_compiler=HostCompiler("/usr/bin/gcc", "12.2.0", "PATH"),
                 ninja="1.11.1.git.kitware.jobserver-1", shm_gib=62.0)


def cuda_wrapper_machine() -> Facts:
    """The same machine with a CUDA 13.0 build of torch: torch and DeepSpeed really build with CUDA_HOME=/usr/local."""
    f = real_machine()
    f.torch = torch_cuda("13.0", version="2.13.0+cu130", home="/usr/local")
    f.deepspeed_cuda_home = "/usr/local"
    f.gpus = []
    return f


def only(findings, id_, severity=None):
    got = [f for f in findings if f.id == id_]
    assert len(got) == 1, [(f.id, f.severity) for f in findings]
    if severity is not None:
        assert got[0].severity == severity, (got[0].severity, got[0].title)
    return got[0]


def ids(findings):
    return [f.id for f in findings]


def bad(findings):
    return [(f.id, f.severity) for f in findings if f.severity in ("warn", "fail")]


# -- deepspeed_accepts -------------------------------------------------------------------------------------
def test_deepspeed_accepts_examples():
    assert deepspeed_accepts("12.4", "12.4")
    assert deepspeed_accepts("12.4", "12.6")
    assert deepspeed_accepts("12.8", "12.6")
    assert deepspeed_accepts("12.4.1", "12.9")
    assert deepspeed_accepts("11.0", "11.8")
    assert deepspeed_accepts("10.0", "10.2")
    assert deepspeed_accepts("13.0", "13.0.88")
    assert not deepspeed_accepts("12.6", "12.7")  # 12.7 is not in DeepSpeed's list
    assert not deepspeed_accepts("13.0", "13.1")  # CUDA 13 has no list
    assert not deepspeed_accepts("11.8", "12.0")
    assert not deepspeed_accepts("12.4", "nvcc?")


versions = st.builds(lambda a, b: f"{a}.{b}", st.integers(9, 14), st.integers(0, 9))


@given(versions, versions)
def test_deepspeed_accepts_properties(a, b):
    assert deepspeed_accepts(a, b) == deepspeed_accepts(b, a)
    assert deepspeed_accepts(a, a)
    if a.split(".")[0] != b.split(".")[0]:
        assert not deepspeed_accepts(a, b)
    if a.startswith("13.") and b.startswith("13.") and a != b:
        assert not deepspeed_accepts(a, b)


# -- helpers: recommended_arch_list, build_toolkit, parse_arch_list ------------------------------------------
def test_recommended_arch_list():
    assert recommended_arch_list(machine(gpu=[])) is None
    assert recommended_arch_list(machine(gpu=gpus(("RTX 3090", "8.6")))) == "8.6"
    f = machine(gpu=gpus(("RTX 3090", "8.6"), ("GTX 1080", "6.1"), ("RTX 3090", "8.6"), ("B200", "10.0")))
    assert recommended_arch_list(f) == "6.1;8.6;10.0"  # numeric order, not string order


def test_build_toolkit_prefers_deepspeed_then_torch_then_nvcc():
    a, b, c = tk("12.4"), tk("12.6"), tk("13.0")
    f = machine(toolkits=[a, b, c])
    f.deepspeed_cuda_home, f.torch.cuda_home, f.nvcc_on_path_root = b.root, c.root, a.root
    assert build_toolkit(f) is b
    f.deepspeed_cuda_home = "/nowhere"
    assert build_toolkit(f) is c
    f.torch.cuda_home = None
    assert build_toolkit(f) is a
    f.nvcc_on_path_root = None
    assert build_toolkit(f) is None
    f.build_toolkit_root = b.root  # the probe's choice, made with real paths, wins
    assert build_toolkit(f) is b


def test_toolkit_at_follows_symlink_labels_but_not_wrapper_folders():
    linked = tk("12.4", via=["/usr/local/cuda", "CUDA_HOME", "/usr/local/cuda-12.4"])
    f = machine(toolkits=[linked], cuda_home_env="/opt/cuda-link/")
    assert toolkit_at(f, "/usr/local/cuda") is linked
    assert toolkit_at(f, "/usr/local/cuda-12.4/") is linked
    assert toolkit_at(f, "/opt/cuda-link") is linked  # CUDA_HOME's real path is the root
    assert toolkit_at(f, "/usr/local") is None
    assert toolkit_at(real_machine(), "/usr/local") is None  # "PATH (/usr/local)": a wrapper, not the toolkit
    wrapped = real_machine()
    wrapped.toolkits[0].found_via = ["PATH"]  # had /usr/local/bin/nvcc been a link, /usr/local would be the root
    assert toolkit_at(wrapped, "/usr/local") is wrapped.toolkits[0]


def test_parse_arch_list():
    p = parse_arch_list("8.0;8.6+PTX 9.0a")
    assert p.entries == [((8, 0), "", False), ((8, 6), "", True), ((9, 0), "a", False)]
    assert (p.unknown, p.empty, p.auto) == ([], 0, False)
    p = parse_arch_list("Ampere;86;8.9,9.0;")
    assert [c for c, _, _ in p.entries] == [(8, 0), (8, 6)] and p.names == ["Ampere"]
    assert (p.unknown, p.empty) == (["86", "8.9,9.0"], 1)
    assert [c for c, _, _ in parse_arch_list("Kepler+Tesla").entries] == [(3, 7)]
    # torch's supported_arches: 8.1 and 9.9 do not exist, 10.0f is not in torch 2.13's list
    assert parse_arch_list("8.1;9.9+PTX;10.0f").unknown == ["8.1", "9.9+PTX", "10.0f"]
    assert parse_arch_list("").auto and parse_arch_list("native").auto
    assert parse_arch_list(" ").empty == 2  # torch splits it into two empty entries (and raises)
    # a torch with other tables: they are used instead of the fallback copies
    p = parse_arch_list("Rubin;10.0f", names=[["Rubin", "11.0"]], supported=["11.0", "10.0f"])
    assert p.entries == [((11, 0), "", False), ((10, 0), "f", False)] and p.unknown == []


# -- judge -------------------------------------------------------------------------------------------------
def test_healthy_machine_has_no_warning():
    f = machine()
    findings = judge(f)
    assert bad(findings) == []
    assert judge(f) == findings  # stable
    for id_ in ("cuda.torch-vs-nvcc", "cuda.home-mismatch", "cuda.libcudart-missing", "compiler.host-gcc",
                "gpu.arch-unsupported", "cuda.path-order", "gpu.arch-list", "build.ninja-missing",
                "system.shm-small"):
        only(findings, id_, "ok")
    only(findings, "precision.bf16-available", "info")
    assert "build.libaio-missing" not in ids(findings)
    only(judge(f, nvme_offload=True), "build.libaio-missing", "ok")


def test_judge_order_is_the_rules_order_most_important_first():
    f = machine(torch=TorchFacts(installed=False, error="ModuleNotFoundError: No module named 'torch'"))
    findings = judge(f)
    assert findings[0].id == "torch.missing"
    names = [r.__name__.removeprefix("check_") for r in RULES]
    seen = [i.replace(".", "_").replace("-", "_") for i in dict.fromkeys(ids(judge(machine(), nvme_offload=True)))]
    assert seen == [n for n in names if n in seen]


def test_real_machine_wrapper_nvcc():
    """A CPU torch: torch's CUDA_HOME is None, DeepSpeed cannot build CUDA ops; the wrapper that a CUDA build of
    torch would take as CUDA_HOME is a warning, not a failure."""
    f = real_machine()
    findings = judge(f)
    home = only(findings, "cuda.home-mismatch", "warn")
    assert home.title == ("a CUDA build of torch would use CUDA_HOME=/usr/local, which is not a CUDA toolkit (no "
                          "include/cuda_runtime.h, no libcudart.so*); torch is not a CUDA build now, so DeepSpeed "
                          "cannot build CUDA ops anyway")
    assert home.fix == ["export CUDA_HOME=/usr/local/cuda-13.0"]
    assert home.evidence[0].startswith("torch 2.13.0+cpu is a CPU build: torch.utils.cpp_extension.CUDA_HOME is None")
    assert any("/usr/local/bin/nvcc" in e and "wrapper" in e for e in home.evidence)
    assert any(e.startswith("a CUDA build of torch (and DeepSpeed with it) would build with CUDA_HOME=/usr/local ")
               for e in home.evidence)
    assert home.data["bad"] == {"a CUDA build of torch (and DeepSpeed with it)": "/usr/local"}
    assert home.data["torch_cuda_build"] is False
    assert "torch.cpu-build" not in ids(findings)  # no GPU, no driver: a CPU build is right here
    only(findings, "cuda.torch-vs-nvcc", "skip")
    gcc = only(findings, "compiler.host-gcc", "ok")
    assert "12.2.0" in gcc.title and "13.0" in gcc.title
    only(findings, "cuda.libcudart-missing", "ok")
    assert "gpu.arch-unsupported" in ids(findings) and "precision.bf16-available" not in ids(findings)
    assert bad(findings) == [("cuda.home-mismatch", "warn")]
    assert not any(x.severity == "fail" for x in findings)  # `torchdoctor env` exits 0 here
    f.build_homes = [WRAPPER_HOME, BuildHome("/usr/local/cuda-13.0")]  # a usable home is ok for a CPU torch too
    f.cuda_home_for_cuda_torch = f.cuda_home_env = "/usr/local/cuda-13.0"
    ok = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "ok")
    assert "a CUDA build of torch would use CUDA_HOME=/usr/local/cuda-13.0, a CUDA toolkit" in ok.title


def test_wrapper_nvcc_with_a_cuda_torch_fails():
    f = cuda_wrapper_machine()
    home = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "fail")
    assert home.title == ("extension builds would use CUDA_HOME=/usr/local, which is not a CUDA toolkit (no "
                          "include/cuda_runtime.h, no libcudart.so*)")
    assert home.fix == ["export CUDA_HOME=/usr/local/cuda-13.0"]
    assert home.data["bad"] == {"DeepSpeed": "/usr/local", "torch.utils.cpp_extension": "/usr/local"}
    assert any("DeepSpeed builds with CUDA_HOME=/usr/local" in e and "lacks include/cuda_runtime.h" in e
               for e in home.evidence)
    assert build_toolkit(f).root == "/usr/local/cuda-13.0"  # the wrapper runs that nvcc
    lines = prebuild.commands(f, None).splitlines()
    assert "export CUDA_HOME=/usr/local/cuda-13.0   # CUDA_HOME=/usr/local is not a CUDA toolkit (`torchdoctor env`)" \
        in lines


def debian_machine(cuda_home: str | None = None) -> Facts:
    """Debian/Ubuntu's nvidia-cuda-toolkit: /usr/bin/nvcc runs /usr/lib/nvidia-cuda-toolkit (no include/ there),
    headers in /usr/include, libcudart in /usr/lib/x86_64-linux-gnu: CUDA_HOME=/usr works."""
    top = "/usr/lib/nvidia-cuda-toolkit"
    deb = Toolkit(top, ["PATH (/usr)"], f"{top}/bin/nvcc", "12.0", "12.0.140", "/usr/lib/x86_64-linux-gnu",
                  ["libcudart.so.12"], missing=["include/cuda_runtime.h"])
    home = cuda_home or "/usr"
    homes = [BuildHome("/usr", "/usr/bin/nvcc", "12.0", top, "/usr/include", "/usr/lib/x86_64-linux-gnu")]
    if cuda_home:
        homes.append(BuildHome(cuda_home, f"{cuda_home}/bin/nvcc", "12.0", top, None, "/usr/lib/x86_64-linux-gnu",
                               ["include/cuda_runtime.h"]))
    return machine(torch=torch_cuda("12.0", home=home), toolkits=[deb], home=home, nvcc_on_path="/usr/bin/nvcc",
                   nvcc_on_path_root=top, cuda_home_env=cuda_home, cuda_home_for_cuda_torch=home,
                   build_homes=homes, path_entries=[PathEntry("PATH", 1, "/usr/bin", top)])


def test_debian_layout_cuda_home_is_usr_never_the_toolkit_top():
    f = debian_machine()
    ok = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "ok")
    assert "CUDA_HOME=/usr, a CUDA toolkit" in ok.title
    assert any("headers in /usr/include" in e for e in ok.evidence)
    assert bad(judge(f)) == []
    assert "export CUDA_HOME" not in prebuild.commands(f, None)
    f = debian_machine(cuda_home="/usr/lib/nvidia-cuda-toolkit")
    x = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "fail")
    assert x.fix == ["export CUDA_HOME=/usr"]
    assert x.title.endswith("CUDA_HOME=/usr/lib/nvidia-cuda-toolkit, which is not a CUDA toolkit (no "
                            "include/cuda_runtime.h)")
    # CUDA_HOME at another toolkit (12.4) while the Debian one matches torch's 12.0: its exports say /usr
    f = debian_machine(cuda_home="/usr/local/cuda-12.4")
    f.toolkits.append(tk("12.4"))
    f.build_homes[1] = BuildHome("/usr/local/cuda-12.4", toolkit_root="/usr/local/cuda-12.4")
    f.deepspeed_cuda_home = f.torch.cuda_home = "/usr/local/cuda-12.4"
    x = only(check_cuda_torch_vs_nvcc(f), "cuda.torch-vs-nvcc", "warn")
    assert x.fix[:3] == ["export CUDA_HOME=/usr", "export PATH=/usr/bin:$PATH",
                         "export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"]
    w = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "warn")  # CUDA_HOME vs `nvcc` on PATH
    assert w.fix == ["export CUDA_HOME=/usr", "export PATH=/usr/bin:$PATH"]
    f = debian_machine(cuda_home="/usr/lib/nvidia-cuda-toolkit")
    f.build_homes = f.build_homes[1:]  # /usr not probed: no usable home to recommend, so install one
    x = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "fail")
    assert x.fix[0].startswith("conda install -c nvidia cuda-toolkit=12.0")
    assert "export CUDA_HOME=/usr/lib/nvidia-cuda-toolkit" not in x.fix


def test_warn_and_fail_findings_carry_fixes_and_data():
    scenarios = [real_machine(), cuda_wrapper_machine(), debian_machine("/usr/lib/nvidia-cuda-toolkit"),
                 machine(torch=torch_cuda(None)), machine(toolkits=[tk("13.0")]),
                 machine(toolkits=[tk("12.4", lib=False)], shm_gib=0.06, ninja=None, libaio=None),
                 machine(host_compiler=HostCompiler("/usr/bin/gcc", "14.2.0", "PATH"),
                         gpu=gpus(("Tesla P100", "6.0")), torch=torch_cuda("12.8", arch=["sm_75", "sm_80"]),
                         toolkits=[tk("12.8")])]
    for f in scenarios:
        for finding in judge(f, nvme_offload=True):
            if finding.severity in ("warn", "fail"):
                assert finding.fix and finding.data, finding


# -- torch -------------------------------------------------------------------------------------------------
def test_torch_missing():
    f = machine(torch=TorchFacts(installed=False, error="ModuleNotFoundError: No module named 'torch'"))
    m = only(check_torch_missing(f), "torch.missing", "fail")
    assert m.title == "torch is not installed in this Python"
    assert m.fix[0].startswith("pip install torch --index-url https://download.pytorch.org/whl/cu124")
    assert check_torch_missing(machine()) == []
    f.torch.error = "ImportError: libcudnn.so.9: cannot open shared object file"
    assert "cannot be imported: ImportError: libcudnn.so.9" in check_torch_missing(f)[0].title
    f = machine(torch=TorchFacts(installed=False), toolkits=[], home=None, gpu=[], driver=None)
    assert check_torch_missing(f)[0].fix[0].startswith("pip install torch --index-url https://download.pytorch."
                                                       "org/whl/cpu")
    # a CUDA build of torch-less judge: no crash in any rule
    assert judge(f)[0].id == "torch.missing"


def test_torch_probe_error():
    assert check_torch_probe_error(machine()) == []
    f = machine(torch=torch_cuda(error="torch.cuda: CUDA driver initialization failed"))
    e = only(check_torch_probe_error(f), "torch.probe-error", "warn")
    assert "CUDA driver initialization failed" in e.title


def test_torch_cpu_build_on_gpu_machine():
    f = machine(torch=torch_cuda(None, version="2.5.1+cpu"), toolkits=[tk("13.0")])
    c = only(check_torch_cpu_build(f), "torch.cpu-build", "fail")
    assert "2.5.1+cpu" in c.title and "CPU-only" in c.title
    assert c.fix[0].startswith("pip install --force-reinstall torch==2.5.1 --index-url "
                               "https://download.pytorch.org/whl/cu130")
    assert c.data["toolkit"] == "13.0"


def test_torch_cpu_build_driver_only_without_toolkit():
    f = machine(torch=torch_cuda(None, version="2.5.1+cpu"), toolkits=[], home=None, gpu=[])
    c = only(check_torch_cpu_build(f), "torch.cpu-build", "fail")
    assert any("driver 570.86.15" in e for e in c.evidence)
    assert "whl/cu<XY>" in c.fix[0] and "CUDA Version" in c.fix[0] and "torch==2.5.1 " in c.fix[0]


def test_torch_cpu_build_not_reported_without_gpu_or_for_rocm():
    assert check_torch_cpu_build(machine(torch=torch_cuda(None), gpu=[], driver=None)) == []
    assert check_torch_cpu_build(machine(torch=torch_cuda(None, hip="6.2.41133"))) == []
    assert check_torch_cpu_build(machine()) == []


def test_torch_cuda_unavailable():
    f = machine(torch=torch_cuda(), env={"CUDA_VISIBLE_DEVICES": ""})
    f.torch.cuda_available = False
    u = only(check_torch_cuda_unavailable(f), "torch.cuda-unavailable", "warn")
    assert "CUDA 12.4 build" in u.title
    assert u.fix[0] == "unset CUDA_VISIBLE_DEVICES   # it hides every GPU"
    f.env = {}
    assert "unset" not in check_torch_cuda_unavailable(f)[0].fix[0]
    assert check_torch_cuda_unavailable(machine()) == []
    f.gpus, f.driver = [], None
    assert check_torch_cuda_unavailable(f) == []


# -- cuda.toolkit-missing ----------------------------------------------------------------------------------
def test_toolkit_missing_warns_with_deepspeed():
    f = machine(toolkits=[], home=None)
    m = only(check_cuda_toolkit_missing(f), "cuda.toolkit-missing", "warn")
    assert "CUDA 12.4" in m.title
    assert m.fix[0].startswith("conda install -c nvidia cuda-toolkit=12.4")
    assert "export CUDA_HOME=/usr/local/cuda-12.4" in m.fix
    assert "export LD_LIBRARY_PATH=/usr/local/cuda-12.4/lib64:$LD_LIBRARY_PATH" in m.fix


def test_toolkit_missing_is_info_without_deepspeed_and_absent_otherwise():
    only(check_cuda_toolkit_missing(machine(toolkits=[], home=None, ds=None)), "cuda.toolkit-missing", "info")
    assert check_cuda_toolkit_missing(machine()) == []
    assert check_cuda_toolkit_missing(machine(torch=torch_cuda(None), toolkits=[], home=None)) == []


# -- cuda.torch-vs-nvcc ------------------------------------------------------------------------------------
def test_torch_vs_nvcc_ok():
    ok = only(check_cuda_torch_vs_nvcc(machine()), "cuda.torch-vs-nvcc", "ok")
    assert ok.data == {"torch_cuda": "12.4", "nvcc": "12.4", "root": "/usr/local/cuda-12.4"}


def test_torch_vs_nvcc_minor_mismatch_deepspeed_accepts():
    f = machine(torch=torch_cuda("12.4"), toolkits=[tk("12.6")])
    w = only(check_cuda_torch_vs_nvcc(f), "cuda.torch-vs-nvcc", "warn")
    assert "DeepSpeed accepts it" in w.title and "torch.utils.cpp_extension warns" in w.title
    assert w.fix[0].startswith("conda install -c nvidia cuda-toolkit=12.4")
    assert ("or install torch built for CUDA 12.6: pip install --force-reinstall torch==2.5.1 --index-url "
            "https://download.pytorch.org/whl/cu126") in w.fix
    assert not any("DS_SKIP_CUDA_CHECK" in x for x in w.fix)


def test_torch_vs_nvcc_cuda13_minor_mismatch_refused():
    f = machine(torch=torch_cuda("13.0"), toolkits=[tk("13.1")])
    x = only(check_cuda_torch_vs_nvcc(f), "cuda.torch-vs-nvcc", "fail")
    assert "DeepSpeed's op builder refuses it" in x.title and "CUDA 13 has none" in x.title
    assert any("CUDA 13 has no such list" in e for e in x.evidence)
    assert any("Installed CUDA version 13.1 does not match the version torch was compiled with 13.0" in e
               for e in x.evidence)
    assert "refuses a different major" not in x.title
    assert x.fix[-1].startswith("last resort: export DS_SKIP_CUDA_CHECK=1") and "risk" in x.fix[-1]
    assert x.data["deepspeed_accepts"] is False


def test_torch_vs_nvcc_major_mismatch_points_at_matching_toolkit():
    f = machine(torch=torch_cuda("12.4"), toolkits=[tk("13.0"), tk("12.4")])
    x = only(check_cuda_torch_vs_nvcc(f), "cuda.torch-vs-nvcc", "fail")
    assert "refuses a different major version too" in x.title
    assert x.fix[:3] == ["export CUDA_HOME=/usr/local/cuda-12.4", "export PATH=/usr/local/cuda-12.4/bin:$PATH",
                         "export LD_LIBRARY_PATH=/usr/local/cuda-12.4/lib64:$LD_LIBRARY_PATH"]
    assert not any("DS_SKIP_CUDA_CHECK" in fx for fx in x.fix)  # torch refuses anyway


def test_torch_vs_nvcc_ds_skip_cuda_check_is_named_but_mismatch_still_reported():
    f = machine(torch=torch_cuda("13.0"), toolkits=[tk("13.1")], env={"DS_SKIP_CUDA_CHECK": "1"})
    x = only(check_cuda_torch_vs_nvcc(f), "cuda.torch-vs-nvcc", "warn")
    assert "DS_SKIP_CUDA_CHECK=1 is set" in x.title and "differs from torch's CUDA 13.0" in x.title
    assert x.data["ds_skip_cuda_check"] is True
    f = machine(torch=torch_cuda("12.4"), toolkits=[tk("13.0")], env={"DS_SKIP_CUDA_CHECK": "1"})
    only(check_cuda_torch_vs_nvcc(f), "cuda.torch-vs-nvcc", "fail")  # torch refuses a major mismatch itself


def test_torch_vs_nvcc_skips():
    assert "not a CUDA build" in only(check_cuda_torch_vs_nvcc(machine(torch=torch_cuda(None))),
                                      "cuda.torch-vs-nvcc", "skip").title
    assert "no toolkit" in only(check_cuda_torch_vs_nvcc(machine(toolkits=[], home=None)),
                                "cuda.torch-vs-nvcc", "skip").title
    broken = tk(None, root="/opt/cuda")
    broken.error = "nvcc timed out"
    s = only(check_cuda_torch_vs_nvcc(machine(toolkits=[broken])), "cuda.torch-vs-nvcc", "skip")
    assert "unknown" in s.title and "nvcc timed out" in s.evidence[0]
    assert "unreadable" in only(check_cuda_torch_vs_nvcc(machine(torch=torch_cuda("git"))), "cuda.torch-vs-nvcc",
                                "skip").title


# -- cuda.multiple-toolkits --------------------------------------------------------------------------------
def test_multiple_toolkits():
    assert check_cuda_multiple_toolkits(machine()) == []
    f = machine(toolkits=[tk("12.4", via=["CUDA_HOME"]), tk("12.8", via=["/usr/local/cuda-12.8", "conda"])])
    i = only(check_cuda_multiple_toolkits(f), "cuda.multiple-toolkits", "info")
    assert i.evidence == ["/usr/local/cuda-12.4: CUDA 12.4 (found via CUDA_HOME)  <- extension builds use this one",
                          "/usr/local/cuda-12.8: CUDA 12.8 (found via /usr/local/cuda-12.8, conda)"]
    assert [t["root"] for t in i.data["toolkits"]] == ["/usr/local/cuda-12.4", "/usr/local/cuda-12.8"]


def test_multiple_toolkits_warns_when_builds_use_the_wrong_one():
    f = machine(toolkits=[tk("12.8"), tk("12.4")])
    w = only(check_cuda_multiple_toolkits(f), "cuda.multiple-toolkits", "warn")
    assert "builds use /usr/local/cuda-12.8 (CUDA 12.8)" in w.title and "/usr/local/cuda-12.4 (CUDA 12.4)" in w.title
    assert w.fix[0] == "export CUDA_HOME=/usr/local/cuda-12.4"


# -- cuda.path-order ---------------------------------------------------------------------------------------
def test_path_order_ok_and_absent():
    ok = only(check_cuda_path_order(machine()), "cuda.path-order", "ok")
    assert ok.title == "PATH and LD_LIBRARY_PATH agree on /usr/local/cuda-12.4"
    ok = only(check_cuda_path_order(real_machine()), "cuda.path-order", "ok")
    assert ok.title == "PATH reaches /usr/local/cuda-13.0 first (LD_LIBRARY_PATH reaches no toolkit)"
    assert check_cuda_path_order(machine(path=False)) == []


def test_path_order_different_toolkits():
    a, b = tk("12.4"), tk("12.8")
    f = machine(torch=torch_cuda(None), toolkits=[a, b])
    f.path_entries = [PathEntry("PATH", 5, f"{b.root}/bin", b.root), PathEntry("PATH", 1, f"{a.root}/bin", a.root),
                      PathEntry("LD_LIBRARY_PATH", 0, f"{b.root}/lib64", b.root)]
    w = only(check_cuda_path_order(f), "cuda.path-order", "warn")
    assert "PATH runs nvcc from /usr/local/cuda-12.4, LD_LIBRARY_PATH loads CUDA libraries from " \
           "/usr/local/cuda-12.8" in w.title
    assert w.fix == ["export PATH=/usr/local/cuda-12.4/bin:$PATH",
                     "export LD_LIBRARY_PATH=/usr/local/cuda-12.4/lib64:$LD_LIBRARY_PATH"]


def test_path_order_wrong_version_while_a_match_exists():
    good = tk("12.4", root="/opt/cuda-12.4", lib_dir="/opt/cuda-12.4/targets/x86_64-linux/lib")
    other = tk("12.8")
    f = machine(toolkits=[other, good])
    w = only(check_cuda_path_order(f), "cuda.path-order", "warn")
    assert "PATH and LD_LIBRARY_PATH reach CUDA 12.8 first, while /opt/cuda-12.4 (CUDA 12.4) matches" in w.title
    assert w.fix == ["export PATH=/opt/cuda-12.4/bin:$PATH",
                     "export LD_LIBRARY_PATH=/opt/cuda-12.4/targets/x86_64-linux/lib:$LD_LIBRARY_PATH"]
    assert w.data["match"] == "/opt/cuda-12.4"
    f.path_entries[0] = PathEntry("PATH", 0, "/opt/cuda-12.4/bin", good.root)
    w = only(check_cuda_path_order(f), "cuda.path-order", "warn")
    assert w.title == ("PATH / LD_LIBRARY_PATH order: PATH runs nvcc from /opt/cuda-12.4, LD_LIBRARY_PATH loads CUDA "
                       "libraries from /usr/local/cuda-12.8; LD_LIBRARY_PATH reaches CUDA 12.8 first, while "
                       "/opt/cuda-12.4 (CUDA 12.4) matches torch's CUDA 12.4")


def test_path_order_names_a_stray_libcudart_the_loader_finds_first():
    f = machine(toolkits=[tk("12.4"), tk("12.1")])
    root = "/usr/local/cuda-12.4"
    f.path_entries = [PathEntry("PATH", 0, f"{root}/bin", root),
                      PathEntry("LD_LIBRARY_PATH", 0, "/opt/libs", None, ["libcudart.so.12"]),
                      PathEntry("LD_LIBRARY_PATH", 1, "/usr/local/cuda-12.1/lib64", "/usr/local/cuda-12.1")]
    w = only(check_cuda_path_order(f), "cuda.path-order", "warn")
    assert "LD_LIBRARY_PATH loads CUDA libraries from /usr/local/cuda-12.1" in w.title
    assert w.evidence[-1] == ("LD_LIBRARY_PATH[0] = /opt/libs holds libcudart.so.12 outside any toolkit found: the "
                              "loader looks there first")


# -- cuda.home-mismatch ------------------------------------------------------------------------------------
def test_home_mismatch_ok():
    ok = only(check_cuda_home_mismatch(machine()), "cuda.home-mismatch", "ok")
    assert "CUDA_HOME=/usr/local/cuda-12.4" in ok.title
    # a symlinked /usr/local/cuda is the toolkit
    f = machine(toolkits=[tk("12.4", via=["/usr/local/cuda", "/usr/local/cuda-12.4"])], home="/usr/local/cuda")
    f.nvcc_on_path_root = "/usr/local/cuda-12.4"
    only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "ok")
    assert check_cuda_home_mismatch(machine(toolkits=[], home=None)) == []


def test_home_mismatch_cuda_home_and_nvcc_differ():
    a, b = tk("12.4"), tk("12.8")
    f = machine(toolkits=[a, b])
    f.nvcc_on_path, f.nvcc_on_path_root = f"{b.root}/bin/nvcc", b.root
    w = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "warn")
    assert "CUDA_HOME (/usr/local/cuda-12.4) and `nvcc` on PATH (/usr/local/cuda-12.8)" in w.title
    assert w.fix == ["export CUDA_HOME=/usr/local/cuda-12.4", "export PATH=/usr/local/cuda-12.4/bin:$PATH"]


def test_home_mismatch_cuda_home_not_a_toolkit_is_one_fail():
    f = machine(toolkits=[tk("12.4")])
    f.cuda_home_env = f.deepspeed_cuda_home = f.torch.cuda_home = "/usr/local/cuda-11.8"  # removed long ago
    findings = check_cuda_home_mismatch(f)
    x = only(findings, "cuda.home-mismatch", "fail")
    assert "(from $CUDA_HOME)" in x.evidence[0]
    assert x.fix == ["export CUDA_HOME=/usr/local/cuda-12.4"]


def test_home_mismatch_fix_prefers_toolkit_matching_torch():
    f = real_machine()
    f.torch = torch_cuda("12.8", home="/usr/local")
    f.toolkits.append(tk("12.8"))
    x = only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "fail")
    assert x.fix == ["export CUDA_HOME=/usr/local/cuda-12.8", "export PATH=/usr/local/cuda-12.8/bin:$PATH"]


# -- cuda.libcudart-missing --------------------------------------------------------------------------------
def test_libcudart_missing_build_toolkit_fails():
    f = machine(toolkits=[tk("12.4", lib=False)])
    x = only(check_cuda_libcudart_missing(f), "cuda.libcudart-missing", "fail")
    only(check_cuda_home_mismatch(f), "cuda.home-mismatch", "ok")  # said once, here
    assert x.title == "CUDA toolkit /usr/local/cuda-12.4 has no libcudart"
    assert x.evidence[1] == "lib_dir: none found"
    assert x.fix[:3] == [
        "ls /usr/local/cuda-12.4/lib64 /usr/local/cuda-12.4/targets/x86_64-linux/lib",
        "if libcudart.so sits in /usr/local/cuda-12.4/targets/x86_64-linux/lib: sudo ln -s "
        "/usr/local/cuda-12.4/targets/x86_64-linux/lib /usr/local/cuda-12.4/lib64",
        "export LD_LIBRARY_PATH=/usr/local/cuda-12.4/lib64:$LD_LIBRARY_PATH"]


def test_libcudart_missing_other_toolkit_warns_and_arm_target():
    f = machine(toolkits=[tk("12.4"), tk("12.8", lib=False)], os="Linux-6.8.0-aarch64-with-glibc2.39")
    w = only(check_cuda_libcudart_missing(f), "cuda.libcudart-missing", "warn")
    assert w.fix[0] == "ls /usr/local/cuda-12.8/lib64 /usr/local/cuda-12.8/targets/sbsa-linux/lib"
    only(check_cuda_libcudart_missing(machine()), "cuda.libcudart-missing", "ok")
    assert check_cuda_libcudart_missing(machine(toolkits=[], home=None)) == []


# -- compiler.host-gcc -------------------------------------------------------------------------------------
def test_host_gcc_ok_says_why():
    ok = only(check_compiler_host_gcc(machine()), "compiler.host-gcc", "ok")
    assert "gcc 12.2.0" in ok.title and ">=6.0.0, <14.0" in ok.title
    assert ok.evidence[0] == ("/usr/bin/gcc (12.2.0), chosen by nvcc from: PATH (no -ccbin, NVCC_CCBIN or "
                              "<toolkit>/bin/gcc)")
    assert ok.data["min"] == [6, 0, 0] and ok.data["max"] == [14, 0]


def test_host_gcc_bounds_are_min_inclusive_max_exclusive():
    for version, sev in [("6.0.0", "ok"), ("5.4.0", "fail"), ("15.2.1", "ok"), ("16.0.0", "fail"), ("16", "fail")]:
        f = machine(toolkits=[tk("13.0")], torch=torch_cuda("13.0"),
                    host_compiler=HostCompiler("/usr/bin/gcc", version, "PATH"))
        only(check_compiler_host_gcc(f), "compiler.host-gcc", sev)


def test_host_gcc_too_new():
    f = machine(host_compiler=HostCompiler("/usr/bin/gcc", "14.2.0", "PATH"))
    x = only(check_compiler_host_gcc(f), "compiler.host-gcc", "fail")
    assert "gcc 14.2.0 is newer than CUDA 12.4 accepts (>=6.0.0, <14.0)" in x.title
    assert x.fix == ["sudo apt install gcc-13 g++-13",
                     "sudo ln -s /usr/bin/gcc-13 /usr/local/cuda-12.4/bin/gcc",
                     "sudo ln -s /usr/bin/g++-13 /usr/local/cuda-12.4/bin/g++",
                     "or: export CC=/usr/bin/gcc-13 CXX=/usr/bin/g++-13   # torch passes CC to nvcc as -ccbin"]


def test_host_gcc_too_old_from_toolkit_link():
    f = machine(host_compiler=HostCompiler("/usr/local/cuda-12.4/bin/gcc", "5.4.0", "toolkit bin/gcc"))
    x = only(check_compiler_host_gcc(f), "compiler.host-gcc", "fail")
    assert "older than CUDA 12.4" in x.title
    assert x.fix == ["sudo apt install gcc-13 g++-13",
                     "sudo ln -sf /usr/bin/gcc-13 /usr/local/cuda-12.4/bin/gcc",  # replace the existing link
                     "sudo ln -sf /usr/bin/g++-13 /usr/local/cuda-12.4/bin/g++",
                     "or: export CC=/usr/bin/gcc-13 CXX=/usr/bin/g++-13   # torch passes CC to nvcc as -ccbin"]
    assert "nvcc puts its own bin folder first on PATH" in x.evidence[0]


def test_host_gcc_fix_matches_the_source_that_wins():
    """Only a fix that wins in nvcc's order: a link in the toolkit does nothing while CC or NVCC_CCBIN pick gcc."""
    def fix(source: str) -> list[str]:
        f = machine(host_compiler=HostCompiler("/usr/bin/gcc-14", "14.1.0", source, ["PATH: /usr/bin/gcc"]))
        x = only(check_compiler_host_gcc(f), "compiler.host-gcc", "fail")
        assert x.fix[0] == "sudo apt install gcc-13 g++-13" and x.data["source"] == source
        assert x.evidence[2] == "also present, but lower in nvcc's order: PATH: /usr/bin/gcc"
        return x.fix[1:]

    assert fix("CC") == ["export CC=/usr/bin/gcc-13 CXX=/usr/bin/g++-13   # torch passes CC to nvcc as -ccbin"]
    assert fix("NVCC_CCBIN") == ["export NVCC_CCBIN=/usr/bin/gcc-13", "or: export CC=/usr/bin/gcc-13 "
                                 "CXX=/usr/bin/g++-13   # torch passes CC to nvcc as -ccbin, which beats NVCC_CCBIN"]
    assert fix("-ccbin in NVCC_PREPEND_FLAGS")[0] == "change -ccbin in NVCC_PREPEND_FLAGS to -ccbin /usr/bin/gcc-13"
    assert fix("-ccbin in NVCC_APPEND_FLAGS") == [
        "change -ccbin in NVCC_APPEND_FLAGS to -ccbin /usr/bin/gcc-13   # it wins over CC and NVCC_CCBIN"]
    assert fix("PATH") == ["sudo ln -s /usr/bin/gcc-13 /usr/local/cuda-12.4/bin/gcc",
                           "sudo ln -s /usr/bin/g++-13 /usr/local/cuda-12.4/bin/g++",
                           "or: export CC=/usr/bin/gcc-13 CXX=/usr/bin/g++-13   # torch passes CC to nvcc as -ccbin"]
    for source in ("CC", "NVCC_CCBIN", "-ccbin in NVCC_PREPEND_FLAGS", "-ccbin in NVCC_APPEND_FLAGS"):
        assert not any("ln -s" in x for x in fix(source)), source


def test_host_gcc_info_and_skip_and_missing():
    f = machine(toolkits=[tk("11.8")], torch=torch_cuda("11.8"))
    assert "no entry for CUDA 11.8" in only(check_compiler_host_gcc(f), "compiler.host-gcc", "info").title
    f = machine(host_compiler=HostCompiler("/usr/bin/clang", "18.1.3", "CC"))
    assert "clang" in only(check_compiler_host_gcc(f), "compiler.host-gcc", "info").title
    f = machine(host_compiler=HostCompiler("/usr/bin/gcc", None, "PATH"))
    assert "version is unknown" in only(check_compiler_host_gcc(f), "compiler.host-gcc", "info").title
    only(check_compiler_host_gcc(machine(toolkits=[], home=None)), "compiler.host-gcc", "skip")
    x = only(check_compiler_host_gcc(machine(host_compiler=None)), "compiler.host-gcc", "fail")
    assert "nvcc needs a host compiler" in x.title
    assert x.fix[0].startswith("sudo apt install build-essential")
    only(check_compiler_host_gcc(machine(host_compiler=None, toolkits=[], home=None)), "compiler.host-gcc", "info")


# -- gpu.arch-unsupported ----------------------------------------------------------------------------------
def test_arch_ok_exact_and_binary_compatible():
    ok = only(check_gpu_arch_unsupported(machine()), "gpu.arch-unsupported", "ok")
    assert "(sm_80): sm_80" in ok.title
    f = machine(gpu=gpus(("NVIDIA GeForce RTX 4090", "8.9"), ("NVIDIA GeForce RTX 4090", "8.9")))
    ok = only(check_gpu_arch_unsupported(f), "gpu.arch-unsupported", "ok")  # one finding per capability
    assert "sm_86 (binary-compatible within major 8)" in ok.title
    assert ok.data["gpus"] == [0, 1]
    f = machine(gpu=gpus(("NVIDIA H100", "9.0")), torch=torch_cuda(arch=["sm_80", "sm_90a"]))
    only(check_gpu_arch_unsupported(f), "gpu.arch-unsupported", "ok")


def test_arch_ptx_only_warns():
    f = machine(gpu=gpus(("NVIDIA B200", "10.0")), torch=torch_cuda(arch=["sm_80", "sm_90a", "compute_90"]))
    w = only(check_gpu_arch_unsupported(f), "gpu.arch-unsupported", "warn")
    assert "no sm_100 kernels" in w.title and "PTX JIT (compute_90)" in w.title
    assert "whl/cu130" in w.fix[0]
    f.torch.arch_list = ["sm_80", "compute_90a"]  # arch-specific PTX runs on 9.0 only
    only(check_gpu_arch_unsupported(f), "gpu.arch-unsupported", "fail")


def test_arch_unsupported_fails():
    old = machine(gpu=gpus(("Tesla P100-PCIE-16GB", "6.0")),
                  torch=torch_cuda("12.8", arch=["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]))
    x = only(check_gpu_arch_unsupported(old), "gpu.arch-unsupported", "fail")
    assert "torch 2.5.1+cu128 does not support Tesla P100-PCIE-16GB (sm_60)" in x.title
    assert "sm_75 sm_80" in x.title
    assert "whl/cu126" in x.fix[0] and "older CUDA" in x.fix[0]
    new = machine(gpu=gpus(("NVIDIA RTX PRO 6000", "12.0")))
    x = only(check_gpu_arch_unsupported(new), "gpu.arch-unsupported", "fail")
    assert "whl/cu130" in x.fix[0] and "newer CUDA" in x.fix[0]
    # SASS of a newer minor does not run on an older minor, although torch's own check lets it pass
    f = machine(torch=torch_cuda(arch=["sm_86"]))
    x = only(check_gpu_arch_unsupported(f), "gpu.arch-unsupported", "fail")
    assert any("torch's own check passes" in e for e in x.evidence)


def test_arch_unsupported_skips():
    assert "not a CUDA build" in only(check_gpu_arch_unsupported(machine(torch=torch_cuda(None))),
                                      "gpu.arch-unsupported", "skip").title
    assert "no GPU" in only(check_gpu_arch_unsupported(machine(gpu=[])), "gpu.arch-unsupported", "skip").title
    assert "no arch list" in only(check_gpu_arch_unsupported(machine(torch=torch_cuda(arch=[]))),
                                  "gpu.arch-unsupported", "skip").title


# -- gpu.arch-list -----------------------------------------------------------------------------------------
def test_arch_list_unset():
    f = machine(gpu=gpus(("RTX 3090", "8.6"), ("GTX 1080 Ti", "6.1")), env={})
    i = only(check_gpu_arch_list(f), "gpu.arch-list", "info")
    assert i.fix == ['export TORCH_CUDA_ARCH_LIST="6.1;8.6"']
    i = only(check_gpu_arch_list(machine(gpu=[], env={})), "gpu.arch-list", "info")
    assert "no GPU is visible" in i.title
    assert "nvidia-smi --query-gpu=compute_cap --format=csv" in i.fix[0]


def test_arch_list_set_ok():
    f = machine(gpu=gpus(("RTX 3090", "8.6")), env={"TORCH_CUDA_ARCH_LIST": "8.0 8.6+PTX"})
    only(check_gpu_arch_list(f), "gpu.arch-list", "ok")
    f = machine(gpu=gpus(("RTX 3090", "8.6")), env={"TORCH_CUDA_ARCH_LIST": "Ampere"}, ds=None)
    only(check_gpu_arch_list(f), "gpu.arch-list", "ok")  # torch expands names
    i = only(check_gpu_arch_list(machine(gpu=[], env={"TORCH_CUDA_ARCH_LIST": "9.0"})), "gpu.arch-list", "info")
    assert "no GPU is visible" in i.title


def test_arch_list_leaves_out_a_gpu():
    f = machine(gpu=gpus(("A100", "8.0"), ("H100", "9.0")), env={"TORCH_CUDA_ARCH_LIST": "8.0"})
    w = only(check_gpu_arch_list(f), "gpu.arch-list", "warn")
    assert "leaves out 9.0 (GPU 1 H100)" in w.title
    assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.0;9.0"']


def test_arch_list_unparseable_entry():
    w = only(check_gpu_arch_list(machine(env={"TORCH_CUDA_ARCH_LIST": "80;8.0"})), "gpu.arch-list", "warn")
    assert "torch refuses '80': \"Unknown CUDA arch (80) or GPU not supported\"" in w.title
    assert w.data["unparseable"] == ["80"]
    assert any(e.startswith("torch 2.5.1+cu124 accepts 3.5, 3.7,") for e in w.evidence)
    assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.0"']
    w = only(check_gpu_arch_list(machine(gpu=[], env={"TORCH_CUDA_ARCH_LIST": "86"})), "gpu.arch-list", "warn")
    assert "nvidia-smi --query-gpu=compute_cap" in w.fix[0]


def test_arch_list_pre_turing_with_cuda13():
    f = machine(toolkits=[tk("13.0")], torch=torch_cuda("13.0"), env={"TORCH_CUDA_ARCH_LIST": "6.0;7.0;8.0"})
    w = only(check_gpu_arch_list(f), "gpu.arch-list", "warn")
    assert "6.0, 7.0 below 7.5" in w.title and "Unsupported gpu architecture" in w.title
    assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.0"']
    f = machine(toolkits=[tk("12.8")], torch=torch_cuda("12.8"), env={"TORCH_CUDA_ARCH_LIST": "6.0;7.0;8.0"})
    only(check_gpu_arch_list(f), "gpu.arch-list", "ok")  # CUDA 12 still builds for them


def test_arch_list_empty_or_native_is_auto_detect_like_unset():
    for value in ("", "native"):
        f = machine(gpu=gpus(("RTX 3090", "8.6")), env={"TORCH_CUDA_ARCH_LIST": value}, ds=None)
        i = only(check_gpu_arch_list(f), "gpu.arch-list", "info")
        assert i.title == (f"TORCH_CUDA_ARCH_LIST is {value!r} (torch detects the visible GPUs, as when it is "
                           "unset); the visible GPUs need 8.6")
        assert i.fix == ['export TORCH_CUDA_ARCH_LIST="8.6"']
        f.gpus = []
        assert "no GPU is visible" in only(check_gpu_arch_list(f), "gpu.arch-list", "info").title
    # DeepSpeed reads 'native' as X.Y and fails; an empty value only breaks its prebuild
    f = machine(gpu=gpus(("RTX 3090", "8.6")), env={"TORCH_CUDA_ARCH_LIST": "native"})
    w = only(check_gpu_arch_list(f), "gpu.arch-list", "warn")
    assert "DeepSpeed refuses 'native'" in w.title and "invalid literal for int()" in w.evidence[1]
    assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.6"', "or: unset TORCH_CUDA_ARCH_LIST"]
    f.env["TORCH_CUDA_ARCH_LIST"] = ""
    i = only(check_gpu_arch_list(f), "gpu.arch-list", "info")
    assert any("prebuild" in e for e in i.evidence)


def test_arch_list_refused_like_torch_refuses():
    for value, refused in (("8.6;8.1", "8.1"), ("8.6;9.9+PTX", "9.9+PTX"), ("8.6;10.0f", "10.0f")):
        w = only(check_gpu_arch_list(machine(gpu=gpus(("RTX 3090", "8.6")), env={"TORCH_CUDA_ARCH_LIST": value})),
                 "gpu.arch-list", "warn")
        assert f"torch refuses {refused!r}" in w.title, value
        assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.6"']
    # the installed torch's own table wins over the fallback copy
    f = machine(gpu=gpus(("B200", "10.0")), env={"TORCH_CUDA_ARCH_LIST": "10.0f"}, ds=None)
    f.torch.supported_arches = ["9.0", "10.0", "10.0f"]
    only(check_gpu_arch_list(f), "gpu.arch-list", "ok")


def test_arch_list_empty_entries():
    f = machine(gpu=gpus(("RTX 3090", "8.6")), env={"TORCH_CUDA_ARCH_LIST": "8.6;;"})
    w = only(check_gpu_arch_list(f), "gpu.arch-list", "warn")
    assert "2 empty entries" in w.title and "only DeepSpeed's JIT builds drop them" in w.title
    assert "leaves out" not in w.title and w.data["parsed"] == ["8.6"]  # dropped, as DeepSpeed's JIT does
    assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.6"']


def test_arch_list_names_and_suffixes_deepspeed_cannot_read():
    f = machine(gpu=gpus(("H100", "9.0")), env={"TORCH_CUDA_ARCH_LIST": "Ampere;9.0a+PTX"})
    w = only(check_gpu_arch_list(f), "gpu.arch-list", "warn")
    assert "DeepSpeed's op builder (0.19.8) reads only X.Y[+PTX]: 'Ampere', '9.0a+PTX'" in w.title
    assert "leaves out" not in w.title  # 9.0a covers the H100 for torch
    assert w.fix == ['export TORCH_CUDA_ARCH_LIST="8.0;8.6+PTX;9.0+PTX"']
    f.packages = {}
    only(check_gpu_arch_list(f), "gpu.arch-list", "ok")
    assert arch_list_fixed(f) == "8.0;8.6+PTX;9.0a+PTX"


def test_prebuild_arch_list_without_gpu_cleans_the_variable():
    f = machine(gpu=[], env={"TORCH_CUDA_ARCH_LIST": "8.6;;Hopper"})
    out = prebuild.commands(f, None)
    assert 'TORCH_CUDA_ARCH_LIST="8.6;9.0+PTX" DS_BUILD_CPU_ADAM=1' in out
    assert "using your TORCH_CUDA_ARCH_LIST='8.6;;Hopper' as '8.6;9.0+PTX'" in out
    f.env["TORCH_CUDA_ARCH_LIST"] = "8.6"
    assert 'TORCH_CUDA_ARCH_LIST="8.6" DS_BUILD_CPU_ADAM=1' in prebuild.commands(f, None)
    f.env["TORCH_CUDA_ARCH_LIST"] = "native"
    assert 'TORCH_CUDA_ARCH_LIST="<ARCH>"' in prebuild.commands(f, None)


def test_prebuild_says_a_cpu_torch_cannot_build_cuda_ops():
    out = prebuild.commands(real_machine(), None)
    assert "# torch 2.13.0+cpu is not a CUDA build: DeepSpeed cannot build CUDA ops with it" in out
    assert "export CUDA_HOME=/usr/local/cuda-13.0   # CUDA_HOME=/usr/local is not a CUDA toolkit" in out
    assert "not a CUDA build" not in prebuild.commands(machine(), None)


# -- precision.bf16-available ------------------------------------------------------------------------------
def test_bf16():
    i = only(check_precision_bf16_available(machine()), "precision.bf16-available", "info")
    assert "prefer bf16" in i.title and "NaN" in i.evidence[0]
    assert i.fix == ["TrainingArguments(bf16=True)", 'DeepSpeed config: "bf16": {"enabled": true}']
    f = machine(gpu=gpus(A100, ("Tesla V100-SXM2-32GB", "7.0")))
    i = only(check_precision_bf16_available(f), "precision.bf16-available", "info")
    assert "not available" in i.title and "7.0: GPU 1 Tesla V100" in i.title
    assert any("initial_scale_power" in x for x in i.fix) and i.data["bf16"] is False
    assert check_precision_bf16_available(machine(gpu=[])) == []


# -- system, build tools -----------------------------------------------------------------------------------
def test_shm():
    w = only(check_system_shm_small(machine(shm_gib=0.0625)), "system.shm-small", "warn")
    assert "64 MiB" in w.title
    assert w.fix[:2] == ["docker run --shm-size=16g ...", "or docker run --ipc=host ..."]
    only(check_system_shm_small(machine(shm_gib=1.0)), "system.shm-small", "ok")
    assert check_system_shm_small(machine(shm_gib=None)) == []


def test_ninja():
    only(check_build_ninja_missing(machine()), "build.ninja-missing", "ok")
    w = only(check_build_ninja_missing(machine(ninja=None)), "build.ninja-missing", "warn")
    assert w.fix == ["pip install ninja"]
    only(check_build_ninja_missing(machine(ninja=None, ds=None)), "build.ninja-missing", "info")


def test_libaio():
    assert check_build_libaio_missing(machine(libaio=None)) == []
    x = only(check_build_libaio_missing(machine(libaio=None), nvme_offload=True), "build.libaio-missing", "fail")
    assert x.fix[0] == "sudo apt install libaio-dev   # yum install libaio-devel" and "DS_BUILD_AIO=1" in x.fix[1]
    only(check_build_libaio_missing(machine(), nvme_offload=True), "build.libaio-missing", "ok")
    only(judge(machine(libaio=None), nvme_offload=True), "build.libaio-missing", "fail")


# -- any machine -------------------------------------------------------------------------------------------
cuda_versions = st.sampled_from([None, "11.8", "12.4", "12.6", "12.8", "13.0", "13.1"])
some_toolkits = st.lists(st.builds(tk, cuda_versions.filter(bool), lib=st.booleans()), max_size=3,
                         unique_by=lambda t: t.root)
some_gpus = st.lists(st.sampled_from([A100, ("RTX 3090", "8.6"), ("V100", "7.0"), ("B200", "10.0"),
                                      ("P100", "6.0"), ("odd", "?")]), max_size=3)


@settings(max_examples=60, deadline=None)
@given(cuda_versions, some_toolkits, some_gpus, st.sampled_from(["first", "/usr/local", None]),
       st.sampled_from([None, "5.4.0", "12.2.0", "14.1.0", "16.1.0"]), st.sampled_from([None, "", "8.0;90", "6.0"]),
       st.booleans())
def test_judge_never_crashes_and_every_problem_has_a_fix(cuda, toolkits, gpu_specs, home, gcc, arch, nvme):
    f = machine(torch=torch_cuda(cuda), toolkits=toolkits, home=home if toolkits or home != "first" else None,
                gpu=gpus(*gpu_specs), host_compiler=HostCompiler("/usr/bin/gcc", gcc, "PATH") if gcc else None,
                env={} if arch is None else {"TORCH_CUDA_ARCH_LIST": arch}, ninja=None if nvme else "1.11.1",
                libaio=None)
    findings = judge(f, nvme_offload=nvme)
    assert findings == judge(f, nvme_offload=nvme)
    for finding in findings:
        if finding.severity in ("warn", "fail"):
            assert finding.fix and finding.data, finding

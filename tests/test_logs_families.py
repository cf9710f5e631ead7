"""Families, not formats (issue 20): each failure family in the words of the tools that print it, and any layout.

Every log here is written by these tests from the message templates the tables cite (``logs/families/*``,
``logs/scalers.py``, ``logs/nonfinite.py``): the format strings with values put in, never text copied from a user's
log. The layout tests take a few such logs and print them the ways real logs arrive -- behind launcher, logger and
time prefixes, cut by a terminal at its width, with the cut turned into spaces, after a progress bar, in colour,
with two ranks interleaved -- and check that the findings are the same as on the clean log, with the file's own line
numbers.
"""

from __future__ import annotations

import io
import re

import pytest

from torchdoctor.logs.analyze import Analyzer, analyze_lines, analyze_stream
from torchdoctor.logs.lines import dewrap, rejoin, strip_prefixes, wrap_width
from torchdoctor.logs.scan import VOCABULARY


def report(lines: list[str]):
    return analyze_stream(io.BytesIO(("\n".join(lines) + "\n").encode()))


def sev(lines: list[str]) -> dict[str, str]:
    return {f.id: f.severity for f in report(lines).findings}


def finding(lines: list[str], fid: str):
    found = {f.id: f for f in report(lines).findings}
    assert fid in found, [(f.id, f.severity, f.title) for f in found.values()]
    return found[fid]


def severe(findings: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in findings.items() if v in ("warn", "fail")}


# ---------------------------------------------------------------------------------------- communication
TIMEOUT = ("[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={s}, OpType=ALLREDUCE, "
           "NumelIn=2048, NumelOut=2048, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
COMM_CASES = {
    "timeout, torch 2.x": ([TIMEOUT.format(r=1, s=41), TIMEOUT.format(r=2, s=41)], "comm.nccl-timeout"),
    "timeout, torch 1.x (no SeqNum)": ["[E ProcessGroupNCCL.cpp:587] [Rank 0] Watchdog caught collective operation "
                                       "timeout: WorkNCCL(OpType=BROADCAST, Timeout(ms)=1800000) ran for 1801342 "
                                       "milliseconds before timing out."],
    "blocking wait": ["[Rank 3] Work WorkNCCL(SeqNum=9, OpType=ALLGATHER, NumelIn=8, NumelOut=64, Timeout(ms)=60000) "
                      "timed out in blocking wait (NCCL_BLOCKING_WAIT=1)."],
    "hung watchdog": ["[PG ID 0 PG GUID 0(default_pg) Rank 5] ProcessGroupNCCL's watchdog got stuck for 480 seconds "
                      "without making progress in monitoring enqueued collectives."],
    "socket connect": ["node-a:2211:2290 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to "
                       "10.1.0.7<43121> failed : Connection refused"],
    "socket closed by peer": ["node-a:2211:2290 [3] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by "
                              "remote peer node-b<57557>"],
    "infiniband": ["node-a:2211:2290 [4] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
                   "10.2.0.9<5612> with status=12 opcode=0 len=0 vendor err 129 (Recv)"],
    "no interface": ["node-a:2211:2211 [0] bootstrap.cc:120 NCCL WARN Bootstrap : no socket interface found"],
    "gloo closed": ["RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                    "[10.3.0.2]:21331"],
    "store client timeout": ["torch.distributed.DistNetworkError: The client socket has timed out after 600s while "
                             "trying to connect to (10.0.0.1, 29500)."],
    "port in use, legacy": ["[W socket.cpp:436] [c10d] The server socket has failed to bind to [::]:29500 (errno: 98 "
                            "- Address already in use)."],
    "port in use, libuv": ["torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                           "network address. port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address "
                           "already in use"],
    "store barrier": ["RuntimeError: Timed out initializing process group in store based barrier on rank 3, for key: "
                      "store_based_barrier_key:1 (world_size=8, num_workers_joined=6, timeout=0:30:00)"],
    "rendezvous": ["torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d "
                   "store has failed. See inner exception for details."],
    "duplicate gpu": ["node-a:1:1 [0] init.cc:783 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
                      "device 1000"],
    "device ordinal": ["RuntimeError: CUDA error: invalid device ordinal"],
}
COMM_IDS = {"timeout, torch 2.x": "comm.nccl-timeout", "timeout, torch 1.x (no SeqNum)": "comm.nccl-timeout",
            "blocking wait": "comm.nccl-timeout", "hung watchdog": "comm.nccl-timeout",
            "socket connect": "comm.network", "socket closed by peer": "comm.network", "infiniband": "comm.network",
            "no interface": "comm.network", "gloo closed": "comm.network",
            "store client timeout": "comm.rendezvous", "port in use, legacy": "comm.rendezvous",
            "port in use, libuv": "comm.rendezvous", "store barrier": "comm.rendezvous",
            "rendezvous": "comm.rendezvous", "duplicate gpu": "comm.invalid-usage",
            "device ordinal": "comm.invalid-usage"}


@pytest.mark.parametrize("case", sorted(COMM_IDS))
def test_each_communication_failure_is_named_by_its_family(case):
    lines = COMM_CASES[case][0] if isinstance(COMM_CASES[case], tuple) else COMM_CASES[case]
    f = finding(lines, COMM_IDS[case])
    assert f.severity == "fail" and f.fix


def test_the_rank_that_completed_fewest_collectives_is_named():
    lines = [f"[PG 0 Rank {r}] Timeout at NCCL work: 880, last enqueued NCCL work: 880, last completed NCCL work: "
             f"{879 if r != 2 else 876}." for r in range(4)] + [TIMEOUT.format(r=0, s=880)]
    f = finding(lines, "comm.nccl-timeout")
    assert any("rank(s) 2 completed the fewest collectives" in e for e in f.evidence)


def test_a_network_cause_takes_the_nccl_error_it_explains():
    lines = ["node-a:1:2 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.1.0.7<43121> failed : "
             "No route to host",
             "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error "
             "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"]
    found = sev(lines)
    assert found.get("comm.network") == "fail" and "comm.nccl-error" not in found
    f = finding(lines, "comm.network")
    assert "No route to host" in f.title and any("NCCL_SOCKET_IFNAME" in x for x in f.fix)
    assert f.data["events"][0]["host"] == "node-a"


def test_ib_status_is_explained_and_a_healthy_nccl_log_is_quiet():
    f = finding(COMM_CASES["infiniband"], "comm.network")
    assert "IBV_WC_RETRY_EXC_ERR" in f.title and any("NCCL_IB_TIMEOUT" in x for x in f.fix)
    healthy = ["node-a:2211:2211 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.11<0>",
               "node-a:2211:2290 [0] NCCL INFO Channel 00/02 :    0   1", "node-a:2211:2290 [0] NCCL INFO Connected "
               "all rings", "{'loss': 2.31, 'learning_rate': 5e-05, 'epoch': 0.1}"]
    assert not severe(sev(healthy))


# ---------------------------------------------------------------------------------------- loss scaling
def apex(scales: list[float]) -> list[str]:
    return [f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {s}" for s in scales]


@pytest.mark.parametrize("lines,fid,severity", [
    (apex([2.0 ** k for k in range(15, -3, -1)]), "fp16.loss-scale-collapse", "fail"),      # below 1: collapsed
    (["Epoch 14"] + ["loss 0.148"] * 3 + apex([256.0, 128.0, 64.0, 32.0, 16.0, 8.0, 4.0]),
     "fp16.loss-scale-collapse", "warn"),                                                    # falling, 2 halvings left
    (apex([32768.0, 16384.0]), "fp16.overflow", "info"),                                    # a start-up search
    ([f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {2.0 ** k}"
      for k in range(6, 0, -1)]
     + ["FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try lowering the "
        "learning rate, using gradient clipping or increasing the batch size."], "fp16.loss-scale-collapse", "fail"),
    ([f"Overflow occurs, the loss scale is adjusted to {2.0 ** k}" for k in range(10, -1, -1)],
     "fp16.loss-scale-collapse", "fail"),                                                    # ColossalAI at its floor
    ([f"Check overflow, downscale loss scale to {2.0 ** k}" for k in range(9, 0, -1)], "fp16.loss-scale-collapse",
     "warn"),                                                                                # mmcv, 1 halving left
    ([f"Found NaN, decreased lg_loss_scale to {19.0 - k}" for k in range(25)], "fp16.loss-scale-collapse", "fail"),
    ([line for k in range(16, 5, -1) for line in (f"Grad overflow on iteration {20 - k}",
                                                  f"Using dynamic loss scale of {2.0 ** k}")],
     "fp16.loss-scale-collapse", "warn"),                                                    # apex's FP16_Optimizer
])
def test_every_trainers_scaler_is_judged_as_one_trajectory(lines, fid, severity):
    f = finding(lines, fid)
    assert f.severity == severity, f.title


def test_a_scaler_without_a_floor_says_so_and_gets_its_trainers_advice():
    f = finding(apex([2.0 ** k for k in range(15, -3, -1)]), "fp16.loss-scale-collapse")
    assert "apex amp's scaler has no minimum" in f.title
    assert any("torch.autocast" in x for x in f.fix) and not any('"bf16": {"enabled"' in x for x in f.fix)


# ---------------------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("lines,fid,severity", [
    (["Epoch: [3]  [ 120/1251]  loss: 6.9012", "Loss is nan, stopping training"], "loss.nonfinite", "fail"),
    (["     3/99  4.1G  0.0512  0.0211  23/27 [00:15<00:02, 1.66it/s]WARNING: non-finite loss, ending training  "
      "tensor([nan, nan, nan, nan])"], "loss.nonfinite", "fail"),
    (["FloatingPointError: Loss became infinite or NaN at iteration=2137!"], "loss.nonfinite", "fail"),
    (["2024-03-01 10:00:00,000 - mmdet - INFO - loss become infinite or NaN!"], "loss.nonfinite", "fail"),
    (["FloatingPointError: gradients are Nan/Inf"], "grad.nonfinite", "fail"),
    (["AssertionError: Rank 3: found NaN in local grad norm for bucket #0 in backward pass before data-parallel "
      "communication collective"], "grad.nonfinite", "fail"),
    (["train.py:317: FutureWarning: Non-finite norm encountered in torch.nn.utils.clip_grad_norm_; continuing "
      "anyway."], "grad.nonfinite", "warn"),
    (["RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be "
      "clipped."], "grad.nonfinite", "fail"),
    (["RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output."], "grad.nonfinite",
     "fail"),
    (["ValueError: The loss returned in `training_step` is nan."], "loss.nonfinite", "fail"),
    (["RuntimeError: Loss or gradient norm is not finite on at least one rank at step 1204. Stopping training before "
      "the optimizer update."], "loss.nonfinite", "fail"),
    (["| loss          | nan       |", "| step          | 1.53e+05  |"], "loss.nonfinite", "fail"),
    (["[R0] | E6 iter[ 14/ 15] | [Loss] nan | [step]   104"], "loss.nonfinite", "fail"),
    (["[Iteration 45459] Train 1792 in 4.0 seconds. Loss is Infinity. Current learning rate is 0.1."],
     "loss.nonfinite", "fail"),
])
def test_nonfinite_values_in_every_tools_words(lines, fid, severity):
    f = finding(lines, fid)
    assert f.severity == severity, f.title


def test_recovery_is_judged_per_loss_name():
    epochs = []
    for e in range(3):
        epochs += [f"Train Epoch: {e} Loss: 0.359: 100% 2785/2785 [00:53<00:00, 52.28it/s]",
                   f"Valid Epoch: {e} Loss: nan: 100% 660/660 [00:04<00:00, 143.71it/s]"]
    f = finding(epochs, "loss.nonfinite")  # the validation loss stays nan; the training loss is another name
    assert f.severity == "fail" and f.data["recovered"] is False
    back = ["{'loss': 2.1, 'epoch': 0.1}", "{'loss': nan, 'epoch': 0.2}", "{'loss': 2.0, 'epoch': 0.3}"]
    f = finding(back, "loss.nonfinite")
    assert f.severity == "warn" and f.data["recovered"] is True


def test_one_nan_grad_norm_without_a_scaler_is_a_warning():
    lines = [f"Epoch(train) [1][{i}0/735]  lr: 1.9e-04  loss: 2.5  grad_norm: {'nan' if i > 4 else '2.7'}"
             for i in range(1, 7)]
    assert finding(lines, "grad.nonfinite").severity == "warn"


# ---------------------------------------------------------------------------------------- builds and GPUs
def test_an_extension_built_for_another_torch():
    lines = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
             "    import flash_attn_2_cuda as flash_attn_cuda",
             "ImportError: /envs/py/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: "
             "undefined symbol: _ZN3c104cuda9SetDeviceEi"]
    f = finding(lines, "build.undefined-symbol")
    assert f.severity == "fail" and f.data["package"] == "flash_attn"
    assert any("c10::cuda::SetDevice" in e for e in f.evidence)
    assert any("pip install flash-attn --no-build-isolation" in x for x in f.fix)
    tv = finding(["RuntimeError: operator torchvision::nms does not exist"], "build.undefined-symbol")
    assert tv.data["package"] == "torchvision"


@pytest.mark.parametrize("lines,fid,severity,words", [
    (["OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root."],
     "build.cuda-home", "fail", "CUDA_HOME"),
    (["No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'"], "build.cuda-home", "warn", "no CUDA runtime"),
    (["/usr/include/c10/util/C++17.h:16:2: error: #error \"You're trying to build PyTorch with a too old version of "
      "GCC. We need GCC 9 or later.\""], "build.compiler", "fail", "PyTorch's own headers"),
    (["FlashAttention only supports Ampere GPUs or newer."], "cuda.unsupported-gpu", "fail", "FlashAttention"),
    (["NotImplementedError: No operator found for `memory_efficient_attention_forward` with inputs:",
      "`fa2F@v2.6.3` is not supported because:",
      "    requires device with capability > (8, 0) but your GPU has capability (7, 5) (too old)"],
     "cuda.unsupported-gpu", "fail", "xFormers"),
    (["UserWarning: The installed version of bitsandbytes was compiled without GPU support."],
     "cuda.unsupported-gpu", "warn", "bitsandbytes"),  # a warning: the run goes on without its GPU kernels
    (["GeForce RTX 3080 with CUDA capability sm_86 is not compatible with the current PyTorch installation.",
      "The current PyTorch install supports CUDA capabilities sm_37 sm_50 sm_60 sm_70."],
     "cuda.no-kernel-image", "fail", "sm_86"),
])
def test_builds_and_gpus_a_library_does_not_support(lines, fid, severity, words):
    f = finding(lines, fid)
    assert f.severity == severity and words in f.title, f.title


def test_no_torch_build_is_suggested_for_a_cuda_torch_has_none_for():
    msg = ("Exception: >- DeepSpeed Op Builder: Installed CUDA version {} does not match the version torch was "
           "compiled with 11.8, unable to compile cuda/cpp extensions without a matching cuda version.")
    old = finding([msg.format("9.1")], "build.cuda-mismatch")
    assert any("no torch release is built for CUDA 9.1" in x for x in old.fix)
    new = finding([msg.format("12.4")], "build.cuda-mismatch")
    assert any("download.pytorch.org/whl/cu124" in x for x in new.fix)


# ---------------------------------------------------------------------------------------- CUDA runtime, memory
@pytest.mark.parametrize("lines,fid", [
    (["THCudaCheck FAIL file=/pytorch/aten/src/THC/generic/THCTensorMath.cu line=26 error=59 : device-side assert "
      "triggered"], "cuda.device-assert"),
    (["RuntimeError: cuda runtime error (59) : device-side assert triggered at /pytorch/aten/THC/THCGeneral.cpp:405"],
     "cuda.device-assert"),
    (["/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1141: block: [0,0,0], thread: [106,0,0] Assertion "
      "`srcIndex < srcSelectDimSize` failed."], "cuda.device-assert"),
    (["F0402 19:17:15.304689 15412 im2col.cu:54] Cuda kernel failed. Error: unspecified launch failure"],
     "cuda.illegal-memory-access"),
    (["RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, "
      "k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"], "cuda.library-error"),
    (["!!!! kernel execution error. (m: 768, n: 4608, k: 3072, error: 13)"], "cuda.library-error"),
    (["RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"], "cuda.library-error"),
    (["RuntimeError: cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/THCCachingAllocator.cpp:510"],
     "memory.cuda-oom"),
    (["RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: you "
      "tried to allocate 318767104000 bytes. Error code 12 (Cannot allocate memory)"], "memory.host-oom"),
    (['  File "/usr/lib/python3.10/multiprocessing/popen_fork.py", line 66, in _launch', "    self.pid = os.fork()",
      "OSError: [Errno 12] Cannot allocate memory"], "memory.host-oom"),
    (["terminate called after throwing an instance of 'std::bad_alloc'", "  what():  std::bad_alloc"],
     "memory.host-oom"),
])
def test_runtime_errors_in_old_and_new_words(lines, fid):
    assert finding(lines, fid).severity == "fail"


def test_the_status_deepspeeds_kernel_printed_is_named():
    f = finding(["!!!! kernel execution error. (m: 768, n: 4608, k: 3072, error: 13)"], "cuda.library-error")
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in f.title


def test_a_request_larger_than_all_memory_the_allocator_could_free_gets_no_fragmentation_advice():
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {}. GPU 0 has a total capacity of 31.47 GiB "
           "of which 12.73 GiB is free. Of the allocated memory 9.08 GiB is allocated by PyTorch, and 9.35 GiB is "
           "reserved by PyTorch but unallocated.")
    big = finding([oom.format("22.78 GiB")], "memory.cuda-oom")
    assert not any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments" in x for x in big.fix)
    assert any("no allocator setting can serve it" in e for e in big.evidence)
    small = finding([oom.format("2.00 GiB")], "memory.cuda-oom")
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments" in x for x in small.fix)
    assert not any("ZeRO-3 or offload" in x for x in small.fix)  # no DeepSpeed in this log
    ds = finding(["[2024-01-01 10:00:00,000] [INFO] [engine.py:3793:_report_progress] step=10, skipped=0, lr=[1e-05]",
                  oom.format("2.00 GiB")], "memory.cuda-oom")
    assert any("ZeRO-3 or offload" in x for x in ds.fix)


# ---------------------------------------------------------------------------------------- never OK on a failure
def test_an_error_line_anywhere_is_never_clean():
    lines = ["{'loss': 2.1, 'epoch': 0.1}", "[ERROR] shard 3 unreadable: skipped", "{'loss': 2.0, 'epoch': 0.2}",
             "{'loss': 1.9, 'epoch': 0.3}"]
    f = finding(lines, "process.error-line")
    assert f.severity == "warn" and "shard 3 unreadable" in f.title
    assert "logs.clean" not in sev(lines)
    fatal = ["I0101 10:00:00.000000 1 net.cpp:100] Creating Layer conv1",
             "F0101 10:00:01.000000 1 math_functions.cpp:250] Check failed: a <= b (0 vs. -1.19209e-07)",
             "*** Check failure stack trace: ***"]
    assert finding(fatal, "process.error-line").severity == "fail"


def test_a_progress_bars_count_is_not_called_a_step():
    lines = ["  1%|          | 12/1000 [00:05<07:00,  2.3it/s]", "loss: nan"]
    f = finding(lines, "loss.nonfinite")
    assert "progress 12/1000" in f.title and "step 12" not in f.title


# ---------------------------------------------------------------------------------------- layouts
BASE = {
    "nccl": [f"step {i} loss 2.{i}" for i in range(3)] + [TIMEOUT.format(r=1, s=41),
                                                           "Some NCCL operations have failed or timed out. Due to the "
                                                           "asynchronous nature of CUDA kernels, subsequent GPU "
                                                           "operations might run on corrupted/incomplete data."],
    "oom": ["Traceback (most recent call last):", '  File "train.py", line 12, in <module>', "    loss.backward()",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.11 GiB of which 1.20 GiB is free."],
    "ds": [f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {2 ** k}, reducing to {2 ** (k - 1)}"
           for k in range(12, 1, -1)],
    "nan": ["{'loss': 2.31, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}",
            "{'loss': nan, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.2}",
            "{'loss': nan, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.3}"],
    "net": ["node-a:1:2 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.1.0.7<43121> failed : "
            "Connection refused"],
}
PREFIXES = {
    "torchrun": "[rank3]:", "torchrun tee": "[default3]:", "srun --label": "3: ", "mpirun": "[1,3]<stderr>:",
    "iso time": "2026-03-02T10:00:00.123Z ",
    "deepspeed logger": "[2026-03-02 10:00:00,123] [INFO] [engine.py:12:step] ",
    "transformers logger": "[INFO|2026-03-02 10:00:00] trainer.callbacks:157 >> ", "loguru":
    "2026-03-02 10:00:00.123 | INFO     | train:main:42 - ", "nemo": "[NeMo I 2026-03-02 10:00:00 train:42] ",
    "lightning rank": "[rank: 3] ", "pdsh host": "worker-1: ", "quoted paste": "> ", "c10 glog": "[E302 10:00:00.1 "
    "ProcessGroupNCCL.cpp:607] ",
}


def _severities(lines: list[str]) -> dict[str, str]:
    return {f.id: f.severity for f in report(lines).findings if f.severity in ("fail", "warn", "info")}


@pytest.mark.parametrize("prefix", sorted(PREFIXES))
@pytest.mark.parametrize("name", sorted(BASE))
def test_prefixes_change_nothing(name, prefix):
    clean = _severities(BASE[name])
    assert severe(clean)
    assert _severities([PREFIXES[prefix] + line for line in BASE[name]]) == clean


def _wrap(lines: list[str], width: int) -> list[str]:
    out = []
    for line in lines:
        out += [line[i:i + width] for i in range(0, len(line), width)] or [""]
    return out


@pytest.mark.parametrize("width", [61, 80, 97, 120])
@pytest.mark.parametrize("name", sorted(BASE))
def test_a_terminals_hard_wrap_changes_nothing(name, width):
    lines = BASE[name] + BASE[name] + [f"epoch {i} done" for i in range(3)]
    wrapped = _wrap(lines, width)
    if sum(len(x) > width for x in lines) < 2:  # one cut line alone is not told from a long one (lines.wrap_width)
        pytest.skip("fewer than two lines to wrap at this width")
    assert _severities(wrapped) == _severities(lines)


def test_a_hard_wrap_keeps_the_files_line_numbers():
    lines = ["warmup"] * 3 + [TIMEOUT.format(r=1, s=41)] + ["after"] * 2 + [TIMEOUT.format(r=2, s=41)]
    wrapped = _wrap(lines, 70)
    assert wrap_width("\n".join(wrapped)) == 70
    t = finding(wrapped, "comm.nccl-timeout").data["timeouts"]
    starts = [i + 1 for i, ln in enumerate(wrapped) if ln.startswith("[Rank")]
    assert [x["line"] for x in t] == starts and report(wrapped).lines == len(wrapped)
    assert t[0]["text"].startswith("[Rank 1] Watchdog caught")  # the file's text, joined back


def test_a_wrap_that_became_spaces_inside_words_changes_nothing():
    line = TIMEOUT.format(r=1, s=41)
    for cut in (line.replace("OpType", "OpTy pe"), line.replace("collective", "collec       tive"),
                line.replace("milliseconds", "millisec onds")):
        assert _severities([cut]) == _severities([line]), cut
    ds = BASE["ds"][0].replace("loss scale", "loss scal                       e")
    assert rejoin(ds, VOCABULARY) == BASE["ds"][0]


def test_text_after_a_progress_bar_is_a_line_of_its_own():
    bar = " 45%|████▌     | 75/166 [08:38<11:33,  6.74s/it]"
    for name in ("oom", "nan", "net"):
        glued = BASE[name][:-1] + [bar + BASE[name][-1]]
        assert severe(_severities(glued)) == severe(_severities(BASE[name])), name
    killed = finding([bar + "Killed"], "process.killed")
    assert killed.severity == "fail"


def test_colours_change_nothing():
    for name, lines in BASE.items():
        coloured = [f"\x1b[31m{ln[:20]}\x1b[0m{ln[20:]}" for ln in lines]
        assert _severities(coloured) == _severities(lines), name


def test_interleaved_ranks_keep_their_tracebacks_apart():
    r0 = ["Traceback (most recent call last):", '  File "train.py", line 40, in <module>', "    main()",
          '  File "train.py", line 31, in main', "    out = model(batch)", "KeyError: 'labels'"]
    r1 = ["Traceback (most recent call last):", '  File "train.py", line 40, in <module>', "    main()",
          '  File "train.py", line 35, in main', "    loss.backward()",
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."]
    mixed = [x for pair in zip(r0, r1) for x in (f"[rank0]: {pair[0]}", f"[rank1]: {pair[1]}")]
    a = Analyzer()
    for line in mixed:
        a.feed_line(line)
    found = {f.id: f for f in a.finish().findings}
    assert found["memory.cuda-oom"].severity == "fail"
    exc = found["process.exception"]
    assert exc.data["rank"] == 0 and exc.data["exception"]["type"] == "KeyError"
    assert exc.data["user_frame"]["code"] == "out = model(batch)"  # rank 0's code line, not rank 1's


def test_the_same_log_in_any_chunking_reads_the_same():
    text = "\n".join(_wrap(BASE["nccl"] + BASE["nan"], 73)) + "\n"
    whole = analyze_stream(io.BytesIO(text.encode())).to_json()
    for chunk in (7, 64, 4097):
        assert analyze_stream(io.BytesIO(text.encode()), chunk_size=chunk).to_json() == whole
    lines = analyze_lines(text.splitlines())
    assert lines.to_json() == whole


# ---------------------------------------------------------------------------------------- the parts
def test_strip_prefixes_keeps_rank_host_time_and_level():
    line = strip_prefixes("worker-1: [rank9]: [2026-03-02 10:00:00,123] [ERROR] [launch.py:3:main] boom")
    assert (line.text, line.rank, line.host, line.time, line.level) == (
        "boom", 9, "worker-1", "2026-03-02 10:00:00,123", "ERROR")
    assert strip_prefixes("F0101 10:00:01.000000 1 math.cpp:250] Check failed").level == "FATAL"
    assert strip_prefixes("RuntimeError: CUDA error").text == "RuntimeError: CUDA error"  # an exception is no host
    assert strip_prefixes("[rank3]:").text == "[rank3]:"  # a line that is only a prefix keeps its text


def test_dewrap_joins_only_cut_lines():
    text = "\n".join(["x" * 50 + "abc", "def rest of it", "=" * 53, "next line", "y" * 53, "[rank1]: new"])
    joined, joins = dewrap(text, 53)
    assert joined.split("\n") == ["x" * 50 + "abcdef rest of it", "=" * 53, "next line", "y" * 53, "[rank1]: new"]
    assert len(joins) == 1
    assert wrap_width("\n".join(["same line that repeats, not a wrap at all"] * 5)) is None


def test_every_message_table_cites_its_source():
    from torchdoctor.logs import nonfinite, scalers
    from torchdoctor.logs.families import FAMILIES

    for module in (scalers, nonfinite, *(__import__(f.__module__, fromlist=["x"]) for f in FAMILIES)):
        doc = module.__doc__ or ""
        assert re.search(r"@[0-9a-f]{7,}|\d+\.\d+(?:\.\d+)? ", doc), f"{module.__name__} cites no commit or version"


# ---------------------------------------------------------------------------------------- what review found
def test_lines_of_one_length_alternating_with_others_are_not_a_wrap():
    lines = []
    for e in range(1, 4):
        lines += [f"Epoch {e}/9 done | train_loss 0.500{e} | val_loss 0.600{e} | time 123.4s",
                  f"Saving checkpoint to ckpt/epoch{e}.pt"]
    assert wrap_width("\n".join(lines)) is None
    assert finding(lines[:-1] + ["Killed"], "process.killed").severity == "fail"


def test_a_crlf_paste_is_unwrapped_too():
    lines = _wrap([TIMEOUT.format(r=r, s=41) for r in range(3)], 80)
    text = "\r\n".join(lines) + "\r\n"
    found = {f.id: f.severity for f in analyze_stream(io.BytesIO(text.encode())).findings}
    assert found.get("comm.nccl-timeout") == "fail"


@pytest.mark.parametrize("line", ["Test Error: ", "Top-1 error: 12.3%", "val error: 0.05", "error: 0",
                                  "Error: 0.3 Acc: 0.7", "Epoch 3 - Error: 0.05 - Acc: 0.95", "| val | error: 0.1 |",
                                  "I0101 10:00:00.000000 1 main.cc:1] set FATAL log level to stderr",
                                  "Read error rate: 0.01", "nccl version 2.18.1, ncclSystemError count: 0",
                                  "node1:2211:2290 [0] NCCL INFO Call to connect returned Connection refused, retrying",
                                  "[W socket.cpp:663] [c10d] The client socket has failed to connect to "
                                  "[localhost]:29500 (errno: 99 - Cannot assign requested address)."])
def test_healthy_lines_that_mention_errors_stay_quiet(line):
    lines = ["{'loss': 2.31, 'epoch': 0.1}", line, "{'loss': 2.20, 'epoch': 0.2}", "{'loss': 2.10, 'epoch': 0.3}"]
    assert not severe(sev(lines)), sev(lines)


def test_an_error_label_in_capitals_is_an_error_line():
    lines = ["{'loss': 2.31, 'epoch': 0.1}", "ERROR: Unexpected segmentation fault encountered in worker.",
             "{'loss': 2.20, 'epoch': 0.2}"]
    assert severe(sev(lines))


def test_a_metric_named_with_a_hyphen_is_no_host():
    assert finding(["val-loss: NaN"] * 3, "loss.nonfinite").severity == "fail"
    assert strip_prefixes("loss1: NaN").text == "loss1: NaN"
    assert strip_prefixes("gpu-node-03: Traceback (most recent call last):").host == "gpu-node-03"


def test_c10s_three_digit_month_day_is_a_prefix():
    line = strip_prefixes("[rank0]:[F424 01:11:21.162803470 init.cpp:12] collective mismatch")
    assert (line.text, line.rank, line.level) == ("collective mismatch", 0, "FATAL")
    assert finding(["{'loss': 2.3, 'epoch': 0.1}", "[rank0]:[F424 01:11:21.162803470 init.cpp:12] collective "
                    "mismatch"], "process.error-line").severity == "fail"


def test_numpys_memory_error_is_host_memory():
    f = finding(["numpy.core._exceptions._ArrayMemoryError: Unable to allocate 12.0 GiB for an array with shape "
                 "(40000, 40000) and data type float64"], "memory.host-oom")
    assert f.severity == "fail" and "12.00 GiB" in f.title and "numpy" in f.title


def test_long_lines_do_not_make_the_new_patterns_backtrack():
    # each took minutes with nested quantifiers (review): now linear
    lines = ["ImportError: " + "a" * 5000 + " /x/y.so: undefined symbol: z", "[E " + "1" * 4000 + " rror",
             "Connect to a failed : " + " " * 8000 + "x", "| ".join(["loss "] * 3000)]
    found = sev(lines)
    assert found.get("build.undefined-symbol") == "fail"


def test_nccl_retries_are_a_failure_only_when_a_warning_follows():
    retry = "node-a:1:2 [0] NCCL INFO Call to connect returned Connection timed out, retrying"
    warned = [retry, retry, "node-a:1:2 [0] include/socket.h:403 NCCL WARN Connect to 10.0.0.2<41234> failed"]
    assert finding(warned[:2] + ["node-a:1:2 [0] include/socket.h:403 NCCL WARN Connect to f"],
                   "comm.network").severity == "fail"  # a warning cut mid-word still follows the retries
    assert finding(warned, "comm.network").severity == "fail"
    assert finding([retry, "{'loss': 2.3, 'epoch': 0.1}"], "comm.network").severity == "info"


def test_the_store_barrier_says_who_joined():
    wait = ("Waiting in store based barrier to initialize process group for rank: 0, key: store_based_barrier_key:1 "
            "(world_size=4, worker_count={}, timeout=0:30:00)")
    crowded = finding([wait.format(8)] * 3, "comm.rendezvous")
    assert crowded.severity == "fail" and "more processes joined" in crowded.title
    assert any("--master_port" in x for x in crowded.fix)
    assert finding([wait.format(3)] * 3, "comm.rendezvous").severity == "warn"


@pytest.mark.parametrize("line", ["| WARNING: overflow detected, setting loss scale to: {}",
                                  "2020-03-23 11:41:18 | INFO | fairseq.trainer | NOTE: overflow detected, setting "
                                  "loss scale to: {}",
                                  "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {}"])
def test_fairseqs_three_wordings_are_one_scaler(line):
    f = finding([line.format(2.0 ** -k) for k in range(4, 14)], "fp16.loss-scale-collapse")
    # 2**-13 is one overflow above fairseq's --min-loss-scale 1e-4, where it raises: still falling, none left
    assert f.severity == "warn" and "0 halvings left before the minimum (0.0001: fairseq's default)" in f.title


def test_a_printed_loss_scale_is_a_trajectory():
    lines = [f"DLL 2020-06-03 02:4{k}:00.000000 - PARAMETER loss_scale : {2.0 ** (16 - k)}" for k in range(10)]
    f = finding(lines, "fp16.loss-scale-collapse")
    assert f.severity == "warn" and f.data["falling"] is True
    assert not severe(sev(['"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}']))


def test_a_cuda_error_that_names_the_driver_is_the_driver():
    line = ("Faiss assertion 'err__ == cudaSuccess' failed in int faiss::gpu::getNumDevices() at "
            "gpu/utils/DeviceUtils.cu:32; details: CUDA error 35 CUDA driver version is insufficient for CUDA runtime "
            "version")
    assert finding([line, "Aborted (core dumped)"], "cuda.driver-too-old").severity == "fail"


def test_the_key_search_finds_every_key_the_naive_scan_finds():
    """One regex search per line stands for ~170 `key in text` tests: it must miss none, overlapping keys included."""
    import random

    a = Analyzer()
    keys = sorted({r[0] for r in a._rule_table})
    rng = random.Random(20)
    for _ in range(3000):
        parts = [rng.choice(keys)[rng.randrange(3):] if rng.random() < 0.3 else rng.choice(keys)
                 for _ in range(rng.randrange(1, 5))]
        text = rng.choice(["", " ", "x"]).join(parts)
        present = a._keys_re.findall(text)
        found = set(present)
        for k in present:
            found.update(a._contained[k])
            found.update(o for o in a._overlap[k] if o in text)
        assert found == {k for k in keys if k in text}, text

"""The cause that stands in the same line (issue 33): a rule reads the facts its line gives -- who holds the GPU's
memory, which assert a kernel failed, which file the shared memory refused, which limit Slurm enforced -- and the fix
follows from those facts; a cascade's first cause is the headline. Every log here is written from the format strings
the rules cite (torch's caching allocator and kernels, NCCL's checks, torch's MapAllocator and DataLoader, slurmstepd,
pip's box), with values put in.
"""

from __future__ import annotations

import io

import pytest

from torchdoctor.logs.analyze import analyze_stream

GIB = 2**30


def report(lines: list[str]):
    return analyze_stream(io.BytesIO(("\n".join(lines) + "\n").encode()))


def by_id(lines: list[str]) -> dict:
    return {f.id: f for f in report(lines).findings}


def said(f) -> str:
    """What a finding says (its diagnosis): title and fix, not the evidence that quotes the line."""
    return " ".join([f.title, *f.fix])


def oom_new(total: float, free: float, this: float, others: list[tuple[int, float]], tried: float = 0.05,
            gpu: int = 0, rank: str = "") -> str:
    # c10/cuda/CUDACachingAllocator.cpp (torch >= 2.1), the Process entries from NVML
    procs = "".join(f"Process {pid} has {size:.2f} GiB memory in use. " for pid, size in others)
    return (f"{rank}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried:.2f} GiB. GPU {gpu} has a "
            f"total capacity of {total:.2f} GiB of which {free:.2f} GiB is free. {procs}Including non-PyTorch memory, "
            f"this process has {this:.2f} GiB memory in use. Of the allocated memory {this * 0.9:.2f} GiB is allocated "
            f"by PyTorch, and {this * 0.05:.2f} GiB is reserved by PyTorch but unallocated.")


def oom_old(total: float, allocated: float, free_mib: float, reserved: float, tried_mib: float = 36) -> str:
    # torch 1.x-2.0: "(GPU 0; T total capacity; A already allocated; F free; R reserved in total by PyTorch)"
    return (f"RuntimeError: CUDA out of memory. Tried to allocate {tried_mib:.2f} MiB (GPU 0; {total:.2f} GiB total "
            f"capacity; {allocated:.2f} GiB already allocated; {free_mib:.2f} MiB free; {reserved:.2f} GiB reserved "
            "in total by PyTorch)")


# ------------------------------------------------------------------------------------------ who holds the GPU
def test_oom_with_every_rank_on_one_gpu_says_so_and_how_to_fix_it():
    others = [(4100 + i, 1.19) for i in range(7)]
    f = by_id([oom_new(31.74, 0.04, 22.0, others)])["memory.cuda-oom"]
    assert f.severity == "fail"
    assert "7 other process(es) hold 8.33 GiB" in f.title  # 7 x 1.19, summed from the line
    assert "torch.cuda.set_device(local_rank)" in f.fix[0]  # equal small processes: the other ranks' contexts
    assert all(str(p) in said(f) for p, _ in others[:6])
    assert not f.fix[0].startswith("lower the batch")


def test_oom_with_one_big_foreign_process_points_at_it_not_at_the_batch():
    f = by_id([oom_new(23.65, 0.2, 8.0, [(777, 15.0)])])["memory.cuda-oom"]
    assert "1 other process(es) hold 15.00 GiB" in f.title and "777" in f.fix[0]
    assert "set_device" not in f.fix[0]  # one process of another size: nothing says it is this job's rank


def test_oom_old_format_memory_outside_pytorch_is_named():
    f = by_id([oom_old(10.76, 0.97, 8.81, 0.99)])["memory.cuda-oom"]
    assert "is held outside this process's PyTorch memory" in f.title
    assert "9.76 GiB" in f.title  # 10.76 - 0.99 reserved - ~0.01 free
    assert f.fix[0].startswith("nvidia-smi")


def test_oom_that_this_process_fills_is_a_batch_question():
    f = by_id([oom_new(23.56, 1.23, 22.27, [], tried=1.99)])["memory.cuda-oom"]
    assert "other process" not in f.title and "outside" not in f.title
    assert f.fix[0].startswith("lower the batch")


def test_a_request_larger_than_the_gpu_is_a_size_bug():
    f = by_id([oom_new(79.14, 61.76, 17.37, [], tried=13535.27)])["memory.cuda-oom"]
    assert "larger than the GPU" in f.title and "size or shape bug" in f.fix[0]


def test_ncclss_own_cuda_failure_out_of_memory_is_a_cuda_oom_in_nccl():
    # NVIDIA/nccl src/include/checks.h CUDACHECK: WARN("Cuda failure '%s'", cudaGetErrorString(err))
    f = by_id(["node1:3018451:3018451 [0] enqueue.cc:1085 NCCL WARN Cuda failure 'out of memory'"])["memory.cuda-oom"]
    assert f.severity == "fail" and "inside NCCL" in f.title and "NCCL_BUFFSIZE" in f.fix[0]


# ------------------------------------------------------------------------------------------ which assert
BCE = ("/pytorch/aten/src/ATen/native/cuda/Loss.cu:92: operator(): block: [0,0,0], thread: [{t},0,0] Assertion "
       "`input_val >= zero && input_val <= one` failed.")


def test_a_bce_assert_is_named_as_bce_and_never_as_an_index_error():
    f = by_id([BCE.format(t=t) for t in range(3)])["cuda.device-assert"]
    assert "binary_cross_entropy" in f.title and "BCEWithLogitsLoss" in f.fix[0]
    assert "index" not in said(f).lower()


def test_a_bce_assert_after_a_nan_loss_names_the_nan_as_the_cause():
    lines = ["Epoch 3: : 67189it [6:05:52,  3.06it/s, loss=nan, v_num=m9eu]", BCE.format(t=32)]
    f = by_id(lines)["cuda.device-assert"]
    assert "the loss was already nan at line 1" in f.title
    assert f.fix[0].startswith("the loss was non-finite before the assert (line 1)")


def test_an_unknown_assert_is_quoted_not_guessed():
    f = by_id(["/src/kernels/topk.cu:41: block: [0,0,0] Assertion `k <= n_elems` failed."])["cuda.device-assert"]
    assert "`k <= n_elems`" in f.title and "index" not in said(f).lower()


@pytest.mark.parametrize("cond,words", [
    ("t >= 0 && t < n_classes", "class label"),
    ("srcIndex < srcSelectDimSize", "embedding"),
    ("idx_dim >= 0 && idx_dim < index_size && \"index out of bounds\"", "index out of bounds"),
])
def test_each_known_assert_condition_has_its_own_meaning(cond, words):
    f = by_id([f"/pytorch/aten/src/ATen/native/cuda/X.cu:1: block: [0,0,0] Assertion `{cond}` failed."])[
        "cuda.device-assert"]
    assert words in f.title


# ------------------------------------------------------------------------------------------ /dev/shm
SHARE = ["Traceback (most recent call last):",
         '  File "/usr/lib/python3.10/multiprocessing/queues.py", line 244, in _feed',
         "    obj = _ForkingPickler.dumps(obj)",
         '  File "/venv/lib/python3.10/site-packages/torch/multiprocessing/reductions.py", line 568, in reduce_storage',
         "    fd, size = storage._share_fd_cpu_()"]


@pytest.mark.parametrize("tail,words", [
    ("RuntimeError: unable to write to file </torch_8289_606636967_0>: No space left on device (28)",
     "no space left on /dev/shm"),
    ("RuntimeError: unable to write to file </torch_15769_1517813162>", "gives no reason"),  # torch <= 1.4
    ("RuntimeError: unable to open shared memory object </torch_31_1030151126> in read-write mode: Too many open "
     "files (24)", "file descriptors"),
])
def test_shared_memory_failures_say_which_limit(tail, words):
    f = by_id([*SHARE, tail])["memory.shm"]
    assert f.severity == "fail" and words in f.title
    fix = " ".join(f.fix)
    assert ("ulimit -n" in fix) if "(24)" in tail else ("--shm-size" in fix and "df -h /dev/shm" in fix)


def test_the_dataloader_bus_error_message_is_shared_memory():
    lines = ["ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory "
             "(shm)."]
    assert "SIGBUS" in by_id(lines)["memory.shm"].title


def test_enospc_is_shared_memory_only_under_a_semlock():
    semlock = ['  File "/usr/lib/python3.10/multiprocessing/synchronize.py", line 57, in __init__',
               "    sl = self._semlock = _multiprocessing.SemLock(", "OSError: [Errno 28] No space left on device"]
    assert "semaphore" in by_id(["Traceback (most recent call last):", *semlock])["memory.shm"].title
    disk = ["Traceback (most recent call last):", '  File "train.py", line 80, in save',
            "    torch.save(state, path)", "OSError: [Errno 28] No space left on device"]
    assert "memory.shm" not in by_id(disk)  # a checkpoint write that found the disk full is not /dev/shm


# ------------------------------------------------------------------------------------------ Slurm
@pytest.mark.parametrize("line,reason", [
    ("slurmstepd: error: *** JOB 494583 ON gpu-3 CANCELLED AT 2024-04-20T09:09:37 DUE TO TIME LIMIT ***",
     "time limit"),
    ("slurmstepd: error: *** STEP 494583.0 ON gpu-3 CANCELLED AT 2024-04-20T09:09:37 DUE TO PREEMPTION ***",
     "preemption"),
    ("slurmstepd: error: *** JOB 7 ON gpu-3 CANCELLED AT 2024-04-20T09:09:37 DUE TO NODE FAILURE, SEE SLURMCTLD LOG "
     "FOR DETAILS ***", "node failure"),
    ("slurmstepd: error: *** JOB 7 ON gpu-3 CANCELLED AT 2024-04-20T09:09:37 ***", "by scancel"),
    ("slurmstepd: *** JOB 830329 CANCELLED AT 2018-08-06T17:21:44 DUE TO TIME LIMIT on n447 ***", "time limit"),
])
def test_a_slurm_cancel_is_a_failure_with_its_reason_and_its_fix(line, reason):
    f = by_id(["step 100 loss 2.31", line])["process.cancelled"]
    assert f.severity == "fail" and reason in f.title
    first = {"time limit": "--time", "preemption": "--requeue", "node failure": "--exclude",
             "by scancel": "scancel"}[reason]
    assert first in f.fix[0]
    assert "process.error-line" not in by_id([line])  # the rule took the line


# ------------------------------------------------------------------------------------------ cascades
TIMEOUT = ("[rank{r}]:[E1204 12:30:00.000 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective operation "
           "timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=4661, NumelOut=4661, Timeout(ms)=600000) ran for "
           "600060 milliseconds before timing out.")


def test_a_rank_that_died_is_the_headline_and_its_peers_timeouts_its_evidence():
    lines = [oom_new(79.1, 1.5, 77.6, [], tried=2.0, gpu=1, rank="[rank1]: "), TIMEOUT.format(r=0),
             TIMEOUT.format(r=2)]
    fs = report(lines).findings
    assert fs[0].id == "memory.cuda-oom" and fs[0].severity == "fail"
    assert any(e.startswith("then, line 2: NCCL collective timed out") for e in fs[0].evidence)
    comm = next(f for f in fs if f.id == "comm.nccl-timeout")
    assert comm.severity == "info" and comm.data["consequence_of"] == "memory.cuda-oom"


def test_a_timeout_with_no_earlier_failure_stays_the_cause():
    f = by_id([TIMEOUT.format(r=0), TIMEOUT.format(r=1)])["comm.nccl-timeout"]
    assert f.severity == "fail" and "consequence_of" not in f.data


def test_a_timeout_before_the_other_failure_is_not_its_consequence():
    lines = [TIMEOUT.format(r=0), oom_new(79.1, 1.5, 77.6, [], gpu=1, rank="[rank1]: ")]
    assert {f.id: f.severity for f in report(lines).findings if f.severity == "fail"} == {
        "comm.nccl-timeout": "fail", "memory.cuda-oom": "fail"}


def test_a_cuda_error_surfacing_again_at_a_later_call_is_folded_into_the_first():
    lines = ["RuntimeError: CUDA error: an illegal memory access was encountered",
             "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, "
             "n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"]
    fs = report(lines).findings
    assert fs[0].id == "cuda.illegal-memory-access"
    assert {f.id: f.severity for f in fs}["cuda.library-error"] == "info"


# ------------------------------------------------------------------------------------------ pip's box
def test_an_error_inside_pips_box_is_read_as_the_builds_own():
    # pip/_internal/exceptions.py InstallationSubprocessError: "╰─> [N lines of output]", lines indented to the box
    box = ["Collecting flash-attn", "  Preparing metadata (setup.py) ... error",
           "  error: subprocess-exited-with-error", "", "  × python setup.py egg_info did not run successfully.",
           "  │ exit code: 1",
           "  ╰─> [7 lines of output]", "      Traceback (most recent call last):",
           '        File "<string>", line 2, in <module>',
           '        File "/tmp/pip-install-x/flash-attn_1/setup.py", line 120, in <module>',
           '          raise_if_cuda_home_none("flash_attn")',
           "      RuntimeError: flash_attn was requested, but nvcc was not found.  Are you sure your environment has "
           "nvcc available?", "", "      torch.__version__  = 2.0.1+cu117", "      [end of output]", "",
           "  note: This error originates from a subprocess, and is likely not a problem with pip.",
           "error: metadata-generation-failed"]
    fs = by_id(box)
    assert fs["build.cuda-home"].severity == "fail"
    exc = fs["process.exception"]
    assert exc.data["exception"]["type"] == "RuntimeError" and "nvcc was not found" in exc.data["exception"]["msg"]
    assert exc.severity == "info"  # explained by build.cuda-home

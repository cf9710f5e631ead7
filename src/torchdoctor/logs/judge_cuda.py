"""Judging CUDA runtime errors (``cuda.*``): illegal memory accesses, device-side asserts, kernels missing for the GPU,
cuBLAS/cuDNN failures, the driver, ECC and Xid, whatever format the log printed them in (see ``patterns.CUDA_ERROR_RE``
and :mod:`.handlers_crash`, which record them)."""

from __future__ import annotations

import re
from typing import Any

from ..findings import Finding
from .common import at_step


class CudaJudge:
    """Mixin: ``_judge_cuda``."""

    def _judge_cuda(self) -> list[Finding]:
        out: list[Finding] = []
        errs = self._cuda_errors
        blocking = ("rerun with CUDA_LAUNCH_BLOCKING=1: kernels then run synchronously, so the traceback points at "
                    "the kernel that failed, not at a later call (CUDA reports errors asynchronously)")

        def ev_of(kind: str) -> list[str]:
            d = errs[kind]
            ev = [f"line {e['line']}{at_step(e)}: {e['text']}" for e in d["events"][:3]]
            if d["count"] > 3:
                ev.append(f"{d['count']} such line(s) in all")
            return ev

        def data_of(kind: str, **more) -> dict:
            return {"count": errs[kind]["count"], "events": list(errs[kind]["events"]), **more}

        if "illegal-memory-access" in errs:
            msg = errs["illegal-memory-access"]["events"][0]["msg"]
            out.append(Finding(
                "cuda.illegal-memory-access", "fail", f"CUDA error: {msg}: a kernel read or wrote memory it must not",
                ev_of("illegal-memory-access"),
                [blocking,
                 "compute-sanitizer --tool memcheck python train.py (the CUDA toolkit's tool) names the kernel and "
                 "the bad address; with a small batch it runs in minutes",
                 "usual causes: an out-of-range index or a custom/fused kernel (flash-attn, apex, DeepSpeed ops, "
                 "Triton) built for another torch or GPU: rebuild it (torchdoctor env), or switch it off to see if "
                 "the error goes; a failing GPU shows Xid lines in dmesg"],
                data_of("illegal-memory-access")))
        if "device-assert" in errs or self._device_asserts:  # the kernel's own assert line alone says it too
            out.append(self._device_assert_finding(ev_of, data_of, blocking))
        if "no-kernel-image" in errs or self._cuda_capability:
            cap = self._cuda_capability
            ev = ev_of("no-kernel-image") if "no-kernel-image" in errs else []
            what = "no kernel image for this GPU"
            if cap:
                ev.append(f"line {cap['line']}: {cap['text']}")
                archs = " ".join(cap["arch_list"]) or "?"
                what += f": the GPU is {cap['capability']}, the torch build has {archs}"
            fix = ["compare torch.cuda.get_arch_list() (the architectures this torch build carries) with "
                   "torch.cuda.get_device_capability() (the GPU's; (8, 9) is sm_89): `torchdoctor env` shows both",
                   "install a torch build that includes this GPU's architecture (a newer wheel, or one for a newer "
                   "CUDA from download.pytorch.org)",
                   "for an extension you built (DeepSpeed ops, flash-attn, apex): rebuild it with "
                   "TORCH_CUDA_ARCH_LIST set to the GPU's capability, e.g. TORCH_CUDA_ARCH_LIST=\"8.9\" pip install "
                   "--no-build-isolation --force-reinstall ..."]
            # torch's warning alone is a failure too: every CUDA kernel of this build fails on that GPU
            out.append(Finding("cuda.no-kernel-image", "fail", what, ev, fix,
                               {**(data_of("no-kernel-image") if "no-kernel-image" in errs else {"count": 0}),
                                "capability": cap}))
        if "driver-too-old" in errs:
            found = next((e.get("found") for e in errs["driver-too-old"]["events"] if e.get("found")), None)
            ver = f" (found driver version {found})" if found else ""
            out.append(Finding(
                "cuda.driver-too-old", "fail",
                f"the NVIDIA driver is too old for the CUDA runtime torch uses{ver}", ev_of("driver-too-old"),
                ["nvidia-smi shows the driver and the newest CUDA it supports (top right); torch.version.cuda is what "
                 "torch needs: `torchdoctor env` shows both",
                 "update the driver, or install a torch build for an older CUDA (pip install torch --index-url "
                 "https://download.pytorch.org/whl/cu118); in a container the host's driver is the one that counts"],
                data_of("driver-too-old", found_version=found)))
        if "ecc" in errs or self._ecc:
            ev = (ev_of("ecc") if "ecc" in errs else []) + [f"line {e['line']}: {e['text']}" for e in self._ecc[:2]]
            out.append(Finding(
                "cuda.ecc", "fail", "an uncorrectable ECC memory error on a GPU: a hardware fault, not the code",
                ev, ["nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER on that node: pending retirements/remaps "
                     "need a GPU reset (nvidia-smi -r) or a reboot",
                     "take the node out of the pool (Slurm: scontrol update nodename=NODE state=drain "
                     "reason=ecc) and tell its admins if it recurs; resume from the last checkpoint elsewhere"],
                {"count": errs.get("ecc", {}).get("count", 0) + len(self._ecc), "lines": list(self._ecc)}))
        if self._xids:
            out.append(self._xid_finding())
        if "library-error" in errs:
            status = errs["library-error"]["events"][0]["msg"]
            meaning = LIBRARY_STATUS.get(status.replace("CUDNN_", "CUBLAS_", 1), "")
            out.append(Finding(
                "cuda.library-error", "fail",
                f"{'cuDNN' if status.startswith('CUDNN') else 'cuBLAS'} failed: {status}"
                + (f" ({meaning})" if meaning else ""), ev_of("library-error"),
                [blocking,
                 "a cuBLAS/cuDNN failure is most often an earlier error surfacing: an out-of-memory (NOT_INITIALIZED, "
                 "ALLOC_FAILED when a handle is created), an illegal memory access or a kernel built for another GPU "
                 "(EXECUTION_FAILED, ARCH_MISMATCH): look for the first CUDA error above, and `torchdoctor env` for "
                 "the GPU's architecture against torch's",
                 "to tell the library from your inputs: the same batch on the CPU; "
                 "torch.backends.cudnn.enabled = False (cuDNN) or a smaller batch / fp32 (cuBLAS) for one run; "
                 "several jobs on one GPU (CUDA_VISIBLE_DEVICES) also exhaust it"],
                data_of("library-error")))
        if "error" in errs:
            msg = errs["error"]["events"][0]["msg"]
            fix = [blocking]
            for words, hint in CUDA_ERROR_HINTS:
                if any(w in msg for w in words):
                    fix.insert(0, hint)
            out.append(Finding("cuda.error", "fail", f"CUDA error: {msg}", ev_of("error"), fix, data_of("error")))
        return out

    def _device_assert_finding(self, ev_of: Any, data_of: Any, blocking: str) -> Finding:
        """A device-side assert, read by its condition (the kernel's ``Assertion `cond` failed`` line): what the
        kernel refused and the fix for that, not a guess; with a non-finite loss before it, that is named first."""
        errs = self._cuda_errors
        ev = (ev_of("device-assert") if "device-assert" in errs else []) + [
            f"line {a['line']}: {a['text']}" for a in self._device_asserts[:2]]
        conds = [a["cond"] for a in self._device_asserts]
        known = next(((what, fix) for c in conds for rx, what, fix in DEVICE_ASSERTS if rx.search(c)), None)
        first_line = min([a["line"] for a in self._device_asserts]
                         + [e["line"] for e in errs.get("device-assert", {}).get("events", [])] or [0])
        nf = self._loss_first if self._loss_first and self._loss_first["line"] <= first_line else None
        if known is not None:
            what, fix0 = known
            title = f"CUDA device-side assert: {what}"
            fix = [fix0, blocking, "run the same batch on the CPU: the same input is a readable error there"]
        elif conds:
            title = f"CUDA device-side assert: a kernel refused its input (`{conds[0]}`)"
            fix = [f"the condition `{conds[0]}` is what the kernel checks: find the op by its file in the assert "
                   "line and check that input's range", blocking,
                   "run the same batch on the CPU: the same input is a readable error there"]
        else:
            title = "CUDA error: device-side assert triggered (the kernel's assert line is not in the log)"
            fix = [blocking, "the assert line (`...Assertion `cond` failed`) goes to the job's stderr: it names the "
                   "kernel and the condition; usual ones are labels or indices out of range (cross_entropy, "
                   "embedding, index_select) and values outside [0, 1] for binary_cross_entropy",
                   "run the same batch on the CPU: the same mistake is a readable error there"]
        if nf is not None and known is not None and "probabilit" in known[0]:
            title += f"; the loss was already {nf['value']} at line {nf['line']}"
            fix.insert(0, f"the loss was non-finite before the assert (line {nf['line']}): NaN predictions fail "
                          "this check, so the NaN is the cause -- find where it starts (torchdoctor.NumericsMonitor), "
                          "lower the learning rate, or compute the loss from logits (BCEWithLogitsLoss)")
        return Finding("cuda.device-assert", "fail", title, ev, fix,
                       {**(data_of("device-assert") if "device-assert" in errs else {"count": 0}),
                        "asserts": list(self._device_asserts), "condition": conds[0] if conds else None,
                        "meaning": known[0] if known else None,
                        "nonfinite_loss_before": nf["line"] if nf else None})

    def _xid_finding(self) -> Finding:
        codes = sorted({x["code"] for x in self._xids})
        meaning = [f"Xid {c}: {XID_MEANINGS[c]}" for c in codes if c in XID_MEANINGS]
        hw = any(c in XID_HARDWARE for c in codes)
        ev = [f"line {x['line']}: {x['text']}" for x in self._xids[:3]] + meaning
        fix = ["nvidia-smi -q on that node (ECC, retired pages, clocks, power); dmesg -T | grep -i xid for the whole "
               "history; NVIDIA's Xid catalog says what each code means"]
        if hw:
            fix.append("a hardware/driver-level Xid: drain the node (Slurm: scontrol update nodename=NODE state=drain "
                       "reason=xid) and reset or replace the GPU; resume from the last checkpoint on another node")
        else:
            fix.append("Xid 13/31/43 usually follow an application error (an illegal memory access in a kernel): "
                       "rerun with CUDA_LAUNCH_BLOCKING=1, compute-sanitizer")
        return Finding("cuda.xid", "fail" if hw else "warn",
                       f"the NVIDIA driver logged Xid {', '.join(map(str, codes))}"
                       + (": a GPU hardware or driver fault" if hw else ": a GPU error (often the program's)"),
                       ev, fix, {"xids": list(self._xids), "codes": codes})


XID_MEANINGS = {
    13: "graphics engine exception (often an out-of-range access in a kernel)",
    31: "GPU memory page fault (an illegal address; the program's or the driver's)",
    43: "GPU stopped processing (the program's kernel was killed after an error)",
    45: "preemptive cleanup after an earlier error", 48: "double-bit ECC error (memory hardware)",
    61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping recorded", 64: "ECC page retirement / row remapping failed",
    74: "NVLink error", 79: "the GPU has fallen off the bus (power, PCIe, overheating)",
    92: "high single-bit ECC error rate", 94: "contained ECC error (restart the program)",
    95: "uncontained ECC error (reset the GPU)", 109: "context switch timeout", 119: "GSP RPC timeout",
    120: "GSP error",
}
#: what a cuBLAS status means (cublas_api.h; cuDNN's statuses of the same names read alike)
LIBRARY_STATUS = {
    "CUBLAS_STATUS_NOT_INITIALIZED": "the library could not start: usually no GPU memory left for its handle",
    "CUBLAS_STATUS_ALLOC_FAILED": "an allocation inside the library failed: out of GPU memory",
    "CUBLAS_STATUS_EXECUTION_FAILED": "its kernel failed to run on the GPU",
    "CUBLAS_STATUS_ARCH_MISMATCH": "the GPU lacks a feature the call needs",
    "CUBLAS_STATUS_INTERNAL_ERROR": "an internal failure, often after an earlier CUDA error",
    "CUBLAS_STATUS_NOT_SUPPORTED": "the call is not supported for these inputs or this GPU",
    "CUBLAS_STATUS_INVALID_VALUE": "an argument the library refused (shapes, strides, dtypes)",
    "CUBLAS_STATUS_MAPPING_ERROR": "GPU memory could not be accessed",
}
XID_HARDWARE = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}
CUDA_ERROR_HINTS = (
    (("initialization error",), "CUDA was initialised before a fork: DataLoader workers / multiprocessing that touch "
     "CUDA need the 'spawn' start method (torch.multiprocessing.set_start_method('spawn')), and no CUDA calls at "
     "import time"),
    (("invalid device ordinal",), "a device index beyond the GPUs visible: CUDA_VISIBLE_DEVICES and "
     "--nproc_per_node / --num_gpus must agree; each rank should use cuda:LOCAL_RANK"),
    (("busy or unavailable",), "the GPU is in exclusive-process mode or taken: nvidia-smi shows its compute mode and "
     "the processes on it"),
    (("system not yet initialized",), "on NVSwitch systems (HGX A100/H100) the fabric manager must run: systemctl "
     "status nvidia-fabricmanager, with the same version as the driver"),
    (("CUBLAS_STATUS", "CUDNN_STATUS"), "a cuBLAS/cuDNN failure is often an earlier error surfacing (an illegal "
     "access, out of memory) or mismatched shapes/dtypes; CUDA_LAUNCH_BLOCKING=1 shows which"),
)

#: A device-side assert's condition (the ``Assertion `...` failed`` line torch's kernels print) -> what it means, the
#: fix. Read from pytorch/pytorch: aten/src/ATen/native/cuda/Loss.cu (binary_cross_entropy: ``input_val >= zero &&
#: input_val <= one``; nll_loss: ``t >= 0 && t < n_classes``), THCUNN's BCECriterion.cu (torch <= 1.4: ``input >= 0.
#: && input <= 1.``), Indexing.cu (index_select / embedding: ``srcIndex < srcSelectDimSize``), IndexKernel.cu and
#: ScatterGatherKernel.cu (``... && "index out of bounds"``), MultiMarginCriterion / MultiLabelMarginCriterion
#: (``cur_target >= 0 && cur_target < dim``).
DEVICE_ASSERTS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"input_val >= zero && input_val <= one|input >= 0\. && input <= 1\."),
     "binary_cross_entropy got an input outside [0, 1] (its input must be probabilities)",
     "binary_cross_entropy / BCELoss takes probabilities in [0, 1]: a NaN prediction fails this check as well as a "
     "raw logit does -- feed logits to BCEWithLogitsLoss (F.binary_cross_entropy_with_logits) instead of a sigmoid + "
     "BCELoss (also the form autocast keeps stable), and check the predictions for nan before the loss"),
    (re.compile(r"t >= 0 && t < n_classes|cur_target >= 0 && cur_target < (?:n_classes|dim)"),
     "a class label is negative or >= the number of classes (cross_entropy / nll_loss)",
     "the assert is cross_entropy's `t >= 0 && t < n_classes`: a label outside [0, num_classes): check "
     "labels.min() and labels.max() against the model's output size; "
     "a padding label of -1 needs ignore_index=-1 (the default ignore_index is -100); labels counted from 1 need -1"),
    (re.compile(r"srcIndex < srcSelectDimSize"),
     "an index >= the size of the table it selects from (embedding / index_select)",
     "the assert is an indexing kernel's (embedding / index_select): an index >= the table's size, a token id >= "
     "the embedding's num_embeddings (a tokenizer with added tokens "
     "needs model.resize_token_embeddings(len(tokenizer))), or an index_select past the dimension"),
    (re.compile(r"index out of bounds"),
     "an index out of bounds in an indexing, gather or scatter kernel",
     "an index outside the indexed dimension (x[idx], gather, scatter, index_put): check idx.min() and idx.max() "
     "against the size of that dimension"),
)

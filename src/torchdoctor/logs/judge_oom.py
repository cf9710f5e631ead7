"""Judging a CUDA out-of-memory (``memory.cuda-oom``) from what its message says: who holds the GPU's memory (other
processes, this process, PyTorch's allocator, memory outside it), how large the one request was against the free
memory and the whole GPU, and whether NCCL or the allocator asked. The fix follows from those facts: a GPU held by
other processes is freed or avoided, a request larger than the GPU is a size bug, fragmentation is an allocator
setting, and only memory this process itself fills calls for a smaller batch.

The message formats (c10/cuda/CUDACachingAllocator.cpp): torch >= 2.1 ``Tried to allocate R. GPU g has a total
capacity of T of which F is free. Process P has S memory in use. ... Including non-PyTorch memory, this process has
S memory in use. Of the allocated memory A is allocated by PyTorch, and U is reserved by PyTorch but unallocated.``
(the ``Process`` entries come from NVML: the other processes on the GPU); torch 1.x-2.0 ``(GPU g; T total capacity; A
already allocated; F free; R reserved in total by PyTorch)`` (``cached`` before 1.6); NCCL's ``Cuda failure 'out of
memory'`` (src/include/checks.h ``CUDACHECK``).
"""

from __future__ import annotations

from ..findings import Finding

GIB = 2**30


def _bytes(text: str | None) -> int | None:
    from ..units import SizeError, parse_bytes

    if not text:
        return None
    try:
        return int(parse_bytes(text.replace(" ", "")))
    except (SizeError, ValueError, TypeError):
        return None


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def oom_sizes(oom: dict) -> dict | None:
    """The bytes of a CUDA out-of-memory message's request, free memory and reserved-but-unallocated memory, when it
    says all three (torch >= 2.1's format)."""
    out = {k: _bytes(oom.get(f)) for k, f in (("tried", "tried_to_allocate"), ("free", "free"),
                                                ("unallocated", "reserved_unallocated"))}
    return out if all(v is not None for v in out.values()) else None  # type: ignore[return-value]


def holders(oom: dict) -> dict:
    """Who holds the GPU, in bytes, from what the message says: ``total``, ``free``, ``others`` (the other processes'
    sum) and ``n_others``, ``this`` (this process, all its memory) or ``reserved`` (PyTorch's allocator, old format),
    and ``outside``: what neither the listed processes nor this process (or its allocator) account for."""
    total, free = _bytes(oom.get("total_capacity")), _bytes(oom.get("free"))
    others = [(pid, _bytes(size) or 0) for pid, size in oom.get("other_processes", ())]
    this, reserved = _bytes(oom.get("this_process")), _bytes(oom.get("reserved"))
    h = {"total": total, "free": free, "others": sum(b for _, b in others), "n_others": len(others),
         "other_sizes": [b for _, b in others], "other_pids": [p for p, _ in others], "this": this,
         "reserved": reserved, "tried": _bytes(oom.get("tried_to_allocate")), "outside": None}
    mine = this if this is not None else reserved
    if total is not None and free is not None and mine is not None:
        h["outside"] = max(0, total - free - mine - h["others"])
    return h


class OomJudge:
    """Mixin: ``_judge_cuda_oom``."""

    def _judge_cuda_oom(self) -> list[Finding]:
        if not self._cuda_oom_n:
            return []
        first = self._cuda_oom[0]
        req = f" allocating {first['tried_to_allocate']}" if first.get("tried_to_allocate") else ""
        where = f" on GPU {first['gpu']}" if "gpu" in first else ""
        gpu = f"GPU {first['gpu']}" if "gpu" in first else "the GPU"
        at = f" at step {first['step']}" if first["step"] is not None else ""
        ev = [f"line {first['line']}: {first['text']}"]
        if self._cuda_oom_n > 1:
            ev.append(f"{self._cuda_oom_n} out-of-memory line(s) in all")
        if self._gpu_mem_max:
            ev.append(f"DeepSpeed's memory report peaked at Max_MA {self._gpu_mem_max[0]} GB, "
                      f"Max_CA {self._gpu_mem_max[1]} GB")
        batch = ("lower the batch per GPU and raise gradient accumulation to keep the global batch "
                 + ("(train_micro_batch_size_per_gpu / gradient_accumulation_steps; per_device_train_batch_size with "
                    "the HF Trainer)" if self._deepspeed else "(per_device_train_batch_size with the HF Trainer)")
                 + "; activation checkpointing (model.gradient_checkpointing_enable()); bf16/fp16 activations")
        if self._deepspeed:
            states = ("torchdoctor ds memory --params <N> --config ds.json estimates the per-GPU model states for "
                      "every ZeRO setup: move to ZeRO-3 or offload the optimizer to CPU if they do not fit")
        else:
            states = ("if the model's own states (weights, gradients, optimizer) do not fit one GPU: shard them "
                      "(FSDP's fully_shard, or DeepSpeed ZeRO-3; `torchdoctor ds memory --params <N>` sizes each "
                      "setup) or use more GPUs")
        fix = [batch, states]
        title = f"CUDA out of memory{where}{at}{req}"
        h = holders(first)
        total = h["total"]
        big = max(GIB, total // 5) if total else GIB
        if first.get("nccl"):
            title = f"CUDA out of memory inside NCCL{at}: the GPU had no room left for NCCL's buffers"
            ev.append("NCCL's own CUDA allocation failed (its WARN line): NCCL allocates its communication buffers on "
                      "the GPU when a communicator starts or first runs a collective")
            fix.insert(0, "leave room for NCCL on every GPU: the model, activations and other processes fill it first "
                          "(nvidia-smi shows who holds it); NCCL_BUFFSIZE (default 4 MiB per channel) and fewer "
                          "channels (NCCL_MAX_NCHANNELS) shrink NCCL's share; make sure each rank uses its own GPU "
                          "(torch.cuda.set_device(local_rank) before init_process_group)")
        if h["tried"] is not None and total is not None and h["tried"] > total:
            title = f"CUDA out of memory{where}{at}: one request of {first['tried_to_allocate']} is larger than the GPU"
            ev.append(f"the request ({first['tried_to_allocate']}) is more than the GPU's whole capacity "
                      f"({first['total_capacity']}): no batch size or allocator setting makes it fit")
            fix = ["a single tensor of that size is a size or shape bug, not memory pressure: find what makes it (a "
                   "sequence length, image size or batch far beyond what was meant; a shape broadcast into an outer "
                   "product; an attention matrix over a whole document) -- print the shapes going into the line of "
                   "the traceback", *fix]
        elif h["n_others"] and h["others"] >= big:
            sizes = h["other_sizes"]
            pids = ", ".join(map(str, h["other_pids"][:6])) + (" ..." if h["n_others"] > 6 else "")
            mine = f"; this process holds {gib(h['this'])}" if h["this"] is not None else ""
            title = (f"CUDA out of memory{where}{at}: {h['n_others']} other process(es) hold {gib(h['others'])} of "
                     f"{gpu}'s {first.get('total_capacity', '?')}")
            ev.append(f"other processes on {gpu} (pids {pids}) hold {gib(h['others'])} together{mine}, "
                      f"{first.get('free', '?')} free")
            fix = [f"free {gpu} or use another: nvidia-smi lists the processes on it (pids {pids}); stop or wait for "
                   "them, or point this job at idle GPUs with CUDA_VISIBLE_DEVICES"]
            if len(sizes) >= 2 and max(sizes) <= max(1.5 * min(sizes), min(sizes) + 2**28) and max(sizes) <= 3 * GIB:
                ev.append(f"{len(sizes)} processes of the same size ({gib(sizes[0])}: what a CUDA context and a "
                          "little memory take) is how the other ranks of a job look when each one starts CUDA on this "
                          "GPU")
                fix.insert(0, f"if those are this job's other ranks, every rank is touching {gpu}: set each rank's "
                              "device before any CUDA call -- torch.cuda.set_device(local_rank) (LOCAL_RANK from the "
                              "launcher), .to(f'cuda:{local_rank}'), map_location=f'cuda:{local_rank}' in torch.load, "
                              "and no bare .cuda() or 'cuda:0' in the code")
            fix.append(batch)
        elif h["outside"] is not None and h["outside"] >= big:
            held = ("this process" if h["this"] is not None else "PyTorch's allocator")
            amount = h["this"] if h["this"] is not None else h["reserved"]
            title = (f"CUDA out of memory{where}{at}: {gib(h['outside'])} of {gpu}'s {first.get('total_capacity')} "
                     "is held outside this process's PyTorch memory (another process?)")
            ev.append(f"{gpu} has {first.get('total_capacity')}; {held} holds {gib(amount)} and "
                      f"{first.get('free')} is free, so {gib(h['outside'])} is held by something else: other "
                      "processes on the GPU (the message does not list them), or this process's memory outside "
                      "PyTorch (the CUDA context, NCCL, cuDNN/cuBLAS workspaces, another library)")
            fix = [f"nvidia-smi shows what holds {gpu}: another job, a notebook kernel or a stale process from an "
                   "earlier run -- stop it, or use an idle GPU (CUDA_VISIBLE_DEVICES); several ranks of one job on "
                   "the same GPU look the same (set torch.cuda.set_device(local_rank))", batch]
        sizes_ = oom_sizes(first)
        if sizes_ is not None and sizes_["tried"] > sizes_["free"] + sizes_["unallocated"] and not (
                total is not None and sizes_["tried"] > total):
            # one request larger than all the memory the allocator could free: defragmenting cannot serve it
            ev.append(f"the one request ({first['tried_to_allocate']}) is more than the GPU's free memory "
                      f"({first['free']}) and what PyTorch holds reserved but unallocated "
                      f"({first['reserved_unallocated']}) together: no allocator setting can serve it")
            fix.insert(0, "that single tensor is too large for the GPU: shrink what makes it (the batch, the image "
                          "resolution or volume, the sequence length; process it in tiles or chunks, e.g. a "
                          "sliding-window inference) -- expandable_segments cannot help a request this size")
        elif any("reserved_unallocated" in o for o in self._cuda_oom):
            fix.append("memory reserved but unallocated is fragmentation: "
                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return [Finding("memory.cuda-oom", "fail", title, ev, fix,
                        {"count": self._cuda_oom_n, "events": list(self._cuda_oom),
                         "held_by_other_processes": h["others"] or None, "held_outside": h["outside"],
                         "max_allocated_gb": self._gpu_mem_max[0] if self._gpu_mem_max else None,
                         "max_cached_gb": self._gpu_mem_max[1] if self._gpu_mem_max else None})]

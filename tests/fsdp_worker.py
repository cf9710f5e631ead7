"""Run under torchrun (gloo, 2 ranks): the monitor on FSDP2, FSDP1 and tensor-parallel models.

``python fsdp_worker.py OUT_DIR WRAP`` with WRAP one of fsdp2, fsdp2mp (bf16 mixed precision), fsdp1
(use_orig_params=True), tp. For every gradient level: a clean run (3 steps, host syncs counted against
the bare step), then a run where rank 1 alone gets a nan input at step 1. Each rank writes
``<WRAP>-rank<r>.json``: per level the steps done, the error's first frame, bad ranks and report text,
whether this rank's parameters and optimizer state are bit-identical to before the bad step, the module
names the monitor saw, and the extra host syncs per step. Used by tests/test_engines_fsdp.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from conftest import leave_worker
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.syncs import SyncCounter


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def build(wrap: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if wrap.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        kw = kw if wrap == "fsdp2mp" else {}
        for b in model.blocks:
            fully_shard(b, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     device_id=torch.device("cpu"))
    elif wrap == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()})
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [local(p) for p in model.parameters()] + state


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def batch(wrap: str, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 8, generator=g)
    return x if wrap == "tp" else x + rank  # tensor parallel ranks share the batch


def train_step(model, opt, x):
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def run_level(wrap: str, grads: str, out_dir: str) -> dict:
    rank = dist.get_rank()
    model = build(wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, batch(wrap, 0, rank))  # optimizer state exists from here on
    with SyncCounter() as bare:
        train_step(model, opt, batch(wrap, 1, rank))
    result: dict = {"grads": grads}
    with NumericsMonitor(model, optimizer=opt, grads=grads, report_dir=os.path.join(out_dir, f"{wrap}-{grads}")) as mon:
        result["names"] = sorted({i.name for i in mon._watched.infos.values()})
        result["classes"] = sorted({i.cls for i in mon._watched.infos.values()})
        train_step(model, opt, batch(wrap, 2, rank))
        with SyncCounter() as watched:
            train_step(model, opt, batch(wrap, 3, rank))
        result["extra_syncs"] = watched.count - bare.count
        result["clean_steps"] = mon.step_index
        before = snapshot(model, opt)
        x = batch(wrap, 4, rank)
        if rank == 1:
            x[0, 0] = float("nan")
        try:
            train_step(model, opt, x)
            result["error"] = None
        except NonFiniteError as e:
            first = e.first.to_json() if e.first else None
            result["error"] = {"first": first, "bad_ranks": e.details.bad_ranks, "report": e.report}
        result["identical"] = identical(before, snapshot(model, opt))
        result["steps"] = mon.step_index
    return result


def main(out_dir: str, wrap: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {grads: run_level(wrap, grads, out_dir) for grads in ("none", "params", "modules")}
    with open(os.path.join(out_dir, f"{wrap}-rank{rank}.json"), "w") as fh:  # stdout would interleave
        json.dump(results, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_worker()  # (conftest: past a torch abort at interpreter exit)

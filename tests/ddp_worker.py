"""Run under torchrun (gloo): DDP training where rank 1 alone gets a non-finite input at step 2
(mode "train"; "accelerate": the same through accelerate's prepare() and backward()), a nan in an
evaluation forward under no_grad after step 1 (mode "eval"), or, at step 2 on rank 1 alone, a batch whose
backward goes inf in a parameter-free module (mode "backward": sqrt'(0); every rank's gradients are inf after
DDP's all-reduce), or, at step 2 on rank 1 alone, an inf that its replay does not reproduce (mode "transient",
with ``transient="skip"``: every rank refuses that step and goes on).

Writes result-rank<r>.json (what its monitor reported) into the report folder; used by tests/test_ddp.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from conftest import leave_worker
from torchdoctor import NonFiniteError, NumericsMonitor


class SqrtAbs(torch.nn.Module):
    def forward(self, x):
        return x.abs().sqrt()


class Flaky(torch.nn.Module):
    """Its output goes inf on the first call after ``armed`` is set, never again: a transient fault."""

    armed = False

    def forward(self, x):
        if self.armed:
            self.armed = False
            return x + float("inf")
        return x


def main(report_dir: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if mode == "backward":  # no bias: a row of zeros stays a row of zeros whatever the updates
        model[0], model[1] = torch.nn.Linear(8, 16, bias=False), SqrtAbs()
    if mode == "transient":
        model[1] = Flaky()
    backward = torch.Tensor.backward
    if mode == "accelerate":  # accelerate's own DDP wrapper and AcceleratedOptimizer, as users write it
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        ddp, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        backward = accelerator.backward
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    result = {"rank": rank, "error": None, "wrapped": type(ddp).__name__, "optimizer": type(opt).__name__}
    before = None
    try:
        skip = "skip" if mode == "transient" else "raise"
        with NumericsMonitor(ddp, optimizer=opt, report_dir=report_dir, transient=skip) as mon:
            for step in range(5):
                x = torch.randn(4, 8)
                if mode in ("train", "accelerate") and rank == 1 and step == 2:
                    x[0, 3] = float("inf")
                if mode == "backward" and rank == 1 and step == 2:
                    x[0] = 0.0  # its hidden row is 0: sqrt's derivative there is inf
                if mode == "transient" and rank == 1 and step == 2:
                    model[1].armed = True
                before = [p.detach().clone() for p in model.parameters()]
                backward(ddp(x).pow(2).mean())
                opt.step()
                opt.zero_grad()
                if mode == "eval" and step == 1:
                    with torch.no_grad():
                        ddp(torch.full((2, 8), float("nan") if rank == 1 else 1.0))
    except NonFiniteError as e:
        result["error"] = {"first": e.first.to_json() if e.first else None, "report": e.report,
                           "replay": e.details.replay, "bad_ranks": e.details.bad_ranks}
    result["steps"] = mon.step_index
    result["transients"] = [(t.step, t.replay, t.bad_ranks) for t in mon.transients]
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    result["ranks_agree"] = all(torch.equal(gathered[0], w) for w in gathered)
    result["identical"] = before is not None and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with open(os.path.join(report_dir, f"result-rank{rank}.json"), "w") as fh:  # stdout would interleave
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_worker()  # (conftest: past a torch abort at interpreter exit)

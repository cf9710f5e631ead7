"""Run under torchrun (gloo, 2 ranks): cases where the ranks must decide alike, or one rank would hang.

``python agreement_worker.py OUT_DIR MODE``:
  scaler-fwd           DDP + GradScaler; rank 0 alone gets an inf input: a forward inf is never a loss-scale
                       overflow, so both ranks raise (rank 1 only sees inf gradients)
  scaler-bwd           DDP + GradScaler; rank 1's backward alone overflows at the loss scale (finite without it):
                       both ranks record it and go on
  scaler-invalid       the same with a backward that makes inf and nan whatever the scale: rank 1 names it as an
                       invalid op and both ranks raise at once (the scaler would skip every step)
  compiled-collective  a compiled block whose forward all-reduces (an MoE router's load counts); its output goes
                       inf on rank 1: the eager re-run must stop before the collective, both ranks raise
  attach-nan           FSDP2 with a nan in rank 1's shard of one weight: both ranks refuse at attach
  weight-inf           FSDP2; after a clean step an inf lands in rank 1's shard of one weight: every rank's forward
                       goes inf at that module (the weight is gathered), and every rank names rank 1's weight
  eval-one-rank        DDP without the optimizer passed (steps end at forwards); rank 0 alone evaluates under
                       no_grad after each step, and its second evaluation holds a nan: no hang, both stop
Each rank writes ``<MODE>-rank<r>.json``. Used by tests/test_rank_agreement.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from conftest import Boom, leave_worker
from torchdoctor import NonFiniteError, NumericsMonitor


class _GradTimes(torch.autograd.Function):
    """Identity in the forward; the gradient times ``factor`` in the backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class ScaleBoom(nn.Module):
    """A backward that overflows fp32 only at the loss scale: the gradient times 1e38 (the gradient reaching it, ~9
    at GradScaler's scale 256, makes ~9e38 > 3.4e38; at scale 1, ~4e36, it stays finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = False

    def forward(self, x):
        return _GradTimes.apply(x, 1e38) if self.enabled else x * 1


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.proj = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        counts = torch.bincount(self.gate(x).argmax(-1), minlength=4).float()
        dist.all_reduce(counts)  # the global load: a collective inside the forward
        return self.proj(x) * (1 + 0 * counts.sum())


def scaler_run(mode: str, rank: int, out: str) -> dict:
    torch.manual_seed(0)
    boom = ScaleBoom() if mode == "scaler-bwd" else Boom()
    boom.enabled = False
    model = nn.Sequential(nn.Linear(8, 16), boom, nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    result: dict = {"error": None}
    with NumericsMonitor(ddp, optimizer=opt, scaler=scaler, report_dir=out) as mon:
        try:
            for step in range(5):
                x = torch.randn(4, 8)
                if mode == "scaler-fwd" and rank == 0 and step == 2:
                    x[0, 0] = float("inf")
                boom.enabled = mode in ("scaler-bwd", "scaler-invalid") and rank == 1 and step in (1, 2)
                scaler.scale(ddp(x).pow(2).mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        except NonFiniteError as e:
            result["error"] = {"first": e.first.to_json() if e.first else None, "bad_ranks": e.details.bad_ranks,
                               "cause": e.details.cause}
        result["steps"] = mon.step_index
        result["overflows"] = [(o.step, o.scale) for o in mon.overflows]
    return result


def collective_run(rank: int, out: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Router(), nn.Linear(8, 2))
    model[1].compile(backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    result: dict = {"error": None}
    with NumericsMonitor(model, optimizer=opt, report_dir=out, grads="modules") as mon:
        try:
            for step in range(3):
                if step == 1 and rank == 1:
                    with torch.no_grad():
                        model[1].proj.weight.fill_(3e38)
                model(torch.randn(4, 8)).pow(2).mean().backward()
                for p in model.parameters():  # data parallel by hand (the router's gate gets no gradient)
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                opt.step()
                opt.zero_grad()
        except NonFiniteError as e:
            result["error"] = {"first": e.first.to_json() if e.first else None, "bad_ranks": e.details.bad_ranks,
                               "notes": e.details.notes}
        result["steps"] = mon.step_index
    return result


def attach_run(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    if rank == 1:
        with torch.no_grad():
            model[0].weight.to_local()[0, 0] = float("nan")  # only in rank 1's shard
    try:
        NumericsMonitor(model, report_dir=out).close()
        return {"error": None}
    except NonFiniteError as e:
        return {"error": {"first": e.first.to_json() if e.first else None, "bad_ranks": e.details.bad_ranks}}


def weight_run(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    result: dict = {"error": None}
    with NumericsMonitor(model, optimizer=opt, report_dir=out) as mon:
        try:
            for step in range(3):
                if step == 1 and rank == 1:
                    with torch.no_grad():
                        model[2].weight.to_local()[0, 0] = float("inf")  # only in rank 1's shard
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        except NonFiniteError as e:
            result["error"] = {"first": e.first.to_json() if e.first else None, "bad_ranks": e.details.bad_ranks,
                               "cause": e.details.cause, "diagnosis": e.details.diagnosis}
        result["steps"] = mon.step_index
    return result


def eval_run(rank: int, out: str) -> dict:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    result: dict = {"error": None}
    try:
        with NumericsMonitor(ddp, report_dir=out) as mon:
            for step in range(4):
                ddp(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if rank == 0:
                    with torch.no_grad():
                        ddp.module(torch.full((2, 8), float("nan") if step == 1 else 1.0))
    except NonFiniteError as e:
        result["error"] = {"first": e.first.to_json() if e.first else None, "bad_ranks": e.details.bad_ranks}
    result["steps"] = mon.step_index
    return result


def main(out: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode.startswith("scaler"):
        result = scaler_run(mode, rank, out)
    elif mode == "compiled-collective":
        result = collective_run(rank, out)
    elif mode == "eval-one-rank":
        result = eval_run(rank, out)
    elif mode == "weight-inf":
        result = weight_run(rank, out)
    else:
        result = attach_run(rank, out)
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_worker()  # (conftest: past a torch abort at interpreter exit)

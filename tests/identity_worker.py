"""Healthy training runs whose every loss and final weight is written bit for bit
(tests/test_seeing_changes_nothing.py).

``python identity_worker.py KIND OUT_DIR [--with-monitor]``. KIND: ``scaler`` (an fp16-autocast loop with a GradScaler),
``ddp`` (DDP under torchrun, gloo, AdamW), ``compile`` (a ``torch.compile``'d model, AdamW). ``--with-monitor`` attaches
``NumericsMonitor`` in the script (the switch attaches it from outside: ``torchdoctor run --numerics``). Each rank
writes ``OUT_DIR/result-rank<r>.json``: the losses as exact hex floats and a SHA-256 of every parameter's bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
from torch import nn

from train_step import update

STEPS = 5


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Dropout(0.1), nn.Linear(64, 1))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(kind: str, out_dir: str, monitor: bool) -> None:
    rank = 0
    model = net()
    if kind == "ddp":
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "compile":
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if kind == "scaler" else None
    mon = None
    if monitor:
        from torchdoctor import NumericsMonitor

        mon = NumericsMonitor(model, opt, scaler=scaler, report_dir=out_dir)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    torch.manual_seed(2 + rank)  # (dropout's masks: the same with or without the monitor)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = (model(x).float() - y).pow(2).mean()
        losses.append(loss.item().hex())
        update(loss, opt, scaler)
    if mon is not None:
        mon.close()
    with open(os.path.join(out_dir, f"result-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"losses": losses, "weights": digest(model)}, f)
    if kind == "ddp":
        torch.distributed.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["scaler", "ddp", "compile"])
    ap.add_argument("out_dir")
    ap.add_argument("--with-monitor", dest="monitor", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    run(args.kind, args.out_dir, args.monitor)
    return 0


if __name__ == "__main__":
    sys.exit(main())

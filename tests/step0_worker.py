"""Training programs shaped like the ones people run, faulty from their first step (tests/test_step0.py).

``python step0_worker.py KIND FAULT OUT_DIR [--api] [--fix]``. KIND: ``scaler`` (an fp16-autocast loop with a
GradScaler, nanoGPT's recipe), ``plain`` (the same loop without a scaler), ``lightning`` (a LightningModule whose
``training_step`` calls its submodules, at ``precision="16-true"``), ``where`` (an fp32 loop with a masked
normalisation), ``where-scaler`` (the same under fp16 autocast with a GradScaler), ``where-loss16`` (its loss in
fp16 inside the model), ``where-nested16`` (the same, the normalisation a submodule). FAULT: ``overflow`` (a weight
scaled so that its fp16 output overflows from step 0), ``grad-overflow`` (a finite forward whose weight gradient
overflows in its fp16 matmul), ``nan-batch`` (a nan in the first batch), ``invalid`` (``where*`` only: a
``torch.where`` whose unselected branch divides 0 by 0, so the forward is finite and the backward is nan), ``none``
(the healthy twin). ``--api``: the script attaches
``NumericsMonitor`` itself (otherwise it knows nothing of torchdoctor: run it under ``torchdoctor run --numerics``).
``--fix FIX``: apply the fix a report proposed: ``keep_fp32:NAME`` (that module in fp32), ``bf16`` (bf16 autocast
instead of fp16), ``safe-where`` (the where's safe denominator); several, comma-separated.
Writes ``OUT_DIR/result.json``: the steps that updated the weights, the losses, and how the script ended.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from train_step import update

STEPS = 6


class Net(nn.Module):
    """Two blocks and a head. ``overflow``: ``block1``'s Linear scaled so that its fp16 output overflows (65504) from
    the first step; ``grad-overflow``: scaled less, so the forward stays finite but the head's weight gradient (its
    input, ~1e3, times the gradient it receives, summed over the batch) overflows in its fp16 matmul."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block0 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.block1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        factor = {"overflow": 3e5, "grad-overflow": 2e3}.get(fault)
        if factor is not None:
            with torch.no_grad():
                self.block1[0].weight.mul_(factor)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.block1(self.block0(x)))
        return out, out.float().pow(2).mean()  # (logits, loss): the model computes its loss, as nanoGPT's does


class Masked(nn.Module):
    """A masked mean normalisation: ``torch.where`` keeps the rows with a count, but the other branch still divides by
    a count of 0 -- finite forward, 0/0 in the backward (``fixed``: the safe-denominator repair). ``loss16``: the
    model returns its loss, computed in fp16 under autocast as timm's task does on a CPU -- a GradScaler's scaled
    gradient (65536) is then inf in the loss's own dtype, and step 0's first bad value is that gradient, not the nan."""

    def __init__(self, fixed: bool, loss16: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.fixed = fixed
        self.loss16 = loss16

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * mask
        count = mask.sum(-1, keepdim=True)
        safe = torch.where(count > 0, count, torch.ones_like(count)) if self.fixed else count
        mean = torch.where(count > 0, h.sum(-1, keepdim=True) / safe, torch.zeros_like(count))
        out = self.head(h - mean)
        return out.pow(2).mean() if self.loss16 else out


class Nested(nn.Module):
    """:class:`Masked` inside a model that computes its loss in fp16 (``where-nested16``): the torch.where line is in
    the forward of ``inner``, and the first bad value a GradScaler's step shows is the scaled loss gradient at the
    model's output -- the fault is named where its line ran (``inner``), not where the scale overflowed."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.inner = Masked(fixed)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.inner(x, mask).pow(2).mean()


def batches(fault: str, n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = [torch.randn(8, 16, generator=g) for _ in range(n)]
    if fault == "nan-batch":
        out[0][3, 5] = float("nan")
    return out


def masks(fault: str, n: int = STEPS) -> list[torch.Tensor]:
    out = [torch.ones(8, 16) for _ in range(n)]
    if fault == "invalid":
        for m in out:
            m[2] = 0  # a row with nothing kept: its count is 0
    return out


def write(out_dir: str, data: dict) -> None:
    with open(os.path.join(out_dir, "result.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)


def keep(model: nn.Module, fix: str | None) -> None:
    """``keep_fp32:NAME[,keep_fp32:NAME...]``: those modules in fp32."""
    from torchdoctor import keep_fp32

    for one in (fix or "").split(","):
        if one.startswith("keep_fp32:"):
            keep_fp32(model, one.split(":", 1)[1])


def plain_loop(kind: str, fault: str, out_dir: str, api: bool, fix: str | None = None) -> dict:
    where = kind.startswith("where")
    fixed = "safe-where" in (fix or "").split(",")
    model = (Nested(fixed) if kind == "where-nested16" else Masked(fixed, loss16=kind == "where-loss16")) if where \
        else Net(fault)
    keep(model, fix)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if kind in ("scaler", "where-scaler", "where-loss16", "where-nested16") \
        else None
    fp16 = kind != "where"
    dtype = torch.bfloat16 if "bf16" in (fix or "").split(",") else torch.float16
    mon = None
    if api:
        from torchdoctor import NumericsMonitor

        mon = NumericsMonitor(model, opt, scaler=scaler, report_dir=out_dir)
    result = {"updates": 0, "losses": [], "ended": "normally"}
    try:
        for step, (x, m) in enumerate(zip(batches(fault), masks(fault))):
            with torch.autocast("cpu", dtype=dtype, enabled=fp16):
                if kind in ("where-loss16", "where-nested16"):
                    loss = model(x, m)
                else:
                    loss = model(x, m).float().pow(2).mean() if where else model(x)[1]
            result["losses"].append(loss.item())
            before = [p.detach().clone() for p in model.parameters()]
            update(loss, opt, scaler)
            if any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
                result["updates"] += 1
            result["steps"] = step + 1
    except Exception as e:
        result["ended"] = type(e).__name__
        raise
    finally:
        if mon is not None:
            mon.close()
        result["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        result["params"] = [p.detach().tolist() for p in model.parameters()]
        write(out_dir, result)
    return result


def lightning_loop(fault: str, out_dir: str, api: bool, fix: str | None = None) -> dict:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            net = Net(fault)
            self.encoder = net.block0
            self.body = net.block1
            self.head = net.head

        def training_step(self, batch, batch_idx):
            (x,) = batch
            h = self.body(self.encoder(x))  # the README's shape: the step calls submodules, never self(x)
            return self.head(h).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-4)  # (1e-8 is 0 in fp16: 16-true needs more)

    model = Lit()
    keep(model, fix)
    data = torch.utils.data.TensorDataset(torch.cat(batches(fault)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    callbacks = []
    if api:
        from torchdoctor.integrations.lightning import NumericsCallback

        callbacks.append(NumericsCallback(report_dir=out_dir))
    precision = "bf16-true" if "bf16" in (fix or "").split(",") else "16-true"
    trainer = L.Trainer(max_epochs=1, precision=precision, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    result = {"ended": "normally"}
    try:
        trainer.fit(model, loader)
    except Exception as e:
        result["ended"] = type(e).__name__
        raise
    finally:
        result["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        result["steps"] = int(trainer.global_step)
        write(out_dir, result)
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["scaler", "plain", "lightning", "where", "where-scaler", "where-loss16",
                                         "where-nested16"])
    ap.add_argument("fault", choices=["overflow", "grad-overflow", "nan-batch", "invalid", "none"])
    ap.add_argument("out_dir")
    ap.add_argument("--api", action="store_true")
    ap.add_argument("--fix", default=None)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.kind == "lightning":
        lightning_loop(args.fault, args.out_dir, args.api, args.fix)
    else:
        plain_loop(args.kind, args.fault, args.out_dir, args.api, args.fix)
    return 0


if __name__ == "__main__":
    sys.exit(main())

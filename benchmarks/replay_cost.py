"""What a replay costs: the extra time of a bad step, and the bytes kept per micro-batch for one (issue 21).

Run from the repository root::

    .venv/bin/python benchmarks/replay_cost.py              # ~1 min on 2 cores
    .venv/bin/python benchmarks/replay_cost.py --json out.json

At the default ``watch="boundaries"`` a healthy step records the model's call only; a bad step is replayed with
every module watched. Measured on a GPT-2 built from a config (4 layers, d 128, vocab 1024, 64 tokens, CPU, one
thread), AdamW, for batch sizes 1, 4 and 16:

* the healthy step (bare and watched at the boundaries, interleaved), and the bad step: a healthy step whose
  forward is made to go inf in block 2's MLP (a forward hook multiplies by inf) or whose backward is (a tensor
  hook on that MLP's output makes its gradient inf), raised as ``NonFiniteError`` after the replay -- its time
  minus the healthy watched step's is what the replay cost;
* what a stop costs under fp16 autocast, where the fix is checked before it is printed (issue 31): the healthy
  autocast step (watched), and the same step with block 2's MLP weight scaled past fp16's range from the start
  (raised after the replay and the fix check, which tries the regions around it, bf16 and fp32 on the bad step);
* the bytes kept for a backward replay per micro-batch: the model returning its own loss (``labels=``: the 0-d
  loss's gradient) and the model returning logits with the loss computed by the loop (the logits' gradient:
  batch x tokens x vocab x 4 bytes), against ``calls.GRAD_BYTES_KEPT``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.record import calls

VOCAB, TOKENS = 1024, 64


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).train()


def batch_of(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, TOKENS), generator=torch.Generator().manual_seed(n))


def step(model, opt, ids, loss_outside: bool = False, fp16: bool = False) -> None:
    if fp16:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    elif loss_outside:
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits.view(-1, VOCAB), ids.view(-1)).backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def fault(model: torch.nn.Module, phase: str):
    """A handle that makes block 2's MLP output inf (forward) or its gradient inf (backward)."""
    mlp = model.transformer.h[2].mlp
    if phase == "fwd":
        return mlp.register_forward_hook(lambda m, a, out: out * float("inf"))

    def hook(m, a, out):
        if out.requires_grad:
            out.register_hook(lambda g: g * float("inf"))

    return mlp.register_forward_hook(hook)


def cost(batch: int, reps: int) -> dict:
    base = gpt2()
    ids = batch_of(batch)
    bare_model = copy.deepcopy(base)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = NumericsMonitor(model, opt, report_dir="/tmp/torchdoctor-replay-cost")
    for _ in range(2):
        step(bare_model, bare_opt, ids)
        step(model, opt, ids)
    bare, healthy = [], []
    for _ in range(reps):  # interleaved
        bare.append(timed(lambda: step(bare_model, bare_opt, ids), 1))
        healthy.append(timed(lambda: step(model, opt, ids), 1))
    out = {"batch": batch, "bare_ms": statistics.median(bare) * 1e3, "healthy_ms": statistics.median(healthy) * 1e3}
    for phase in ("fwd", "bwd"):
        handle = fault(model, phase)

        def bad():
            try:
                step(model, opt, ids)
            except NonFiniteError as e:
                assert e.details.replay == "reproduced", e.details.replay_reason
            else:
                raise AssertionError("the bad step was not found")

        out[f"bad_{phase}_ms"] = timed(bad, max(3, reps // 3)) * 1e3
        handle.remove()
    mon.close()
    out.update(fix_check_cost(base, ids, reps))
    out["kept_bytes_loss"] = kept_bytes(base, ids, loss_outside=False)
    out["kept_bytes_logits"] = kept_bytes(base, ids, loss_outside=True)
    return out


def fix_check_cost(base: torch.nn.Module, ids: torch.Tensor, reps: int) -> dict:
    """A healthy fp16-autocast step (watched), and a stop whose fix is checked: block 2's MLP overflows fp16."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = {}
    with NumericsMonitor(model, opt, report_dir="/tmp/torchdoctor-replay-cost"):
        for _ in range(2):
            step(model, opt, ids, fp16=True)
        out["healthy_fp16_ms"] = timed(lambda: step(model, opt, ids, fp16=True), reps) * 1e3
        weight = model.transformer.h[2].mlp.c_fc.weight
        saved = weight.detach().clone()
        checks = []

        def bad():
            with torch.no_grad():
                weight.mul_(3e4)
            try:
                step(model, opt, ids, fp16=True)
            except NonFiniteError as e:
                checks.append(e.details.fix_check)
            else:
                raise AssertionError("the bad step was not found")
            finally:
                with torch.no_grad():
                    weight.copy_(saved)

        out["stop_fp16_ms"] = timed(bad, max(3, reps // 3)) * 1e3
        out["fix_check"] = checks[-1]
    return out


def kept_bytes(base: torch.nn.Module, ids: torch.Tensor, loss_outside: bool) -> int:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    seen = []
    original = calls._Keeper.__call__

    def spy(self, grad):
        original(self, grad)
        seen.append(self.call.grad_bytes if self.call.dropped is None else -grad.numel() * grad.element_size())

    calls._Keeper.__call__ = spy
    try:
        with NumericsMonitor(model, opt, report_dir="/tmp/torchdoctor-replay-cost"):
            step(model, opt, ids, loss_outside)
    finally:
        calls._Keeper.__call__ = original
    return seen[-1] if seen else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json", metavar="PATH", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in (1, 4, 16):
        print(f"  batch {batch} ...", file=sys.stderr, flush=True)
        rows.append(cost(batch, args.reps))
    print(f"GPT-2 4 layers d 128, vocab {VOCAB}, {TOKENS} tokens, AdamW, one thread, thread CPU time (median)")
    print(f"{'batch':>5} {'bare':>9} {'healthy':>9} {'bad fwd':>9} {'replay':>7} {'bad bwd':>9} {'replay':>7} "
          f"{'kept (loss)':>12} {'kept (logits)':>14}")
    for r in rows:
        logits = r["kept_bytes_logits"]
        shown = f"{logits / 2**20:.2f} MiB" if logits >= 0 else f"not ({-logits / 2**20:.0f} MiB)"
        print(f"{r['batch']:>5} {r['bare_ms']:>7.1f}ms {r['healthy_ms']:>7.1f}ms {r['bad_fwd_ms']:>7.1f}ms "
              f"{r['bad_fwd_ms'] / r['healthy_ms']:>6.2f}x {r['bad_bwd_ms']:>7.1f}ms "
              f"{r['bad_bwd_ms'] / r['healthy_ms']:>6.2f}x {r['kept_bytes_loss']:>10} B {shown:>14}")
    print(f"(kept: the gradient at the model's output held until the step is checked, bound "
          f"{calls.GRAD_BYTES_KEPT / 2**20:.0f} MiB per micro-batch; 'not': above it, not kept)")
    print("\nunder fp16 autocast: a stop whose fix is checked on the bad step (block 2's MLP past fp16's range)")
    print(f"{'batch':>5} {'healthy':>9} {'stop':>9} {'ratio':>7}  fix check")
    for r in rows:
        print(f"{r['batch']:>5} {r['healthy_fp16_ms']:>7.1f}ms {r['stop_fp16_ms']:>7.1f}ms "
              f"{r['stop_fp16_ms'] / r['healthy_fp16_ms']:>6.2f}x  {r['fix_check']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the numerics monitor dispatches per training step, and its host cost per hooked module.

Run from the repository root::

    .venv/bin/python benchmarks/numerics_dispatch.py            # both parts, ~2 min on 2 cores
    .venv/bin/python benchmarks/numerics_dispatch.py --ops      # op counts only (~30 s)
    .venv/bin/python benchmarks/numerics_dispatch.py --json out.json

Why: on an accelerator every dispatched ATen op costs host time (~5-20 us) and usually a kernel launch, and a
mid-size model's step is launch-bound, so the monitor's ops *are* its cost there. Both parts run on a CPU:

* Ops. ``torchdoctor.syncs.OpCounter`` (a ``TorchDispatchMode``) counts every op of the third training step of
  the T5 of issue 12 (4+4 layers, d_model 256, vocab 32128, batch 4, 32/16 tokens, SGD), bare and at each
  level, twice: as the CPU reduces (tensors above 4K elements one by one: on a CPU that is faster per element)
  and as an accelerator reduces (``windows.accelerator_path()``: every window through the multi-tensor ops).
* Host cost. A tiny T5 (d_model 32, d_ff 64, 4+4 layers, 2 heads, d_kv 16, vocab 128, batch 1, 8/8 tokens, SGD,
  one thread), where compute is negligible: the CPU picture of a launch-bound GPU step. Bare, each level (the
  default ``watch="boundaries"``, and ``watch="every-module"`` -- the default before issue 21 -- at each ``grads``),
  transformers' ``DebugUnderflowOverflow``, two floors (a no-op forward hook on every module; one ``aminmax`` per
  module output), and ``headroom=True`` every 100 steps and every step, interleaved round-robin, thread CPU time (a
  busy machine inflates wall time, not this). Reported as the median ratio to the bare step and microseconds per
  hooked module per step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time

import torch
from transformers import T5Config, T5ForConditionalGeneration
from transformers.debug_utils import DebugUnderflowOverflow

from torchdoctor import NumericsMonitor

try:
    from torchdoctor.numerics.measure.windows import accelerator_path
except ImportError:  # a torchdoctor from before the windows: one path, the same on every device
    accelerator_path = contextlib.nullcontext
from torchdoctor.syncs import OpCounter

LEVELS = ("none", "params", "modules")
# monitor variants: name -> NumericsMonitor options (a tree from before issue 21 has no watch=: every module)
MONITORS = {
    "boundaries, params": {"watch": "boundaries", "grads": "params"},  # the default
    "boundaries, modules": {"watch": "boundaries", "grads": "modules"},
    "every-module, none": {"watch": "every-module", "grads": "none"},
    "every-module, params": {"watch": "every-module", "grads": "params"},
    "every-module, modules": {"watch": "every-module", "grads": "modules"},
    # headroom=True (issue 22): every 100th step watched every module (amortized), and every step (its own cost)
    "headroom every 100": {"watch": "boundaries", "grads": "params", "headroom": True, "headroom_every": 100},
    "headroom every step": {"watch": "boundaries", "grads": "params", "headroom": True, "headroom_every": 1},
}


def monitor(model, opt, options: dict):
    try:
        return NumericsMonitor(model, optimizer=opt, **options)
    except TypeError:  # no watch= (or headroom=) in this tree
        return NumericsMonitor(model, optimizer=opt, grads=options["grads"])


def t5(d_model, d_ff, layers, heads, d_kv, vocab, gated) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T5Config(d_model=d_model, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                   d_kv=d_kv, vocab_size=vocab, feed_forward_proj="gated-gelu" if gated else "relu",
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg).train()


def batch_of(vocab: int, n: int, src: int, tgt: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1, vocab, (n, src), generator=g),
            "labels": torch.randint(1, vocab, (n, tgt), generator=g)}


class Variant:
    def __init__(self, name: str, base: torch.nn.Module):
        self.name = name
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.monitor = None
        if name in LEVELS:  # (the op counts: every module, as the ceilings of tests/test_monitor_ops.py)
            self.monitor = monitor(self.model, self.opt, {"watch": "every-module", "grads": name})
            self.monitor.__enter__()
        elif name in MONITORS:
            self.monitor = monitor(self.model, self.opt, MONITORS[name])
            self.monitor.__enter__()
        elif name == "transformers":
            DebugUnderflowOverflow(self.model)
        elif name == "no-op hook":
            for m in self.model.modules():
                m.register_forward_hook(lambda *_: None)
        elif name == "aminmax per output":
            for m in self.model.modules():
                m.register_forward_hook(_aminmax_hook)

    def step(self, batch: dict) -> None:
        self.model(**batch).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.__exit__(None, None, None)


def _aminmax_hook(module, args, output):
    out = output[0] if isinstance(output, tuple) and output else output
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        with torch.no_grad():
            torch.aminmax(out)


def count_ops(base, batch, accelerator: bool) -> dict:
    rows = {}
    for name in ("bare", *LEVELS, "boundaries, params"):
        v = Variant(name, base)
        with accelerator_path() if accelerator else contextlib.nullcontext():
            v.step(batch)
            v.step(batch)
            with OpCounter() as ops:
                v.step(batch)
        v.close()
        rows[name] = ops
    bare = rows["bare"]
    return {name: {"ops": c.count, "extra_ops": c.count - bare.count, "extra_syncs": c.syncs - bare.syncs,
                   "top_extra": (c.by_op - bare.by_op).most_common(6)} for name, c in rows.items()}


def host_cost(reps: int, steps: int) -> dict:
    torch.set_num_threads(1)
    base = t5(32, 64, 4, 2, 16, 128, gated=False)
    batch = batch_of(128, 1, 8, 8)
    modules = sum(1 for _ in base.modules())
    names = ["bare", *MONITORS, "transformers", "no-op hook", "aminmax per output"]
    variants = [Variant(n, base) for n in names]
    for v in variants:
        for _ in range(5):
            v.step(batch)
    for rep in range(reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            t0 = time.thread_time()
            for _ in range(steps):
                v.step(batch)
            v.times.append((time.thread_time() - t0) / steps)
        if (rep + 1) % max(1, reps // 10) == 0 or rep + 1 == reps:  # (ten progress lines, not one per rep)
            print(f"  rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
    bare = variants[0].times
    out = {"hooked_modules": modules}
    for v in variants:
        ratio = statistics.median(t / b for t, b in zip(v.times, bare))
        out[v.name] = {"median_step_ms": statistics.median(v.times) * 1e3, "ratio": ratio,
                       "us_per_module": (statistics.median(t - b for t, b in zip(v.times, bare))) * 1e6 / modules}
        v.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", action="store_true", help="op counts only")
    ap.add_argument("--reps", type=int, default=20, help="interleaved repetitions of the host-cost part")
    ap.add_argument("--steps", type=int, default=10, help="steps per variant per repetition")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)

    base = t5(256, 1024, 4, 4, 64, 32128, gated=True)
    batch = batch_of(32128, 4, 32, 16)
    modules = sum(1 for _ in base.modules())
    res = {"torch": torch.__version__, "ops_modules": modules,
           "ops_cpu": count_ops(base, batch, accelerator=False),
           "ops_accelerator": count_ops(base, batch, accelerator=True)}
    print(f"dispatched ops per training step, T5 4+4 d_model 256, batch 4, 32/16 tokens, SGD ({modules} modules), "
          "every module watched")
    print(f"{'level':20} {'CPU path: extra ops':>20} {'accelerator path: extra ops':>28} {'extra syncs':>12}")
    for name in ("bare", *LEVELS, "boundaries, params"):
        c, a = res["ops_cpu"][name], res["ops_accelerator"][name]
        shown = f"{c['ops']} (bare)" if name == "bare" else f"+{c['extra_ops']}"
        label = name if name in ("bare", "boundaries, params") else f"every-module, {name}"
        print(f"{label:20} {shown:>20} {'' if name == 'bare' else '+' + str(a['extra_ops']):>28} "
              f"{'' if name == 'bare' else a['extra_syncs']:>12}")
    if not args.ops:
        print("\nhost cost, tiny T5 (d_model 32, 4+4 layers, batch 1, 8/8 tokens, SGD, one thread), thread CPU time")
        hc = res["host_cost"] = host_cost(args.reps, args.steps)
        print(f"{'variant':22} {'median step':>12} {'ratio':>7} {'us/module/step':>15}   "
              f"({hc['hooked_modules']} modules)")
        for name, row in hc.items():
            if name == "hooked_modules":
                continue
            extra = "" if name == "bare" else f"{row['us_per_module']:.1f}"
            print(f"{name:22} {row['median_step_ms']:>10.2f}ms {row['ratio']:>6.2f}x {extra:>15}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=str)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

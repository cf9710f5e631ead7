"""The monitor of this working tree against the monitor of an earlier revision, side by side in one process.

Run from the repository root::

    .venv/bin/python benchmarks/monitor_ab.py --base HEAD~1            # ~3 min on 2 cores
    .venv/bin/python benchmarks/monitor_ab.py --base 1dad0e0 --reps 30 --json out.json

Why: a change to the monitor's per-step path (a reshape, a new check) must not make a healthy step dearer, and the
machines these numbers come from are shared and noisy, so two runs at different times cannot be compared. Here
both monitors live in one process: the revision's ``src/torchdoctor`` is extracted with ``git archive`` into a
temporary folder as the package ``torchdoctor_base`` (the monitor imports its own modules relatively), and every
variant -- bare, each monitor at each level -- steps its own copy of the model in interleaved rounds, timed in
thread CPU time (a busy machine inflates wall time, not this) with torch on one thread (so that the thread's time is
all the step's work). Reported: the median ratio to the bare step of the
same round, per model.

Models: the tiny T5 of ``numerics_dispatch.py`` (d_model 32, 4+4 layers, batch 1, one thread: a launch-bound step
seen on a CPU), the T5 of ``numerics_overhead.py`` (d_model 256, 4+4 layers, batch 8, AdamW), and a
nanoGPT-shaped loop (a 4-layer GPT-2 from config, d 64, batch 4 x 32 tokens, fp16 autocast on the CPU,
``torch.amp.GradScaler``, AdamW); and (not with ``--quick``) the HF Trainer on that GPT-2 with each tree's
``NumericsCallback``, ``train()`` of 40 steps timed whole (its first step, watched every module, included).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_package(rev: str, into: str) -> str:
    """Extract ``src/torchdoctor`` at ``rev`` as the package ``torchdoctor_base`` under ``into``; its name."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "src/torchdoctor"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    shutil.move(os.path.join(into, "src", "torchdoctor"), os.path.join(into, "torchdoctor_base"))
    sys.path.insert(0, into)
    return "torchdoctor_base"


def t5(d_model: int, d_ff: int, layers: int, heads: int, d_kv: int, vocab: int) -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(d_model=d_model, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                   d_kv=d_kv, vocab_size=vocab, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                   pad_token_id=0)
    return T5ForConditionalGeneration(cfg).train()


def gpt2(layers: int = 4, d: int = 64, vocab: int = 256) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=d, n_head=4, vocab_size=vocab, n_positions=128)).train()


class Model:
    """One benchmark model: how to build it, its batch, its optimizer, whether it trains in fp16 with a scaler."""

    def __init__(self, name: str, build, batch: dict, adam: bool, fp16: bool, threads: int | None) -> None:
        self.name, self.build, self.batch, self.adam, self.fp16, self.threads = name, build, batch, adam, fp16, threads


def models(quick: bool) -> list[Model]:
    g = torch.Generator().manual_seed(1)
    tiny = {"input_ids": torch.randint(1, 128, (1, 8), generator=g), "labels": torch.randint(1, 128, (1, 8),
                                                                                           generator=g)}
    mid = {"input_ids": torch.randint(1, 32128, (8, 64), generator=g),
           "labels": torch.randint(1, 32128, (8, 64), generator=g)}
    ids = torch.randint(0, 256, (4, 32), generator=g)
    out = [Model("tiny T5 (launch-bound)", lambda: t5(32, 64, 4, 2, 16, 128), tiny, False, False, 1),
           Model("nanoGPT-shaped fp16 + GradScaler", gpt2, {"input_ids": ids, "labels": ids}, True, True, 1)]
    if not quick:
        out.insert(1, Model("mid T5", lambda: t5(256, 1024, 4, 4, 64, 32128), mid, True, False, 1))
    return out


class Variant:
    def __init__(self, name: str, model: Model, base_model: torch.nn.Module, package: str | None,
                 options: dict) -> None:
        self.name = name
        self.fp16 = model.fp16
        self.model = copy.deepcopy(base_model)
        params = self.model.parameters()
        self.opt = torch.optim.AdamW(params, lr=1e-4) if model.adam else torch.optim.SGD(params, lr=1e-3)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if model.fp16 else None
        self.times: list[float] = []
        self.monitor = None
        if package is not None:
            cls = importlib.import_module(package + ".numerics.monitor").NumericsMonitor
            self.monitor = cls(self.model, optimizer=self.opt, scaler=self.scaler, **options)
            self.monitor.__enter__()

    def step(self, batch: dict) -> None:
        if self.fp16:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.model(**batch).loss
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.model(**batch).loss.backward()
            self.opt.step()
        self.opt.zero_grad()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.__exit__(None, None, None)


def run_model(model: Model, packages: dict[str, str], reps: int, steps: int) -> dict:
    threads = torch.get_num_threads()
    if model.threads:
        torch.set_num_threads(model.threads)
    base = model.build()
    variants = [Variant("bare", model, base, None, {})]
    for label, package in packages.items():
        variants.append(Variant(f"{label}, default", model, base, package, {}))
        variants.append(Variant(f"{label}, every-module", model, base, package, {"watch": "every-module"}))
    for v in variants:
        for _ in range(3):
            v.step(model.batch)
    for rep in range(reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            t0 = time.thread_time()
            for _ in range(steps):
                v.step(model.batch)
            v.times.append((time.thread_time() - t0) / steps)
        print(f"  {model.name}: rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
    bare = variants[0].times
    out = {}
    for v in variants:
        out[v.name] = {"median_step_ms": statistics.median(v.times) * 1e3,
                       "ratio": statistics.median(t / b for t, b in zip(v.times, bare))}
        v.close()
    torch.set_num_threads(threads)
    return out


def run_trainer(packages: dict[str, str], reps: int, steps: int) -> dict:
    """The HF Trainer on a tiny GPT-2 from config: ``trainer.train()`` of ``steps`` steps per variant per round, bare
    and with each tree's ``NumericsCallback`` (the Trainer is built outside the timing)."""
    import transformers

    torch.set_num_threads(1)  # (thread CPU time: all the step's work on this thread)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 32), generator=g)]
    variants = {"bare": None, **{f"{label}, default": package for label, package in packages.items()}}
    times: dict[str, list[float]] = {name: [] for name in variants}

    def once(name: str, package: str | None, out: str) -> float:
        callbacks = []
        if package is not None:
            callbacks.append(importlib.import_module(package + ".integrations.hf").NumericsCallback(report_dir=out))
        args = transformers.TrainingArguments(out, max_steps=steps, per_device_train_batch_size=4, report_to=[],
                                              save_strategy="no", use_cpu=True, logging_strategy="no",
                                              dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=data, callbacks=callbacks)
        t0 = time.thread_time()
        trainer.train()
        return (time.thread_time() - t0) / steps

    with tempfile.TemporaryDirectory(prefix="torchdoctor-ab-trainer-") as out:
        for name, package in variants.items():
            once(name, package, out)  # (warm-up: imports, first-call costs)
        for rep in range(reps):
            for name, package in list(variants.items())[rep % len(variants):] + list(variants.items())[
                    :rep % len(variants)]:
                times[name].append(once(name, package, out))
            print(f"  HF Trainer: rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
    bare = times["bare"]
    return {name: {"median_step_ms": statistics.median(t) * 1e3,
                   "ratio": statistics.median(a / b for a, b in zip(t, bare))} for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the revision to compare with (default: HEAD)")
    ap.add_argument("--reps", type=int, default=20, help="interleaved rounds (default 20)")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round (default 5)")
    ap.add_argument("--quick", action="store_true", help="the two small models only")
    ap.add_argument("--only", choices=["tiny", "mid", "gpt2", "trainer"], default=None,
                    help="one model only (tiny T5, mid T5, the nanoGPT-shaped loop, the HF Trainer)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    with tempfile.TemporaryDirectory(prefix="torchdoctor-ab-") as tmp:
        packages = {"this tree": "torchdoctor", args.base: base_package(args.base, tmp)}
        load = os.getloadavg()[0]
        chosen = {"tiny": "tiny T5", "mid": "mid T5", "gpt2": "nanoGPT"}.get(args.only or "", "")
        results = {m.name: run_model(m, packages, args.reps, args.steps) for m in models(args.quick and not chosen)
                   if args.only != "trainer" and m.name.startswith(chosen)}
        if not args.quick and args.only in (None, "trainer"):
            results["HF Trainer, tiny GPT-2 (train() of 40 steps)"] = run_trainer(packages, max(3, args.reps // 4), 40)
    print(f"healthy-step cost, ratio to the bare step of the same round (median of {args.reps} rounds of "
          f"{args.steps} steps; load average {load:.1f} -> {os.getloadavg()[0]:.1f})")
    for name, rows in results.items():
        print(f"\n{name}")
        for variant, row in rows.items():
            print(f"  {variant:32} {row['median_step_ms']:9.2f} ms  {row['ratio']:6.3f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"base": args.base, "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

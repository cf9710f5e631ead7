"""What a numerics recording costs: the training step recorded every step against the same watching without the
recording, the bytes it writes, and the page ``numerics show`` makes of a long run.

Run from the repository root::

    .venv/bin/python benchmarks/timeline_overhead.py             # ~5 min on an idle 2-core box
    .venv/bin/python benchmarks/timeline_overhead.py --quick     # smoke test: tiny model, few repetitions
    .venv/bin/python benchmarks/timeline_overhead.py --json out.json

What is measured, in ONE process, on the T5 of ``numerics_overhead.py`` (17.7M parameters, batch 8, AdamW):

* Time, variants interleaved round-robin (the first rotating), each on its own ``copy.deepcopy`` of one seeded
  model: the bare step; ``watch="every-module"`` with ``grads="params"`` and with ``grads="modules"`` (a recorded
  step watches every module and the gradients at module outputs: the second is the same watching without the
  recording); ``record=DIR`` every step; ``record=DIR, record_every=10``. Per variant the median over repetitions
  of (its step time / the other's in the same repetition), and best against best (noise on a shared machine only
  ever adds time).
* Size: the recording's ``.npy`` bytes per key per step and per module output (forward + gradient) per step.
* The page: a synthetic recording of ``--modules`` module outputs x ``--page-steps`` steps (forward and gradient
  keys, values of a slow random walk, one inf), written by the real writer; ``numerics show``'s time and page size,
  and, where Chromium is installed, the time from navigation to the first drawing (the page's own
  ``performance.now()``), headless.
"""

from __future__ import annotations

import argparse
import copy
import gc
import html as html_mod
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from numerics_overhead import QUICK_SHAPE, Shape, build_base, core_count, cpu_model, make_batches
from torchdoctor import NumericsMonitor

BARE, PARAMS, MODULES, RECORD, RECORD10 = "bare", "every module, params", "every module, modules", "record", "record/10"
VARIANTS = (BARE, PARAMS, MODULES, RECORD, RECORD10)
LABELS = {BARE: "bare training step", PARAMS: 'watch="every-module" (grads="params")',
          MODULES: 'watch="every-module", grads="modules"', RECORD: "record=DIR (every step)",
          RECORD10: "record=DIR, record_every=10"}
#: (variant, against): the issue's aim, recording every step within 2 % of the same watching without it
TARGETS = [(RECORD, MODULES, 1.02), (RECORD, PARAMS, 1.02)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Runner:
    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    monitor: NumericsMonitor | None = None
    record: str | None = None
    times: list[float] = field(default_factory=list)
    steps: int = 0

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        self.steps += 1
        loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def make(name: str, base: torch.nn.Module) -> Runner:
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == BARE:
        return Runner(name, model, opt)
    if name in (PARAMS, MODULES):
        grads = "params" if name == PARAMS else "modules"
        return Runner(name, model, opt, NumericsMonitor(model, opt, grads=grads, watch="every-module"))
    record = tempfile.mkdtemp(prefix="td-timeline-")
    every = 10 if name == RECORD10 else 1
    return Runner(name, model, opt, NumericsMonitor(model, opt, record=record, record_every=every), record)


def measure(runners: list[Runner], batches: list[dict], warmup: int, reps: int, steps: int) -> None:
    for r in runners:
        for i in range(warmup):
            r.step(batches[i % len(batches)])
    for rep in range(reps):
        order = runners[rep % len(runners):] + runners[:rep % len(runners)]
        for r in order:
            gc.collect()
            t0 = time.perf_counter()
            for i in range(steps):
                r.step(batches[i % len(batches)])
            r.times.append((time.perf_counter() - t0) / steps)
        log(f"  rep {rep + 1}/{reps}: " + "  ".join(f"{r.name}={r.times[-1]:.3f}s" for r in runners))


def recording_size(r: Runner) -> dict[str, Any]:
    r.monitor.close()
    with open(os.path.join(r.record, "rank0", "keys.json"), encoding="utf-8") as f:
        keys = json.load(f)
    files = [os.path.join(d, f) for d, _, fs in os.walk(r.record) for f in fs if f.endswith(".npy")]
    size = sum(os.path.getsize(f) for f in files)
    outputs = len({(k[0], k[3].removeprefix("grad_")) for k in keys})
    out = {"bytes": size, "steps": r.steps, "keys": len(keys), "module_outputs": outputs,
           "bytes_per_key_step": size / (len(keys) * r.steps),
           "bytes_per_module_output_step": size / (outputs * r.steps)}
    shutil.rmtree(r.record, ignore_errors=True)
    return out


def ratios(a: Runner, b: Runner) -> dict[str, float]:
    each = [x / y for x, y in zip(a.times, b.times)]
    return {"median": statistics.median(each), "p25": statistics.quantiles(each, n=4)[0] if len(each) > 1 else
            each[0], "p75": statistics.quantiles(each, n=4)[2] if len(each) > 1 else each[0],
            "best": min(a.times) / min(b.times)}


# ---------------------------------------------------------------------------------------------- the page
def synthetic_recording(path: str, modules: int, steps: int) -> float:
    """A recording of ``modules`` outputs (forward and gradient) x ``steps``; returns the seconds it took."""
    from torchdoctor.numerics.timeline.store import TimelineWriter

    keys = [(f"model.layers.{i // 10}.part{i % 10}", "Linear", ph, "output" if ph == "fwd" else "grad_output",
             "bfloat16") for ph in ("fwd", "bwd") for i in range(modules)]
    writer = TimelineWriter(path, 0, {"rank": 0, "world_size": 1, "torch": torch.__version__, "record_every": 1},
                            flush_every=500)
    g = torch.Generator().manual_seed(0)
    walk = (torch.rand(len(keys), generator=g) * 4 - 2)[None, :] + torch.randn(steps, len(keys), generator=g).mul(
        0.02).cumsum(0)
    hi = 10.0 ** walk
    values = torch.stack([hi * 1e-3, hi], dim=2)
    values[steps - 7, modules // 2, 1] = float("inf")
    t0 = time.perf_counter()
    for s in range(steps):
        writer.add(s, keys, values[s])
    writer.close()
    return time.perf_counter() - t0


def chromium_draw_ms(page: str) -> float | None:
    exe = next((p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))), None)
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                               f"--user-data-dir={profile}", "--window-size=1600,1000", "--dump-dom",
                               "file://" + os.path.abspath(page)], capture_output=True, text=True, timeout=300)
    found = re.search(r'<pre id="td-state"[^>]*>(.*?)</pre>', proc.stdout, re.S)
    return json.loads(html_mod.unescape(found.group(1)))["ms_since_navigation"] if found else None


def page_numbers(modules: int, steps: int) -> dict[str, Any]:
    from torchdoctor.numerics.timeline.show import build
    from torchdoctor.numerics.timeline.store import load_run

    with tempfile.TemporaryDirectory() as tmp:
        rec = os.path.join(tmp, "rec")
        log(f"writing a {modules} x {steps} recording")
        write_s = synthetic_recording(rec, modules, steps)
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(rec) for f in fs)
        log("numerics show")
        t0 = time.perf_counter()
        text, summaries = build(load_run(rec), "bench")
        show_s = time.perf_counter() - t0
        page = os.path.join(tmp, "page.html")
        with open(page, "w", encoding="utf-8") as f:
            f.write(text)
        log("opening it in headless Chromium")
        draw = chromium_draw_ms(page)
    return {"modules": modules, "steps": steps, "recording_bytes": disk, "write_s": write_s, "show_s": show_s,
            "page_bytes": len(text.encode()), "columns": summaries[0].columns, "chromium_draw_ms": draw}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    ap.add_argument("--modules", type=int, default=500, help="module outputs of the page measured")
    ap.add_argument("--page-steps", type=int, default=10_000, help="steps of the page measured")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH", default=None)
    args = ap.parse_args(argv)
    shape = copy.copy(QUICK_SHAPE if args.quick else Shape())
    if args.quick:
        args.reps, args.steps, args.warmup, args.batch, args.page_steps = 3, 2, 1, 2, 2000
    threads = args.threads or core_count()
    torch.set_num_threads(threads)
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    base = build_base(shape, 0)
    batches = make_batches(shape, args.batch, max(args.steps, args.warmup), 0)
    runners = [make(n, base) for n in VARIANTS]
    log(f"timing {len(runners)} variants: {args.reps} reps x {args.steps} steps, {threads} threads")
    measure(runners, batches, args.warmup, args.reps, args.steps)
    by = {r.name: r for r in runners}
    res: dict[str, Any] = {"variants": {}, "versus": {}}
    for r in runners:
        res["variants"][r.name] = {"median_step_s": statistics.median(r.times), "vs_bare": ratios(r, by[BARE])}
    for a, b, _ in TARGETS:
        res["versus"][f"{a} / {b}"] = ratios(by[a], by[b])
    res["versus"][f"{RECORD10} / {BARE}"] = ratios(by[RECORD10], by[BARE])
    res["size"] = recording_size(by[RECORD])
    for r in runners:
        if r.monitor is not None:
            r.monitor.close()
        if r.record:
            shutil.rmtree(r.record, ignore_errors=True)
    res["page"] = page_numbers(args.modules, args.page_steps)
    res["machine"] = {"torch": torch.__version__, "cpu": cpu_model(), "cores": core_count(), "threads": threads,
                      "load_start": load0, "load_end": os.getloadavg(), "wall_s": time.perf_counter() - t_start,
                      "quick": args.quick}
    p = print
    p(f"timeline overhead: torch {torch.__version__}, {cpu_model()}, {threads} threads, load "
      f"{load0[0]:.1f} -> {os.getloadavg()[0]:.1f}, {res['machine']['wall_s']:.0f} s")
    p(f"{'variant':42} {'median step':>11} {'vs bare':>8} {'best':>7}")
    for name in VARIANTS:
        v = res["variants"][name]
        p(f"{LABELS[name]:42} {v['median_step_s']:>10.3f}s {v['vs_bare']['median']:>7.3f}x "
          f"{v['vs_bare']['best']:>6.3f}x")
    for key, r in res["versus"].items():
        p(f"  {key}: {r['median']:.3f}x median (p25-p75 {r['p25']:.3f}-{r['p75']:.3f}), {r['best']:.3f}x best vs best")
    s = res["size"]
    p(f"recording: {s['bytes']} bytes for {s['steps']} steps x {s['keys']} keys ({s['module_outputs']} module "
      f"outputs): {s['bytes_per_key_step']:.2f} B per key per step, {s['bytes_per_module_output_step']:.2f} B per "
      "module output per step")
    pg = res["page"]
    draw = "no Chromium here" if pg["chromium_draw_ms"] is None else f"drawn {pg['chromium_draw_ms']} ms after " \
        "navigation (headless Chromium)"
    p(f"page of {pg['modules']} module outputs x {pg['steps']} steps (recording "
      f"{pg['recording_bytes'] / 2**20:.1f} MiB, written in {pg['write_s']:.1f} s): numerics show "
      f"{pg['show_s']:.1f} s, {pg['page_bytes'] / 2**20:.1f} MiB, {pg['columns']} columns; {draw}")
    for a, b, limit in TARGETS:
        r = res["versus"][f"{a} / {b}"]["median"]
        p(f"  [{'ok' if r <= limit else 'MISSED'}] {LABELS[a]} <= {limit:.2f}x {LABELS[b]}: {r:.3f}x"
          + (" (--quick: not a measurement)" if args.quick else ""))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The check to run on a machine with a GPU: host syncs and overhead of the monitor under CUDA.

On CPU the sync budget is counted with a dispatch mode (``torchdoctor.syncs.SyncCounter``); on CUDA the
real question is how often the host *waits*. This script answers it with
``torch.cuda.set_sync_debug_mode("warn")`` (every synchronising call emits a warning, counted here), and
measures, on the device:

* which per-tensor statistic is cheapest there (``aminmax(x.abs())``, ``vector_norm(x, inf)``,
  ``x.abs().amax()``, ``aminmax(x)``), since the monitor's choice was measured on CPU;
* the per-step gradient check (one ``aminmax`` per gradient) against a fused ``_foreach_norm(inf)``;
* step time of a T5-shaped model under fp16 autocast, bare vs ``NumericsMonitor`` at each level
  (interleaved, CUDA-event timed), and the waits per step of each;
* where the monitor's time goes: a variant with a no-op forward hook on every module (the Python cost of
  hooking alone) and the device kernels launched per step at each level (torch.profiler).

Usage: ``python benchmarks/gpu_check.py [--device cuda] [--steps 20] [--json out.json]``. Without a
CUDA device it says so and exits 0 (``--device cpu`` runs the same code on CPU, as a smoke test).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch


def _time(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()`` on ``device`` (CUDA events there, perf_counter on CPU)."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def count_waits(fn, device: torch.device) -> int:
    """Host waits made by ``fn()``: CUDA sync-debug warnings (on CPU: the dispatch-mode count)."""
    if device.type != "cuda":
        from torchdoctor.syncs import SyncCounter

        with SyncCounter() as c:
            fn()
        return c.count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def statistic_costs(device: torch.device, reps: int) -> dict[str, dict[str, float]]:
    out = {}
    for shape in ((8, 64, 256), (8, 64, 1024), (8, 32, 32128)):
        x = torch.randn(*shape, device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32)
        out[str(shape)] = {
            "aminmax(abs)": _time(lambda x=x: torch.aminmax(x.abs()), device, reps),
            "vector_norm(inf)": _time(lambda x=x: torch.linalg.vector_norm(x, float("inf")), device, reps),
            "abs().amax()": _time(lambda x=x: x.abs().amax(), device, reps),
            "aminmax(x)": _time(lambda x=x: torch.aminmax(x), device, reps),
        }
    return out


def statistic_host_us(device: torch.device, calls: int = 2000) -> dict[str, float]:
    """Host microseconds per call of each candidate statistic when calls are issued back to back (the
    dispatch cost that bounds a launch-bound step), and whether each one sees a nan and a -inf."""
    x = torch.randn(8, 64, 1024, device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32)
    inf = float("inf")
    candidates = {
        "aminmax(abs)": lambda t: torch.aminmax(t.abs()),
        "aminmax(x)": lambda t: torch.aminmax(t),
        "vector_norm(inf) + vector_norm(-inf)": lambda t: (torch.linalg.vector_norm(t, inf),
                                                           torch.linalg.vector_norm(t, -inf)),
        "vector_norm(inf)": lambda t: (torch.linalg.vector_norm(t, inf),),
    }
    bad = x.clone()
    bad[3, 7, 11] = float("nan")
    neg = x.clone()
    neg[1, 2, 3] = -inf
    out = {}
    for name, fn in candidates.items():
        for _ in range(50):
            fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        host = (time.perf_counter() - t0) / calls * 1e6
        if device.type == "cuda":
            torch.cuda.synchronize()
        sees = all(not torch.isfinite(torch.stack([r.float() for r in fn(b)])).all().item() for b in (bad, neg))
        out[name] = {"host_us": host, "sees_nan_and_-inf": sees}
    return out


def kernels_per_step(fn, device: torch.device) -> int | None:
    """Device kernels launched by one ``fn()`` (None on CPU, where there are none to count)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if "CUDA" in str(e.device_type))
    except Exception as e:  # a profiler that cannot start (CUPTI missing) must not cost the other figures
        print(f"gpu_check: kernel count unavailable: {type(e).__name__}: {e}")
        return None


def fused_check_misses(device: torch.device) -> list[str]:
    """Cases where the fused gradient check on ``device`` disagrees with the truth (must be empty)."""
    from torchdoctor.numerics.measure.stats import finite_flags_of

    misses = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bad in (None, float("nan"), float("inf"), float("-inf")):
            for where, n in enumerate((7, 1 << 20, 1)):
                ts = [torch.randn(m, device=device, dtype=dtype) for m in (7, 1 << 20, 1)]
                if bad is not None:
                    ts[where][n // 2 + (n > 1)] = bad
                got = bool(finite_flags_of(ts, fused=True)[0].item())
                if got != (bad is None):
                    misses.append(f"{dtype} {bad} in tensor {where}")
    return misses


def hook_every_module(model) -> None:
    """A forward hook that does nothing on every module: what hooking alone costs per step."""
    def noop(module, args, kwargs, output):
        return None

    for module in model.modules():
        module.register_forward_hook(noop, with_kwargs=True)


def build(device: torch.device):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        d_model=256, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4, d_kv=64,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 32128, (8, 64), generator=g).to(device),
        "labels": torch.randint(0, 32128, (8, 32), generator=g).to(device),
    }
    return model, batch


def training_step(base, batch, device: torch.device, level: str | None):
    """(step function, monitor) for a fresh copy of ``base``: fp16 autocast on CUDA, AdamW. ``level`` is a
    NumericsMonitor grads level, "noop" (a do-nothing hook on every module) or None (bare)."""
    from torchdoctor import NumericsMonitor

    amp = device.type == "cuda"
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=amp)
    mon = None
    if level == "noop":
        hook_every_module(model)
    elif level:
        mon = NumericsMonitor(model, optimizer=opt, grads=level)

    def step():
        with torch.autocast(device.type, dtype=torch.float16 if amp else torch.bfloat16, enabled=amp):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, mon


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to measure (use --device cpu for a smoke run)")
        return 0
    from torchdoctor.numerics.measure.stats import finite_flags_of, fused_check_works

    device = torch.device(args.device)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    result["statistic_ms"] = statistic_costs(device, max(5, args.steps))
    result["statistic_host_us"] = statistic_host_us(device)

    base, batch = build(device)
    grads = [torch.randn_like(p) for p in base.parameters()]
    result["grad_check_ms"] = {
        "aminmax per gradient": _time(lambda: [torch.aminmax(gr) for gr in grads], device, args.steps),
        "_foreach_norm(inf)": _time(lambda: torch._foreach_norm(grads, float("inf")), device, args.steps),
        "finite_flags_of (auto)": _time(lambda: finite_flags_of(grads), device, args.steps),
    }
    result["fused_check_works"] = fused_check_works(device)
    result["fused_check_misses"] = fused_check_misses(device)

    variants = {"bare": None, "noop hooks": "noop", "none": "none", "params": "params", "modules": "modules"}
    runs = {name: training_step(base, batch, device, level) for name, level in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):  # interleaved
        for name, (step, _mon) in runs.items():
            times[name].append(_time(step, device, 1))
    bare = statistics.median(times["bare"])
    result["step_ms"] = {name: statistics.median(t) for name, t in times.items()}
    result["ratio"] = {name: statistics.median(t) / bare for name, t in times.items()}
    result["waits_per_step"] = {name: count_waits(step, device) for name, (step, _mon) in runs.items()}
    result["kernels_per_step"] = {name: kernels_per_step(step, device) for name, (step, _mon) in runs.items()}
    result["modules"] = sum(1 for _ in base.modules())
    for _step, mon in runs.values():
        if mon is not None:
            mon.close()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

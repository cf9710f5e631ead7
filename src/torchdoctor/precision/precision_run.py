"""``torchdoctor precision MODEL``: will this model overflow (or underflow) in fp16 or bf16, where, and what to do --
before training. One forward in the target dtype, one forward and backward in fp32, every op and module measured;
then the fix searched and verified (:mod:`.fix`). Exit 0 safe, 1 overflow predicted, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..findings import Finding, render_text, use_color, worst
from ..jsonfile import dumps

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
EXAMPLES = [
    ("torchdoctor precision ./my-model", "fp16: where it overflows, the loss scale, the fp32 regions that fix it"),
    ("torchdoctor precision ./my-model --batch sample.jsonl", "on your data (text or token ids)"),
    ("torchdoctor precision mytrain:build --dtype bf16", "a model and batch your own function builds"),
    ("torchdoctor precision ./my-model --json", "the same as JSON"),
]
EXIT_CODES = [(EXIT_OK, "safe in that dtype (warnings may remain)"),
              (EXIT_PROBLEMS, "an overflow is predicted (or no loss scale keeps the gradients)"),
              (EXIT_USAGE, "bad usage, or a model that cannot be loaded"), (130, "interrupted (Ctrl-C)")]
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
_SHOWN = 6  # sites listed per finding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face model folder (config.json + *.safetensors; pickles are refused) or "
                             "module:factory, a callable returning (model, batch)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="the precision to train in "
                        "(default fp16, under autocast: matmuls in it, the rest in fp32)")
    parser.add_argument("--batch", metavar="FILE", default=None,
                        help="examples to measure on: a text file (one per line) or JSONL ({\"text\": ...} or "
                             "{\"input_ids\": [...]}); default: random token ids")
    parser.add_argument("--seq-len", type=_positive("--seq-len", 1 << 16), default=None, metavar="N",
                        help="tokens per example (default 128, or the model's longest when shorter)")
    parser.add_argument("--batch-size", type=_positive("--batch-size", 4096), default=2, metavar="N",
                        help="examples in the batch (default 2)")
    parser.add_argument("--device", default=None, help="where to run (default: cuda when available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _positive(flag: str, most: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not 1 <= n <= most:
            raise argparse.ArgumentTypeError(f"{n} is not in 1..{most}")
        return n
    parse.__name__ = flag
    return parse


def run(args: argparse.Namespace) -> int:
    from .load import PrecisionUsageError

    try:
        return _run(args)
    except PrecisionUsageError as e:
        print(f"torchdoctor precision: {e}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    import torch

    from ..deepspeed.quiet import quiet_deepspeed
    from ..env.progress import Progress
    from .fix import find_regions, verified_power
    from .load import PrecisionUsageError, load
    from .predict import predict
    from .probe import run_probe

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda", "xpu", "mps", "hpu"):
        raise PrecisionUsageError(f"--device {device}: autocast runs on cpu, cuda, xpu, mps or hpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PrecisionUsageError(f"--device {device}: torch sees no CUDA device here (torch "
                                  f"{torch.__version__}); use --device cpu")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, ValueError, AssertionError) as e:
        raise PrecisionUsageError(f"--device {device}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    target = getattr(torch, DTYPES[args.dtype])
    stage = ["loading the model"]
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    with Progress("torchdoctor precision", lambda: stage[0]):
        with quiet_deepspeed():  # transformers imports DeepSpeed when it is installed: its lines would break --json
            loaded = load(args.model, args.batch, args.seq_len, args.batch_size, device)
        times["load_s"] = time.perf_counter() - t0
        stage[0] = f"one {args.dtype} forward, one fp32 forward and backward"
        try:
            probe = run_probe(loaded.model, loaded.batch, target, device)
        except Exception as e:  # noqa: BLE001 -- the model (or its config) refused the batch: its own message
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise PrecisionUsageError(f"the model's forward or backward on the batch raised {type(e).__name__}: "
                                      f"{first}") from None
        times["measure_s"] = probe.seconds
        prediction = predict(probe)
        stage[0] = f"verifying the fix under {args.dtype} autocast"
        t1 = time.perf_counter()
        needs_fix = prediction.overflow or prediction.at_risk or prediction.weights_over
        fix = find_regions(loaded.model, loaded.batch, probe, prediction) if needs_fix else None
        scale = prediction.loss_scale
        verified = None
        if scale is not None and scale.works and (fix is None or fix.verified):
            regions = fix.regions if fix is not None else []
            verified = verified_power(loaded.model, loaded.batch, probe, regions, scale.power, scale.min_power)
            if fix is not None:
                fix.scale_power, fix.scale_ok = scale.power, verified == scale.power
        times["verify_s"] = time.perf_counter() - t1
    findings = judge(prediction, fix, verified, args.dtype)
    findings[0:0] = [Finding("precision.note", "info", n) for n in loaded.notes]
    bad = prediction.overflows or (fix is not None and not fix.verified)
    verdict = "overflow" if bad else "at-risk" if prediction.at_risk or prediction.weights_at_risk else "safe"
    if args.json:
        print(dumps({
            "model": loaded.what, "batch": loaded.batch_what, "dtype": args.dtype, "device": device,
            "verdict": verdict, "paired": prediction.paired,
            "overflow": [s.to_json() for s in prediction.overflow],
            "at_risk": [s.to_json() for s in prediction.at_risk],
            "absorbed": [s.to_json() for s in prediction.absorbed],
            "underflow": [u.to_json() for u in prediction.underflow],
            "weights": {"over": prediction.weights_over, "at_risk": prediction.weights_at_risk,
                        "flushed": prediction.weights_flushed},
            "loss_scale": prediction.loss_scale.to_json() if prediction.loss_scale else None,
            "verified_scale_power": verified,
            "observed_first": prediction.observed_first, "fix": fix.to_json() if fix else None,
            "loss": {"fp32": probe.loss, args.dtype: probe.narrow_loss}, "seconds": times,
            "findings": [f.to_json() for f in findings],
        }))
    else:
        print(f"torchdoctor precision: {loaded.what}\n  on {loaded.batch_what}; target {args.dtype} on {device}; "
              f"measured in {probe.seconds:.1f} s, fix checked in {times['verify_s']:.1f} s\n")
        print(render_text(findings, color=use_color(sys.stdout)))
        print(f"\nverdict: {verdict}" + (f" ({worst(findings)})" if verdict == "safe" else ""))
    return EXIT_PROBLEMS if bad else EXIT_OK


def judge(prediction, fix, verified: int | None, dtype: str) -> list[Finding]:
    """The findings of a prediction, its fix and the verified loss scale, most serious first."""
    from .predict import RISK_FACTOR

    out: list[Finding] = []
    top = f"{prediction.dtype_max:.3g}"
    bf16 = ["train in bf16 (fp32's range): torch.autocast(device_type, dtype=torch.bfloat16); HF Trainer --bf16; "
            "DeepSpeed \"bf16\": {\"enabled\": true}"]
    fix_lines = _fix_lines(fix, dtype)
    if prediction.overflow:
        first = prediction.overflow[0]
        out.append(Finding(
            "precision.overflow", "fail",
            f"{dtype} overflow predicted at {first.module or '(the model)'} ({first.cls}): {first.op} reaches "
            f"{first.peak:.3g} in fp32, beyond {dtype}'s {top} ({first.headroom:.2f}x, {first.bits:+.1f} bits)",
            [f"{s.module or '(the model)'} ({s.cls}): {s.op} {s.peak:.3g} ({s.headroom:.2f}x)"
             for s in prediction.overflow[:_SHOWN]]
            + ([f"... and {len(prediction.overflow) - _SHOWN} more"] if len(prediction.overflow) > _SHOWN else [])
            + ([f"in {_a(dtype)} forward of this batch, {prediction.observed_first} went inf/nan first"]
               if prediction.observed_first else []),
            fix_lines or bf16, {"modules": [s.module for s in prediction.overflow]}))
    if prediction.weights_over:
        out.append(Finding(
            "precision.weights-out-of-range", "fail",
            f"{len(prediction.weights_over)} weight tensor(s) hold values beyond {dtype}'s {top} (a model pretrained "
            f"in bf16 or fp32): {prediction.weights_over[0][0]} reaches {prediction.weights_over[0][1]:.3g}",
            [f"{n}: {m:.3g}" for n, m in prediction.weights_over[:_SHOWN]],
            (fix_lines + [f"(under autocast a module kept in fp32 keeps its weights in fp32; a model cast to {dtype} "
                          "-- model.half(), DeepSpeed fp16 -- cannot hold them: bf16)"]) if fix_lines else bf16,
            {"weights": prediction.weights_over}))
    if prediction.at_risk:
        out.append(Finding(
            "precision.at-risk", "warn",
            f"{len(prediction.at_risk)} module(s) compute {dtype} values within {RISK_FACTOR:g}x of {dtype}'s largest "
            f"value ({top}): {prediction.at_risk[0].module} at {prediction.at_risk[0].peak:.3g}",
            [f"{s.module} ({s.cls}): {s.op} {s.peak:.3g}, headroom {s.headroom:.2f}x ({s.bits:+.1f} bits)"
             for s in prediction.at_risk[:_SHOWN]],
            _at_risk_fix(prediction, fix, fix_lines),
            {"modules": [s.module for s in prediction.at_risk]}))
    if prediction.weights_at_risk:
        out.append(Finding("precision.weights-at-risk", "warn",
                           f"{len(prediction.weights_at_risk)} weight tensor(s) within {RISK_FACTOR:g}x of {dtype}'s "
                           f"{top}", [f"{n}: {m:.3g}" for n, m in prediction.weights_at_risk[:_SHOWN]]))
    if fix is not None and not fix.verified:
        out.append(Finding(
            "precision.no-region-fix", "fail", f"no small fp32 region fixes it: {fix.reason}",
            [f"tried: {', '.join(fix.regions) or '(none)'}; still out of range: {', '.join(fix.remaining) or '?'}"],
            bf16, fix.to_json()))
    scale = prediction.loss_scale
    if scale is not None and scale.max_power is not None:
        out.append(_scale_finding(scale, verified, bf16))
    if prediction.absorbed:
        s = prediction.absorbed[0]
        out.append(Finding(
            "precision.absorbed", "info",
            f"inside {s.module or '(the model)'} ({s.cls}) {_a(dtype)} value overflows ({s.op} {s.peak:.3g}) but the "
            "module's output stays finite (a saturating function, e.g. tanh(inf) = 1)",
            [f"{a.module or '(the model)'}: {a.op} {a.peak:.3g}" for a in prediction.absorbed[:_SHOWN]]))
    if prediction.underflow:
        u = prediction.underflow[0]
        out.append(Finding(
            "precision.underflow", "warn" if u.flushed >= 0.05 else "info",
            f"{dtype} would flush {u.flushed:.1%} of {u.module}'s nonzero values to zero "
            f"({u.subnormal:.1%} subnormal)",
            [f"{x.module}: {x.flushed:.1%} to zero, {x.subnormal:.1%} subnormal, of {x.values} values"
             for x in prediction.underflow[:_SHOWN]],
            ["keep that module in fp32 (torchdoctor.keep_fp32), or train in bf16 (fp32's exponent range)"]))
    if prediction.weights_flushed:
        n, share = prediction.weights_flushed[0]
        out.append(Finding("precision.weights-underflow", "warn",
                           f"{dtype} would flush {share:.1%} of {n}'s nonzero values to zero",
                           [f"{w}: {s:.1%}" for w, s in prediction.weights_flushed[:_SHOWN]]))
    out += [Finding("precision.note", "info", note) for note in prediction.notes]
    if not any(f.severity in ("fail", "warn") for f in out):
        out.insert(0, Finding("precision.safe", "ok", f"no value computed in {dtype} comes within "
                              f"{RISK_FACTOR:g}x of its largest ({top}) on this batch"))
    order = {"fail": 0, "warn": 1, "ok": 2, "info": 3, "skip": 4}
    return sorted(out, key=lambda f: order[f.severity])


def _at_risk_fix(prediction, fix, fix_lines: list[str]) -> list[str]:
    watch = ["watch them while training: NumericsMonitor(model, optimizer, headroom=True) warns before one "
             "overflows, with the steps left"]
    if not fix_lines:
        return watch
    if prediction.overflow:  # the fix is on the overflow finding; say whether it covers these too
        covered = all(any(s.module == r or s.module.startswith(r + ".") for r in fix.regions)
                      for s in prediction.at_risk)
        return ["the fix above keeps them in fp32"] if covered else watch
    return fix_lines


def _a(dtype: str) -> str:
    return ("an " if dtype == "fp16" else "a ") + dtype


def _fix_lines(fix, dtype: str) -> list[str]:
    from .fix import fix_code

    if fix is None or not fix.verified or not fix.regions:
        return []
    checked = (f"checked: a forward under {dtype} autocast with these in fp32 stays within range and its backward "
               "stays finite" + (f" ({fix.param_share:.1%} of the parameters in fp32)" if fix.param_share else ""))
    return ["after building the model:"] + [f"    {line}" for line in fix_code(fix.regions)] + [checked]


def _scale_finding(scale, verified: int | None, bf16: list[str]) -> Finding:
    data = scale.to_json() | {"verified_power": verified}
    if not scale.works:
        return Finding(
            "precision.loss-scale", "fail",
            f"no loss scale keeps the gradients in fp16: they reach {scale.grad_peak:.3g}, so at most 2**"
            f"{scale.max_power} avoids overflow, yet more than 1% of them flush to zero below that",
            [f"with no scaling {scale.flushed_unscaled:.1%} of nonzero gradients flush to zero"], bf16, data)
    power = verified if verified is not None else scale.power
    default_ok = scale.min_power <= 16 <= scale.max_power and (verified is None or verified >= 16)
    title = (f"loss scale: gradients peak at {scale.grad_peak:.3g}; 2**{scale.min_power} .. 2**{scale.max_power} keeps "
             f"them in fp16" + (" -- the default 2**16 works" if default_ok else f" -- start at 2**{power}"))
    evidence = [f"unscaled, {scale.flushed_unscaled:.2%} of nonzero gradients flush to zero in fp16"]
    if verified is not None:
        evidence.append(f"checked: a backward at 2**{verified} kept every gradient finite")
    fix = [] if default_ok else [f"torch.amp.GradScaler(init_scale=2.0**{power})",
                                 f"DeepSpeed: \"fp16\": {{\"enabled\": true, \"initial_scale_power\": {power}}}",
                                 f"(with the default 2**16 the first {max(0, 16 - power)} step(s) overflow and are "
                                 "skipped while the scale backs off)"]
    return Finding("precision.loss-scale", "ok" if default_ok else "warn", title, evidence, fix, data)

"""``torchdoctor precision MODEL``: will this model overflow (or underflow) in fp16 or bf16, where, and what to do --
before training. One forward in the target dtype, one forward and backward in fp32, every op and module measured;
then the fix searched and verified, and the loss scale checked (:mod:`.fix`); the findings (:mod:`.verdict`).
Exit 0 safe, 1 overflow predicted (or not finite in fp32), 2 bad usage or a model the dtype cannot run here.
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
              (EXIT_PROBLEMS, "an overflow is predicted, no loss scale keeps the gradients, or the model is not "
                              "finite in fp32 already"),
              (EXIT_USAGE, "bad usage, a model that cannot be loaded, or one the dtype cannot run on this device "
                           "(--json: verdict cannot-run)"), (130, "interrupted (Ctrl-C)")]
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face model folder (config.json + *.safetensors; pickles are refused) or "
                             "module:factory, a callable returning (model, batch); it runs with sys.argv = [module] "
                             "(a parse_args() in it sees no arguments), its output is shown (on stderr with --json) "
                             "and its exit is reported as its own")
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
    except CannotRun as e:  # a fact about the model on this device, in one line; --json gets it as a finding
        print(f"torchdoctor precision: {e}", file=sys.stderr)
        if args.json:
            print(dumps({"model": args.model, "dtype": args.dtype, "device": e.device, "verdict": "cannot-run",
                         "findings": [Finding("precision.cannot-run", "fail", str(e), [e.error], e.fix,
                                              {"dtype": args.dtype, "device": e.device}).to_json()]}))
        return EXIT_USAGE


class CannotRun(Exception):
    """The model runs in fp32 but not in the target dtype on this device (CPU fp16 autocast refuses an LSTM)."""

    def __init__(self, what: str, error: str, device: str, fix: list[str]) -> None:
        super().__init__(what)
        self.error, self.device, self.fix = error, device, fix


def _run(args: argparse.Namespace) -> int:
    import torch

    from ..env.progress import Progress
    from .fix import check_scales, find_regions
    from .load import PrecisionUsageError, load
    from .predict import predict
    from .probe import NarrowPassError, run_probe
    from .verdict import failed, judge, verdict

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda", "xpu", "mps", "hpu"):
        raise PrecisionUsageError(f"--device {device}: autocast runs on cpu, cuda, xpu, mps or hpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PrecisionUsageError(f"--device {device}: torch sees no CUDA device here (torch "
                                  f"{torch.__version__}); use --device cuda on a machine with one, or --device cpu")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, ValueError, AssertionError) as e:
        raise PrecisionUsageError(f"--device {device}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    target = getattr(torch, DTYPES[args.dtype])
    stage = ["loading the model"]
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    with Progress("torchdoctor precision", lambda: stage[0]):
        # (a folder's transformers import is kept quiet; a factory's own output is shown, on stderr under --json)
        loaded = load(args.model, args.batch, args.seq_len, args.batch_size, device, json_out=args.json)
        times["load_s"] = time.perf_counter() - t0
        stage[0] = f"one {args.dtype} forward, one fp32 forward and backward"
        try:
            probe = run_probe(loaded.model, loaded.batch, target, device)
        except NarrowPassError as e:
            _cannot_run(loaded, e.error, args.dtype, device, "forward")
        except Exception as e:  # noqa: BLE001 -- the model (or its config) refused the batch: its own message
            raise PrecisionUsageError(f"the model's forward or backward on the batch raised {type(e).__name__}: "
                                      f"{_first_line(e)}") from None
        times["measure_s"] = probe.seconds
        prediction = predict(probe)
        stage[0] = f"verifying the fix under {args.dtype} autocast"
        t1 = time.perf_counter()
        try:
            needs_fix = prediction.overflow or prediction.at_risk or prediction.weights_over
            fix = find_regions(loaded.model, loaded.batch, probe, prediction) if needs_fix else None
            scale = prediction.loss_scale
            steps = prediction.fp32_fault is None or not prediction.fp32_fault.params  # (else no scale can step)
            clean = fix is None or fix.verified or not prediction.overflows  # a forward the backward can follow
            regions = fix.regions if fix is not None and fix.verified else []
            checks = (check_scales(loaded.model, loaded.batch, probe, regions, scale)
                      if scale is not None and steps and clean else [])
        except Exception as e:  # noqa: BLE001 -- the fp32 passes ran: the target dtype's forward+backward did not
            _cannot_run(loaded, e, args.dtype, device, "forward and backward")
        times["verify_s"] = time.perf_counter() - t1
    findings = judge(prediction, fix, checks, args.dtype, device)
    findings[0:0] = [Finding("precision.note", "info", n) for n in loaded.notes]
    said = verdict(prediction, fix, checks)
    if args.json:
        print(dumps({
            "model": loaded.what, "batch": loaded.batch_what, "dtype": args.dtype, "device": device,
            "verdict": said, "paired": prediction.paired,
            "overflow": [s.to_json() for s in prediction.overflow],
            "at_risk": [s.to_json() for s in prediction.at_risk],
            "absorbed": [s.to_json() for s in prediction.absorbed],
            "underflow": [u.to_json() for u in prediction.underflow],
            "weights": {"over": prediction.weights_over, "at_risk": prediction.weights_at_risk,
                        "flushed": prediction.weights_flushed},
            "buffers": {"over": prediction.buffers_over},
            "fp32_fault": prediction.fp32_fault.to_json() if prediction.fp32_fault else None,
            "loss_scale": prediction.loss_scale.to_json() if prediction.loss_scale else None,
            "scale_checks": [c.to_json() for c in checks],
            "observed_first": prediction.observed_first, "fix": fix.to_json() if fix else None,
            "loss": {"fp32": probe.loss, args.dtype: probe.narrow_loss}, "seconds": times,
            "findings": [f.to_json() for f in findings],
        }))
    else:
        print(f"torchdoctor precision: {loaded.what}\n  on {loaded.batch_what}; target {args.dtype} on {device}; "
              f"measured in {probe.seconds:.1f} s, fix checked in {times['verify_s']:.1f} s\n")
        print(render_text(findings, color=use_color(sys.stdout)))
        print(f"\nverdict: {said}" + (f" ({worst(findings)})" if said == "safe" else ""))
    return EXIT_PROBLEMS if said == "broken" or failed(prediction, fix, checks) else EXIT_OK


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _cannot_run(loaded, error: BaseException, dtype: str, device: str, what: str) -> None:
    """The target dtype's pass raised ``error``. Said as what it is, each part checked: the fp32 forward and backward
    raise too -> the model's (or the batch's) own error; a plain forward and backward under the target dtype's
    autocast (no torchdoctor in it) raises -> the model cannot run in ``dtype`` on this device (:class:`CannotRun`);
    neither -> the error is torchdoctor's own, raised as it is."""
    import torch

    from .load import PrecisionUsageError
    from .probe import call, loss_of, seeded

    def forward_backward(target: torch.dtype | None) -> BaseException | None:
        try:
            with seeded(), torch.autocast(device.split(":")[0], dtype=target, enabled=target is not None):
                loss, _ = loss_of(call(loaded.model, loaded.batch))
            if loss.requires_grad:
                loss.float().backward()
        except Exception as e:  # noqa: BLE001 -- whatever the model raises is the answer
            return e
        finally:
            for p in loaded.model.parameters():
                p.grad = None
        return None

    fp32 = forward_backward(None)
    if fp32 is not None:
        raise PrecisionUsageError(f"the model's forward or backward on the batch raised {type(fp32).__name__}: "
                                  f"{_first_line(fp32)}") from None
    own = forward_backward(getattr(torch, DTYPES[dtype]))
    if own is None:
        raise error  # not the model's: the model runs in that dtype without torchdoctor around it
    kind = device.split(":")[0]
    other = "bf16" if dtype == "fp16" else "fp16"
    fix = [f"measure it where it will train (--device cuda on a machine with a GPU): {kind}'s autocast kernels are "
           f"not CUDA's", f"or --dtype {other}, if you may train in it"]
    said = f"{type(own).__name__}: {_first_line(own)}"
    raise CannotRun(f"the model runs in fp32 but its {what} under {dtype} autocast on {kind} raised {said}", said,
                    device, fix) from None

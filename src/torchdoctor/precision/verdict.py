"""The findings of ``torchdoctor precision``: a prediction (:mod:`.predict`), its fix (:mod:`.fix`) and the loss
scales checked with a backward, said most serious first. Every sentence rests on a measured value or on a check
that ran; a prediction that was not checked says so, and a check overrides the prediction it tested.
"""

from __future__ import annotations

from ..findings import Finding
from .fix import FixResult, ScaleCheck, fix_code
from .predict import DEFAULT_SCALE_POWER, FLUSH_SHARE, RISK_FACTOR, LossScale, Prediction

_SHOWN = 6  # sites listed per finding
BF16 = ["train in bf16 (fp32's range): torch.autocast(device_type, dtype=torch.bfloat16); HF Trainer --bf16; "
        "DeepSpeed \"bf16\": {\"enabled\": true}"]


def verdict(prediction: Prediction, fix: FixResult | None, checks: list[ScaleCheck]) -> str:
    """``broken`` (not finite in fp32), ``overflow``, ``at-risk`` or ``safe``."""
    if prediction.fp32_fault is not None and (prediction.fp32_fault.params or not _finite(prediction.fp32_fault.loss)):
        return "broken"
    if failed(prediction, fix, checks):
        return "overflow"
    return "at-risk" if prediction.at_risk or prediction.weights_at_risk else "safe"


def failed(prediction: Prediction, fix: FixResult | None, checks: list[ScaleCheck]) -> bool:
    """An overflow (forward, weights), or no loss scale that keeps the gradients: every one checked overflowed, or
    the largest that did not flushes too many of the parameters' gradients to zero. (A fix not found for values
    only near the range is a warning.)"""
    if prediction.overflows:
        return True
    if not checks or prediction.loss_scale is None:
        return False
    power, flushed = scale_outcome(prediction.loss_scale, checks)
    return power is None or (flushed is not None and flushed > FLUSH_SHARE)


def scale_outcome(scale: LossScale, checks: list[ScaleCheck]) -> tuple[int | None, float | None]:
    """(the largest power checked that kept the gradients finite, or None; the share of the parameters' nonzero
    gradients it flushes to zero, from their fp32 values)."""
    works = [c.power for c in checks if c.ok]
    if not works:
        return None, None
    return max(works), scale.flushed_at.get(max(works))


def judge(prediction: Prediction, fix: FixResult | None, checks: list[ScaleCheck], dtype: str,
          device: str = "cuda") -> list[Finding]:
    """The findings, most serious first."""
    out: list[Finding] = []
    top = f"{prediction.dtype_max:.3g}"
    fix_lines = _fix_lines(fix, dtype)
    if prediction.fp32_fault is not None:
        out.append(_fp32_finding(prediction))
    if prediction.overflow:
        first = prediction.overflow[0]
        out.append(Finding(
            "precision.overflow", "fail",
            f"{dtype} overflow predicted at {first.name} ({first.cls}): {first.op} reaches {first.peak:.3g} in fp32, "
            f"beyond {dtype}'s {top} ({first.headroom:.2f}x, {first.bits:+.1f} bits)",
            [f"{s.name} ({s.cls}): {s.op} {s.peak:.3g} ({s.headroom:.2f}x)" for s in prediction.overflow[:_SHOWN]]
            + _more(prediction.overflow)
            + ([f"in {_a(dtype)} forward of this batch, {prediction.observed_first or '(the model)'} went inf/nan "
                "first"] if prediction.observed_first is not None else []),
            fix_lines or _own_code_fix(prediction.overflow, device) + BF16,
            {"modules": [s.module for s in prediction.overflow]}))
    if prediction.weights_over:
        out.append(Finding(
            "precision.weights-out-of-range", "fail",
            f"{len(prediction.weights_over)} weight tensor(s) hold values beyond {dtype}'s {top} (a model pretrained "
            f"in bf16 or fp32): {prediction.weights_over[0][0]} reaches {prediction.weights_over[0][1]:.3g}",
            [f"{n}: {m:.3g}" for n, m in prediction.weights_over[:_SHOWN]],
            (fix_lines + [f"(under autocast a module kept in fp32 keeps its weights in fp32; a model cast to {dtype} "
                          "-- model.half(), DeepSpeed fp16 -- cannot hold them: bf16)"]) if fix_lines else BF16,
            {"weights": prediction.weights_over}))
    if prediction.at_risk:
        first = prediction.at_risk[0]
        out.append(Finding(
            "precision.at-risk", "warn",
            f"{len(prediction.at_risk)} module(s) compute {dtype} values within {RISK_FACTOR:g}x of {dtype}'s largest "
            f"value ({top}): {first.name} at {first.peak:.3g}",
            [f"{s.name} ({s.cls}): {s.op} {s.peak:.3g}, headroom {s.headroom:.2f}x ({s.bits:+.1f} bits)"
             for s in prediction.at_risk[:_SHOWN]],
            _at_risk_fix(prediction, fix, fix_lines, device),
            {"modules": [s.module for s in prediction.at_risk]}))
    if prediction.weights_at_risk:
        out.append(Finding("precision.weights-at-risk", "warn",
                           f"{len(prediction.weights_at_risk)} weight tensor(s) within {RISK_FACTOR:g}x of {dtype}'s "
                           f"{top}", [f"{n}: {m:.3g}" for n, m in prediction.weights_at_risk[:_SHOWN]]))
    if prediction.buffers_over:
        n, m = prediction.buffers_over[0]
        out.append(Finding(
            "precision.buffers-out-of-range", "warn",
            f"{len(prediction.buffers_over)} buffer(s) hold values beyond {dtype}'s {top}: {n} reaches {m:.3g}. "
            f"Autocast leaves buffers in fp32, so this is no overflow under it; a model cast to {dtype} "
            "(model.half(), DeepSpeed fp16) turns them inf",
            [f"{b}: {v:.3g} (a buffer, not a parameter: no optimizer updates it)" for b, v in
             prediction.buffers_over[:_SHOWN]],
            ["train under autocast (buffers stay fp32), or in bf16; do not cast the model itself to " + dtype],
            {"buffers": prediction.buffers_over}))
    if fix is not None and not fix.verified:
        out.append(Finding(
            "precision.no-region-fix", "fail" if prediction.overflows else "warn",
            f"no small fp32 region fixes it: {fix.reason}",
            [f"tried: {', '.join(fix.regions) or '(none)'}; still out of range: "
             f"{', '.join(r or '(the model)' for r in fix.remaining) or '?'}"],
            _own_code_fix(prediction.overflow + prediction.at_risk, device) + BF16, fix.to_json()))
    scale = prediction.loss_scale
    if scale is not None and scale.max_power is not None:
        out.append(scale_finding(scale, checks, fix, bool(prediction.fp32_fault and prediction.fp32_fault.params)))
    if prediction.absorbed:
        s = prediction.absorbed[0]
        out.append(Finding(
            "precision.absorbed", "info",
            f"inside {s.name} ({s.cls}) {_a(dtype)} value overflows ({s.op} {s.peak:.3g}) but the module's output "
            "stays finite (a saturating function, e.g. tanh(inf) = 1)",
            [f"{a.name}: {a.op} {a.peak:.3g}" for a in prediction.absorbed[:_SHOWN]]))
    if prediction.underflow:
        u = prediction.underflow[0]
        root = [x for x in prediction.underflow[:_SHOWN] if not x.module]
        out.append(Finding(
            "precision.underflow", "warn" if u.flushed >= 0.05 else "info",
            f"{dtype} would flush {u.flushed:.1%} of the nonzero values {u.name} computes to zero ({u.subnormal:.1%} "
            "subnormal)",
            [f"{x.name}: {x.flushed:.1%} to zero, {x.subnormal:.1%} subnormal, of {x.values} values"
             for x in prediction.underflow[:_SHOWN]],
            (["keep that module in fp32 (torchdoctor.keep_fp32(model, NAME)), or train in bf16 (fp32's exponent "
              "range)"] if len(root) < len(prediction.underflow[:_SHOWN]) else [])
            + (_own_code_lines([x.where for x in root], device) + ["or train in bf16 (fp32's exponent range)"]
               if root else [])))
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


def _fp32_finding(prediction: Prediction) -> Finding:
    fault = prediction.fp32_fault
    first = fault.first
    made = f"{first.op}'s output in {first.module or '(the model)'}" if first is not None else ""
    readers = ", ".join(dict.fromkeys(first.consumers)) if first is not None else ""
    where = (None if first is None else
             f"the first gradient to go inf/nan in the fp32 backward is the one {readers} sent back (into {made}): "
             "the backward of that op made it" if readers else
             f"the first gradient to go inf/nan in the fp32 backward is that of {made}")
    if not _finite(fault.loss):
        title = (f"the loss is already {fault.loss} in fp32: the model or the batch is broken before any precision "
                 "question")
    elif fault.params:
        title = (f"the backward is already non-finite in fp32: {len(fault.params)} parameter gradient(s) are inf/nan "
                 f"(e.g. {fault.params[0]}), so training cannot step in any precision")
    else:
        title = (f"the backward is already non-finite in fp32 inside the model ({fault.tensors} gradient(s) inf/nan), "
                 "though no parameter's gradient is: the parameters before that point receive none of it")
    evidence = [where] if where else []
    fix = ["find the op that divides by zero or takes sqrt/log at 0 there (torch.sqrt(x + eps), x.clamp_min(eps)); "
           "torch.autograd.set_detect_anomaly(True) names it in a traceback"]
    severity = "fail" if fault.params or not _finite(fault.loss) else "warn"
    return Finding("precision.fp32-nonfinite", severity, title, evidence, fix, fault.to_json())


def scale_finding(scale: LossScale, checks: list[ScaleCheck], fix: FixResult | None, broken: bool = False) -> Finding:
    """The loss scale: what the gradients predict (overflow from their peak, flushing from the parameters'
    gradients), and what the backwards at the scales checked did -- a failed check is never followed by "works"."""
    data = scale.to_json() | {"checks": [c.to_json() for c in checks]}
    predicted = (f"gradients peak at {scale.grad_peak:.3g}: predicted 2**{scale.min_power} .. 2**{scale.max_power} "
                 f"keeps them in fp16 with {RISK_FACTOR:g}x to spare" if scale.works else
                 f"gradients peak at {scale.grad_peak:.3g}: predicted at most 2**{scale.max_power} without overflow")
    evidence = [f"unscaled, {scale.flushed_unscaled:.2%} of the parameters' nonzero gradients flush to zero in fp16 "
                "(from their fp32 values)"]
    evidence += [f"checked: a backward at 2**{c.power} " + (f"made {c.overflowed} parameter gradient(s) inf/nan"
                                                           if c.overflowed else "kept every gradient finite")
                 for c in checks]
    if not checks:
        why = ("parameter gradients are inf/nan in fp32 already" if broken else
               "the forward overflows and no fp32 region fixes it" if fix is not None and not fix.verified
               else "no backward was run")
        return Finding("precision.loss-scale", "info", f"loss scale, predicted only ({why}, so not checked): "
                       + predicted, evidence, [], data)
    power, flushed = scale_outcome(scale, checks)
    if power is None:
        tried = sorted(c.power for c in checks)
        return Finding("precision.loss-scale", "fail", "no loss scale checked keeps the gradients finite in fp16: "
                       f"every backward from 2**{tried[-1]} down to 2**{tried[0]} overflowed; {predicted}", evidence,
                       BF16, data)
    if flushed is not None and flushed > FLUSH_SHARE:
        above = [c.power for c in checks if c.overflowed and c.power > power]
        return Finding("precision.loss-scale", "fail",
                       "no loss scale keeps the gradients in fp16: "
                       + (f"at 2**{min(above)} they overflow (checked), and " if above else "")
                       + f"at 2**{power}, the largest checked that keeps them finite, {flushed:.1%} of the "
                       "parameters' nonzero gradients flush to zero (from their fp32 values)", evidence, BF16, data)
    default = next((c for c in checks if c.power == DEFAULT_SCALE_POWER), None)
    if default is not None and default.ok:
        return Finding("precision.loss-scale", "ok", f"loss scale: the default 2**{DEFAULT_SCALE_POWER} works "
                       f"(checked); {predicted}", evidence, [], data)
    fix_lines = [f"torch.amp.GradScaler(init_scale=2.0**{power})",
                 f"DeepSpeed: \"fp16\": {{\"enabled\": true, \"initial_scale_power\": {power}}}"]
    if default is not None and default.overflowed and power < DEFAULT_SCALE_POWER:
        fix_lines.append(f"(with the default 2**{DEFAULT_SCALE_POWER} the first {DEFAULT_SCALE_POWER - power} step(s) "
                         "overflow and are skipped while the scale backs off)")
    return Finding("precision.loss-scale", "warn", f"loss scale: start at 2**{power} (checked); {predicted}",
                   evidence, fix_lines, data)


def _at_risk_fix(prediction: Prediction, fix: FixResult | None, fix_lines: list[str], device: str) -> list[str]:
    watch = ["watch them while training: NumericsMonitor(model, optimizer, headroom=True) warns before one "
             "overflows, with the steps left"]
    if not fix_lines:
        return _own_code_fix(prediction.at_risk, device) + watch
    if prediction.overflow:  # the fix is on the overflow finding; say whether it covers these too
        covered = all(any(s.module == r or s.module.startswith(r + ".") for r in fix.regions)
                      for s in prediction.at_risk)
        return ["the fix above keeps them in fp32"] if covered else watch
    return fix_lines


def _own_code_fix(sites: list, device: str) -> list[str]:
    """For values the model's own forward computes (no module to keep in fp32): the lines, and how to run them in
    fp32 -- said as not checked, since torchdoctor cannot change them."""
    return _own_code_lines([s.where for s in sites if not s.module], device)


def _own_code_lines(wheres: list[str | None], device: str) -> list[str]:
    if not wheres:
        return []
    lines = sorted({w for w in wheres if w})
    at = f" ({'; '.join(lines[:3])})" if lines else ""
    return [f"the model's own forward computes it{at}, outside any submodule: run those lines in fp32 -- "
            f"with torch.autocast({device.split(':')[0]!r}, enabled=False): ... on inputs .float() -- (not checked: "
            "torchdoctor cannot change them)"]


def _more(sites: list) -> list[str]:
    return [f"... and {len(sites) - _SHOWN} more"] if len(sites) > _SHOWN else []


def _a(dtype: str) -> str:
    return ("an " if dtype == "fp16" else "a ") + dtype


def _fix_lines(fix: FixResult | None, dtype: str) -> list[str]:
    if fix is None or not fix.verified or not fix.regions:
        return []
    checked = (f"checked: a forward under {dtype} autocast with these in fp32 stays within range"
               + (" and its backward stays finite" if fix.backward_checked else
                  " (its backward is not checked: it is non-finite in fp32 already)")
               + (f" ({fix.param_share:.1%} of the parameters in fp32)" if fix.param_share else ""))
    return ["after building the model:"] + [f"    {line}" for line in fix_code(fix.regions)] + [checked]


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


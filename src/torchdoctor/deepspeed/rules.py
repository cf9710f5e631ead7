"""The semantic rules of ``ds check``: what a config that DeepSpeed parses will do in the run.

Precision (fp16 and bf16 together, bf16 on old GPUs), the fp16 loss scaler, the hidden overflow messages, the batch
size arithmetic, ZeRO offload, and the "auto" values nobody fills. Each rule reads the config as DeepSpeed will
(:class:`_Ctx`: defaults, "auto" dropped by its models) and gives findings; nothing here probes the machine.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..advice import fp16_collapse_fix
from ..findings import Finding
from .hf_fill import HfFill
from .schema import Schema
from .validate import _autos
from .values import _NO, _default, _lax_bool, _lax_float, _lax_int, _show

# -- the rules ---------------------------------------------------------------------------------------------------

_OVERFLOW_LINE = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: X, reducing to Y"
_COLLAPSE = ('If the scale keeps falling to min_loss_scale ("Attempted loss scale: 1, reducing to 1"), the gradients '
             "overflow at every scale: " + fp16_collapse_fix(deepspeed=True))


class _Ctx:
    """The config as DeepSpeed will read it."""

    def __init__(self, config: dict, for_: str, sch: Schema, hf: HfFill | None = None) -> None:
        self.config, self.for_, self.sch, self.hf = config, for_, sch, hf
        self.hf_filled = frozenset(hf.fills) if hf is not None else frozenset()  # "auto" the HF Trainer fills

    def block(self, path: str) -> dict:
        d: Any = self.config
        for part in path.split(".") if path else ():
            nxt = d.get(part) if isinstance(d, dict) else None
            if part == "bf16" and d is self.config and nxt is None:
                nxt = self.config.get("bfloat16")  # DeepSpeed's old name, read when "bf16" is absent
            d = nxt
        return d if isinstance(d, dict) else {}

    def eff(self, block: str, key: str, conv, default: Any) -> Any:
        """What DeepSpeed uses for ``block.key``: the default when absent (or an "auto" its model drops); None
        when it cannot be known here (the HF Trainer fills it, or the value is invalid and reported elsewhere)."""
        d = self.block(block)
        if key not in d:
            return default
        v = d[key]
        if isinstance(v, str) and v == "auto":
            if self.for_ == "hf" and (f"{block}.{key}" if block else key) in self.hf_filled:
                return None
            return default if block in self.sch.strict else None
        return None if v is None else conv(v)

    def stage(self) -> int | None:
        z = self.config.get("zero_optimization")
        if isinstance(z, bool):
            return int(z)
        return self.eff("zero_optimization", "stage", lambda v: n if (n := _lax_int(v)) in (0, 1, 2, 3) else None, 0)

    def device(self, which: str) -> str | None:
        return self.eff(f"zero_optimization.{which}", "device",
                        lambda v: v if v in ("none", "cpu", "nvme") else None, "none")


def _caps(gpu_capabilities: list[str]) -> list[tuple[int, int]]:
    out = []
    for c in gpu_capabilities:
        major, _, minor = str(c).partition(".")
        try:
            out.append((int(major), int(minor or 0)))
        except ValueError:
            continue
    return out


def _gpus_text(caps: list[tuple[int, int]]) -> str:
    counts: dict[tuple[int, int], int] = {}
    for c in caps:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n}x sm {a}.{b}" for (a, b), n in sorted(counts.items()))


def _hf_unfilled_rule(ctx: _Ctx, keys: list[str]) -> list[Finding]:
    """--for hf: "auto" values neither transformers nor accelerate fills stop accelerate before training."""
    hf = ctx.hf
    assert hf is not None
    n = len(keys)
    message = hf.message or "`KEY` not found in kwargs."
    evidence = [f'accelerate\'s Accelerator._prepare_deepspeed stops before the first step: "ValueError: {message}"',
                "Not filled: " + ", ".join(keys) + "."]
    if hf.fills:
        evidence.append("Filled here: " + "; ".join(f"{k} <- {v}" for k, v in hf.fills.items()) + f" ({hf.source}).")
    else:
        evidence.append(f"The HF Trainer fills none of this config's \"auto\" values ({hf.source}).")
    own = [k for k in keys if k in ctx.sch.ds_auto]
    if own:
        evidence.append(f'{", ".join(own)}: "auto" is DeepSpeed\'s own default there, so removing the key keeps the '
                        "same meaning.")
    fix = ["replace each with the value the run should use" + (" (or remove " + ", ".join(own) + ")" if own else "")]
    edits: list[dict[str, Any]] = [{"path": k.split("."), "remove": True} for k in own] if len(own) == n else []
    old_bf16 = ctx.config.get("bfloat16")
    if isinstance(old_bf16, dict) and "bf16" not in ctx.config and all(k.startswith("bfloat16.") for k in keys):
        fix = ['rename "bfloat16" to "bf16" (its current name, the one transformers fills): "bf16": '
               + json.dumps(old_bf16)]
        edits = [{"path": ["bfloat16"], "remove": True}, {"path": ["bf16"], "value": old_bf16}]
    data: dict[str, Any] = {"unfilled": keys, "fills": dict(hf.fills), "source": hf.source, "edits": edits}
    if edits and edits[0]["path"] == ["bfloat16"]:
        data["key"] = "bfloat16"  # the block the fix renames, with what is inside it (judged on its own)
    return [Finding("hf.auto-not-filled", "fail",
                    f'{n} "auto" value{"s" if n > 1 else ""} the HF Trainer cannot fill: accelerate stops with '
                    f'ValueError before training ({keys[0]}{", ..." if n > 1 else ""})', evidence, fix,
                    data)]


def _hf_refused_rule(ctx: _Ctx) -> list[Finding]:
    """--for hf: accelerate's DeepSpeedPlugin refuses the config before anything runs."""
    if ctx.for_ != "hf" or ctx.hf is None or not ctx.hf.refused:
        return []
    msg = ctx.hf.refused
    no_zero = "zero_optimization" not in ctx.config
    fix = ['add a ZeRO block, e.g. "zero_optimization": {"stage": 0}  (stage 0: plain data parallel)' if no_zero
           else "change the config as the message says"]
    return [Finding("hf.accelerate-refuses", "fail", f"accelerate refuses this config: {msg.splitlines()[0][:100]}",
                    [f'TrainingArguments(deepspeed=...) builds accelerate\'s DeepSpeedPlugin, which raises '
                     f'"ValueError: {msg}" before the model is touched ({ctx.hf.source}).'], fix,
                    {"message": msg, "edits": [{"path": ["zero_optimization"], "value": {"stage": 0}}] if no_zero
                     else []})]


def _auto_rule(ctx: _Ctx) -> list[Finding]:
    dropped: list[str] = []  # in a pydantic block: DeepSpeed drops "auto" and uses the default
    passed: list[str] = []  # elsewhere: the string "auto" reaches the code
    notes: list[str] = []
    unfilled = set(ctx.hf.unfilled) if ctx.for_ == "hf" and ctx.hf is not None else set()
    for dotted in _autos(ctx.config):
        if ctx.for_ == "hf" and (dotted in ctx.hf_filled or dotted in unfilled):
            continue  # filled, or judged by hf.auto-not-filled
        if dotted in ctx.sch.ds_auto:
            continue  # DeepSpeed's own default for the key: "auto" is what it reads there anyway
        parts = dotted.split(".")
        if parts[0] == "bfloat16":
            parts[0] = "bf16"
        if any(".".join(parts[:i]) in ctx.sch.strict for i in range(1, len(parts))):
            spec = ctx.sch.blocks.get(".".join(parts[:-1]), {}).get(parts[-1])
            d = _default(spec) if spec is not None else _NO
            dropped.append(f"{dotted} (-> {_show(d)})" if d is not _NO else dotted)
            if dotted in ("fp16.enabled", "bf16.enabled", "bfloat16.enabled"):
                notes.append(f'{dotted} "auto" becomes false: {parts[0]} is silently off and the run trains in fp32.')
            elif dotted == "zero_optimization.stage":
                notes.append('zero_optimization.stage "auto" becomes 0: ZeRO is silently off.')
        else:
            passed.append(dotted)
    out = _hf_unfilled_rule(ctx, list(ctx.hf.unfilled)) if unfilled and ctx.hf is not None else []
    if not dropped and not passed:
        return out
    keys = [*dropped, *passed]
    n = len(keys)
    evidence = list(notes)
    if dropped:
        evidence.append("DeepSpeed's config models drop \"auto\" and use their defaults: " + ", ".join(dropped) + ".")
    if passed:
        evidence.append('DeepSpeed receives the string "auto" and does not resolve it, so it fails at start or where '
                        "the value is used: " + ", ".join(passed) + ".")
    if ctx.for_ == "deepspeed":
        title = (f'{n} "auto" value{"s" if n > 1 else ""}, but plain DeepSpeed does not fill "auto"'
                 + (' -- fp16.enabled "auto" means fp16 off' if "fp16.enabled" in "".join(dropped) else ""))
        evidence.append('Only the HF Trainer (transformers + accelerate) replaces "auto" with TrainingArguments values;'
                        " deepspeed.initialize() does not.")
        fix = ["replace each with the value the run should use"
               + (', e.g. "fp16": {"enabled": true}' if "fp16.enabled" in "".join(dropped) else ""),
               "or, when the config is for the HF Trainer (TrainingArguments(deepspeed=...)), check it with --for hf"]
        # a string that reaches the code breaks the run; one DeepSpeed's model drops only means its default
        severity = "fail" if passed else "warn"
    else:  # inside lists: accelerate does not look there, DeepSpeed gets the string
        title = f'{n} "auto" value{"s" if n > 1 else ""} inside lists, which the HF Trainer does not fill'
        evidence.append("transformers and accelerate replace \"auto\" only in values of objects, not in list items.")
        fix = ["replace each with the value the run should use"]
        severity = "fail" if passed else "warn"
    return [*out, Finding("config.auto-outside-hf", severity, title, evidence, fix,
                          {"dropped": [k.split(" ")[0] for k in dropped], "passed_on": passed, "for": ctx.for_,
                           "edits": []})]  # the value is the user's to choose


_BF16_EDITS = [{"path": ["bf16", "enabled"], "value": True}, {"path": ["fp16", "enabled"], "value": False}]


def _precision_rules(ctx: _Ctx, caps: list[tuple[int, int]]) -> list[Finding]:
    out: list[Finding] = []
    fp16_on = ctx.eff("fp16", "enabled", _lax_bool, False)
    bf16_on = ctx.eff("bf16", "enabled", _lax_bool, False)
    ampere = bool(caps) and all(c >= (8, 0) for c in caps)
    hf = ctx.for_ == "hf"
    if fp16_on and bf16_on:
        keep_bf16 = '"fp16": {"enabled": false}, "bf16": {"enabled": true}'
        keep_fp16 = '"fp16": {"enabled": true}, "bf16": {"enabled": false}'
        older = bool(caps) and not ampere
        out.append(Finding(
            "precision.fp16-and-bf16", "fail", "fp16 and bf16 are both enabled",
            ["DeepSpeed asserts at start: \"bfloat16 and fp16 modes cannot be simultaneously enabled\"."]
            + ([f"GPUs here: {_gpus_text(caps)}."] if caps else []),
            [f"keep one: {keep_fp16} (GPUs older than sm 8.0 have no native bf16)" if older else
             f"keep one: {keep_bf16} (Ampere/sm 8.0 or newer)",
             f"or {keep_bf16}" if older else f"or {keep_fp16} (GPUs older than sm 8.0)"],
            {"fp16": True, "bf16": True}))
        return out
    if fp16_on:
        fix = ['"bf16": {"enabled": true} and remove the "fp16" block (or set "fp16": {"enabled": false})']
        if hf:
            fix.append('with the HF Trainer: "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"} and train '
                       "with --bf16 instead of --fp16")
        why = ("fp16's largest value is 65504: models pretrained in bf16 (TPU-trained ones especially) often produce "
               "activations beyond it, which become inf and then a NaN loss. bf16 has fp32's range (3.4e38) and "
               "needs no loss scaling.")
        if ampere:
            out.append(Finding(
                "precision.prefer-bf16", "warn", f"fp16 on GPUs with native bf16 ({_gpus_text(caps)}): prefer bf16",
                [f"Every visible GPU is sm 8.0 (Ampere) or newer: {_gpus_text(caps)}.", why], fix,
                {"gpu_capabilities": [f"{a}.{b}" for a, b in caps], "edits": _BF16_EDITS}))
        elif not caps:
            out.append(Finding(
                "precision.prefer-bf16", "info", "fp16 is enabled; on Ampere (sm 8.0) or newer GPUs bf16 is safer",
                ["No GPU is visible here, so the training GPUs could not be checked.", why], fix,
                {"gpu_capabilities": [], "edits": _BF16_EDITS}))
    if bf16_on and caps and any(c < (8, 0) for c in caps):
        old = [c for c in caps if c < (8, 0)]
        out.append(Finding(
            "precision.bf16-unsupported", "warn", f"bf16 on GPUs without native bf16 ({_gpus_text(old)})",
            ["GPUs older than sm 8.0 (Ampere) have no bf16 units: torch emulates bf16 there (slowly) and DeepSpeed's "
             "bf16 kernels need sm 8.0 or newer."],
            ['"fp16": {"enabled": true, "loss_scale": 0}, "bf16": {"enabled": false}  (fp16 with dynamic loss '
             "scaling), or fp32 (no precision blocks)"],
            {"gpu_capabilities": [f"{a}.{b}" for a, b in caps]}))
    return out


def _loss_scale_rules(ctx: _Ctx) -> list[Finding]:
    if ctx.eff("fp16", "enabled", _lax_bool, False) is not True:
        return []
    out: list[Finding] = []
    ls = ctx.eff("fp16", "loss_scale", _lax_float, 0.0)
    if ls is None or not math.isfinite(ls) or ls < 0:
        return out  # reported as config.bad-value
    isp = ctx.eff("fp16", "initial_scale_power", _lax_int, 16)
    win = ctx.eff("fp16", "loss_scale_window", _lax_int, 1000)
    hyst = ctx.eff("fp16", "hysteresis", _lax_int, 2)
    cons = ctx.eff("fp16", "consecutive_hysteresis", _lax_bool, False)
    minls = ctx.eff("fp16", "min_loss_scale", _lax_int, 1)

    def finding(sev: str, title: str, evidence: list[str], fix: str, key: str, value: Any) -> None:
        out.append(Finding("fp16.loss-scale", sev, title, evidence, [fix], {"key": f"fp16.{key}", "value": value}))

    if ls > 0:
        dyn_keys = [k for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                                "min_loss_scale") if k in ctx.block("fp16")]
        finding("warn", f"fp16.loss_scale = {ls:g}: a static loss scale, no dynamic loss scaling",
                ["With loss_scale > 0 DeepSpeed keeps the scale fixed: a step whose gradients overflow is skipped "
                 '("OVERFLOW! Skipping step") and the scale is never lowered, so a scale that is too high skips step '
                 "after step, and one that is too low flushes small gradients to zero."]
                + ([f"{', '.join(dyn_keys)} only apply to dynamic scaling (loss_scale 0) and are ignored."]
                   if dyn_keys else []),
                '"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}  (dynamic scaling, '
                "DeepSpeed's default)", "loss_scale", ls)
        return out
    for key, value in (("loss_scale_window", win), ("min_loss_scale", minls)):
        if value is not None and value <= 0:
            out.append(Finding(
                "config.bad-value", "fail", f"fp16.{key} = {value}: expected an integer > 0 with dynamic loss scaling",
                [f"DeepSpeed's fp16 model refuses it when fp16 is on with loss_scale 0: \"fp16.{key} must be > 0 when "
                 'dynamic loss scaling is enabled (loss_scale=0)".'],
                [f'"fp16": {{"{key}": {1000 if key == "loss_scale_window" else 1}}}  (DeepSpeed\'s default)'],
                {"key": f"fp16.{key}", "value": value, "expected": "an integer > 0"}))
    if hyst is not None and hyst <= 0:
        finding("fail", f"fp16.hysteresis = {hyst}: the dynamic loss scale is never lowered",
                ["DynamicLossScaler halves the scale only when hysteresis is 1 or its countdown reaches 1; from "
                 f"{hyst} the countdown only goes down, so every step whose gradients overflow is skipped at the same "
                 "scale, for the rest of the run (each skip logged at INFO only)."],
                '"fp16": {"hysteresis": 2}  (DeepSpeed\'s default)', "hysteresis", hyst)
    if isp is not None and isp < 8:
        steps = (16 - isp) * win if win and win > 0 else None
        finding("warn", f"fp16.initial_scale_power = {isp}: the loss scale starts at 2^{isp}",
                ["A gradient survives in fp16 only if gradient x scale >= 6e-8 (fp16's smallest subnormal): at "
                 f"2^{isp} gradients below {math.ldexp(1.0, -24 - isp) if isp > -990 else math.inf:.1e} flush to "
                 f"zero (at DeepSpeed's default 2^16: {math.ldexp(1.0, -40):.1e}). The scale only doubles after "
                 f"loss_scale_window ({win}) clean steps"
                 + (f", so reaching 2^16 takes {steps} steps." if steps else ".")],
                '"fp16": {"initial_scale_power": 16}  (DeepSpeed\'s default: if it is too high, the first '
                "overflowing steps are skipped while it halves)", "initial_scale_power", isp)
    elif isp is not None and isp > 32:
        skipped = isp - 16 + max((hyst or 1) - 1, 0)
        finding("warn", f"fp16.initial_scale_power = {isp}: the loss scale starts at 2^{isp}",
                [f"Each overflowing step is skipped and halves the scale (after hysteresis {hyst} counts down): coming "
                 f"down to DeepSpeed's default 2^16 costs {skipped} skipped steps when the gradients overflow there.",
                 _COLLAPSE],
                '"fp16": {"initial_scale_power": 16}  (DeepSpeed\'s default; the HF guide\'s advice stops at 32)',
                "initial_scale_power", isp)
    if win is not None and 0 < win < 100:
        finding("warn", f"fp16.loss_scale_window = {win}: the loss scale is raised every {win} clean steps",
                [f"DynamicLossScaler doubles the scale after every {win} steps without overflow; when the doubled "
                 "scale overflows, that step is skipped"
                 + (f" (up to {hyst} of them, hysteresis)" if hyst and hyst > 1 else "")
                 + " and the scale halves again: a run at its largest safe scale throws away about one step in "
                 f"{win}."],
                '"fp16": {"loss_scale_window": 1000}  (DeepSpeed\'s default)', "loss_scale_window", win)
    if cons and hyst is not None and hyst > 1:
        finding("warn", f"fp16.consecutive_hysteresis = true with hysteresis {hyst}: scattered overflows never "
                        "lower the scale",
                [f"DeepSpeed refills hysteresis after every clean step, so the scale only halves when {hyst} "
                 "overflows come in a row: a run that overflows every other step skips half its steps and the scale "
                 "never adapts (each skip is logged at INFO only)."],
                '"fp16": {"consecutive_hysteresis": false}  (DeepSpeed\'s default)', "consecutive_hysteresis", True)
    if minls is not None and minls > 1 and isp is not None and 0 <= isp <= 1000 and minls >= 2**isp:
        finding("warn", f"fp16.min_loss_scale = {minls} is not below the initial scale 2^{isp}",
                ["The dynamic scale never goes below min_loss_scale, and an overflow at the minimum stops the run: "
                 '"Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." With the '
                 "floor at the start, one or two rounds of overflow end the run."],
                '"fp16": {"min_loss_scale": 1}  (DeepSpeed\'s default)', "min_loss_scale", minls)
    return out


def _logging_rule(ctx: _Ctx) -> list[Finding]:
    if ctx.eff("fp16", "enabled", _lax_bool, False) is not True:
        return []
    ls = ctx.eff("fp16", "loss_scale", _lax_float, 0.0)
    if ls is None or ls != 0:
        return []  # static scaling logs its skips at WARNING
    level = ctx.config.get("log_level")
    if level is not None and not isinstance(level, str):
        return []
    if isinstance(level, str) and level.lower() in ("debug", "info"):
        return []
    shown = f'"log_level" is "{level}"' if level is not None else '"log_level" is not set'
    evidence = [
        f"DeepSpeed's dynamic loss scaler logs every skipped step at INFO: \"{_OVERFLOW_LINE}\" "
        "(deepspeed/runtime/fp16/loss_scaler.py).",
        "DeepSpeed's logger (\"DeepSpeed\", deepspeed/utils/logging.py) and its stdout handler start at WARNING; "
        f"only the config key \"log_level\" lowers both, when the engine starts. Here {shown}.",
        "So skipped steps and a falling scale stay invisible until the run stops with \"Current loss scale already "
        "at minimum - cannot decrease scale anymore. Exiting run.\" or the loss is NaN.",
    ]
    if ctx.for_ == "hf":
        evidence.append("The HF Trainer's --log_level info does not help: it sets the DeepSpeed logger's level but "
                        "not its handler's, which stays at WARNING.")
    evidence.append("The deepspeed launcher's --log_level (default info) applies to the launcher process only.")
    evidence.append(_COLLAPSE)
    return [Finding(
        "logging.overflow-hidden", "warn", "fp16 overflow messages will not be printed (DeepSpeed logs them at INFO)",
        evidence,
        ['"log_level": "info" at the top level of the config (DeepSpeed then prints its other INFO lines too)',
         'or in the training script: from deepspeed.utils.logging import set_log_level_from_string; '
         'set_log_level_from_string("info")'],
        {"log_level": level})]


def _batch_rule(ctx: _Ctx, world_size: int | None) -> list[Finding]:
    raw = {k: ctx.config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps")}
    vals: dict[str, int | None] = {}
    for k, v in raw.items():
        if v is None:
            vals[k] = None
        elif isinstance(v, int) and not isinstance(v, bool) and v > 0:
            vals[k] = v
        else:
            return []  # "auto" (filled by the HF Trainer or reported) or a bad value (reported)
    tbs, mb, gas = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    ws = world_size
    ws_note = ("world size = the data-parallel ranks: GPUs / (tensor x pipeline x sequence parallel degree)")
    if ctx.for_ == "hf" and gas is None and (tbs is not None or mb is not None):
        # accelerate's DeepSpeedPlugin writes "gradient_accumulation_steps": 1 into a config that has none, so
        # DeepSpeed never derives it under the HF Trainer
        gas = 1
        ws_note += ("; under the HF Trainer a missing gradient_accumulation_steps is 1 (accelerate's "
                    "DeepSpeedPlugin adds it), DeepSpeed does not derive it")

    def fail(title: str, evidence: list[str], fix: list[str], edits: list | None = None) -> list[Finding]:
        data: dict[str, Any] = {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": mb,
                                "gradient_accumulation_steps": gas, "world_size": ws}
        if edits is not None:
            data["edits"] = edits
        return [Finding("config.batch-size", "fail", title, evidence + [ws_note], fix, data)]

    if tbs is None and mb is None:
        if ctx.for_ == "hf":
            return fail("neither train_batch_size nor train_micro_batch_size_per_gpu is set: the HF Trainer fills "
                        "them only where the config says \"auto\"",
                        ['transformers fills a batch key from TrainingArguments only when the key is present with '
                         '"auto"; without one DeepSpeed stops at start: "Either train_batch_size or '
                         'train_micro_batch_size_per_gpu needs to be provided".'],
                        ['"train_micro_batch_size_per_gpu": "auto"  (filled from --per_device_train_batch_size)'],
                        [{"path": ["train_micro_batch_size_per_gpu"], "value": "auto"}])
        return fail("neither train_batch_size nor train_micro_batch_size_per_gpu is set",
                    ['DeepSpeed stops at start: "Either train_batch_size or train_micro_batch_size_per_gpu needs to be '
                     'provided".'],
                    ['"train_micro_batch_size_per_gpu": 1 (the per-GPU batch; DeepSpeed derives train_batch_size)'])
    if tbs is not None and mb is not None and gas is not None:
        if ws is not None:
            if tbs == mb * gas * ws:
                return []
            fix = [f'"train_batch_size": {mb * gas * ws}  (= {mb} x {gas} x {ws})']
            if tbs % (mb * ws) == 0:
                fix.append(f'or "gradient_accumulation_steps": {tbs // (mb * ws)}  (keeps train_batch_size {tbs})')
            if tbs % (gas * ws) == 0:
                fix.append(f'or "train_micro_batch_size_per_gpu": {tbs // (gas * ws)}')
            fix.append("or remove train_batch_size and let DeepSpeed derive it")
            return fail(f"train_batch_size {tbs} != micro batch {mb} x accumulation {gas} x world size {ws} "
                        f"= {mb * gas * ws}",
                        ["DeepSpeed asserts train_batch_size == train_micro_batch_size_per_gpu x "
                         "gradient_accumulation_steps x world_size at start."], fix)
        if tbs % (mb * gas):
            return fail(f"train_batch_size {tbs} is not a multiple of micro batch {mb} x accumulation {gas} "
                        f"= {mb * gas}: no world size fits",
                        ["DeepSpeed asserts train_batch_size == train_micro_batch_size_per_gpu x "
                         "gradient_accumulation_steps x world_size at start."],
                        [f'"train_batch_size": {mb * gas} x <world size>, or remove it and let DeepSpeed derive it'],
                        [{"path": ["train_batch_size"], "remove": True}])
        implied = tbs // (mb * gas)
        return [Finding("config.batch-size", "info", f"the batch sizes only fit a world size of {implied}",
                        [f"train_batch_size {tbs} = micro batch {mb} x accumulation {gas} x {implied}; on any other "
                         "number of data-parallel ranks DeepSpeed's batch assertion fails.", ws_note],
                        [f"run on {implied} data-parallel ranks, or pass --world-size N to check another size, or "
                         "remove train_batch_size and let DeepSpeed derive it"],
                        {"implied_world_size": implied})]
    if ws is None:
        return []
    # DeepSpeed derives the missing value with floor division, then asserts the product
    if tbs is not None and mb is not None:
        d_gas = tbs // mb // ws
        if d_gas * mb * ws != tbs or d_gas < 1:
            return fail(f"train_batch_size {tbs} does not split into micro batch {mb} x world size {ws}",
                        [f"DeepSpeed derives gradient_accumulation_steps = {tbs} // {mb} // {ws} = {d_gas}, and "
                         f"{mb} x {d_gas} x {ws} = {mb * d_gas * ws} != {tbs}: its batch assertion fails."],
                        [f'"train_batch_size": {mb * max(d_gas, 1) * ws}  (with gradient_accumulation_steps '
                         f"{max(d_gas, 1)})", '"gradient_accumulation_steps": N with train_batch_size = '
                                              f"{mb} x N x {ws}"])
    elif tbs is not None and gas is not None:
        d_mb = tbs // ws // gas
        if d_mb * gas * ws != tbs or d_mb < 1:
            return fail(f"train_batch_size {tbs} does not split into accumulation {gas} x world size {ws}",
                        [f"DeepSpeed derives train_micro_batch_size_per_gpu = {tbs} // {ws} // {gas} = {d_mb}, and "
                         f"{d_mb} x {gas} x {ws} = {d_mb * gas * ws} != {tbs}: its batch assertion fails."],
                        [f'"train_batch_size": {max(d_mb, 1) * gas * ws}  (micro batch {max(d_mb, 1)})',
                         '"train_micro_batch_size_per_gpu": N instead of train_batch_size'])
    elif tbs is not None:
        d_mb = tbs // ws
        if d_mb * ws != tbs or d_mb < 1:
            return fail(f"train_batch_size {tbs} is not a multiple of world size {ws}",
                        [f"DeepSpeed derives train_micro_batch_size_per_gpu = {tbs} // {ws} = {d_mb} (accumulation 1) "
                         "and its batch assertion fails."],
                        [f'"train_batch_size": {max(d_mb, 1) * ws}', '"train_micro_batch_size_per_gpu": N instead'])
    return []


def _zero_rules(ctx: _Ctx, libaio: str | None) -> list[Finding]:
    out: list[Finding] = []
    stage = ctx.stage()
    param_dev, opt_dev = ctx.device("offload_param"), ctx.device("offload_optimizer")
    if stage is not None and stage < 3 and param_dev in ("cpu", "nvme"):
        out.append(Finding(
            "zero.offload-param-stage", "warn",  # DeepSpeed accepts it and does nothing with it
            f'zero_optimization.offload_param ({param_dev}) with ZeRO stage {stage}: parameters are not offloaded',
            [f"DeepSpeed hands offload_param only to the ZeRO-3 engine; at stage {stage} it is ignored without a "
             "word and the parameters stay on the GPU. Stages 1 and 2 can offload only the optimizer."],
            ['"zero_optimization": {"stage": 3, "offload_param": {"device": "' + param_dev + '"'
             + (', "nvme_path": "/local_nvme"' if param_dev == "nvme" else "") + "}}",
             'or keep stage ' + str(stage) + ' and remove offload_param ("offload_optimizer": {"device": "cpu"} '
             "is what stages 1-2 can offload)"],
            {"stage": stage, "device": param_dev}))
    if stage is not None and stage in (1, 2) and opt_dev == "nvme":
        out.append(Finding(
            "zero.nvme-stage", "warn",
            f"zero_optimization.offload_optimizer to NVMe with ZeRO stage {stage}: the optimizer goes to CPU memory",
            [f"The ZeRO stage 1/2 optimizer treats any offload device as CPU: nvme_path is never used at stage {stage}."
             " Only ZeRO-3 swaps optimizer state to NVMe."],
            ['"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}',
             'or "offload_optimizer": {"device": "cpu"} to say what happens'],
            {"stage": stage}))
    nvme = []
    for which, dev in (("offload_param", param_dev), ("offload_optimizer", opt_dev)):
        if dev != "nvme" or stage not in (3, None):  # below stage 3 NVMe is not used (the findings above say so)
            continue
        nvme.append(which)
        path = ctx.eff(f"zero_optimization.{which}", "nvme_path", lambda v: v if isinstance(v, str) else None, None)
        raw = ctx.block(f"zero_optimization.{which}").get("nvme_path")
        if path is None and not (ctx.for_ == "hf" and raw == "auto") or path == "":
            out.append(Finding(
                "zero.nvme-path", "fail", f'zero_optimization.{which} is on "nvme" without an nvme_path',
                ["ZeRO-3 stops at start without it: " + (
                    "an assertion ('\"nvme_path\" in DeepSpeed Config cannot be None if remote device is nvme')."
                    if which == "offload_param" else "a TypeError from os.path.join(None, 'zero_stage_3').")],
                [f'"zero_optimization": {{"{which}": {{"device": "nvme", "nvme_path": "/local_nvme"}}}}  (a '
                 "directory on a local NVMe drive, writable by every rank)"],
                {"block": f"zero_optimization.{which}"}))
    if nvme and libaio is None:
        out.append(Finding(
            "build.libaio-missing", "fail",
            f"NVMe offload ({', '.join(nvme)}) needs libaio, which is not installed here",
            ["DeepSpeed swaps to NVMe with its async_io op, which builds against libaio; libaio.so (from libaio-dev) "
             "was not found in the system library directories."],
            ["sudo apt install libaio-dev   (RHEL/Fedora: sudo dnf install libaio-devel)",
             "then build the op: DS_BUILD_AIO=1 pip install deepspeed --no-cache-dir --force-reinstall "
             "(or let DeepSpeed JIT-build it on first use); `ds_report` should then show async_io [OKAY]"],
            {"offload": nvme}))
    z = ctx.block("zero_optimization")
    if ctx.eff("zero_optimization", "compute_grad_norm", _lax_bool, True) is False and stage not in (1, 2, None):
        out.append(Finding(
            "config.bad-value", "fail", f"zero_optimization.compute_grad_norm = false needs ZeRO stage 1 or 2 "
                                        f"(stage is {stage})",
            ['DeepSpeed\'s ZeRO model refuses it: "compute_grad_norm=false is supported only with ZeRO Stage 1 or 2".'],
            ['remove "compute_grad_norm" (default true)'],
            {"key": "zero_optimization.compute_grad_norm",
             "edits": [{"path": ["zero_optimization", "compute_grad_norm"], "remove": True}]}))
    ratio = ctx.eff("zero_optimization.offload_optimizer", "ratio", _lax_float, 1.0)
    if (isinstance(z.get("offload_optimizer"), dict) and ratio is not None and ratio < 1.0
            and stage is not None and stage != 3):
        out.append(Finding(
            "config.bad-value", "fail", f"zero_optimization.offload_optimizer.ratio = {ratio:g} needs ZeRO stage 3",
            ['DeepSpeed asserts: "Partial offloading only supported for ZeRO Stage 3."'],
            ['"zero_optimization": {"stage": 3}, or remove "ratio"'],
            {"key": "zero_optimization.offload_optimizer.ratio"}))
    for block, key in (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
                       ("bf16", "bf16_optimizer_states")):
        if ctx.eff(block, key, _lax_bool, False) and stage == 0:
            out.append(Finding(
                "config.bad-value", "fail", f"{block}.{key} needs ZeRO stage 1, 2 or 3",
                [f"DeepSpeed asserts at start that {key} is only supported with ZeRO stage 1, 2 or 3."],
                [f'"zero_optimization": {{"stage": 2}}, or remove "{key}"'], {"key": f"{block}.{key}"}))
    if ctx.eff("bf16", "bf16_optimizer_states", _lax_bool, False) and ctx.eff(
            "bf16", "bf16_master_weights_and_grads", _lax_bool, False) is False:
        out.append(Finding(
            "config.bad-value", "fail", "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads",
            ['DeepSpeed asserts: "bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled."'],
            ['"bf16": {"bf16_master_weights_and_grads": true}'
             + (', "zero_optimization": {"stage": 2}  (it needs ZeRO stage 1, 2 or 3 too)' if stage == 0 else ""),
             'or remove "bf16_optimizer_states"'], {"key": "bf16.bf16_optimizer_states"}))
    return out


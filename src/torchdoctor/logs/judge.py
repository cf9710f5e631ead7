"""The rules that judge what the handlers collected, once the whole log is read: one ``_judge_*`` per family.

The fp16 loss scale is judged in :mod:`.scale_trajectory`, killed processes in :mod:`.judge_process`; this module
holds the rest (non-finite gradients and losses, NCCL, CUDA out-of-memory, builds, DeepSpeed config assertions)
and the verdict on a log with none of them.
"""

from __future__ import annotations

from ..advice import fp16_collapse_fix
from ..findings import Finding
from .cascade import headline
from .common import fmt_scale, step_words
from .judge_crash import CrashJudge
from .judge_cuda import CudaJudge
from .judge_oom import OomJudge
from .judge_process import ProcessJudge
from .scale_trajectory import judge_fp16

#: Why a Trainer log shows 'loss': 0.0 for a NaN loss (transformers' trainer.py, checked in 4.x and 5.24).
HF_HIDDEN_NAN_WHY = (
    "why the log shows 0.0: transformers' Trainer defaults to logging_nan_inf_filter=True, which replaces a NaN/Inf "
    "step loss by the average of the finite losses since the last log (trainer.py: `self._tr_loss += self._tr_loss / "
    "(1 + self.state.global_step - self._globalstep_last_logged)`); when every step since the last log was NaN, "
    "that running sum is 0 and the Trainer logs 'loss': 0.0 -- the 'grad_norm': nan on the same line is the NaN "
    "showing through. TrainingArguments(logging_nan_inf_filter=False) logs the NaN itself"
)


#: Trainer log dicts in a row, up to the end, with a non-finite grad_norm (and a finite loss): the model is not training
HF_DEAD_LOGS = 5


class Judges(ProcessJudge, CrashJudge, CudaJudge, OomJudge):
    """Mixin of :class:`~torchdoctor.logs.analyze.Analyzer`: the judging half."""

    def _judge(self) -> list[Finding]:
        self._resolve_progress()
        out: list[Finding] = []
        for fn in (self._judge_fp16, self._judge_grad, self._judge_loss, self._judge_families, self._judge_cuda_oom,
                   self._judge_cuda, self._judge_process, self._judge_config):
            out.extend(fn())
        out.extend(self._judge_exception(out))
        out = headline(out)
        if self._internal_errors:
            out.append(Finding("logs.analyzer-error", "info",
                               f"{self._internal_errors} line(s) could not be analysed (skipped)",
                               data={"count": self._internal_errors}))
        if self._lines == 0:
            if self._source == "command":
                out.append(Finding("logs.empty", "info", "the command printed nothing (no output to analyse)",
                                   evidence=["nothing on its stdout or stderr: if it writes its log to a file, "
                                             "run `torchdoctor logs FILE` on that file"]))
            else:
                out.append(Finding("logs.empty", "info", "the log is empty (0 lines)",
                                   evidence=["nothing to analyse: check the file name, or that the run wrote to it"]))
        elif not any(f.severity in ("warn", "fail") for f in out):
            ev = [f"{self._lines} lines read; checked for fp16 loss-scale collapse, non-finite loss, NCCL timeouts and "
                  "errors, CUDA and host out-of-memory, killed processes and crashes, tracebacks, CUDA runtime "
                  "errors, CUDA/compiler build failures"]
            if self._max_step is not None:
                where = {"step": self._step, "step_from": self._step_from, "planned": self._planned}
                ev.append(f"last {step_words(where)} seen (a progress bar's count: batches or steps)"
                          if self._step_from == "bar" else
                          f"last step seen: {self._step}" + (f" of {self._planned}" if self._planned else ""))
            lines = f"{self._lines} line{'' if self._lines == 1 else 's'}"
            out.append(Finding("logs.clean", "ok", f"no failure signatures in {lines}", evidence=ev,
                               data={"lines": self._lines, "last_step": self._step}))
        return out


    def _judge_families(self) -> list[Finding]:
        return [f for family in self._families for f in family.judge()]

    def _skipped(self) -> int:
        return self._scale.skipped(self._ds_skipped)

    def _judge_fp16(self) -> list[Finding]:
        last = self._loss_last
        return judge_fp16(self._scale, max_step=self._max_step, iterations=self._iterations, planned=self._planned,
                          ds_skipped=self._ds_skipped, loss_last_line=last["line"] if last else None,
                          loss_recovered=self._loss_recovered, loss_nf=self._loss_nf,
                          deepspeed=self._scale.observed_source not in ("GradScaler", "printed"))

    def _judge_grad(self) -> list[Finding]:
        n = self._scaleless_ovf + self._static_ovf + self._norm_nf
        if not n:
            return []
        ev = []
        if self._scaleless_ovf:
            first = next((e for e in self._timeline.items() if e["event"] == "overflow-unscaled"), None)
            ev.append(f"{self._scaleless_ovf} step(s) skipped with non-finite gradients and no dynamic loss scale "
                      "to lower (bf16/fp32, or a static scale)" + (f"; first at line {first['line']}" if first else ""))
        if self._static_ovf:
            ev.append(f"{self._static_ovf} overflow(s) at a static loss scale of {fmt_scale(self._static_scale)}")
        if self._norm_nf:
            f = self._norm_first
            ev.append(f"{self._norm_nf} logged non-finite gradient norm(s); first at line {f['line']}: {f['text']}")
        # with no fp16 scaler in play, even one non-finite gradient is worth a look: nothing is there to skip it (a
        # non-finite loss beside it is the finding that says so)
        sev = "fail" if n >= 20 else "warn" if n >= 3 or not (self._scale.dynamic or self._loss_nf) else "info"
        if self._scale.dynamic and not (self._scaleless_ovf or self._static_ovf or self._grad_said):
            sev = "info"  # the norms of steps the fp16 scaler skipped: judged by the fp16 finding
        stop = next((g for g in self._grad_said if g["stops"]), None)
        for g in self._grad_said[:3]:
            where = f" ({g['where']})" if g["where"] else ""
            ev.append(f"line {g['line']}: {g['tool']}{where} {'stopped the run' if g['stops'] else 'warned'}: "
                      f"{g['text']}")
        if stop is not None:
            sev = "fail"
        elif self._grad_said:
            sev = "warn" if sev == "info" else sev
        hf_only = n == self._hf_norm_nf_finite_loss and self._hf_norms
        if hf_only and self._hf_norm_nf_tail < 3 and 2 * n <= self._hf_norms:
            # Trainer dicts with a finite loss and a nan grad_norm, among finite ones: the steps fp16 AMP skipped
            sev = "info"
            ev.append(f"{n} of {self._hf_norms} Trainer log dicts have a non-finite grad_norm with a finite loss, and "
                      "later grad norms are finite: with fp16 mixed precision those are the steps the GradScaler "
                      "skipped (it skips a step whose gradients overflow and lowers its scale), which is normal")
        elif hf_only and self._hf_norm_nf_tail >= 3:
            # a run whose every logged step since some point has nan gradients is not training: fail from
            # HF_DEAD_LOGS intervals on (a burst of skipped fp16 steps does not last that long)
            dead = self._hf_norm_nf_tail >= HF_DEAD_LOGS
            sev = "fail" if dead else "warn" if sev == "info" else sev
            ev.append(f"the last {self._hf_norm_nf_tail} logged grad norms are all non-finite: with fp16 every step is "
                      "being skipped (the model is not training); in bf16/fp32 the next update makes the weights nan")
        fix = ["find where the inf/nan starts: torchdoctor.NumericsMonitor(model, optimizer=opt) stops at the first "
               "non-finite activation or gradient and names the module",
               "lower the learning rate or clip gradients (gradient_clipping: 1.0 in the DeepSpeed config, "
               "max_grad_norm with the HF Trainer)"]
        if self._static_ovf:
            fix.insert(0, 'use dynamic loss scaling: "fp16": {"loss_scale": 0} (a static scale cannot back off)')
        return [Finding("grad.nonfinite", sev, f"{n} step(s) with non-finite gradients", ev, fix,
                        {"unscaled_overflows": self._scaleless_ovf, "static_scale_overflows": self._static_ovf,
                         "nonfinite_grad_norms": self._norm_nf, "static_scale": self._static_scale})]

    def _judge_loss(self) -> list[Finding]:
        if not self._loss_nf:
            return []
        f, last = self._loss_first, self._loss_last
        at = f"{step_words(f)}, line {f['line']}" if f["step"] is not None else f"line {f['line']}"
        if f["step"] is None and f.get("epoch") is not None:
            at = f"epoch {f['epoch']:g}, line {f['line']}"
        ev = [f"first non-finite {f['key']} ({f['value']}) at {at}: {f['text']}"]
        if self._loss_hidden:
            ev.append(f"{self._loss_hidden} Trainer log dict(s) with 'loss': 0.0 and 'grad_norm': nan: the loss is "
                      "NaN there; " + HF_HIDDEN_NAN_WHY)
        if self._loss_nf > 1:
            ev.append(f"{self._loss_nf} non-finite loss value(s) in all; last at line {last['line']}")
        if self._loss_recovered:
            ev.append("finite values of each loss were logged after its last non-finite one")
        elif self._nf_keys:
            ev.append("still non-finite at the end of the log: " + ", ".join(sorted(self._nf_keys)[:4]))
        if self._scale.dynamic:
            ev.append(f"the run also had {self._skipped()} fp16 overflow step(s): see fp16 findings")
        fix = [
            "models pretrained in bf16 (e.g. T5 and other TPU-trained checkpoints) often give nan loss in fp16: on "
            "Ampere or newer GPUs use bf16 (--bf16, or \"bf16\": {\"enabled\": true}) or fp32",
            "find the first layer that produces inf/nan: torchdoctor.NumericsMonitor(model, optimizer=opt), or "
            "torchdoctor.compat.DebugUnderflowOverflow (drop-in for transformers' debug=\"underflow_overflow\")",
            "if the loss diverged rather than overflowed: lower the learning rate, add warmup, clip gradients",
        ]
        if self._scale.dynamic or self._scale.observed:
            # an fp16 run whose scale is in play: the one collapse fix (bf16 first), not a second wording of it
            fix[0] = fp16_collapse_fix(self._scale.observed_source != "GradScaler")
        if self._loss_hidden:
            fix.append("TrainingArguments(logging_nan_inf_filter=False) makes the Trainer log the NaN itself")
        stop = self._loss_stopped
        if stop is not None:
            ev.append(f"line {stop['line']}: {stop['tool']} stopped the run on it: {stop['text']}")
        recovered = self._loss_recovered and stop is None
        sev = "warn" if recovered else "fail"
        if self._loss_hidden and f.get("hidden"):
            title = (f"the loss is NaN from {at}: the Trainer logged 'loss': 0.0 with 'grad_norm': nan "
                     f"(logging_nan_inf_filter hides a NaN loss as 0.0)")
        else:
            title = f"loss became {f['value']} at {at}"
        title += " (later losses were finite)" if recovered else "; the run stopped on it" if stop else ""
        return [Finding("loss.nonfinite", sev, title, ev, fix,
                        {"first_step": f["step"], "first_line": f["line"], "first_text": f["text"],
                         "first_epoch": f.get("epoch"), "count": self._loss_nf, "recovered": recovered,
                         "stopped_by": stop["tool"] if stop else None,
                         "hidden_by_nan_inf_filter": self._loss_hidden})]

    def _judge_config(self) -> list[Finding]:
        out = []
        for d in self._ds_config:
            if d["kind"] == "bf16-and-fp16":
                out.append(Finding("ds.config-error", "fail", "DeepSpeed config enables both fp16 and bf16",
                                   [f"line {d['line']}: {d['text']}"],
                                   ['enable one: "bf16": {"enabled": true} on Ampere or newer, else fp16; with the HF '
                                    'Trainer set both to "auto" and pass --bf16 or --fp16',
                                    "torchdoctor ds check ds.json lints the config before a run"], dict(d)))
            else:
                right = d["micro_batch"] * d["gradient_accumulation_steps"] * d["world_size"]
                out.append(Finding("ds.config-error", "fail",
                                   f"DeepSpeed batch sizes disagree: train_batch_size {d['train_batch_size']} != "
                                   f"{d['micro_batch']} x {d['gradient_accumulation_steps']} x {d['world_size']} ranks",
                                   [f"line {d['line']}: {d['text']}"],
                                   [f'set "train_batch_size": {right} (micro batch x gradient accumulation x world '
                                    'size), or "auto" with the HF Trainer',
                                    "torchdoctor ds check ds.json lints the config before a run"], dict(d)))
        return out


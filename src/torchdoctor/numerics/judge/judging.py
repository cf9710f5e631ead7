"""Judging a step that went bad: this rank's report, where the value started across ranks, and what to do.

The step logic (:mod:`.steps`) calls :meth:`Judge.judge` after the one host read of a step (:mod:`.check`)
said "not finite". From here on speed no longer matters: the statistics are read back, parameters and
their gradients measured, a compiled region re-run if the value went bad inside one (:mod:`.compiled`),
the ranks compare where their first bad value sits (:mod:`.verdict`), and the judge decides (:class:`Outcome`):
raise :class:`~..errors.NonFiniteError`, or, under a loss scaler that skips the step, record an
:class:`~..engines.scalers.OverflowEvent`, or, when its only non-finite value is an inf loss and every gradient is
finite, a warning the run survives (:mod:`.loss_warning`), or, with ``transient="skip"``, skip a step whose fault did
not reproduce. The step logic acts on the decision; the judge changes nothing of the run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ...advice import FP32_COLLAPSE_FIX, fp16_collapse_fix
from ..engines.scalers import OverflowEvent
from ..engines.wrappers import clean_name
from ..explain import causes
from ..explain.causes import narrow_range
from ..explain.diagnosis_types import Setup
from ..explain.render import who
from ..explain.report import FirstNonFinite, NonFiniteReport, build_report, find_first_bad
from ..measure.stats import all_finite, finite_flags_of
from ..record.frames import BWD, FWD, ResolvedFrame, measure_now
from ..record.recorder import Recorder
from ..record.watched import WatchedModel
from .check import StepCheck
from .fixcheck import FixChecker
from .history import History
from .loss_warning import only_the_loss
from .replay import NOT_REPRODUCED, REPRODUCED, Replayer
from .reporter import Reporter
from .verdict import (
    BACKWARD,
    FORWARD,
    NO_BAD,
    NOT_REPRODUCED_OFFSET,
    UNKNOWN_GRADIENT,
    agreed_max,
    first_bad_code,
    not_reproduced,
    origin_ranks,
    phase_of,
    share_verdict,
)

log = logging.getLogger("torchdoctor.numerics")


RAISE, WARNED, OVERFLOW, SKIP = "raise", "warned", "overflow", "skip"


@dataclass
class Outcome:
    """What to do with a bad step: ``raise`` its report, or it was ``warned`` about (an inf loss the run survives),
    recorded as an ``overflow`` the loss scaler skips, or is to be skipped as a transient (``skip``)."""

    action: str
    report: NonFiniteReport


class Judge:
    """The bad-step half of the monitor: builds this rank's report, agrees with the other ranks, decides.

    Args:
        watched, recorder, history, replayer, reporter, check: the monitor's parts it reads (the model's facts, the
            step's record, earlier steps, the replay, the findings so far, the ranks' agreement).
        max_frames, rank, hf: how reports are built.
        transient: ``"raise"`` or ``"skip"``; auto_localize, min_loss_scale, max_consecutive_overflows: the monitor's
            options of the same names.
    """

    def __init__(self, watched: WatchedModel, recorder: Recorder, history: History, replayer: Replayer,
                 reporter: Reporter, check: StepCheck, fix_checker: FixChecker, *, max_frames: int, rank: int | None,
                 hf: bool, transient: str, auto_localize: bool, min_loss_scale: float,
                 max_consecutive_overflows: int) -> None:
        self.fix_checker = fix_checker
        self.overflows_cleared = False  # a step a scaler skipped was finite in fp32: its overflows are ordinary
        self.watched = watched
        self.recorder = recorder
        self.history = history
        self.replayer = replayer
        self.reporter = reporter
        self.check = check
        self.max_frames = max_frames
        self.rank = rank
        self.hf = hf
        self.transient = transient
        self.auto_localize = auto_localize
        self.min_loss_scale = min_loss_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        self.consecutive_overflows = 0

    def _param_grad_frames(self, step: int) -> list[ResolvedFrame]:
        """Parameter gradients, module by module in backward order (reverse of the forward)."""
        infos = self.watched.infos
        order: dict[str, object] = {}
        for f in self.recorder.rec.frames:
            if f.phase == FWD and not f.info.boundary:
                order.setdefault(f.info.name, f.info)
        found = list(order.values())[::-1] or list(infos.values())[::-1]
        if len(order) < len(infos):  # compiled regions hide their modules' frames: add the others
            found += [i for i in list(infos.values())[::-1] if i.name not in order]
        out = []
        for info in found:
            module = info.module()
            if module is None:
                continue
            lines = [
                measure_now(f"grad:{n}", p.grad)
                for n, p in module.named_parameters(recurse=False)
                if p.requires_grad and p.grad is not None
            ]
            if lines:
                out.append(ResolvedFrame(step, BWD, info.name, info.cls, lines))
        return out

    def _step_report(self, step: int, check_grads: bool, self_bad: bool, setup: Setup
                     ) -> tuple[NonFiniteReport | None, int, tuple[list[ResolvedFrame], int] | None]:
        """This rank's report of the current step, the sortable code of where its first bad value is, and the
        frames it was built from."""
        rec = self.recorder.rec
        frames, start = self.history.frames_with(rec)
        # weights are measured now: unless the step is checked before its update, they may have changed since the
        # forward (no optimizer given, or mon.step() after optimizer.step())
        judge_params = setup.before_update or self.hf
        if check_grads and find_first_bad(frames, start, self.hf, judge_params) is None:
            frames += self._param_grad_frames(step)
        trail = self.history.growth.read()
        report = build_report(frames, self.max_frames, self.rank, start, self.hf, judge_params, trail, setup)
        if report is not None and not self.hf:
            report = self.replayer.localize(rec, report, frames, start, judge_params, setup)
        if report is None:  # this rank's own flags were bad, but no value it can name (gradients gone)
            return None, first_bad_code(UNKNOWN_GRADIENT, 0) if self_bad else NO_BAD, (frames, start)
        phase = BACKWARD if report.first is not None and report.first.phase == BWD else FORWARD
        # a fault this rank's replay did not reproduce comes after any another rank's replay did (under DDP every
        # rank's gradients are bad after the reduction: the rank whose own backward made it is the origin)
        late = NOT_REPRODUCED_OFFSET if report.replay == NOT_REPRODUCED else 0
        # at one position, a rank whose own weight (shard) is bad comes first: FSDP gathers a weight for the forward,
        # so every rank's output goes bad at that module, and only the rank holding the bad shard made it
        own_weight = report.cause == causes.BAD_WEIGHT
        return report, first_bad_code(phase, 2 * (report.position + late) + (0 if own_weight else 1)), (frames, start)

    def judge(self, step: int, source: str, check_grads: bool, self_bad: bool, setup: Setup,
              deferred: NonFiniteReport | None = None, optimizer_hooked: bool = True) -> Outcome:
        """Decide what to do with the bad step ``step`` (ended by ``source``). ``self_bad``: this rank's own flags
        were non-finite; ``deferred``: an evaluation pass of this rank went bad earlier (said now, with the other
        ranks); ``optimizer_hooked``: the step is checked in front of the optimizer."""
        if deferred is not None:
            report, code, judged = deferred, first_bad_code(FORWARD, 0), None
        else:
            report, code, judged = self._step_report(step, check_grads, self_bad, setup)
        if report is not None and judged is not None and not self.check.sync_ranks \
                and self._loss_only(report, *judged, check_grads):
            self.reporter.warn_loss(report)
            return Outcome(WARNED, report)
        origin, earliest = origin_ranks(code) if self.check.sync_ranks else ([], code)
        me = self.rank
        others = [r for r in origin if r != me]
        unknown_gradient = report is None and not others
        if unknown_gradient:  # only the gradients seen when a backward ended were bad, and they are gone
            frames, start = self.history.frames_with(self.recorder.rec)
            report = NonFiniteReport(
                step, None, frames[start:][-self.max_frames :],
                "a parameter gradient was non-finite when the backward of this step ended, and the gradients "
                "were gone (zero_grad) by the time the step was checked, so which one is unknown. "
                + ("" if optimizer_hooked else
                   "Pass the optimizer (NumericsMonitor(model, optimizer=opt)) so the step is checked before the "
                   "update is applied, or call mon.step() before optimizer.step(); " if not setup.optimizer else
                   "The optimizer is given, but with manual steps the check runs at mon.step(): call it before "
                   "optimizer.step() and zero_grad(), so the step is checked with its gradients, before its update; ")
                + f"{setup.option('grads', 'modules')} names the module. Under "
                "a loss scaler, pass it too (scaler=...): its overflows are then recorded, not raised.",
                rank=self.rank, cause=causes.UNKNOWN_GRADIENT,
            )
        elif report is None:  # only another rank saw a non-finite value
            report = NonFiniteReport(step, None, [], "another rank found non-finite values", rank=self.rank,
                                     cause=causes.OTHER_RANK)
        if me not in origin and others:
            report.bad_ranks = others
            _blame_other_ranks(report, others)
        if deferred is not None:
            return Outcome(RAISE, report)
        # decided from the earliest bad value across ranks, so that every rank records or raises alike
        only_backward = phase_of(earliest) in (BACKWARD, UNKNOWN_GRADIENT)
        skipping = source in ("skipped", "scaler") or (source == "optimizer" and self.watched.engine.skips_overflow)
        if only_backward and skipping:
            return self._overflow(step, report)
        not_the_model = report.cause in (causes.LOSS_OUTSIDE_MODEL, causes.DIVERGENCE)
        module_level = report.first is not None and not report.first.slot.startswith("grad:")
        # (module-level gradients were recorded as the step ran -- its first step -- or by a replay that reproduced)
        seen_modules = self.recorder.rec.module_grads or report.replay == REPRODUCED
        if self.recorder.level == "params" and only_backward and not not_the_model and not module_level \
                and not seen_modules:
            report.notes.append(
                f"To see where the backward blow-up starts, run with {setup.option('grads', 'modules')}."
            )
        # under several ranks, decided from the shared code (no rank's replay reproduced), not this rank's own cause
        transient = not_reproduced(earliest) if self.check.sync_ranks else report.cause == causes.TRANSIENT
        if transient and self.transient == "skip":
            if optimizer_hooked:
                return Outcome(SKIP, report)
            report.notes.append("transient='skip' was asked, but the step is checked after its update (no optimizer "
                                "given, or manual steps): raised instead")
        return Outcome(RAISE, report)

    def healthy(self) -> None:
        """A step went through finite: the overflows in a row start again from zero."""
        self.consecutive_overflows = 0

    def _loss_only(self, report: NonFiniteReport, frames: list[ResolvedFrame], start: int, check_grads: bool) -> bool:
        """Is the step's only non-finite value its loss, with every gradient checked and finite (:mod:`.loss_warning`)?
        Not under torch.distributed: the ranks would need one more shared verdict to decide alike, so there such a
        step still stops the run."""
        if not only_the_loss(report, frames, start):  # the values decide, whichever rule named them
            return False
        if not check_grads or not self.recorder.rec.backward_ran:
            return False  # gradients not watched, or no backward: nothing says the update is sound
        return self.check.grads_finite(self.recorder.rec)

    def _overflow(self, step: int, report: NonFiniteReport) -> Outcome:
        """A step the loss scaler skips: recorded, unless the scale collapsed or too many steps in a row overflowed
        (then raised), or its non-finite value comes from an invalid op fp32 does not cure (then raised at once: every
        step would be skipped). Skipped steps are checked until one turns out finite in fp32 (then the scaler's
        overflows are ordinary)."""
        if not self.overflows_cleared:
            verdict = self.fix_checker.invalid_behind_overflow(report) if report.first is not None else "unknown"
            if self.check.sync_ranks:  # (every rank reaches this point of the step: it carries out what one found)
                verdict = _BEHIND[agreed_max(_BEHIND.index(verdict))]
            if verdict == "invalid":
                return Outcome(RAISE, report)
            self.overflows_cleared = verdict == "overflow"
        scaler = self.watched.scaler
        scale = scaler.scale() if scaler is not None else None
        first = report.first
        event = OverflowEvent(step, scale, first.module if first else None, first.slot if first else None)
        self.reporter.overflows.append(event)
        if self.reporter.first_overflow is None:
            self.reporter.first_overflow = report
        self.consecutive_overflows += 1
        where = f" starting in {event.module} ({event.slot})" if event.module else ""
        log.info("gradient overflow at step %d (loss scale %s)%s: step skipped", step, scale, where)
        recorder = self.recorder
        if recorder.level == "params" and self.auto_localize and recorder.live_default:  # (a replay localizes anyway)
            recorder.level = recorder.grads = "modules"
            self.history.growth.clear()  # peaks include (scaled) module gradients from now on: not comparable
            log.info("switching to grads='modules' to localize the next gradient overflow")
        collapsed = scaler is not None and scaler.collapsed(scale, self.min_loss_scale)
        if not collapsed and self.consecutive_overflows < self.max_consecutive_overflows:
            return Outcome(OVERFLOW, report)
        floor = scaler.floor if scaler is not None else None
        why = (
            f"the loss scale collapsed to {scale:g} ("
            + (f"DeepSpeed's minimum, min_loss_scale={floor:g}" if floor is not None and scale <= floor
               else f"< {self.min_loss_scale:g}") + ")"
            if collapsed
            else f"{self.consecutive_overflows} steps in a row overflowed"
        )
        rest = report.diagnosis
        report.diagnosis = (f"{why}: the gradients overflow at every scale, so this is not a transient spike. "
                            + rest[:1].upper() + rest[1:])
        if narrow_step(report):
            report.fix = fp16_collapse_fix(scaler is not None and scaler.deepspeed, report.fp32_region)
        else:
            report.fix, report.fp32_region = FP32_COLLAPSE_FIX, None
        report.cause = causes.SCALE_COLLAPSE
        return Outcome(RAISE, report)

    def check_weights(self) -> NonFiniteReport | None:
        """At attach time: a weight that is already non-finite is named at once (one sync, once); its report."""
        named = [(clean_name(n), p) for n, p in self.watched.root.named_parameters()]
        flag = all_finite(finite_flags_of([p for _, p in named]))
        if self.check.sync_ranks:  # sharded weights differ per rank: every rank must refuse together
            ok, mine = share_verdict(None, flag)
            if not ok and not mine:
                others, _ = origin_ranks(NO_BAD)
                report = NonFiniteReport(0, None, [], "another rank's weights are already non-finite", rank=self.rank,
                                         cause=causes.BAD_WEIGHT)
                report.bad_ranks = others
                return report
            if ok:
                return None
            origin_ranks(first_bad_code(FORWARD, 0))
        elif flag is None or bool(flag.item()):
            return None
        for name, p in named:
            line = measure_now(name.rsplit(".", 1)[-1], p, param=True)
            if line.abs_max is not None and not math.isfinite(line.abs_max):
                module_name = name.rpartition(".")[0]
                cls = self.watched.class_of(module_name)
                value = "nan" if math.isnan(line.abs_max) else "inf"
                first = FirstNonFinite(0, FWD, module_name, cls, line.label, value)
                return NonFiniteReport(
                    0, first, [],
                    f"parameter {name} of the model is already non-finite before training ({value}): check "
                    "the checkpoint or the initialisation",
                    rank=self.rank, cause=causes.BAD_WEIGHT,
                )
        return None


# what the fp32 check behind a scaler's overflow found, in the order the ranks' findings are combined (the most
# informed wins: a rank that could not tell defers to one that did; an invalid op on one rank stops them all)
_BEHIND = ("unknown", "overflow", "invalid")


def narrow_step(report: NonFiniteReport) -> bool:
    """Did the bad step compute in a narrow dtype -- an fp16 / bf16 value among its frames, or narrow autocast seen
    as it ran (``report.observed``, or the setup's when not yet said)?"""
    dtypes = {ln.dtype for f in report.frames if f.step == report.step for ln in f.lines if ln.dtype is not None}
    autocast = (report.observed or {}).get("autocast") or ""
    return any(narrow_range(d) or d == torch.bfloat16 for d in dtypes) or "float16" in autocast


def _blame_other_ranks(report: NonFiniteReport, others: list[int]) -> None:
    """This rank's first non-finite value came later in the step than another rank's: it arrived
    through a collective (DDP's / FSDP's gradient reduction, a tensor-parallel all-reduce)."""
    first = report.first
    if first is None:
        return
    if first.phase == BWD:
        report.diagnosis = (
            f"this rank's forward was finite; rank(s) {others} produced non-finite activations in "
            "this step and their gradients reached this rank through the gradient reduction (DDP's "
            "all-reduce, FSDP's reduce-scatter). "
            f"See the report of rank {others[0]}."
        )
    else:
        report.diagnosis = (
            f"this rank's values were finite until {who(first.module, first.cls)} {first.slot}; rank(s) "
            f"{others} went non-finite earlier in this step (or hold the bad weight), and the value reached this "
            f"rank through a collective inside the forward (a weight FSDP gathers, a tensor-parallel all-reduce). "
            f"See the report of rank {others[0]}."
        )
    report.fix = report.fp32_region = None
    report.cause = causes.OTHER_RANK

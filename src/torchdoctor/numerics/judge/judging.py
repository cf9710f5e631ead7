"""Judging a step that went bad: this rank's report, where the value started across ranks, raise or record.

The monitor (:mod:`.monitor`) calls :meth:`Judging._handle_nonfinite` after the one host read of a step
said "not finite". From here on speed no longer matters: the statistics are read back, parameters and
their gradients measured, a compiled region re-run if the value went bad inside one (:mod:`.compiled`),
the ranks compare where their first bad value sits (:mod:`.verdict`), and the step either raises
:class:`~.errors.NonFiniteError`, or, under a loss scaler that skips it, becomes an :class:`~.scalers.OverflowEvent`,
or, when its only non-finite value is an inf loss and every gradient is finite, becomes a warning the run survives
(:mod:`.loss_warning`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from typing import TYPE_CHECKING

from ...advice import fp16_collapse_fix
from ..engines.scalers import OverflowEvent
from ..errors import NonFiniteWarning
from ..explain import causes
from ..explain.render import who
from ..explain.report import FirstNonFinite, NonFiniteReport, build_report, find_first_bad
from ..measure.stats import all_finite, finite_flags_of
from ..record.frames import BWD, FWD, ModuleInfo, ResolvedFrame, measure_now, resolve
from ..record.step import StepRecord
from .loss_warning import as_warning, loss_name, only_the_loss, user_stacklevel
from .replay import NOT_REPRODUCED, localize
from .verdict import (
    BACKWARD,
    FORWARD,
    NO_BAD,
    NOT_REPRODUCED_OFFSET,
    UNKNOWN_GRADIENT,
    first_bad_code,
    not_reproduced,
    origin_ranks,
    phase_of,
    share_verdict,
)

if TYPE_CHECKING:
    from ..engines import Engine
    from ..engines.scalers import LossScaler

log = logging.getLogger("torchdoctor.numerics")


class Judging:
    """The bad-step half of :class:`~.monitor.NumericsMonitor` (a mixin)."""

    _rec: StepRecord
    _history: deque[StepRecord]
    _growth: causes.GrowthTrail
    _engine: Engine
    _scaler: LossScaler | None
    _infos: dict[int, ModuleInfo]
    _deferred_report: NonFiniteReport | None
    _self_bad: bool  # this rank's own flags were non-finite in the step being judged
    overflows: list[OverflowEvent]
    warnings: list[NonFiniteReport]
    _judged_frames: tuple[list[ResolvedFrame], int] | None

    def _frames_with_context(self) -> tuple[list[ResolvedFrame], int]:
        """Earlier (already checked) steps as context, then the current step; and where it starts."""
        context = self._resolved(list(self._history))
        return context + self._resolved([self._rec]), len(context)

    @staticmethod
    def _resolved(records: list[StepRecord]) -> list[ResolvedFrame]:
        out: list[ResolvedFrame] = []
        for r in records:
            r.settle()
            out.extend(resolve(r.frames, r.buffer.read(), r.weights.read() if r.weights is not None else None))
        return out

    def _param_grad_frames(self, step: int) -> list[ResolvedFrame]:
        """Parameter gradients, module by module in backward order (reverse of the forward)."""
        order: dict[str, ModuleInfo] = {}
        for f in self._rec.frames:
            if f.phase == FWD and not f.info.boundary:
                order.setdefault(f.info.name, f.info)
        infos = list(order.values())[::-1] or list(self._infos.values())[::-1]
        if len(order) < len(self._infos):  # compiled regions hide their modules' frames: add the others
            infos += [i for i in list(self._infos.values())[::-1] if i.name not in order]
        out = []
        for info in infos:
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

    def _build_step_report(self, step: int, check_grads: bool) -> tuple[NonFiniteReport | None, int]:
        """This rank's report of the current step, and the sortable code of where its first bad value is."""
        if self._deferred_report is not None:
            return self._deferred_report, first_bad_code(FORWARD, 0)
        frames, start = self._frames_with_context()
        self._judged_frames = (frames, start)
        # weights are measured now: unless the step is checked before its update, they may have changed since the
        # forward (no optimizer given, or mon.step() after optimizer.step())
        setup = self._setup()
        judge_params = setup.before_update or self._hf
        if check_grads and find_first_bad(frames, start, self._hf, judge_params) is None:
            frames += self._param_grad_frames(step)
        trail = self._growth.read()
        report = build_report(frames, self.max_frames, self.rank, start, self._hf, judge_params, trail, setup)
        if report is not None and not self._hf:
            report = localize(self, self._rec, report, frames, start, judge_params)
        if report is None:  # this rank's own flags were bad, but no value it can name (gradients gone)
            return None, first_bad_code(UNKNOWN_GRADIENT, 0) if self._self_bad else NO_BAD
        phase = BACKWARD if report.first is not None and report.first.phase == BWD else FORWARD
        # a fault this rank's replay did not reproduce comes after any another rank's replay did (under DDP every
        # rank's gradients are bad after the reduction: the rank whose own backward made it is the origin)
        late = NOT_REPRODUCED_OFFSET if report.replay == NOT_REPRODUCED else 0
        # at one position, a rank whose own weight (shard) is bad comes first: FSDP gathers a weight for the forward,
        # so every rank's output goes bad at that module, and only the rank holding the bad shard made it
        own_weight = report.cause == causes.BAD_WEIGHT
        return report, first_bad_code(phase, 2 * (report.position + late) + (0 if own_weight else 1))

    def _handle_nonfinite(self, step: int, source: str, check_grads: bool) -> None:
        self._judged_frames = None
        report, code = self._build_step_report(step, check_grads)
        judged, self._judged_frames = self._judged_frames, None
        if report is not None and judged is not None and not self._sync_ranks \
                and self._loss_only(report, *judged, check_grads):
            self._warn(report)
            return
        origin, earliest = origin_ranks(code) if self._sync_ranks else ([], code)
        me = self.rank
        others = [r for r in origin if r != me]
        unknown_gradient = report is None and not others
        if unknown_gradient:  # only the gradients seen when a backward ended were bad, and they are gone
            frames, start = self._frames_with_context()
            report = NonFiniteReport(
                step, None, frames[start:][-self.max_frames :],
                "a parameter gradient was non-finite when the backward of this step ended, and the gradients "
                "were gone (zero_grad) by the time the step was checked, so which one is unknown. "
                + ("" if self._optimizer_hooked() else
                   "Pass the optimizer (NumericsMonitor(model, optimizer=opt)) so the step is checked before the "
                   "update is applied, or call mon.step() before optimizer.step(); " if self.optimizer is None else
                   "The optimizer is given, but with manual steps the check runs at mon.step(): call it before "
                   "optimizer.step() and zero_grad(), so the step is checked with its gradients, before its update; ")
                + f"{self._setup().option('grads', 'modules')} names the module. Under "
                "a loss scaler, pass it too (scaler=...): its overflows are then recorded, not raised.",
                rank=self.rank, cause=causes.UNKNOWN_GRADIENT,
            )
        elif report is None:  # only another rank saw a non-finite value
            report = NonFiniteReport(step, None, [], "another rank found non-finite values", rank=self.rank,
                                     cause=causes.OTHER_RANK)
        if me not in origin and others:
            report.bad_ranks = others
            self._blame_other_ranks(report, others)
        if self._deferred_report is not None:
            self._raise(report)
        # decided from the earliest bad value across ranks, so that every rank records or raises alike
        only_backward = phase_of(earliest) in (BACKWARD, UNKNOWN_GRADIENT)
        skipping = source in ("skipped", "scaler") or (source == "optimizer" and self._engine.skips_overflow)
        if only_backward and skipping:
            self._record_overflow(step, report)
            return
        not_the_model = report.cause in (causes.LOSS_OUTSIDE_MODEL, causes.DIVERGENCE)
        module_level = report.first is not None and not report.first.slot.startswith("grad:")
        if self.grads == "params" and only_backward and not not_the_model and not module_level:
            report.notes.append(
                f"To see where the backward blow-up starts, run with {self._setup().option('grads', 'modules')}."
            )
        # under several ranks, decided from the shared code (no rank's replay reproduced), not this rank's own cause
        transient = not_reproduced(earliest) if self._sync_ranks else report.cause == causes.TRANSIENT
        if transient and self.transient == "skip":
            if self._optimizer_hooked():
                self._skip_transient(report)
                return
            report.notes.append("transient='skip' was asked, but the step is checked after its update (no optimizer "
                                "given, or manual steps): raised instead")
        self._raise(report)

    def _skip_transient(self, report: NonFiniteReport) -> None:
        """``transient="skip"``: the fault did not reproduce. Refuse this step's update (its gradients dropped, the
        buffers put back), keep the report in ``transients`` and on disk, warn, and go on with the next step."""
        report.severity = "warn"
        report.notes.append("transient='skip': this step's update was refused (its gradients were dropped) and the "
                            "run went on.")
        report.watched = report.watched or self.watching
        self._after_detection()
        self.transients.append(report)
        try:
            paths = report.write(self.report_dir, basename="torchdoctor-transient")
        except Exception as e:  # never let a full disk turn a skipped step into a crash
            paths = [f"(not written: {e})"]
        message = (f"torchdoctor: step {report.step} went non-finite and its replay did not reproduce it (a transient "
                   f"fault); its update was refused and the run goes on. Report: {paths[0]}")
        log.warning("%s\n%s", message, report.text())
        warnings.warn(message, NonFiniteWarning, stacklevel=user_stacklevel())

    def _loss_only(self, report: NonFiniteReport, frames: list[ResolvedFrame], start: int, check_grads: bool) -> bool:
        """Is the step's only non-finite value its loss, with every gradient checked and finite (:mod:`.loss_warning`)?
        Not under torch.distributed: the ranks would need one more shared verdict to decide alike, so there such a
        step still stops the run."""
        if not only_the_loss(report, frames, start):  # the values decide, whichever rule named them
            return False
        if not check_grads or not self._rec.backward_ran or self._deferred_report is not None:
            return False  # gradients not watched, or no backward: nothing says the update is sound
        flag = all_finite(self._engine.grad_flags(self._params) + self._rec.stored_grad_flags())
        return flag is not None and bool(flag.item())  # (a bad step: one more read is fine)

    def _warn(self, report: NonFiniteReport) -> None:
        """Record a warning finding, write it to disk, say where; the step goes on (its update is applied)."""
        as_warning(report, causes.NONFINITE_LOSS)
        self.warnings.append(report)
        try:
            paths = report.write(self.report_dir, basename="torchdoctor-nonfinite-loss")
        except Exception as e:  # never let a full disk turn a warning into a crash
            paths = [f"(not written: {e})"]
        message = (f"torchdoctor: step {report.step}: {loss_name(report)} is {report.first.value} while every "
                   f"gradient is finite; the update was applied and the run goes on. Report: {paths[0]}")
        log.warning("%s\n%s", message, report.text())
        warnings.warn(message, NonFiniteWarning, stacklevel=user_stacklevel())

    @staticmethod
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

    def _record_overflow(self, step: int, report: NonFiniteReport) -> None:
        scale = self._scaler.scale() if self._scaler is not None else None
        first = report.first
        event = OverflowEvent(step, scale, first.module if first else None, first.slot if first else None)
        self.overflows.append(event)
        self._consecutive_overflows += 1
        where = f" starting in {event.module} ({event.slot})" if event.module else ""
        log.info("gradient overflow at step %d (loss scale %s)%s: step skipped", step, scale, where)
        if self.grads == "params" and self.auto_localize and self._live_default:  # (a replay localizes anyway)
            self.grads = "modules"
            self._growth.clear()  # from now on the steps' peaks include (scaled) module gradients: not comparable
            log.info("switching to grads='modules' to localize the next gradient overflow")
        collapsed = self._scaler is not None and self._scaler.collapsed(scale, self.min_loss_scale)
        if collapsed or self._consecutive_overflows >= self.max_consecutive_overflows:
            floor = self._scaler.floor if self._scaler is not None else None
            why = (
                f"the loss scale collapsed to {scale:g} ("
                + (f"DeepSpeed's minimum, min_loss_scale={floor:g}" if floor is not None and scale <= floor
                   else f"< {self.min_loss_scale:g}") + ")"
                if collapsed
                else f"{self._consecutive_overflows} steps in a row overflowed"
            )
            rest = report.diagnosis
            report.diagnosis = (f"{why}: the gradients overflow at every scale, so this is not a transient spike. "
                                + rest[:1].upper() + rest[1:])
            deepspeed = self._scaler is not None and self._scaler.deepspeed
            report.fix = fp16_collapse_fix(deepspeed, report.fp32_region)
            report.cause = causes.SCALE_COLLAPSE
            self._raise(report)

    def _check_weights_once(self) -> None:
        """At attach time: a weight that is already non-finite is named at once (one sync, once)."""
        named = [(self._engine.clean(n), p) for n, p in self.model.named_parameters()]
        flag = all_finite(finite_flags_of([p for _, p in named]))
        if self._sync_ranks:  # sharded weights differ per rank: every rank must refuse together
            ok, mine = share_verdict(None, flag)
            if not ok and not mine:
                others, _ = origin_ranks(NO_BAD)
                report = NonFiniteReport(0, None, [], "another rank's weights are already non-finite", rank=self.rank,
                                         cause=causes.BAD_WEIGHT)
                report.bad_ranks = others
                self._raise(report)
            if ok:
                return
            origin_ranks(first_bad_code(FORWARD, 0))
        elif flag is None or bool(flag.item()):
            return
        for name, p in named:
            line = measure_now(name.rsplit(".", 1)[-1], p, param=True)
            if line.abs_max is not None and not math.isfinite(line.abs_max):
                module_name = name.rpartition(".")[0]
                cls = next((i.cls for i in self._infos.values() if i.name == module_name), "?")
                value = "nan" if math.isnan(line.abs_max) else "inf"
                first = FirstNonFinite(0, FWD, module_name, cls, line.label, value)
                self._raise(
                    NonFiniteReport(
                        0, first, [],
                        f"parameter {name} of the model is already non-finite before training ({value}): check "
                        "the checkpoint or the initialisation",
                        rank=self.rank, cause=causes.BAD_WEIGHT,
                    )
                )

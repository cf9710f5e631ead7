"""The monitor's steps: when one ends, how it is checked with one host read, and what happens after.

A step ends at ``optimizer.step()`` (a pre-hook), at ``mon.step()``, at the next forward when nothing else
ends it, when a loss scaler skips it, or when the ``with`` block exits. :meth:`Steps.close_step` stacks the
step's on-device statistics, reads the one "all finite" flag (:mod:`.check`: shared across ranks under
torch.distributed), and either keeps the step as context for a later report (:mod:`.history`) or hands it to the
judge (:mod:`.judging`), whose decision it carries out: raise, record, warn, skip.

:class:`Steps` is the one part that moves the run along: it owns the step counter, the manual/closure/forward-ended
ways a step ends, the module buffers put back after a detection, and the recorder's fresh record for each step. It
hears from the recorder (:class:`~..record.recorder.StepEvents`: the model's call began, ended, raised) and from the
engine (:class:`~..engines.base.StepHooks`: the optimizer and the loss scaler).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..engines import MonitorWarning
from ..engines.hookset import HookSet
from ..engines.wrappers import clean_name
from ..errors import AbortAfterStep, NonFiniteError
from ..explain.diagnosis_types import Setup
from ..explain.report import NonFiniteReport, build_report
from ..explain.trace import TraceWriter
from ..measure.buffers import BufferGuard
from ..record.recorder import Recorder
from ..record.watched import WatchedModel
from .check import StepCheck
from .closures import ClosureSteps
from .headroom import Headroom
from .history import History, resolved
from .judging import OVERFLOW, RAISE, SKIP, Judge, narrow_step
from .replay import Replayer
from .reporter import Reporter
from .update_trial import smallest_eps, try_update, update_report

if TYPE_CHECKING:
    from ..timeline.steps import Timeline

log = logging.getLogger("torchdoctor.numerics")

EXIT_NOTE = (
    "This step was checked as the `with NumericsMonitor(...)` block exited (nothing inside the block ended it: no "
    "optimizer step ran -- a GradScaler that skipped it, not passed as scaler= -- and no mon.step()), so this "
    "NonFiniteError is raised by the `with` statement itself: catch it with a try around the with block, or pass "
    "scaler= / call mon.step() so that every step is checked inside it."
)


def narrow_optimizer(optimizer: Any) -> str | None:
    """What the optimizer's own arithmetic cannot do in its parameters' dtype, as seen on it: an ``eps`` that rounds
    to 0 in fp16 (Adam's default 1e-8, below fp16's smallest subnormal) in a group of fp16 parameters, so that where
    a gradient's running average of squares is 0 the update divides by 0."""
    for group in getattr(optimizer, "param_groups", None) or ():
        eps = group.get("eps")
        if not isinstance(eps, float) or eps <= 0:
            continue
        if any(getattr(p, "dtype", None) == torch.float16 for p in group.get("params", ())) and \
                torch.tensor(eps, dtype=torch.float16).item() == 0.0:
            return (f"{type(optimizer).__name__}'s eps={eps:g} is 0 in float16, the dtype of its parameters: where a "
                    "gradient's running average of squares rounds to 0 in fp16 (a small gradient), its update "
                    "divides by sqrt(0) + 0: inf, and nan where the gradient is 0 too")
    return None


class Steps:
    """Step boundaries and what follows them (see the module docstring).

    Args:
        watched, hooks, recorder, history, check, judge, replayer, reporter: the monitor's other parts.
        manual (bool): steps end only at :meth:`step`.
        trace_steps, abort_after_step, max_frames, rank, hf, via: the monitor's options (``via``: how the user
            attached it, for the advice's wording).
        headroom (Headroom | None): ``headroom=True``'s tracker.
        tracer (TraceWriter): where traced steps go.
        stop (callable): ends the monitor's watch (``abort_after_step`` reached).
    """

    def __init__(self, *, watched: WatchedModel, hooks: HookSet, recorder: Recorder, history: History,
                 check: StepCheck, judge: Judge, replayer: Replayer, reporter: Reporter, manual: bool,
                 trace_steps: frozenset[int], abort_after_step: int | None, max_frames: int, rank: int | None,
                 hf: bool, via: str, headroom: Headroom | None, tracer: TraceWriter, stop: Callable[[], None],
                 timeline: Timeline | None = None) -> None:
        self.watched = watched
        self.hooks = hooks
        self.recorder = recorder
        self.history = history
        self.check = check
        self.judge = judge
        self.replayer = replayer
        self.reporter = reporter
        self.trace_steps = trace_steps
        self.abort_after_step = abort_after_step
        self.max_frames = max_frames
        self.rank = rank
        self.hf = hf
        self.via = via
        self.headroom = headroom
        self.tracer = tracer
        self.timeline = timeline
        self._stop = stop
        self.optimizer = watched.optimizer
        self.scaler = watched.scaler
        self.index = 0  # the step under way, from 0
        self.manual = manual
        self.optimizer_stepped = False  # the optimizer pre-hook checked this step (scaler.update() has nothing left)
        self.closures = ClosureSteps(self._check_closure, reporter.write)
        # manual steps with an optimizer given: the last step whose optimizer.step() came before its mon.step(), and
        # whether any did (the check then followed the update: what a report's advice says)
        self.updated_in: int | None = None
        self.late_check = False
        self.forward_pending = False  # forward-bounded steps: a training forward awaits its backward
        self.deferred_report: NonFiniteReport | None = None  # DDP: an evaluation pass went bad
        self.just_reported = False  # a report was made and nothing has run since
        self.warned_unseen = False  # said once: a step without any recorded forward
        self.at_exit = False  # the last step is being checked as the with block exits
        self.buffers: BufferGuard | None = None  # module buffers as each step began (put back after a detection)
        self.applied = 0  # steps checked in front of the optimizer and found finite: updates applied
        self.fix_checker = judge.fix_checker
        self._ended = False
        # an optimizer whose arithmetic cannot work in its parameters' dtype: each update is tried on a copy first
        # (one process only: ranks would have to agree on it)
        self.optimizer_note = narrow_optimizer(self.optimizer)
        self.try_updates = self.optimizer_note is not None and not check.sync_ranks

    def start(self) -> None:
        """Attached: the module buffers are kept as each step begins from now on."""
        self.buffers = BufferGuard(m for _, m in self.watched.modules)
        self.buffers.start()

    def new_step(self, continued: bool = False) -> None:
        """A fresh record for the step under way: every module watched, or only the boundaries. The first step is
        watched every module, module-level gradients included: it is seen whole (a fault from step 0 needs no replay
        to be named), and it shows which modules a step calls (the loop's own entries) -- except in a compiled model."""
        rec = self.recorder
        # (a compiled model's first step is not: hooks put in for one step and taken out for the next would make
        # torch.compile recompile, and inside the compiled code they see nothing anyway -- its edges and the replay do)
        first = self.index == 0 and not self.watched.regions
        if first:
            rec.learning_entries = True  # (the modules a loop calls on its own become entries at this step)
        recorded = self.timeline is not None and self.timeline.due(self.index)
        live = first or recorded or rec.live_default or rec.learning_entries or self.index in self.trace_steps \
            or (self.headroom is not None and self.headroom.due(self.index))
        rec.new_record(self.index, live, continued, module_grads=first or recorded)
        if self.buffers is not None and not continued:  # a continued step keeps the snapshot of its start
            self.buffers.start()

    def ends_at_forward(self) -> bool:
        return self.optimizer is None and not self.manual and self.scaler is None

    def optimizer_hooked(self) -> bool:
        """Is the step checked in front of the optimizer's step (its pre-hook ends the step)?"""
        return self.optimizer is not None and not self.manual

    def checked_before_update(self) -> bool:
        """Is the step being judged checked before its update was applied: in front of the hooked optimizer, or, with
        manual steps, at a ``mon.step()`` that came before this step's ``optimizer.step()``? (Without an optimizer
        the monitor cannot see when the update comes.)"""
        if self.optimizer is None:
            return False
        return not self.manual or self.updated_in != self.index

    def setup(self) -> Setup:
        """What a report's advice may assume beyond its frames (:class:`~..explain.diagnosis_types.Setup`): also
        what the monitor saw of the step under way -- its forward (a call of the model, or of a module the loop calls,
        was recorded) and the autocast that call ran under. Report time only."""
        before = self.checked_before_update()
        rec = self.recorder.rec
        calls = rec.root_calls
        seen = bool(calls) or any(f.phase != "bwd" for f in rec.frames)
        autocast = calls[-1].autocast if calls else None
        return Setup(self.optimizer is not None, self.manual, before, before and not self.late_check,
                     self.watched.kept_in_fp32(), self.via, forward_seen=seen, autocast=autocast,
                     scaler=self.scaler is not None, optimizer_note=self.optimizer_note)

    def observed(self, report: NonFiniteReport) -> dict[str, str]:
        """What the monitor saw of the bad step, for the report (its JSON carries it): each part of the step, and
        how it was seen."""
        rec = self.recorder.rec
        replayed = report.replay == "reproduced"
        calls = rec.root_calls
        if rec.live:
            forward = "every module, as it ran"
        elif calls or rec.frames:
            forward = "the model's calls (inputs and outputs)" + (", then every module in a replay" if replayed else "")
        else:
            forward = ("not seen: the monitor attached after this step's forward (attach it before the first forward "
                       "to see it)")
        if self.recorder.level == "none":
            backward = "not watched (grads='none')"
        elif rec.module_grads:
            backward = "every module's output gradient and the parameter gradients, as they were made"
        elif replayed and report.first is not None and report.first.phase == "bwd":
            backward = "the parameter gradients; every module's output gradient in a replay"
        else:
            backward = "the parameter gradients"
        autocast = ("not seen" if not calls else ", ".join(f"{str(d).removeprefix('torch.')} ({dev})"
                                                            for dev, d in calls[-1].autocast) or "off")
        return {"forward": forward, "backward": backward, "autocast": autocast}

    # ------------------------------------------------------------------ step boundaries
    def step(self) -> None:
        """End a training step by hand: check it, then start the next."""
        self.manual = True
        self.recorder.hook_param_grads()
        self.forward_pending = False
        self.close_step("manual")

    def on_pre_step_hook(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """torch's step pre-hook (``args`` begin with the optimizer); may hand ``step()`` a checking closure."""
        return self._pre_step(args, kwargs, first=1)

    def on_pre_step(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict] | None:
        """Before a wrapped ``step()`` (``args`` are its own)."""
        return self._pre_step(args, kwargs, first=0)

    def _pre_step(self, args: tuple, kwargs: dict, first: int) -> tuple[tuple, dict] | None:
        """The optimizer is about to apply the step: check it first -- or, when ``step(closure)`` runs the forward
        and backward itself, each time the closure returns (:mod:`.closures`). With manual steps, note that this
        step's update comes before its check at mon.step(), for the advice of a report."""
        if self.hooks.active and not self.manual:
            replaced = self.closures.begin(self.optimizer, args, kwargs, first)
            if replaced is not None:
                return replaced
            self.close_step("optimizer", abort_check=False)
            self.optimizer_stepped = True  # scaler.update() of this step has nothing left to check
        elif self.hooks.active and not self.recorder.rec.empty:
            self.updated_in = self.index
            self.late_check = True
            self.recorder.live_default = True  # from the next step on: a replay after the update would run on other
            # weights
        return None

    def _try_update(self, step: int) -> None:
        """The update about to be applied, tried on a copy (:mod:`.update_trial`): raised before it is applied when
        it makes a weight non-finite, with the fix (a larger eps) tried the same way."""
        names = {id(p): clean_name(n) for n, p in self.watched.root.named_parameters()}
        bad = try_update(self.optimizer, names)
        if bad is None:  # (the attach warning said it would be tried: say it was not, once, and stop trying)
            self.try_updates = False
            warnings.warn(f"torchdoctor: {type(self.optimizer).__name__}'s update could not be tried on a copy (the "
                          "same class could not be built on copies of its groups, or its step failed there): an update "
                          "that makes a weight non-finite cannot be stopped before it is applied", MonitorWarning,
                          stacklevel=2)
            return
        if not bad:
            return
        dtypes = {p.dtype for g in self.optimizer.param_groups for p in g["params"] if p.is_floating_point()}
        eps = max((smallest_eps(d) for d in dtypes), default=1e-4)  # (one every dtype holds: fp16's 1e-4)
        fixed = try_update(self.optimizer, names, eps=eps) == []
        report = update_report(step, bad, self.optimizer_note or "", self.watched.class_of, eps if fixed else None,
                               eps, self.rank)
        report.observed = {"gradients": "finite (the step's check, before the trial)",
                           "update": "tried on a copy of the weights, their gradients and the optimizer's state, "
                                     "before it was applied"}
        self.raise_(report)

    def _check_closure(self, again: bool) -> None:
        """The closure of ``step(closure)`` returned (``again``: a later evaluation of the same step): check what
        it ran; the step number moves on only when ``step()`` returns."""
        self.close_step("optimizer", abort_check=False, advance=False)
        self.optimizer_stepped = True

    def on_post_step(self, *_: Any, **__: Any) -> None:
        if self.hooks.active and not self.manual:
            calls = self.closures.end()
            if calls == 0:  # the optimizer never evaluated its closure: check what there is, late
                self.close_step("optimizer", abort_check=False)
            elif calls is not None:
                self.rotate()  # the step was checked at each evaluation: now it ends
            self.check_abort_after(self.index - 1)

    def on_scaler_update(self, *args: Any, **kwargs: Any) -> None:
        """torch's ``scaler.update()`` (after the step or its skip), DeepSpeed's ``update_scale(overflow)``
        (before either)."""
        if not self.hooks.active:
            return
        if self.scaler is not None and self.scaler.deepspeed:
            overflow = args[0] if args else kwargs.get("overflow", False)
            if not overflow and self.optimizer is not None:
                return  # the optimizer steps next: its pre-hook checks this step
            self.close_step("skipped" if overflow and self.optimizer is not None else "scaler")
            return
        if self.optimizer_stepped:  # the optimizer pre-hook already checked this step
            self.optimizer_stepped = False
            return
        # with an optimizer, reaching here means the scaler skipped its step; without one, it is the boundary
        self.close_step("skipped" if self.optimizer is not None else "scaler")

    def on_zero_grad(self, *_: Any, **__: Any) -> None:
        """zero_grad() after a backward but no optimizer step: the step was skipped (by a loss scaler
        that was not passed as ``scaler=``). Check it now, while its gradients still exist."""
        if self.hooks.active and not self.manual and self.recorder.rec.backward_ran:
            self.close_step("skipped")

    def exit_check(self) -> None:
        """The ``with`` block exits without an exception: check the last, still open step. A detection here is raised
        by the ``with`` statement itself (the report says so)."""
        open_step = not self.recorder.rec.empty or self.deferred_report is not None
        if self.hooks.active and (open_step or self.check.sync_ranks):
            self.at_exit = True
            try:
                self.close_step("final", advance=open_step)  # (an empty step shared under DDP: not counted)
            finally:
                self.at_exit = False

    def end_run(self) -> None:
        """The monitor closes: what only the whole run shows -- a loss scaler that skipped every step -- is said
        (:meth:`~.reporter.Reporter.never_stepped`). Once."""
        if self._ended:
            return
        self._ended = True
        first = self.reporter.first_overflow
        # every step the run ended was one the scaler skipped (and none was checked in front of the optimizer and
        # found finite): without an optimizer given, only the first part can be seen
        if not self.applied and first is not None and len(self.reporter.overflows) >= self.index:
            self.reporter.never_stepped(self.index, self.scaler is not None and self.scaler.deepspeed,
                                        narrow_step(first))

    def close_step(self, source: str, abort_check: bool = True, advance: bool = True) -> None:
        """Check the finished step with one host read; raise or record what went wrong (``advance=False``: the
        step goes on, a closure's evaluation)."""
        recorder = self.recorder
        rec = recorder.rec
        rec.settle()
        if rec.live:
            recorder.learning_entries = False
        elif not rec.frames:  # checked at its boundaries, yet no call of the model was seen
            if not rec.backward_ran and self.watched.engine.grads_at_report:
                rec.backward_ran = any(p.grad is not None for p in self.watched.params)
            if rec.backward_ran or source == "optimizer":
                recorder.learning_entries = True  # the loop calls modules on their own: watch one step to see which
        nothing = rec.empty and self.deferred_report is None
        if nothing and source in ("forward", "skipped", "final") and not self.check.sync_ranks:
            return  # (under DDP every rank must take part in the verdict, so no shortcut there)
        if not rec.frames and rec.live and source == "optimizer" and not self.warned_unseen:
            self._forward_unseen()  # (watched every module, yet nothing recorded: not a loop's own entries)
        judged = rec.buffer.judged_stacks()  # activations, module-level and engine-collected gradients
        if rec.buffer.changed:
            rec.measure_changed_at_once()
        # each group's largest value (its statistics are abs values: a nan or inf anywhere is the max): the step's
        # flag, and on a healthy step the divergence trail's peak, from one reduction per group
        peaks = {key: v.amax() for key, v in judged.items() if v.numel()}
        act_ok = [torch.isfinite(p) for p in peaks.values()]
        if self.deferred_report is not None:
            act_ok = [torch.zeros((), dtype=torch.bool)]
        # nothing ran since a reported step: gradients still there are that step's (its zero_grad() was skipped)
        stale = rec.empty and self.just_reported
        check_grads = recorder.grads != "none" and not stale and (source != "forward" or rec.backward_ran)
        step = self.index
        near = None  # headroom=True, on its steps: a module within 2x of its dtype's largest value (device)
        if self.headroom is not None and rec.live and self.headroom.due(step):
            near = self.headroom.collect(step, rec.frames, rec.buffer, judged)
        ok, self_bad, near_set = self.check.verdict(act_ok, rec, check_grads, near)
        if ok and near_set:
            self.headroom.warn(self.rank, self.reporter.report_dir)
        if step in self.trace_steps:
            self.tracer.write_step(step, resolved([rec]))
        if self.timeline is not None:
            self.timeline.add(step, rec)  # (device ops; written every record_flush steps)
        if ok and source == "optimizer" and self.try_updates:
            # the update about to be applied, tried on a copy: raised here, as any bad step of this boundary is (the
            # step keeps its number and its buffers are put back); from inside step(closure), Lightning's way, too
            self._try_update(step)
        if ok:
            self.judge.healthy()
            self.history.growth.add(step, peaks)  # a few device ops, read only when a report is built
            if source == "optimizer":
                self.applied += 1
        else:
            self._bad_step(step, source, check_grads, self_bad)
        self.rotate(advance)
        if abort_check and source != "skipped":
            self.check_abort_after(step)

    def _bad_step(self, step: int, source: str, check_grads: bool, self_bad: bool) -> None:
        """Carry out the judge's decision on a bad step; a step that stops the run has its fix tried first."""
        setup = self.setup()
        outcome = self.judge.judge(step, source, check_grads, self_bad, setup, self.deferred_report,
                                   self.optimizer_hooked())
        outcome.report.observed = self.observed(outcome.report)
        if outcome.action == RAISE:
            if outcome.report is not self.deferred_report:
                self.fix_checker.check(outcome.report, setup)
            self.raise_(outcome.report)
        elif outcome.action == SKIP:
            self.after_detection()
            self.reporter.transient(outcome.report)
        elif outcome.action == OVERFLOW:
            pass  # recorded; the loss scaler skips the step

    def _forward_unseen(self) -> None:
        """The optimizer steps, yet no forward was recorded: was the model compiled after we attached?
        Inside compiled code the hooks do nothing; ``module.compile()`` regions can still get their edges."""
        self.warned_unseen = True
        late = self.watched.late_regions()
        if late:
            late.install(self.hooks, self.recorder)
            self.watched.regions.regions += late.regions
            log.warning("torchdoctor: the model was compiled after the monitor attached; watching the compiled "
                        "regions' edges from the next step on")
            return
        warnings.warn(
            "torchdoctor: the optimizer steps but no forward of the model was recorded. If the model was compiled "
            "after the monitor attached (torch.compile(model)), attach it to the compiled model instead: "
            "NumericsMonitor(torch.compile(model), ...); inside compiled code the monitor's hooks do nothing. "
            "Gradients are still checked.", MonitorWarning, stacklevel=4,
        )

    def rotate(self, advance: bool = True, keep: bool = True) -> None:
        """Keep recent steps (unread, on device) as context for a report, then start a new step
        (``advance=False``: a new record of the same step, compat's submodule-only calls)."""
        rec = self.recorder.rec
        rec.root_calls = []  # inputs kept for a re-run: not beyond their step
        if keep:
            self.history.keep(rec)
        if advance:
            self.index += 1
        self.just_reported = False
        self.new_step(continued=not advance)

    def after_detection(self, advance: bool = False, continued: bool = False) -> int:
        """A detection was reported: put the buffers back as the step began, forget the step and its
        context, and go on watching (a loop that catches the error goes on). The step number stays: its
        update was refused, so the next try is the same step (compat passes transformers' counting).
        How many buffers were put back."""
        restored = self.buffers.restore() if self.buffers is not None else 0
        if self.optimizer_hooked():
            # the update was refused and the exception skips the loop's zero_grad(): drop the refused step's
            # gradients, or the next backward adds onto its nan and every later step is reported again
            for p in self.watched.params:
                p.grad = None
        self.history.clear()
        self.deferred_report = None
        self.recorder.stash = None
        self.forward_pending = False
        if advance:
            self.index += 1
        self.new_step(continued)
        self.just_reported = True
        return restored

    def check_abort_after(self, step: int) -> None:
        if self.abort_after_step is not None and step >= self.abort_after_step:
            self._stop()
            raise AbortAfterStep(
                f"torchdoctor: stopping after step {step} as asked (abort_after_step={self.abort_after_step})"
            )

    def finish(self, report: NonFiniteReport, reset: bool = True) -> None:
        """Keep the report, put the buffers back, write the report to disk before anything is raised, and go on
        watching from a fresh step. ``reset=False`` (a no-grad pass between a backward and its optimizer step):
        the training step it interrupted is resumed as it is, still to be checked at its own boundary."""
        self.reporter.detected(report)
        if self.at_exit:
            report.notes.append(EXIT_NOTE)
        restored = self.after_detection() if reset else 0
        missed = self.buffers.missed if reset and self.buffers is not None else 0
        if missed:
            report.notes.append(
                f"{missed} module buffer(s) replaced since this step began (e.g. by model.double() or .to()) "
                "could not be put back."
            )
        if restored:
            report.notes.append(
                f"{restored} module buffer(s) (e.g. BatchNorm running statistics) were put back as they were "
                "when this step began."
            )
        self.reporter.write(report)

    def raise_(self, report: NonFiniteReport) -> None:
        self.finish(report)
        if self.timeline is not None:
            self.timeline.stopped(report)  # the recording and the report are on disk before anything is raised
        raise NonFiniteError(report)

    # ------------------------------------------------------------------ the model's calls (StepEvents)
    def root_forward_starting(self, module: Any, args: Any, kwargs: dict) -> None:
        """The model's outermost call begins: close a forward-bounded step that awaits it, put an evaluation pass on
        a record of its own, notice a step a loss scaler skipped, and let the recorder keep what a replay needs."""
        recorder = self.recorder
        grad_on = torch.is_grad_enabled()
        if self.forward_pending and self.ends_at_forward() and (grad_on or not self.check.sync_ranks):
            self.forward_pending = False
            self.close_step("forward")  # the previous forward and the backward that followed it
        if recorder.stash is not None and grad_on:  # an evaluation forward raised midway
            recorder.resume_training()
        evaluation = not self.ends_at_forward() or self.check.sync_ranks  # (no collective for one rank's eval)
        if not grad_on and evaluation and recorder.stash is None:
            # an evaluation / generation forward between training steps: checked on its own at its end,
            # so that a long evaluation loop does not pile its frames onto the training step; under
            # torch.distributed without a collective, since other ranks need not run it
            recorder.begin_evaluation(module, args, kwargs)
            return
        # A backward ran, yet every gradient is None again: the optimizer step was skipped (a loss
        # scaler saw an overflow) and zero_grad() ran. Close that step now.
        rec = recorder.rec
        skipped_possible = rec.backward_ran and not self.manual and self.optimizer is not None
        skipped_possible = skipped_possible and self.watched.engine.grads_at_report  # (ZeRO-2/3: p.grad always gone)
        if skipped_possible and self.scaler is None and all(p.grad is None for p in self.watched.params):
            self.close_step("skipped")
        recorder.begin_call(module, args, kwargs)

    def root_forward_ended(self) -> None:
        # the model's outputs are measured before the code after the forward can change them in place
        # (logits[:, 0] = -inf before the loss): neither a waiting call nor a window may hold them into user code
        rec = self.recorder.rec
        rec.settle()
        rec.buffer.flush()
        if self.recorder.stash is not None:
            self._close_inference_pass()
        elif self.ends_at_forward():
            if self.hf or not torch.is_grad_enabled():
                self.close_step("forward")
            else:  # a backward may follow: close at the next forward, step() or leaving the with block
                self.forward_pending = True

    def loose_call_starting(self) -> None:
        if self.forward_pending:  # a submodule-only call ended the previous forward: close it
            self.forward_pending = False
            self.close_step("forward")

    def loose_call_ended(self) -> None:
        """The outermost watched call of a loop that never calls the root module ended: a step (or, in compat
        mode, a check) boundary, so that such a loop is checked and its frames never pile up."""
        if self.hf:
            self.close_step("loose")
        elif self.recorder.stash is None and self.ends_at_forward():
            self.forward_pending = True  # closed at the next call, step() or leaving the with block

    def root_forward_failed(self) -> None:
        """The root forward raised. If a non-finite value came first, say so; else forget its frames.

        torch silences exceptions raised here (the forward's own exception is re-raised), so the
        report is written to disk, logged, and attached to that exception as a note.
        """
        recorder = self.recorder
        flag = recorder.rec.activation_flag()
        if flag is not None and not bool(flag.item()):
            frames, start = self.history.frames_with(recorder.rec)
            report = build_report(frames, self.max_frames, self.rank, start, self.hf, setup=self.setup())
            if report is not None:
                self._failed_forward_report(report)
                return
        elif not recorder.rec.live and recorder.rec.root_calls:  # checked at its boundaries: replay to look inside
            # (earlier steps as context: reading this step's statistics now would freeze its buffer, and the step
            # goes on when no report comes of it)
            report = self.replayer.failed_forward(recorder.rec.root_calls[-1], self.history.frames(), self.setup())
            if report is not None:
                self._failed_forward_report(report)
                return
        recorder.forget_failed_call()

    def _failed_forward_report(self, report: NonFiniteReport) -> None:
        report.notes.append("The forward then raised an exception of its own (see the traceback).")
        self.finish(report)
        log.error("non-finite value before the forward raised:\n%s", report.text())
        exc = sys.exc_info()[1]
        if exc is not None and hasattr(exc, "add_note"):
            exc.add_note("torchdoctor: " + report.text())

    def _close_inference_pass(self) -> None:
        """Check a no-grad forward made between training steps (one host read), then resume the step."""
        flag = self.recorder.rec.activation_flag()
        done = self.recorder.end_evaluation()
        if flag is not None and not bool(flag.item()):
            frames = resolved([done])
            report = build_report(frames, self.max_frames, self.rank, 0, self.hf, setup=self.setup())
            assert report is not None
            if not self.hf:
                report = self.replayer.localize(done, report, frames, 0, True, self.setup())
            report.notes.append("This was a forward under torch.no_grad() (evaluation or generation).")
            if self.check.sync_ranks:
                # other ranks may be in a collective already: say it at the next shared verdict, together
                self.deferred_report = self.deferred_report or report
                return
            self.finish(report, reset=False)  # the resumed training step is judged at its own boundary
            raise NonFiniteError(report)

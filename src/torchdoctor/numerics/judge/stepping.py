"""The monitor at its step boundaries: when a step ends, how it is judged with one host read, and what is
kept of it.

A step ends at ``optimizer.step()`` (a pre-hook), at ``mon.step()``, at the next forward when nothing else
ends it, when a loss scaler skips it, or when the ``with`` block exits. :meth:`Stepping._close_step` stacks the
step's on-device statistics, reads the one "all finite" flag (shared across ranks under torch.distributed), and
either keeps the step as context for a later report or hands it to :mod:`.judging`. A mixin of
:class:`~.monitor.NumericsMonitor`, as :mod:`.recording` (the hooks) and :mod:`.judging` are.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch

from ..engines import MonitorWarning
from ..errors import AbortAfterStep, NonFiniteError
from ..explain.diagnosis import Setup
from ..explain.report import NonFiniteReport, build_report
from ..fp32 import kept_in_fp32
from ..measure.stats import all_finite
from ..record.compiled import Regions
from ..record.step import StepRecord
from .replay import localize, replay_failed_forward
from .verdict import share_verdict

log = logging.getLogger("torchdoctor.numerics")

EXIT_NOTE = (
    "This step was checked as the `with NumericsMonitor(...)` block exited (nothing inside the block ended it: no "
    "optimizer step ran -- a GradScaler that skipped it, not passed as scaler= -- and no mon.step()), so this "
    "NonFiniteError is raised by the `with` statement itself: catch it with a try around the with block, or pass "
    "scaler= / call mon.step() so that every step is checked inside it."
)


class Stepping:
    """Step boundaries of :class:`~.monitor.NumericsMonitor` (a mixin)."""

    def _new_step(self, continued: bool = False) -> None:
        self._rec = StepRecord(continued=continued)
        if self._modules is not None:  # (attached) checked at its boundaries, unless this step is traced
            self._rec.live = self._live_default or self._learning_entries or self.step_index in self.trace_steps \
                or (self._headroom is not None and self._headroom.due(self.step_index))
            self._set_live(self._rec.live)
            if not self._rec.live and self._found_entries:
                self._add_entries(self._found_entries)  # (after the live hooks are gone: never two on one module)
                self._found_entries = {}
        if self._buffers is not None and not continued:  # a continued step keeps the snapshot of its start
            self._buffers.start()

    def _steps_end_at_forward(self) -> bool:
        return self.optimizer is None and not self._manual and self.scaler is None

    def _optimizer_hooked(self) -> bool:
        """Is the step checked in front of the optimizer's step (its pre-hook ends the step)?"""
        return self.optimizer is not None and not self._manual

    def _checked_before_update(self) -> bool:
        """Is the step being judged checked before its update was applied: in front of the hooked optimizer, or, with
        manual steps, at a ``mon.step()`` that came before this step's ``optimizer.step()``? (Without an optimizer
        the monitor cannot see when the update comes.)"""
        if self.optimizer is None:
            return False
        return not self._manual or self._updated_in != self.step_index

    def _setup(self) -> Setup:
        """What a report's advice may assume beyond its frames (:class:`~.diagnosis.Setup`). Report time only."""
        before = self._checked_before_update()
        return Setup(self.optimizer is not None, self._manual, before, before and not self._late_check,
                     kept_in_fp32(self._engine.modules()), self._via)

    # ------------------------------------------------------------------ step boundaries
    def step(self) -> None:
        """End a training step by hand: check it, then start the next. With an optimizer given, call it before
        ``optimizer.step()`` (and ``zero_grad()``): a bad step then raises before its update is applied."""
        self._manual = True
        self._hook_param_grads()
        self._forward_pending = False
        self._close_step("manual")

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
        if self._active and not self._manual:
            replaced = self._closures.begin(self.optimizer, args, kwargs, first)
            if replaced is not None:
                return replaced
            self._close_step("optimizer", abort_check=False)
            self._optimizer_stepped = True  # scaler.update() of this step has nothing left to check
        elif self._active and not self._rec.empty:
            self._updated_in = self.step_index
            self._late_check = True
            self._live_default = True  # from the next step on: a replay after the update would run on other weights
        return None

    def _check_closure(self, again: bool) -> None:
        """The closure of ``step(closure)`` returned (``again``: a later evaluation of the same step): check what
        it ran; the step number moves on only when ``step()`` returns."""
        self._close_step("optimizer", abort_check=False, advance=False)
        self._optimizer_stepped = True

    def _rewrite_report(self, report: NonFiniteReport) -> None:
        try:
            report.write(self.report_dir)
        except Exception as e:
            report.notes.append(f"(could not write the report to {self.report_dir}: {e})")

    def on_post_step(self, *_: Any, **__: Any) -> None:
        if self._active and not self._manual:
            calls = self._closures.end()
            if calls == 0:  # the optimizer never evaluated its closure: check what there is, late
                self._close_step("optimizer", abort_check=False)
            elif calls is not None:
                self._rotate()  # the step was checked at each evaluation: now it ends
            self._check_abort_after(self.step_index - 1)

    def on_scaler_update(self, *args: Any, **kwargs: Any) -> None:
        """torch's ``scaler.update()`` (after the step or its skip), DeepSpeed's ``update_scale(overflow)``
        (before either)."""
        if not self._active:
            return
        if self._scaler is not None and self._scaler.deepspeed:
            overflow = args[0] if args else kwargs.get("overflow", False)
            if not overflow and self.optimizer is not None:
                return  # the optimizer steps next: its pre-hook checks this step
            self._close_step("skipped" if overflow and self.optimizer is not None else "scaler")
            return
        if self._optimizer_stepped:  # the optimizer pre-hook already checked this step
            self._optimizer_stepped = False
            return
        # with an optimizer, reaching here means the scaler skipped its step; without one, it is the boundary
        self._close_step("skipped" if self.optimizer is not None else "scaler")

    def on_zero_grad(self, *_: Any, **__: Any) -> None:
        """zero_grad() after a backward but no optimizer step: the step was skipped (by a loss scaler
        that was not passed as ``scaler=``). Check it now, while its gradients still exist."""
        if self._active and not self._manual and self._rec.backward_ran:
            self._close_step("skipped")

    def _close_step(self, source: str, abort_check: bool = True, advance: bool = True) -> None:
        """Check the finished step with one host read; raise or record what went wrong (``advance=False``: the
        step goes on, a closure's evaluation)."""
        rec = self._rec
        rec.settle()
        if rec.live:
            self._learning_entries = False
        elif not rec.frames:  # checked at its boundaries, yet no call of the model was seen
            if not rec.backward_ran and self._engine.grads_at_report:
                rec.backward_ran = any(p.grad is not None for p in self._params)
            if rec.backward_ran or source == "optimizer":
                self._learning_entries = True  # the loop calls modules on their own: watch one step to see which
        nothing = rec.empty and self._deferred_report is None
        if nothing and source in ("forward", "skipped", "final") and not self._sync_ranks:
            return  # (under DDP every rank must take part in the verdict, so no shortcut there)
        if not rec.frames and source == "optimizer" and not self._warned_unseen:
            self._forward_unseen()
        judged = rec.buffer.judged_stacks()  # activations, module-level and engine-collected gradients
        if rec.buffer.changed:
            rec.measure_changed_at_once()
        # each group's largest value (its statistics are abs values: a nan or inf anywhere is the max): the step's
        # flag, and on a healthy step the divergence trail's peak, from one reduction per group
        peaks = {key: v.amax() for key, v in judged.items() if v.numel()}
        act_ok = [torch.isfinite(p) for p in peaks.values()]
        if self._deferred_report is not None:
            act_ok = [torch.zeros((), dtype=torch.bool)]
        # nothing ran since a reported step: gradients still there are that step's (its zero_grad() was skipped)
        stale = rec.empty and self._just_reported
        check_grads = self.grads != "none" and not stale and (source != "forward" or rec.backward_ran)
        grad_flags = self._engine.grad_flags(self._params, exact=False) if check_grads else []
        step = self.step_index
        near = None  # headroom=True, on its steps: a module within 2x of its dtype's largest value (device)
        if self._headroom is not None and rec.live and self._headroom.due(step):
            near = self._headroom.collect(step, rec.frames, rec.buffer, judged)
        ok, self._self_bad, near_set = self._verdict(act_ok, grad_flags + rec.stored_grad_flags(), near)
        if not ok and check_grads:  # the fast gradient check can overflow on huge finite values: ask exactly
            ok, self._self_bad, _ = self._verdict(act_ok, self._engine.grad_flags(self._params)
                                                  + rec.stored_grad_flags())
        if ok and near_set:
            self._headroom.warn(self.rank, self.report_dir)
        if step in self.trace_steps:
            self._trace(step)
        if ok:
            self._consecutive_overflows = 0
            self._growth.add(step, peaks)  # a few device ops, read only when a report is built
        else:
            self._handle_nonfinite(step, source, check_grads)
        self._rotate(advance)
        if abort_check and source != "skipped":
            self._check_abort_after(step)

    def _verdict(self, act_ok: list[torch.Tensor], grad_ok: list[torch.Tensor],
                 near: torch.Tensor | None = None) -> tuple[bool, bool, bool]:
        """(everything finite on every rank, this rank's own values were not, the headroom flag ``near``), from the
        activations' and the gradients' on-device flags. The one host read of a healthy step (``near`` rides on it;
        under several ranks it is read on its own, on headroom steps only)."""
        if self._sync_ranks:
            ok, self_bad = share_verdict(all_finite(act_ok), all_finite(grad_ok))
            return ok, self_bad, near is not None and bool(near.item())
        both = all_finite(act_ok + grad_ok)  # (one stack for both)
        if near is not None:  # both flags in one number, one read: bit 0 all finite, bit 1 near
            ok_flag = both if both is not None else torch.ones((), dtype=torch.bool, device=near.device)
            code = int((ok_flag.to(torch.int32) + 2 * near.to(device=ok_flag.device, dtype=torch.int32)).item())
            return bool(code & 1), not code & 1, bool(code & 2)
        ok = True if both is None else bool(both.item())
        return ok, not ok, False

    def _forward_unseen(self) -> None:
        """The optimizer steps, yet no forward was recorded: was the model compiled after we attached?
        Inside compiled code the hooks do nothing; ``module.compile()`` regions can still get their edges."""
        self._warned_unseen = True
        late = Regions(self.model, self.model)
        if late:
            late.install(self)
            self._regions.regions += late.regions
            log.warning("torchdoctor: the model was compiled after the monitor attached; watching the compiled "
                        "regions' edges from the next step on")
            return
        warnings.warn(
            "torchdoctor: the optimizer steps but no forward of the model was recorded. If the model was compiled "
            "after the monitor attached (torch.compile(model)), attach it to the compiled model instead: "
            "NumericsMonitor(torch.compile(model), ...); inside compiled code the monitor's hooks do nothing. "
            "Gradients are still checked.", MonitorWarning, stacklevel=4,
        )

    def _rotate(self, advance: bool = True, keep: bool = True) -> None:
        """Keep recent steps (unread, on device) as context for a report, then start a new step
        (``advance=False``: a new record of the same step, compat's submodule-only calls)."""
        rec = self._rec
        rec.root_calls = []  # inputs kept for a re-run: not beyond their step
        if rec.frames and keep:
            rec.keep_for_context(self.max_frames)
        if rec.frames and keep:
            self._history.append(rec)
            kept = 0
            for i in range(len(self._history) - 1, -1, -1):
                kept += len(self._history[i].frames)
                if kept >= self.max_frames:
                    for _ in range(i):
                        self._history.popleft()
                    break
        if advance:
            self.step_index += 1
        self._just_reported = False
        self._new_step(continued=not advance)

    def _after_detection(self, advance: bool = False, continued: bool = False) -> int:
        """A detection was reported: put the buffers back as the step began, forget the step and its
        context, and go on watching (a loop that catches the error goes on). The step number stays: its
        update was refused, so the next try is the same step (compat passes transformers' counting).
        How many buffers were put back."""
        restored = self._buffers.restore() if self._buffers is not None else 0
        if self._optimizer_hooked():
            # the update was refused and the exception skips the loop's zero_grad(): drop the refused step's
            # gradients, or the next backward adds onto its nan and every later step is reported again
            for p in self._params:
                p.grad = None
        self._history.clear()
        self._deferred_report = None
        self._stash = None
        self._forward_pending = False
        if advance:
            self.step_index += 1
        self._new_step(continued)
        self._just_reported = True
        return restored

    def _check_abort_after(self, step: int) -> None:
        if self.abort_after_step is not None and step >= self.abort_after_step:
            self._stop()
            raise AbortAfterStep(
                f"torchdoctor: stopping after step {step} as asked (abort_after_step={self.abort_after_step})"
            )

    def _stop(self) -> None:
        """The run is over: stop checking and let a new monitor attach (inert hooks go at close())."""
        self._active = False
        self._release_modules()

    def _finish(self, report: NonFiniteReport, reset: bool = True) -> None:
        """Keep the report, put the buffers back, write the report to disk before anything is raised, and go on
        watching from a fresh step. ``reset=False`` (a no-grad pass between a backward and its optimizer step):
        the training step it interrupted is resumed as it is, still to be checked at its own boundary."""
        self.report = report
        report.watched = report.watched or self.watching
        if self._at_exit:
            report.notes.append(EXIT_NOTE)
        restored = self._after_detection() if reset else 0
        missed = self._buffers.missed if reset and self._buffers is not None else 0
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
        try:
            report.write(self.report_dir)
        except Exception as e:  # never let a full disk (or anything else) hide the finding itself
            report.notes.append(f"(could not write the report to {self.report_dir}: {e})")

    def _raise(self, report: NonFiniteReport) -> None:
        self._finish(report)
        raise NonFiniteError(report)

    def _trace(self, step: int) -> None:
        self._tracer.write_step(step, self._resolved([self._rec]))

    # ------------------------------------------------------------------ forwards that end a pass
    def _on_root_forward_end(self) -> None:
        # the model's outputs are measured before the code after the forward can change them in place
        # (logits[:, 0] = -inf before the loss): neither a waiting call nor a window may hold them into user code
        self._rec.settle()
        self._rec.buffer.flush()
        if self._stash is not None:
            self._close_inference_pass()
        elif self._steps_end_at_forward():
            if self._hf or not torch.is_grad_enabled():
                self._close_step("forward")
            else:  # a backward may follow: close at the next forward, step() or leaving the with block
                self._forward_pending = True

    def _on_root_forward_failed(self) -> None:
        """The root forward raised. If a non-finite value came first, say so; else forget its frames.

        torch silences exceptions raised here (the forward's own exception is re-raised), so the
        report is written to disk, logged, and attached to that exception as a note.
        """
        flag = self._rec.activation_flag()
        if flag is not None and not bool(flag.item()):
            frames, start = self._frames_with_context()
            report = build_report(frames, self.max_frames, self.rank, start, self._hf, setup=self._setup())
            if report is not None:
                self._on_failed_forward_report(report)
                return
        elif not self._rec.live and self._rec.root_calls:  # checked at its boundaries: replay to look inside
            # (earlier steps as context: reading this step's statistics now would freeze its buffer, and the step
            # goes on when no report comes of it)
            context = self._resolved(list(self._history))
            report = replay_failed_forward(self, self._rec.root_calls[-1], context)
            if report is not None:
                self._on_failed_forward_report(report)
                return
        del self._rec.frames[self._forward_start :]
        if self._stash is not None:
            self._rec, self._stash = self._stash, None

    def _on_failed_forward_report(self, report: NonFiniteReport) -> None:
        report.notes.append("The forward then raised an exception of its own (see the traceback).")
        self._finish(report)
        log.error("non-finite value before the forward raised:\n%s", report.text())
        exc = sys.exc_info()[1]
        if exc is not None and hasattr(exc, "add_note"):
            exc.add_note("torchdoctor: " + report.text())

    def _close_inference_pass(self) -> None:
        """Check a no-grad forward made between training steps (one host read), then resume the step."""
        flag = self._rec.activation_flag()
        done, self._rec, self._stash = self._rec, self._stash, None
        if flag is not None and not bool(flag.item()):
            frames = self._resolved([done])
            report = build_report(frames, self.max_frames, self.rank, 0, self._hf, setup=self._setup())
            assert report is not None
            if not self._hf:
                report = localize(self, done, report, frames, 0, True)
            report.notes.append("This was a forward under torch.no_grad() (evaluation or generation).")
            if self._sync_ranks:
                # other ranks may be in a collective already: say it at the next shared verdict, together
                self._deferred_report = self._deferred_report or report
                return
            self._finish(report, reset=False)  # the resumed training step is judged at its own boundary
            raise NonFiniteError(report)



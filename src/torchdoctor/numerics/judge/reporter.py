"""What the monitor keeps and writes of what it found: the report it raised, the warnings and skipped steps the
run survived, the loss scaler's overflows; each report written to ``report_dir`` before anything is raised.

A full disk (or any error writing) never hides a finding: the report then carries a note saying it was not
written, and the run stops or goes on as it would have.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

from ...advice import FP32_COLLAPSE_FIX, fp16_collapse_fix
from ..engines.scalers import OverflowEvent
from ..errors import NonFiniteWarning
from ..explain import causes
from ..explain.report import NonFiniteReport
from .loss_warning import as_warning, loss_name, user_stacklevel

log = logging.getLogger("torchdoctor.numerics")


class Reporter:
    """The findings of one monitor (its public ``report``, ``warnings``, ``overflows``, ``transients``)."""

    def __init__(self, report_dir: str, rank: int | None) -> None:
        self.report_dir = report_dir
        self.rank = rank
        self._watching: str | Callable[[], str] = ""  # what is watched, in one line: kept in every report
        self.report: NonFiniteReport | None = None  # the last detection, the one raised
        self.warnings: list[NonFiniteReport] = []  # findings the run survives (an inf loss, finite gradients)
        self.overflows: list[OverflowEvent] = []  # steps a loss scaler skipped
        self.transients: list[NonFiniteReport] = []  # steps skipped with transient="skip"
        self.first_overflow: NonFiniteReport | None = None  # the report of the first step a loss scaler skipped

    @property
    def watching(self) -> str:
        """What is watched, in one line; given as a callable, worked out on first use (a Trainer callback's search of
        the process for the wrappers around its model: once, and only when a report or a caller needs it)."""
        if callable(self._watching):
            self._watching = self._watching()
        return self._watching

    @watching.setter
    def watching(self, value: str | Callable[[], str]) -> None:
        self._watching = value

    def write(self, report: NonFiniteReport, basename: str = "torchdoctor-nonfinite") -> list[str]:
        """Write ``report`` (its ``.txt`` and ``.json``); never raises: a note in the report says why not."""
        try:
            return report.write(self.report_dir, basename=basename)
        except Exception as e:  # never let a full disk (or anything else) hide the finding itself
            report.notes.append(f"(could not write the report to {self.report_dir}: {e})")
            return [f"(not written: {e})"]

    def detected(self, report: NonFiniteReport) -> None:
        """The detection that stops the run (or the step): kept as ``report``, said what was watched."""
        self.report = report
        report.watched = report.watched or self.watching

    def warn_loss(self, report: NonFiniteReport) -> None:
        """An inf loss with every gradient finite: a warning the run survives (:mod:`.loss_warning`), written,
        kept in ``warnings``, logged and warned about; the step's update is applied."""
        as_warning(report, causes.NONFINITE_LOSS)
        self.warnings.append(report)
        paths = self.write(report, basename="torchdoctor-nonfinite-loss")
        _said(report, f"torchdoctor: step {report.step}: {loss_name(report)} is {report.first.value} while every "
                      f"gradient is finite; the update was applied and the run goes on. Report: {paths[0]}")

    def transient(self, report: NonFiniteReport) -> None:
        """``transient="skip"``: a step whose fault did not reproduce was refused (its gradients dropped); kept in
        ``transients`` and on disk, warned about."""
        report.severity = "warn"
        report.notes.append("transient='skip': this step's update was refused (its gradients were dropped) and the "
                            "run went on.")
        report.watched = report.watched or self.watching
        self.transients.append(report)
        paths = self.write(report, basename="torchdoctor-transient")
        _said(report, f"torchdoctor: step {report.step} went non-finite and its replay did not reproduce it (a "
                      f"transient fault); its update was refused and the run goes on. Report: {paths[0]}")

    def never_stepped(self, steps: int, deepspeed: bool, narrow: bool = True) -> NonFiniteReport | None:
        """The run ends and its loss scaler skipped every one of its ``steps``: no update was ever applied, the model
        did not train. A report of its own (written and warned about like a detection), built on the first skipped
        step's; None when an update was applied or nothing overflowed. ``narrow``: that step computed in a narrow
        dtype (else the advice is not fp16's)."""
        first = self.first_overflow
        if first is None or not self.overflows or self.report is not None:
            return None
        scales = [e.scale for e in self.overflows if e.scale is not None]
        trajectory = (f" (loss scale {scales[0]:g} at step {self.overflows[0].step}, {scales[-1]:g} at step "
                      f"{self.overflows[-1].step})" if scales else "")
        n = len(self.overflows)
        rest = first.diagnosis
        report = NonFiniteReport(
            first.step, first.first, first.frames,
            f"the loss scaler skipped every step of the run: {n} of {steps} step(s) overflowed{trajectory} and no "
            "update was ever applied, so the model did not train. The gradients overflowed at every scale tried; at "
            f"step {first.step}: " + rest[:1].lower() + rest[1:],
            fix=fp16_collapse_fix(deepspeed, first.fp32_region) if narrow else FP32_COLLAPSE_FIX, rank=first.rank,
            fp32_region=first.fp32_region if narrow else None,
            fp32_kept=first.fp32_kept, cause=causes.SCALER_NEVER_STEPPED, evidence=first.evidence,
            cited=first.cited, watched=first.watched or self.watching, replay=first.replay,
            replay_reason=first.replay_reason, observed=first.observed)
        report.notes = [*first.notes, f"Steps the loss scaler skipped: {[e.step for e in self.overflows]}."]
        report.fix_check, report.fix_check_reason = "not checked", (
            "the run had ended: a step's inputs are kept only while it is checked; torchdoctor precision MODEL checks "
            "a region on the model before training")
        self.detected(report)
        paths = self.write(report)
        message = f"torchdoctor: {report.diagnosis.split('. ')[0]}. Report: {paths[0]}"
        log.error("%s\n%s", message, report.text())
        warnings.warn(message, NonFiniteWarning, stacklevel=2)
        return report


def _said(report: NonFiniteReport, message: str) -> None:
    """A finding the run goes on after: logged with its report, and warned about where the user's code is."""
    log.warning("%s\n%s", message, report.text())
    warnings.warn(message, NonFiniteWarning, stacklevel=user_stacklevel())

"""Exceptions raised by the numerics monitor."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .explain.report import FirstNonFinite, NonFiniteReport


class NonFiniteError(ValueError):
    """An inf/nan was found; with ``optimizer=`` given, raised before ``optimizer.step()`` changes anything.

    Attributes:
        report (str): the text report (also written to ``report_dir``).
        first (FirstNonFinite | None): step, phase, module, class and slot of the first non-finite value.
        details (NonFiniteReport): the structured report.
    """

    def __init__(self, report: NonFiniteReport) -> None:
        self.details = report
        self.report: str = report.text()
        self.first: FirstNonFinite | None = report.first
        super().__init__("torchdoctor: non-finite value detected\n" + self.report)

    def __reduce__(self):  # pickles (multiprocessing workers) with its structured report
        return (type(self), (self.details,))


class AbortAfterStep(RuntimeError):
    """Raised once the step given as ``abort_after_step`` has finished (a clean, asked-for stop)."""


class NonFiniteWarning(UserWarning):
    """A non-finite value the run survives: a loss that is inf while every gradient of its step is finite.
    The report is written to ``report_dir`` (its path is in the message) and kept in ``NumericsMonitor.warnings``."""

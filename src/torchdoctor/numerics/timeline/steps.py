"""Which steps a recording keeps, and handing each one's statistics to the writer (the monitor's side of it)."""

from __future__ import annotations

from ..explain.report import NonFiniteReport
from ..record.step import StepRecord
from .collect import step_stats
from .store import TimelineWriter


class Timeline:
    """The recording of one monitor: every ``every``-th step, watched every module (module-level gradients too),
    its statistics gathered on the device as its one host read is done, written by ``writer``."""

    def __init__(self, writer: TimelineWriter, every: int = 1) -> None:
        self.writer = writer
        self.every = every
        self.closed = False

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def add(self, step: int, rec: StepRecord) -> None:
        """The step ended (and was judged): keep its statistics (a step not watched every module has none)."""
        if rec.live and self.due(step) and not self.closed:
            self.writer.add(step, *step_stats(rec.frames, rec.buffer))

    def flush(self) -> None:
        """Before a NonFiniteError is raised: what was recorded is on disk."""
        if not self.closed:
            self.writer.flush()

    def stopped(self, report: NonFiniteReport) -> None:
        """Before a NonFiniteError is raised: the steps kept and the report (JSON and the text the monitor prints)
        are on disk; the recording stays open (the monitor closes it)."""
        if not self.closed:
            self.writer.write_report(report.to_json(), report.text())

    def close(self, report: NonFiniteReport | None = None) -> None:
        if not self.closed:
            self.closed = True
            if report is None:
                self.writer.close()
            else:  # (report.json again, as the error wrote it, and the text the monitor printed)
                self.writer.close(report.to_json(), report.text())

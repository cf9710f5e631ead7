"""Tracing chosen steps: every frame printed in the transformers layout and appended to a JSONL file."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from ...jsonfile import dumps
from ..record.frames import ResolvedFrame
from .render import format_frame, frames_header


class TraceWriter:
    """Prints traced steps to ``stream`` and appends them to ``torchdoctor-trace-rank<r>.jsonl``.

    The file is opened on the first traced step and kept open (appending) until :meth:`close`.
    """

    def __init__(self, report_dir: str, rank: int | None, stream: TextIO | None = None) -> None:
        self.path = os.path.join(report_dir, f"torchdoctor-trace-rank{rank or 0}.jsonl")
        self._report_dir = report_dir
        self._tag = f"[rank{rank}] " if rank is not None else ""
        self._stream = stream
        self._file: TextIO | None = None

    def write_step(self, step: int, frames: list[ResolvedFrame]) -> None:
        out = self._stream or sys.stdout
        tag = self._tag
        out.write(f"{tag}{' ' * 17} *** Starting step={step} ***\n{tag}{frames_header()}\n")
        if self._file is None:
            os.makedirs(self._report_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across steps
        for f in frames:
            out.write("".join(f"{tag}{line}\n" for line in format_frame(f, phase=True)))
            self._file.write(dumps(f.to_json()) + "\n")
        self._file.flush()
        out.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

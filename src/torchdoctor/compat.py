"""Drop-in replacements for ``transformers.debug_utils``: change the import, keep the output.

``DebugUnderflowOverflow`` prints the same report, trace and ``ValueError`` messages as transformers
(5.x), with the same batch counting (a batch is one call of the root module's forward, numbered from
0), and every line transformers prints appears in ours, in the same order, with the same numbers.
It is built on the numerics monitor's on-device engine, so it reads the device once per batch
instead of ~4 times per tensor, and it has none of the known defects: hooks are removable
(``.remove()``) and never doubled, the frame buffer stays bounded after a traced batch, an inf in a
traced batch does not abort the next batch, bool / empty / meta tensors are fine, keyword inputs and
dict / ``ModelOutput`` / list outputs are shown (as extra lines after the ones transformers prints)
but, as in transformers, never judged, recomputation under gradient checkpointing is not taken for new
frames, and under torch.distributed every line carries its rank.

It also behaves where transformers' class misbehaves: a loop that calls only a submodule
(``model.transformer(...)``, ``model.get_encoder()(...)``) is checked when that outermost call ends and
its batch number stays, as in transformers, where it is; after a caught ``ValueError`` the loop is still
watched (transformers raises again at every later call), and the module buffers (``BatchNorm``
statistics) are put back as the batch began; making a second detector on the same model (what
``Trainer.train()`` called twice does) replaces the first.

Example::

    from torchdoctor.compat import DebugUnderflowOverflow   # was: from transformers.debug_utils import ...
    debug_overflow = DebugUnderflowOverflow(model)
"""

from __future__ import annotations

import functools
import math
import sys
from collections import deque
from enum import Enum
from typing import Any

from torch import nn

from .numerics.explain.render import PREFIX, format_frame, hf_header
from .numerics.explain.report import build_report
from .numerics.judge.history import resolved
from .numerics.judge.steps import Steps
from .numerics.monitor import NumericsMonitor
from .numerics.overflow import detect_overflow
from .numerics.record.frames import ResolvedFrame

__all__ = ["DebugOption", "DebugUnderflowOverflow", "detect_overflow"]


class DebugOption(str, Enum):
    """transformers' ``DebugOption`` (the ``TrainingArguments(debug=...)`` values), equal to its members."""

    UNDERFLOW_OVERFLOW = "underflow_overflow"
    TPU_METRICS_DEBUG = "tpu_metrics_debug"

_DETECTED = (
    "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
    "Please scroll up above this traceback to see the activation values prior to this event."
)


class DebugUnderflowOverflow:
    """transformers' ``DebugUnderflowOverflow``, same arguments and output, one host sync per batch.

    Args:
        model (nn.Module): the model to debug.
        max_frames_to_save (int, optional): how many frames back to print on detection. Defaults to 21;
            None keeps every frame since the last detection, as transformers' unbounded deque does (memory
            then grows with the run).
        trace_batch_nums (list[int], optional): batches whose every frame is printed (detection is off
            for them).
        abort_after_batch_num (int, optional): raise ``ValueError`` once this batch has finished.
    """

    def __init__(
        self,
        model: nn.Module,
        max_frames_to_save: int | None = 21,
        trace_batch_nums: list[int] | None = None,
        abort_after_batch_num: int | None = None,
    ) -> None:
        self.model = model
        self.max_frames_to_save = max_frames_to_save
        self.trace_batch_nums = list(trace_batch_nums or [])
        self.abort_after_batch_num = abort_after_batch_num
        frames = sys.maxsize if max_frames_to_save is None else max_frames_to_save
        # the monitor with transformers' step boundary (the root's forward) and transformers' printing
        self._engine = NumericsMonitor(model, grads="none", max_frames=frames, _hf=True,
                                       _steps=functools.partial(_HFSteps, self))

    @property
    def batch_number(self) -> int:
        """Batches finished so far (transformers' counter)."""
        return self._engine.step_index

    def remove(self) -> None:
        """Remove every hook (transformers' class cannot be removed)."""
        self._engine.close()

    def __enter__(self) -> DebugUnderflowOverflow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _HFSteps(Steps):
    """The monitor's steps as transformers counts and prints them: a batch is one call of the root module."""

    def __init__(self, owner: DebugUnderflowOverflow, **parts: Any) -> None:
        super().__init__(**parts)
        self._owner = owner

    def _tag(self, text: str) -> str:
        if self.rank is None:
            return text
        return "\n".join(f"[rank{self.rank}] {line}" for line in text.split("\n"))

    def _print(self, text: str) -> None:
        print(self._tag(text))

    def _overflow_messages(self, frame: ResolvedFrame) -> None:
        """transformers prints "<slot> has nans" and/or "<slot> has infs" while it measures a frame."""
        for line in frame.lines:
            if line.finite or not line.judged:  # transformers checks only what it sees
                continue
            has_nan = math.isnan(line.abs_max) or bool(line.has_nan)
            if has_nan:
                self._print(f"{line.label} has nans")
            if not has_nan or line.has_inf:
                self._print(f"{line.label} has infs")

    def _hf_frame(self, frame: ResolvedFrame) -> str:
        lines = format_frame(frame, phase=False)
        if frame.first_of_step:
            start = f"\n\n{PREFIX} *** Starting batch number={frame.step} ***\n{hf_header()}"
            lines.insert(0, start)
        return "\n".join(lines)

    def close_step(self, source: str, abort_check: bool = True, advance: bool = True) -> None:
        """A batch ended (``source="loose"``: a submodule called on its own ended, and the batch number
        stays, as in transformers, whose counter moves only at the root module)."""
        owner = self._owner
        batch = self.index
        advance = source != "loose"
        if not self.recorder.rec.frames:
            return
        if batch in owner.trace_batch_nums:
            # transformers prints each frame as it completes; detection is off in a traced batch
            for frame in resolved([self.recorder.rec]):
                self._overflow_messages(frame)
                self._print(self._hf_frame(frame))
            self.history.clear()  # transformers starts its frame buffer afresh after a traced batch
            self.rotate(advance, keep=False)
        else:
            flag = self.recorder.rec.activation_flag()
            ok = True if flag is None else bool(flag.item())  # the one host sync
            if not ok:
                self._dump(batch, root_ran=advance)
                raise ValueError(_DETECTED)
            self.rotate(advance)
        if not advance:
            return
        if owner.abort_after_batch_num is not None and self.index > owner.abort_after_batch_num:
            raise ValueError(
                f"DebugUnderflowOverflow: aborting after {self.index} batches due to"
                f" `abort_after_batch_num={owner.abort_after_batch_num}` arg"
            )

    def root_forward_failed(self) -> None:
        """transformers raises its ValueError from the first bad module's hook, before the forward can
        fail on its own; here the forward's own exception propagates (torch silences ours), so print
        the same report before it."""
        flag = self.recorder.rec.activation_flag()
        if flag is not None and not bool(flag.item()):
            self._dump(self.index, root_ran=False)
        # else: keep the frames, as transformers keeps them in its buffer

    def _dump(self, batch: int, root_ran: bool = True) -> None:
        frames, _ = self.history.frames_with(self.recorder.rec)  # earlier batches are all finite: search from the start
        report = build_report(frames, self.max_frames, self.rank)
        assert report is not None and report.first is not None
        index = frames.index(report.frames[-1])
        shown = list(deque(frames[: index + 1], maxlen=self.max_frames))
        # transformers counts the batch when the root module's hook runs, before it checks the frame
        number = batch + 1 if root_ran and index == len(frames) - 1 else batch
        self._overflow_messages(frames[index])
        self._print(f"\nDetected inf/nan during batch_number={number}")
        self._print(f"Last {len(shown)} forward frames:")
        self._print(hf_header())
        self._print("\n".join(self._hf_frame(f) for f in shown))
        self._print("\n\n")
        self._print(f"torchdoctor diagnosis: {report.diagnosis}")
        if report.fix:
            self._print(f"torchdoctor fix: {report.fix}")
        self.reporter.report = report
        # transformers' counter moved only if the root's hook ran; otherwise the same batch goes on
        self.after_detection(advance=root_ran, continued=not root_ran)

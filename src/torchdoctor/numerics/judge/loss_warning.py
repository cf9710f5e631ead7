"""A loss that is inf while every gradient of its step is finite: a warning, not a stop.

The update such a step applies is finite, so stopping the run would throw away a healthy run over a number
that only the logs show (the HF Trainer's default ``logging_nan_inf_filter=True`` even hides it from them). Yet
the loss is wrong, and a silent inf loss is how a bad target or an overflowing loss term goes unnoticed: a
squared error of a target beyond ``sqrt(dtype max)`` is inf while its gradient is finite, and so is a loss term
no parameter depends on. So the monitor reports it as a *warning* (:data:`.causes.NONFINITE_LOSS`): the report is
written to disk, a :class:`~.errors.NonFiniteWarning` names its path, and the report is kept in the monitor's
``warnings`` list; the run goes on.

The monitor sees the loss where it is a judged value: the model's own loss output -- ``loss`` in a dict, a
``ModelOutput`` or a dataclass (a transformers model given ``labels``, as the HF Trainer calls it), or the model's
only or first output when that is a scalar (``return loss``, ``(loss,)``, ``(loss, logits)``) -- the output of a
module the model computes it with (``self.criterion``), or a ``mark()`` after the model's forward. Every other
judged value of the step must be finite, and the gradients must have been checked (``grads`` other than
``"none"``, a backward ran) and found finite. The values decide, not the rule that explains them: an inf loss in
fp32 with no value near the limit (a "range overflow"), in an fp16-autocast step, or of any micro-batch is the
same warning.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from ..explain.causes import LOSS_LABELS, is_model_loss
from ..explain.render import who
from ..explain.report import NonFiniteReport
from ..record.frames import BWD, FWD, MARK, ResolvedFrame

_LOOPS = ("transformers", "accelerate", "deepspeed")  # training loops whose callers are the user's line
_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(torch.__file__)))
__all__ = ["LOSS_LABELS", "as_warning", "loss_name", "only_the_loss", "user_stacklevel"]


def _loss_refs(frames: list[ResolvedFrame], start: int) -> set:
    """The values the model returned under the name ``loss`` in the step: a module that computed that very tensor
    (a loss module of the user's, ``return {"loss": self.criterion(logits, labels)}``) made the loss. (An unnamed
    scalar output counts only where the model's own code or one of torch's loss modules made it: the last Linear
    of a model given a batch of one returns a scalar too.)"""
    return {ln.ref for f in frames[start:] if f.phase == FWD and f.root for ln in f.lines
            if ln.ref is not None and ln.label in LOSS_LABELS}


def _loss_lines_only(frames: list[ResolvedFrame], start: int) -> bool:
    """Is every judged non-finite value of the step (``frames[start:]``) an inf loss: the model's own loss output
    (``loss``, or its only / first output when that is a scalar: :func:`.causes.is_model_loss`), the output of a
    module that computed it or of one of torch's loss modules (``nn.MSELoss``...) the model runs, or a mark made
    after a call of the model? It is the values that decide, whichever rule explains them. (A nan loss still stops
    the run: a nan is an invalid computation -- a mean over no label, 0/0 -- even where its gradients come out
    finite.)"""
    refs = None
    seen_root = False
    bad = False
    for f in frames[start:]:
        for ln in f.lines:
            if ln.finite or not ln.judged:
                continue
            if f.phase == BWD or math.isnan(ln.abs_max):
                return False
            if f.phase == MARK:
                loss = seen_root
            elif f.root:
                loss = is_model_loss(f, ln)
            else:
                if refs is None:
                    refs = _loss_refs(frames, start)
                loss = ln.label.startswith("output") and not ln.param and (ln.ref in refs or f.loss_module)
            if not loss:
                return False
            bad = True
        seen_root = seen_root or (f.phase == FWD and f.root)
    return bad


def only_the_loss(report: NonFiniteReport, frames: list[ResolvedFrame], start: int) -> bool:
    """The report's first bad value is a loss the monitor can see, and no other judged value of the step is
    non-finite. (Whether the gradients are finite is the monitor's to check: they are not in ``frames``.)"""
    first = report.first
    if first is None or first.phase == BWD:
        return False
    return _loss_lines_only(frames, start)


def as_warning(report: NonFiniteReport, cause: str) -> None:
    """Turn the report of a step whose only non-finite value is its loss, with finite gradients, into the warning."""
    value = report.first.value
    rest = report.diagnosis
    report.diagnosis = (
        f"the loss is {value} while every gradient of this step is finite, so the update was applied and the run "
        f"goes on; the loss you log reads {value} (the HF Trainer's logging_nan_inf_filter, on by default, leaves "
        "it out of its logs). A loss term whose value overflows while its derivative stays finite (the squared "
        "error of a huge target, a sum that overflows its dtype) or that no parameter depends on does this. In this "
        f"step, {rest}"  # (as the rule wrote it: a module's name is not capitalised)
    )
    report.cause = cause
    report.severity = "warn"
    report.fp32_region = None
    report.notes.append("The monitor did not stop the run: this report is kept in monitor.warnings.")


def loss_name(report: NonFiniteReport) -> str:
    """``the value marked 'loss'`` / ``BertForSequenceClassification (the model)'s output[loss]``."""
    first = report.first
    if first.phase == MARK:
        return f"the value marked {first.module!r}"
    return f"{who(first.module, first.cls)}'s {first.slot}"


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line (``optimizer.step()``, ``mon.step()``,
    ``trainer.train()``), past this package's and torch's own frames."""
    ours = _OURS + tuple(os.path.dirname(os.path.abspath(m.__file__)) for name in _LOOPS
                         if (m := sys.modules.get(name)) is not None and getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level

"""Causes read in the backward: where a gradient went non-finite (a module's own backward, the backward of the code
between modules, the module that consumed the output), and what the step's dtypes allow it to be -- an fp16
gradient overflow, bf16's rounding, or (fp32 only) the derivative of an op at a point where it has none; nothing
is said of a forward the monitor did not see."""

from __future__ import annotations

import torch

from ..record.frames import Line, ResolvedFrame
from . import causes
from .causes import module_output_grads, narrow_range
from .consumers import code_between, consumer_of
from .diagnosis_types import Diagnosis, Evidence, Setup
from .forward_causes import low_precision_words
from .ranges import shown
from .render import who


def backward_cause(frames: list[ResolvedFrame], index: int, line: Line, what: str, setup: Setup) -> Diagnosis:
    frame = frames[index]
    fp16, bf16 = low_precision_words(frames, frame.step)
    fp16 = fp16 or narrow_range(line.dtype) or any(narrow_range(d) for d in setup.autocast_dtypes)
    bf16 = bf16 or line.dtype == torch.bfloat16 or torch.bfloat16 in setup.autocast_dtypes
    consumer = None if line.label.startswith("grad:") else consumer_of(frames, index)
    evidence = (Evidence.of(frame, line),)
    between = None if consumer is not None or line.label.startswith("grad:") else code_between(frames, index)
    seen = setup.forward_seen
    forward = "the forward was finite; " if seen else ""
    if between is not None:  # the gradient of a module's output, which no watched module took as its input
        parent, nxt = between
        where = (
            f"{forward}in the backward the gradient at the output of {who(frame.name, frame.cls)} "
            f"became {what}, and no watched module took that output as its input: plain code in the forward of "
            f"{who(parent.name, parent.cls)}, after it calls {frame.name}"
            + (f" and before {nxt.name}" if nxt is not None else "")
            + " (a torch function, an operator, a view passed on), used it, and that code's backward made the "
            f"{what}."
        )
        target = parent.name
    elif consumer is not None:
        where = (
            f"{forward}in the backward the gradient was finite at the output of "
            f"{who(consumer.name, consumer.cls)} and became {what} at its input "
            f"({frame.name + '.' if frame.name else ''}{line.label[5:]}): the blow-up starts in the backward of "
            f"{consumer.name or 'the model'}."
        )
        target = consumer.name
    else:
        own = module_output_grads(frames, frame.step, frame.name) if line.label.startswith("grad:") else []
        finite_in = [(f, ln) for f, ln in own if ln.finite and ln.abs_max is not None]
        if line.label.startswith("grad:"):
            where = f"the gradient of {f'{frame.name}.' if frame.name else ''}{line.label[5:]}"
        else:
            where = f"the gradient flowing into {who(frame.name, frame.cls)} from its {line.label[5:] or 'output'}"
        where = f"{forward}{where} became {what} in the backward."
        if finite_in:  # the gradient at the module's output was recorded, finite: its own backward made it
            f_in, ln_in = finite_in[-1]
            where += (f" The gradient at the output of {who(frame.name, frame.cls)} was finite ({ln_in.label} "
                      f"{shown(ln_in.abs_max)}), so {frame.name or 'the model'}'s own backward made it: the product "
                      "of that gradient and the module's input (the weight gradient's matmul) left the range.")
            evidence = (Evidence.of(f_in, ln_in), *evidence)
        target = frame.name
    keep = target or "the model"
    if not seen and not setup.autocast_dtypes and not fp16 and not bf16:
        return Diagnosis(
            causes.BACKWARD_NONFINITE,
            f"{where} The monitor did not see this step's forward (it attached after it began), so which dtype the "
            "step computed in, and whether its activations were finite, is not known: the report of the next bad "
            "step, seen from its start, says which.",
            target or None, evidence=evidence,
        )
    if fp16:
        scale = (" The loss scaler in use skips such a step and lowers its scale; if steps keep overflowing, the "
                 "values are too large for fp16 at any scale." if setup.scaler else
                 " A loss scale (torch.amp.GradScaler) would skip such steps and lower its scale: that helps only "
                 "while the gradients fit fp16 at some scale.")
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{where} In fp16 this is a gradient overflow: keep {keep} in fp32{'' if bf16 else ', or train in bf16'}."
            + scale,
            target or None, evidence=evidence,
        )
    if bf16:
        return Diagnosis(
            causes.BACKWARD_OVERFLOW,
            f"{where} The step computes in bf16, whose range is fp32's, so a loss scale will not help and neither "
            f"would fp32's range; bf16 keeps 8 bits of mantissa, so a difference of nearly equal values can round "
            f"to 0 before a division or a log: keep {keep} in fp32 to test that. If it stays {what} in fp32, it is "
            f"the derivative of an operation at a point where it has none ("
            + ("" if consumer is not None else f"{setup.option('grads', 'modules')} names the module, ")
            + "torch.autograd.set_detect_anomaly(True) names the op).",
            target or None, evidence=evidence,
        )
    named = consumer is not None or not line.label.startswith("grad:")  # a module's gradient, not a parameter's
    text = _FP32_BACKWARD.format(name=keep, option="torch.autograd.set_detect_anomaly(True) names the op" if named
                                 else f"{setup.option('grads', 'modules')} names the module, "
                                      "torch.autograd.set_detect_anomaly(True) the op")
    return Diagnosis(causes.BACKWARD_NONFINITE, f"{where} {text}", evidence=evidence)


_FP32_BACKWARD = (
    "Every value seen is fp32 or wider, with no autocast, so this is not a small dtype's overflow and more precision "
    "will not help: it is "
    "the derivative of an operation at a point where it has none inside {name}'s backward (sqrt or norm of 0, "
    "log or pow near 0, torch.where whose unselected branch is inf/nan, a division by a value that can be 0), or a "
    "gradient beyond fp32's range (a custom backward's huge factor). {option}."
)

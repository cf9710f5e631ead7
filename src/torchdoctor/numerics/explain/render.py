"""Text layout of frames: transformers' ``DebugUnderflowOverflow`` layout, optionally with a phase
column, so that people who know that report read ours without learning anything new::

    abs min  abs max  phase metadata
                      fwd   encoder.block.2.layer.1.DenseReluDense.wo Linear
    1.01e-06 6.44e+00 fwd   weight
    0.00e+00 9.74e+03 fwd   input[0]
    3.18e-04 6.27e+04 fwd   output
"""

from __future__ import annotations

from ..record.frames import Line, ResolvedFrame

PREFIX = " " * 17  # transformers' indentation of a frame header


def who(name: str, cls: str) -> str:
    """A module as the report's sentences name it: the root's qualified name is empty, so it is named by its
    class (the frame layout keeps transformers' empty name)."""
    return f"{name} ({cls})" if name else f"{cls} (the model)"


def hf_header() -> str:
    return f"{'abs min':8} {'abs max':8} metadata"


def format_line(line: Line) -> str:
    """One slot exactly as transformers prints it: ``f"{absmin:8.2e} {absmax:8.2e} {label}"``."""
    label = f"{line.label} ({line.scope})" if line.scope else line.label
    if line.abs_max is not None:
        return f"{line.abs_min:8.2e} {line.abs_max:8.2e} {label}"
    return f"{line.kind:>17} {label}"


def format_frame(frame: ResolvedFrame, phase: bool = True, marker: Line | None = None) -> list[str]:
    """Lines of one frame; with ``phase`` a phase column follows the numbers. ``marker`` flags a line."""
    col = f"{frame.phase:<5} " if phase else ""
    out = [f"{PREFIX} {col}{frame.name} {frame.cls}"]
    for line in frame.lines:
        text = format_line(line)
        if phase:
            text = text[:17] + " " + col + text[18:]
        if line is marker:
            text += "   <-- first non-finite value"
        out.append(text)
    return out


def frames_header() -> str:
    """The header of our layout: transformers' columns plus the phase."""
    return f"{'abs min':8} {'abs max':8} {'phase':5} metadata"


def format_frames(frames: list[ResolvedFrame], marker: Line | None = None) -> list[str]:
    """The frames under one header; when they span several steps, a ``*** step N ***`` line starts each step's
    frames (transformers' detector marks its batches the same way)."""
    out = [frames_header()]
    several = len({f.step for f in frames}) > 1
    step = None
    for f in frames:
        if several and f.step != step:
            out.append(f"*** step {f.step} ***")
            step = f.step
        out.extend(format_frame(f, phase=True, marker=marker))
    return out

"""What a diagnosis is made of, and the fix sentences every rule shares.

:class:`Evidence` (a frame line a diagnosis cites), :class:`Diagnosis` (one rule's verdict), :class:`Setup` (what
the monitor knows of the run beyond the frames, which the advice depends on), and the one way a ``keep_fp32`` fix is
written (:func:`keep_fp32_fix`: in addition to the guards already on, never as their replacement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..record.frames import Line, ResolvedFrame
from .ranges import dtype_name


@dataclass(frozen=True)
class Evidence:
    """One frame line a diagnosis cites: where it is (module, phase, slot) and the number and dtype it states."""

    module: str
    cls: str
    phase: str
    slot: str
    abs_max: float | None
    dtype: torch.dtype | None
    frame: ResolvedFrame | None = field(default=None, compare=False, repr=False)  # where it was read

    @classmethod
    def of(cls, frame: ResolvedFrame, line: Line) -> Evidence:
        return cls(frame.name, frame.cls, frame.phase, line.label, line.abs_max, line.dtype, frame)

    def to_json(self) -> dict:
        return {"module": self.module, "class": self.cls, "phase": self.phase, "slot": self.slot,
                "abs_max": self.abs_max if self.abs_max is None or math.isfinite(self.abs_max) else str(self.abs_max),
                "dtype": dtype_name(self.dtype) if self.dtype is not None else None}


@dataclass(frozen=True)
class Diagnosis:
    """One rule's verdict: its stable id (:data:`.causes.CAUSES`), the why, the module to keep in fp32 (when
    that is the fix), the fix itself when it is not ``keep_fp32``, and the frame lines the text cites."""

    cause: str
    text: str
    region: str | None = None
    fix: str | None = None
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class Setup:
    """What the monitor knows of the run that the advice depends on, beyond the frames.

    ``optimizer``: one was given (``NumericsMonitor(model, optimizer=opt)``). ``manual``: steps end at
    ``mon.step()`` (``manual_steps=True``, or ``mon.step()`` called), so the check runs there and not in front of
    the optimizer. ``before_update``: this step was checked before its update was applied (a hooked optimizer, or
    ``mon.step()`` called before ``optimizer.step()``), so the weights measured now are the ones its forward ran
    with; ``always_before``: every step so far was, so no update from non-finite gradients was ever applied.
    ``kept_fp32``: the modules a ``keep_fp32`` guard keeps in fp32 now (qualified names): a fix that adds a
    region adds it to those. ``via``: how the monitor was attached (``monitor``: ``NumericsMonitor(...)``; ``hf`` /
    ``lightning``: a ``NumericsCallback``; ``switch``: ``torchdoctor run --numerics``), so that advice to change an
    option is written in the form the user attached it with (:meth:`option`)."""

    optimizer: bool = False
    manual: bool = False
    before_update: bool = False
    always_before: bool = False
    kept_fp32: tuple[str, ...] = ()
    via: str = "monitor"
    # what the monitor saw of the step: its forward (a call of the model was recorded), the autocast that call ran
    # under ((device type, dtype) pairs; None: not seen), and whether a loss scaler is in play
    forward_seen: bool = True
    autocast: tuple[tuple[str, torch.dtype], ...] | None = None
    scaler: bool = False
    # the optimizer's own arithmetic cannot work in its parameters' dtype (Adam's eps=1e-8 is 0 in fp16): said as
    # seen on the optimizer, when it is so
    optimizer_note: str | None = None

    @property
    def autocast_dtypes(self) -> set[torch.dtype]:
        return {d for _, d in self.autocast or ()}

    def option(self, name: str, value: object) -> str:
        """The monitor's option ``name=value`` as the user sets it where they attached it."""
        if self.via == "switch":
            return f"torchdoctor run --numerics --{name.replace('_', '-')} {value}"
        if self.via in ("hf", "lightning"):
            return f"NumericsCallback({name}={value!r})"
        return f"NumericsMonitor(..., {name}={value!r})"

    @classmethod
    def hooked(cls, kept_fp32: tuple[str, ...] = ()) -> Setup:
        """An optimizer checked in front of its step (the default ``NumericsMonitor(model, optimizer=opt)``)."""
        return cls(True, False, True, True, kept_fp32)

    def region_of(self, name: str) -> str | None:
        """The module kept in fp32 that ``name`` is (or is inside), if any."""
        return next((k for k in self.kept_fp32 if not k or k == name or name.startswith(k + ".")), None)


def keep_fp32_fixes(regions: tuple[str, ...], kept: tuple[str, ...] = ()) -> str:
    """:func:`keep_fp32_fix` for one region or several together (``keep_fp32(model, '2')`` and
    ``keep_fp32(model, '3')``), in addition to the guards already on ``kept``."""
    if len(regions) == 1:
        return keep_fp32_fix(regions[0], kept)
    calls = " and ".join(f"torchdoctor.keep_fp32(model, {r!r})" for r in regions)
    others = [k for k in kept if k not in regions]
    if others:
        named = ", ".join(repr(k) for k in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        guards = "that guard" if len(others) == 1 else "those guards"
        calls += f", in addition to the keep_fp32 already on {named} (leave {guards} on)"
    return calls


def keep_fp32_fix(region: str, kept: tuple[str, ...] = (), why: str = "") -> str:
    """``torchdoctor.keep_fp32(model, region)``, said to be in addition to the guards already on ``kept`` (a
    second call of keep_fp32 works beside the first, as written; read as a replacement it would undo what the first
    one fixed). ``why``: the reason a guard must stay, when one is known."""
    fix = f"torchdoctor.keep_fp32(model, {region!r})"
    others = [k for k in kept if k != region]
    if others:
        named = ", ".join(repr(k) for k in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        guards = "that guard" if len(others) == 1 else "those guards"
        fix += f", in addition to the keep_fp32 already on {named} (leave {guards} on{': ' + why if why else ''})"
    return fix


def common_region(a: str, b: str) -> str:
    """The innermost module that contains both qualified names ('' is the root)."""
    pa, pb = a.split("."), b.split(".")
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)

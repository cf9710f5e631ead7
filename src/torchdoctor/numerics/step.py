"""What one step records: host-side frames, their on-device statistics, and the step's own bookkeeping.

A :class:`StepRecord` is the unit the monitor checks with one host read. The training step owns one;
an evaluation forward between training steps gets a record of its own (checked at its end), and so
does the eager re-run that localizes a non-finite value inside a compiled region. Swapping the
current record is all it takes to keep those apart.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .frames import Frame, Slot, measure
from .stats import StatBuffer, all_finite, has_inf


@dataclass(eq=False)
class StepRecord:
    frames: list[Frame] = field(default_factory=list)
    buffer: StatBuffer = field(default_factory=StatBuffer)
    # id(tensor) -> (weakref, version, slot): a module output passed on as the next input is measured once
    seen: dict[int, tuple[weakref.ref, int, Slot]] = field(default_factory=dict)
    # id(output tensor) -> (weakref, [(module info, label, source ref)]): module-level gradient hooks
    grad_targets: dict[int, tuple[weakref.ref, list]] = field(default_factory=dict)
    backward_ran: bool = False
    backward_grad_flags: list[torch.Tensor] = field(default_factory=list)  # gradients when a backward ended
    backward_grads: list[tuple[torch.Tensor, weakref.ref]] = field(default_factory=list)  # ... which ones
    queued_task: int | None = None  # the backward whose end-of-backward callback is queued
    root_calls: list = field(default_factory=list)  # the model's calls, kept for an eager re-run (compiled models)
    continued: bool = False  # compat: the same batch goes on (a submodule called on its own ended a record)
    weights: StatBuffer | None = None  # the weights of the frames kept as context, measured as the step ended

    @property
    def empty(self) -> bool:
        return not self.frames and not self.backward_ran

    def slot(self, label: str, value: Any, judged: bool = True, hf: bool = False, param: bool = False) -> Slot:
        """Measure ``value`` once: an output passed on as the next module's input is not measured again."""
        if param:
            return measure(self.buffer, label, value, judged, param=True)
        if isinstance(value, torch.Tensor) and not value.is_inference():  # no version counter there
            key = id(value)
            seen = self.seen.get(key)
            if seen is not None and seen[0]() is value and seen[1] == value._version:
                s = seen[2]
                if s.ref is None or s.ref.judged or not judged:
                    return Slot(label, s.ref, s.kind, s.dtype, s.inf_ref, s.scope, s.param, judged, s.nan_ref)
            slot = self._measure(label, value, judged, hf)
            self.seen[key] = (weakref.ref(value), value._version, slot)
            return slot
        return self._measure(label, value, judged, hf)

    def _measure(self, label: str, value: Any, judged: bool, hf: bool) -> Slot:
        slot = measure(self.buffer, label, value, judged)
        if hf and slot.ref is not None and (value.dtype.is_floating_point or value.dtype.is_complex):
            # transformers prints "has infs" next to "has nans" for a tensor holding both; abs max
            # cannot tell, so compat mode pays one more reduction per tensor to know
            slot.inf_ref = self.buffer.add_flag(has_inf(value))
            if value.dtype.is_complex:  # |inf + nan j| is inf: the nan needs its own flag
                slot.nan_ref = self.buffer.add_flag(torch.isnan(value.detach()).any())
        return slot

    def keep_for_context(self, max_frames: int) -> None:
        """The step is over: keep only the frames a later report can show (its last ``max_frames``) and
        measure their modules' weights now, before the optimizer changes them, on the device (no sync).
        Their parameter gradients are not kept: by the next report they are another step's."""
        self.frames = self.frames[-max_frames:] if max_frames else []
        self.seen.clear()
        self.grad_targets.clear()
        measured: dict[int, list[Slot]] = {}
        per_param: dict[int, Slot] = {}  # a weight shared by modules (a tied LM head) is measured once

        def weight_slot(name: str, p: torch.Tensor) -> Slot:
            slot = per_param.get(id(p))
            if slot is None:
                if self.weights is None:
                    self.weights = StatBuffer()
                slot = per_param[id(p)] = measure(self.weights, name, p, param=True)
            return slot if slot.label == name else replace(slot, label=name)

        for f in self.frames:
            f.with_param_grads = False
            module = f.info.module() if f.with_params else None
            if module is None:
                continue
            slots = measured.get(id(module))
            if slots is None:
                slots = measured[id(module)] = [weight_slot(n, p) for n, p in module.named_parameters(recurse=False)]
            f.weights = slots

    def activation_flag(self) -> torch.Tensor | None:
        """One on-device "all judged statistics finite" flag (None when nothing was measured)."""
        return all_finite(self.buffer.finite_flags())

    def stored_grad_flags(self) -> list[torch.Tensor]:
        """Flags taken when backwards ended, unless those very gradients are still there (then the
        check at the step's end sees them as they are now, repaired or accumulated further)."""
        if all(p.grad is not None and p.grad is ref() for p, ref in self.backward_grads):
            return []
        return self.backward_grad_flags

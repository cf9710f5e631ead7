"""What one step records: host-side frames, their on-device statistics, and the step's own bookkeeping.

A :class:`StepRecord` is the unit the monitor checks with one host read. The training step owns one;
an evaluation forward between training steps gets a record of its own (checked at its end), and so
does the eager re-run that localizes a non-finite value inside a compiled region. Swapping the
current record is all it takes to keep those apart.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..measure.slots import (
    INPUT_LABELS,
    NOT_A_TENSOR,
    OUTPUT_LABELS,
    is_container,
    labelled_arg,
    labelled_inputs,
    labelled_item,
    labelled_outputs,
)
from ..measure.stats import all_finite, has_inf
from ..measure.windows import WINDOW_ELEMENTS, StatBuffer, fits_window
from .frames import ENTRY, INF_REF, KEY, LABEL, Frame, Slot, make_slot, measure, relabelled, slot_ref

_STRIDED = torch.strided
_SCALARS = (bool, int, float, str)  # leaves of a call besides tensors and None (slots.labelled_inputs)
CALLS_WAITING = 128  # forward calls labelled together (StepRecord.settle); also bounded by WINDOW_ELEMENTS
_NONE_SLOTS: dict[bool, dict[str, Slot]] = {True: {}, False: {}}  # label -> Slot: shared, never changed
_OTHER_SLOTS: dict[bool, dict[str, Slot]] = {True: {}, False: {}}


def _versioned(values: Any, versions: dict[int, int]) -> int | None:
    """Note the version of each tensor among ``values`` (a call's arguments, keyword values or output tuple) in
    ``versions``; their elements, or None when the call must be labelled now: one of the values is a container (its
    tensors are not noted) or a tensor no window takes (an integer tensor, one too large, a Parameter, a subclass,
    a sparse tensor: measured at once, it must be measured before anything can change it)."""
    n = 0
    for a in values:
        if isinstance(a, torch.Tensor):
            m = a.numel()
            if m and not fits_window(a):  # (a Parameter, a subclass, an integer or large tensor: measured at once)
                return None
            versions[id(a)] = a._version
            n += m
        elif a is not None and not isinstance(a, _SCALARS) and is_container(a):
            return None
    return n


def _fixed_slot(label: str, kind: str, judged: bool) -> Slot:
    """The one Slot of ``label`` holding a None (or a non-tensor): made once, shared by every frame."""
    cache = (_NONE_SLOTS if kind == "None" else _OTHER_SLOTS)[judged]
    if len(cache) > 4096:  # labels are few (input[i], output[name]); bound it anyway
        cache.clear()
    slot = cache[label] = make_slot(label, kind=kind, judged=judged)
    return slot


@dataclass(eq=False)
class StepRecord:
    frames: list[Frame] = field(default_factory=list)
    buffer: StatBuffer = field(default_factory=StatBuffer)
    # id(tensor) -> (weakref, version, slot): a module output passed on as the next input is measured once
    seen: dict[int, tuple[weakref.ref, int, Slot]] = field(default_factory=dict)
    # id(output tensor) -> (weakref, [(module info, label, source ref)]): module-level gradient hooks
    grad_targets: dict[int, tuple[weakref.ref, list, int]] = field(default_factory=dict)  # (..., its version)
    backward_ran: bool = False
    backward_grad_flags: list[torch.Tensor] = field(default_factory=list)  # gradients when a backward ended
    backward_grads: list[tuple[torch.Tensor, weakref.ref]] = field(default_factory=list)  # ... which ones
    queued_task: int | None = None  # the backward whose end-of-backward callback is queued
    root_calls: list = field(default_factory=list)  # the model's calls, kept for a replay (calls.RootCall)
    continued: bool = False  # compat: the same batch goes on (a submodule called on its own ended a record)
    live: bool = True  # every module's call recorded as it ran (else only the model's own: replayed if it goes bad)
    module_grads: bool = False  # live, and the gradient at every module's output recorded too
    weights: StatBuffer | None = None  # the weights of the frames kept as context, measured as the step ended
    # forward calls waiting to be labelled and measured (settle()): (frame, args, kwargs, output, versions)
    calls: list[tuple] = field(default_factory=list)
    call_elements: int = 0  # elements of the tensors those calls hold
    # module-level gradient targets whose forward output was still waiting: (id, weakref, targets, index)
    unsourced: list[tuple] = field(default_factory=list)
    thread: int = field(default_factory=threading.get_ident)  # calls wait only in the thread that made the record

    @property
    def empty(self) -> bool:
        return not self.frames and not self.backward_ran

    def slot(self, label: str, value: Any, judged: bool = True, hf: bool = False, param: bool = False,
             at_once: bool = False) -> Slot:
        """Measure ``value`` once: an output passed on as the next module's input is not measured again.

        The hot path of every hooked module (several calls per module and step): a plain dense tensor, a
        ``None`` and a non-tensor each take the shortest way; anything else goes through :func:`~.frames.measure`.
        """
        if value is None:
            return _NONE_SLOTS[judged].get(label) or _fixed_slot(label, "None", judged)
        if not isinstance(value, torch.Tensor):
            return _OTHER_SLOTS[judged].get(label) or _fixed_slot(label, NOT_A_TENSOR, judged)
        if param:  # gathered for this forward only (ZeRO-3 frees it after): reduced now, never in a window
            return measure(self.buffer, label, value, judged, param=True, at_once=True)
        return self._tensor_slot(label, value, judged, hf, at_once)

    def defer(self, frame: Frame, args: tuple, kwargs: dict | None, output: Any) -> bool:
        """Keep one forward call to be labelled and measured with the calls around it (:meth:`settle`), with the
        version of each of its tensors now, so that a change in place before then still shows. False when it is to
        be measured now: it holds a container (a list, dict, ModelOutput: only top-level values are versioned
        here), a tensor no window takes (measured at once, so before the code after the call can change it), an
        inference tensor (no version counter), or it runs in another thread than the record's (a queue shared by
        threads could lose a call between two settles). Only values a window takes wait, so the window's version
        check covers every in-place change between the hook and the reduction.

        The hook itself then costs a few attribute reads per tensor; the labelling runs later, many calls in one
        loop, where the interpreter's caches are warm (issue 12: 0.02-0.05x less on the tiny T5 step of
        BENCHMARKS.md, in-process A/B, than labelling each call in its hook, between the model's own ops)."""
        if threading.get_ident() != self.thread:
            return False  # a forward in another thread (nn.DataParallel's replicas): its own values, measured now
        versions: dict[int, int] = {}
        try:
            n = _versioned(args, versions)
            if n is not None and kwargs:
                more = _versioned(kwargs.values(), versions)
                n = None if more is None else n + more
            if n is None:
                return False
            if isinstance(output, torch.Tensor) or (type(output) is tuple and len(output) <= 8):
                # (a tuple as call_slots takes it, each value versioned)
                more = _versioned((output,) if isinstance(output, torch.Tensor) else output, versions)
                if more is None:
                    return False
                n += more
            elif output is not None and not isinstance(output, _SCALARS) and is_container(output):
                return False
        except Exception:  # an inference tensor (no version counter), a wrapper that has none: measured now
            return False
        self.calls.append((frame, args, kwargs, output, versions))
        self.call_elements += n
        if len(self.calls) >= CALLS_WAITING or self.call_elements >= WINDOW_ELEMENTS:
            self.settle()
        return True

    def settle(self) -> None:
        """Label and measure the calls waiting (:meth:`defer`), in the order they ran: before anything reads
        this record's frames or statistics, and before a call measured at once (so that an output passed on as an
        input is still measured once)."""
        calls = self.calls
        if not calls:
            return
        self.calls = []
        self.call_elements = 0
        call_slots = self.call_slots
        for frame, args, kwargs, output, versions in calls:
            frame.slots = call_slots(args, kwargs, output, False, versions)
        if self.unsourced:
            for key, ref, targets, i in self.unsourced:
                seen = self.seen.get(key)
                if seen is not None and seen[0]() is ref() and seen[2][KEY] is not None:
                    info, label, _ = targets[i]
                    targets[i] = (info, label, slot_ref(seen[2]))
            self.unsourced.clear()

    def call_slots(self, args: tuple, kwargs: dict | None, output: Any, at_once: bool,
                   versions: dict[int, int] | None = None) -> list[Slot]:
        """Every slot of one forward call (inputs as context, outputs judged), as :func:`~.slots.labelled_inputs`
        and :func:`~.slots.labelled_outputs` label them, with the common values (tensors, None) handled inline:
        this runs once per hooked module and call. ``versions``: each tensor's version when the call ran (a
        call that waited), else read now."""
        out: list[Slot] = []
        append = out.append
        tensor_slot = self._tensor_slot
        for i, a in enumerate(args):
            label = INPUT_LABELS[i] if i < 8 else f"input[{i}]"
            if isinstance(a, torch.Tensor):
                append(tensor_slot(label, a, False, False, at_once, versions))
            elif a is None:
                append(_NONE_SLOTS[False].get(label) or _fixed_slot(label, "None", False))
            else:  # a scalar, a container (walked as labelled_inputs walks it)
                out += [self.slot(lb, v, False, False, False, at_once) for lb, v in labelled_arg(label, a)]
        if kwargs:
            for lb, v in labelled_inputs((), kwargs):
                append(tensor_slot(lb, v, False, False, at_once, versions) if isinstance(v, torch.Tensor)
                       else self.slot(lb, v, False, False, False, at_once))
        if isinstance(output, torch.Tensor):
            append(tensor_slot("output", output, True, False, at_once, versions))
        elif type(output) is tuple and len(output) <= 8:  # (a T5 block: hidden states, position bias, None...)
            for label, o in zip(OUTPUT_LABELS, output):
                if isinstance(o, torch.Tensor):
                    append(tensor_slot(label, o, True, False, at_once, versions))
                elif o is None:
                    append(_NONE_SLOTS[True].get(label) or _fixed_slot(label, "None", True))
                else:
                    out += [self.slot(lb, v, True, False, False, at_once) for lb, v in labelled_item(label, o, 1)]
        else:
            out += [self.slot(lb, v, True, False, False, at_once) for lb, v in labelled_outputs(output)]
        return out

    def _tensor_slot(self, label: str, value: torch.Tensor, judged: bool, hf: bool, at_once: bool,
                     versions: dict[int, int] | None = None) -> Slot:
        key = id(value)
        version = versions.get(key) if versions is not None else None
        if version is None:
            try:
                version = value._version
            except RuntimeError:  # an inference tensor: no version counter, so never "the same as before"
                return self._measure(label, value, judged, hf, at_once)
        seen = self.seen.get(key)
        if seen is not None and seen[1] == version and seen[0]() is value:
            s = seen[2]
            group = s[KEY]
            if group is None or group[0] or not judged:  # (group[0]: its group is judged)
                return relabelled(s, label, judged)
        ref = None
        if not hf and type(value) is torch.Tensor and value.layout is _STRIDED:
            # the common case, checked once: a window takes it (never an empty, meta or quantized tensor), or it is
            # a plain tensor reduced at once
            ref = None if at_once else self.buffer.wait(value, judged, version)
            if ref is None and value.numel() and not value.is_meta and not value.is_quantized:
                ref = self.buffer.add(value, judged, True)
        if ref is not None:
            slot = (label, *ref, None, value.dtype, None, None, False, judged, None)
        else:
            slot = self._measure(label, value, judged, hf, at_once)
        self.seen[key] = (weakref.ref(value), version, slot)
        return slot

    def _measure(self, label: str, value: Any, judged: bool, hf: bool, at_once: bool = False) -> Slot:
        # compat mode measures at once: transformers reads each value as its module returns it, and parity with
        # it (a later in-place change must not show) is that surface's point
        slot = measure(self.buffer, label, value, judged, at_once=at_once or hf)
        if hf and slot[KEY] is not None and (value.dtype.is_floating_point or value.dtype.is_complex):
            # transformers prints "has infs" next to "has nans" for a tensor holding both; abs max
            # cannot tell, so compat mode pays one more reduction per tensor to know
            inf_ref = self.buffer.add_flag(has_inf(value))
            nan_ref = None
            if value.dtype.is_complex:  # |inf + nan j| is inf: the nan needs its own flag
                nan_ref = self.buffer.add_flag(torch.isnan(value.detach()).any())
            slot = (*slot[:INF_REF], inf_ref, *slot[INF_REF + 1:-1], nan_ref)
        return slot

    def keep_for_context(self, max_frames: int) -> None:
        """The step is over: keep only the frames a later report can show (its last ``max_frames``) and
        measure their modules' weights now, before the optimizer changes them, on the device (no sync).
        Their parameter gradients are not kept: by the next report they are another step's."""
        self.settle()
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
            return slot if slot[LABEL] == name else relabelled(slot, name)

        for f in self.frames:
            f.with_param_grads = False
            module = f.info.module() if f.with_params else None
            if module is None:
                continue
            slots = measured.get(id(module))
            if slots is None:
                slots = measured[id(module)] = [weight_slot(n, p) for n, p in module._parameters.items()
                                                if p is not None]
            f.weights = slots
        if self.weights is not None:
            self.weights.flush()  # now: the optimizer's update changes these weights in place

    def measure_changed_at_once(self) -> None:
        """Outputs changed in place before their window was reduced (``ReLU(inplace=True)`` after a BatchNorm,
        ``x += residual``): their modules are measured at once from now on (this step's lines say so)."""
        changed = self.buffer.changed
        for f in self.frames:
            if not f.info.at_once and any(s[KEY] is not None and s[KEY:ENTRY + 1] in changed
                                          and s[LABEL].startswith("output") for s in f.slots):
                f.info.at_once = True

    def activation_flag(self) -> torch.Tensor | None:
        """One on-device "all judged statistics finite" flag (None when nothing was measured)."""
        self.settle()
        flags = self.buffer.finite_flags()
        if self.buffer.changed:
            self.measure_changed_at_once()
        return all_finite(flags)

    def stored_grad_flags(self) -> list[torch.Tensor]:
        """Flags taken when backwards ended, unless those very gradients are still there (then the
        check at the step's end sees them as they are now, repaired or accumulated further)."""
        if all(p.grad is not None and p.grad is ref() for p, ref in self.backward_grads):
            return []
        return self.backward_grad_flags

"""NumericsMonitor: the first inf/nan in forward and backward, at one host sync per step.

Example usage::

    from torchdoctor import NumericsMonitor, NonFiniteError

    with NumericsMonitor(model, optimizer=opt) as mon:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            opt.step()        # the step is checked here, before the update is applied
            opt.zero_grad()

How it stays cheap: every module's forward hook reduces its inputs and outputs to (abs min, abs max)
on their own device (:mod:`.stats`) and keeps only a host-side description of the call
(:mod:`.frames`). A tensor that was just measured as one module's output and comes in as the next
module's input is measured once. Parameters and their gradients do not change before
``optimizer.step()``, so they are measured only when a report is built; the parameter gradients are
checked once per step with one ``aminmax`` each (no temporary). At the step boundary everything is
folded into a single on-device flag read with one ``.item()``.

Module *inputs* are shown as context but do not by themselves stop a run (an additive ``-inf``
attention mask is a legitimate input); outputs, gradients, weights and marks do. After a
``NonFiniteError`` the monitor stops checking: close it and attach a new one to keep watching.

Step boundaries, in order of preference: an optimizer step pre-hook (``optimizer=``; a non-finite
update is never applied), ``scaler.update()`` of a loss scaler passed as ``scaler=`` (a step the
scaler skipped), an explicit :meth:`NumericsMonitor.step`, or else the end of each forward of the root
module. Steps are numbered from 0, like transformers' batch numbers.

Known limitations:
  - A loss scaler that is not passed as ``scaler=`` is recognised by its effect: a new forward starts
    after a backward while every gradient is None (``zero_grad()`` without an optimizer step). With
    ``zero_grad(set_to_none=False)`` such skipped steps are merged into the next step.
  - Parameters shown in frames of an earlier step are measured as they are now.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import sys
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch import nn

from .errors import AbortAfterStep, NonFiniteError
from .frames import BWD, FWD, MARK, Frame, ModuleInfo, ResolvedFrame, Slot, measure, measure_now, resolve
from .options import check_options
from .report import FirstNonFinite, NonFiniteReport, build_report, find_first_bad
from .slots import input_slots, output_slots
from .stats import StatBuffer, all_finite, finite_flags_of, fused_check_works, has_inf
from .trace import TraceWriter
from .wrappers import unwrap_model

log = logging.getLogger("torchdoctor.numerics")

# Every monitored module, whichever monitor watches it: attaching twice would double every hook.
_WATCHED: weakref.WeakKeyDictionary[nn.Module, NumericsMonitor] = weakref.WeakKeyDictionary()


@dataclass
class OverflowEvent:
    """A step whose gradients overflowed and that a loss scaler skipped (the scaler's normal signal)."""

    step: int
    scale: float | None
    module: str | None
    slot: str | None


@dataclass
class _Step:
    """What one step recorded: host-side frames plus their on-device statistics."""

    frames: list[Frame]
    buffer: StatBuffer


def _dist_rank_world() -> tuple[int | None, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None, 1


class NumericsMonitor:
    """Watch a model for inf/nan in weights, activations and gradients; explain the first one.

    Args:
        model (nn.Module): the model (DDP / DataParallel wrappers are looked through).
        optimizer (torch.optim.Optimizer, optional): checked in a step pre-hook, so a step with a
            non-finite value raises before any parameter or optimizer state changes. Without it the
            gradients are checked when each backward ends, but the update cannot be stopped.
        grads (str): ``"params"`` (default) checks every parameter gradient once per step (one
            ``aminmax`` each, on device); ``"modules"`` also measures the gradient at every module
            output, which names the module where a backward blow-up starts; ``"none"`` watches the
            forward only.
        scaler (optional): a loss scaler (``torch.amp.GradScaler`` or anything with ``get_scale()``
            and ``update()``). Its overflows are recorded in :attr:`overflows`, not raised, unless the
            scale falls below ``min_loss_scale`` or ``max_consecutive_overflows`` steps overflow in a row.
        max_frames (int): frames shown before the first bad one. Defaults to 21.
        trace_steps (Iterable[int], optional): steps whose every frame is printed and written to
            ``torchdoctor-trace-rank<r>.jsonl``.
        abort_after_step (int, optional): raise :class:`AbortAfterStep` once step N has finished.
        report_dir (str): where ``torchdoctor-nonfinite-rank<r>.txt`` / ``.json`` are written.
        auto_localize (bool): after a gradient overflow seen at ``"params"`` level, switch to
            ``"modules"`` so the next one is localized. Defaults to True.
        sync_ranks (bool, optional): under torch.distributed, share the step's verdict with one tiny
            all_reduce so that every rank stops together (default: when initialized with >1 rank).
        manual_steps (bool): steps end only at :meth:`step`, from the very first one (otherwise that
            is known only once step() is first called; say so when a step has several forwards).
        stream (TextIO, optional): where traces are printed. Defaults to sys.stdout.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        grads: str = "params",
        scaler: Any = None,
        max_frames: int = 21,
        trace_steps: Iterable[int] | None = None,
        abort_after_step: int | None = None,
        report_dir: str | os.PathLike = ".",
        auto_localize: bool = True,
        min_loss_scale: float = 1.0,
        max_consecutive_overflows: int = 30,
        sync_ranks: bool | None = None,
        manual_steps: bool = False,
        stream: TextIO | None = None,
        _hf: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NumericsMonitor needs an nn.Module, got {type(model).__name__}")
        traced = check_options(
            grads=grads, max_frames=max_frames, trace_steps=trace_steps, abort_after_step=abort_after_step,
            report_dir=report_dir, min_loss_scale=min_loss_scale,
            max_consecutive_overflows=max_consecutive_overflows, stream=stream,
        )
        # accelerate's AcceleratedOptimizer wraps the torch optimizer without initialising its hooks
        while not hasattr(optimizer, "_optimizer_step_pre_hooks") and isinstance(
            getattr(optimizer, "optimizer", None), torch.optim.Optimizer
        ):
            optimizer = optimizer.optimizer
        if optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} has no register_step_pre_hook(); pass a "
                "torch.optim.Optimizer, or leave optimizer out and call mon.step() once per step"
            )
        if scaler is not None and not callable(getattr(scaler, "update", None)):
            raise TypeError(f"scaler={type(scaler).__name__} has no update() method")
        self.model = unwrap_model(model)
        self.optimizer = optimizer
        self.grads = grads
        self.scaler = scaler
        self.max_frames = operator.index(max_frames)
        self.trace_steps = traced
        self.abort_after_step = None if abort_after_step is None else operator.index(abort_after_step)
        self.report_dir = os.fspath(report_dir)
        self.auto_localize = auto_localize
        self.min_loss_scale = min_loss_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        self.stream = stream
        self._hf = _hf
        rank, world = _dist_rank_world()
        self.rank = rank if world > 1 else None
        self._world = world
        self._sync_ranks = (world > 1) if sync_ranks is None else (sync_ranks and world > 1)

        self.step_index = 0
        self.overflows: list[OverflowEvent] = []
        self.report: NonFiniteReport | None = None
        self._consecutive_overflows = 0
        self._manual = manual_steps
        self._optimizer_stepped = False
        self._tracer = TraceWriter(self.report_dir, self.rank, stream)
        self._stash: tuple[list[Frame], StatBuffer, dict] | None = None
        self._deferred_report: NonFiniteReport | None = None  # DDP: an evaluation pass went bad
        self._root_depth = 0  # root forwards in flight
        self._root_done = False  # the root's own hook ran (so the always-called hook knows it did not fail)
        self._forward_pending = False  # forward-bounded steps: a training forward awaits its backward
        self._forward_start = 0  # index in _frames where the current root forward began
        self._grad_hooks_on = False
        self._history: deque[_Step] = deque()
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any, Any]] = []
        self._active = False
        self._new_step()
        try:
            self._attach()
        except BaseException:
            self.close()  # a refused or failed attach leaves no hook behind
            raise

    # ------------------------------------------------------------------ lifecycle
    def _attach(self) -> None:
        modules = list(self.model.named_modules())
        taken = [name or "<root>" for name, m in modules if m in _WATCHED]
        if taken:
            raise RuntimeError(
                f"{len(taken)} module(s) of this model are already watched by another monitor "
                f"(e.g. {', '.join(taken[:3])}); close() it first -- hooks are never doubled"
            )
        self._infos: dict[int, ModuleInfo] = {}
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        for device in {p.device for p in self._params if p.device.type not in ("cpu", "meta")}:
            fused_check_works(device)  # its one host sync here, at attach time, never inside a step
        for name, module in modules:
            info = ModuleInfo(name, type(module).__name__, weakref.ref(module), is_root=module is self.model)
            self._infos[id(module)] = info
            _WATCHED[module] = self
            self._handles.append(
                module.register_forward_hook(functools.partial(self._on_forward, info), with_kwargs=True)
            )
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_pre_forward))
        # runs after the root's own hook, and also when the forward raises (then only this one runs)
        self._handles.append(
            self.model.register_forward_hook(self._on_root_forward_always, with_kwargs=True, always_call=True)
        )
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._on_optimizer_pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._on_optimizer_post_step))
            if self.scaler is None:
                self._wrap(self.optimizer, "zero_grad", self._on_zero_grad)
        if self.scaler is not None:
            self._wrap(self.scaler, "update", self._on_scaler_update)
        self._active = True
        if not self._optimizer_hooked() and not self._hf:
            self._hook_param_grads()
        if not self._hf:  # transformers reports broken weights in the first forward's frames instead
            self._check_weights_once()

    def _wrap(self, obj: Any, attr: str, before: Any) -> None:
        """Shadow ``obj.attr`` with an instance attribute that calls ``before()`` first; undone by close()."""
        original = getattr(obj, attr)
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before()  # a no-op once this monitor is closed
            return original(*args, **kwargs)

        previous = obj.__dict__.get(attr)
        wrapper._torchdoctor_previous = previous  # type: ignore[attr-defined]
        wrapper._torchdoctor_owner = weakref.ref(self)  # type: ignore[attr-defined]
        self._restore.append((obj, attr, previous, wrapper))
        setattr(obj, attr, wrapper)

    def close(self) -> None:
        """Remove every hook (safe to call twice) and close the trace file.

        Leaving a ``with`` block without an exception also checks the last, still open step.
        """
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles = []
        for obj, attr, old, wrapper in reversed(self._restore):
            if obj.__dict__.get(attr) is not wrapper:
                continue  # wrapped again by someone else since: leave theirs, ours is now a pass-through
            while hasattr(old, "_torchdoctor_owner") and not getattr(old._torchdoctor_owner(), "_active", False):
                old = old._torchdoctor_previous  # skip wrappers of monitors closed in the meantime
            if old is None:
                obj.__dict__.pop(attr, None)
            else:
                setattr(obj, attr, old)
        self._restore = []
        self._release_modules()
        self._tracer.close()

    remove = close

    def __enter__(self) -> NumericsMonitor:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            open_step = self._frames or self._backward_ran or self._deferred_report is not None
            if exc_type is None and self._active and (open_step or self._sync_ranks):
                self._close_step("final")
        finally:
            self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        if getattr(self, "_active", False):
            self.close()

    # ------------------------------------------------------------------ recording
    def _new_step(self) -> None:
        self._frames: list[Frame] = []
        self._buffer = StatBuffer()
        self._seen: dict[int, tuple[weakref.ref, int, Slot]] = {}
        self._grad_targets: dict[int, tuple[weakref.ref, list]] = {}
        self._backward_ran = False
        self._backward_grad_flags: list[torch.Tensor] = []  # gradients as they were when a backward ended
        self._backward_grads: list[tuple[torch.Tensor, weakref.ref]] = []  # ... and which tensors they were
        self._queued_task: int | None = None

    def _slot(self, label: str, value: Any, judged: bool = True) -> Slot:
        """Measure ``value`` once: an output passed on as the next module's input is not measured again."""
        if isinstance(value, torch.Tensor) and not value.is_inference():  # no version counter there
            key = id(value)
            seen = self._seen.get(key)
            if seen is not None and seen[0]() is value and seen[1] == value._version:
                s = seen[2]
                if s.ref is None or s.ref.judged or not judged:
                    return Slot(label, s.ref, s.kind, s.dtype, s.inf_ref)
            slot = self._measure(label, value, judged)
            self._seen[key] = (weakref.ref(value), value._version, slot)
            return slot
        return self._measure(label, value, judged)

    def _measure(self, label: str, value: Any, judged: bool) -> Slot:
        slot = measure(self._buffer, label, value, judged)
        if self._hf and slot.ref is not None and (value.dtype.is_floating_point or value.dtype.is_complex):
            # transformers prints "has infs" next to "has nans" for a tensor holding both; abs max
            # cannot tell, so compat mode pays one more reduction per tensor to know
            slot.inf_ref = self._buffer.add_flag(has_inf(value))
        return slot

    def _steps_end_at_forward(self) -> bool:
        return self.optimizer is None and not self._manual and self.scaler is None

    def _on_root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._active or torch._C._current_graph_task_id() != -1:
            return
        if self._root_depth and not self._inside_root_forward():
            self._root_depth = 0  # a KeyboardInterrupt skipped the always-called hook: not really nested
            self._root_done = False
        self._root_depth += 1
        if self._root_depth > 1:  # a nested call of the root from inside its own forward
            return
        if self._forward_pending and self._steps_end_at_forward():
            self._forward_pending = False
            self._close_step("forward")  # the previous forward and the backward that followed it
        if self._stash is not None and torch.is_grad_enabled():  # an evaluation forward raised midway
            self._frames, self._buffer, self._seen = self._stash
            self._stash = None
        if not torch.is_grad_enabled() and not self._steps_end_at_forward() and self._stash is None:
            # an evaluation / generation forward between training steps: checked on its own at its end,
            # so that a long evaluation loop does not pile its frames onto the training step
            self._stash = (self._frames, self._buffer, self._seen)
            self._frames, self._buffer, self._seen = [], StatBuffer(), {}
            return
        # A backward ran, yet every gradient is None again: the optimizer step was skipped (a loss
        # scaler saw an overflow) and zero_grad() ran. Close that step now.
        skipped_possible = self._backward_ran and not self._manual and self.optimizer is not None
        if skipped_possible and self.scaler is None and all(p.grad is None for p in self._params):
            self._close_step("skipped")
        self._forward_start = len(self._frames)

    def _on_forward(self, info: ModuleInfo, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._active:
            return
        if torch._C._current_graph_task_id() != -1:
            # activation recomputation (gradient checkpointing) inside the backward: not a new frame
            if self.grads == "modules" and torch.is_grad_enabled():
                self._hook_grads(info, output)  # reentrant checkpointing builds its graph only here
            return
        if not self._root_depth and not info.is_root and not torch.is_grad_enabled() and not self._hf:
            return  # a submodule called on its own under no_grad (e.g. generate() running the encoder)
        slot = self._slot
        judge_inputs = self._hf  # transformers stops on a non-finite input; we show inputs as context
        slots = [slot(label, v, judge_inputs) for label, v in input_slots(args, kwargs, self._hf)]
        slots += [slot(label, v) for label, v in output_slots(output, self._hf)]
        self._frames.append(
            Frame(self.step_index, FWD, info, slots, with_params=True, first_of_step=not self._frames)
        )
        if torch.is_grad_enabled():
            if self.grads == "modules":
                self._hook_grads(info, output)
            elif info.is_root:
                self._hook_backward_seen(output)
        if info.is_root and self._root_depth <= 1:
            self._root_done = True
            self._on_root_forward_end()

    def _on_root_forward_end(self) -> None:
        if self._stash is not None:
            self._close_inference_pass()
        elif self._steps_end_at_forward():
            if self._hf or not torch.is_grad_enabled():
                self._close_step("forward")
            else:  # a backward may follow: close at the next forward, step() or leaving the with block
                self._forward_pending = True

    def _inside_root_forward(self) -> bool:
        """Is an *outer* call of the root module on the Python stack? Asked only when the depth counter
        says so; the pre-forward hook itself runs inside the current call's ``_call_impl``."""
        calls = 0
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is self.model:
                calls += 1
                if calls > 1:
                    return True
            frame = frame.f_back
        return False

    def _on_root_forward_always(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_done or self._root_depth or not self._active:
            self._root_done = False
            return
        self._on_root_forward_failed()

    def _on_root_forward_failed(self) -> None:
        """The root forward raised. If a non-finite value came first, say so; else forget its frames.

        torch silences exceptions raised here (the forward's own exception is re-raised), so the
        report is written to disk, logged, and attached to that exception as a note.
        """
        flag = all_finite(self._buffer.finite_flags())
        if flag is not None and not bool(flag.item()):
            frames, start = self._frames_with_context()
            report = build_report(frames, self.max_frames, self.rank, start, self._hf)
            if report is not None:
                self._on_failed_forward_report(report)
                return
        del self._frames[self._forward_start :]
        if self._stash is not None:
            self._frames, self._buffer, self._seen = self._stash
            self._stash = None

    def _on_failed_forward_report(self, report: NonFiniteReport) -> None:
        report.notes.append("The forward then raised an exception of its own (see the traceback).")
        self._finish(report)
        log.error("non-finite value before the forward raised:\n%s", report.text())
        exc = sys.exc_info()[1]
        if exc is not None and hasattr(exc, "add_note"):
            exc.add_note("torchdoctor: " + report.text())

    def _close_inference_pass(self) -> None:
        """Check a no-grad forward made between training steps (one host read), then resume the step."""
        flag = all_finite(self._buffer.finite_flags())
        frames, buffer = self._frames, self._buffer
        self._frames, self._buffer, self._seen = self._stash
        self._stash = None
        if flag is not None and not bool(flag.item()):
            report = build_report(self._resolved([_Step(frames, buffer)]), self.max_frames, self.rank, 0, self._hf)
            assert report is not None
            report.notes.append("This was a forward under torch.no_grad() (evaluation or generation).")
            if self._sync_ranks:
                # other ranks may be in a collective already: say it at the next shared verdict, together
                self._deferred_report = self._deferred_report or report
                return
            self._raise(report)

    def _hook_backward_seen(self, output: Any) -> None:
        """One cheap hook on the root output that notes that a backward ran (for skipped steps)."""
        for _, v in output_slots(output):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                v.register_hook(self._on_backward_seen)
                return

    def _on_backward_seen(self, grad: torch.Tensor) -> None:
        self._backward_ran = True

    def _optimizer_hooked(self) -> bool:
        """Is the step checked in the optimizer's pre-hook, i.e. before the update?"""
        return self.optimizer is not None and not self._manual

    def _hook_param_grads(self) -> None:
        """Without a hooked optimizer, check the parameter gradients when each backward ends (on
        device, read with the step's flag): zero_grad() or the update may come before the step ends.
        A post-accumulate hook per parameter notices any backward that writes a gradient, whatever
        output the loss was computed from."""
        if self._grad_hooks_on or self.grads == "none":
            return
        self._grad_hooks_on = True
        for p in self._params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_param_grad))

    def _on_param_grad(self, param: torch.Tensor) -> None:
        if not self._active or self._optimizer_hooked():
            return
        self._backward_ran = True
        task = torch._C._current_graph_task_id()
        if task != self._queued_task:  # once per backward (a backward that raised never ran its callback)
            self._queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued_task = None
        if self._active:
            with_grad = [p for p in self._params if p.grad is not None]
            self._backward_grad_flags.extend(finite_flags_of([p.grad for p in with_grad]))
            self._backward_grads.extend((p, weakref.ref(p.grad)) for p in with_grad)

    def _stored_grad_flags(self) -> list[torch.Tensor]:
        """Flags taken when backwards ended, unless those very gradients are still there (then the
        check at the step's end sees them as they are now, repaired or accumulated further)."""
        if all(p.grad is not None and p.grad is ref() for p, ref in self._backward_grads):
            return []
        return self._backward_grad_flags

    def _hook_grads(self, info: ModuleInfo, output: Any) -> None:
        for label, v in output_slots(output):
            if not (isinstance(v, torch.Tensor) and v.requires_grad):
                continue
            key = id(v)
            seen = self._seen.get(key)
            source = seen[2].ref if seen is not None and seen[0]() is v else None
            entry = self._grad_targets.get(key)
            if entry is not None and entry[0]() is v:
                entry[1].append((info, "grad_" + label, source))
                continue
            targets = [(info, "grad_" + label, source)]
            self._grad_targets[key] = (weakref.ref(v), targets)
            v.register_hook(functools.partial(self._on_grad, targets))

    def _on_grad(self, targets: list, grad: torch.Tensor) -> None:
        if not self._active:
            return
        self._backward_ran = True
        measured = measure(self._buffer, targets[0][1], grad)
        seen_modules = set()
        for info, label, source in targets:
            first_for_module = id(info) not in seen_modules
            seen_modules.add(id(info))
            self._frames.append(
                Frame(
                    self.step_index,
                    BWD,
                    info,
                    [Slot(label, measured.ref, measured.kind, measured.dtype)],
                    with_param_grads=first_for_module,
                    source_ref=source,
                )
            )

    def mark(self, tensor: torch.Tensor, ctx: str) -> None:
        """Add a frame for an intermediate value, in execution order, without a host sync."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"mark() needs a tensor, got {type(tensor).__name__}")
        if not self._active or torch._C._current_graph_task_id() != -1:  # not again in recomputation
            return
        info = ModuleInfo(ctx, "mark", weakref.ref(self.model))
        self._frames.append(
            Frame(self.step_index, MARK, info, [self._slot("value", tensor)], first_of_step=not self._frames)
        )

    # ------------------------------------------------------------------ step boundaries
    def step(self) -> None:
        """End a training step by hand (when no optimizer was given): check it, then start the next."""
        self._manual = True
        self._hook_param_grads()
        self._forward_pending = False
        self._close_step("manual")

    def _on_optimizer_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._active and not self._manual:
            self._close_step("optimizer", abort_check=False)
            self._optimizer_stepped = True  # scaler.update() of this step has nothing left to check

    def _on_optimizer_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._active and not self._manual:
            self._check_abort_after(self.step_index - 1)

    def _on_scaler_update(self) -> None:
        if not self._active:
            return
        if self._optimizer_stepped:  # the optimizer pre-hook already checked this step
            self._optimizer_stepped = False
            return
        # with an optimizer, reaching here means the scaler skipped its step; without one, it is the boundary
        self._close_step("skipped" if self.optimizer is not None else "scaler")

    def _on_zero_grad(self) -> None:
        """zero_grad() after a backward but no optimizer step: the step was skipped (by a loss scaler
        that was not passed as ``scaler=``). Check it now, while its gradients still exist."""
        if self._active and not self._manual and self._backward_ran:
            self._close_step("skipped")

    def _param_grad_flags(self) -> list[torch.Tensor]:
        return finite_flags_of([p.grad for p in self._params if p.grad is not None])

    def _close_step(self, source: str, abort_check: bool = True) -> None:
        """Check the finished step with one host read; raise or record what went wrong."""
        nothing = not self._frames and not self._backward_ran and self._deferred_report is None
        if nothing and source in ("forward", "skipped", "final") and not self._sync_ranks:
            return  # (under DDP every rank must take part in the verdict, so no shortcut there)
        act_ok = all_finite(self._buffer.finite_flags())  # activations (and module-level gradients)
        if self._deferred_report is not None:
            act_ok = torch.zeros((), dtype=torch.bool)
        check_grads = self.grads != "none" and (source != "forward" or self._backward_ran)
        grad_ok = all_finite((self._param_grad_flags() if check_grads else []) + self._stored_grad_flags())
        others: list[int] = []
        if self._sync_ranks:
            ok, others = self._share_verdict(act_ok, grad_ok)
        else:
            both = all_finite([f for f in (act_ok, grad_ok) if f is not None])
            ok = True if both is None else bool(both.item())  # THE host sync of this step
        step = self.step_index
        if step in self.trace_steps:
            self._trace(step)
        if ok:
            self._consecutive_overflows = 0
        else:
            self._handle_nonfinite(step, source, others, check_grads)
        self._rotate()
        if abort_check and source != "skipped":
            self._check_abort_after(step)

    def _share_verdict(self, act_ok: torch.Tensor | None, grad_ok: torch.Tensor | None) -> tuple[bool, list[int]]:
        """One small all-reduce: which ranks saw non-finite activations, which non-finite gradients.

        Returns (all finite everywhere, the *other* ranks whose activations were non-finite). Under DDP
        a non-finite gradient on one rank reaches every rank through the gradient all-reduce; knowing
        which rank's forward broke lets the others say so instead of blaming themselves.
        """
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        bad = torch.zeros(self._world, 2, dtype=torch.int32, device=device)
        me = dist.get_rank()
        for col, flag in enumerate((act_ok, grad_ok)):
            if flag is not None:
                bad[me, col] = (~flag).to(device=device, dtype=torch.int32)
        dist.all_reduce(bad)
        rows = bad.cpu().tolist()  # the one host read of this step
        any_bad = any(a or g for a, g in rows)
        return not any_bad, [r for r, (a, _) in enumerate(rows) if a and r != me]

    def _rotate(self) -> None:
        """Keep recent steps (unread, on device) as context for a report, then start a new step."""
        if self._frames:
            self._history.append(_Step(self._frames, self._buffer))
            kept = 0
            for i in range(len(self._history) - 1, -1, -1):
                kept += len(self._history[i].frames)
                if kept > self.max_frames:
                    for _ in range(i):
                        self._history.popleft()
                    break
        self.step_index += 1
        self._new_step()

    def _check_abort_after(self, step: int) -> None:
        if self.abort_after_step is not None and step >= self.abort_after_step:
            self._stop()
            raise AbortAfterStep(
                f"torchdoctor: stopping after step {step} as asked (abort_after_step={self.abort_after_step})"
            )

    # ------------------------------------------------------------------ reading back
    def _frames_with_context(self) -> tuple[list[ResolvedFrame], int]:
        """Earlier (already checked) steps as context, then the current step; and where it starts."""
        context = self._resolved(list(self._history))
        return context + self._resolved([_Step(self._frames, self._buffer)]), len(context)

    def _resolved(self, steps: list[_Step]) -> list[ResolvedFrame]:
        out: list[ResolvedFrame] = []
        for s in steps:
            out.extend(resolve(s.frames, s.buffer.read()))
        return out

    def _param_grad_frames(self, step: int) -> list[ResolvedFrame]:
        """Parameter gradients, module by module in backward order (reverse of the forward)."""
        order: dict[str, ModuleInfo] = {}
        for f in self._frames:
            if f.phase == FWD:
                order.setdefault(f.info.name, f.info)
        infos = list(order.values())[::-1] or list(self._infos.values())[::-1]
        out = []
        for info in infos:
            module = info.module()
            if module is None:
                continue
            lines = [
                measure_now(f"grad:{n}", p.grad)
                for n, p in module.named_parameters(recurse=False)
                if p.requires_grad and p.grad is not None
            ]
            if lines:
                out.append(ResolvedFrame(step, BWD, info.name, info.cls, lines))
        return out

    def _handle_nonfinite(self, step: int, source: str, bad_ranks: list[int], check_grads: bool) -> None:
        if self._deferred_report is not None:
            self._deferred_report.bad_ranks = bad_ranks
            self._raise(self._deferred_report)
        frames, start = self._frames_with_context()
        # weights are measured now: without a hooked optimizer they may have changed since the forward
        judge_params = self._optimizer_hooked() or self._hf
        if check_grads and find_first_bad(frames, start, self._hf, judge_params) is None:
            frames += self._param_grad_frames(step)
        report = build_report(frames, self.max_frames, self.rank, start, self._hf, judge_params)
        unknown_gradient = report is None and not bad_ranks
        if unknown_gradient:  # only the gradients seen when a backward ended were bad, and they are gone
            report = NonFiniteReport(
                step, None, frames[start:][-self.max_frames :],
                "a parameter gradient was non-finite when the backward of this step ended, and the gradients "
                "were gone (zero_grad) by the time the step was checked, so which one is unknown. Pass the "
                "optimizer (NumericsMonitor(model, optimizer=opt)) so the step is checked before the update is "
                "applied, or call mon.step() before optimizer.step(); grads='modules' names the module. Under "
                "a loss scaler, pass it too (scaler=...): its overflows are then recorded, not raised.",
                rank=self.rank,
            )
        elif report is None:  # only another rank saw a non-finite value
            report = NonFiniteReport(step, None, [], "another rank found non-finite values", rank=self.rank)
        report.bad_ranks = bad_ranks
        if bad_ranks and report.first is not None and report.first.phase == BWD:
            report.diagnosis = (
                f"this rank's forward was finite; rank(s) {bad_ranks} produced non-finite activations in "
                "this step and their gradients reached this rank through the gradient all-reduce. "
                f"See the report of rank {bad_ranks[0]}."
            )
            report.fix = report.fp32_region = None
        only_backward = unknown_gradient or (report.first is not None and report.first.phase == BWD)
        if only_backward and source in ("skipped", "scaler"):
            self._record_overflow(step, report)
            return
        if self.grads == "params" and only_backward:
            report.notes.append(
                "To see where the backward blow-up starts, run with NumericsMonitor(..., grads='modules')."
            )
        self._raise(report)

    def _record_overflow(self, step: int, report: NonFiniteReport) -> None:
        scale = None
        if self.scaler is not None and callable(getattr(self.scaler, "get_scale", None)):
            scale = float(self.scaler.get_scale())
        first = report.first
        event = OverflowEvent(step, scale, first.module if first else None, first.slot if first else None)
        self.overflows.append(event)
        self._consecutive_overflows += 1
        where = f" starting in {event.module} ({event.slot})" if event.module else ""
        log.info("gradient overflow at step %d (loss scale %s)%s: step skipped", step, scale, where)
        if self.grads == "params" and self.auto_localize:
            self.grads = "modules"
            log.info("switching to grads='modules' to localize the next gradient overflow")
        collapsed = scale is not None and scale < self.min_loss_scale
        if collapsed or self._consecutive_overflows >= self.max_consecutive_overflows:
            why = (
                f"the loss scale collapsed to {scale:g} (< {self.min_loss_scale:g})"
                if collapsed
                else f"{self._consecutive_overflows} steps in a row overflowed"
            )
            report.diagnosis = (
                f"{why}: the gradients overflow at every scale, so this is not a transient spike. "
                + report.diagnosis
            )
            report.fix = report.fix or "train in bf16, or keep the module named above in fp32"
            self._raise(report)

    def _release_modules(self) -> None:
        for module in list(_WATCHED.keys()):
            if _WATCHED.get(module) is self:
                del _WATCHED[module]

    def _stop(self) -> None:
        """The run is over: stop checking and let a new monitor attach (inert hooks go at close())."""
        self._active = False
        self._release_modules()

    def _finish(self, report: NonFiniteReport) -> None:
        """Keep the report, stop, and write it to disk before anything is raised."""
        self.report = report
        self._stop()
        try:
            report.write(self.report_dir)
        except Exception as e:  # never let a full disk (or anything else) hide the finding itself
            report.notes.append(f"(could not write the report to {self.report_dir}: {e})")

    def _raise(self, report: NonFiniteReport) -> None:
        self._finish(report)
        raise NonFiniteError(report)

    def _trace(self, step: int) -> None:
        self._tracer.write_step(step, self._resolved([_Step(self._frames, self._buffer)]))

    def _check_weights_once(self) -> None:
        """At attach time: a weight that is already non-finite is named at once (one sync, once)."""
        flag = all_finite(finite_flags_of(list(self.model.parameters())))
        if flag is None or bool(flag.item()):
            return
        for name, p in self.model.named_parameters():
            line = measure_now(name.rsplit(".", 1)[-1], p, param=True)
            if line.abs_max is not None and not math.isfinite(line.abs_max):
                module_name = name.rpartition(".")[0]
                cls = type(self.model.get_submodule(module_name)).__name__
                value = "nan" if math.isnan(line.abs_max) else "inf"
                first = FirstNonFinite(0, FWD, module_name, cls, line.label, value)
                self._raise(
                    NonFiniteReport(
                        0, first, [],
                        f"parameter {name} of the model is already non-finite before training ({value}): check "
                        "the checkpoint or the initialisation",
                        rank=self.rank,
                    )
                )

"""The monitor's hooks: what runs inside a forward or a backward, and records into the current step.

Everything here is on the hot path, so each hook does the least it can: label the values, reduce
each tensor to (abs min, abs max) on its device (:mod:`.stats`), append a host-side
:class:`~.frames.Frame`. Nothing reads a value back. The step logic that decides when and how to
read (one host sync per step) lives in :mod:`.monitor`; this mixin only records.

Inside code that ``torch.compile`` traces, every hook returns at its first line: traced, it is a
no-op with no guard, so it adds neither a graph break nor a recompilation. Compiled regions are
watched at their edges instead, where the monitor runs eagerly (:mod:`.compiled`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

from ..measure.slots import labelled_outputs, visible_inputs, visible_outputs
from ..measure.stats import finite_flags_of
from .calls import capture, forward_ended, keep_output_grads
from .compiled import Region
from .frames import BWD, FWD, LABEL, MARK, Frame, ModuleInfo, measure, relabelled, slot_ref
from .step import StepRecord

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


_CALL_IMPL = nn.Module._call_impl.__code__


# The running backward's id, -1 outside a backward (then a forward is a real one, not recomputation). (Called
# directly: every hook asks, and a Python wrapper around it cost more than the call.)
_graph_task = torch._C._current_graph_task_id


class _GradHook(list):
    """The module-level gradient targets of one forward output, ``(module info, label, source ref)`` each, and the
    tensor hook that measures its gradient for them: one object per hooked output where a list, a partial and a
    bound method were three (fewer objects for the garbage collector to carry through the step)."""

    __slots__ = ("monitor",)

    def __call__(self, grad: torch.Tensor) -> None:
        self.monitor._on_grad(self, grad)


class Recording:
    """Forward, backward and mark hooks of :class:`~.monitor.NumericsMonitor` (a mixin)."""

    # set by the monitor
    _active: bool
    _hf: bool
    grads: str
    step_index: int
    model: nn.Module
    _rec: StepRecord

    # ------------------------------------------------------------------ forward
    def _on_forward(self, info: ModuleInfo, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _is_compiling() or not self._active:
            return
        if _graph_task() != -1:
            # activation recomputation (gradient checkpointing) inside the backward: not a new frame
            if self.grads == "modules" and torch.is_grad_enabled():
                self._hook_grads(info, output)  # reentrant checkpointing builds its graph only here
            return
        alone = not self._root_depth and not info.is_root and not self._rerunning
        if alone and not torch.is_grad_enabled() and not self._hf:
            return  # a submodule called on its own under no_grad (e.g. generate() running the encoder)
        if alone and self._forward_pending:  # a submodule-only call ended the previous forward: close it
            self._forward_pending = False
            self._close_step("forward")
        self._record_call(info, module, args, kwargs, output)
        if info.is_root and self._root_depth <= 1 and not self._rerunning:
            self._root_done = True
            self._on_root_forward_end()
        elif alone and self._outermost_call(module):
            if self._learning_entries:
                self._found_entries[id(module)] = module
            self._on_loose_call_end()

    def _outermost_call(self, module: nn.Module) -> bool:
        """Is no other watched module's forward on the Python stack (``model.transformer(...)`` itself, not
        one of the blocks it runs)? Asked only for calls outside a forward of the root module."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                caller = frame.f_locals.get("self")
                if caller is not module and id(caller) in self._infos:
                    return False
            frame = frame.f_back
        return True

    def _on_loose_call_end(self) -> None:
        """The outermost watched call of a loop that never calls the root module ended: a step (or, in compat
        mode, a check) boundary, so that such a loop is checked and its frames never pile up."""
        if self._hf:
            self._close_step("loose")
        elif self._stash is None and self._steps_end_at_forward():
            self._forward_pending = True  # closed at the next call, step() or leaving the with block

    def _record_call(self, info: ModuleInfo, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """One forward frame: the module's inputs (context) and outputs (judged)."""
        rec = self._rec
        hf = self._hf
        at_forward = self._engine.params_at_forward
        first = not rec.frames and not rec.continued
        now = info.at_once
        if not (hf or at_forward or now):  # the common case: labelled and measured with the calls around it
            frame = Frame(self.step_index, FWD, info, [], True, False, first)
            rec.frames.append(frame)
            if not rec.defer(frame, args, kwargs, output):
                rec.settle()
                frame.slots = rec.call_slots(args, kwargs, output, False)
        else:
            rec.settle()
            slots = self._measured_params.pop(id(module), []) if at_forward else []
            # transformers stops on a non-finite positional input, and only on what it sees (never on a keyword
            # input or a tensor inside a dict / ModelOutput); the monitor shows inputs as context
            if hf:
                values = [*visible_inputs(args, kwargs, True), *visible_outputs(output, True)]
                slots += [rec.slot(lb, v, seen, True, at_once=now) for lb, v, seen in values]
            else:
                slots += rec.call_slots(args, kwargs, output, now)
            rec.frames.append(Frame(self.step_index, FWD, info, slots, not at_forward, False, first))
        call = rec.root_calls[-1] if rec.root_calls and not self._rerunning else None
        if call is not None and not (info.is_root or (id(module) in self._entries and call.module is module)):
            call = None  # (the model's call, or an entry's: a compiled model's call was kept by its outer module)
        if call is not None:
            forward_ended(call)
        if torch.is_grad_enabled():
            kept = call is not None and self.grads != "none" and keep_output_grads(call, output, rec)  # (a replay)
            if self.grads == "modules":
                self._hook_grads(info, output)
            elif info.is_root and not kept:  # (the kept gradient's hook notes a backward too)
                self._hook_backward_seen(output)

    def _on_pre_forward_params(self, module: nn.Module, args: Any) -> None:
        """Engines that gather weights only for their module's forward (ZeRO-3): measure them as it starts.
        (DeepSpeed's own pre-forward hook, registered first, has gathered them; read without attribute
        access, which would gather again.)"""
        if _is_compiling() or not self._active or _graph_task() != -1:
            return
        rec = self._rec
        self._measured_params[id(module)] = [
            rec.slot(name, p, True, self._hf, param=True) for name, p in module.named_parameters(recurse=False)
        ]

    def _on_root_pre_forward(self, module: nn.Module, args: Any, kwargs: dict | None = None) -> None:
        if _is_compiling() or not self._active or _graph_task() != -1 or self._rerunning:
            return
        if self._root_depth and not self._inside_root_forward(module):
            self._root_depth = 0  # a KeyboardInterrupt skipped the always-called hook: not really nested
            self._root_done = False
        self._root_depth += 1
        if self._root_depth > 1:  # a nested call of the root from inside its own forward
            return
        if self._forward_pending and self._steps_end_at_forward() and (torch.is_grad_enabled() or not self._sync_ranks):
            self._forward_pending = False
            self._close_step("forward")  # the previous forward and the backward that followed it
        if self._stash is not None and torch.is_grad_enabled():  # an evaluation forward raised midway
            self._rec, self._stash = self._stash, None
        evaluation = not self._steps_end_at_forward() or self._sync_ranks  # (no collective for one rank's eval)
        if not torch.is_grad_enabled() and evaluation and self._stash is None:
            # an evaluation / generation forward between training steps: checked on its own at its end,
            # so that a long evaluation loop does not pile its frames onto the training step; under
            # torch.distributed without a collective, since other ranks need not run it
            self._stash, self._rec = self._rec, StepRecord(live=self._live_now)
            self._forward_start = 0
            if not self._live_now:  # checked at its boundaries: keep what a replay would need
                self._rec.root_calls.append(capture(module, args, kwargs or {}, 0, self._cuda_devices))
            return
        # A backward ran, yet every gradient is None again: the optimizer step was skipped (a loss
        # scaler saw an overflow) and zero_grad() ran. Close that step now.
        skipped_possible = self._rec.backward_ran and not self._manual and self.optimizer is not None
        skipped_possible = skipped_possible and self._engine.grads_at_report  # (ZeRO-2/3: p.grad is always gone)
        if skipped_possible and self.scaler is None and all(p.grad is None for p in self._params):
            self._close_step("skipped")
        self._forward_start = len(self._rec.frames)
        if self._regions or not self._rec.live:  # keep what a replay of this call would need (replay.py)
            self._rec.root_calls.append(capture(module, args, kwargs or {}, self._forward_start, self._cuda_devices))

    def _on_entry_pre_forward(self, module: nn.Module, args: Any, kwargs: dict | None = None) -> None:
        """A module the loop calls on its own (``self.net(x)`` in a LightningModule's ``training_step``), watched at
        its boundaries like the model: keep what a replay of this call would need."""
        if _is_compiling() or not self._active or _graph_task() != -1 or self._rerunning or self._root_depth:
            return
        rec = self._rec
        if rec.live or not torch.is_grad_enabled() or not self._outermost_call(module):
            return
        rec.root_calls.append(capture(module, args, kwargs or {}, len(rec.frames), self._cuda_devices))

    def _inside_root_forward(self, module: nn.Module) -> bool:
        """Is an *outer* call of the root module on the Python stack? Asked only when the depth counter
        says so; the pre-forward hook itself runs inside the current call's ``_call_impl``."""
        calls = 0
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
                calls += 1
                if calls > 1:
                    return True
            frame = frame.f_back
        return False

    def _on_root_forward_always(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _is_compiling() or _graph_task() != -1 or self._rerunning:
            return
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_done or self._root_depth or not self._active:
            self._root_done = False
            return
        self._on_root_forward_failed()

    def _hook_backward_seen(self, output: Any) -> None:
        """One cheap hook on the root output that notes that a backward ran (for skipped steps)."""
        for _, v in labelled_outputs(output):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                v.register_hook(self._on_backward_seen)
                return

    def _on_backward_seen(self, grad: torch.Tensor) -> None:
        self._rec.backward_ran = True

    # ------------------------------------------------------------------ backward
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
        rec = self._rec
        rec.backward_ran = True
        task = _graph_task()
        if task != rec.queued_task:  # once per backward (a backward that raised never ran its callback)
            rec.queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        rec = self._rec
        rec.queued_task = None
        if self._active:
            with_grad = [p for p in self._params if p.grad is not None]
            rec.backward_grad_flags.extend(finite_flags_of([p.grad for p in with_grad]))
            rec.backward_grads.extend((p, weakref.ref(p.grad)) for p in with_grad)

    def _on_param_grad_received(self, info: ModuleInfo, label: str, grad: torch.Tensor) -> None:
        """A parameter receives its gradient in the backward (engines whose gradients are gone by the
        step, DeepSpeed): measured now, as a frame of its module, in backward order."""
        if not self._active:
            return
        rec = self._rec
        rec.backward_ran = True
        slot = measure(rec.buffer, label, grad, at_once=True)  # the engine moves it into its buckets right after
        last = rec.frames[-1] if rec.frames else None
        if last is not None and last.info is info and last.phase == BWD and last.slots[-1][LABEL].startswith("grad:"):
            last.slots.append(slot)  # the module's other parameters: one frame per module
        else:
            rec.frames.append(Frame(self.step_index, BWD, info, [slot]))

    def _hook_grads(self, info: ModuleInfo, output: Any) -> None:
        rec = self._rec
        for label, v in labelled_outputs(output):
            if not (isinstance(v, torch.Tensor) and v.requires_grad):
                continue
            key = id(v)
            seen = rec.seen.get(key)
            source = slot_ref(seen[2]) if seen is not None and seen[0]() is v else None
            entry = rec.grad_targets.get(key)
            version = v._version
            if entry is not None and entry[0]() is v and entry[2] == version:
                targets = entry[1]
                targets.append((info, "grad_" + label, source))
            else:  # (a tensor changed in place since, ReLU(inplace=True): a hook of its own, on its new version)
                targets = _GradHook(((info, "grad_" + label, source),))
                targets.monitor = self
                rec.grad_targets[key] = (weakref.ref(v), targets, version)
                v.register_hook(targets)
            if source is None and rec.calls:  # its forward call waits: the source is known once it is measured
                rec.unsourced.append((key, weakref.ref(v), targets, len(targets) - 1))

    def _on_grad(self, targets: list, grad: torch.Tensor) -> None:
        if not self._active:
            return
        rec = self._rec
        rec.backward_ran = True
        rec.settle()  # (a forward that never reached its end, e.g. a re-run: its calls' sources are needed now)
        ref = None
        if type(grad) is torch.Tensor and grad.layout is torch.strided:  # the common case: into a window
            ref = rec.buffer.wait(grad, True, grad._version)
        label = targets[0][1]
        measured = (label, *ref, None, grad.dtype, None, None, False, True, None) if ref is not None else measure(
            rec.buffer, label, grad)
        # (a replay's parameter gradients are the ones its own backward returned, not p.grad: replay.replay_call)
        params = self._engine.grads_at_report and not self._rerunning
        step = self.step_index
        seen_modules = set()
        for info, label, source in targets:
            first_for_module = id(info) not in seen_modules
            seen_modules.add(id(info))
            rec.frames.append(Frame(step, BWD, info, [relabelled(measured, label)], False, first_for_module and params,
                                    False, source))

    # ------------------------------------------------------------------ compiled regions' edges
    def _region_enter(self, region: Region, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        if _is_compiling() or not self._active or _graph_task() != -1:
            return
        if region.is_root:
            self._on_root_pre_forward(module, args, kwargs)
        self._region_stack.append((region, len(self._rec.frames)))

    def _region_exit(self, region: Region, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _is_compiling() or _graph_task() != -1:
            return
        top = self._region_stack[-1] if self._region_stack else None
        if top is None or top[0] is not region:
            return  # entered while the monitor was inactive or recomputing
        self._region_stack.pop()
        if not self._active:
            return
        rec = self._rec
        # the region ran eagerly after all (nothing to compile, or a re-run): its own hooks recorded it
        ran_eagerly = any(f.phase == FWD and f.info.module() is region.inner for f in rec.frames[top[1]:])
        recordable = self._root_depth or region.is_root or torch.is_grad_enabled() or self._rerunning
        if not ran_eagerly and recordable:
            self._record_call(region.info, region.inner, args, kwargs, output)
        if region.is_root and self._root_depth <= 1 and not self._rerunning:
            self._root_done = True
            self._on_root_forward_end()

    def _region_always(self, region: Region, module: nn.Module, *_: Any) -> None:
        if _is_compiling() or _graph_task() != -1:
            return
        if self._region_stack and self._region_stack[-1][0] is region:
            self._region_stack.pop()  # the forward raised: its exit never ran
        if region.is_root:
            self._on_root_forward_always(module, None, None, None)

    # ------------------------------------------------------------------ marks
    def mark(self, tensor: torch.Tensor, ctx: str) -> None:
        """Add a frame for an intermediate value, in execution order, without a host sync."""
        if _is_compiling():
            return
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"mark() needs a tensor, got {type(tensor).__name__}")
        if not self._active or _graph_task() != -1:  # not again in recomputation
            return
        info = ModuleInfo(ctx, "mark", weakref.ref(self.model))
        rec = self._rec
        rec.settle()  # (in order: a marked module output is measured once)
        rec.frames.append(
            Frame(self.step_index, MARK, info, [rec.slot("value", tensor)], first_of_step=not rec.frames)
        )


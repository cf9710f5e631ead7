"""The recorder: the monitor's hooks, and the record of the step they write into.

Everything here is on the hot path, so each hook does the least it can: label the values, reduce
each tensor to (abs min, abs max) on its device (:mod:`..measure.stats`), append a host-side
:class:`~.frames.Frame` to the current :class:`~.step.StepRecord`. Nothing reads a value back. When a step ends and
how it is judged (one host sync per step) is the step logic's (:class:`~..judge.steps.Steps`): the recorder only
tells it that the model's call began, ended or raised, through :class:`StepEvents`.

What the recorder owns: the current record (and, while an evaluation forward runs between training steps, the
training step's record put aside), which modules are hooked (only the model's own call at the boundaries; every
module while a step is watched module by module or replayed), the modules the loop calls on its own (``entries``),
and the depth of the model's calls in flight. It is handed the watched model's facts
(:class:`~.watched.WatchedModel`) and the monitor's :class:`~..engines.hookset.HookSet`, never the monitor.

Inside code that ``torch.compile`` traces, every hook returns at its first line: traced, it is a
no-op with no guard, so it adds neither a graph break nor a recompilation. Compiled regions are
watched at their edges instead, where the monitor runs eagerly (:mod:`.compiled`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ..engines.hookset import HookSet
from ..measure.slots import labelled_outputs, visible_inputs, visible_outputs
from ..measure.stats import finite_flags_of
from .calls import capture, forward_ended, keep_output_grads
from .compiled import Region
from .frames import BWD, FWD, LABEL, MARK, Frame, ModuleInfo, measure, relabelled, slot_ref
from .step import StepRecord
from .watched import WatchedModel

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


_CALL_IMPL = nn.Module._call_impl.__code__


# The running backward's id, -1 outside a backward (then a forward is a real one, not recomputation). (Called
# directly: every hook asks, and a Python wrapper around it cost more than the call.)
_graph_task = torch._C._current_graph_task_id


class StepEvents(Protocol):
    """What the recorder tells the step logic (:class:`~..judge.steps.Steps`)."""

    def root_forward_starting(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        """The model's outermost call begins (a step, a micro-batch, or an evaluation pass)."""

    def root_forward_ended(self) -> None:
        """The model's outermost call returned (its outputs measured)."""

    def root_forward_failed(self) -> None:
        """The model's outermost call raised."""

    def loose_call_starting(self) -> None:
        """A watched module is called outside any call of the model (a loop that calls a submodule)."""

    def loose_call_ended(self) -> None:
        """The outermost such call returned."""

    def optimizer_hooked(self) -> bool:
        """Is the step checked in front of the optimizer (so gradients wait for that check)?"""


class _GradHook(list):
    """The module-level gradient targets of one forward output, ``(module info, label, source ref)`` each, and the
    tensor hook that measures its gradient for them: one object per hooked output where a list, a partial and a
    bound method were three (fewer objects for the garbage collector to carry through the step)."""

    __slots__ = ("recorder",)

    def __call__(self, grad: torch.Tensor) -> None:
        self.recorder._on_grad(self, grad)


class Recorder:
    """The forward, backward, mark and compiled-edge hooks of one monitor, and the step record they write into.

    Args:
        watched (WatchedModel): the model's facts (modules and their infos, engine, regions, parameters, devices).
        hooks (HookSet): where every hook it adds is kept; ``hooks.active`` says whether the monitor watches.
        grads (str): ``"none"``, ``"params"`` or ``"modules"`` (module-level gradients hooked as they are made): the
            level asked for (:attr:`level`); :attr:`grads` is the current step's (the first step records module-level
            gradients whatever the level, a replay always does).
        hf (bool): transformers' compat surface (:mod:`torchdoctor.compat`): what it sees, measured at once.
    """

    def __init__(self, watched: WatchedModel, hooks: HookSet, grads: str, hf: bool = False) -> None:
        self.watched = watched
        self.infos = watched.infos
        self.hooks = hooks
        self.level = grads  # the level asked for
        self.grads = grads  # this step's
        # module-level gradients may stop a step (grads="modules", a replay); recorded at the first step whatever the
        # level, they are seen there but do not stop it (a loop that repairs its gradients before the update)
        self.grads_judged = grads == "modules"
        self.hf = hf
        self.params_at_forward = watched.engine.params_at_forward
        self.events: StepEvents | None = None  # the step logic, wired in once it exists (it needs the recorder)
        self.step = 0  # the step the frames belong to (set with each new record)
        self.rec = StepRecord()
        self.stash: StepRecord | None = None  # the training step's record, while an evaluation forward records
        self.attached = False
        self.live_default = True  # watched module by module unless a step is traced (decided at attach)
        self.live_now = False  # every module's forward hook is in place
        self.module_hooks: list[Any] = []  # those hooks
        # modules the loop calls on its own, outside any call of the model (a LightningModule's training_step
        # calling self.net): watched at their boundaries like the model, once a step showed them (one step watched
        # every module after a step at the boundaries recorded no call at all)
        self.entries: dict[int, nn.Module] = {}
        self.learning_entries = False
        self.found_entries: dict[int, nn.Module] = {}
        self.root_depth = 0  # root forwards in flight
        self.root_done = False  # the root's own hook ran (so the always-called hook knows it did not fail)
        self.forward_start = 0  # index in the step's frames where the current root forward began
        self.rerunning = False  # a replay is recording
        self.region_stack: list[tuple[Region, int]] = []  # regions in flight: where their frames begin
        self.measured_params: dict[int, list] = {}  # ZeRO-3: weights measured as their module's forward began
        self._grad_hooks_on = False

    # ------------------------------------------------------------------ lifecycle
    def attach(self, live: bool) -> None:
        """Hook the model's own call (at every level; the other modules by :meth:`set_live`), and its compiled
        regions' edges; then watch every module or not, as ``live`` says."""
        hooks, root = self.hooks, self.watched.root
        for _, module in self.watched.modules:
            info = self.infos[id(module)]
            if info.is_root:
                hooks.add(self._hook_module(module, info))
                if self.params_at_forward:
                    hooks.add(module.register_forward_pre_hook(self._on_pre_forward_params))
        if self.watched.regions.root is None:
            hooks.add(root.register_forward_pre_hook(self._on_root_pre_forward, with_kwargs=True))
            # runs after the root's own hook, and also when the forward raises (then only this one runs)
            hooks.add(root.register_forward_hook(self._on_root_forward_always, with_kwargs=True, always_call=True))
        self.watched.regions.install(hooks, self)
        self.attached = True
        self.rec.live = live
        self.rec.module_grads = live and self.grads == "modules"
        self.set_live(live)

    def close(self) -> None:
        """Remove the per-module hooks (the others are the hook set's)."""
        for h in self.module_hooks:
            h.remove()
        self.module_hooks = []
        self.live_now = False

    def new_record(self, step: int, live: bool, continued: bool = False, module_grads: bool = False) -> None:
        """Record step ``step`` afresh from here (``continued``: the same step goes on in a new record), every module
        watched as it runs or only at the boundaries (``live``), with the gradient at every module's output
        (``module_grads``, live only) whatever the level."""
        self.step = step
        self.rec = StepRecord(continued=continued)
        self.grads = "modules" if module_grads and live and self.level != "none" else self.level
        self.grads_judged = self.level == "modules"
        if self.attached:
            self.rec.live = live
            self.rec.module_grads = live and self.grads == "modules"
            self.set_live(live)
            if not live and self.found_entries:
                self.add_entries(self.found_entries)  # (after the live hooks are gone: never two on one module)
                self.found_entries = {}

    def _hook_module(self, module: nn.Module, info: ModuleInfo) -> Any:
        return module.register_forward_hook(functools.partial(self._on_forward, info), with_kwargs=True)

    def set_live(self, on: bool) -> None:
        """Watch every module's call as it runs (``on``), or only the model's own call; the current step's record
        says which (a step checked at its boundaries is replayed when it goes bad)."""
        if on == self.live_now or self.hooks.closed:
            return
        self.live_now = on
        if not on:
            for h in self.module_hooks:
                h.remove()
            self.module_hooks = []
            return
        at_forward = self.params_at_forward
        loose = self._on_entry_pre_forward
        for _, module in self.watched.modules:
            info = self.infos[id(module)]
            if info.is_root or id(module) in self.entries:
                continue  # hooked for good
            self.module_hooks.append(self._hook_module(module, info))
            # a module the loop calls on its own (not learnt yet): what a replay of its call needs
            self.module_hooks.append(module.register_forward_pre_hook(loose, with_kwargs=True))
            if at_forward:
                self.module_hooks.append(module.register_forward_pre_hook(self._on_pre_forward_params))

    def add_entries(self, found: dict[int, nn.Module]) -> None:
        """Watch these modules at their boundaries from now on (they are called outside any call of the model)."""
        for key, module in found.items():
            info = self.infos.get(key)
            if info is None or info.is_root or key in self.entries:
                continue
            self.entries[key] = module
            self.hooks.add(self._hook_module(module, info))
            self.hooks.add(module.register_forward_pre_hook(self._on_entry_pre_forward, with_kwargs=True))

    @contextlib.contextmanager
    def replaying(self) -> Iterator[StepRecord]:
        """A replay records into a fresh record, every module watched with module-level gradients; the step's own
        record, the hooks and the level are as before after it."""
        saved, was_live, grads, judged = self.rec, self.live_now, self.grads, self.grads_judged
        self.rec, self.rerunning = StepRecord(live=True, module_grads=True), True
        self.set_live(True)
        self.grads, self.grads_judged = "modules", True
        try:
            yield self.rec
        finally:
            self.grads, self.grads_judged = grads, judged
            if not was_live:
                self.set_live(False)
            self.rec, self.rerunning = saved, False

    # ------------------------------------------------------------------ the model's calls
    def begin_evaluation(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        """An evaluation / generation forward between training steps: recorded on its own (checked at its end), the
        training step's record put aside until it ends; what a replay of it would need is kept."""
        self.stash, self.rec = self.rec, StepRecord(live=self.live_now)
        self.forward_start = 0
        self.rec.root_calls.append(capture(module, args, kwargs, 0, self.watched.cuda_devices))

    def end_evaluation(self) -> StepRecord:
        """The evaluation forward ended: its record, and the training step's record back in place."""
        done, self.rec, self.stash = self.rec, self.stash, None
        return done

    def resume_training(self) -> None:
        """A training forward begins while an evaluation's record is in place (the evaluation raised midway)."""
        if self.stash is not None:
            self.rec, self.stash = self.stash, None

    def begin_call(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        """A training call of the model begins: where its frames start, and what a replay of it would need (also
        when every module is watched: the replay says whether a fault reproduces, and checks a fix)."""
        self.forward_start = len(self.rec.frames)
        self.rec.root_calls.append(capture(module, args, kwargs, self.forward_start, self.watched.cuda_devices))

    def joined(self, module: nn.Module, args: Any, kwargs: dict | None) -> None:
        """Attached while ``module``'s call was under way (from a global forward pre-hook: its own pre-forward hooks
        were read before they existed): begin that call as they would have. ``kwargs`` None: they were not seen (the
        call is then not replayed)."""
        root_region = self.watched.regions.root
        if root_region is not None and module is root_region.outer:
            self.region_enter(root_region, module, args, kwargs or {})
        elif root_region is None and module is self.watched.root:
            self._on_root_pre_forward(module, args, kwargs or {})
        else:
            return  # a wrapper around the model (the model's own call, hooked now, runs inside), or an entry
        if kwargs is None and self.rec.root_calls:
            self.rec.root_calls[-1].unseen = ("the monitor attached as this call began and could not read its keyword "
                                              "arguments")

    def forget_failed_call(self) -> None:
        """The call raised and nothing non-finite came before: its frames go; an evaluation's record ends."""
        del self.rec.frames[self.forward_start :]
        self.resume_training()

    # ------------------------------------------------------------------ forward
    def _on_forward(self, info: ModuleInfo, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _is_compiling() or not self.hooks.active:
            return
        if _graph_task() != -1:
            # activation recomputation (gradient checkpointing) inside the backward: not a new frame
            if self.grads == "modules" and torch.is_grad_enabled():
                self._hook_grads(info, output)  # reentrant checkpointing builds its graph only here
            return
        alone = not self.root_depth and not info.is_root and not self.rerunning
        if alone and not torch.is_grad_enabled() and not self.hf:
            return  # a submodule called on its own under no_grad (e.g. generate() running the encoder)
        if alone:  # (a submodule-only call ends a previous forward that awaits its end)
            self.events.loose_call_starting()
        self.record_call(info, module, args, kwargs, output)
        if info.is_root and self.root_depth <= 1 and not self.rerunning:
            self.root_done = True
            self.events.root_forward_ended()
        elif alone and self._outermost_call(module):
            if self.learning_entries:
                self.found_entries[id(module)] = module
            self.events.loose_call_ended()

    def _outermost_call(self, module: nn.Module) -> bool:
        """Is no other watched module's forward on the Python stack (``model.transformer(...)`` itself, not
        one of the blocks it runs)? Asked only for calls outside a forward of the root module."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                caller = frame.f_locals.get("self")
                if caller is not module and id(caller) in self.infos:
                    return False
            frame = frame.f_back
        return True

    def record_call(self, info: ModuleInfo, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """One forward frame: the module's inputs (context) and outputs (judged)."""
        rec = self.rec
        hf = self.hf
        at_forward = self.params_at_forward
        first = not rec.frames and not rec.continued
        now = info.at_once
        if not (hf or at_forward or now):  # the common case: labelled and measured with the calls around it
            frame = Frame(self.step, FWD, info, [], True, False, first)
            rec.frames.append(frame)
            if not rec.defer(frame, args, kwargs, output):
                rec.settle()
                frame.slots = rec.call_slots(args, kwargs, output, False)
        else:
            rec.settle()
            slots = self.measured_params.pop(id(module), []) if at_forward else []
            # transformers stops on a non-finite positional input, and only on what it sees (never on a keyword
            # input or a tensor inside a dict / ModelOutput); the monitor shows inputs as context
            if hf:
                values = [*visible_inputs(args, kwargs, True), *visible_outputs(output, True)]
                slots += [rec.slot(lb, v, seen, True, at_once=now) for lb, v, seen in values]
            else:
                slots += rec.call_slots(args, kwargs, output, now)
            rec.frames.append(Frame(self.step, FWD, info, slots, not at_forward, False, first))
        call = rec.root_calls[-1] if rec.root_calls and not self.rerunning else None
        if call is not None and not (info.is_root or call.module is module):
            call = None  # (the model's call, or a loose call's: a compiled model's call was kept by its outer module)
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
        if _is_compiling() or not self.hooks.active or _graph_task() != -1:
            return
        rec = self.rec
        self.measured_params[id(module)] = [
            rec.slot(name, p, True, self.hf, param=True) for name, p in module.named_parameters(recurse=False)
        ]

    def _on_root_pre_forward(self, module: nn.Module, args: Any, kwargs: dict | None = None) -> None:
        if _is_compiling() or not self.hooks.active or _graph_task() != -1 or self.rerunning:
            return
        if self.root_depth and not self._inside_root_forward(module):
            self.root_depth = 0  # a KeyboardInterrupt skipped the always-called hook: not really nested
            self.root_done = False
        self.root_depth += 1
        if self.root_depth > 1:  # a nested call of the root from inside its own forward
            return
        self.events.root_forward_starting(module, args, kwargs or {})

    def _on_entry_pre_forward(self, module: nn.Module, args: Any, kwargs: dict | None = None) -> None:
        """A module the loop calls on its own (``self.net(x)`` in a LightningModule's ``training_step``), watched at
        its boundaries like the model, or any module called outside the model while every module is watched: keep
        what a replay of this call would need (returns at once inside a call of the model)."""
        if _is_compiling() or not self.hooks.active or _graph_task() != -1 or self.rerunning or self.root_depth:
            return
        rec = self.rec
        if not torch.is_grad_enabled() or not self._outermost_call(module):
            return
        rec.root_calls.append(capture(module, args, kwargs or {}, len(rec.frames), self.watched.cuda_devices))

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
        if _is_compiling() or _graph_task() != -1 or self.rerunning:
            return
        self.root_depth = max(0, self.root_depth - 1)
        if self.root_done or self.root_depth or not self.hooks.active:
            self.root_done = False
            return
        self.events.root_forward_failed()

    def _hook_backward_seen(self, output: Any) -> None:
        """One cheap hook on the root output that notes that a backward ran (for skipped steps)."""
        for _, v in labelled_outputs(output):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                v.register_hook(self._on_backward_seen)
                return

    def _on_backward_seen(self, grad: torch.Tensor) -> None:
        self.rec.backward_ran = True

    # ------------------------------------------------------------------ backward
    def hook_param_grads(self) -> None:
        """Without a hooked optimizer, check the parameter gradients when each backward ends (on
        device, read with the step's flag): zero_grad() or the update may come before the step ends.
        A post-accumulate hook per parameter notices any backward that writes a gradient, whatever
        output the loss was computed from."""
        if self._grad_hooks_on or self.level == "none":
            return
        self._grad_hooks_on = True
        for p in self.watched.params:
            self.hooks.add(p.register_post_accumulate_grad_hook(self._on_param_grad))

    def _on_param_grad(self, param: torch.Tensor) -> None:
        if not self.hooks.active or self.events.optimizer_hooked():
            return
        rec = self.rec
        rec.backward_ran = True
        task = _graph_task()
        if task != rec.queued_task:  # once per backward (a backward that raised never ran its callback)
            rec.queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        rec = self.rec
        rec.queued_task = None
        if self.hooks.active:
            with_grad = [p for p in self.watched.params if p.grad is not None]
            rec.backward_grad_flags.extend(finite_flags_of([p.grad for p in with_grad]))
            rec.backward_grads.extend((p, weakref.ref(p.grad)) for p in with_grad)

    def receive_param_grad(self, info: ModuleInfo, label: str, grad: torch.Tensor) -> None:
        """A parameter receives its gradient in the backward (engines whose gradients are gone by the
        step, DeepSpeed): measured now, as a frame of its module, in backward order."""
        if not self.hooks.active:
            return
        rec = self.rec
        rec.backward_ran = True
        slot = measure(rec.buffer, label, grad, at_once=True)  # the engine moves it into its buckets right after
        last = rec.frames[-1] if rec.frames else None
        if last is not None and last.info is info and last.phase == BWD and last.slots[-1][LABEL].startswith("grad:"):
            last.slots.append(slot)  # the module's other parameters: one frame per module
        else:
            rec.frames.append(Frame(self.step, BWD, info, [slot]))

    def _hook_grads(self, info: ModuleInfo, output: Any) -> None:
        rec = self.rec
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
                targets.recorder = self
                rec.grad_targets[key] = (weakref.ref(v), targets, version)
                v.register_hook(targets)
            if source is None and rec.calls:  # its forward call waits: the source is known once it is measured
                rec.unsourced.append((key, weakref.ref(v), targets, len(targets) - 1))

    def _on_grad(self, targets: list, grad: torch.Tensor) -> None:
        if not self.hooks.active:
            return
        rec = self.rec
        rec.backward_ran = True
        rec.settle()  # (a forward that never reached its end, e.g. a re-run: its calls' sources are needed now)
        ref = None
        judged = self.grads_judged
        if type(grad) is torch.Tensor and grad.layout is torch.strided:  # the common case: into a window
            ref = rec.buffer.wait(grad, judged, grad._version)
        label = targets[0][1]
        measured = (label, *ref, None, grad.dtype, None, None, False, judged, None) if ref is not None else measure(
            rec.buffer, label, grad, judged)
        # (a replay's parameter gradients are the ones its own backward returned, not p.grad: replay.replay_call)
        params = self.watched.engine.grads_at_report and not self.rerunning
        step = self.step
        seen_modules = set()
        for info, label, source in targets:
            first_for_module = id(info) not in seen_modules
            seen_modules.add(id(info))
            rec.frames.append(Frame(step, BWD, info, [relabelled(measured, label, judged)], False,
                                    first_for_module and params, False, source))

    # ------------------------------------------------------------------ compiled regions' edges
    def region_enter(self, region: Region, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        if _is_compiling() or not self.hooks.active or _graph_task() != -1:
            return
        if region.is_root:
            self._on_root_pre_forward(module, args, kwargs)
        self.region_stack.append((region, len(self.rec.frames)))

    def region_exit(self, region: Region, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _is_compiling() or _graph_task() != -1:
            return
        top = self.region_stack[-1] if self.region_stack else None
        if top is None or top[0] is not region:
            return  # entered while the monitor was inactive or recomputing
        self.region_stack.pop()
        if not self.hooks.active:
            return
        rec = self.rec
        # the region ran eagerly after all (nothing to compile, or a re-run): its own hooks recorded it
        ran_eagerly = any(f.phase == FWD and f.info.module() is region.inner for f in rec.frames[top[1]:])
        recordable = self.root_depth or region.is_root or torch.is_grad_enabled() or self.rerunning
        if not ran_eagerly and recordable:
            self.record_call(region.info, region.inner, args, kwargs, output)
        if region.is_root and self.root_depth <= 1 and not self.rerunning:
            self.root_done = True
            self.events.root_forward_ended()

    def region_always(self, region: Region, module: nn.Module, *_: Any) -> None:
        if _is_compiling() or _graph_task() != -1:
            return
        if self.region_stack and self.region_stack[-1][0] is region:
            self.region_stack.pop()  # the forward raised: its exit never ran
        if region.is_root:
            self._on_root_forward_always(module, None, None, None)

    # ------------------------------------------------------------------ marks
    def mark(self, tensor: torch.Tensor, ctx: str) -> None:
        """Add a frame for an intermediate value, in execution order, without a host sync."""
        if _is_compiling():
            return
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"mark() needs a tensor, got {type(tensor).__name__}")
        if not self.hooks.active or _graph_task() != -1:  # not again in recomputation
            return
        info = ModuleInfo(ctx, "mark", weakref.ref(self.watched.root))
        rec = self.rec
        rec.settle()  # (in order: a marked module output is measured once)
        rec.frames.append(
            Frame(self.step, MARK, info, [rec.slot("value", tensor)], first_of_step=not rec.frames)
        )


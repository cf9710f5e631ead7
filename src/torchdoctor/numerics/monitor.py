"""NumericsMonitor: the first inf/nan in forward and backward, at one host sync per step.

Example usage::

    from torchdoctor import NumericsMonitor, NonFiniteError

    with NumericsMonitor(model, optimizer=opt) as mon:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            opt.step()        # the step is checked here, before the update is applied
            opt.zero_grad()

How it stays cheap: every module's forward hook hands its inputs and outputs to a window on their own
device, reduced to (abs min, abs max) per tensor a few multi-tensor ops at a time (:mod:`.stats`: well under
one dispatched op per module), and keeps only a host-side description of the call (:mod:`.frames`, recorded
by :mod:`.recording`). A tensor that was just measured as one module's output and comes in as the next
module's input is measured once. Parameters and their gradients do not change
before ``optimizer.step()``, so they are measured only when a report is built; the parameter gradients
are checked once per step. At the step boundary (:mod:`.stepping`) everything is folded into a single
on-device flag read with one ``.item()``.

The machinery around the model is met through an *engine adapter* (:mod:`.engines`): DDP, FSDP1/FSDP2,
accelerate and the HF Trainer, a DeepSpeed engine at any ZeRO stage. Compiled regions
(``torch.compile``) are watched at their edges and looked into only when they go bad (:mod:`.compiled`).

Module *inputs* are shown as context but do not by themselves stop a run (an additive ``-inf``
attention mask is a legitimate input); outputs, gradients, weights and marks do. After a
``NonFiniteError`` nothing of the step is kept: the update was refused and the module buffers
(``BatchNorm`` running statistics) are put back as the step began (:mod:`.buffers`); a loop that
catches the error and goes on is watched from the next step on.

Step boundaries, in order of preference: an optimizer step pre-hook (``optimizer=``; a non-finite
update is never applied), ``scaler.update()`` of a loss scaler passed as ``scaler=`` (a step the
scaler skipped), an explicit :meth:`NumericsMonitor.step`, or else the end of each forward of the root
module (or of the outermost watched module, when a loop calls only a submodule: ``model.transformer(...)``).
Steps are numbered from 0, like transformers' batch numbers. Earlier steps are kept as context only as far
as a report can show them (``max_frames`` frames), with the weights those frames ran with, measured as
their step ended (before the update when the optimizer is hooked).

Where a ``NonFiniteError`` surfaces: at the step boundary that found it, inside the ``with`` block (in
``optimizer.step()``, ``scaler.update()``, ``mon.step()`` or the next forward), except for the last step when
nothing inside the block ended it: that one is checked as the block exits and raised by the ``with`` statement,
so catch it with a ``try`` around the ``with`` (``try: with NumericsMonitor(...): ... except NonFiniteError``).
A closed monitor refuses a second ``with`` block (``RuntimeError``): make a new one.

Known limitations:
  - A loss scaler that is not passed as ``scaler=`` is recognised by its effect: a new forward starts
    after a backward while every gradient is None (``zero_grad()`` without an optimizer step). With
    ``zero_grad(set_to_none=False)`` such skipped steps are merged into the next step.
  - Without a hooked optimizer (steps ending at the next forward), the weights kept with an earlier step
    are measured after an update made before that forward.
  - Non-persistent buffers (derived tables, caches) are not put back after a detection.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

import torch
from torch import nn

from .engines import MonitorWarning, select_engine
from .engines.scalers import LossScaler, OverflowEvent
from .engines.wrappers import sharded
from .explain.causes import GrowthTrail
from .explain.report import NonFiniteReport
from .explain.trace import TraceWriter
from .judge.closures import ClosureSteps
from .judge.headroom import Headroom
from .judge.judging import Judging
from .judge.stepping import Stepping
from .measure.buffers import BufferGuard
from .measure.stats import fused_check_works
from .measure.windows import window_reduce_works
from .options import check_options, default_report_dir
from .record.compiled import Region, Regions
from .record.frames import ModuleInfo
from .record.recording import Recording
from .record.step import StepRecord
from .record.watched import describe

log = logging.getLogger("torchdoctor.numerics")

__all__ = ["NumericsMonitor", "OverflowEvent", "mark"]

# Every monitored module, whichever monitor watches it: attaching twice would double every hook.
_WATCHED: weakref.WeakKeyDictionary[nn.Module, NumericsMonitor] = weakref.WeakKeyDictionary()


def monitor_of(model: nn.Module) -> NumericsMonitor | None:
    """The live monitor that watches ``model`` or one of its modules, if any."""
    for module in model.modules():
        found = _WATCHED.get(module)
        if found is not None and not found._closed:
            return found
    return None


def mark(tensor: torch.Tensor, label: str) -> None:
    """``torchdoctor.mark(x, "after attention")``: ``mon.mark`` for whichever monitor watches the model now running
    (the one whose forward is in flight; outside a forward, every live one), so it works however the monitor was
    attached -- the library, a Trainer callback, ``torchdoctor run --numerics`` -- and does nothing without one."""
    live = list({id(m): m for m in list(_WATCHED.values()) if not m._closed}.values())
    running = [m for m in live if m._root_depth > 0 or m._rerunning]
    for monitor in running or live:
        monitor.mark(tensor, label)


def _dist_rank_world() -> tuple[int | None, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None, 1


class NumericsMonitor(Recording, Stepping, Judging):
    """Watch a model for inf/nan in weights, activations and gradients; explain the first one.

    Args:
        model (nn.Module): the model, or what wraps it: DDP / DataParallel / FSDP / ``torch.compile`` /
            accelerate's prepared model / the engine ``deepspeed.initialize`` returns (whose optimizer
            is then found and hooked too).
        optimizer (optional): checked before it steps, so a step with a non-finite value raises before
            any parameter or optimizer state changes: a torch optimizer (also inside accelerate's or
            Lightning's wrapper), DeepSpeed's ZeRO / fp16 / bf16 optimizer, or anything with ``step()``.
            Without it the gradients are checked when each backward ends, but the update cannot be stopped.
        watch (str): how much of a healthy step is watched. ``"boundaries"`` (default): only what a step begins
            and ends with -- the model's outputs for each micro-batch, ``mark()``-ed values and the parameter
            gradients, checked with the one host read per step -- so a healthy step costs little more than that
            read; a step that goes bad is replayed (same inputs, RNG state, autocast) with every module watched,
            which names the module, slot and phase where it began, and says whether the fault reproduced.
            ``"every-module"``: every module's call is recorded as it runs (inputs, outputs, gradients at
            ``grads="modules"``), the way ``trace_steps`` and transformers' detector see a step; it costs a few
            tens of microseconds per module call, and a report also shows earlier steps' module frames. Without
            ``optimizer`` (the step is then checked after its update, when a replay would run on other weights),
            for models whose forward makes collectives (ZeRO-3, FSDP with several ranks) and in compat mode,
            every module is watched.
        grads (str): ``"params"`` (default) checks every parameter gradient once per step (on device);
            ``"modules"`` also measures the gradient at every module output, which names the module
            where a backward blow-up starts (a replay at ``watch="boundaries"`` always does); ``"none"``
            watches the forward only.
        transient (str): what to do with a step whose fault did not reproduce when replayed (a transient fault
            of the device or a kernel): ``"raise"`` (default) a :class:`NonFiniteError` as for any other, or
            ``"skip"``: refuse that step's update (its gradients are dropped), record it in :attr:`transients`,
            warn, and go on. Needs the optimizer (the check must come before the update); never retries a step.
        headroom (bool): warn once per module when its values come within 2x of its dtype's largest value, with
            the trend (growth per 100 steps, steps left at that rate): every ``headroom_every``-th step is watched
            every module, each module's largest value kept on the device; the warning is logged, raised as a
            :class:`HeadroomWarning` and appended to ``torchdoctor-headroom[-rank<r>].jsonl`` in ``report_dir``;
            the warnings so far are in :attr:`headroom_events`. Defaults to False.
        headroom_every (int): the steps between two headroom measurements. Defaults to 100.
        scaler (optional): a loss scaler (``torch.amp.GradScaler``, DeepSpeed's ``DynamicLossScaler``,
            or anything with ``get_scale()`` and ``update()``). Its overflows are recorded in
            :attr:`overflows`, not raised, unless the scale falls below ``min_loss_scale`` (or reaches
            DeepSpeed's own floor) or ``max_consecutive_overflows`` steps overflow in a row. A DeepSpeed
            engine's own loss scaler is found without being passed.
        max_frames (int): frames shown before the first bad one. Defaults to 21.
        trace_steps (Iterable[int], optional): steps whose every frame is printed and written to
            ``torchdoctor-trace-rank<r>.jsonl``.
        abort_after_step (int, optional): raise :class:`AbortAfterStep` once step N has finished.
        report_dir (str, optional): where ``torchdoctor-nonfinite-rank<r>.txt`` / ``.json`` are written (default:
            ``$TORCHDOCTOR_REPORT_DIR``, the folder ``torchdoctor run`` gives the processes it starts, else the
            current directory).
        auto_localize (bool): with every module watched, after a gradient overflow seen at ``"params"`` level,
            switch to ``"modules"`` so the next one is localized (at the boundaries each one is replayed).
            Defaults to True.
        sync_ranks (bool, optional): under torch.distributed, share the step's verdict with one tiny
            all_reduce so that every rank stops together (default: when initialized with >1 rank).
        manual_steps (bool): steps end only at :meth:`step`, from the very first one (otherwise that
            is known only once step() is first called; say so when a step has several forwards). The check
            then runs at step(), not in front of the optimizer: call it before ``optimizer.step()``.
        stream (TextIO, optional): where traces are printed. Defaults to sys.stdout.

    Attributes:
        report (NonFiniteReport | None): the last detection, the one raised as :class:`NonFiniteError`.
        warnings (list[NonFiniteReport]): findings the run survives, in order: a step whose loss (the model's own
            ``loss`` output, its only or first output when that is a scalar, a loss module's output, or a ``mark()``
            after its forward) is inf while every gradient is finite, whatever rule explains it. Each is
            written to ``torchdoctor-nonfinite-loss-rank<r>.txt`` / ``.json``, logged, and warned about
            (:class:`NonFiniteWarning`, with the report's path); its update is applied and the run goes on.
        overflows (list[OverflowEvent]): steps a loss scaler skipped.
        transients (list[NonFiniteReport]): steps skipped with ``transient="skip"`` (their fault did not reproduce).
        headroom_events (list[HeadroomEvent]): the headroom warnings given so far (``headroom=True``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        *,
        grads: str = "params",
        watch: str = "boundaries",
        transient: str = "raise",
        headroom: bool = False,
        headroom_every: int = 100,
        scaler: Any = None,
        max_frames: int = 21,
        trace_steps: Iterable[int] | None = None,
        abort_after_step: int | None = None,
        report_dir: str | os.PathLike | None = None,
        auto_localize: bool = True,
        min_loss_scale: float = 1.0,
        max_consecutive_overflows: int = 30,
        sync_ranks: bool | None = None,
        manual_steps: bool = False,
        stream: TextIO | None = None,
        _hf: bool = False,
        _via: str = "monitor",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NumericsMonitor needs an nn.Module, got {type(model).__name__}")
        traced = check_options(
            grads=grads, watch=watch, transient=transient, max_frames=max_frames, trace_steps=trace_steps,
            abort_after_step=abort_after_step, headroom=headroom, headroom_every=headroom_every,
            report_dir=report_dir, min_loss_scale=min_loss_scale,
            max_consecutive_overflows=max_consecutive_overflows, stream=stream,
        )
        if scaler is not None:
            LossScaler(scaler)  # refuses what is not a loss scaler, before anything is attached
        self._engine = select_engine(model, optimizer, scaler)
        for text in self._engine.warnings:
            warnings.warn("torchdoctor: " + text, MonitorWarning, stacklevel=2)
        self.model = self._engine.root
        self.optimizer = self._engine.optimizer
        self._scaler = self._engine.scaler
        self.scaler = self._scaler.obj if self._scaler is not None else None
        self.grads = grads
        self.watch = watch
        self.transient = transient
        self._headroom = Headroom(operator.index(headroom_every)) if headroom else None
        self.watching = describe(model, self.optimizer, grads)  # what it watches, in one line (watched.describe)
        self.max_frames = operator.index(max_frames)
        self.trace_steps = traced
        self.abort_after_step = None if abort_after_step is None else operator.index(abort_after_step)
        self.report_dir = os.fspath(default_report_dir() if report_dir is None else report_dir)
        self.auto_localize = auto_localize
        self.min_loss_scale = min_loss_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        self.stream = stream
        self._hf = _hf
        self._via = _via  # how the user attached it: the form of the options the advice names (diagnosis.Setup)
        rank, world = _dist_rank_world()
        self.rank = rank if world > 1 else None
        self._world = world
        self._sync_ranks = (world > 1) if sync_ranks is None else (sync_ranks and world > 1)

        self.step_index = 0
        self.overflows: list[OverflowEvent] = []
        self.transients: list[NonFiniteReport] = []
        self.report: NonFiniteReport | None = None
        self.warnings: list[NonFiniteReport] = []  # findings the run survives (an inf loss, finite gradients)
        self._judged_frames = None  # a bad step's resolved frames, while it is judged
        self._consecutive_overflows = 0
        self._manual = manual_steps
        self._optimizer_stepped = False
        self._closures = ClosureSteps(self._check_closure, self._rewrite_report)
        # manual steps with an optimizer given: the last step whose optimizer.step() came before its mon.step(), and
        # whether any did (the check then followed the update: what a report's advice says)
        self._updated_in: int | None = None
        self._late_check = False
        self._tracer = TraceWriter(self.report_dir, self.rank, stream)
        self._stash: StepRecord | None = None  # the training step, while an evaluation forward records
        self._deferred_report: NonFiniteReport | None = None  # DDP: an evaluation pass went bad
        self._root_depth = 0  # root forwards in flight
        self._root_done = False  # the root's own hook ran (so the always-called hook knows it did not fail)
        self._forward_pending = False  # forward-bounded steps: a training forward awaits its backward
        self._forward_start = 0  # index in the step's frames where the current root forward began
        self._grad_hooks_on = False
        self._rerunning = False  # a replay (replay.py) is recording
        self._module_hooks: list[Any] = []  # every module's forward hook, while steps are watched module by module
        self._live_now = False  # those hooks are in place
        self._modules: list[tuple[str, nn.Module]] | None = None  # the watched modules (once attached)
        # modules the loop calls on their own, outside any call of the model (a LightningModule's training_step
        # calling self.net): watched at their boundaries like the model, once a step showed them (one step watched
        # every module after a step at the boundaries recorded no call at all)
        self._entries: dict[int, nn.Module] = {}
        self._learning_entries = False
        self._found_entries: dict[int, nn.Module] = {}
        self._live_default = True  # watched module by module unless a step is traced (decided at attach)
        self._cuda_devices: tuple[int, ...] = ()  # the GPUs whose RNG state a replay restores
        self._region_stack: list[tuple[Region, int]] = []  # regions in flight: where their frames begin
        self._warned_unseen = False  # said once: a step without any recorded forward
        self._self_bad = False  # this rank's own flags in the step being judged
        self._measured_params: dict[int, list] = {}  # ZeRO-3: weights measured as their module's forward began
        self._history: deque[StepRecord] = deque()
        self._growth = GrowthTrail()  # recent healthy steps' largest values, on the device (divergence)
        self._buffers: BufferGuard | None = None
        self._just_reported = False  # a report was made and nothing has run since
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any, Any]] = []
        self._active = False
        self._closed = False
        self._at_exit = False  # the last step is being checked as the with block exits
        self._regions = Regions(model, self.model)
        self._new_step()
        try:
            self._attach()
        except BaseException:
            self.close()  # a refused or failed attach leaves no hook behind
            raise
        self.watching = describe(model, self.optimizer, grads, self.watch_level, self.headroom_every)

    # ------------------------------------------------------------------ lifecycle
    def _attach(self) -> None:
        engine = self._engine
        modules = list(engine.modules())
        for old in {id(o): o for _, m in modules if (o := _WATCHED.get(m)) is not None}.values():
            if old._replaceable_by(self):
                log.info("torchdoctor: a new monitor on this model replaces the previous one")
                old.close()
        taken = [name or "<root>" for name, m in modules if m in _WATCHED]
        if taken:
            raise RuntimeError(
                f"{len(taken)} module(s) of this model are already watched by another monitor "
                f"(e.g. {', '.join(taken[:3])}); close() it first -- hooks are never doubled"
            )
        self._infos: dict[int, ModuleInfo] = {}
        self._params = engine.trainable()
        devices = {p.device for p in self._params if p.device.type != "meta"} | {torch.device("cpu")}
        for device in devices:  # (inputs and losses may be on the CPU when the model is not)
            # their host syncs here, at attach time, never inside a step
            if device.type != "cpu":
                fused_check_works(device)
            window_reduce_works(device)
        self._cuda_devices = tuple(sorted({d.index or 0 for d in devices if d.type == "cuda"}))
        root_region = self._regions.root
        self._modules = modules
        for name, module in modules:
            is_root = module is self.model and root_region is None
            info = ModuleInfo(name, engine.class_name(module), weakref.ref(module), is_root=is_root)
            self._infos[id(module)] = info
            _WATCHED[module] = self
            if is_root:  # the model's own call is watched at every level; the other modules by _set_live
                self.add_handle(self._hook_module(module, info))
                if engine.params_at_forward:
                    self.add_handle(module.register_forward_pre_hook(self._on_pre_forward_params))
        if root_region is None:
            self.add_handle(self.model.register_forward_pre_hook(self._on_root_pre_forward, with_kwargs=True))
            # runs after the root's own hook, and also when the forward raises (then only this one runs)
            self.add_handle(
                self.model.register_forward_hook(self._on_root_forward_always, with_kwargs=True, always_call=True)
            )
        self._regions.install(self)
        # watched every module where a replay could not be trusted (replay.py): without an optimizer the check comes
        # after the update, when a replay would run on other weights; a model whose forward makes collectives
        # cannot be replayed on one rank
        self._live_default = self.watch == "every-module" or self._hf or self.optimizer is None \
            or engine.params_at_forward or (self._world > 1 and sharded(self.model))
        self._rec.live = self._live_default or self.step_index in self.trace_steps
        self._set_live(self._rec.live)  # (every later step decides again as it begins: stepping._new_step)
        engine.install(self)
        self._buffers = BufferGuard(m for _, m in modules)
        self._buffers.start()
        self._active = True
        if not self._optimizer_hooked() and not self._hf:
            self._hook_param_grads()
        engine.attach_grad_watch(self)
        if not self._hf:  # transformers reports broken weights in the first forward's frames instead
            self._check_weights_once()

    @property
    def headroom_events(self) -> list:
        return [] if self._headroom is None else list(self._headroom.events)

    @property
    def headroom_every(self) -> int | None:
        """Steps between two headroom measurements; None without ``headroom=True``."""
        return None if self._headroom is None else self._headroom.every

    @property
    def watch_level(self) -> str:
        """The level healthy steps are watched at: ``watch``, unless the model or the setup needs every module
        (no optimizer, collectives in the forward, compat mode)."""
        return "every-module" if self._live_default else "boundaries"

    def _hook_module(self, module: nn.Module, info: ModuleInfo) -> Any:
        return module.register_forward_hook(functools.partial(self._on_forward, info), with_kwargs=True)

    def _set_live(self, on: bool) -> None:
        """Watch every module's call as it runs (``on``), or only the model's own call; the current step's record
        says which (a step checked at its boundaries is replayed when it goes bad)."""
        if on == self._live_now or self._closed:
            return
        self._live_now = on
        if not on:
            for h in self._module_hooks:
                h.remove()
            self._module_hooks = []
            return
        at_forward = self._engine.params_at_forward
        for _, module in self._modules:
            info = self._infos[id(module)]
            if info.is_root or id(module) in self._entries:
                continue  # hooked for good
            self._module_hooks.append(self._hook_module(module, info))
            if at_forward:
                self._module_hooks.append(module.register_forward_pre_hook(self._on_pre_forward_params))

    def _add_entries(self, found: dict[int, nn.Module]) -> None:
        """Watch these modules at their boundaries from now on (they are called outside any call of the model)."""
        for key, module in found.items():
            info = self._infos.get(key)
            if info is None or info.is_root or key in self._entries:
                continue
            self._entries[key] = module
            self.add_handle(self._hook_module(module, info))
            self.add_handle(module.register_forward_pre_hook(self._on_entry_pre_forward, with_kwargs=True))

    @contextlib.contextmanager
    def _live_hooks(self) -> Iterator[None]:
        """Every module watched, module-level gradients included, for a replay; as before after it."""
        was_live, grads = self._live_now, self.grads
        self._set_live(True)
        self.grads = "modules"
        try:
            yield
        finally:
            self.grads = grads
            if not was_live:
                self._set_live(False)

    def _replaceable_by(self, new: NumericsMonitor) -> bool:
        """A detector made again on the same model (``Trainer.train()`` twice) replaces the previous one;
        so does any monitor once this one has reported. Two live monitors are refused."""
        return (self._hf and new._hf) or self.report is not None or self._via == "switch"

    def _joined_mid_step(self) -> None:
        """Attached from inside the first ``optimizer.step()`` (``torchdoctor run --numerics``): that step's forward
        ran before the monitor existed, so it has no frames to expect; its gradients are still checked before its
        update is applied."""
        self._warned_unseen = True

    def add_handle(self, handle: Any) -> None:
        """Keep a hook handle; close() removes it."""
        self._handles.append(handle)

    def wrap(self, obj: Any, attr: str, before: Any, after: Any = None) -> None:
        """Shadow ``obj.attr`` with an instance attribute that calls ``before(*args, **kwargs)`` first
        (and ``after`` once it returned); undone by close(). Both are no-ops once this monitor is closed."""
        original = getattr(obj, attr)

        @functools.wraps(original)  # keeps what wrappers set on it (LR schedulers' _wrapped_by_lr_sched)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            replaced = before(*args, **kwargs)
            if replaced is not None:  # new (args, kwargs), as a torch step pre-hook may return
                args, kwargs = replaced
            out = original(*args, **kwargs)
            if after is not None:
                after(*args, **kwargs)
            return out

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
        self._closed = True
        for h in self._handles + self._module_hooks:
            h.remove()
        self._handles = []
        self._module_hooks = []
        self._live_now = False
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
        self._regions.close()
        self._release_modules()
        self._tracer.close()

    remove = close

    def __enter__(self) -> NumericsMonitor:
        """The monitor attached when it was made; a closed one refuses a second ``with`` block (its hooks
        are gone: it would watch nothing) instead of silently watching nothing."""
        if self._closed:
            raise RuntimeError(
                "torchdoctor: this NumericsMonitor is closed (its with block ended, or close() was called), so it "
                "watches nothing; make a new one for this block: with NumericsMonitor(model, ...) as mon:"
            )
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        """Check the last, still open step. A detection here is raised by the ``with`` statement itself, so a
        ``try`` inside the block cannot see it: put the ``try`` around the ``with`` (the report says so)."""
        try:
            open_step = not self._rec.empty or self._deferred_report is not None
            if exc_type is None and self._active and (open_step or self._sync_ranks):
                self._at_exit = True
                self._close_step("final", advance=open_step)  # (an empty step shared under DDP: not counted)
        finally:
            self._at_exit = False
            self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        if getattr(self, "_active", False):
            self.close()

    def _release_modules(self) -> None:
        for module in list(_WATCHED.keys()):
            if _WATCHED.get(module) is self:
                del _WATCHED[module]

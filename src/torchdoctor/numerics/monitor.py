"""NumericsMonitor: the first inf/nan in forward and backward, at one host sync per step.

Example usage::

    from torchdoctor import NumericsMonitor, NonFiniteError

    with NumericsMonitor(model, optimizer=opt) as mon:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            opt.step()        # the step is checked here, before the update is applied
            opt.zero_grad()

How it stays cheap: a healthy step is watched at its boundaries (each micro-batch's model outputs, marks, the
parameter gradients), reduced to (abs min, abs max) per tensor on their own device, and folded into a single
on-device flag read with one ``.item()`` per step; a step that goes bad is replayed with every module watched.

The monitor is the parts below, each owning its state, wired here and handed only what it needs (the data's way:
hook -> window -> step record -> verdict -> replay -> report; DESIGN.md "The monitor's parts"):

* :class:`~.record.watched.WatchedModel` -- the model met once at the door: the user's module under any wrappers,
  its modules' names and classes, the engine adapter (:mod:`.engines`: DDP, FSDP1/FSDP2, accelerate, the HF
  Trainer, DeepSpeed at any ZeRO stage), the compiled regions (:mod:`.record.compiled`), parameters, devices;
* :class:`~.engines.hookset.HookSet` -- every hook and shadowed method, removed together;
* :class:`~.record.recorder.Recorder` -- the hooks, and the step's record they write into (:mod:`.record.step`,
  :mod:`.measure`);
* :class:`~.judge.steps.Steps` -- when a step ends, its one host read (:class:`~.judge.check.StepCheck`), what
  is kept of it (:class:`~.judge.history.History`), and carrying out the judge's decision;
* :class:`~.judge.judging.Judge` -- a bad step's report, agreed across ranks, and what to do with it;
* :class:`~.judge.replay.Replayer` -- a bad micro-batch run again with every module watched;
* :class:`~.judge.reporter.Reporter` -- the findings kept and written.

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

import functools
import logging
import operator
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import torch
from torch import nn

from .engines import MonitorWarning
from .engines.hookset import HookSet
from .engines.scalers import LossScaler, OverflowEvent
from .explain.report import NonFiniteReport
from .explain.trace import TraceWriter
from .judge.check import StepCheck
from .judge.fixcheck import FixChecker
from .judge.headroom import Headroom
from .judge.history import History
from .judge.judging import Judge
from .judge.replay import Replayer
from .judge.reporter import Reporter
from .judge.steps import Steps, narrow_optimizer
from .measure.stats import fused_check_works
from .measure.windows import window_reduce_works
from .options import check_options, default_report_dir
from .record.recorder import Recorder
from .record.watched import WatchedModel
from .timeline.steps import Timeline
from .timeline.store import TimelineWriter

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
    running = [m for m in live if m._recorder.root_depth > 0 or m._recorder.rerunning]
    for monitor in running or live:
        monitor.mark(tensor, label)


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("torchdoctor")
    except importlib.metadata.PackageNotFoundError:  # (run from a source tree that was not installed)
        return "unknown"


def _dist_rank_world() -> tuple[int | None, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None, 1


class NumericsMonitor:
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
        record (str, optional): a folder to record the run's numerics timeline into: every ``record_every``-th step is
            watched every module (module-level gradients too), each module's (abs min, abs max) kept on the device
            and appended to ``record/rank<r>/`` every ``record_flush`` recorded steps with one host read, before a
            :class:`NonFiniteError` is raised, and as the monitor closes (:mod:`.timeline`; read it with
            ``torchdoctor numerics show``). Defaults to None (nothing recorded).
        record_every (int): steps between two recorded ones (the others cost the default). Defaults to 1.
        record_flush (int): recorded steps kept on the device between two writes. Defaults to 50.

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
        record: str | os.PathLike | None = None,
        record_every: int = 1,
        record_flush: int = 50,
        _hf: bool = False,
        _via: str = "monitor",
        _steps: Callable[..., Steps] = Steps,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NumericsMonitor needs an nn.Module, got {type(model).__name__}")
        traced = check_options(
            grads=grads, watch=watch, transient=transient, max_frames=max_frames, trace_steps=trace_steps,
            abort_after_step=abort_after_step, headroom=headroom, headroom_every=headroom_every,
            report_dir=report_dir, min_loss_scale=min_loss_scale,
            max_consecutive_overflows=max_consecutive_overflows, stream=stream, record=record,
            record_every=record_every, record_flush=record_flush,
        )
        if scaler is not None:
            LossScaler(scaler)  # refuses what is not a loss scaler, before anything is attached
        rank, world = _dist_rank_world()
        self._watched = watched = WatchedModel(model, optimizer, scaler, world)
        for text in watched.engine.warnings:
            warnings.warn("torchdoctor: " + text, MonitorWarning, stacklevel=2)
        self.model = watched.root
        self.optimizer = watched.optimizer
        self.scaler = watched.scaler.obj if watched.scaler is not None else None
        self.watch = watch
        self.transient = transient
        self.max_frames = operator.index(max_frames)
        self.trace_steps = traced
        self.abort_after_step = None if abort_after_step is None else operator.index(abort_after_step)
        self.report_dir = os.fspath(default_report_dir() if report_dir is None else report_dir)
        self.auto_localize = auto_localize
        self.min_loss_scale = min_loss_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        self.stream = stream
        self._hf = _hf
        self._via = _via  # how the user attached it: the form of the options the advice names (diagnosis_types.Setup)
        self.rank = rank if world > 1 else None
        self._world = world
        sync = (world > 1) if sync_ranks is None else (sync_ranks and world > 1)
        eps = narrow_optimizer(watched.optimizer)
        if eps is not None:  # (an update from finite gradients: no check of the step's values can stop it)
            tried = not sync and not manual_steps
            how = ("each update is tried on a copy before it is applied (a copy of the weights, their gradients and "
                   "the optimizer's state per step, where the step is checked in front of the optimizer, not at "
                   "mon.step()), and one that makes a weight non-finite is stopped" if tried else
                   "it cannot be stopped before it is applied " + ("with several ranks checked together" if sync else
                                                                   "with steps that end at mon.step()"))
            warnings.warn(f"torchdoctor: {eps}. Such an update comes from finite gradients: {how}. Give the optimizer "
                          "an eps fp16 holds (eps=1e-4), keep the weights in fp32 and compute in fp16 under autocast "
                          "(Lightning: precision='16-mixed'), or train in bf16", MonitorWarning, stacklevel=2)
        self._headroom = Headroom(operator.index(headroom_every)) if headroom else None

        self._hooks = hooks = HookSet()
        self._recorder = recorder = Recorder(watched, hooks, grads, _hf)
        history = History(self.max_frames)
        self._reporter = reporter = Reporter(self.report_dir, self.rank)
        reporter.watching = watched.describe(grads)  # what it watches, in one line (said fully once attached)
        check = StepCheck(watched.engine, watched.params, sync)
        replayer = Replayer(recorder, watched, history, self.max_frames, self.rank, _hf)
        judge = Judge(watched, recorder, history, replayer, reporter, check, FixChecker(replayer, watched),
                      max_frames=self.max_frames,
                      rank=self.rank, hf=_hf, transient=transient, auto_localize=auto_localize,
                      min_loss_scale=min_loss_scale, max_consecutive_overflows=max_consecutive_overflows)
        self._replace_earlier(watched.modules)  # (before a recording opens a folder an earlier monitor may hold)
        timeline = None
        if record is not None:
            timeline = Timeline(TimelineWriter(os.fspath(record), self.rank, {
                "rank": self.rank, "world_size": world, "torch": torch.__version__, "torchdoctor": _version(),
                "watching": reporter.watching, "record_every": operator.index(record_every)},
                operator.index(record_flush)), operator.index(record_every))
        self._steps = _steps(watched=watched, hooks=hooks, recorder=recorder, history=history, check=check,
                             judge=judge, replayer=replayer, reporter=reporter, manual=manual_steps,
                             trace_steps=traced, abort_after_step=self.abort_after_step, max_frames=self.max_frames,
                             rank=self.rank, hf=_hf, via=_via, headroom=self._headroom,
                             tracer=TraceWriter(self.report_dir, self.rank, stream), stop=self._stop,
                             timeline=timeline)
        recorder.events = self._steps
        self._judge = judge
        self._steps.new_step()
        try:
            self._attach()
        except BaseException:
            self.close()  # a refused or failed attach leaves no hook behind
            raise
        reporter.watching = watched.describe(grads, self.watch_level, self.headroom_every, self.record_every)
        if timeline is not None:
            timeline.writer.update_settings(watching=reporter.watching)

    # ------------------------------------------------------------------ lifecycle
    def _replace_earlier(self, modules: list) -> None:
        """Close the earlier monitors of this model that this one replaces (:meth:`_replaceable_by`)."""
        for old in {id(o): o for _, m in modules if (o := _WATCHED.get(m)) is not None}.values():
            if old._replaceable_by(self):
                log.info("torchdoctor: a new monitor on this model replaces the previous one")
                old.close()

    def _attach(self) -> None:
        watched, recorder, steps, hooks = self._watched, self._recorder, self._steps, self._hooks
        modules = watched.modules
        taken = [name or "<root>" for name, m in modules if m in _WATCHED]
        if taken:
            raise RuntimeError(
                f"{len(taken)} module(s) of this model are already watched by another monitor "
                f"(e.g. {', '.join(taken[:3])}); close() it first -- hooks are never doubled"
            )
        for device in watched.devices:  # (inputs and losses may be on the CPU when the model is not)
            # their host syncs here, at attach time, never inside a step
            if device.type != "cpu":
                fused_check_works(device)
            window_reduce_works(device)
        for _, module in modules:
            _WATCHED[module] = self
        # watched every module where a replay could not be trusted (replay.py): without an optimizer the check comes
        # after the update, when a replay would run on other weights; a model whose forward makes collectives
        # cannot be replayed on one rank
        recorder.live_default = self.watch == "every-module" or self._hf or self.optimizer is None \
            or watched.engine.params_at_forward or watched.sharded
        # (the first step is watched every module, unless compiled; every later step decides again: Steps.new_step)
        recorder.attach(recorder.live_default or not watched.regions or steps.index in self.trace_steps)
        watched.engine.install(hooks, steps)
        steps.start()
        hooks.active = True
        if not steps.optimizer_hooked() and not self._hf:
            recorder.hook_param_grads()
        if recorder.level != "none":
            watched.engine.attach_grad_watch(hooks, iter(watched.infos.values()), recorder.receive_param_grad)
        if not self._hf:  # transformers reports broken weights in the first forward's frames instead
            bad = self._judge.check_weights()
            if bad is not None:
                steps.raise_(bad)

    # ------------------------------------------------------------------ what it found, what it watches
    @property
    def step_index(self) -> int:
        """The step under way, counted from 0 (transformers' batch numbers)."""
        return self._steps.index

    @property
    def grads(self) -> str:
        """The gradient level: ``"none"``, ``"params"`` or ``"modules"`` (``"modules"`` once ``auto_localize`` switched
        it after an overflow)."""
        return self._recorder.level

    @grads.setter
    def grads(self, value: str) -> None:
        self._recorder.level = self._recorder.grads = value

    @property
    def report(self) -> NonFiniteReport | None:
        return self._reporter.report

    @report.setter
    def report(self, value: NonFiniteReport | None) -> None:
        self._reporter.report = value

    @property
    def warnings(self) -> list[NonFiniteReport]:
        return self._reporter.warnings

    @warnings.setter
    def warnings(self, value: list[NonFiniteReport]) -> None:
        self._reporter.warnings = value  # (a Trainer callback's list, one for the whole of train() / fit())

    @property
    def overflows(self) -> list[OverflowEvent]:
        return self._reporter.overflows

    @property
    def transients(self) -> list[NonFiniteReport]:
        return self._reporter.transients

    @property
    def watching(self) -> str:
        """What it watches, in one line: ``GPT2LMHeadModel (124M params) with AdamW, DDP, grads=params, ...``."""
        return self._reporter.watching

    @watching.setter
    def watching(self, value: str | Callable[[], str]) -> None:
        """A line, or a callable that makes it when first needed."""
        self._reporter.watching = value

    @property
    def via(self) -> str:
        """How it was attached: ``monitor`` (``NumericsMonitor(...)``), ``hf`` / ``lightning`` (a callback),
        ``switch`` (``torchdoctor run --numerics``)."""
        return self._via

    @property
    def headroom_events(self) -> list:
        return [] if self._headroom is None else list(self._headroom.events)

    @property
    def headroom_every(self) -> int | None:
        """Steps between two headroom measurements; None without ``headroom=True``."""
        return None if self._headroom is None else self._headroom.every

    @property
    def record_every(self) -> int | None:
        """Steps between two recorded ones; None without ``record=``."""
        timeline = self._steps.timeline
        return None if timeline is None else timeline.every

    @property
    def watch_level(self) -> str:
        """The level healthy steps are watched at: ``watch``, unless the model or the setup needs every module
        (no optimizer, collectives in the forward, compat mode)."""
        return "every-module" if self._recorder.live_default else "boundaries"

    @property
    def _closed(self) -> bool:
        return self._hooks.closed

    # ------------------------------------------------------------------ steps and marks
    def step(self) -> None:
        """End a training step by hand: check it, then start the next. With an optimizer given, call it before
        ``optimizer.step()`` (and ``zero_grad()``): a bad step then raises before its update is applied."""
        self._steps.step()

    def mark(self, tensor: torch.Tensor, ctx: str) -> None:
        """Add a frame for an intermediate value, in execution order, without a host sync."""
        self._recorder.mark(tensor, ctx)

    # (the engine's hooks, kept under their names: what an optimizer or a loss scaler calls)
    def on_pre_step_hook(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return self._steps.on_pre_step_hook(optimizer, args, kwargs)

    def on_pre_step(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict] | None:
        return self._steps.on_pre_step(*args, **kwargs)

    def on_post_step(self, *args: Any, **kwargs: Any) -> None:
        self._steps.on_post_step(*args, **kwargs)

    def on_scaler_update(self, *args: Any, **kwargs: Any) -> None:
        self._steps.on_scaler_update(*args, **kwargs)

    def on_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self._steps.on_zero_grad(*args, **kwargs)

    def _replaceable_by(self, new: NumericsMonitor) -> bool:
        """A detector made again on the same model (``Trainer.train()`` twice) replaces the previous one;
        so does any monitor once this one has reported. Two live monitors are refused."""
        return (self._hf and new._hf) or self.report is not None or self._via == "switch"

    def _joined_mid_step(self) -> None:
        """Attached from inside the first ``optimizer.step()`` (``torchdoctor run --numerics``): that step's forward
        ran before the monitor existed, so it has no frames to expect; its gradients are still checked before its
        update is applied."""
        self._steps.warned_unseen = True

    def _joined_in_forward(self, module: nn.Module, args: tuple, kwargs: dict | None) -> None:
        """Attached from a global forward pre-hook of ``module``'s call under way (``torchdoctor run --numerics`` at a
        loop's first training forward): begin that call as the monitor's own pre-forward hooks would have."""
        self._recorder.joined(module, args, kwargs)

    def _step_through_call(self, module: nn.Module, name: str) -> None:
        """The loop calls ``module.<name>(...)`` instead of the module (a LightningModule's ``training_step`` under
        automatic optimization): route that call through ``module.__call__`` with ``forward`` set to it for the call,
        as Lightning's own DDP wrapper does, so that it is the model's call -- hooked at its boundaries, kept for a
        replay, and replayed whole (every submodule it calls, and the loss it returns). Undone by close()."""
        original = getattr(module, name)

        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            saved = module.__dict__.get("forward")
            module.forward = original
            try:
                return module(*args, **kwargs)
            finally:
                if saved is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = saved

        self._hooks.replace(module, name, routed)

    def add_handle(self, handle: Any) -> None:
        """Keep a hook handle; close() removes it."""
        self._hooks.add(handle)

    def wrap(self, obj: Any, attr: str, before: Any, after: Any = None) -> None:
        """Shadow ``obj.attr`` with an instance attribute that calls ``before(*args, **kwargs)`` first
        (and ``after`` once it returned); undone by close(). Both are no-ops once this monitor is closed."""
        self._hooks.wrap(obj, attr, before, after)

    def close(self) -> None:
        """Remove every hook (safe to call twice) and close the trace file.

        Leaving a ``with`` block without an exception also checks the last, still open step. A run whose loss scaler
        skipped every step is reported as it closes (no update was ever applied).
        """
        if not self._hooks.closed:
            self._steps.end_run()
        self._hooks.close()
        self._recorder.close()
        self._watched.regions.close()
        self._release_modules()
        self._steps.tracer.close()
        if self._steps.timeline is not None:
            self._steps.timeline.close(self.report)

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
            if exc_type is None:
                self._steps.exit_check()
        finally:
            self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        hooks = getattr(self, "_hooks", None)
        if hooks is not None and hooks.active:
            self.close()

    def _stop(self) -> None:
        """The run is over: stop checking and let a new monitor attach (inert hooks go at close())."""
        self._hooks.active = False
        self._release_modules()

    def _release_modules(self) -> None:
        for module in list(_WATCHED.keys()):
            if _WATCHED.get(module) is self:
                del _WATCHED[module]

"""A bad step replayed with every module watched: how the monitor looks inside a step it checked only at its
boundaries (``watch="boundaries"``), or inside a compiled region it watched only at its edges.

While a step runs, each call of the model (each micro-batch) leaves a :class:`~..record.calls.RootCall`: what
replaying it needs, kept by reference and dropped when the step ends.

When the step's check fails, :func:`localize` replays the micro-batch that went bad with every module's hooks in
place, module-level gradients included, into a fresh record (:mod:`.step`), and builds the report from what the
replay saw. A forward fault is found by the replayed forward (under ``no_grad``); a backward fault by the
replayed forward followed by ``autograd.grad`` from the kept output gradient, micro-batch by micro-batch in the
order they ran, until one reproduces it. The replay changes nothing the run keeps: no ``.grad`` (``autograd.grad``
returns the gradients instead of accumulating them, so no accumulate-grad hook -- DDP's reducer, an engine's
bucket -- runs), no optimizer state, the buffers and the RNG state put back, and any collective stopped before
it is issued (one rank replaying alone would wait for the others forever).

The report says what happened (:data:`REPRODUCED`, :data:`NOT_REPRODUCED`, :data:`NOT_REPLAYED` with the reason):
reproduced means the data or the model (the fix applies); not reproduced means the same inputs under the same RNG
state computed finite values, a transient fault of the device or a kernel. A compiled model replays eagerly
(``force_eager``), not inductor's kernels, so there "not reproduced" may also be the kernels' own rounding.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ...units import human_bytes
from ..explain import causes
from ..explain.consumers import backward_consumer
from ..explain.diagnosis_types import Setup
from ..explain.report import NonFiniteReport, build_report
from ..measure.buffers import saved_buffers
from ..measure.slots import output_slots
from ..record import calls as kept  # (its bound read when used: a test scales it down)
from ..record.calls import RootCall, changed_input
from ..record.frames import BWD, FWD, MARK, ResolvedFrame, measure_now
from ..record.recorder import Recorder
from ..record.step import StepRecord
from ..record.watched import WatchedModel
from .history import History, resolved

REPRODUCED, NOT_REPRODUCED, NOT_REPLAYED = "reproduced", "not reproduced", "not replayed"

class CollectiveInReplay(RuntimeError):
    """A replay tried to communicate with other ranks (it is stopped before the collective is issued)."""


class _NoCollectives(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            raise CollectiveInReplay(f"{func} is a collective")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _eager_everywhere() -> Iterator[None]:
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with stance("force_eager") if stance is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _autocast_as(call: RootCall, autocast: tuple[tuple[str, torch.dtype], ...] | None = None) -> Iterator[None]:
    """The autocast the call's forward ran under (``autocast``: another one, a fix being checked; ``()``: off). Only
    around the replayed forward: a training step's backward runs outside autocast (torch's recipe), and a backward
    under autocast would compute its matmuls in the narrow dtype -- an overflow the step never had."""
    with contextlib.ExitStack() as stack:
        on = dict(call.autocast if autocast is None else autocast)
        for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            if device_type in on:
                stack.enter_context(torch.autocast(device_type, dtype=on[device_type]))
            else:  # (a check made at the next forward may run inside the loop's own autocast)
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextlib.contextmanager
def _as_the_call_ran(model: nn.Module, call: RootCall) -> Iterator[None]:
    """The RNG states, train/eval mode and forward of the call; everything put back after. (Lightning's strategies
    call ``training_step`` through the model's ``__call__`` by setting ``forward`` on the instance for that one call:
    the replay calls what the step called.) Its autocast: :func:`_autocast_as`, around the forward only."""
    forward_now = model.__dict__.get("forward")
    if call.forward is not None and forward_now is not call.forward:
        model.forward = call.forward
    cpu_now = torch.get_rng_state()
    cuda_now = {d: torch.cuda.get_rng_state(d) for d in call.cuda_rng}
    modes = None
    if model.training != call.training:  # the loop switched modes since (model.eval() to evaluate)
        modes = [(m, m.training) for m in model.modules()]
        model.train(call.training)
    torch.set_rng_state(call.cpu_rng)
    for d, state in call.cuda_rng.items():
        torch.cuda.set_rng_state(state, d)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_now)
        for d, state in cuda_now.items():
            torch.cuda.set_rng_state(state, d)
        for m, training in modes or ():
            m.training = training
        if forward_now is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = forward_now


def _param_grad_frames(step: int, params: list, grads: tuple, frames: list[ResolvedFrame]) -> list[ResolvedFrame]:
    """The replayed backward's parameter gradients as frames of their modules, in backward order (the reverse of
    the replayed forward's)."""
    by_module: dict[str, tuple[Any, list]] = {}
    for (info, name, _), g in zip(params, grads, strict=True):
        if g is not None:
            by_module.setdefault(info.name, (info, []))[1].append((name, g))
    ran = [f.name for f in frames if f.phase == FWD]
    order = {name: i for i, name in enumerate(dict.fromkeys(reversed(ran)))}
    out = []
    for name in sorted(by_module, key=lambda n: order.get(n, len(order))):
        info, named = by_module[name]
        out.append(ResolvedFrame(step, BWD, info.name, info.cls, [measure_now(f"grad:{n}", g) for n, g in named]))
    return out


def _compiled_edge(frames: list[ResolvedFrame], index: int, backward: bool) -> bool:
    """Is the first bad frame one the compiled code hid the inside of?"""
    bad = frames[index]
    if bad.boundary:
        return True
    if not backward:
        return False
    line = bad.first_bad_line()
    if line is not None and line.label.startswith("grad:") and line.ref is None:
        return True  # a parameter gradient measured at the step's end: its module may sit in a region
    consumer = backward_consumer(frames, index)
    return consumer is not None and consumer.boundary


def _bad_output_grad(calls: list[RootCall]) -> tuple[RootCall, str, torch.Tensor] | None:
    """A kept gradient at the model's output that is already non-finite (one read each: a bad step only)."""
    for call in calls:
        for label, g in call.output_grads.items():
            if not bool(torch.isfinite(g).all()):
                return call, label, g
    return None


def _settled(report: NonFiniteReport, status: str, reason: str | None = None) -> NonFiniteReport:
    report.replay, report.replay_reason = status, reason
    return report


def _marked_after_the_call(frames: list[ResolvedFrame], start: int, position: int, calls: list[RootCall]) -> bool:
    """Is the first bad frame a value marked after the model's call returned (a loss computed from its outputs)?"""
    bad = frames[start + position]
    if bad.phase != MARK:
        return False
    call = next((c for c in reversed(calls) if c.start <= position), None)
    return call is not None and any(f.root and f.phase == FWD for f in frames[start + call.start:start + position])


def _replayed_note(checked: NonFiniteReport, replayed: NonFiniteReport, bad: ResolvedFrame, compiled: bool,
                   which: str) -> str:
    """What the replayed report says of where its frames come from (``checked``: what the step's check saw)."""
    if compiled:
        return ("The model is compiled (torch.compile): these frames come from an eager replay of "
                f"{which} on the same inputs (RNG state restored), after the compiled run went non-finite"
                + (f" at {checked.first.module or checked.first.cls}'s edge." if bad.boundary else "."))
    return (f"Replayed: the step was checked at its boundaries (the model's outputs and the parameter gradients); "
            f"{which} was run again on the same inputs, RNG state and autocast with every module watched, and the "
            "fault reproduced -- so it comes from the data or the model, and the fix above applies."
            + (" Frames of earlier steps show the model's calls only (watch='every-module' records every module)."
               if any(f.step != replayed.step for f in replayed.frames) else ""))


def _which(calls: list[RootCall], call: RootCall, name: str) -> str:
    """The call replayed, as the report says it: a micro-batch of the model, or a call of a module the loop calls on
    its own (a LightningModule's training_step calling its submodules)."""
    if any(c.module is not call.module for c in calls):
        return f"its call of {name or 'the model'}"
    return f"micro-batch {calls.index(call) + 1} of {len(calls)}" if len(calls) > 1 else "this micro-batch"


def _reproduced_note(which: str) -> str:
    return (f"Replayed: every module was watched as the step ran (the frames above); {which} was run again on the "
            "same inputs, RNG state and autocast, and the fault reproduced -- so it comes from the data or the model, "
            "not a transient fault of the device.")


class Replayer:
    """Replays a bad step's micro-batches with every module watched.

    What a replay may read: the kept calls of the step (:class:`~..record.calls.RootCall`: inputs by reference, RNG
    and autocast state), the watched model's modules and parameters (:class:`~..record.watched.WatchedModel`), the
    earlier steps kept as context (:class:`~.history.History`). What it may change: only the recorder's record, for the
    length of the replay (:meth:`~..record.recorder.Recorder.replaying` puts the step's own back); the model's
    buffers, RNG state, train/eval mode and forward are put back; no ``.grad``, optimizer state or collective.
    """

    def __init__(self, recorder: Recorder, watched: WatchedModel, history: History, max_frames: int,
                 rank: int | None, hf: bool = False) -> None:
        self.recorder = recorder
        self.watched = watched
        self.history = history
        self.max_frames = max_frames
        self.rank = rank
        self.hf = hf
        # the call whose replay reproduced the last report's fault, whether that was a backward one, and the frames
        # the replay saw (the fix check runs that call again, and reads the order its modules ran in)
        self.reproduced: tuple[RootCall, bool, list[ResolvedFrame]] | None = None

    def replay_call(self, call: RootCall, backward: bool, failed: bool = False,
                    variant: contextlib.AbstractContextManager | None = None,
                    autocast: tuple[tuple[str, torch.dtype], ...] | None = None) -> list[ResolvedFrame]:
        """Replay one call with every module watched, into a fresh record; the frames it saw, with the parameter
        gradients the replayed backward computed (measured now, module by module in backward order, as a report at
        ``"params"`` shows them). State is put back. ``failed``: the call raised; so does its replay, and the frames
        before the exception are what it shows. ``variant`` (entered around the replayed forward and backward) and
        ``autocast`` (instead of the call's): a fix being checked (:mod:`.fixcheck`)."""
        model = call.module
        grads = None
        with self.recorder.replaying() as rec, saved_buffers(self.watched.root.buffers()), \
                _as_the_call_ran(model, call), _eager_everywhere(), _NoCollectives(), \
                variant or contextlib.nullcontext():
            if not backward:
                with torch.no_grad(), _autocast_as(call, autocast):
                    try:
                        model._call_impl(*call.args, **call.kwargs)
                    except CollectiveInReplay:
                        raise
                    except Exception:
                        if not failed:
                            raise
            else:
                with torch.enable_grad(), _autocast_as(call, autocast):
                    out = model._call_impl(*call.args, **call.kwargs)
                outs, seeds = [], []
                for label, v in output_slots(out):
                    g = call.output_grads.get(label)
                    if g is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                        outs.append(v)
                        seeds.append(g if g.dtype == v.dtype else g.to(v.dtype))  # (a fix tried may change it)
                params = [(info, n, p) for info in self.watched.infos.values() if (m := info.module()) is not None
                          for n, p in m.named_parameters(recurse=False) if p.requires_grad]
                if outs and params:
                    grads = torch.autograd.grad(outs, [p for _, _, p in params], seeds, allow_unused=True)
            frames = resolved([rec])
        if grads is not None:
            frames += _param_grad_frames(self.recorder.step, params, grads, frames)
        return frames

    def _report(self, frames: list[ResolvedFrame], start: int, setup: Setup, judge_params: bool = True,
                trail: bool = True) -> NonFiniteReport | None:
        return build_report(frames, self.max_frames, self.rank, start, self.hf, judge_params,
                            self.history.growth.read() if trail else None, setup)

    def _unreplayed(self, report: NonFiniteReport, coarse: bool, reason: str, setup: Setup) -> NonFiniteReport:
        """A step that could not be replayed. ``coarse``: it was checked at its boundaries, so say what its frames
        show (the model's output, a parameter gradient) and no more -- no module inside the model was watched, so
        none is claimed finite."""
        report.notes.append(f"Not replayed: {reason}.")
        first = report.first
        if coarse and first is not None and first.phase == FWD:
            report.diagnosis = (
                f"the model's {first.slot} was {first.value}. This step was checked at its boundaries (the model's "
                "outputs and the parameter gradients) and could not be replayed, so which module made it is unknown.")
            report.fix = (f"{setup.option('watch', 'every-module')} watches every module as it runs (and names it "
                          "the next time); or add torchdoctor.mark(x, 'name') calls inside the model's forward")
            report.cause, report.fp32_region, report.evidence, report.cited = causes.UNLOCALIZED, None, (), []
        return _settled(report, NOT_REPLAYED, reason)

    def bad_seed_call(self) -> RootCall | None:
        """The call of the current step whose outputs received a non-finite gradient (not replayed: the fault came
        from outside the model) and whose inputs are as they were, or None."""
        bad = _bad_output_grad(list(self.recorder.rec.root_calls))
        return bad[0] if bad is not None and not changed_input(bad[0]) else None

    def localize(self, rec: StepRecord, report: NonFiniteReport, frames: list[ResolvedFrame], start: int,
                 judge_params: bool, setup: Setup) -> NonFiniteReport:
        """Replay the micro-batch of the step (``rec``) that went bad. When the step was not seen whole -- watched at
        its boundaries (``watch="boundaries"``), a backward fault without module-level gradients, or a first bad value
        where compiled code hid what happened -- return the report of what the replay shows; when it was seen whole
        (every module, and module-level gradients for a backward fault), keep this report, built from what the step
        did as it ran, and the replay only says whether the fault reproduces. Either way ``report.replay`` says what
        came of it, and why not when it could not run. ``setup.before_update``: the training step is checked before
        its update (its weights are still those its forward ran with; an evaluation pass changes no weight)."""
        self.reproduced = None
        position = report.position
        backward = report.first is not None and report.first.phase == BWD
        compiled = bool(self.watched.regions) and _compiled_edge(frames, start + position, backward)
        coarse = not rec.live
        seen_whole = rec.live and not compiled and (not backward or rec.module_grads)
        if rec is self.recorder.rec and not setup.before_update:
            return self._unreplayed(report, coarse, "this step was checked after its update (mon.step() after "
                                    "optimizer.step()), so a replay would run on other weights than the step did",
                                    setup)
        calls = list(rec.root_calls)
        if not calls:
            return _settled(report, NOT_REPLAYED, "no call of the model was recorded in this step")
        if _marked_after_the_call(frames, start, position, calls):
            return _settled(report, NOT_REPLAYED, "the first non-finite value was marked after the model's forward "
                            "returned: the model's outputs were finite, so there is nothing inside it to replay")
        if self.watched.sharded:
            return self._unreplayed(report, coarse, "the model is sharded (FSDP / ZeRO-3): a replay to look inside "
                                    "would make collectives on this rank alone", setup)
        if backward:
            bad = _bad_output_grad(calls)
            if bad is not None:
                return self._loss_gradient_report(report, frames, start, bad, judge_params, setup)
            todo = [c for c in calls if c.output_grads]
            if not todo:
                dropped = next((c.dropped for c in calls if c.dropped), None)
                bound = human_bytes(kept.GRAD_BYTES_KEPT)
                reason = (f"the gradient at the model's output ({dropped}) is above the {bound} "
                          "kept per micro-batch for a replay" if dropped else
                          "no gradient reached the model's outputs (a backward from a value the monitor does not see)")
                report.notes.append(f"Not replayed: {reason}; the parameter gradient above is where the step's check "
                                    "found the fault, not where it began.")
                return _settled(report, NOT_REPLAYED, reason)
        else:
            todo = [c for c in calls if c.start <= position][-1:]
        why_not = [changed_input(c) for c in todo]
        if all(why_not):
            return self._unreplayed(report, coarse, why_not[0], setup)
        for call, skip in zip(todo, why_not, strict=True):
            if skip:
                continue
            try:
                inner = self.replay_call(call, backward)
            except CollectiveInReplay as e:
                return self._unreplayed(report, coarse, f"the replay was stopped before a collective ({e}): on one "
                                        "rank alone it would wait for the others forever", setup)
            except Exception as e:  # the replay is a bonus: never let it hide the finding itself
                return self._unreplayed(report, coarse, f"the replay raised {type(e).__name__}: {e}", setup)
            context = frames[: start + call.start]  # earlier micro-batches and steps, then what the replay saw
            again = self._report(context + inner, len(context), setup, judge_params)
            if again is None:
                continue
            self.reproduced = (call, backward, inner)
            info = self.watched.infos.get(id(call.module))
            which = _which(calls, call, info.name if info is not None else "")
            if seen_whole:  # the frames of the step as it ran stand; the replay says the fault comes back
                report.notes.append(_reproduced_note(which))
                return _settled(report, REPRODUCED)
            again.position = position  # ranks compare where the value went bad in the step they all ran
            again.notes.append(_replayed_note(report, again, frames[start + position], compiled, which))
            return _settled(again, REPRODUCED)
        return self._not_reproduced(report, compiled, backward, setup)

    def failed_forward(self, call: RootCall, context: list[ResolvedFrame], setup: Setup) -> NonFiniteReport | None:
        """A forward checked at its boundaries raised: was a value non-finite before the exception? Replayed (it
        raises again, under ``no_grad``) with every module watched; the report, or None when the replay saw nothing
        bad (or could not run: the exception is then the only finding). An out-of-memory error is not replayed."""
        exc = sys.exc_info()[1]
        if isinstance(exc, torch.OutOfMemoryError) or changed_input(call) is not None:
            return None
        try:
            inner = self.replay_call(call, backward=False, failed=True)
        except Exception:
            return None
        report = self._report(context + inner, len(context), setup, trail=False)
        if report is not None:
            report.notes.append("Replayed: the forward was checked at its boundaries and raised; it was run again on "
                                "the same inputs, RNG state and autocast with every module watched (it raised "
                                "again).")
            _settled(report, REPRODUCED)
        return report

    def _not_reproduced(self, report: NonFiniteReport, compiled: bool, backward: bool,
                        setup: Setup) -> NonFiniteReport:
        if compiled:
            report.notes.append(
                "The model is compiled (torch.compile). This micro-batch was re-run eagerly on the same inputs (RNG "
                "state restored) and stayed finite there: the compiled kernels round differently near the dtype's "
                "limit (or drew other dropout masks). Run this step without torch.compile to see inside."
            )
            return _settled(report, NOT_REPRODUCED, "the eager replay of the compiled model stayed finite")
        where = self.watched.where(self.rank)
        if backward:
            report.diagnosis = (
                "the step's gradients went non-finite, but replaying the model's calls on the same inputs, RNG state "
                "and autocast, from the gradients their outputs received, computed finite ones: the fault did not "
                f"reproduce. Either a transient fault of the device or a kernel{where}, or a gradient that did not "
                "come through the model's calls (a loss term computed from the parameters themselves, a module called "
                "outside the model's forward): those are the places to look if it comes back on other devices."
            )
        else:
            report.diagnosis = (
                "the model's output went non-finite, but replaying its call on the same inputs, RNG state and autocast "
                "computed finite values: the fault did not reproduce, so it is not the data or the model but a "
                f"transient fault of the device or a kernel{where} (or Python state the forward reads that changed "
                "since: a counter, a flag)."
            )
        report.fix = (
            "check the device: on a GPU, nvidia-smi -q -d ECC,ROW_REMAPPER (uncorrectable errors, remapped rows) and "
            "dcgmi diag -r 3 (or NVIDIA's field diagnostic), and look for Xid errors in the kernel log (dmesg | grep "
            "-i xid); a kernel that is not deterministic (atomics) can also differ from run to run. If it happens "
            "again on the same device, take that device out of the job. "
            + setup.option("transient", "skip") + " skips such a step and goes on (counted in monitor.transients)."
        )
        if backward and self.watched.world > 1:
            report.diagnosis += (" With several ranks the gradient reduction brings a non-finite gradient to every "
                                 "rank, and no rank's replay reproduced it: the device that faulted is one of the "
                                 "ranks', and from the gradients alone which one cannot be told.")
        report.cause = causes.TRANSIENT
        report.fp32_region = None
        report.evidence = ()
        report.cited = []
        return _settled(report, NOT_REPRODUCED, "the replay on the same inputs and RNG state stayed finite")

    def _loss_gradient_report(self, report: NonFiniteReport, frames: list[ResolvedFrame], start: int,
                              bad: tuple[RootCall, str, torch.Tensor], judge_params: bool,
                              setup: Setup) -> NonFiniteReport:
        """The gradient reaching the model's output was already non-finite: the fault is in what computed it from
        the outputs (the loss), outside the model -- the report is built with that gradient as the first bad
        value."""
        call, label, grad = bad
        root = next((f for f in frames[start:] if f.root), None)
        info_name, cls = (root.name, root.cls) if root is not None else ("", type(self.watched.root).__name__)
        line = measure_now("grad_" + label, grad)
        index = next((i for i in range(start + call.start, len(frames)) if frames[i].root and frames[i].phase == FWD),
                     None)
        cut = len(frames) if index is None else index + 1
        grad_frame = ResolvedFrame(self.recorder.step, BWD, info_name, cls, [line], root=True)
        again = self._report(frames[:cut] + [grad_frame], start, setup, judge_params) or report
        again.position = report.position
        return _settled(again, NOT_REPLAYED, "the gradient reaching the model's output was already non-finite: the "
                        "fault is in the loss computed from the outputs, outside the model (nothing inside it to "
                        "replay)")

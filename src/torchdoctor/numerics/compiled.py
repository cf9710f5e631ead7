"""Compiled regions: watched at their edges while the step runs, looked inside only when one goes bad.

Inside code that ``torch.compile`` traces, the monitor's hooks return at their first line, so a
compiled graph stays whole: no graph break, no recompilation, nothing added to it. What the monitor
still sees of a compiled region is its edge, where Python runs eagerly:

* ``torch.compile(module)`` returns an ``OptimizedModule``: hooks on *it* run outside the graph;
* ``module.compile()`` sets ``module._compiled_call_impl``, which ``Module.__call__`` calls: the monitor
  puts an eager wrapper in its place (an instance attribute, removed on close).

At the edge, each call of a region records one *boundary* frame (its inputs as context, its outputs
judged), plus, at ``grads="modules"``, the gradients at its outputs; the parameter gradients are
checked at the step's end as for any model. Of each call of the *model* (each micro-batch) the monitor
keeps its inputs (references: the batch), the RNG state at its start and, at ``grads="modules"``, the
gradient its output received (the loss's alone when the model returns one), until the step is checked.

When the first non-finite value of a step is at a region's edge, in a gradient made by a compiled
region's backward, or in a parameter gradient, the monitor re-runs that micro-batch's forward eagerly
(``torch.compiler.set_stance("force_eager")``: every compiled region runs as plain Python), on the kept
inputs, with the RNG state restored and every buffer (BatchNorm statistics) saved and put back; under
``no_grad`` for a forward blow-up, or followed by ``autograd.grad`` from the kept output gradient for a
backward one (no ``.grad`` changes). The monitor's hooks run there and name the module inside. The
compiled graphs are not touched. The re-run is eager, not inductor's kernels (fused code rounds
differently near a dtype's limit and draws other dropout masks), so the report says whether it
reproduced the value. A re-run must never make a collective: one rank re-running alone would wait for
the others forever. Sharded models (FSDP, ZeRO-3, DTensor) are not re-run with several ranks, and any
other collective (an MoE router's all-reduce, SyncBatchNorm) stops the re-run before it is issued.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .buffers import saved_buffers
from .diagnosis import backward_consumer
from .frames import BWD, ModuleInfo, ResolvedFrame
from .report import NonFiniteReport, build_report
from .slots import output_slots
from .step import StepRecord
from .wrappers import clean_name, is_wrapper, named_user_modules, unwrap_model, user_class_name

if TYPE_CHECKING:
    from .monitor import NumericsMonitor


@dataclass(eq=False)
class Region:
    """One compiled region: the module the caller calls, and the module that runs eagerly inside."""

    outer: nn.Module  # an OptimizedModule, or a module whose _compiled_call_impl is set
    inner: nn.Module  # the user's module inside (wrappers such as DDP looked through)
    info: ModuleInfo  # its boundary frames
    compiled_call: Any = None  # the original _compiled_call_impl (module.compile()), restored on close

    @property
    def is_root(self) -> bool:
        return self.info.is_root


@dataclass(eq=False)
class RootCall:
    """One call of the model (a micro-batch) in a step with compiled regions: what a re-run needs."""

    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: tuple[int, torch.Tensor] | None
    start: int  # index in the step's frames where this call's frames begin
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # grads="modules": by output label


def _has_compiled_call(module: nn.Module) -> bool:
    return module.__dict__.get("_compiled_call_impl") is not None


def find_regions(model: nn.Module, root: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(user name, outer, inner) of every compiled region in ``model``, outermost first."""
    names = {id(m): name for name, m in named_user_modules(root)}
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            inner = unwrap_model(module._orig_mod)
        elif _has_compiled_call(module) and not is_wrapper(module):
            inner = module
        else:
            continue
        found.append((names.get(id(inner), clean_name(name)), module, inner))
    return found


def _sharded(module: nn.Module) -> bool:
    """Does this module's forward make collectives by design (FSDP unshards, ZeRO-3 gathers)?"""
    for m in module.modules():
        if type(m).__name__ == "FullyShardedDataParallel" or any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            return True
    return any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor" for p in module.parameters())


class Regions:
    """The compiled regions of one monitored model."""

    def __init__(self, model: nn.Module, root: nn.Module) -> None:
        self.regions: list[Region] = []
        for name, outer, inner in find_regions(model, root):
            info = ModuleInfo(name, user_class_name(inner), weakref.ref(inner), is_root=inner is root, boundary=True)
            self.regions.append(Region(outer, inner, info))

    @property
    def root(self) -> Region | None:
        return next((r for r in self.regions if r.is_root), None)

    def __bool__(self) -> bool:
        return bool(self.regions)

    def install(self, mon: NumericsMonitor) -> None:
        for region in self.regions:
            if type(region.outer).__name__ == "OptimizedModule":
                mon.add_handle(region.outer.register_forward_pre_hook(
                    functools.partial(mon._region_enter, region), with_kwargs=True))
                mon.add_handle(region.outer.register_forward_hook(
                    functools.partial(mon._region_exit, region), with_kwargs=True))
                mon.add_handle(region.outer.register_forward_hook(
                    functools.partial(mon._region_always, region), with_kwargs=True, always_call=True))
            else:
                region.compiled_call = region.outer.__dict__["_compiled_call_impl"]
                region.outer._compiled_call_impl = _edge_call(mon, region)

    def close(self) -> None:
        for region in self.regions:
            if region.compiled_call is not None:
                if getattr(region.outer.__dict__.get("_compiled_call_impl"), "_torchdoctor_region", None) is region:
                    region.outer._compiled_call_impl = region.compiled_call
                region.compiled_call = None


def root_call(args: tuple, kwargs: dict | None, start: int) -> RootCall:
    cuda = None
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and first.is_cuda:
        cuda = (first.device.index, torch.cuda.get_rng_state(first.device))
    return RootCall(args, dict(kwargs or {}), torch.get_rng_state(), cuda, start)


def keep_output_grads(call: RootCall, output: Any) -> None:
    """At ``grads="modules"``: keep the gradient the model's output receives, for a backward re-run. A
    0-d output (the loss the model computed) is enough and small; otherwise every differentiable one."""
    outs = [(label, v) for label, v in output_slots(output) if isinstance(v, torch.Tensor) and v.requires_grad]
    losses = [(label, v) for label, v in outs if v.dim() == 0]
    for label, v in losses or outs:
        v.register_hook(functools.partial(_keep_grad, call, label))


def _keep_grad(call: RootCall, label: str, grad: torch.Tensor) -> None:
    call.output_grads[label] = grad


def _edge_call(mon: NumericsMonitor, region: Region) -> Any:
    """The eager wrapper put in place of ``module._compiled_call_impl`` (``module.compile()``)."""
    compiled = region.compiled_call

    def region_call(*args: Any, **kwargs: Any) -> Any:
        mon._region_enter(region, region.outer, args, kwargs)
        try:
            out = compiled(*args, **kwargs)
        except BaseException:
            mon._region_always(region, region.outer)
            raise
        mon._region_exit(region, region.outer, args, kwargs, out)
        mon._region_always(region, region.outer)
        return out

    region_call._torchdoctor_region = region  # type: ignore[attr-defined]
    return region_call


class CollectiveInRerun(RuntimeError):
    """A re-run tried to communicate with other ranks (it is stopped before the collective is issued)."""


class _NoCollectives(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            raise CollectiveInRerun(f"{func} is a collective")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _eager_everywhere() -> Iterator[None]:
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with stance("force_eager") if stance is not None else contextlib.nullcontext():
        yield


def rerun(mon: NumericsMonitor, call: RootCall, backward: bool) -> None:
    """Re-run one micro-batch of the model eagerly into the monitor's current (fresh) record; state is put back."""
    model = mon.model
    cpu_now = torch.get_rng_state()
    cuda_now = torch.cuda.get_rng_state(call.cuda_rng[0]) if call.cuda_rng is not None else None
    torch.set_rng_state(call.cpu_rng)
    if call.cuda_rng is not None:
        torch.cuda.set_rng_state(call.cuda_rng[1], call.cuda_rng[0])
    try:
        with saved_buffers(model.buffers()), _eager_everywhere(), _NoCollectives():
            if not backward:
                with torch.no_grad():
                    model._call_impl(*call.args, **call.kwargs)
                return
            with torch.enable_grad():
                out = model._call_impl(*call.args, **call.kwargs)
            outs, grads = [], []
            for label, v in output_slots(out):
                g = call.output_grads.get(label)
                if g is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                    outs.append(v)
                    grads.append(g)
            params = [p for p in model.parameters() if p.requires_grad]
            if outs and params:
                torch.autograd.grad(outs, params, grads, allow_unused=True)
    finally:
        torch.set_rng_state(cpu_now)
        if cuda_now is not None:
            torch.cuda.set_rng_state(cuda_now, call.cuda_rng[0])


def _needs_rerun(frames: list[ResolvedFrame], index: int, backward: bool) -> bool:
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


def localize(mon: NumericsMonitor, report: NonFiniteReport, frames: list[ResolvedFrame], start: int,
             judge_params: bool) -> NonFiniteReport:
    """The first bad value is where compiled code hid what happened: re-run that micro-batch eagerly,
    and return the report of what the re-run shows (or this one, with a note saying why not)."""
    position = report.position
    backward = report.first is not None and report.first.phase == BWD
    if not mon._regions or not _needs_rerun(frames, start + position, backward):
        return report
    calls = [c for c in mon._rec.root_calls if c.start <= position]
    if not calls:
        return report
    call = calls[-1]
    if backward and not call.output_grads:  # grads="params": the note to use "modules" follows
        return report
    if mon._world > 1 and _sharded(mon.model):
        report.notes.append("The model is compiled (torch.compile) and sharded (FSDP / ZeRO-3): an eager re-run to "
                            "look inside would make collectives on this rank alone, so it is not re-run.")
        return report
    saved, mon._rec, mon._rerunning = mon._rec, StepRecord(), True
    try:
        rerun(mon, call, backward)
        inner = mon._resolved([mon._rec])
    except CollectiveInRerun as e:
        report.notes.append(f"The model is compiled (torch.compile); its eager re-run was stopped before a "
                            f"collective ({e}): on one rank alone it would wait for the others forever.")
        return report
    except Exception as e:  # the re-run is a bonus: never let it hide the finding itself
        report.notes.append(f"(the eager re-run of the compiled model failed: {type(e).__name__}: {e})")
        return report
    finally:
        mon._rec, mon._rerunning = saved, False
    context = frames[: start + call.start]  # earlier micro-batches and steps, then what the re-run saw
    again = build_report(context + inner, mon.max_frames, mon.rank, len(context), mon._hf, judge_params,
                         mon._growth.read(), mon._setup())
    if again is None:
        report.notes.append(
            "The model is compiled (torch.compile). This micro-batch was re-run eagerly on the same inputs (RNG "
            "state restored) and stayed finite there: the compiled kernels round differently near the dtype's limit "
            "(or drew other dropout masks). Run this step without torch.compile to see inside."
        )
        return report
    again.notes.append(
        "The model is compiled (torch.compile): these frames come from an eager re-run of this micro-batch on the "
        "same inputs (RNG state restored), after the compiled run went non-finite"
        + (f" at {report.first.module or report.first.cls}'s edge." if frames[start + position].boundary else ".")
    )
    again.position = position  # ranks compare where the value went bad in the step they all ran
    return again

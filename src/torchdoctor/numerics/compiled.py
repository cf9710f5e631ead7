"""Compiled regions: watched at their edges while the step runs, looked inside only when one goes bad.

Inside code that ``torch.compile`` traces, the monitor's hooks return at their first line, so a
compiled graph stays whole: no graph break, no recompilation, nothing added to it. What the monitor
still sees of a compiled region is its edge, where Python runs eagerly:

* ``torch.compile(module)`` returns an ``OptimizedModule``: hooks on *it* run outside the graph;
* ``module.compile()`` sets ``module._compiled_call_impl``, which ``Module.__call__`` calls: the monitor
  puts an eager wrapper in its place (an instance attribute, removed on close).

At the edge, each call of a region records one *boundary* frame (its inputs as context, its outputs
judged), plus, at ``grads="modules"``, the gradients at its outputs; the parameter gradients are
checked at the step's end as for any model. The inputs of each region call and the RNG state at its
start are kept (references, not copies) until the step is checked.

When the first non-finite value of a step is at a region's edge, the monitor re-runs that call
eagerly on the kept inputs, with the RNG state restored, floating-point buffers (BatchNorm running
statistics) saved and put back, under ``no_grad`` for a forward blow-up or with ``autograd.grad`` from
the kept output gradients for a backward one (so no ``.grad`` changes): the monitor's hooks run there
and name the module inside. The compiled graph is not touched (hooks added for a re-run and removed
are not guarded on). The re-run is eager, not the compiled kernels: inductor's fused code can round
differently near a dtype's limit and draws other dropout masks, so the report says whether the
re-run reproduced the non-finite value. Regions whose forward makes collectives (FSDP, ZeRO-3) are
not re-run on several ranks: a lone rank re-running them would wait for the others forever.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .frames import BWD, ModuleInfo, ResolvedFrame
from .report import NonFiniteReport, backward_consumer, build_report
from .slots import output_slots
from .step import StepRecord
from .wrappers import clean_name, is_wrapper, unwrap_model, user_class_name

if TYPE_CHECKING:
    from .monitor import NumericsMonitor


@dataclass(eq=False)
class Region:
    """One compiled region: the module the caller calls, and the module that runs eagerly inside."""

    outer: nn.Module  # an OptimizedModule, or a module whose _compiled_call_impl is set
    inner: nn.Module  # what a re-run calls eagerly (wrappers such as DDP looked through)
    info: ModuleInfo  # its boundary frames
    compiled_call: Any = None  # the original _compiled_call_impl (module.compile()), restored on close

    @property
    def is_root(self) -> bool:
        return self.info.is_root

    def eager_call(self, *args: Any, **kwargs: Any) -> Any:
        """Run the region once without compiling (its own hooks, and the monitor's, do run)."""
        if self.compiled_call is not None:
            return self.inner._call_impl(*args, **kwargs)
        return self.inner(*args, **kwargs)


@dataclass(eq=False)
class RegionCall:
    """One call of a region during the step: what a re-run needs."""

    region: Region
    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: tuple[int, torch.Tensor] | None
    frame: Any = None  # its boundary frame, once recorded
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # grads="modules": by output label


def _has_compiled_call(module: nn.Module) -> bool:
    return module.__dict__.get("_compiled_call_impl") is not None


def find_regions(model: nn.Module, root: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(user name, outer, inner) of every compiled region in ``model``, outermost first."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            found.append((clean_name(name), module, unwrap_model(module._orig_mod)))
        elif _has_compiled_call(module) and not is_wrapper(module):
            found.append((clean_name(name), module, module))
    return found


def _sharded(module: nn.Module) -> bool:
    """Does this module's forward make collectives (FSDP unshards, ZeRO-3 gathers)?"""
    for m in module.modules():
        if type(m).__name__ == "FullyShardedDataParallel" or any(
            c.__name__ == "FSDPModule" for c in type(m).__mro__
        ):
            return True
    return any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor" for p in module.parameters())


class Regions:
    """The compiled regions of one monitored model and their calls in the current step."""

    def __init__(self, mon: NumericsMonitor, model: nn.Module, root: nn.Module) -> None:
        self._mon = weakref.ref(mon)
        self.regions: list[Region] = []
        for name, outer, inner in find_regions(model, root):
            info = ModuleInfo(name, user_class_name(inner), weakref.ref(inner), is_root=inner is root, boundary=True)
            self.regions.append(Region(outer, inner, info))

    @property
    def root(self) -> Region | None:
        return next((r for r in self.regions if r.is_root), None)

    def __bool__(self) -> bool:
        return bool(self.regions)

    # ------------------------------------------------------------------ installing the edges
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

    # ------------------------------------------------------------------ calls kept for a re-run
    @staticmethod
    def remember(region: Region, args: tuple, kwargs: dict) -> RegionCall:
        cuda = None
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.is_cuda:
            cuda = (first.device.index, torch.cuda.get_rng_state(first.device))
        return RegionCall(region, args, dict(kwargs or {}), torch.get_rng_state(), cuda)

    def rerun_blocked(self, region: Region, world: int) -> str | None:
        """Why a re-run of ``region`` must not happen here, or None."""
        if world > 1 and _sharded(region.inner):
            return (f"{region.info.name or 'the model'} is sharded (FSDP / ZeRO-3): its eager re-run would make "
                    "collectives on this rank alone, so it is not re-run")
        return None


def _edge_call(mon: NumericsMonitor, region: Region) -> Any:
    """The eager wrapper put in place of ``module._compiled_call_impl`` (``module.compile()``)."""
    compiled = region.compiled_call

    def region_call(*args: Any, **kwargs: Any) -> Any:
        mon._region_enter(region, region.outer, args, kwargs)
        try:
            out = compiled(*args, **kwargs)
        except BaseException:
            mon._region_failed(region)
            raise
        mon._region_exit(region, region.outer, args, kwargs, out)
        return out

    region_call._torchdoctor_region = region  # type: ignore[attr-defined]
    return region_call


def rerun(mon: NumericsMonitor, call: RegionCall, backward: bool) -> None:
    """Re-run one region call eagerly into the monitor's current (fresh) record; state is put back."""
    region = call.region
    module = region.inner
    buffers = [(b, b.detach().clone()) for b in module.buffers() if b.is_floating_point()]
    cpu_now = torch.get_rng_state()
    cuda_now = torch.cuda.get_rng_state(call.cuda_rng[0]) if call.cuda_rng is not None else None
    torch.set_rng_state(call.cpu_rng)
    if call.cuda_rng is not None:
        torch.cuda.set_rng_state(call.cuda_rng[1], call.cuda_rng[0])
    try:
        if not backward:
            with torch.no_grad():
                region.eager_call(*call.args, **call.kwargs)
            return
        args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in call.args)
        with torch.enable_grad():
            out = region.eager_call(*args, **call.kwargs)
        outs, grads = [], []
        for label, v in output_slots(out):
            g = call.output_grads.get(label)
            if g is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                outs.append(v)
                grads.append(g)
        inputs = [p for p in module.parameters() if p.requires_grad]
        inputs += [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if outs and inputs:
            torch.autograd.grad(outs, inputs, grads, allow_unused=True)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu_now)
        if cuda_now is not None:
            torch.cuda.set_rng_state(cuda_now, call.cuda_rng[0])


def _call_for(rec: StepRecord, frames: list[ResolvedFrame], start: int, index: int,
              backward: bool) -> RegionCall | None:
    """The region call to re-run for the first bad frame ``frames[index]``.

    A forward value at a region's edge: that call. A gradient at a module's output is made by the backward
    of the module that consumed the output: re-run it if it is a compiled region. A parameter gradient
    measured at the step's end: the innermost region holding that module."""
    bad = frames[index]

    def call_of(resolved: ResolvedFrame) -> RegionCall | None:
        position = frames.index(resolved) - start
        frame = rec.frames[position] if 0 <= position < len(rec.frames) else None
        return next((c for c in rec.region_calls if frame is not None and c.frame is frame), None)

    if not backward:
        return call_of(bad) if bad.boundary else None
    if bad.lines and any(not ln.finite and not (ln.label.startswith("grad:") and ln.ref is None) for ln in bad.lines):
        consumer = backward_consumer(frames, index)
        return call_of(consumer) if consumer is not None and consumer.boundary else None
    holding = [c for c in rec.region_calls
               if c.region.info.name == "" or bad.name == c.region.info.name
               or bad.name.startswith(c.region.info.name + ".")]
    return max(holding, key=lambda c: len(c.region.info.name), default=None)


def localize(mon: NumericsMonitor, report: NonFiniteReport, frames: list[ResolvedFrame], start: int,
             judge_params: bool) -> NonFiniteReport:
    """The first bad value is at a compiled region's edge (or in a parameter gradient of a module inside
    one): re-run that call eagerly, look inside, and return the report of what the re-run shows."""
    position = report.position
    bad = frames[start + position]
    backward = report.first is not None and report.first.phase == BWD
    call = _call_for(mon._rec, frames, start, start + position, backward)
    if call is None:
        return report
    shown = call.region.info.name or "the model"
    if backward and not call.output_grads:  # grads="params": the note to use "modules" follows
        return report
    blocked = mon._regions.rerun_blocked(call.region, mon._world)
    if blocked:
        report.notes.append(f"{shown} is compiled (torch.compile); {blocked}.")
        return report
    saved, mon._rec, mon._rerunning = mon._rec, StepRecord(), True
    try:
        rerun(mon, call, backward)
        inner = mon._resolved([mon._rec])
    except Exception as e:  # the re-run is a bonus: never let it hide the finding itself
        report.notes.append(f"(the eager re-run of {shown} failed: {type(e).__name__}: {e})")
        return report
    finally:
        mon._rec, mon._rerunning = saved, False
    context = frames[: start + position]  # everything before the first bad frame, then what the re-run saw
    again = build_report(context + inner, mon.max_frames, mon.rank, len(context), mon._hf, judge_params)
    if again is None:
        report.notes.append(
            f"{shown} is compiled (torch.compile). Its call was re-run eagerly on the same inputs (RNG state "
            "restored) and stayed finite there: the compiled kernels round differently near the dtype's limit "
            "(or drew other dropout masks). Run this step without torch.compile to see inside."
        )
        return report
    again.notes.append(
        f"{shown} is compiled (torch.compile): the frames inside it come from an eager re-run of that call on the "
        "same inputs (RNG state restored), after the compiled run went non-finite "
        + (f"in {bad.name}'s parameter gradients." if bad.lines[-1].label.startswith("grad:") and not bad.boundary
           else "at its edge.")
    )
    again.position = position  # ranks compare where the value went bad in the step they all ran
    return again

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
keeps what a replay needs until the step is checked (:class:`~.calls.RootCall`).

When the first non-finite value of a step is at a region's edge, in a gradient made by a compiled
region's backward, or in a parameter gradient, the monitor replays that micro-batch eagerly
(``torch.compiler.set_stance("force_eager")``: every compiled region runs as plain Python) with every module
watched: the one mechanism that also looks inside a step checked only at its boundaries (:mod:`.replay`).
The compiled graphs are not touched.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from ..engines.hookset import HookSet
from .frames import ModuleInfo


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


class Edges(Protocol):
    """What runs at a compiled region's edge (the recorder: :class:`~.recorder.Recorder`)."""

    def region_enter(self, region: Region, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None: ...
    def region_exit(self, region: Region, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None: ...
    def region_always(self, region: Region, module: nn.Module, *_: Any) -> None: ...


class Regions:
    """The compiled regions of one monitored model: ``found`` as :func:`~..engines.wrappers.compiled_regions` finds
    them, ``classes`` the user's class of each module, ``root`` the user's module."""

    def __init__(self, found: Iterable[tuple[str, nn.Module, nn.Module]], classes: dict[int, str],
                 root: nn.Module) -> None:
        self.regions: list[Region] = []
        for name, outer, inner in found:
            info = ModuleInfo(name, classes[id(inner)], weakref.ref(inner), is_root=inner is root, boundary=True)
            self.regions.append(Region(outer, inner, info))

    @property
    def root(self) -> Region | None:
        return next((r for r in self.regions if r.is_root), None)

    def __bool__(self) -> bool:
        return bool(self.regions)

    def install(self, hooks: HookSet, edges: Edges) -> None:
        for region in self.regions:
            if type(region.outer).__name__ == "OptimizedModule":
                hooks.add(region.outer.register_forward_pre_hook(
                    functools.partial(edges.region_enter, region), with_kwargs=True))
                hooks.add(region.outer.register_forward_hook(
                    functools.partial(edges.region_exit, region), with_kwargs=True))
                hooks.add(region.outer.register_forward_hook(
                    functools.partial(edges.region_always, region), with_kwargs=True, always_call=True))
            else:
                region.compiled_call = region.outer.__dict__["_compiled_call_impl"]
                region.outer._compiled_call_impl = _edge_call(edges, region)

    def close(self) -> None:
        for region in self.regions:
            if region.compiled_call is not None:
                if getattr(region.outer.__dict__.get("_compiled_call_impl"), "_torchdoctor_region", None) is region:
                    region.outer._compiled_call_impl = region.compiled_call
                region.compiled_call = None


def _edge_call(edges: Edges, region: Region) -> Any:
    """The eager wrapper put in place of ``module._compiled_call_impl`` (``module.compile()``)."""
    compiled = region.compiled_call

    def region_call(*args: Any, **kwargs: Any) -> Any:
        edges.region_enter(region, region.outer, args, kwargs)
        try:
            out = compiled(*args, **kwargs)
        except BaseException:
            edges.region_always(region, region.outer)
            raise
        edges.region_exit(region, region.outer, args, kwargs, out)
        edges.region_always(region, region.outer)
        return out

    region_call._torchdoctor_region = region  # type: ignore[attr-defined]
    return region_call

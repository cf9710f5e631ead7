"""The model a monitor watches, met once at the door: :class:`WatchedModel`, and what it watches in one line.

A monitor is handed a model under any wrappers (DDP, FSDP, ``torch.compile``, DeepSpeed, Lightning's). Everything
the other parts ask of it -- the user's module and its modules' names and classes, the engine adapter, the compiled
regions, the trainable parameters, the devices, whether the forward makes collectives -- is found here, walking the
wrappers once (:func:`~..engines.wrappers.wrapper_chain`), and handed on as these facts: no other part unwraps.

``GPT2LMHeadModel (124M params) with AdamW, DDP, grads=params`` (:meth:`WatchedModel.describe`) -- logged when
``torchdoctor run --numerics`` attaches, and kept in every report, so a run under a wrapper other than the one asked
for (accelerate running DDP where FSDP was configured) says which one was watched.
"""

from __future__ import annotations

import contextlib
import socket
import weakref
from typing import Any

import torch
from torch import nn

from ..engines import Engine, select_engine
from ..engines.wrappers import _inner, is_wrapper, look_through, user_class_name, wrapper_chain
from ..fp32 import kept_in_fp32
from .compiled import Regions
from .frames import ModuleInfo

# short names of the wrappers people know by them (others: their class name)
_SHORT = {
    "DistributedDataParallel": "DDP",
    "FullyShardedDataParallel": "FSDP1",
    "OptimizedModule": "torch.compile",
    "DeepSpeedEngine": "DeepSpeed",
    "PipelineEngine": "DeepSpeed pipeline",
    "_FabricModule": "Fabric",
    "_LightningModuleWrapperBase": None,  # (Lightning's own, around every LightningModule: not worth naming)
    "_LightningPrecisionModuleWrapperBase": None,
}


def wrappers_of(chain: list[nn.Module], root_class: str) -> list[str]:
    """The wrappers around the user's module (:func:`~..engines.wrappers.wrapper_chain`; ``root_class`` its class as
    the user wrote it), outermost first, by the names people know them by (FSDP2 is a class swap, not a
    wrapper)."""
    out = []
    for model in chain[:-1]:
        name = type(model).__name__
        out.append(_SHORT.get(name, name))
        if out[-1] is None:
            out.pop()
        elif name == "DeepSpeedEngine":
            stage = _zero_stage(model)
            if stage is not None:
                out[-1] = f"DeepSpeed ZeRO-{stage}"
    if root_class != type(chain[-1]).__name__:
        out.append("FSDP2")
    return out


def _zero_stage(engine: Any) -> int | None:
    try:
        return int(engine.zero_optimization_stage())
    except Exception:
        return None


def parameter_count(root: nn.Module) -> int:
    """Every parameter's full size, also where this rank holds only a part (DeepSpeed ZeRO-3 keeps ``ds_numel``;
    FSDP2's DTensors answer their global size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in root.parameters())


def human_count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.1f}B"
    if n >= 10**6:
        return f"{n / 1e6:.0f}M" if n >= 10**7 else f"{n / 1e6:.1f}M"
    if n >= 10**3:
        return f"{n / 1e3:.0f}K"
    return str(n)


def live_modules() -> list[nn.Module]:
    """Every ``nn.Module`` alive in the process (one ``gc`` scan: at a callback's start or an attach, never per
    step). ``type()``, not ``isinstance``: a lazy proxy's ``__class__`` (torch's deprecated ``reduce_op``) warns."""
    import gc

    return [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]


def outermost_wrapper(model: nn.Module) -> nn.Module:
    """The outermost wrapper alive in the process around ``model`` (DDP, FSDP1, torch.compile, DeepSpeed, Lightning's
    strategy wrappers), else ``model``: what a Trainer's callback, given the bare model, runs inside."""
    best, best_depth = model, 0  # (a search of the process's modules: a callback's start, never per step)
    for obj in live_modules():
        if not is_wrapper(obj):
            continue
        depth, inner = 0, obj
        while inner is not model and is_wrapper(inner):
            inner, depth = _inner(inner), depth + 1
        if inner is model and depth > best_depth:
            best, best_depth = obj, depth
    return best


def describe(model: nn.Module, optimizer: Any, grads: str, watch: str | None = None,
             headroom_every: int | None = None, record_every: int | None = None) -> str:
    """``GPT2LMHeadModel (124M params) with AdamW, DDP, grads=params, watch=boundaries`` for ``model`` as given to the
    monitor (``watch``: the level its steps are watched at, when known; ``headroom_every``: headroom=True;
    ``record_every``: a recorded timeline's period, whose steps are watched at every module whatever ``watch`` says)."""
    chain = wrapper_chain(model)
    return _described(chain, user_class_name(chain[-1]), optimizer, grads, watch, headroom_every, record_every)


def _described(chain: list[nn.Module], root_class: str, optimizer: Any, grads: str, watch: str | None,
               headroom_every: int | None, record_every: int | None = None) -> str:
    root = chain[-1]
    parts = [f"{root_class} ({human_count(parameter_count(root))} params)"]
    with_ = [type(optimizer).__name__ if optimizer is not None else "no optimizer", *wrappers_of(chain, root_class)]
    return (f"{parts[0]} with {', '.join(with_)}, grads={grads}" + (f", watch={watch}" if watch else "")
            + (f", headroom every {headroom_every} steps" if headroom_every else "")
            + (f", recording {'every step' if record_every == 1 else f'every {record_every} steps'} (watched at every "
               "module)" if record_every else ""))


class WatchedModel:
    """The model as the monitor meets it, found once when it attaches (see the module docstring).

    Attributes:
        given (nn.Module): the model as handed to the monitor, wrappers and all.
        root (nn.Module): the user's module inside them: what reports name ``(the model)``.
        engine (Engine): the adapter for the machinery around it (:mod:`..engines`).
        optimizer: the optimizer the engine hooks (None without one); ``scaler``: its ``LossScaler`` (or None).
        modules (list[tuple[str, nn.Module]]): the user's modules with the user's names, the root first.
        infos (dict[int, ModuleInfo]): ``id(module)`` -> its :class:`~.frames.ModuleInfo`, one per module.
        regions (Regions): the compiled regions (``torch.compile``) and their edges.
        params (list[nn.Parameter]): the trainable parameters (this rank's, under a sharding engine).
        cuda_devices (tuple[int, ...]): the GPUs the parameters are on (whose RNG state a replay restores).
        world (int): the ranks of torch.distributed (1 without it); ``sharded``: with several ranks, the forward
            makes collectives by design (FSDP, ZeRO-3), so it cannot be replayed on one rank alone.
    """

    def __init__(self, model: nn.Module, optimizer: Any, scaler: Any, world: int = 1) -> None:
        self.given = model
        self._seen = seen = look_through(model, world)  # the one walk through the wrappers
        self.root = seen.root
        self.engine: Engine = select_engine(seen.chain, optimizer, scaler)
        self.optimizer = self.engine.optimizer
        self.scaler = self.engine.scaler
        self.modules = seen.modules
        self.regions = Regions(seen.regions, seen.classes, self.root)
        root_region = self.regions.root
        self.infos: dict[int, ModuleInfo] = {
            id(module): ModuleInfo(name, seen.classes[id(module)], weakref.ref(module),
                                   is_root=module is self.root and root_region is None)
            for name, module in self.modules}
        self.params = self.engine.trainable()
        self.devices = {p.device for p in self.params if p.device.type != "meta"} | {torch.device("cpu")}
        self.cuda_devices = tuple(sorted({d.index or 0 for d in self.devices if d.type == "cuda"}))
        self.world = world
        self.sharded = seen.sharded

    def describe(self, grads: str, watch: str | None = None, headroom_every: int | None = None,
                 record_every: int | None = None) -> str:
        """What is watched, in one line (:func:`describe`)."""
        seen = self._seen
        return _described(seen.chain, seen.classes[id(seen.root)], self.optimizer, grads, watch, headroom_every,
                          record_every)

    def class_of(self, name: str) -> str:
        """The class a report names the watched module ``name`` by (as its frames do), or "?" when none is."""
        return next((i.cls for i in self.infos.values() if i.name == name), "?")

    def kept_in_fp32(self) -> tuple[str, ...]:
        """The modules a ``keep_fp32`` guard keeps in fp32 now (what a report's advice must extend)."""
        return kept_in_fp32(self.modules)

    def late_regions(self) -> Regions:
        """Compiled regions made since the monitor attached (``model.compile()`` after it): found anew."""
        seen = look_through(self.root)
        return Regions(seen.regions, seen.classes, self.root)

    def where(self, rank: int | None) -> str:
        """`` (rank R, host H, device D)``: where a fault that did not reproduce happened."""
        parts = []
        if rank is not None:
            parts.append(f"rank {rank}")
        parts.append(f"host {socket.gethostname()}")
        devices = sorted({str(p.device) for p in self.params if p.device.type != "meta"})
        if devices:
            name = ""
            if devices[0].startswith("cuda"):
                with contextlib.suppress(Exception):
                    name = f" ({torch.cuda.get_device_name(torch.device(devices[0]))})"
            parts.append(f"device {', '.join(devices[:4])}{name}")
        return " (" + ", ".join(parts) + ")"

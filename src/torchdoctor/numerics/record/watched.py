"""What a monitor watches, in one line: the user's model, its size, the optimizer, the wrappers around it.

``GPT2LMHeadModel (124M params) with AdamW, DDP, grads=params`` -- logged when ``torchdoctor run --numerics``
attaches, and kept in every report, so a run under a wrapper other than the one asked for (accelerate running DDP
where FSDP was configured) says which one was watched.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..engines.wrappers import _inner, is_wrapper, unwrap_model, user_class_name

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


def wrappers_of(model: nn.Module) -> list[str]:
    """The wrappers around the user's module, outermost first (FSDP2 is a class swap, not a wrapper)."""
    out = []
    while is_wrapper(model):
        name = type(model).__name__
        out.append(_SHORT.get(name, name))
        if out[-1] is None:
            out.pop()
        elif name == "DeepSpeedEngine":
            stage = _zero_stage(model)
            if stage is not None:
                out[-1] = f"DeepSpeed ZeRO-{stage}"
        model = _inner(model)
    root = unwrap_model(model)
    if user_class_name(root) != type(root).__name__:
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
    best, best_depth = model, 0
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
             headroom_every: int | None = None) -> str:
    """``GPT2LMHeadModel (124M params) with AdamW, DDP, grads=params, watch=boundaries`` for ``model`` as given to the
    monitor (``watch``: the level its steps are watched at, when known; ``headroom_every``: headroom=True)."""
    root = unwrap_model(model)
    parts = [f"{user_class_name(root)} ({human_count(parameter_count(root))} params)"]
    with_ = [type(optimizer).__name__ if optimizer is not None else "no optimizer", *wrappers_of(model)]
    return (f"{parts[0]} with {', '.join(with_)}, grads={grads}" + (f", watch={watch}" if watch else "")
            + (f", headroom every {headroom_every} steps" if headroom_every else ""))

"""Looking through the wrappers that distributed training and compilation put around a model.

Reports speak the user's names (``blocks.0.fc1``) and classes (``Block``), whatever sits around the
modules at run time: DDP / DataParallel / FSDP1 / a DeepSpeed engine around the root,
``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), FSDP1's per-unit wrappers
(``_fsdp_wrapped_module``), activation-checkpoint wrappers (``_checkpoint_wrapped_module``), and the
``FSDP<Class>`` classes FSDP2 swaps in, and Lightning's: Fabric's ``_FabricModule`` and the Trainer's
strategy wrappers (``_LightningModuleWrapperBase``), which keep the module as ``_forward_module``. The same
names must resolve wherever a user passes one back (``keep_fp32(model, "encoder.block.2")`` on a DDP model),
so this module is shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

# attribute names under which a wrapper keeps the module it wraps; they never appear in a user's name
WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_forward_module"})

# wrappers whose forward only calls the module they wrap (by class name: no import of what is absent)
_TRANSPARENT = frozenset({
    "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper",
    "OptimizedModule", "DeepSpeedEngine", "PipelineEngine",
    # Lightning (lightning.fabric / lightning.pytorch, or the standalone lightning_fabric / pytorch_lightning)
    "_FabricModule", "_LightningModuleWrapperBase", "_LightningPrecisionModuleWrapperBase",
})

# the packages whose wrappers those class names are (a user's class of the same name is not looked through)
_WRAPPER_PACKAGES = ("torch.", "deepspeed.", "lightning.", "lightning_fabric.", "pytorch_lightning.")


def is_wrapper(module: nn.Module) -> bool:
    """A torch / DeepSpeed / Lightning wrapper whose forward only calls the module it wraps."""
    cls = type(module)
    if cls.__name__ not in _TRANSPARENT or not cls.__module__.startswith(_WRAPPER_PACKAGES):
        return False
    return isinstance(_inner(module), nn.Module)


def _inner(module: nn.Module) -> nn.Module | None:
    # Lightning's wrappers: _forward_module is what forward calls (DDP around the module, or the module itself);
    # _FabricModule also registers _original_module when the two differ -- it sits inside _forward_module
    for attr in ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module", "module"):
        inner = module.__dict__.get("_modules", {}).get(attr)
        if isinstance(inner, nn.Module):
            return inner
    return None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside every wrapper around the root (DDP in OptimizedModule, ...)."""
    while is_wrapper(model):
        model = _inner(model)
    return model


def wrapper_chain(model: nn.Module) -> list[nn.Module]:
    """``model``, each wrapper inside it, and last the user's module: the one walk through the wrappers that a
    monitor makes when it attaches (:class:`~..record.watched.WatchedModel`), so nothing after it unwraps again."""
    chain = [model]
    while is_wrapper(chain[-1]):
        chain.append(_inner(chain[-1]))
    return chain


def clean_name(name: str) -> str:
    """A qualified name without the wrappers' own segments (``blocks.0._fsdp_wrapped_module.fc1`` ->
    ``blocks.0.fc1``)."""
    if "._" not in name and not name.startswith("_"):
        return name
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def user_class_name(module: nn.Module) -> str:
    """The user's class: FSDP2 swaps in ``FSDP<Class>``, a subclass of FSDPModule and of the user's class."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and cls.__module__.startswith("torch.distributed"):
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("torch.distributed.fsdp"):
                return base.__name__
    return cls.__name__


def named_user_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``root.named_modules()`` as the user wrote the model: wrappers skipped, names cleaned."""
    return user_modules(unwrap_model(root))


def user_modules(user_root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """:func:`named_user_modules` of a module already unwrapped (the wrappers inside it, FSDP1's per-unit ones,
    skipped)."""
    for name, module in user_root.named_modules():
        if not is_wrapper(module):
            yield clean_name(name), module


def sharded(module: nn.Module) -> bool:
    """Does this module's forward make collectives by design (FSDP unshards, ZeRO-3 gathers)?"""
    for m in module.modules():
        if type(m).__name__ == "FullyShardedDataParallel" or any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            return True
    return any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor" for p in module.parameters())


@dataclass
class LookedThrough:
    """What a model is under its wrappers, found in one pass (:func:`look_through`)."""

    chain: list[nn.Module]  # the model as given, each wrapper inside it, the user's module last
    modules: list[tuple[str, nn.Module]]  # the user's modules with the user's names, the root first
    classes: dict[int, str]  # id(module) -> the user's class name
    regions: list[tuple[str, nn.Module, nn.Module]]  # compiled regions: (user name, outer, inner), outermost first
    sharded: bool  # with several ranks: the forward makes collectives by design (FSDP, ZeRO-3, DTensor)

    @property
    def root(self) -> nn.Module:
        return self.chain[-1]


def look_through(model: nn.Module, world: int = 1) -> LookedThrough:
    """Everything the monitor asks of ``model``'s wrappers, once: the chain, the user's modules and classes, the
    compiled regions (``torch.compile``'s ``OptimizedModule``, ``module.compile()``), and, with several ranks
    (``world``), whether the forward is sharded."""
    chain = wrapper_chain(model)
    modules = list(user_modules(chain[-1]))
    classes = {id(m): user_class_name(m) for _, m in modules}
    return LookedThrough(chain, modules, classes, compiled_regions(model, modules, classes),
                         world > 1 and sharded(model))


def compiled_regions(model: nn.Module, modules: list[tuple[str, nn.Module]],
                     classes: dict[int, str]) -> list[tuple[str, nn.Module, nn.Module]]:
    """(user name, outer, inner) of every compiled region in ``model``, outermost first: an ``OptimizedModule``
    (``torch.compile(module)``; ``inner`` its module under any wrappers), or a module whose ``_compiled_call_impl``
    is set (``module.compile()``); ``modules``/``classes`` name them as the user does."""
    names = {id(m): name for name, m in modules}
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            inner = unwrap_model(module._orig_mod)
        elif module.__dict__.get("_compiled_call_impl") is not None and not is_wrapper(module):
            inner = module
        else:
            continue
        if id(inner) not in classes:
            classes[id(inner)] = user_class_name(inner)
        found.append((names.get(id(inner), clean_name(name)), module, inner))
    return found

"""One call of the model (a micro-batch), kept while its step runs: what a replay of it needs.

Each call leaves a :class:`RootCall`: its inputs (references to the batch, never copies) with their version
counters, the RNG state of every device the model uses, the autocast state, the grad and train/eval modes, and,
once its backward has run, the gradient its outputs received (the loss's alone when the model returns one; at most
:data:`GRAD_BYTES_KEPT` per call). Nothing of it is read on a healthy step, and it is dropped when the step ends;
:mod:`..judge.replay` runs it again when the step's check fails.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...units import human_bytes
from ..measure.slots import labelled_outputs

#: The gradient a micro-batch's outputs receive is kept for a backward replay up to this many bytes (a loss is 4;
#: a model that returns logits and leaves the loss to the loop keeps its logits' gradient, batch x tokens x vocab).
#: Above it the gradient is not kept: a backward fault in that micro-batch is then reported where the step's
#: check found it (a parameter gradient), with the reason, not replayed.
GRAD_BYTES_KEPT = 64 << 20


@dataclass(eq=False, slots=True)
class RootCall:
    """One call of the model (a micro-batch): what replaying it needs, kept until its step is checked."""

    module: nn.Module  # the module called: the model, or a module the loop calls on its own (monitor._entries)
    args: tuple
    kwargs: dict
    start: int  # index in the step's frames where this call's frames begin
    cpu_rng: torch.Tensor
    cuda_rng: dict[int, torch.Tensor]  # device index -> its generator's state
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of every autocast on at the call
    training: bool
    versions: list[tuple[torch.Tensor, int]]  # the inputs' tensors and their versions as the call began
    forward: Any = None  # a forward set on the instance for this call (Lightning's redirection to training_step)
    changed_in_forward: bool = False  # the forward itself changed one of its inputs in place
    output_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # by output label
    grad_bytes: int = 0
    dropped: str | None = None  # an output whose gradient was above GRAD_BYTES_KEPT
    unseen: str | None = None  # why the call cannot be replayed as it ran, known when it began


def _input_tensors(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensors among a call's arguments, and one level into a list, tuple or dict among them (a batch)."""
    out = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, torch.Tensor)]
        elif isinstance(a, dict):
            out += [x for x in a.values() if isinstance(x, torch.Tensor)]
    return out


def _versions(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    out = []
    for t in tensors:
        with contextlib.suppress(RuntimeError):  # an inference tensor has no version counter (nor in-place changes)
            out.append((t, t._version))
    return out


def _autocast_now() -> tuple[tuple[str, torch.dtype], ...]:
    on = []
    for device_type in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device_type):
                on.append((device_type, torch.get_autocast_dtype(device_type)))
        except (TypeError, AttributeError):  # torch < 2.4: the device-specific spellings
            if device_type == "cpu" and torch.is_autocast_cpu_enabled():
                on.append(("cpu", torch.get_autocast_cpu_dtype()))
            elif device_type == "cuda" and torch.is_autocast_enabled():
                on.append(("cuda", torch.get_autocast_gpu_dtype()))
    return tuple(on)


def capture(model: nn.Module, args: tuple, kwargs: dict | None, start: int, cuda_devices: tuple[int, ...]) -> RootCall:
    """What a replay of this call will need, taken as the model's forward begins (references and a few small
    states: the CPU generator's 5 KB, 16 bytes per GPU)."""
    cuda = {d: torch.cuda.get_rng_state(d) for d in cuda_devices}
    return RootCall(model, args, kwargs if kwargs is not None else {}, start, torch.get_rng_state(), cuda,
                    _autocast_now(), model.training, _versions(_input_tensors(args, kwargs)),
                    model.__dict__.get("forward"))


def forward_ended(call: RootCall) -> None:
    """The call's forward returned: did it change one of its own inputs in place? (Then a replay would start from
    another value than the forward did.)"""
    call.changed_in_forward = any(t._version != v for t, v in call.versions)


def keep_output_grads(call: RootCall, output: Any, rec: Any) -> bool:
    """Keep the gradient the model's output receives, for a backward replay: a 0-d output (the loss the model
    computed) is enough and small; otherwise every differentiable output, up to :data:`GRAD_BYTES_KEPT` in all.
    The hook also notes in ``rec`` (the step's record) that a backward ran. Whether any output was hooked."""
    outs = [(label, v) for label, v in labelled_outputs(output) if isinstance(v, torch.Tensor) and v.requires_grad]
    losses = [(label, v) for label, v in outs if v.dim() == 0]
    for label, v in losses or outs:
        v.register_hook(_Keeper(call, label, rec))
    return bool(outs)


class _Keeper:
    __slots__ = ("call", "label", "rec")

    def __init__(self, call: RootCall, label: str, rec: Any) -> None:
        self.call, self.label, self.rec = call, label, rec

    def __call__(self, grad: torch.Tensor) -> None:
        self.rec.backward_ran = True
        call = self.call
        size = grad.numel() * grad.element_size()
        if call.grad_bytes + size > GRAD_BYTES_KEPT:
            call.dropped = call.dropped or f"{self.label}, {human_bytes(size)}"
            return
        call.grad_bytes += size
        call.output_grads[self.label] = grad


def changed_input(call: RootCall) -> str | None:
    """Why the call cannot be replayed as it ran, or None: an input changed in place since its forward began (or a part
    of the call was not seen)."""
    if call.unseen is not None:
        return call.unseen
    if call.changed_in_forward:
        return "the forward changed one of its own inputs in place, so a replay would start from another value"
    for t, v in call.versions:
        if t._version != v:
            return (f"an input of the call (a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor) was "
                    "changed in place after its forward, so a replay would not see what the forward saw")
    return None

"""The gradients of the fp32 backward that the target dtype would compute: every tensor the forward makes in it
(a module's output or a functional op's in the model's own code -- ``torch.sigmoid`` in a forward -- alike), every
value autocast casts down for an op (its gradient is computed in the target dtype, then cast back), and the
parameters those ops read. Watched by the :class:`~.ops.Recorder` of the fp32 pass, op by op, against the
target dtype's pass (``narrow``: which values were in it there).

Each gradient feeds, on the device: its largest finite magnitude (how far a loss scale may go before it
overflows), a log2 histogram of its nonzero magnitudes (parameters: how many a scale flushes to zero), and whether
it is finite at all -- a backward that is non-finite in fp32 already is no precision question, and the first
tensor whose gradient went non-finite is named with the op that made it and the ops that read it. One host read
at the end (:meth:`GradWatch.read`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

#: the histograms' bins: one per power of two, 2**LOW_EXP .. 2**HIGH_EXP (fp32's whole range)
LOW_EXP, HIGH_EXP = -150, 130
HIST_SAMPLE = 1 << 16  # gradient values per tensor put in the histogram


@dataclass
class Producer:
    op: str  # the aten op that made the tensor ("input": one the model was given)
    module: str  # the module running it ("" for the model's own code)
    index: int  # its place among the recorded ops (-1: an input)
    consumers: list[str] = field(default_factory=list)  # the recorded ops that read it: "op in module" ("op at
    #                                                     file:line in function" in the model's own code)
    narrow: bool = False  # its gradient is computed in the target dtype (made in it, or cast down for an op)
    hooked: bool = False


@dataclass
class GradFacts:
    peak: float  # the largest finite gradient magnitude computed in the target dtype (activations and parameters)
    act_hist: list[float]  # nonzero gradient magnitudes of those tensors per power of two (LOW_EXP ..)
    param_hist: list[float]  # the same for the gradients of the parameters ops in the target dtype read
    narrow_params: list[str]  # those parameters
    nonfinite_params: list[str]  # parameters whose fp32 gradient is not finite
    first_nonfinite: Producer | None  # the first watched tensor whose fp32 gradient went inf/nan, in backward order
    nonfinite_tensors: int  # how many watched tensors had a non-finite gradient
    watched: int  # tensors whose gradients were watched


def grad_row(g: torch.Tensor, hist: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient's largest finite magnitude, exact; whether all of it is finite), its nonzero finite magnitudes
    added to ``hist`` (a strided sample of at most :data:`HIST_SAMPLE` values: the histogram estimates shares, the
    peak is read in full)."""
    a = g.detach().flatten().abs().float()
    finite = torch.isfinite(a)
    if hist is not None:
        sample = a if a.numel() <= HIST_SAMPLE else a[:: -(-a.numel() // HIST_SAMPLE)]
        nz = sample[(sample > 0) & torch.isfinite(sample)]
        if nz.numel():
            hist.append(torch.histc(torch.log2(nz), bins=HIGH_EXP - LOW_EXP, min=LOW_EXP, max=HIGH_EXP))
    if not a.numel():
        return a.sum(), torch.ones((), dtype=torch.bool, device=a.device)
    return torch.where(finite, a, torch.zeros_like(a)).amax(), finite.all()


class GradWatch:
    """Hooks the gradients of a forward's tensors as the fp32 pass's :class:`~.ops.Recorder` sees its ops
    (``Recorder(..., seen=watch.seen)``); :meth:`finish` after the forward, :meth:`read` after the backward."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr(): (n, p) for n, p in model.named_parameters()
                       if p.is_floating_point()}
        self.narrow_params: dict[str, nn.Parameter] = {}
        self.tensors: dict[int, tuple[weakref.ref, Producer]] = {}  # id -> (the tensor, what made it)
        self.pending: list[tuple[weakref.ref, Producer]] = []  # outputs in the target dtype, hooked at finish()
        self.fired: list[tuple[Producer, torch.Tensor, torch.Tensor]] = []  # (tensor, finite peak, all finite)
        self.act_hist: list[torch.Tensor] = []
        self.on = True

    def _record(self, t: torch.Tensor) -> Producer | None:
        got = self.tensors.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def seen(self, index: int, module: str, name: str, where: str | None, ins: list, outs: list,
             narrow_ins: list[bool], narrow_outs: list[bool]) -> None:
        """One op of the forward: its inputs get their hooks now (autograd has made them already), its outputs
        are remembered (autograd makes them after this returns)."""
        if not self.on:
            return
        reader = f"{name} in {module}" if module else f"{name} at {where}" if where else f"{name} in (the model)"
        for t, narrow in zip(ins, narrow_ins):
            param = self.params.get(t.untyped_storage().data_ptr())
            if param is not None:  # a parameter (or a view of one): its .grad is read after the backward
                if narrow:
                    self.narrow_params[param[0]] = param[1]
                continue
            rec = self._record(t)
            if rec is None:
                if not t.requires_grad:
                    continue
                # made by no recorded op: an input of the model, or a copy, cat or view of a value
                rec = Producer("input" if t.grad_fn is None else "(a copy, view or cat)", module, -1)
                self.tensors[id(t)] = (weakref.ref(t), rec)
            self._hook(t, rec)
            rec.consumers.append(reader)
            rec.narrow = rec.narrow or narrow
        for t, narrow in zip(outs, narrow_outs):
            rec = Producer(name, module, index, narrow=narrow)
            self.tensors[id(t)] = (weakref.ref(t), rec)
            if narrow:
                self.pending.append((weakref.ref(t), rec))

    def _hook(self, t: torch.Tensor, rec: Producer) -> None:
        if not t.requires_grad or rec.hooked:
            return
        rec.hooked = True

        def hook(g: torch.Tensor) -> None:
            peak, finite = grad_row(g, self.act_hist if rec.narrow else None)
            self.fired.append((rec, peak if rec.narrow else torch.zeros_like(peak), finite))
        t.register_hook(hook)

    def finish(self) -> None:
        """After the forward: hook the outputs in the target dtype no recorded op read (the model's outputs)."""
        self.on = False
        for ref, rec in self.pending:
            t = ref()
            if t is not None and t.requires_grad:
                self._hook(t, rec)
        self.pending.clear()
        self.tensors.clear()

    def read(self) -> GradFacts:
        """After the backward: the parameters' gradients added, then one host read."""
        param_hist: list[torch.Tensor] = []
        narrow = [(n, p) for n, p in self.narrow_params.items() if p.grad is not None]
        rows = [grad_row(p.grad, param_hist) for _, p in narrow]
        names = [n for _, (n, p) in self.params.items() if p.grad is not None]
        flags = [torch.isfinite(p.grad).all() for _, (n, p) in self.params.items() if p.grad is not None]
        bins = HIGH_EXP - LOW_EXP
        device = next((r[0].device for r in rows), None) or next((f[1].device for f in self.fired), None)
        zero = torch.zeros(1, device=device)
        peaks = [r[0] for r in rows] + [f[1] for f in self.fired]
        read = torch.cat([
            torch.stack(peaks).amax().view(1) if peaks else zero,
            torch.stack(self.act_hist).sum(0) if self.act_hist else torch.zeros(bins, device=device),
            torch.stack(param_hist).sum(0) if param_hist else torch.zeros(bins, device=device),
            torch.stack([f[2] for f in self.fired]).float() if self.fired else zero[:0],
            torch.stack(flags).float() if flags else zero[:0],
        ]).tolist()
        peak, read = read[0], read[1:]
        act_hist, param_hist_v, read = read[:bins], read[bins:2 * bins], read[2 * bins:]
        fired_ok, param_ok = read[:len(self.fired)], read[len(self.fired):]
        bad = [rec for (rec, _, _), ok in zip(self.fired, fired_ok) if not ok]
        return GradFacts(peak, act_hist, param_hist_v, [n for n, _ in narrow],
                         [n for n, ok in zip(names, param_ok) if not ok], bad[0] if bad else None, len(bad),
                         len(self.fired))

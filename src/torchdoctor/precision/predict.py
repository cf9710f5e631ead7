"""From a :class:`~.probe.Probe` to a prediction: where values will overflow or underflow in the target dtype,
which weights it cannot hold, and which loss scale keeps the gradients in its range.

A value overflows where it is *computed* in the target dtype: an op that autocast runs in fp16 (a matmul, a
linear) and whose fp32 result, or an input it casts down, is beyond the dtype's largest value. The fp32 pass gives
the magnitude, the target dtype's pass which ops run narrow (:func:`~.ops.paired`); a value within 2x of the
largest is *at risk* (one more doubling of the activations, a few hundred steps of growth, overflows it). When the
two passes did not run the same ops (control flow that depends on the dtype), the prediction falls back to the
modules' outputs, said so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .grads import LOW_EXP, Producer
from .ops import FLUSHED, IN_MAX, NONZERO, OUT_MAX, SUBNORMAL
from .probe import Probe

RISK_FACTOR = 2.0  # within this factor of the dtype's largest value: at risk
FLUSH_SHARE = 0.01  # a module whose values flush to zero at least this often is worth a line
SUBNORMAL_SHARE = 0.10  # ... or turn subnormal (lose precision) at least this often
DEFAULT_SCALE_POWER = 16  # torch.amp.GradScaler(init_scale=2.**16) and DeepSpeed's "initial_scale_power": 16


@dataclass
class Site:
    """A module where a value leaves (or nears the edge of) the target dtype's range."""

    module: str
    cls: str
    op: str  # the op computing it ("output" when only the module's output was seen)
    peak: float  # the fp32 magnitude
    dtype_max: float
    reaches_output: bool = True  # in the target dtype's forward, the module's output went non-finite (an inf
    #                              inside that a saturating function absorbs -- tanh(inf) = 1 -- does not)
    where: str | None = None  # the model's own code (module ""): the line computing it, "file:line in function"

    @property
    def name(self) -> str:
        """The module, or the model's own code named by its line."""
        return self.module or model_code(self.where)

    @property
    def headroom(self) -> float:
        """How many times larger the value can grow before it overflows (< 1: it already does)."""
        return self.dtype_max / self.peak if self.peak > 0 else math.inf

    @property
    def bits(self) -> float:
        return math.log2(self.headroom) if self.peak > 0 else math.inf

    def to_json(self) -> dict:
        return {"module": self.module, "class": self.cls, "op": self.op, "peak": self.peak,
                "headroom": self.headroom, "headroom_bits": round(self.bits, 2), "reaches_output": self.reaches_output,
                "where": self.where}


def model_code(where: str | None) -> str:
    """How the model's own code (its forward, outside any submodule) is named."""
    return f"(the model) at {where}" if where else "(the model)"


@dataclass
class Underflow:
    module: str
    flushed: float  # share of its nonzero values that become 0
    subnormal: float  # share that become subnormal (fewer significant bits)
    values: int
    where: str | None = None  # the model's own code (module ""): its first such line

    @property
    def name(self) -> str:
        return self.module or model_code(self.where)

    def to_json(self) -> dict:
        return {"module": self.module, "flushed": self.flushed, "subnormal": self.subnormal, "values": self.values,
                "where": self.where}


@dataclass
class LossScale:
    """Which powers of two the measured gradients predict keep the scaled gradients inside fp16: no gradient the
    fp16 backward computes (activations and the parameters fp16 ops read) overflows up to ``max_power``; at most
    :data:`FLUSH_SHARE` of the nonzero parameter gradients -- what the optimizer sees -- flush to zero from
    ``min_power`` on (an activation's gradient far below the others of its tensor is no loss: its share of the sums
    it feeds is what the parameters' gradients show). A prediction: :func:`~.fix.check_scales` runs the backward
    at the scales it names, and the verdict follows the checks."""

    grad_peak: float
    max_power: int | None  # None: no gradient measured
    min_power: int | None  # None: no power keeps the small gradients
    flushed_unscaled: float  # share of nonzero parameter gradients that flush to zero with no scaling
    flushed_at: dict[int, float] = field(default_factory=dict)  # power -> share flushed

    @property
    def works(self) -> bool:
        return self.max_power is not None and self.min_power is not None and self.min_power <= self.max_power

    @property
    def power(self) -> int | None:
        """The power to start from: the default when it works, else the nearest that does."""
        if not self.works:
            return None
        return min(max(DEFAULT_SCALE_POWER, self.min_power), self.max_power)

    def to_json(self) -> dict:
        return {"grad_peak": self.grad_peak, "max_power": self.max_power, "min_power": self.min_power,
                "works": self.works, "power": self.power, "flushed_unscaled": self.flushed_unscaled,
                "flushed_at_power": self.flushed_at.get(self.power) if self.power is not None else None}


@dataclass
class Fp32Fault:
    """The fp32 passes themselves are not finite: no dtype question can be answered before that is fixed."""

    loss: float  # the fp32 loss
    params: list[str]  # parameters whose fp32 gradient is inf/nan
    first: Producer | None  # the first watched tensor whose fp32 gradient went inf/nan, in backward order
    tensors: int  # watched tensors whose gradient went inf/nan

    def to_json(self) -> dict:
        first = self.first
        return {"loss": self.loss, "params": self.params, "tensors": self.tensors,
                "first": None if first is None else {"op": first.op, "module": first.module,
                                                     "read_by": first.consumers}}


@dataclass
class Prediction:
    target: torch.dtype
    dtype_max: float
    paired: bool
    overflow: list[Site]  # beyond the range, and the module's output went non-finite in the target dtype
    at_risk: list[Site]  # within RISK_FACTOR of it
    absorbed: list[Site]  # beyond the range inside a module whose output stayed finite
    underflow: list[Underflow]
    weights_over: list[tuple[str, float]]
    weights_at_risk: list[tuple[str, float]]
    weights_flushed: list[tuple[str, float]]  # (name, share of nonzero values flushed to zero)
    loss_scale: LossScale | None  # fp16 only
    observed_first: str | None  # the first module whose output went non-finite in the target dtype's forward
    notes: list[str] = field(default_factory=list)
    buffers_over: list[tuple[str, float]] = field(default_factory=list)  # buffers a cast of the model makes inf
    fp32_fault: Fp32Fault | None = None

    @property
    def overflows(self) -> bool:
        """An overflow in the forward (predicted, or seen in the target dtype's pass), or weights beyond the range;
        the loss scale is judged by its checks (:func:`~.fix.check_scales`)."""
        return bool(self.overflow or self.weights_over or self.observed_first)


def _module_sites(probe: Probe, dtype_max: float) -> list[Site]:
    """Per module, the largest value it computes in the target dtype (paired ops), in execution order."""
    best: dict[str, Site] = {}
    classes = {m.name: m.cls for m in probe.modules.values()}
    for wide, narrow in zip(probe.fp32_ops, probe.narrow_ops):
        if not narrow.computes(probe.target):
            continue
        peak = max(wide.stats[OUT_MAX], wide.stats[IN_MAX])
        site = best.get(wide.module)
        if site is None or peak > site.peak:
            op = wide.name if wide.stats[OUT_MAX] >= wide.stats[IN_MAX] else f"{wide.name} (its input)"
            best[wide.module] = Site(wide.module, classes.get(wide.module, "?"), op, peak, dtype_max,
                                     where=wide.where)
    order = {name: i for i, name in enumerate(probe.modules)}
    return sorted(best.values(), key=lambda s: order.get(s.module, -1))


def _output_sites(probe: Probe, dtype_max: float) -> list[Site]:
    return [Site(m.name, m.cls, "output", m.out_max, dtype_max) for m in probe.modules.values() if m.narrow]


def _underflow(probe: Probe) -> list[Underflow]:
    """Per module, the share of the values it computes in the target dtype that the dtype flushes to zero or makes
    subnormal, counted on their fp32 values (in the narrow pass they are already gone)."""
    per: dict[str, list[float]] = {}
    where: dict[str, str | None] = {}
    for wide, narrow in zip(probe.fp32_ops, probe.narrow_ops):
        if not narrow.computes(probe.target):
            continue
        row = per.setdefault(wide.module, [0.0, 0.0, 0.0])
        row[0] += wide.stats[NONZERO]
        row[1] += wide.stats[FLUSHED]
        row[2] += wide.stats[SUBNORMAL]
        if wide.stats[FLUSHED] or wide.stats[SUBNORMAL]:
            where.setdefault(wide.module, wide.where)
    out = [Underflow(m, f / n, s / n, int(n), where.get(m)) for m, (n, f, s) in per.items() if n]
    out = [u for u in out if u.flushed >= FLUSH_SHARE or u.subnormal >= SUBNORMAL_SHARE]
    return sorted(out, key=lambda u: (-u.flushed, -u.subnormal))


def _flushed_share(hist: list[float], power: int, target: torch.dtype) -> float:
    """Share of the histogram's nonzero gradients that flush to zero once multiplied by ``2**power``: a value in
    bin ``[2**e, 2**(e+1))`` flushes when ``2**(e+1+power)`` is at most half the dtype's smallest subnormal."""
    total = sum(hist)
    if not total:
        return 0.0
    info = torch.finfo(target)
    flush_exp = math.log2(float(info.smallest_normal) * float(info.eps) / 2)
    flushed = sum(c for i, c in enumerate(hist) if LOW_EXP + i + 1 + power <= flush_exp)
    return flushed / total


def loss_scale(probe: Probe, dtype_max: float) -> LossScale:
    peak = probe.grads.peak
    hist = probe.grads.param_hist if sum(probe.grads.param_hist) else probe.grads.act_hist
    if not sum(hist) or peak <= 0 or not math.isfinite(peak):
        return LossScale(peak, None, None, 0.0)
    max_power = math.floor(math.log2(dtype_max / RISK_FACTOR / peak))
    flushed = {k: _flushed_share(hist, k, probe.target)
               for k in range(max_power - 64, max(max_power, DEFAULT_SCALE_POWER) + 1)}  # (a check may go above)
    min_power = next((k for k in sorted(flushed) if k <= max_power and flushed[k] <= FLUSH_SHARE), None)
    return LossScale(peak, max_power, min_power, _flushed_share(hist, 0, probe.target), flushed)


def predict(probe: Probe) -> Prediction:
    target = probe.target
    dtype_max = float(torch.finfo(target).max)
    notes = list(probe.notes)
    if probe.paired:
        sites = _module_sites(probe, dtype_max)
    else:
        sites = _output_sites(probe, dtype_max)
        notes.append("the fp32 and the reduced-precision forwards did not run the same ops (control flow that "
                     "depends on the dtype), so values inside modules are not compared: modules' outputs only")
    bad = {m.name for m in probe.modules.values() if m.narrow_bad}
    for s in sites:
        s.reaches_output = s.module in bad
    beyond = [s for s in sites if s.peak > dtype_max]
    overflow = [s for s in beyond if s.reaches_output]
    absorbed = [s for s in beyond if not s.reaches_output]
    at_risk = [s for s in sites if dtype_max / RISK_FACTOR < s.peak <= dtype_max]
    observed = probe.first_narrow_bad
    if observed is not None and not any(s.module == observed for s in overflow):
        info = probe.modules[observed]
        overflow.insert(0, Site(observed, info.cls, "output", info.out_max, dtype_max))
        notes.append(f"in the {_name(target)} forward {observed or '(the model)'} went non-finite first, though no "
                     f"value it computes in {_name(target)} is beyond the range in fp32 (an op outside autocast's "
                     "lists, or rounding)")
    weights_over = [(n, m) for n, m, _, _ in probe.weights if m > dtype_max]
    buffers_over = [(n, m) for n, m, _, _ in probe.buffers if m > dtype_max]
    weights_at_risk = [(n, m) for n, m, _, _ in probe.weights if dtype_max / RISK_FACTOR < m <= dtype_max]
    weights_flushed = [(n, f / k) for n, _, f, k in probe.weights if k and f / k >= FLUSH_SHARE]
    scale = loss_scale(probe, dtype_max) if target == torch.float16 else None
    underflow = _underflow(probe) if probe.paired else []
    g = probe.grads
    fault = (Fp32Fault(probe.loss, g.nonfinite_params, g.first_nonfinite, g.nonfinite_tensors)
             if not math.isfinite(probe.loss) or g.nonfinite_params or g.first_nonfinite else None)
    return Prediction(target, dtype_max, probe.paired, overflow, at_risk, absorbed, underflow, weights_over,
                      weights_at_risk, weights_flushed, scale, observed, notes, buffers_over, fault)


def predict_model(model, batch, target: torch.dtype = torch.float16, device: str = "cpu") -> Prediction:
    """Measure ``model`` on ``batch`` (a dict of keyword arguments, or a tuple of positional ones, already on
    ``device``) and predict, without searching a fix: what ``torchdoctor demo`` says before it trains."""
    from .probe import run_probe

    return predict(run_probe(model, batch, target, device))


def _name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))

"""A fix is tried on the bad step before it is printed.

When a step is about to be stopped, the micro-batch whose replay reproduced the fault (:class:`~.replay.Replayer`)
is run again with the proposed change in place -- the region in fp32 (:func:`~..fp32.keep_fp32` for the length of
the replay), bf16 autocast instead of fp16 -- and the report says what came of it (``fix_check``): ``"fixed"``
(every value of the replayed forward and backward finite; the fix printed is that one), ``"not fixed"`` (no change
tried made it finite), or ``"not checked"`` with the reason (the fix changes the data, the code or the
optimisation, which a replay cannot try; the fault did not reproduce; the model is sharded).

A fix that does not fix the step is not printed as the fix. The candidates, tried in order until one works: the
region the diagnosis names (unless ``keep_fp32`` keeps it already: a fix already applied is never proposed again),
then that region with the module run after it and the one run before it (a region too small leaves its boundary to
overflow: its fp32 output cast down for the next module, or its fp32 input gradient cast down for the module before
it), its enclosing module, then bf16. When
none works, the step is run once more in fp32 (autocast off) under autograd's anomaly mode (a nan in the backward) or
an op-by-op check (a nan in the forward): a nan that fp32 does not cure is no dtype's overflow but an invalid
operation, named with its op and the line of the user's code that made it (:mod:`..explain.invalid_ops`).

Cost: only on a step that stops the run, at most eight replays of one micro-batch (:data:`REGIONS` regions, bf16,
fp32), plus one to name an invalid op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..explain import causes
from ..explain.diagnosis_types import Setup, keep_fp32_fixes
from ..explain.invalid_ops import repair
from ..explain.ranges import dtype_name
from ..explain.render import who
from ..explain.report import FirstNonFinite, NonFiniteReport
from ..fp32 import keep_fp32
from ..record.calls import RootCall
from ..record.frames import BWD, FWD
from ..record.watched import WatchedModel
from .invalid_finder import FirstInvalidOp
from .replay import Replayer

FIXED, NOT_FIXED, NOT_CHECKED = "fixed", "not fixed", "not checked"
REGIONS = 6  # regions tried (the one named, then the modules around it); then bf16 and fp32: 8 replays at most

# causes whose fix is a dtype (a region in fp32, bf16): a replay can try it
_PRECISION = (causes.LOW_PRECISION_OVERFLOW, causes.SQUARE_OVERFLOW, causes.BOUNDARY_OVERFLOW,
              causes.BACKWARD_OVERFLOW, causes.SCALE_COLLAPSE)
# causes whose nan may be an invalid op: fp32 is tried, then the op is looked for
_MAYBE_INVALID = (causes.INVALID_OP, causes.BACKWARD_NONFINITE)
# why a fix of each other cause is not something a replay can try
_NOT_CHECKABLE = {
    causes.BAD_INPUT: "the fix changes the data",
    causes.BETWEEN_MODULES: "the fix changes the model's code",
    causes.BAD_WEIGHT: "the fix changes the weights (the checkpoint, or what wrote them)",
    causes.DIVERGENCE: "the fix changes the optimisation (learning rate, clipping, warm-up)",
    causes.MODEL_LOSS: "the fix changes the labels or masks of the batch",
    causes.LOSS_OUTSIDE_MODEL: "the fix changes the loss or its targets, outside the model",
    causes.MARKED_VALUE: "the fix changes the code that computes the marked value",
    causes.RANGE_OVERFLOW: "no dtype holds a larger number than fp32: the fix changes the computation",
    causes.TRANSIENT: "the fault did not reproduce",
    causes.OTHER_RANK: "the fault is another rank's",
    causes.UNKNOWN_GRADIENT: "which gradient went bad is unknown",
    causes.UNLOCALIZED: "the step could not be replayed",
}


@dataclass
class _Try:
    """One change tried on the bad step."""

    label: str  # said in the report: "keep_fp32('block1')", "bf16 autocast"
    fix: str  # the fix printed when it works
    regions: tuple[str, ...] = ()  # modules kept in fp32 for the replay
    autocast: tuple[tuple[str, torch.dtype], ...] | None = None  # instead of the call's
    weights: torch.dtype | None = None  # the model's fp16 weights, buffers and inputs in this dtype for the replay


class FixChecker:
    """Tries a bad step's fix on it (see the module docstring)."""

    def __init__(self, replayer: Replayer, watched: WatchedModel) -> None:
        self.replayer = replayer
        self.watched = watched
        self.scope = "forward and backward"  # what the last try replayed

    def check(self, report: NonFiniteReport, setup: Setup) -> None:
        """Set ``report.fix_check`` (and its reason); replace a fix that does not fix the step by one that does, or
        by the invalid operation's repair."""
        if report.fix_check is not None:  # (decided already: an invalid op found behind a scaler's overflow)
            return None
        cause = report.cause
        if cause == causes.BAD_WEIGHT and setup.always_before and setup.optimizer_note:
            return _said(report, NOT_CHECKED, "the optimizer's own update made the weight non-finite from finite "
                         "gradients; a replay of the step runs the forward and backward, not the optimizer")
        if cause in _NOT_CHECKABLE:
            return _said(report, NOT_CHECKED, _NOT_CHECKABLE[cause])
        if cause not in _PRECISION and cause not in _MAYBE_INVALID:
            return _said(report, NOT_CHECKED, "no fix a replay can try")
        if self.replayer.reproduced is None:
            why = report.replay_reason or "the step was not replayed"
            return _said(report, NOT_CHECKED, f"the fault was not reproduced by a replay ({why})")
        call, backward, frames = self.replayer.reproduced
        nan = report.first is not None and report.first.value == "nan"
        narrow = bool(call.autocast) or _narrow_weights(self.watched.root)
        if not narrow:  # every value fp32 or wider: no dtype to widen to
            if nan and cause in _MAYBE_INVALID:
                found = self._invalid_op(call, backward)
                if found is not None:
                    return self._invalid(report, found, backward)
            return _said(report, NOT_CHECKED, "the step computes in fp32 (no autocast, no fp16 weights): there is no "
                         "wider dtype to try, so the fix changes the computation")
        tries = self._tries(report, setup, call, frames) if cause in _PRECISION else []
        if call.autocast:  # the whole model in fp32: the widest dtype change there is
            tries.append(_Try("fp32 (autocast off)", "train this model in fp32 (autocast off): no smaller change tried "
                              "made this step finite", autocast=()))
        else:
            tries.append(_Try("fp32 weights", "train this model in fp32 (model.float(); Lightning: "
                              "precision='32-true'): no smaller change tried made this step finite",
                              weights=torch.float32))
        for t in tries:
            if self._finite(call, backward, t):
                return self._fixed(report, t, tries, setup)
        # no dtype change made it finite, fp32 included: not a precision problem
        tried = _tried(tries)
        if nan:
            found = self._invalid_op(call, backward)
            if found is not None:
                return self._invalid(report, found, backward)
        report.diagnosis += (f" (Checked on this step: {tried} did not make it finite -- not even fp32, so more "
                             "precision is not the fix" + (": the values are beyond fp32's range too" if not nan else
                                                           "") + ".)")
        report.fix = ("no dtype change made this step finite (tried on it: " + tried + "): find the op that makes the "
                      "value -- torch.autograd.set_detect_anomaly(True) names a backward op and the forward line that "
                      "made it; torchdoctor.mark(x, 'label') narrows a forward one down")
        report.fp32_region = None
        return _said(report, NOT_FIXED, f"tried on this step: {tried}; none made it finite" + (
            ", and no single op turning finite values into nan could be named" if nan else ""))

    def invalid_behind_overflow(self, report: NonFiniteReport) -> str:
        """A loss scaler is about to skip a step: is its non-finite value an overflow (finite in fp32 with the loss
        scale taken out: the scaler's business) or an invalid op (nan there too: the scaler would skip every step, at
        every scale)? Returns ``"invalid"``, with ``report`` rewritten to name the op (a nan made from finite values),
        ``"overflow"`` (finite so, or only an inf: a range fp32 overflows too, which the scaler's collapse says), or
        ``"unknown"`` (not replayed, or the gradient the model's output received is non-finite and no loss's)."""
        if self.replayer.reproduced is not None:
            call, backward, _ = self.replayer.reproduced
        else:  # (the gradient the model's output received was bad already: the step was not replayed)
            call, backward = self.replayer.bad_seed_call(), True
            if call is None:
                return "unknown"
        scale = self.watched.scaler.scale() if self.watched.scaler is not None else None
        unscaled = _unscaled(call, scale)
        if unscaled is None:
            return "unknown"
        narrow_seed = next((g.dtype for g in call.output_grads.values() if not bool(torch.isfinite(g).all())), None)
        call = unscaled
        if call.autocast:
            fp32 = _Try("fp32 (autocast off)", "", autocast=())
        elif _narrow_weights(self.watched.root):
            fp32 = _Try("fp32 weights", "", weights=torch.float32)
        else:
            fp32 = _Try("as it ran", "")  # (already fp32: the loss scale is what is taken out)
        if self._finite(call, backward, fp32):
            return "overflow"
        found = self._invalid_op(call, backward)
        if found is None or not (found["nan"] or report.first.value == "nan"):
            return "overflow"  # (no op made a nan from finite values: an inf is an overflow of fp32's range)
        self._invalid(report, found, backward)
        at = f" and without the loss scale ({scale:g})" if scale not in (None, 1.0) else ""
        report.notes.append(f"A loss scaler was about to skip this step as an overflow: run again in fp32{at}, it made "
                            "a nan all the same, so it would come back at every scale and every step be skipped.")
        if narrow_seed is not None:
            # the step's first non-finite value was the scale's: the headline is where the fp32 run's values went
            # bad -- in its backward (this step's forward was finite: a nan its forward made was masked there)
            seen = found.get("in_backward") or found
            if seen.get("module") is not None:
                report.first = FirstNonFinite(report.step, BWD if seen["phase"] == "backward" else FWD,
                                              seen["module"], self.watched.class_of(seen["module"]),
                                              f"{seen['op']} (the step run again in fp32 at scale 1)",
                                              "nan" if seen["nan"] else "inf")
                first_module = found.get("module")
                if seen is not found and first_module not in (None, seen["module"]):
                    same = " (the same line)" if seen.get("where") == found.get("where") else ""
                    made, then = who(first_module, self.watched.class_of(first_module)), who(seen["module"],
                                                                                     self.watched.class_of(seen["module"]))
                    report.notes.append(f"In that run the first nan was made in the forward of {made}, and this step's "
                                        f"outputs were finite; its first non-finite gradient came from {seen['op']} "
                                        f"in {then}{same}.")
            beyond = (f": the loss is {dtype_name(narrow_seed)} and the loss scale ({scale:g}) is beyond its largest "
                      f"value ({torch.finfo(narrow_seed).max:.5g})" if scale > torch.finfo(narrow_seed).max else "")
            report.notes.append(f"The gradient the model's output (a loss) received was already non-finite{beyond}; "
                                "the fp32 run started its backward from the loss's own gradient at scale 1.")
            report.replay_reason = ("the gradient reaching the model's output was already non-finite, so the step was "
                                    "not run again as it ran; it was run in fp32 at scale 1, above")
        return "invalid"

    # ------------------------------------------------------------------ what is tried
    def _tries(self, report: NonFiniteReport, setup: Setup, call: RootCall, frames: list) -> list[_Try]:
        """The region the diagnosis names, then regions around it -- with the module run after it (its output
        overflowing the next module's narrow input), with the one run before it (the gradient its fp32 backward
        sends back overflowing at its input), both, its parent, the parent with its neighbours -- up to
        :data:`REGIONS` in all, none of them a guard that is on already; then bf16 (autocast, or the weights of a
        ``model.half()`` network). ``frames``: the replay's, whose order says which modules ran around the region."""
        out: list[_Try] = []
        names = {name for name, _ in self.watched.modules}
        region = report.fp32_region
        if region:
            kept = setup.kept_fp32
            before, after = _neighbours(frames, region, kept)
            parent = region.rpartition(".")[0]
            p_before, p_after = _neighbours(frames, parent, kept) if parent else (None, None)
            shapes = [(region,), (region, after), (before, region), (before, region, after), (parent,),
                      (parent, p_after), (p_before, parent)]
            seen: set[tuple[str, ...]] = set()
            for shape in shapes:
                regions = tuple(r for r in shape if r)
                if len(regions) != len(shape) or regions in seen or not all(r in names for r in regions):
                    continue
                seen.add(regions)
                if any(_kept(r, setup.kept_fp32) for r in regions) or len(out) >= REGIONS:
                    continue
                label = " + ".join(f"keep_fp32({r!r})" for r in regions)
                out.append(_Try(label, keep_fp32_fixes(regions, setup.kept_fp32), regions=regions))
        if _narrow_weights(self.watched.root) and not call.autocast:  # a model.half() network: its weights narrow
            out.append(_Try("bf16 weights", "keep the weights in bf16 instead of fp16 where the device has it "
                            "(model.to(torch.bfloat16); Lightning: precision='bf16-true'; the HF Trainer: --bf16)",
                            weights=torch.bfloat16))
        if _narrow_autocast(call):
            bf16 = tuple((device, torch.bfloat16) for device, _ in call.autocast)
            out.append(_Try("bf16 autocast", "train in bf16 where the device has it (torch.autocast(device_type, "
                            "dtype=torch.bfloat16), no GradScaler needed)", autocast=bf16))
        return out

    def _finite(self, call: RootCall, backward: bool, t: _Try) -> bool:
        """Is the call finite when replayed with ``t``: its forward, and its backward from the gradient its outputs
        received when that gradient was finite (a loss's: the same whatever the fix; an output's in a backward fault:
        what the loss sent in). Where it was not finite (a forward that went bad), the forward alone is checked, and
        :attr:`scope` says so."""
        variant = None
        if t.regions:
            modules = dict(self.watched.modules)
            variant = _kept_for_replay([modules[r] for r in t.regions], self.watched.root)
        elif t.weights is not None:
            variant = _weights_as(self.watched.root, t.weights)
            call = dataclasses.replace(call, args=_narrow_to(call.args, t.weights),
                                       kwargs=_narrow_to(call.kwargs, t.weights))
        seeds = list(call.output_grads.values())
        whole = bool(seeds) and all(bool(torch.isfinite(g).all()) for g in seeds)
        self.scope = "forward and backward" if whole else "forward"
        try:
            frames = self.replayer.replay_call(call, whole, variant=variant, autocast=t.autocast)
        except Exception:  # (a replay that cannot run is no evidence either way)
            return False
        return all(ln.finite for f in frames for ln in f.lines if ln.judged)

    def _fixed(self, report: NonFiniteReport, t: _Try, tries: list[_Try], setup: Setup) -> None:
        failed = _tried(tries[: tries.index(t)])
        how = f"the bad step was run again with {t.label}: every value of its {self.scope} finite"
        if self.scope == "forward":
            how += (" (its backward was not checked: the gradient the step's outputs received was not finite, so there "
                    "is none to replay it from)")
        if t.regions == (report.fp32_region,):
            return _said(report, FIXED, how)
        region = report.fp32_region
        said = []
        if region and _kept(region, setup.kept_fp32):
            said.append(f"keep_fp32 keeps {region} in fp32 already")
        if failed:
            said.append(f"{failed} did not make this step finite")
        report.fix = t.fix
        report.fp32_region = t.regions[0] if len(t.regions) == 1 else None
        report.diagnosis = (_without_advice(report.diagnosis) + f" Checked on this step: "
                            f"{'; '.join(said) + '; ' if said else ''}{t.label} did -- the fix below.")
        return _said(report, FIXED, how + (f"; {failed} tried first, not enough" if failed else ""))

    # ------------------------------------------------------------------ an invalid operation
    def _invalid_op(self, call: RootCall, backward: bool) -> dict[str, Any] | None:
        """Run the step once more in fp32 and name the first op that turned finite values into non-finite ones (a nan
        in the forward; an inf or a nan in the backward, where a derivative is infinite at 0 before a product with 0
        makes the nan), with the user's line: autograd's anomaly mode records the forward line of each backward
        node, and an op-by-op check names the node running when it happened."""
        finder = FirstInvalidOp({id(m): name for name, m in self.watched.modules})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (anomaly mode says it is on)
            with contextlib.suppress(Exception):
                self.replayer.replay_call(call, backward, variant=finder.watching(),
                                          autocast=() if call.autocast else None)
        return None if finder.found is None else dict(finder.found, in_backward=finder.in_backward)

    def _invalid(self, report: NonFiniteReport, found: dict[str, Any], backward: bool) -> None:  # noqa: ARG002
        where = found.get("where")
        what, why, fix = repair(found["op"], found["phase"], where["code"] if where else None)
        line = f" at {where['file']}:{where['line']} ({where['code']})" if where else ""
        module = found.get("module")
        if module is not None:  # the watched module whose forward ran that line
            line += f", in the forward of {who(module, self.watched.class_of(module))}"
        in_backward = found["phase"] == "backward"
        kind = "its derivative has no finite value in the backward" if in_backward else "it makes nan in the forward"
        text = (f"an invalid operation: {what}{line} -- {kind} because {why}. The step was run again in fp32 and "
                f"stayed non-finite, so it is no overflow of a dtype and more precision does not fix it: "
                f"{found['op']} was the first op to turn finite values into non-finite ones.")
        seen = report.diagnosis.split(". ")[0].rstrip(".") if report.diagnosis else ""
        report.diagnosis = text + (f" What the step's frames show: {seen}." if seen else "")
        report.fix = fix + (f" (in {where['file']}:{where['line']})" if where else "")
        report.cause, report.fp32_region = causes.INVALID_OP, None
        report.evidence, report.cited = (), []
        _said(report, NOT_CHECKED, "the repair changes the model's code; the step stayed nan in fp32, which rules "
              "every dtype fix out")


_ADVICE_SENTENCE = re.compile(r"^(Keep|Extend the fp32 region|Scale the loss)\b")
_ADVICE_CLAUSE = re.compile(r"(:\s*)(keep|extend the fp32 region|scale the loss)\b[^.]*$")


def _without_advice(text: str) -> str:
    """The diagnosis without the fix its rule wrote in (a region to keep in fp32, bf16, a loss scale): the fix check
    found another one, and the text must not keep recommending the one that did not hold."""
    out = []
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z(])", text):
        if _ADVICE_SENTENCE.match(sentence):
            continue
        cut = _ADVICE_CLAUSE.search(sentence.rstrip("."))
        out.append(sentence.rstrip(".")[:cut.start()] + "." if cut else sentence)
    return " ".join(out)


def _tried(tries: list[_Try]) -> str:
    """What was tried, as a report says it: every try, or, past three, the first and the last fp32 region and how many
    lay between them."""
    regions = [t for t in tries if t.regions]
    others = [t.label for t in tries if not t.regions]
    if len(regions) > 3:
        said = [f"{len(regions)} fp32 regions from {regions[0].label} to {regions[-1].label}"]
    else:
        said = [t.label for t in regions]
    return ", ".join(said + others)


def _said(report: NonFiniteReport, status: str, reason: str) -> None:
    report.fix_check, report.fix_check_reason = status, reason


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> [``a.b``, ``a``] (the root, all fp32, is tried as autocast off instead)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _neighbours(frames: list, region: str, kept: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    """The modules run just before and just after ``region`` in the step's forward (neither inside it nor around
    it, nor kept in fp32 already: a guard beside it makes the region wider), from the frames of the step: siblings
    or cousins, in execution order."""
    order: list[str] = []
    for f in frames:
        if f.phase == "fwd" and f.name and not f.root and f.name not in order:
            order.append(f.name)

    def apart(name: str) -> bool:
        return not (name == region or name.startswith(region + ".") or region.startswith(name + ".")
                    or _kept(name, kept))

    if region not in order:
        return None, None
    i = order.index(region)
    before = next((n for n in reversed(order[:i]) if apart(n)), None)
    after = next((n for n in order[i + 1:] if apart(n)), None)
    # the outermost module of that neighbour that is still apart from the region (a block, not its first Linear)
    return _outermost(before, region, order), _outermost(after, region, order)


def _outermost(name: str | None, region: str, order: list[str]) -> str | None:
    if name is None:
        return None
    parent = region.rpartition(".")[0]
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if candidate.rpartition(".")[0] == parent and candidate in order + [name]:
            return candidate
    return name


def _kept(name: str, kept: tuple[str, ...]) -> bool:
    return any(k == name or name.startswith(k + ".") or not k for k in kept)


def _narrow_weights(root: Any) -> bool:
    """Are the model's floating weights fp16 (a ``model.half()`` network, Lightning's ``16-true``)?"""
    return any(p.dtype == torch.float16 for p in root.parameters())


@contextlib.contextmanager
def _weights_as(root: Any, dtype: torch.dtype) -> Any:
    """The model's fp16 parameters and buffers held in ``dtype`` for the length of a replay, then put back exactly
    (the fp16 values are kept, not recomputed from the other dtype)."""
    saved = [(t, t.data) for t in (*root.parameters(), *root.buffers()) if t.dtype == torch.float16]
    try:
        for t, data in saved:
            t.data = data.to(dtype)
        yield
    finally:
        for t, data in saved:
            t.data = data


def _narrow_to(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (a call's arguments) with its fp16 tensors in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.float16 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_narrow_to(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _narrow_to(v, dtype) for k, v in value.items()}
    return value


def _narrow_autocast(call: RootCall) -> bool:
    return any(dtype == torch.float16 for _, dtype in call.autocast)


@contextlib.contextmanager
def _kept_for_replay(modules: list, root: Any) -> Any:
    """``modules`` kept in fp32 for the length of a replay, and not a moment longer."""
    guard = keep_fp32(modules, model=root)
    try:
        yield
    finally:
        guard.remove()


def _unscaled(call: RootCall, scale: float | None) -> RootCall | None:
    """``call`` with the gradients its outputs received divided by the loss ``scale``, in fp32 -- what they are at
    scale 1. A loss's own gradient that the narrow dtype could not hold (the scale itself, 65536 > fp16's 65504) is 1.
    None where an output's gradient is non-finite and is no loss's (what the loss sent in cannot be made again)."""
    if scale in (None, 1.0) and all(bool(torch.isfinite(g).all()) for g in call.output_grads.values()):
        return call
    seeds = {}
    for label, g in call.output_grads.items():
        if bool(torch.isfinite(g).all()):
            seeds[label] = g.float() / scale if scale else g
        elif g.numel() == 1 and scale:
            seeds[label] = torch.ones(g.shape, dtype=torch.float32, device=g.device)
        else:
            return None
    return dataclasses.replace(call, output_grads=seeds)


__all__ = ["FIXED", "NOT_CHECKED", "NOT_FIXED", "FixChecker"]

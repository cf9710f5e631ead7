"""An optimizer's next update, tried on a copy before it is applied -- for an optimizer whose own arithmetic cannot
work in its parameters' dtype (:func:`.steps.narrow_optimizer`: Adam's ``eps=1e-8`` is 0 in fp16).

Such an update makes a weight non-finite from finite gradients (0 / (sqrt(0) + 0) where a gradient and its running
averages are 0), so no check of the step's values can stop it. The trial copies the parameters, their gradients and
the optimizer's state, runs the same optimizer class with the same groups on the copies (no hook of the program's or
ours runs: the global step hooks are set aside for it), and reads which parameters come out non-finite -- what the
update would do, seen, before it is done. ``with_eps`` tries the same update with another ``eps``: the fix, checked.
Costs a copy of the parameters, gradients and state and one optimizer step, on the steps of such a run only.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..explain import causes
from ..explain.diagnosis_types import Evidence
from ..explain.report import FirstNonFinite, NonFiniteReport
from ..record.frames import UPDATE, Line, ResolvedFrame, measure_now


@dataclass(frozen=True)
class BadUpdate:
    """A parameter the update would make non-finite: its qualified name, nan or inf, how many of its values; the
    copy after the update and the gradient it was given, measured (what the report shows and cites)."""

    name: str
    value: str
    count: int
    numel: int
    after: Line
    grad: Line


def try_update(optimizer: Any, names: dict[int, str], eps: float | None = None) -> list[BadUpdate] | None:
    """The parameters ``optimizer``'s next step would make non-finite (``[]``: none), tried on copies; ``names``: id of
    each parameter -> its qualified name. ``eps``: try it with that ``eps`` instead. None where the copy could not be
    made or stepped (an optimizer built differently from torch's): nothing is said then."""
    from torch.optim import optimizer as optim_module

    try:
        groups, pairs = [], []
        for g in optimizer.param_groups:
            copies = []
            for p in g["params"]:
                c = p.detach().clone().requires_grad_(p.requires_grad)
                if p.grad is not None:
                    c.grad = p.grad.detach().clone()
                copies.append(c)
                pairs.append((p, c))
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": copies,
                           **({"eps": eps} if eps is not None else {})})
        trial = type(optimizer)(groups)
        trial.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        if eps is not None:
            for g in trial.param_groups:
                g["eps"] = eps
        saved = dict(optim_module._global_optimizer_pre_hooks), dict(optim_module._global_optimizer_post_hooks)
        optim_module._global_optimizer_pre_hooks.clear()
        optim_module._global_optimizer_post_hooks.clear()
        try:
            with torch.no_grad():
                trial.step()
        finally:
            optim_module._global_optimizer_pre_hooks.update(saved[0])
            optim_module._global_optimizer_post_hooks.update(saved[1])
    except Exception:  # noqa: BLE001 -- (never the program's failure: the trial is not made)
        return None
    out = []
    for p, c in pairs:
        if not (c.is_floating_point() and c.numel()):
            continue
        finite = torch.isfinite(c)
        if bool(finite.all()):
            continue
        nan = int(torch.isnan(c).sum())
        name = names.get(id(p), "?")
        label = name.rpartition(".")[2]
        out.append(BadUpdate(name, "nan" if nan else "inf", int((~finite).sum()), c.numel(),
                             measure_now(label, c, param=True), measure_now(f"grad:{label}", p.grad)))
    return out


def smallest_eps(dtype: torch.dtype) -> float:
    """An ``eps`` that ``dtype`` holds as a normal number, rounded up to a power of ten (fp16: 1e-4)."""
    tiny = torch.finfo(dtype).tiny
    return 10.0 ** math.ceil(math.log10(tiny))


def update_report(step: int, bad: list[BadUpdate], note: str, class_of: Callable[[str], str], fixed_by: float | None,
                  eps: float, rank: int | None) -> NonFiniteReport:
    """The report of an update the trial found non-finite (``bad``, largest share first), raised before it is applied.
    ``note``: what the optimizer cannot do in its parameters' dtype, as seen on it; ``class_of``: a module's name ->
    its class; ``fixed_by``: the eps whose trial came out finite (None: the trial with ``eps`` was not finite
    either)."""
    bad = sorted(bad, key=lambda b: -b.count / b.numel)
    worst = bad[0]
    module, _, label = worst.name.rpartition(".")
    first = FirstNonFinite(step, UPDATE, module, class_of(module), label, worst.value)
    more = ""
    if len(bad) > 1:
        named = ", ".join(b.name for b in bad[1:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        more = f", and {len(bad) - 1} other parameter(s) too ({named})"
    text = (f"{note}. This step's gradients were finite; its update, tried on a copy of the weights and of the "
            f"optimizer's state before it was applied, makes {worst.count} of {worst.numel} values of {worst.name} "
            f"{worst.value}{more}. The update was not applied: the weights are as they were before this step.")
    fix = ((f"give the optimizer an eps its parameters' dtype holds (eps={eps:g}), " if fixed_by is not None else "")
           + "keep the weights and the optimizer's state in fp32 and compute in fp16 under autocast (Lightning: "
           "precision='16-mixed'), or train in bf16 where the device has it (Lightning: precision='bf16-true')")
    # what was seen: each parameter as the tried update leaves it, beside the (finite) gradient it was given
    frames = [ResolvedFrame(step, UPDATE, b.name.rpartition(".")[0], class_of(b.name.rpartition(".")[0]),
                            [b.grad, b.after]) for b in bad[:3]]
    report = NonFiniteReport(step, first, frames, text, fix=fix, rank=rank, cause=causes.OPTIMIZER_UPDATE)
    report.evidence = (Evidence.of(frames[0], worst.after),)
    report.marker = worst.after
    if fixed_by is not None:
        report.fix_check = "fixed"
        report.fix_check_reason = f"the same update, tried on a copy with eps={fixed_by:g}, is finite"
    else:
        report.fix_check = "not fixed"
        report.fix_check_reason = (f"the same update, tried on a copy with eps={eps:g}, is not finite either: keep "
                                   "the weights in fp32")
    return report


__all__ = ["BadUpdate", "smallest_eps", "try_update", "update_report"]

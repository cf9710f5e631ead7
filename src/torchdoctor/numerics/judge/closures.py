"""``optimizer.step(closure)``: the step is checked when the closure's backward returns, before the update.

Lightning (automatic optimization, every precision but ``16-mixed``) and every LBFGS user step this way: the
forward and backward run *inside* ``step()``, after its pre-hooks. So the pre-hook does not check the step; it
hands ``step()`` a wrapped closure instead (torch lets a step pre-hook return new arguments), and the step is
checked each time that closure returns -- after its backward, before the optimizer applies anything.

An optimizer that evaluates the closure several times per step (LBFGS's line search) has already moved the
weights by the second evaluation: for those the weights and the optimizer's state are copied when the step begins
and put back when an evaluation is found bad, so a detection leaves them as the step found them. Optimizers known
to re-evaluate are LBFGS and any seen doing so earlier in the run (its first such step is reported with a note).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..errors import NonFiniteError
from ..explain.report import NonFiniteReport

MANY_EVALUATIONS = (torch.optim.LBFGS,)


def find_closure(args: tuple, kwargs: dict, first: int) -> tuple[Callable, int | str] | None:
    """The closure passed to ``step()`` and where it sits: ``kwargs['closure']`` or the positional argument at
    ``first`` (1 in a step pre-hook, whose ``args`` begin with the optimizer; 0 for a wrapped bound ``step``)."""
    if callable(kwargs.get("closure")):
        return kwargs["closure"], "closure"
    if len(args) > first and callable(args[first]):
        return args[first], first
    return None


def replace_closure(args: tuple, kwargs: dict, where: int | str, closure: Callable) -> tuple[tuple, dict]:
    if where == "closure":
        return args, {**kwargs, "closure": closure}
    assert isinstance(where, int)
    return args[:where] + (closure,) + args[where + 1 :], kwargs


class _Snapshot:
    """The optimizer's weights and state as a step began (only for optimizers that re-evaluate the closure)."""

    def __init__(self, optimizer: Any) -> None:
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            self.values = [p.detach().clone() for p in self.params]
        self.state = copy.deepcopy(dict(optimizer.state))
        self.optimizer = optimizer

    def restore(self) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, self.values):
                p.copy_(v)
        self.optimizer.state.clear()
        self.optimizer.state.update(self.state)


class ClosureSteps:
    """The closure steps of one monitor. ``check(again)`` checks the step so far (``again``: a later evaluation
    of the same step) and raises :class:`NonFiniteError` when it went bad; ``rewrite(report)`` writes a report
    again once a note was added."""

    def __init__(self, check: Callable[[bool], None], rewrite: Callable[[NonFiniteReport], None]) -> None:
        self._check = check
        self._rewrite = rewrite  # writes a report again once a note was added to it
        self._many: set[type] = set()  # optimizer classes seen evaluating the closure more than once per step
        self.calls: int | None = None  # evaluations in the step under way; None: not a closure step

    def begin(self, optimizer: Any, args: tuple, kwargs: dict, first: int) -> tuple[tuple, dict] | None:
        """A step is about to run: the new ``(args, kwargs)`` with a checking closure, or None (no closure)."""
        found = find_closure(args, kwargs, first)
        if found is None or optimizer is None:
            self.calls = None
            return None
        closure, where = found
        snapshot = _Snapshot(optimizer) if self._re_evaluates(optimizer) else None
        self.calls = 0

        @functools.wraps(closure)
        def checked(*a: Any, **k: Any) -> Any:
            loss = closure(*a, **k)
            if self.calls is None:  # the step already ended (a closure kept and called later)
                return loss
            self.calls += 1
            if self.calls == 2:
                self._many.add(type(optimizer))
            try:
                self._check(self.calls > 1)
            except NonFiniteError as e:
                note = self._refused(snapshot)
                if note is None:
                    raise
                e.details.notes.append(note)
                self._rewrite(e.details)
                raise NonFiniteError(e.details) from None
            return loss

        return replace_closure(args, kwargs, where, checked)

    def _re_evaluates(self, optimizer: Any) -> bool:
        return isinstance(optimizer, MANY_EVALUATIONS) or type(optimizer) in self._many

    def _refused(self, snapshot: _Snapshot | None) -> str | None:
        """An evaluation was bad: put the weights back if the step had moved them; the report's note, if any."""
        calls, self.calls = self.calls, None
        if calls is None or calls < 2:
            return None  # the first evaluation comes before any update: nothing was applied
        if snapshot is not None:
            snapshot.restore()
            return (f"The optimizer evaluated the closure {calls} times in this step (evaluation {calls} was bad); "
                    "the weights and the optimizer's state were put back as the step began.")
        return (f"The optimizer evaluated the closure {calls} times in this step and had moved the weights before "
                "the bad evaluation (from now on they are copied as each step begins, so that a detection puts "
                "them back).")

    def end(self) -> int | None:
        """The step returned: how many times its closure was evaluated (None: it was not a closure step)."""
        calls, self.calls = self.calls, None
        return calls

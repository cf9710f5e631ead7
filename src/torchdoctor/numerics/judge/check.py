"""The one host read of a step: are its activations and gradients finite (on every rank)?

Everything a healthy step measured is folded into on-device flags: the judged statistics of its record (model
outputs, marks, module values when watched every module), the gradients the optimizer is about to apply
(:meth:`~..engines.base.Engine.grad_flags`), those taken when a backward ended. :meth:`StepCheck.verdict` reads them
with one ``.item()`` -- under torch.distributed after one small all-reduce (:func:`.verdict.share_verdict`), so that
every rank stops at the same step; with ``headroom=True`` the headroom flag rides on the same read.
"""

from __future__ import annotations

import torch

from ..engines import Engine
from ..measure.stats import all_finite
from ..record.step import StepRecord
from .verdict import share_verdict


class StepCheck:
    """The verdict of one step, read once (see the module docstring)."""

    def __init__(self, engine: Engine, params: list, sync_ranks: bool) -> None:
        self.engine = engine
        self.params = params
        self.sync_ranks = sync_ranks  # under torch.distributed with several ranks: every rank decides alike

    def verdict(self, act_ok: list[torch.Tensor], rec: StepRecord, check_grads: bool,
                near: torch.Tensor | None = None) -> tuple[bool, bool, bool]:
        """(everything finite on every rank, this rank's own values were not, the headroom flag ``near``). The fast
        gradient check can overflow on huge finite values: when it says no, the gradients are asked exactly."""
        grad_flags = self.engine.grad_flags(self.params, exact=False) if check_grads else []
        ok, self_bad, near_set = self._read(act_ok, grad_flags + rec.stored_grad_flags(), near)
        if not ok and check_grads:
            ok, self_bad, _ = self._read(act_ok, self.engine.grad_flags(self.params) + rec.stored_grad_flags())
        return ok, self_bad, near_set

    def grads_finite(self, rec: StepRecord) -> bool:
        """Every gradient of the step finite, asked exactly (a bad step: one more read is fine)."""
        flag = all_finite(self.engine.grad_flags(self.params) + rec.stored_grad_flags())
        return flag is not None and bool(flag.item())

    def _read(self, act_ok: list[torch.Tensor], grad_ok: list[torch.Tensor],
              near: torch.Tensor | None = None) -> tuple[bool, bool, bool]:
        """The one host read of a healthy step (``near`` rides on it; under several ranks it is read on its own, on
        headroom steps only)."""
        if self.sync_ranks:
            ok, self_bad = share_verdict(all_finite(act_ok), all_finite(grad_ok))
            return ok, self_bad, near is not None and bool(near.item())
        both = all_finite(act_ok + grad_ok)  # (one stack for both)
        if near is not None:  # both flags in one number, one read: bit 0 all finite, bit 1 near
            ok_flag = both if both is not None else torch.ones((), dtype=torch.bool, device=near.device)
            code = int((ok_flag.to(torch.int32) + 2 * near.to(device=ok_flag.device, dtype=torch.int32)).item())
            return bool(code & 1), not code & 1, bool(code & 2)
        ok = True if both is None else bool(both.item())
        return ok, not ok, False

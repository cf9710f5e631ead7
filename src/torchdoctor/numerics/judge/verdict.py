"""Agreeing on a step's verdict across ranks: one small all-reduce per step, one more only on failure.

Every rank must stop at the same step, or the others hang in their next collective. So under
torch.distributed each rank puts its two on-device flags (activations finite, gradients finite) in its
row of a ``world x 2`` int32 tensor and all ranks sum it: the host reads one scalar (the number of bad
entries) on a healthy step, and its own row only on a bad one. Integers, not floats: gloo's
MIN/MAX all-reduce drops a nan that is not on rank 0, a SUM of 0/1 flags cannot lose anything.

On a bad step every rank knows it at the same moment, so all of them can take part in a second
exchange: where each one's first non-finite value sits in the step (:func:`first_bad_code`). The
rank(s) with the earliest one are where it started; the others received it through a collective
(DDP's or FSDP's gradient reduction, a tensor-parallel all-reduce in the forward).
"""

from __future__ import annotations

import torch

NO_BAD = 2**62  # the code of a rank whose own values were all finite


def _device() -> torch.device:
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_verdict(act_ok: torch.Tensor | None, grad_ok: torch.Tensor | None) -> tuple[bool, bool]:
    """(every rank finite, this rank's own values were not). One host read when healthy."""
    dist = torch.distributed
    device = _device()
    world, me = dist.get_world_size(), dist.get_rank()
    bad = torch.zeros(world, 2, dtype=torch.int32, device=device)
    for col, flag in enumerate((act_ok, grad_ok)):
        if flag is not None:
            bad[me, col] = (~flag).to(device=device, dtype=torch.int32)
    dist.all_reduce(bad)
    if not bad.sum().item():  # THE host read of a healthy step
        return True, []
    return False, bool(bad[me].any().item())


FORWARD, BACKWARD, UNKNOWN_GRADIENT = 0, 1, 2  # phases of a first bad value, in the order they happen
NOT_REPRODUCED_OFFSET = 2**37  # added to the position of a value this rank's replay did not reproduce


def first_bad_code(phase: int, position: int) -> int:
    """A sortable code for where this rank's first non-finite value is: forward before backward (before a
    gradient known only by its flag), then by position in the step (ranks run the same modules in order)."""
    return phase * 2**40 + position


def phase_of(code: int) -> int | None:
    return None if code >= NO_BAD else code // 2**40


def not_reproduced(code: int) -> bool:
    """Is the earliest bad value of the step (``origin_ranks``'s code) one that its rank's replay did not reproduce?
    A rank whose replay reproduced always comes earlier, so this is true only when no rank's replay reproduced
    the fault: every rank then decides alike that the step was a transient."""
    return phase_of(code) in (FORWARD, BACKWARD) and code % 2**40 >= 2 * NOT_REPRODUCED_OFFSET


def origin_ranks(code: int) -> tuple[list[int], int]:
    """The ranks whose first non-finite value came earliest in the step, and that code (a collective; bad
    steps only). Every rank gets the same answer, so every rank decides the same way what to do next."""
    dist = torch.distributed
    device = _device()
    codes = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    codes[dist.get_rank()] = code
    dist.all_reduce(codes)
    values = codes.cpu().tolist()
    best = min(values)
    return ([] if best >= NO_BAD else [r for r, v in enumerate(values) if v == best]), best


def agreed_max(value: int) -> int:
    """The largest of every rank's ``value`` (a collective: every rank calls it at the same point of a bad step), so
    that a decision one rank's own evidence made is carried out by all of them."""
    dist = torch.distributed
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())

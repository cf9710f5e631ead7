"""Run under torchrun (gloo, a short timeout): a job that hangs because one rank skips a collective.

Mode "skip": every rank runs two all_reduces, except rank ``--late`` (default the last), which calls
``slow_path()`` (a long sleep) instead of the second one; the others time out in it, and torchrun then ends the late
rank with SIGTERM. Mode "mismatch": rank 1 calls broadcast where the others call all_reduce. Mode "ok": every rank
runs both all_reduces and ends cleanly. Used by tests/test_hang.py through ``torchdoctor run``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def slow_path() -> None:
    time.sleep(60)  # what a rank stuck outside the collective looks like (compute, I/O, a data loader)


def second_step(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def main(mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("HANG_TIMEOUT", "4"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    dist.all_reduce(t)
    if mode == "skip" and rank == world - 1:
        slow_path()
    elif mode == "mismatch" and rank == 1:
        dist.broadcast(t, src=0)
    elif mode == "raise" and rank == 1:
        time.sleep(0.5)
        raise ValueError("a bad batch on rank 1")
    else:
        second_step(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

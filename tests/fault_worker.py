"""A tiny data-parallel loop with one fault, run under torchrun on gloo (CPU): the hang matrix of
tests/test_hang_matrix.py and benchmarks/hang_matrix.py.

Every rank runs ``STEPS`` steps of all_reduce, all_gather, broadcast and barrier (each from its own function, so a
stack says which). Rank ``FAULT_RANK`` (default 1) meets the fault ``MODE`` at step ``FAULT_STEP`` (default 3):

ok            no fault.
skip          skips that step's broadcast (it goes on to the barrier).
other-op      calls all_gather where the others call all_reduce.
sleep         its data loader never returns (``load_batch`` sleeps 600 s): alive elsewhere.
stop          stops itself with SIGSTOP (as ``kill -STOP`` or Ctrl-Z would).
kill          is killed with SIGKILL.
exit0         runs out of data: leaves the loop and ends with exit 0 (uneven inputs).
raise         raises ValueError in ``load_batch``.
slow          every step, sleeps ``SLOW_S`` (default 0.6 s) in ``load_batch``; the job ends well.
busy          computes for ``BUSY_S`` (default 4 s) at that step (an evaluation on one rank): no fault, a long wait.
init-world    passes world_size + 1 to init_process_group.
init-port     meets at another port than the others (MASTER_PORT + 1, where nothing listens).
transport     the faulty rank shuts its connections to the others down, then every rank enters the all_reduce: every
              rank is there, the transfer fails (the others see their peer's connection close; nobody is behind).

The line where the culprit's own call site is expected carries a ``# site: MODE`` comment (read by the tests). The
faulty rank prints ``fault <epoch seconds>`` just before its fault; every rank prints ``step N`` as a step starts; in
mode ok, rank 0 prints ``loop <seconds>`` the steps took. The collective timeout is ``HANG_TIMEOUT`` s (default 6).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

MODE = sys.argv[1] if len(sys.argv) > 1 else "ok"
STEPS = int(os.environ.get("STEPS", "5"))
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "3"))
SLOW_S = float(os.environ.get("SLOW_S", "0.6"))
BUSY_S = float(os.environ.get("BUSY_S", "4"))


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: the ranks share the launcher's output
    sys.stdout.flush()


def fault() -> None:
    say(f"fault {time.time():.3f}")


def load_batch(rank: int, step: int) -> torch.Tensor:
    if rank == FAULT_RANK:
        if MODE == "slow":
            time.sleep(SLOW_S)  # site: slow
        elif step == FAULT_STEP and MODE == "sleep":
            fault()
            time.sleep(600)  # site: sleep
        elif step == FAULT_STEP and MODE == "raise":
            fault()
            raise ValueError(f"a bad batch on rank {rank}")  # site: raise
    return torch.full((4,), float(rank + step))


def evaluate() -> None:
    end = time.perf_counter() + BUSY_S
    x = torch.rand(64, 64)
    while time.perf_counter() < end:
        x = (x @ x).tanh()  # site: busy


def reduce_grads(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def gather_stats(t: torch.Tensor, world: int) -> None:
    dist.all_gather([torch.zeros_like(t) for _ in range(world)], t)  # site: other-op


def sync_params(t: torch.Tensor) -> None:
    dist.broadcast(t, src=0)


def end_of_step() -> None:
    dist.barrier()  # site: skip


def cut_my_links() -> None:
    """Shut down this process's connections to the other ranks (gloo's pairs; not the store's)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM and \
                    s.getpeername()[1] != int(os.environ["MASTER_PORT"]):  # (a listener has no peer: left open)
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()


def transfer(t: torch.Tensor, cut: bool) -> None:
    """An all_reduce; with ``cut``, this rank's connections to the others are gone as it enters it."""
    if cut:
        fault()
        cut_my_links()
    dist.all_reduce(t)  # site: transport


def init(rank: int) -> None:
    timeout = datetime.timedelta(seconds=float(os.environ.get("HANG_TIMEOUT", "6")))
    world = int(os.environ["WORLD_SIZE"])
    if rank == FAULT_RANK and MODE == "init-world":
        fault()
        dist.init_process_group("gloo", timeout=timeout, world_size=world + 1, rank=rank)  # site: init-world
    elif rank == FAULT_RANK and MODE == "init-port":
        fault()
        port = int(os.environ["MASTER_PORT"]) + 1
        address = f"tcp://{os.environ['MASTER_ADDR']}:{port}"
        dist.init_process_group("gloo", timeout=timeout, init_method=address,  # site: init-port
                                world_size=world, rank=rank)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def main() -> None:
    init(int(os.environ["RANK"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = FAULT_STEP - 1 if MODE == "exit0" and rank == FAULT_RANK else STEPS
    start = time.perf_counter()
    for step in range(1, steps + 1):
        say(f"step {step}")
        t = load_batch(rank, step)
        faulty = rank == FAULT_RANK and step == FAULT_STEP
        if faulty and MODE == "busy":
            evaluate()
        if faulty and MODE == "stop":
            fault()
            os.kill(os.getpid(), signal.SIGSTOP)  # site: stop
        if faulty and MODE == "kill":
            fault()
            os.kill(os.getpid(), signal.SIGKILL)  # site: kill
        if faulty and MODE in ("other-op", "skip"):
            fault()
        if faulty and MODE == "other-op":
            gather_stats(t, world)
        elif MODE == "transport" and step == FAULT_STEP:
            transfer(t, cut=rank == FAULT_RANK)
        else:
            reduce_grads(t)
        gather_stats(t, world)
        if not (faulty and MODE == "skip"):
            sync_params(t)
        end_of_step()
    if rank == 0 and MODE == "ok":
        say(f"loop {time.perf_counter() - start:.4f} s")
    if rank == FAULT_RANK and MODE == "exit0":
        fault()
    dist.destroy_process_group()  # site: exit0


if __name__ == "__main__":
    main()

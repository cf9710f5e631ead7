"""How many ``--local`` ranks this machine can hold, and how many to start at once.

Every rank is a Python interpreter that imports torch: ``--local 100000`` really asks for 100000 of them. Refusing
what cannot fit (a one-line error, exit 2) beats starting them and leaving the machine to its OOM killer. The rules
are pure functions over :class:`Machine` figures, so the thresholds are tested with fabricated machines; only
:func:`this_machine` reads the real one.

The figures:

- A rank of the check costs ~230 MiB resident (peak RSS of a gloo rank: torch 2.13 CPU build, Python 3.11);
  :data:`RANK_BYTES` rounds it up to 256 MiB. ``--bench`` on a host backend adds ~3x the largest message per rank
  (the full tensor, ``all_to_all``'s output, gloo's staging: 64M -> +180 MiB measured); on NCCL those buffers live on
  the GPU.
- CPUs: a connectivity check mostly waits, so ranks may share CPUs -- up to :data:`RANKS_PER_CPU` a CPU. What a CPU
  cannot share well is the start (importing torch is seconds of CPU), hence the batches of :func:`batch_size`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._system import MIB, fmt_bytes, host_memory_limit, read_meminfo

RANK_BYTES = 256 * MIB
BENCH_COPIES = 3  # host copies of the largest message a benchmarking rank holds at once
RANKS_PER_CPU = 8
MIN_BATCH = 4  # ranks started together even on a 1-CPU machine: a small check starts at once


@dataclass(frozen=True)
class Machine:
    cpus: int
    available: int | None  # bytes a new process may still take; None when unknown


def this_machine() -> Machine:
    """The CPUs this process may run on and the memory still available to it (the lower of MemAvailable and the
    memory cgroup's limit)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    free = read_meminfo().get("MemAvailable")
    limit = host_memory_limit()
    if free is None or (limit is not None and limit < free):
        free = limit
    return Machine(cpus=max(cpus, 1), available=free)


def rank_bytes(bench_max: int | None, host_buffers: bool) -> int:
    """Host memory one rank needs: the interpreter, plus the benchmark's buffers when they live in host memory."""
    return RANK_BYTES + (BENCH_COPIES * bench_max if bench_max and host_buffers else 0)


def most_ranks(machine: Machine, per_rank: int) -> int:
    """The most ranks this machine holds: :data:`RANKS_PER_CPU` a CPU, and what the available memory holds."""
    by_cpu = RANKS_PER_CPU * machine.cpus
    if machine.available is None:
        return by_cpu
    return min(by_cpu, machine.available // per_rank)


def refusal(n: int, machine: Machine, per_rank: int) -> str | None:
    """The one-line reason ``--local n`` does not fit this machine, or None when it does."""
    most = most_ranks(machine, per_rank)
    if n <= most:
        return None
    memory = f"{fmt_bytes(machine.available)} available" if machine.available is not None else "unknown memory"
    why = f"{RANKS_PER_CPU} per CPU" if most == RANKS_PER_CPU * machine.cpus else "what its memory holds"
    return (f"--local {n} needs ~{fmt_bytes(n * per_rank)} for {n} interpreters ({fmt_bytes(per_rank)} each); "
            f"this machine has {memory} and {machine.cpus} CPU{'s' if machine.cpus != 1 else ''}; at most {most} here "
            f"({why}); --force to insist")


def batch_size(machine: Machine) -> int:
    """Ranks started at a time: one per CPU (at least :data:`MIN_BATCH`); the next batch starts once these have
    joined, so N interpreters never import torch all at once."""
    return max(MIN_BATCH, machine.cpus)

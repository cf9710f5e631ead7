"""Failure families read from a log, each a collaborator of the analyzer with a narrow interface.

A family owns its message table (``RULES``: a cheap substring key, the regex, the name of its handler), the facts
its handlers keep, and its judge; the analyzer hands it each candidate line that carries one of its keys, as the
program printed it (:mod:`..lines`), and asks it for findings once the log is read. What a family may ask of the
analyzer is :class:`.base.LineContext`: record an event, quote the line, the line's rank and host, the step the log
is at, the lines that follow. Message tables cite the source file (and commit or version) each message was read from.

Families: :mod:`.comm` (NCCL, c10d, gloo, the store and rendezvous), :mod:`.build` (CUDA toolkits, host compilers,
extensions built for another torch), :mod:`.hostmem` (host RAM that ran out inside the program), :mod:`.gpu` (GPUs a
kernel library or this torch does not support), :mod:`.shm` (shared memory, /dev/shm, that ran out). The numerics of a
run (the fp16 loss scale, non-finite losses and gradients: :mod:`..scalers`, :mod:`..nonfinite`) and crashes share the
analyzer's own state and stay in its mixins.
"""

from __future__ import annotations

from .base import Family, LineContext
from .build import Build
from .comm import Comm
from .gpu import GpuSupport
from .hostmem import HostMemory
from .shm import SharedMemory

#: every family, in the order their findings are listed
FAMILIES: tuple[type[Family], ...] = (Comm, Build, HostMemory, SharedMemory, GpuSupport)

__all__ = ["FAMILIES", "Build", "Comm", "Family", "GpuSupport", "HostMemory", "LineContext", "SharedMemory"]

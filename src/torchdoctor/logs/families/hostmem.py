"""Host memory that ran out inside the program: the CPU allocator refusing an allocation, a fork (DataLoader workers)
or mmap that failed for lack of memory, Python's ``MemoryError``, C++'s ``std::bad_alloc``. (The kernel's OOM
killer, which ends a process without a word from it, is :mod:`..judge_process`'s ``process.killed``.)

Message table:

- pytorch/pytorch@0803da8282cb ``c10/core/impl/alloc_cpu.cpp``: "[enforce fail at alloc_cpu.cpp:L] err == 0.
  DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)"
  (posix_memalign, Linux); "DefaultCPUAllocator: not enough memory: you tried to allocate N bytes." (Windows, older
  Linux builds; the old ``CPUAllocator.cpp`` added "Buy new RAM!").
- CPython: ``OSError: [Errno 12] Cannot allocate memory`` (``os.fork`` for DataLoader workers, ``mmap``),
  ``MemoryError`` (an allocation the interpreter could not make).
- C++: ``terminate called after throwing an instance of 'std::bad_alloc'`` (``what(): std::bad_alloc``).
"""

from __future__ import annotations

import re
from typing import Any

from ...findings import Finding
from ..common import add
from .base import Family

CPU_ALLOC_RE = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to allocate "
                          r"(?P<bytes>\d+) bytes")
ENOMEM_RE = re.compile(r"\[Errno 12\] Cannot allocate memory|Error code 12 \(Cannot allocate memory\)"
                       r"|std::bad_alloc|^(?:[\w.]+\.)?(?:_Array)?MemoryError\b")
#: numpy (numpy/core/_exceptions.py ``_ArrayMemoryError``): "Unable to allocate 12.0 GiB for an array with shape ..."
NUMPY_ALLOC_RE = re.compile(r"Unable to allocate (?P<size>[\d.]+ [KMGTP]?i?B) for an array with shape")
_FORK_WORDS = ("fork", "Popen", "worker", "DataLoader", "_launch")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class HostMemory(Family):
    RULES = (
        ("DefaultCPUAllocator", CPU_ALLOC_RE, "on_cpu_alloc"),
        ("Cannot allocate memory", ENOMEM_RE, "on_enomem"),
        ("bad_alloc", ENOMEM_RE, "on_enomem"),
        ("MemoryError", ENOMEM_RE, "on_enomem"),
        ("for an array with shape", NUMPY_ALLOC_RE, "on_numpy"),
    )
    ANCHORS = ("DefaultCPUAllocator", "Cannot allocate memory", "MemoryError", "Unable to allocate")
    NEEDLES = ()  # std::bad_alloc comes in a "terminate called after" line (a needle of the analyzer)
    CAUSE_EVENTS = frozenset({"host-alloc-failed"})

    def __init__(self, log: Any) -> None:
        super().__init__(log)
        self.events: list[dict] = []
        self.n = 0

    @property
    def failed(self) -> bool:
        return bool(self.events)

    def _add(self, lineno: int, text: str, kind: str, **d: Any) -> None:
        self.n += 1
        if self.n <= 8:
            self.log.event(lineno, "host-alloc-failed", text)
        add(self.events, {"line": lineno, "step": self.log.step, "kind": kind, "rank": self.log.rank_of(text),
                          "text": self.log.quote(text), **d}, 8)

    def on_cpu_alloc(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "allocator", bytes=int(m["bytes"]))

    def on_numpy(self, m: re.Match, text: str, lineno: int) -> None:
        from ...units import SizeError, parse_bytes

        try:
            size = int(parse_bytes(m["size"].replace(" ", "")))
        except SizeError:
            size = 0
        self._add(lineno, text, "allocator", bytes=size, by="numpy")

    def on_enomem(self, m: re.Match, text: str, lineno: int) -> None:
        if "DefaultCPUAllocator" in text or NUMPY_ALLOC_RE.search(text):
            return  # on_cpu_alloc has it, with its size
        kind = "bad_alloc" if "bad_alloc" in m.group(0) else "MemoryError" if "MemoryError" in m.group(0) else "enomem"
        self._add(lineno, text, kind)

    def judge(self) -> list[Finding]:
        if not self.events:
            return []
        first = self.events[0]
        sized = next((e for e in self.events if e.get("bytes")), None)
        near = " ".join(e["text"] for e in self.events)
        fork = first["kind"] == "enomem" and any(w in near for w in _FORK_WORDS)
        if sized is not None:
            title = (f"host RAM ran out: {'numpy' if sized.get('by') == 'numpy' else 'torch'}'s CPU allocator could "
                     f"not allocate {gib(sized['bytes'])}")
        elif fork:
            title = "host RAM ran out: starting a process (fork: DataLoader workers) failed with ENOMEM"
        else:
            title = {"bad_alloc": "host RAM ran out: a C++ allocation failed (std::bad_alloc)",
                     "MemoryError": "host RAM ran out: Python raised MemoryError"}.get(
                first["kind"], "host RAM ran out: an allocation failed with ENOMEM (Cannot allocate memory)")
        ev = [f"line {e['line']}: {e['text']}" for e in self.events[:3]]
        if self.n > 3:
            ev.append(f"{self.n} such line(s) in all")
        fix = []
        if sized is not None:
            fix.append(f"one allocation of {gib(sized['bytes'])} in host memory: an array or tensor built whole in RAM "
                       "(a dataset loaded at once, torch.FloatTensor(list) of all samples, a checkpoint loaded on "
                       "every rank); load it lazily (a Dataset that reads items, np.memmap, "
                       "torch.load(..., mmap=True)) or in pieces")
        if fork:
            fix.append("each DataLoader worker is a fork of the training process: fewer workers (num_workers), "
                       "persistent_workers=True instead of new ones per epoch, no large Python lists held in the "
                       "Dataset (they are copied on write), or torch.multiprocessing.set_start_method('spawn')")
        fix += ["free -g / the job's memory limit (cgroup, Slurm --mem) against what the job needs: `torchdoctor ds "
                "memory --params N --config ds.json` sizes DeepSpeed's host RAM (CPU offload needs a lot)",
                "a limit lower than the machine's RAM (a container, Slurm) fails allocations the same way: "
                "`torchdoctor run -- CMD` watches memory and names the limit"]
        return [Finding("memory.host-oom", "fail", title, ev, fix,
                        {"count": self.n, "events": list(self.events)})]

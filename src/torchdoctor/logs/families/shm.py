"""Shared memory (``/dev/shm``) that ran out: DataLoader workers hand each batch to the main process through a file in
/dev/shm (and torch.multiprocessing shares every tensor that way), so a small /dev/shm -- Docker's default is 64 MB --
fails the first time a batch does not fit, in words that read like a full disk.

Message table:

- pytorch/pytorch ``aten/src/ATen/MapAllocator.cpp`` (torch 1.5-2.13): "unable to write to file <{name}>: {strerror}
  ({errno})", "unable to open shared memory object <{name}> in read-write mode: {strerror} ({errno})", "unable to
  mmap {n} bytes from file <{name}>: {strerror} ({errno})" (the names start ``/torch_``: ``THPStorage_newHandle``);
  torch <= 1.4 ``aten/src/TH/THAllocator.cpp`` "unable to write to file <{name}>" with no reason.
- ``torch/csrc/DataLoader.cpp`` (the workers' SIGBUS handler): "ERROR: Unexpected bus error encountered in worker. This
  might be caused by insufficient shared memory (shm)."
- CPython ``multiprocessing/synchronize.py``: a ``SemLock`` (the DataLoader's queues' locks) lives in /dev/shm too; a
  full one fails with "OSError: [Errno 28] No space left on device" under a ``SemLock`` frame.
"""

from __future__ import annotations

import re
from typing import Any

from ...findings import Finding
from ..common import add
from .base import Family

SHM_FILE_RE = re.compile(r"unable to (?P<op>write to|open|mmap \d+ bytes from) (?:file|shared memory object) "
                         r"<(?P<name>/torch_[^>]*)>(?:[^:\n]*?: (?P<why>[^(\n]+?) \((?P<errno>\d+)\))?")
SHM_BUS_RE = re.compile(r"insufficient shared memory \(shm\)")
ENOSPC_RE = re.compile(r"\[Errno 28\] No space left on device")
SEMLOCK_RE = re.compile(r"\bSemLock\b")

_ERRNO = {"28": "no space left on /dev/shm", "24": "too many open files (each shared tensor holds a descriptor)",
          "12": "the memory for it could not be allocated"}


class SharedMemory(Family):
    RULES = (
        ("</torch_", SHM_FILE_RE, "on_file"),
        ("insufficient shared memory", SHM_BUS_RE, "on_bus"),
        ("No space left on device", ENOSPC_RE, "on_enospc"),
        ("SemLock", SEMLOCK_RE, "on_semlock"),
    )
    ANCHORS = ("SemLock",)  # (the other lines are error lines: found by the analyzer's "Error"/"ERROR" anchors)
    NEEDLES = ()
    CAUSE_EVENTS = frozenset({"shm-full"})

    def __init__(self, log: Any) -> None:
        super().__init__(log)
        self.events: list[dict] = []
        self.enospc: list[dict] = []
        self.semlock = False
        self.n = 0

    @property
    def failed(self) -> bool:
        return bool(self.events) or bool(self.enospc and self.semlock)

    def _add(self, lineno: int, text: str, kind: str, **d: Any) -> None:
        self.n += 1
        if self.n <= 8:
            self.log.event(lineno, "shm-full", text)
        add(self.events, {"line": lineno, "kind": kind, "text": self.log.quote(text), **d}, 8)

    def on_file(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "file", name=m["name"], errno=m["errno"], why=m["why"], op=m["op"])

    def on_bus(self, m: re.Match, text: str, lineno: int) -> None:
        self._add(lineno, text, "bus")

    def on_enospc(self, m: re.Match, text: str, lineno: int) -> None:
        if "</torch_" not in text:
            add(self.enospc, {"line": lineno, "text": self.log.quote(text)}, 4)

    def on_semlock(self, m: re.Match, text: str, lineno: int) -> None:
        self.semlock = True

    def judge(self) -> list[Finding]:
        events = list(self.events)
        if not events and self.enospc and self.semlock:  # a queue's lock could not be made in /dev/shm
            events = [{**e, "kind": "semlock", "errno": "28"} for e in self.enospc]
            for e in events[:1]:
                self.log.event(e["line"], "shm-full", e["text"])
        if not events:
            return []
        errnos = [e.get("errno") for e in events if e.get("errno")]
        errno = errnos[0] if errnos else None
        first = events[0]
        if errno == "24":
            title = ("sharing tensors between processes ran out of file descriptors (Too many open files): each "
                     "tensor a DataLoader worker sends holds one")
            fix = ["torch.multiprocessing.set_sharing_strategy('file_system') (tensors shared by file name, not "
                   "descriptor), or raise the limit: ulimit -n 65536",
                   "fewer DataLoader workers / a smaller prefetch_factor keep fewer tensors in flight"]
        else:
            why = _ERRNO.get(errno or "", "")
            if first["kind"] == "bus":  # torch's words are a guess ("might be caused by"): said as one
                how = ("a DataLoader worker died of SIGBUS (a bus error); torch's message says it might be "
                       "insufficient shared memory -- a hypothesis until df -h /dev/shm shows it full")
            elif first["kind"] == "semlock":
                how = "a DataLoader queue's lock (a POSIX semaphore, kept in /dev/shm) could not be created"
            elif errno:
                how = f"writing {first.get('name', 'a /torch_ file')} in /dev/shm failed: {why}"
            else:
                how = (f"writing {first.get('name', 'a /torch_ file')} in /dev/shm failed, and this torch's message "
                       "gives no reason (a full /dev/shm is the usual one)")
            title = (f"shared memory (/dev/shm) ran out: {how}" if errno or first["kind"] == "semlock" else
                     f"a process could not use shared memory: {how}")
            fix = ["df -h /dev/shm shows its size: in Docker the default is 64 MB -- docker run --shm-size=16g (or "
                   "--ipc=host); Kubernetes: mount an emptyDir with medium: Memory at /dev/shm; Slurm/apptainer jobs "
                   "get the node's /dev/shm, which other jobs may fill",
                   "DataLoader workers pass each batch through /dev/shm: fewer workers (num_workers), a smaller "
                   "prefetch_factor or batch lower what is in flight; num_workers=0 uses none (slower)"]
        ev = [f"line {e['line']}: {e['text']}" for e in events[:3]]
        if self.n > 3:
            ev.append(f"{self.n} such line(s) in all")
        return [Finding("memory.shm", "fail", title, ev, fix, {"events": events, "errno": errno})]

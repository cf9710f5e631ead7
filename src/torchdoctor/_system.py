"""Facts about this machine that several commands need: /proc/meminfo, the cgroup limit, units, the NVIDIA
kernel module's version.

One reader each, so ``env``, ``ds memory``, ``comm`` and ``run`` agree.

``TORCHDOCTOR_UNREADABLE`` (comma-separated: ``kernel-log``, ``cgroup``) makes torchdoctor act as on a machine
that does not let a process read those sources -- no kernel log (``dmesg``, ``/dev/kmsg``, ``journalctl``), no
cgroup files -- so what it says there can be seen (and tested) on any machine. ``make test`` runs the tests
that read the machine a second time with both hidden.
"""

from __future__ import annotations

import os
import re

GIB = 1024**3
MIB = 1024**2

UNREADABLE_ENV = "TORCHDOCTOR_UNREADABLE"
UNREADABLE_SOURCES = ("kernel-log", "cgroup")


def unreadable(source: str) -> bool:
    """Whether ``TORCHDOCTOR_UNREADABLE`` hides ``source`` (one of ``UNREADABLE_SOURCES``)."""
    assert source in UNREADABLE_SOURCES, source
    return source in {s.strip() for s in os.environ.get(UNREADABLE_ENV, "").split(",")}


def read_meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (only the ``kB`` lines); ``{}`` where it is unreadable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[name] = int(parts[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def _cgroup_dirs() -> list[str]:
    """This process's memory-cgroup directories, v2 and v1, most specific first (none when hidden)."""
    if unreadable("cgroup"):
        return []
    dirs: list[str] = []
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        entries = []
    for e in entries:
        if len(e) != 3:
            continue
        _, controllers, path = e
        if controllers == "":
            dirs += [f"/sys/fs/cgroup{path}", f"/sys/fs/cgroup/unified{path}"]
        elif "memory" in controllers.split(","):
            dirs.append(f"/sys/fs/cgroup/{controllers}{path}")
    dirs += ["/sys/fs/cgroup", "/sys/fs/cgroup/memory"]  # inside a cgroup namespace the path is "/"
    return [os.path.normpath(d) for d in dict.fromkeys(dirs)]


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_memory() -> tuple[int | None, int | None]:
    """(memory limit in bytes or None when unlimited/unknown, oom_kill counter or None) of our cgroup."""
    limit = oom = None
    for d in _cgroup_dirs():
        for name in ("memory.max", "memory.limit_in_bytes"):
            text = read_text(os.path.join(d, name))
            if limit is None and text is not None:
                text = text.strip()
                if text.isdigit() and int(text) < 1 << 60:
                    limit = int(text)
        for name in ("memory.events", "memory.oom_control"):
            text = read_text(os.path.join(d, name))
            if oom is None and text:
                m = re.search(r"^oom_kill (\d+)$", text, re.M)
                if m:
                    oom = int(m.group(1))
        if limit is not None or oom is not None:
            break
    return limit, oom


def cgroup_limit_readable() -> bool:
    """Whether this process could read a memory cgroup's limit file (``max`` counts: it says "no limit"). When it
    cannot, "no limit" from :func:`cgroup_memory` means "unknown": a container's limit may still be in force."""
    return any(read_text(os.path.join(d, name)) is not None
               for d in _cgroup_dirs() for name in ("memory.max", "memory.limit_in_bytes"))


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def host_memory_limit() -> int | None:
    """The memory this process may use: MemTotal, or the cgroup limit when that is lower (None: unknown)."""
    total = read_meminfo().get("MemTotal")
    limit, _ = cgroup_memory()
    if limit is not None and (total is None or limit < total):
        return limit
    return total


def kernel_driver_version() -> str | None:
    """The NVIDIA driver version as the kernel module reports it (None: no module loaded, or unreadable)."""
    text = read_text("/proc/driver/nvidia/version")
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text or "")
    return m.group(1) if m else None

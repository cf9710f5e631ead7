"""One failure often sets off others: a rank dies and every peer's collective times out or loses its connection; a
CUDA error surfaces again at a later synchronisation, as a cuBLAS failure or a second CUDA error. Those later
failures are evidence of the first, not causes of their own, so :func:`headline` puts the earliest cause first and
folds the consequences that came after it into its evidence (each kept as an ``info`` finding that says what it
followed: nothing is dropped).

What counts as a consequence, and of what:

- a communication failure (``comm.*``: a NCCL/gloo timeout, a closed connection, a store that went away) after any
  other failure on the run -- a rank that died of an out-of-memory, a CUDA error, a Python exception, a non-finite
  loss that stopped it, a kill: its peers then wait in their next collective until the watchdog fires;
- a CUDA library failure or a generic CUDA error (``cuda.library-error``, ``cuda.error``) after a specific CUDA error
  (an illegal memory access, a device-side assert): CUDA reports an error at the next call that checks, and every
  call after it fails too.

The order is the log's: a finding's first line is the smallest ``line N`` its evidence quotes.
"""

from __future__ import annotations

import dataclasses
import re

from ..findings import Finding

_LINE = re.compile(r"\bline (\d+)\b")
#: consequence prefix -> the finding ids that can cause it (prefixes)
CAUSED_BY: dict[str, tuple[str, ...]] = {
    "comm.": ("memory.", "cuda.", "loss.", "process.exception", "process.killed", "process.cancelled", "build.",
              "fp16.", "grad."),
    "cuda.library-error": ("cuda.illegal-memory-access", "cuda.device-assert", "memory.cuda-oom"),
    "cuda.error": ("cuda.illegal-memory-access", "cuda.device-assert"),
}


#: an exception that is itself a communication failure (a C++ DistBackendError carrying the watchdog's timeout, a
#: store error): never the root of a communication cascade
_COMM_EXCEPTION = re.compile(r"DistBackendError|DistNetworkError|DistStoreError|NCCL|[Ww]atchdog|ProcessGroup|gloo|c10d"
                             r"|collective")


def _can_cause(f: Finding, cons_prefix: str) -> bool:
    if cons_prefix == "comm." and f.id.startswith("process.exception"):
        exc = f.data.get("exception") or {}
        return not _COMM_EXCEPTION.search(f"{exc.get('type', '')}: {exc.get('msg', '')} {f.title}")
    return True


def first_line(f: Finding) -> int | None:
    lines = [int(m.group(1)) for e in f.evidence for m in _LINE.finditer(e)]
    return min(lines) if lines else None


def headline(findings: list[Finding]) -> list[Finding]:
    """``findings`` with the first cause of a cascade first and its consequences folded into it (see the module)."""
    fails = [(first_line(f), f) for f in findings if f.severity == "fail"]
    fails = [(n, f) for n, f in fails if n is not None]
    out = list(findings)
    for cons_prefix, causes in CAUSED_BY.items():
        roots = [(n, f) for n, f in fails
                 if f.id.startswith(causes) and not f.id.startswith(cons_prefix) and _can_cause(f, cons_prefix)]
        if not roots:
            continue
        n0, root = min(roots, key=lambda t: t[0])
        later = [(n, f) for n, f in fails if f.id.startswith(cons_prefix) and n > n0 and f in out]
        if not later:
            continue
        extra = [f"then, line {n}: {f.title} -- a consequence of the failure above (see {f.id} below)"
                 for n, f in later]
        new_root = dataclasses.replace(root, evidence=[*root.evidence, *extra],
                                       data={**root.data, "consequences": [f.id for _, f in later]})
        for _, f in later:
            i = out.index(f)
            out[i] = dataclasses.replace(f, severity="info", title=f"{f.title} (after line {n0}'s {root.id}: its "
                                                                   "consequence)",
                                         data={**f.data, "consequence_of": root.id})
        out.remove(root)
        out.insert(0, new_root)
        gone = [g for _, g in later]
        fails = [(n, new_root if f is root else f) for n, f in fails if f not in gone]
    return out

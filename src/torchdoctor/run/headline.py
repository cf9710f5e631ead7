"""One headline per failure of a distributed job: the verdict (``comm.<class>``: the culprit rank, the class, its call
site) goes first, and what followed from it -- the other ranks' timeouts and lost connections, their tracebacks, the
launcher ending them -- stays as evidence under it: such log findings are kept, as ``info``, never a second culprit."""

from __future__ import annotations

import dataclasses
import re

from ..findings import Finding

CLASSES = ("init-mismatch", "stopped", "killed", "exception", "exited-early", "collective-mismatch", "never-arrived",
           "transport", "slow")
#: log findings a failing rank drags along on the others (the logs' comm family: timeouts, lost peers, rendezvous)
_CONSEQUENCE_IDS = re.compile(r"^comm\.(?:nccl-timeout|nccl-error|nccl-warn|network|rendezvous|invalid-usage)$")


def is_verdict(f: Finding) -> bool:
    return f.id.startswith("comm.") and f.data.get("class") in CLASSES


def _rank_of(f: Finding) -> int | None:
    for key in ("rank", "global_rank"):
        r = f.data.get(key)
        if isinstance(r, int):
            return r
    m = re.search(r"\brank (\d+)\b", f.title)
    return int(m.group(1)) if m else None


def fold(findings: list[Finding], hang: list[Finding], ended_by_run: bool = False) -> list[Finding]:
    """``findings`` (the run's: its exit, memory, the log's) with ``hang`` (the job's verdict and the records' notes):
    the verdict first; each log finding about another rank's consequence demoted to ``info``, saying so; with
    ``ended_by_run``, the command's own exit is what ``run`` did to it, said so."""
    verdicts = [f for f in hang if is_verdict(f)]
    if not verdicts:
        return [*findings, *hang]
    v = verdicts[0]
    culprits = set(v.data.get("culprit_ranks") or ())
    out = []
    for f in findings:
        if ended_by_run and f.id == "process.exit":
            f = dataclasses.replace(f, severity="info", title=f"{f.title} -- torchdoctor run ended the job after "
                                    f"its verdict ({v.id})")
        elif f.severity in ("fail", "warn") and _consequence(f, v, culprits):
            who = (f" (rank{'s' if len(culprits) != 1 else ''} {', '.join(map(str, sorted(culprits)))})"
                   if culprits else "")
            f = dataclasses.replace(f, severity="info", title=f"{f.title} -- a consequence of {v.id}{who}")
        out.append(f)
    return [v, *out, *(f for f in hang if f is not v)]


def _consequence(f: Finding, v: Finding, culprits: set[int]) -> bool:
    if _CONSEQUENCE_IDS.match(f.id):
        return True
    if f.id in ("process.exception", "process.killed", "process.error-line"):
        rank = _rank_of(f)
        return rank is None or rank not in culprits or v.data.get("class") not in ("exception", "killed")
    return False

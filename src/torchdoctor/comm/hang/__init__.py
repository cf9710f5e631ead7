"""A hang post-mortem from PyTorch's Flight Recorder: read every rank's dump (:mod:`.dumps`), find where the ranks
parted (:mod:`.analyze`), say it (:mod:`.findings`)."""

from __future__ import annotations

from typing import Any

from ...findings import Finding


def _findings(folder: str, prefixes: tuple[str, ...] = (), also: tuple[str, ...] = (), job: Any = None,
              procs: Any = None) -> tuple[int, list[Finding]]:
    """(ranks read, findings) for the dumps in ``folder`` and the folders ``also``; (0, []) when there is nothing:
    no dump and nothing known of the ranks."""
    from .analyze import analyze
    from .dumps import read_folder
    from .findings import hang_findings

    dumps = read_folder(folder, prefixes)
    for other in also:
        read_folder(other, prefixes, dumps)
    if not dumps.ranks and not dumps.problems and not (job is not None and job.ranks) and not procs:
        return 0, []
    return len(dumps.ranks), hang_findings(dumps, analyze(dumps), folder, job, procs)


def post_mortem(folder: str, prefixes: tuple[str, ...] = (), also: tuple[str, ...] = (), job: Any = None,
                procs: Any = None) -> list[Finding]:
    """The findings for the dumps in ``folder`` and the folders ``also``, with what ``torchdoctor run`` saw of the ranks
    (``job``: a :class:`.facts.JobFacts`; ``procs``: every process that called ``init_process_group``); none: an
    empty list."""
    return _findings(folder, prefixes, also, job, procs)[1]


class FolderReport:
    """``torchdoctor logs DIR`` on a folder of Flight Recorder dumps: the findings, as a log's report has them."""

    def __init__(self, folder: str, ranks: int, findings: list[Finding]) -> None:
        self.folder, self.ranks, self.findings = folder, ranks, findings

    @classmethod
    def read(cls, folder: str) -> FolderReport | None:
        """None when the folder holds no dump (not even an unreadable one)."""
        ranks, findings = _findings(folder)
        return cls(folder, ranks, findings) if findings else None

    def describe(self) -> str:
        return f"Flight Recorder dumps of {self.ranks} rank(s)"

    def to_json(self) -> dict:
        return {"dumps": self.folder, "ranks": self.ranks, "findings": [f.to_json() for f in self.findings]}

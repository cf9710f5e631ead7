"""``torchdoctor logs`` judged on log excerpts from public issue threads, per failure family.

The excerpts are third-party text and stay outside the project: a folder holding ``*.log`` files and a
``labels.jsonl`` with one object per file::

    {"file": "a001__NVIDIA-apex-318.log", "url": "https://github.com/NVIDIA/apex/issues/318",
     "family": "fp16-scale", "expected": "fail" | "warn" | "quiet", "cause": "what the thread says",
     "facts": ["(?i)another process"]}

``facts`` (optional) are regular expressions the cause's own words call for, written with the label before the tool
ran: the family's finding (its title and fix: the diagnosis, not the evidence, which quotes the line itself) must match
every one of them to be **right** (a CUDA OOM whose line
says other processes hold the memory is right only when the finding says so; one that says "lower the batch size"
is *partly*).

Each excerpt gets one of four verdicts against the cause its thread states:

- **right**: the family's own finding (``FAMILIES`` below) at the severity the cause calls for (``fail``: a fail
  finding and exit 1; ``warn``: warn or fail; ``quiet``: no warn or fail at all), saying the label's ``facts``;
- **partly**: the run is flagged but not diagnosed (only a generic finding: the exception, an error line, an exit
  code), the family's finding at a lower severity, or without the facts the line gives; for a healthy log, a
  warning;
- **wrong**: a warn/fail finding of another family names a cause the thread does not (or, for a healthy log, a fail);
- **missed**: nothing at warn or fail on a failed run.

Run it from the repository root (the tree it imports is the one measured; ``PYTHONPATH=OTHER/src`` measures another)::

    .venv/bin/python benchmarks/excerpts.py --corpus DIR            # the table per family
    .venv/bin/python benchmarks/excerpts.py --corpus DIR --rows     # and every excerpt's verdict
    .venv/bin/python benchmarks/excerpts.py --corpus DIR --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from realworld import run_json  # noqa: E402 -- torchdoctor's CLI in this process, --json

#: family -> the finding ids (prefixes) that name its cause
FAMILIES: dict[str, tuple[str, ...]] = {
    "fp16-scale": ("fp16.",),
    "nonfinite-loss": ("loss.nonfinite", "grad.nonfinite"),
    "nccl-timeout": ("comm.nccl-timeout",),
    "comm-network": ("comm.network", "comm.nccl-error"),
    "comm-rendezvous": ("comm.rendezvous",),
    "comm-invalid-usage": ("comm.invalid-usage",),
    "cuda-runtime": ("cuda.illegal-memory-access", "cuda.device-assert", "cuda.error", "cuda.library-error"),
    "cuda-unsupported-gpu": ("cuda.no-kernel-image", "cuda.unsupported-gpu"),
    "cuda-driver": ("cuda.driver-too-old",),
    "cuda-oom": ("memory.cuda-oom",),
    "host-oom": ("memory.host-oom", "process.killed"),
    "build-undefined-symbol": ("build.undefined-symbol",),
    "build-cuda-home": ("build.cuda-home",),
    "build-compiler": ("build.compiler", "build.cuda-mismatch"),
    "crash-other": ("process.exception", "process.error-line", "process.killed", "ds.config-error"),
    "shm": ("memory.shm",),
    "slurm-cancel": ("process.cancelled",),
    "healthy": (),
}
#: findings that say a run failed without saying why
GENERIC = ("process.exception", "process.error-line", "process.exit-code", "process.exit", "logs.analyzer-error")
VERDICTS = ("right", "partly", "wrong", "missed")


def _says(findings: list[dict], ids: tuple[str, ...], facts: list[str]) -> bool:
    """Whether the family's findings say every fact: their titles and fixes (the evidence quotes the log's own lines,
    which hold the fact whether or not the diagnosis read it)."""
    text = "\n".join(" ".join([f.get("title", ""), *f.get("fix", [])])
                     for f in findings if ids and f["id"].startswith(ids))
    return all(re.search(rx, text) for rx in facts)


def verdict(family: str, expected: str, rc: int, findings: list[dict], facts: list[str] | None = None) -> str:
    sev = collections.defaultdict(set)
    for f in findings:
        sev[f["id"]].add(f.get("severity"))
    ids = FAMILIES.get(family, ())
    mine = {s for i, ss in sev.items() if ids and i.startswith(ids) for s in ss}
    flagged = {i for i, ss in sev.items() if ss & {"warn", "fail"}}
    others = {i for i in flagged if not (ids and i.startswith(ids)) and not i.startswith(GENERIC)}
    if expected == "quiet":
        if not flagged:
            return "right"
        return "wrong" if any("fail" in sev[i] for i in flagged) else "partly"
    said = _says(findings, ids, facts or [])
    if expected == "fail" and "fail" in mine and rc == 1 and said:
        return "right"
    if expected == "warn" and mine & {"warn", "fail"} and said:
        return "right"
    if mine or (flagged and not others):
        return "partly"
    return "wrong" if others else "missed"


def evaluate(corpus: Path) -> list[dict]:
    rows = []
    labels = [json.loads(x) for x in (corpus / "labels.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    for i, lab in enumerate(labels, 1):
        print(f"  {i}/{len(labels)} {lab['file']}", file=sys.stderr)
        rc, out = run_json(["logs", str(corpus / lab["file"])])
        findings = out.get("findings", [])
        rows.append({"file": lab["file"], "url": lab.get("url"), "family": lab["family"],
                     "expected": lab["expected"], "rc": rc,
                     "findings": [f"{f['id']}:{f['severity']}" for f in findings
                                  if f.get("severity") in ("fail", "warn", "info")],
                     "verdict": verdict(lab["family"], lab["expected"], rc, findings, lab.get("facts"))})
    return rows


def table(rows: list[dict]) -> str:
    by = collections.defaultdict(collections.Counter)
    for r in rows:
        by[r["family"]][r["verdict"]] += 1
    out = ["| family | excerpts | right | partly | wrong | missed |", "|---|---|---|---|---|---|"]
    total: collections.Counter = collections.Counter()
    for fam in sorted(by):
        c = by[fam]
        total.update(c)
        out.append(f"| {fam} | {sum(c.values())} | " + " | ".join(str(c[v]) for v in VERDICTS) + " |")
    out.append(f"| **all** | {sum(total.values())} | " + " | ".join(f"**{total[v]}**" for v in VERDICTS) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, required=True, help="a folder of *.log excerpts and their labels.jsonl")
    p.add_argument("--rows", action="store_true", help="also print every excerpt's verdict")
    p.add_argument("--json", metavar="FILE", help="write every row as JSON to FILE")
    a = p.parse_args(argv)
    if not (a.corpus / "labels.jsonl").is_file():
        print(f"no labels.jsonl in {a.corpus}", file=sys.stderr)
        return 2
    rows = evaluate(a.corpus)
    if a.rows:
        print("| file | family | expected | exit | findings | verdict |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['file']} | {r['family']} | {r['expected']} | {r['rc']} | "
                  f"{', '.join(r['findings']) or '-'} | {r['verdict']} |")
        print()
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

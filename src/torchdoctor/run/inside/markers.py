"""The small JSON files each process of a ``run --numerics`` leaves in the report folder, read back by ``run``.

``torchdoctor-loaded-<host>-<pid>.json``: the bootstrap ran in that process (``pid``, ``host``, ``argv``, ``rank``).
``torchdoctor-attached-<host>-<pid>-<n>.json``: it attached a monitor there (also ``watching``: what, in one line;
``via``: ``plain``, ``hf``, ``lightning`` or ``deepspeed``), or found the script's own monitor (``own``: true).
No torch import: ``run`` reads these.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
from typing import Any

KINDS = ("loaded", "attached")


def rank_from_env(env: Any = None) -> int | None:
    """The process's global rank as the launchers export it (torchrun, deepspeed, accelerate: ``RANK``; SLURM's
    ``srun``: ``SLURM_PROCID``), or None."""
    env = os.environ if env is None else env
    for name in ("RANK", "SLURM_PROCID"):
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return None


def write(report_dir: str, kind: str, data: dict[str, Any], n: int = 0) -> str:
    """Write one marker (atomically: a reader never sees half of one); returns its path."""
    host = socket.gethostname().replace(os.sep, "_") or "host"
    name = f"torchdoctor-{kind}-{host}-{os.getpid()}" + (f"-{n}" if kind == "attached" else "") + ".json"
    path = os.path.join(report_dir, name)
    os.makedirs(report_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "host": host, "rank": rank_from_env(), **data}, fh, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def _paths(report_dir: str, kind: str, since: float) -> list[str]:
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(report_dir), f"torchdoctor-{kind}-*.json"))):
        try:
            if os.stat(path).st_mtime >= since - 0.5:  # (an earlier run's are left out)
                out.append(path)
        except OSError:
            continue
    return out


def remove(report_dir: str, since: float) -> None:
    """Remove this run's markers once read (they are ``run``'s bookkeeping, not reports)."""
    for kind in KINDS:
        for path in _paths(report_dir, kind, since):
            with contextlib.suppress(OSError):
                os.unlink(path)


def read(report_dir: str, kind: str, since: float = 0.0) -> list[dict[str, Any]]:
    """The markers of ``kind`` in ``report_dir`` written at or after ``since``."""
    out = []
    for path in _paths(report_dir, kind, since):
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(data)
    return out

"""The files a distributed process of ``torchdoctor run`` and ``run`` itself exchange in the report folder while the job
runs (no torch import: both sides use this module).

``torchdoctor-rank-<host>-<pid>.json`` -- one per process that called ``init_process_group``, rewritten whole (never
half-read) by that process:

* ``init``: what it asked ``init_process_group`` for, written *before* the call (so a rank stuck in it is known):
  ``backend``, the ``rank`` / ``world_size`` / ``init_method`` it passed, the launcher's ``env`` (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), ``timeout_s``, the ``stack`` of the call, ``t`` when it
  entered, ``done`` when it returned (or ``error``);
* ``beat``: written every ``period`` seconds by a thread of that process once it is distributed: ``t``, ``groups``
  (per process group: Flight Recorder's last enqueued / started / completed collective), ``in_collective`` (the main
  thread inside torch.distributed, or a device backend's collective not completed), ``pending`` (a host backend's
  collective not completed by the counters while the main thread is elsewhere: its completion lags), the main
  thread's ``stack``, and ``samples``: where the main thread was, counted per sample taken outside a collective;
* ``end``: how it ended, where Python saw it (``how``: ``exit`` with ``code``, ``exception`` with ``error``, or
  ``signal`` with ``signal``), its ``stack``, ``t``; and ``timing``: when it entered each collective (for a slow
  rank), written as it exits;
* ``answered``: the id of the last dump request it answered.

``torchdoctor-request.json`` -- written by ``run`` to ask every rank for its Flight Recorder dump now (``id``,
``why``): each rank's thread answers by writing ``torchdoctor-flight-rank<r>.json`` with the main thread's stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from typing import Any

PREFIX = "torchdoctor-rank-"
NAME = re.compile(r"^torchdoctor-rank-(.+)-(\d+)\.json$")
REQUEST = "torchdoctor-request.json"


def host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "host"


def path_for(report_dir: str, pid: int | None = None) -> str:
    return os.path.join(report_dir, f"{PREFIX}{host()}-{os.getpid() if pid is None else pid}.json")


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` whole: a reader sees the old file or the new one, never half of one."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    data = json.dumps(doc, default=str)  # (one write: the heartbeat calls this every period)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(data)
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_all(report_dir: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Every process's status file in ``report_dir``: (host, pid) -> its document."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        names = os.listdir(report_dir)
    except OSError:
        return out
    for name in names:
        m = NAME.match(name)
        if m:
            doc = read_json(os.path.join(report_dir, name))
            if doc is not None:
                out[(m.group(1), int(m.group(2)))] = doc
    return out


def remove_all(report_dir: str) -> None:
    """``run``'s bookkeeping, removed once read: the status files and the request."""
    try:
        names = os.listdir(report_dir)
    except OSError:
        return
    for name in names:
        if NAME.match(name) or name == REQUEST or (name.startswith(PREFIX) and name.endswith(".tmp")):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(report_dir, name))


def user_frames(stack: list, limit: int = 40) -> list[list]:
    """The innermost ``limit`` frames of ``stack`` ((file, line, function), innermost last) as lists."""
    return [[str(f[0]), int(f[1] or 0), str(f[2])] for f in stack[-limit:]]

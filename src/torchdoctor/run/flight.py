"""``torchdoctor run`` and PyTorch's Flight Recorder: switched on in the job, read back after a hang.

Before the command starts (:func:`environment`): the recorder's buffer (``TORCH_FR_BUFFER_SIZE=2000`` entries per
process group), NCCL's own dump on a watchdog timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) into the run's report folder
(``TORCH_FR_DUMP_TEMP_FILE=<report dir>/nccl_trace_rank_``), and the start-up hook (:mod:`torchdoctor.run.inside.
flight`) that makes each rank of a distributed job write its dump and stack as it ends badly. A variable the user
set is never overridden (their dump prefix is where the dumps are then read from); a job that never calls
``init_process_group`` is not touched. After the command (:func:`findings`): every dump found, read into the
``comm.hang`` / ``comm.collective-mismatch`` findings (:mod:`torchdoctor.comm.hang`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ..findings import Finding

BUFFER = "2000"
_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def environment(report_dir: str, env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(the variables to add to ``env`` for the command, the dump file prefix the job will write to)."""
    from .inside import BOOT_DIR, FLIGHT_VAR, package_parent

    add: dict[str, str] = {}
    if not any(env.get(v) for v in _BUFFER_VARS):
        add["TORCH_FR_BUFFER_SIZE"] = BUFFER
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        add["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    prefix = next((env[v] for v in _PREFIX_VARS if env.get(v)), None)
    if prefix is None:
        prefix = os.path.join(os.path.abspath(report_dir), "nccl_trace_rank_")
        add["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != BOOT_DIR]
    add["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *parts])
    add[FLIGHT_VAR] = json.dumps({"report_dir": os.path.abspath(report_dir), "path": package_parent()})
    return add, prefix


def findings(report_dir: str, prefix: str) -> list[Finding]:
    """The post-mortem of the dumps the job left (none: no finding)."""
    from ..comm.hang import post_mortem

    folder, name = os.path.split(prefix)
    folder = os.path.abspath(folder or ".")
    also = (folder,) if folder != os.path.abspath(report_dir) else ()  # the user's own dump location as well
    return post_mortem(report_dir, (name,), also)

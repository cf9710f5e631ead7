"""``torchdoctor run`` and PyTorch's Flight Recorder: switched on in the job, read back after a hang.

Before the command starts (:func:`environment`): the recorder's buffer (``TORCH_FR_BUFFER_SIZE=2000`` entries per
process group), NCCL's own dump on a watchdog timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) into the run's report folder
(``TORCH_FR_DUMP_TEMP_FILE=<report dir>/nccl_trace_rank_``), and the start-up hook (:mod:`torchdoctor.run.inside.
flight`) that makes each rank of a distributed job keep a status file and write its dump and stack as it ends badly.
A variable the user set is never overridden (their dump prefix is where the dumps are then read from); a job that
never calls ``init_process_group`` is not touched. While the job hangs (:mod:`.watch`) and after it
(:func:`findings`): the dumps and what was seen of each rank (:func:`job_facts`: process state, status file, the
launcher's and the kernel's log) make the verdict, ``comm.<class>`` (:mod:`torchdoctor.comm.hang.verdict`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..findings import Finding

if TYPE_CHECKING:
    from ..comm.hang.facts import JobFacts, RankFacts
    from .watch import Watch

BUFFER = "2000"
_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def environment(report_dir: str, env: Mapping[str, str], period: float = 1.0) -> tuple[dict[str, str], str]:
    """(the variables to add to ``env`` for the command, the dump file prefix the job will write to); ``period``:
    seconds between two heartbeats of each rank."""
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
    add[FLIGHT_VAR] = json.dumps({"report_dir": os.path.abspath(report_dir), "path": package_parent(),
                                  "period": period})
    return add, prefix


def period_for(hang_after: float | None) -> float:
    """Heartbeat period: an eighth of the hang threshold, 0.1 to 1 s (1 s when the threshold is automatic)."""
    return 1.0 if not hang_after else min(1.0, max(0.1, hang_after / 8))


def findings(report_dir: str, prefix: str, watch: Watch | None = None, result: Any = None,
             live: bool = False) -> list[Finding]:
    """The verdict on the job from the dumps it left and what ``run`` saw of its ranks (nothing known: no finding).
    ``result``: the :class:`~.result.RunResult` once the command ended (the launcher's log, the kernel's)."""
    from ..comm.hang import post_mortem

    folder, name = os.path.split(prefix)
    folder = os.path.abspath(folder or ".")
    also = (folder,) if folder != os.path.abspath(report_dir) else ()  # the user's own dump location as well
    job, procs = job_facts(watch, result, live) if watch is not None else (None, None)
    return post_mortem(report_dir, (name,), also, job, procs)


def job_facts(watch: Watch, result: Any = None, live: bool = False) -> tuple[JobFacts, list[RankFacts]]:
    """What ``run`` saw of each rank, as the verdict's facts (each with its witness)."""
    from ..comm.hang import ras
    from ..comm.hang.facts import JobFacts, RankFacts

    now = time.time()
    t0 = now - (time.monotonic() - watch.start)
    kills = {k.get("pid"): k for k in (result.log_kills if result is not None else ()) if k.get("pid")}
    oom = list(result.kernel.oom_lines) if result is not None and result.kernel is not None else []
    procs: list[RankFacts] = []
    for p in watch.procs.values():
        doc = p.doc
        rank = p.rank
        f = RankFacts(-1 if rank is None else rank, p.host, p.pid, p.state)
        f.init, f.beat, f.end, f.timing = doc.get("init"), doc.get("beat"), doc.get("end"), doc.get("timing")
        if f.beat and isinstance(f.beat.get("t"), (int, float)):
            f.beat_age = max(0.0, now - f.beat["t"])
        if p.seen is not None and p.seen[0] != p.state:  # as it was when judged, before run ended the job
            f.state = p.seen[0]
            f.state_witness = f"/proc/{p.pid}/stat: {p.seen[1] or '?'} when judged; then ended by torchdoctor run"
        elif not p.local:
            f.state_witness = f"on host {p.host}: its process state cannot be read from here"
        elif p.state in ("stopped", "traced"):
            f.stopped_at, f.traced = p.stopped_at, p.traced
            f.state_witness = f"/proc/{p.pid}/stat: {p.char} from {p.stopped_at - t0:.1f} s into the run"
        elif p.state == "gone":
            f.gone_at = p.gone_at
            f.state_witness = f"/proc/{p.pid}: gone at {p.gone_at - t0:.1f} s into the run"
        else:
            f.state_witness = f"/proc/{p.pid}/stat: {p.char or '?'}"
        if p.stopped_at is not None:
            f.stopped_at, f.traced = p.stopped_at, p.traced
        f.busy = (p.seen[1] if p.seen else p.char) == "R"
        if p.exit_code is not None and os.WIFSIGNALED(p.exit_code):
            f.signal = signal.Signals(os.WTERMSIG(p.exit_code)).name
            f.signal_witnesses.append(f"process state: /proc/{p.pid}/stat of its zombie: killed by {f.signal}")
        elif p.exit_code is not None and os.WIFEXITED(p.exit_code):
            f.exit_code = os.WEXITSTATUS(p.exit_code)
        kill = kills.get(p.pid)
        if kill is not None:  # the launcher's line too, where run also read the zombie: two witnesses, not one
            f.signal = f.signal or kill.get("signal")
            f.signal_witnesses.append(f"launcher log: {str(kill.get('text') or '').strip()[:200]}")
        f.oom_lines = [line for line in oom if re.search(rf"\b{p.pid}\b", line)]
        boundary = watch.ending_epoch or (watch.trigger_epoch if watch.trigger else None)
        ended = f.end_time if f.end_time is not None else f.gone_at
        f.ended_by_run = boundary is not None and ended is not None and ended >= boundary - 0.05
        procs.append(f)
    job = JobFacts(how=watch.trigger or "after the job ended", live=live, settled=watch.settled,
                   ended_well=result is not None and result.exit_code == 0 and not watch.trigger)
    for f in sorted(procs, key=lambda f: (f.beat is None, f.pid or 0)):
        if f.rank >= 0 and f.rank not in job.ranks:
            job.ranks[f.rank] = f
    worlds = [p.doc.get("world") for p in watch.procs.values() if isinstance(p.doc.get("world"), int)]
    job.world_size = max(worlds, default=None)
    job.notes = list(watch.notes)
    if watch.ras_text:
        comms, why = ras.parse(watch.ras_text)
        job.ras = comms
        if why:
            job.notes.append(f"NCCL RAS: {why}")
    return job, procs

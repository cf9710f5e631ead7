"""``torchdoctor run --numerics``: the numerics monitor in every Python process of the command, no code change.

The options (``--watch``, ``--grads``, ``--transient``, ``--headroom[-every]``, ``--trace-steps``,
``--abort-after-step``, ``--record[-every]``; any of them turns ``--numerics`` on) go to the command's environment with
the bootstrap (:mod:`torchdoctor.run.inside`), which each Python process loads at start-up and which attaches the
monitor to what that process trains. After the run, what was attached is read back from the markers each process left
in the report folder: a run where no Python process loaded the bootstrap (the command runs no Python, or resets
``PYTHONPATH``), or where one did but found nothing to watch, gets a note.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..cli_args import number_list
from ..findings import Finding

# as the monitor's options (numerics.options, which imports torch)
GRAD_LEVELS = ("none", "params", "modules")
WATCH_LEVELS = ("boundaries", "every-module")
TRANSIENT_ACTIONS = ("raise", "skip")


def steps_list(text: str) -> list[int]:
    """``--trace-steps 1,3``: step numbers (from 0), comma-separated."""
    return number_list(text, "step numbers", "1,3")


def step_number(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number (from 0), got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a step number >= 0, got {text!r}")
    return n


def _every(text: str) -> int:
    n = step_number(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of steps >= 1, got {text!r}")
    return n


def record_dir(text: str) -> str:
    """``--record DIR``: a folder (made if missing) -- refused before the command starts when it cannot be one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder, got an empty path")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.access(text if os.path.isdir(text) else parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {text if os.path.isdir(text) else parent}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "numerics (no code change)",
        "attach torchdoctor's numerics monitor in every Python process the command starts: to the HF Trainer, "
        "Lightning's Trainer, the engine deepspeed.initialize returns, or the model a plain loop's optimizer "
        "trains. The first inf/nan stops the run before its update, with the numerics.nonfinite finding.")
    group.add_argument("--numerics", action="store_true", help="attach the monitor")
    group.add_argument("--watch", choices=WATCH_LEVELS, default=None,
                       help="boundaries (default: a healthy step costs only its boundaries -- the model's outputs and "
                            "the parameter gradients; a bad step is replayed with every module watched to name where "
                            "it began), every-module (every module's call recorded as it runs)")
    group.add_argument("--transient", choices=TRANSIENT_ACTIONS, default=None,
                       help="a bad step whose replay does not reproduce it (a transient fault of the device): raise "
                            "(default) or skip its update and go on")
    group.add_argument("--grads", choices=GRAD_LEVELS, default=None,
                       help="gradient checks: params (default: each parameter gradient once per step), modules "
                            "(also each module's output gradient: names the module whose backward broke), none")
    group.add_argument("--headroom", action="store_const", const=True, default=None,
                       help="warn once per module whose values come within 2x of its dtype's largest value, with "
                            "the steps left at its rate (every --headroom-every steps watched every module)")
    group.add_argument("--headroom-every", metavar="N", type=_every, default=None,
                       help="steps between two headroom measurements (default 100; implies --headroom)")
    group.add_argument("--trace-steps", metavar="LIST", type=steps_list, default=None,
                       help="print every frame of these steps (from 0), e.g. 1,3")
    group.add_argument("--abort-after-step", metavar="N", type=step_number, default=None,
                       help="stop the run once step N (from 0) has finished")
    group.add_argument("--record", metavar="DIR", type=record_dir, default=None,
                       help="record the run's numerics timeline into DIR/rank<r>/: each recorded step is watched "
                            "every module, and each module's output and the gradient at it (abs min, abs max) kept on "
                            "the device and written every 50 recorded steps (16 bytes per module per step); read it "
                            "with `torchdoctor numerics show DIR` or compare two with `numerics diff`")
    group.add_argument("--record-every", metavar="N", type=_every, default=None,
                       help="record every N-th step (default 1; the steps between cost the default level); without "
                            "--record, into the run's report folder, recording/")


def options(args: argparse.Namespace, report_dir: str) -> dict[str, Any] | None:
    """The monitor's options for the command's processes, or None without ``--numerics`` (or an option of it)."""
    given = {name: getattr(args, name, None)
             for name in ("watch", "transient", "grads", "headroom", "headroom_every", "trace_steps",
                          "abort_after_step", "record", "record_every")}
    if not getattr(args, "numerics", False) and all(v is None for v in given.values()):
        return None
    out = {k: v for k, v in given.items() if v is not None}
    if "headroom_every" in out:
        out["headroom"] = True
    if "record_every" in out and "record" not in out:
        out["record"] = os.path.join(report_dir, "recording")
    if "record" in out:
        out["record"] = os.path.abspath(out["record"])  # (the command's processes may change directory)
    out["report_dir"] = os.path.abspath(report_dir)
    return out


def environment(opts: dict[str, Any]) -> dict[str, str]:
    """The variables that make the command's Python processes load the bootstrap with ``opts``."""
    from .inside import child_environment

    env = child_environment(opts, os.environ)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def attach_finding(report_dir: str, since: float, record: str | None = None) -> Finding:
    """What ``--numerics`` attached to in this run, from the markers of its processes (removed once read); with
    ``--record``, the ranks whose recording is on disk in ``record``."""
    from .inside import markers

    loaded = markers.read(report_dir, "loaded", since)
    attached = markers.read(report_dir, "attached", since)
    markers.remove(report_dir, since)
    if not loaded:
        return Finding(
            "numerics.not-attached", "info",
            "--numerics: no Python process of the command loaded torchdoctor, so nothing was watched",
            evidence=[f"no start-up marker in {report_dir}"],
            fix=["the command runs no Python, or it resets PYTHONPATH before starting Python (the bootstrap is "
                 "on PYTHONPATH): attach the monitor in the script instead (torchdoctor.NumericsMonitor, or "
                 "NumericsCallback for the HF / Lightning Trainer)"],
            data={"loaded": 0, "attached": []})
    if not attached:
        return Finding(
            "numerics.not-attached", "info",
            f"--numerics: {len(loaded)} Python process(es) started, none stepped an optimizer the monitor could "
            "watch",
            evidence=[f"{len(loaded)} start-up marker(s) in {report_dir}, no attach marker"],
            fix=["the run ended before its first optimizer step, or trains without a torch optimizer: attach the "
                 "monitor in the script (torchdoctor.NumericsMonitor(model), with mon.step() per step)"],
            data={"loaded": len(loaded), "attached": []})
    lines = [f"{_rank(a)}{a.get('watching')}" + (" (the script's own monitor)" if a.get("own") else "")
             for a in attached]
    recorded = _recorded(record)
    said = f"; recorded {len(recorded)} rank(s) in {record}" if recorded else ""
    return Finding(
        "numerics.attached", "ok",
        f"--numerics watched {len(attached)} process(es): {lines[0]}" + (" ..." if len(lines) > 1 else "") + said,
        evidence=lines if len(lines) > 1 else [],
        fix=[f"torchdoctor numerics show {record} -o timeline.html (the steps before it, module by module)"]
        if recorded else [],
        data={"loaded": len(loaded), "attached": attached, "recorded": recorded, "record": record})


def _recorded(record: str | None) -> list[str]:
    """The rank folders of a recording that hold one (its settings written), as found on disk."""
    if not record or not os.path.isdir(record):
        return []
    return sorted(d for d in os.listdir(record) if d.startswith("rank")
                  and os.path.isfile(os.path.join(record, d, "settings.json")))


def _rank(marker: dict[str, Any]) -> str:
    rank = marker.get("rank")
    return f"rank {rank}: " if rank is not None else ""

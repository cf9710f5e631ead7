"""``torchdoctor run --numerics``: the numerics monitor attached in every Python process of a command, no code change.

How it gets there: ``run`` puts :data:`BOOT_DIR` first on the command's ``PYTHONPATH`` and the monitor's options,
as JSON, in :data:`OPTIONS_VAR`. Every Python process started below it (``python train.py``, each ``torchrun``
rank, ``accelerate launch``, ``deepspeed``, ``srun``) inherits both and imports ``sitecustomize`` from
:data:`BOOT_DIR` at start-up (:mod:`site` does so for whatever is on ``sys.path``); that file chains to the
``sitecustomize`` it hides, and with :data:`OPTIONS_VAR` and :data:`FLIGHT_VAR` unset it imports nothing at all.
:data:`FLIGHT_VAR` (every ``torchdoctor run`` sets it, unless ``--no-flight``) installs :mod:`.flight` instead:
a distributed process writes its Flight Recorder dump as it ends badly.

What it attaches to (:mod:`.startup`): the HF ``Trainer`` (the callback added), Lightning's ``Trainer`` (its
callback added), the engine ``deepspeed.initialize`` returns, or in a plain loop the model whose parameters the
first stepped torch optimizer holds (:mod:`.plain`: torch's global optimizer step hook, no patching of user code),
before that first update is applied. This module imports neither torch nor the rest of torchdoctor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from . import markers

#: the folder holding the bootstrap ``sitecustomize.py`` (and nothing else importable)
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
#: the monitor's options for the processes of the command, as JSON (``report_dir``, ``grads``, ``trace_steps``,
#: ``abort_after_step``), with ``path``: where the ``torchdoctor`` package can be imported from; or ``1``: the
#: defaults, reports in ``$TORCHDOCTOR_REPORT_DIR`` (else the working directory) -- a value one can write by hand
OPTIONS_VAR = "TORCHDOCTOR_NUMERICS"
#: ``torchdoctor run``'s flight hook (:mod:`.flight`), as JSON: ``report_dir`` and ``path``
FLIGHT_VAR = "TORCHDOCTOR_FLIGHT"

__all__ = ["BOOT_DIR", "FLIGHT_VAR", "OPTIONS_VAR", "child_environment", "markers", "package_parent"]


def package_parent() -> str:
    """The folder the ``torchdoctor`` package is imported from (for a bootstrap in a process that lacks it)."""
    here = os.path.dirname(os.path.abspath(__file__))  # .../torchdoctor/run/inside
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))


def child_environment(options: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the bootstrap switched on for ``options``: :data:`BOOT_DIR` first on ``PYTHONPATH`` (once) and
    :data:`OPTIONS_VAR` set."""
    out = dict(env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != BOOT_DIR]
    out["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *parts])
    # markers: `run` reads them back (and removes them); a switch written by hand leaves none
    out[OPTIONS_VAR] = json.dumps({**options, "path": package_parent(), "markers": True}, sort_keys=True)
    return out

"""torchdoctor's start-up hook for ``torchdoctor run``: on ``PYTHONPATH`` only while such a run goes on.

With ``TORCHDOCTOR_FLIGHT`` set it installs ``torchdoctor.autoattach.flight`` (a distributed process dumps its
Flight Recorder records as it ends badly). With ``TORCHDOCTOR_NUMERICS`` set (to ``run``'s JSON options, or to
``1`` for the defaults), it installs ``torchdoctor.autoattach.startup`` (import hooks, nothing heavy). Either way it
then runs the ``sitecustomize`` it hides on ``sys.path`` (a distribution's, a virtual environment's, the user's),
whose errors Python reports as it would have. Nothing of torchdoctor's own ever stops the process: it says so in
one line and the program runs without it.
"""

import os as _os
import sys as _sys


def _torchdoctor_start() -> None:
    raw = _os.environ.get("TORCHDOCTOR_NUMERICS", "").strip()
    if raw in ("", "0"):
        return
    try:
        import importlib.util
        import json

        options = json.loads(raw) if raw.startswith("{") else {}  # "1": the defaults (a hand-written switch)
        if importlib.util.find_spec("torchdoctor") is None and options.get("path"):
            _sys.path.append(options["path"])  # the torchdoctor that started the run
        from torchdoctor.autoattach import startup

        startup.install(options)
    except Exception as e:  # (never the program's failure)
        _sys.stderr.write(f"[torchdoctor] --numerics is off in this process: {type(e).__name__}: {e}\n")


def _torchdoctor_flight() -> None:
    raw = _os.environ.get("TORCHDOCTOR_FLIGHT", "").strip()
    if not raw.startswith("{"):
        return
    try:
        import importlib.util
        import json

        options = json.loads(raw)
        if importlib.util.find_spec("torchdoctor") is None and options.get("path"):
            _sys.path.append(options["path"])
        from torchdoctor.autoattach import flight

        flight.install(options)
    except Exception as e:  # (never the program's failure)
        _sys.stderr.write(f"[torchdoctor] the flight recorder hook is off in this process: {type(e).__name__}: {e}\n")


def _hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = _os.path.realpath(_os.path.dirname(_os.path.abspath(__file__)))
    rest = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    _sys.modules["sitecustomize"] = module  # as if it had been the one found
    spec.loader.exec_module(module)


_torchdoctor_start()
_torchdoctor_flight()
_hidden_sitecustomize()

"""torchdoctor's start-up hook for ``torchdoctor run``: on ``PYTHONPATH`` only while such a run goes on.

With ``TORCHDOCTOR_FLIGHT`` set it installs ``torchdoctor.run.inside.flight`` (a distributed process dumps its
Flight Recorder records as it ends badly). With ``TORCHDOCTOR_NUMERICS`` set (to ``run``'s JSON options, or to
``1`` for the defaults), it installs ``torchdoctor.run.inside.startup`` (import hooks, nothing heavy). Either way it
then runs the ``sitecustomize`` it hides on ``sys.path`` (a distribution's, a virtual environment's, the user's),
whose errors Python reports as it would have. Nothing of torchdoctor's own ever stops the process: it says so in
one line and the program runs without it.
"""

import os as _os
import sys as _sys


def _torchdoctor_start(var: str, module: str, what: str, defaults: bool) -> None:
    """Install ``torchdoctor.run.inside.<module>`` with the JSON options in ``$var`` (``defaults``: ``1`` stands for
    the defaults, a hand-written switch); unset, ``0`` or empty: nothing at all."""
    raw = _os.environ.get(var, "").strip()
    if raw in ("", "0") or not (raw.startswith("{") or defaults):
        return
    try:
        import importlib
        import importlib.util
        import json

        options = json.loads(raw) if raw.startswith("{") else {}
        if importlib.util.find_spec("torchdoctor") is None and options.get("path"):
            _sys.path.append(options["path"])  # the torchdoctor that started the run
        importlib.import_module(f"torchdoctor.run.inside.{module}").install(options)
    except Exception as e:  # (never the program's failure)
        _sys.stderr.write(f"[torchdoctor] {what} is off in this process: {type(e).__name__}: {e}\n")


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


_torchdoctor_start("TORCHDOCTOR_NUMERICS", "startup", "--numerics", defaults=True)
_torchdoctor_start("TORCHDOCTOR_FLIGHT", "flight", "the flight recorder hook", defaults=False)
_hidden_sitecustomize()

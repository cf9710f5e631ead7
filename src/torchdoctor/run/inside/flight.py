"""``torchdoctor run``'s flight hook: when a distributed job ends badly, each rank writes where it was.

Installed at start-up by the bootstrap (``TORCHDOCTOR_FLIGHT``) in every Python process of the command, it does
nothing until the process calls ``torch.distributed.init_process_group`` (an import hook wraps it: a job that is not
distributed is never touched). From then on, in that process: an exception that ends it, or a ``SIGTERM`` /
``SIGINT`` (what ``torchrun`` sends the other ranks when one fails, and what ``run`` forwards), first writes
``torchdoctor-flight-rank<r>.json`` into the run's report folder -- the Flight Recorder dump of this rank (every
collective it entered: sequence id, op, sizes, dtypes, state, the Python stack of each call), the Python stack it
was at (the exception's, or the main thread's when the signal came), host, pid and why -- then lets the exception
or the signal do what it would have done (the previous handler, or the default: the process ends by that signal).
A dump is written once per process; nothing here ever stops the program.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from .imports import when_imported

_state: dict[str, Any] = {"dir": None, "written": False, "armed": False, "busy": False, "pending": None}


def install(options: dict[str, Any]) -> None:
    """Arm the hook for this process: wrap ``init_process_group`` when ``torch.distributed`` is imported."""
    _state["dir"] = options.get("report_dir") or os.getcwd()
    when_imported("torch.distributed.distributed_c10d", _wrap_init)


def _wrap_init(module: Any) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_torchdoctor_flight", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _arm()
        return result

    init_process_group._torchdoctor_flight = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group


def _arm() -> None:
    """The process is distributed now: dump on an exception that ends it, and on SIGTERM / SIGINT (main thread)."""
    if _state["armed"]:
        return
    _state["armed"] = True
    previous_hook = sys.excepthook

    def on_exception(exc_type: Any, exc: Any, tb: Any) -> None:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        _state["busy"] = True  # a SIGTERM now (torchrun stopping every rank) waits for the dump and the traceback
        try:
            _dump(f"exception: {exc_type.__name__}: {first}", traceback.extract_tb(tb))
            previous_hook(exc_type, exc, tb)
        finally:
            _state["busy"] = False
            pending, _state["pending"] = _state["pending"], None
            if pending is not None:
                _on_signal(*pending)

    sys.excepthook = on_exception
    if threading.current_thread() is not threading.main_thread():
        return  # (signal handlers can only be set from the main thread)
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(sig)
            signal.signal(sig, functools.partial(_on_signal, previous))
        except (ValueError, OSError, TypeError):
            pass


def _on_signal(previous: Any, signum: int, frame: Any) -> None:
    if _state["busy"]:  # the signal came while a dump was being written (torchrun's SIGTERM right after the
        _state["pending"] = (previous, signum, frame)  # exception): it takes effect once the dump is whole
        return
    _state["busy"] = True
    try:
        _dump(signal.Signals(signum).name, traceback.extract_stack(frame) if frame is not None else [])
    finally:
        _state["busy"] = False
        _state["pending"] = None  # (a second signal during this one's dump: this one's ending stands)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)  # the default: end by this signal, as without the hook
    os.kill(os.getpid(), signum)


def _fr_dump() -> Any:
    """This process's Flight Recorder records (stacks included), as plain data; None where torch has none."""
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace(True, True, False)
    except Exception:  # (no Flight Recorder in this torch, or nothing recorded)
        return None
    from ...comm.hang.dumps import plain_loads

    return plain_loads(raw)


def _dump(reason: str, stack: Any) -> None:
    if _state["written"] or _state["dir"] is None:
        return
    _state["written"] = True
    _write(reason, stack)


def _write(reason: str, stack: Any) -> None:
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        doc = {
            "torchdoctor_flight": 1, "rank": rank, "world_size": world, "host": socket.gethostname(),
            "pid": os.getpid(), "time": time.time(), "reason": reason,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID") or
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}",
            "stack": [[f.filename, f.lineno, f.name] for f in stack],
            "fr": _fr_dump(),
        }
        folder = _state["dir"]
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"torchdoctor-flight-rank{rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, default=str)
        os.replace(tmp, path)
    except Exception as e:  # (never the program's failure)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"[torchdoctor] the flight dump was not written: {type(e).__name__}: {e}\n")

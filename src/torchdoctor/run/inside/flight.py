"""``torchdoctor run``'s flight hook: a distributed process says where it is while it runs and where it was as it ends.

Installed at start-up by the bootstrap (``TORCHDOCTOR_FLIGHT``) in every Python process of the command, it does
nothing until the process calls ``torch.distributed.init_process_group`` (an import hook wraps it: a job that is not
distributed is never touched). Then, in that process:

* before the call, what it asked for (backend, rank, world size, address and port, the call's stack) goes into its
  status file (:mod:`.status`), so a rank stuck in ``init_process_group`` -- another world size, another port -- is
  known while it is stuck; after it, a thread (:mod:`.beat`) keeps that file current: the collectives entered and
  completed, where the main thread is; it answers ``run``'s dump requests;
* an exception that ends it, or a ``SIGTERM`` / ``SIGINT`` (what ``torchrun`` sends the other ranks when one fails,
  and what ``run`` forwards), first writes ``torchdoctor-flight-rank<r>.json`` into the run's report folder -- the
  Flight Recorder dump of this rank (every collective it entered: sequence id, op, sizes, dtypes, state; no
  per-entry stacks: symbolizing them imports most of torch, seconds per rank), the Python stack it was at (the
  exception's, or the main thread's when the signal came), host, pid and why -- then lets the exception or the signal
  do what it would have done (the previous handler, or the default: the process ends by that signal);
* its exit (code, or the exception or signal) and when it entered each collective go into its status file as it ends.

A dump is written once per process; nothing here ever stops the program.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from . import status
from .imports import when_imported

_state: dict[str, Any] = {"dir": None, "written": False, "armed": False, "busy": False, "pending": None,
                          "beat": None, "pid": None, "period": 1.0, "exit_code": None}
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS")


def install(options: dict[str, Any]) -> None:
    """Arm the hook for this process: wrap ``init_process_group`` when ``torch.distributed`` is imported."""
    _state["dir"] = options.get("report_dir") or os.getcwd()
    with contextlib.suppress(TypeError, ValueError):
        _state["period"] = float(options.get("period", 1.0))
    when_imported("torch.distributed.distributed_c10d", _wrap_init)


def _mine() -> bool:
    """This is the process that armed the hook (a forked child -- a DataLoader worker -- is left alone)."""
    return _state["pid"] == os.getpid()


def _wrap_init(module: Any) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_torchdoctor_flight", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        _init_begin(module, original, args, kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as e:
            _init_end(error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")
            raise
        _init_end()
        _arm()
        return result

    init_process_group._torchdoctor_flight = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    destroy = getattr(module, "destroy_process_group", None)
    if destroy is not None and not getattr(destroy, "_torchdoctor_flight", False):

        @functools.wraps(destroy)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            if not args and kwargs.get("group") is None and _mine():  # the job's own end: where it was called
                _state["left_at"] = status.user_frames(traceback.extract_stack()[:-1])
            return destroy(*args, **kwargs)

        destroy_process_group._torchdoctor_flight = True  # type: ignore[attr-defined]
        module.destroy_process_group = destroy_process_group


def _beat() -> Any:
    if _state["beat"] is None or not _mine():
        from .beat import Beat

        _state["pid"] = os.getpid()
        _state["beat"] = Beat(_state["dir"], _state["period"], _dump)
    return _state["beat"]


def _init_begin(module: Any, original: Any, args: tuple, kwargs: dict) -> None:
    try:
        try:
            bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
        except (TypeError, ValueError):
            bound = dict(kwargs)
        timeout = bound.get("timeout")
        backend = bound.get("backend")
        if timeout is None:
            default = getattr(module, "default_pg_nccl_timeout", None) if "nccl" in str(backend or "") else None
            timeout = default or getattr(module, "default_pg_timeout", None)
        rank, world = bound.get("rank", -1), bound.get("world_size", -1)
        init = {"t": time.time(), "backend": None if backend is None else str(backend),
                "init_method": None if bound.get("init_method") is None else str(bound.get("init_method")),
                "rank": rank if isinstance(rank, int) else None,
                "world_size": world if isinstance(world, int) else None,
                "store": bound.get("store") is not None,
                "timeout_s": timeout.total_seconds() if hasattr(timeout, "total_seconds") else None,
                "env": {k: os.environ[k] for k in _ENV if k in os.environ},
                "stack": status.user_frames(traceback.extract_stack()[:-2]), "done": None, "error": None}
        _beat().set(init=init)
    except Exception as e:  # noqa: BLE001 -- (never the program's failure)
        _say(f"the start of init_process_group was not recorded: {type(e).__name__}: {e}")


def _init_end(error: str | None = None) -> None:
    beat = _state["beat"]
    if beat is None:
        return
    try:
        init = dict(beat.doc.get("init") or {})
        init.update(done=time.time(), error=error)
        parts: dict[str, Any] = {"init": init}
        if error is None:
            import torch.distributed as dist

            parts.update(rank=dist.get_rank(), world=dist.get_world_size())
        beat.set(**parts)
    except Exception as e:  # noqa: BLE001
        _say(f"the end of init_process_group was not recorded: {type(e).__name__}: {e}")


def _arm() -> None:
    """The process is distributed now: its heartbeat; a dump on an exception that ends it, and on SIGTERM / SIGINT
    (main thread); its exit recorded."""
    if _state["armed"] and _mine():
        return
    _state["armed"] = True
    beat = _beat()
    previous_hook = sys.excepthook

    def on_exception(exc_type: Any, exc: Any, tb: Any) -> None:
        if not _mine():
            previous_hook(exc_type, exc, tb)
            return
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        _state["busy"] = True  # a SIGTERM now (torchrun stopping every rank) waits for the dump and the traceback
        try:
            stack = traceback.extract_tb(tb)
            _dump(f"exception: {exc_type.__name__}: {first}", stack)
            beat.end("exception", error=f"{exc_type.__name__}: {first}", stack=status.user_frames(stack))
            previous_hook(exc_type, exc, tb)
        finally:
            _state["busy"] = False
            pending, _state["pending"] = _state["pending"], None
            if pending is not None:
                _on_signal(*pending)

    sys.excepthook = on_exception
    _wrap_exit()
    atexit.register(_at_exit)
    with contextlib.suppress(AttributeError, ValueError):
        os.register_at_fork(after_in_child=_forked)
    if threading.current_thread() is threading.main_thread():  # (signal handlers can only be set from there)
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous = signal.getsignal(sig)
                signal.signal(sig, functools.partial(_on_signal, previous))
            except (ValueError, OSError, TypeError):
                pass
    beat.start()


def _forked() -> None:
    """A child forked from this rank (a DataLoader worker): not the rank -- no wakeup fd shared with it."""
    with contextlib.suppress(ValueError, OSError):
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)


def _wrap_exit() -> None:
    original = sys.exit
    if getattr(original, "_torchdoctor_flight", False):
        return

    def exit(status_code: Any = None) -> None:  # noqa: A001 -- sys.exit's own name
        if _mine():
            _state["exit_code"] = 0 if status_code is None else status_code if isinstance(status_code, int) else 1
            _state["left_at"] = status.user_frames(traceback.extract_stack()[:-1])
        original(status_code)

    exit._torchdoctor_flight = True  # type: ignore[attr-defined]
    sys.exit = exit


def _at_exit() -> None:
    beat = _state["beat"]
    if beat is None or not _mine():
        return
    try:  # (a signal now -- the launcher ending the job -- only cuts this short)
        beat.close()
        from .beat import timing

        beat.end("exit", code=_state["exit_code"] if _state["exit_code"] is not None else 0,
                 stack=_state.get("left_at") or [])
        beat.set(timing=timing())
    except BaseException:  # noqa: BLE001, S110
        pass


def _on_signal(previous: Any, signum: int, frame: Any) -> None:
    if not _mine():
        _chain(previous, signum, frame)
        return
    beat = _state["beat"]
    if beat is not None:
        beat.handled[signum] += 1
    if _state["busy"]:  # the signal came while a dump was being written (torchrun's SIGTERM right after the
        _state["pending"] = (previous, signum, frame)  # exception): it takes effect once the dump is whole
        return
    _state["busy"] = True
    try:
        stack = traceback.extract_stack(frame) if frame is not None else []
        _dump(signal.Signals(signum).name, stack)
        if beat is not None:
            beat.end("signal", signal=signal.Signals(signum).name, stack=status.user_frames(stack))
    finally:
        _state["busy"] = False
        _state["pending"] = None  # (a second signal during this one's dump: this one's ending stands)
    _chain(previous, signum, frame)


def _chain(previous: Any, signum: int, frame: Any) -> None:
    if previous is signal.default_int_handler:  # Python's own Ctrl-C: raised where the program was, not in here
        signal.signal(signum, previous)
        os.kill(os.getpid(), signum)
        return
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)  # the default: end by this signal, as without the hook
    os.kill(os.getpid(), signum)


def _fr_dump() -> Any:
    """This process's Flight Recorder records (no per-entry stacks), as plain data; None where torch has none."""
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace(True, False, False)
    except Exception:  # (no Flight Recorder in this torch, or nothing recorded)
        return None
    from ...comm.hang.dumps import plain_loads

    return plain_loads(raw)


def _dump(reason: str, stack: Any) -> None:
    if _state["written"] or _state["dir"] is None or not _mine():
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
            "torchdoctor_flight": 1, "rank": rank, "world_size": world, "host": status.host(),
            "pid": os.getpid(), "time": time.time(), "reason": reason,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID") or
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}",
            "stack": [[f[0], f[1], f[2]] for f in stack],
            "fr": _fr_dump(),
        }
        status.write_json(os.path.join(_state["dir"], f"torchdoctor-flight-rank{rank}.json"), doc)
    except Exception as e:  # (never the program's failure)
        _say(f"the flight dump was not written: {type(e).__name__}: {e}")


def _say(msg: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"[torchdoctor] {msg}\n")

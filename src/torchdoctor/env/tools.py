"""Running the probe's external tools: each with a timeout, in its own session, never a crash.

A missing or stuck tool becomes a note in the probe's :class:`_Errors` (``probe_errors`` in the facts) naming
the tool; a tool that runs past its time is killed with everything it started. Which tools are running right
now is kept too (:func:`running`), so that ``torchdoctor env`` can say what a slow probe is waiting for.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

TOOL_TIMEOUT_S = 5.0  # one tool's limit

_RUNNING: dict[int, tuple[float, str]] = {}  # what the probes of this process wait for now: id -> (start, what)
_RUNNING_LOCK = threading.Lock()
_RUNNING_IDS = itertools.count()


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark ``what`` (a tool's command line, "import torch") as running for the length of the block."""
    key = next(_RUNNING_IDS)
    with _RUNNING_LOCK:
        _RUNNING[key] = (time.monotonic(), what)
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            del _RUNNING[key]


def running() -> list[str]:
    """What is running now, the longest-running first (the likeliest to be the one stuck)."""
    with _RUNNING_LOCK:
        return [what for _, what in sorted(_RUNNING.values(), key=lambda v: v[0])]


class _Errors(list):
    """The probe's notes (tools that failed or hung), plus its deadline for external tools and its memo of tool
    answers (one ``nvcc --version`` per nvcc, however many ways it was found). Safe to share between threads."""

    def __init__(self, deadline: float | None = None, tool_timeout: float | None = None):
        super().__init__()
        self.deadline = deadline  # time.monotonic() by which every tool must have ended; None: per tool only
        self.tool_timeout = TOOL_TIMEOUT_S if tool_timeout is None else tool_timeout  # one tool's limit
        self._lock = threading.Lock()
        self._memo: dict[Any, Future] = {}

    def note(self, what: str) -> None:
        with self._lock:
            self.append(what)

    def time_for(self, timeout: float | None = None) -> float:
        """Seconds the next tool may run: its own limit, cut to what is left before the deadline."""
        t = self.tool_timeout if timeout is None else timeout
        return t if self.deadline is None else min(t, self.deadline - time.monotonic())

    def once(self, key: Any, fn: Callable[[], Any]) -> Any:
        """``fn()``, computed once per key; concurrent callers with the same key wait for the first."""
        with self._lock:
            fut = self._memo.get(key)
            mine = fut is None
            if mine:
                fut = self._memo[key] = Future()
        if mine:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
        return fut.result()


def _secs(t: float) -> str:
    return f"{t:.1f}".removesuffix(".0")


def _spawn(cmd: list[str], timeout: float, env: Mapping[str, str] | None = None,
           cwd: str | None = None) -> tuple[int | None, str, str]:
    """(returncode, stdout, stderr); returncode None when it ran past ``timeout``: then it and every process it
    started (its session's process group: a shell script's ``sleep`` too) are killed, and the output so far kept.

    The tool gets a temporary folder of its own (TMPDIR, TMP, TEMP), removed when it ends however it ends: what it
    leaves there -- nvcc's ``tmpxft_*`` files when its host compiler hangs and both are killed -- goes with it."""
    with tempfile.TemporaryDirectory(prefix="torchdoctor-tool-") as tmp:
        own = {**(os.environ if env is None else env), "TMPDIR": tmp, "TMP": tmp, "TEMP": tmp}
        return _spawn_in(cmd, timeout, own, cwd)


def _spawn_in(cmd: list[str], timeout: float, env: dict[str, str], cwd: str | None) -> tuple[int | None, str, str]:
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        p.kill()
    try:
        out, err = p.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:  # something left the group and still holds the pipes: stop reading
        out = err = ""
        for f in (p.stdout, p.stderr):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=1.0)
    return None, out or "", err or ""


def _run(cmd: list[str], errors: _Errors, timeout: float | None = None, env: Mapping[str, str] | None = None,
         cwd: str | None = None, shown: str | None = None) -> tuple[tuple[int, str, str] | None, str | None]:
    """(result or None, why not: "missing" | "hung: ..." | "no time" | "failed")."""
    shown = shown or shlex.join(cmd)
    t = errors.time_for(timeout) if isinstance(errors, _Errors) else (TOOL_TIMEOUT_S if timeout is None else timeout)
    if t <= 0.05:
        errors.note(f"`{shown}` not run: the probe's deadline for tools had passed (a tool above hung)")
        return None, "no time"
    try:
        with busy(shown):
            rc, out, err = _spawn(cmd, t, env, cwd)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        errors.note(f"`{shown}` failed: {e}")
        return None, "failed"
    if rc is None:
        errors.note(f"`{shown}` hung: no answer within {_secs(t)} s; killed it and the processes it started")
        return None, f"hung: no answer within {_secs(t)} s"
    return (rc, out, err), None


def run(cmd: list[str], errors: _Errors, timeout: float | None = None, env: Mapping[str, str] | None = None,
        cwd: str | None = None, shown: str | None = None):
    """(returncode, stdout, stderr), or None when the tool is missing, failed or hung (noted in ``errors``)."""
    return _run(cmd, errors, timeout, env, cwd, shown)[0]


def _real(path: str) -> str:
    return os.path.realpath(path)


def _is_exe(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)

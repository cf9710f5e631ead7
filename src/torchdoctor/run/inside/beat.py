"""A distributed process's heartbeat for ``torchdoctor run``: a thread that says, every ``period`` seconds, how far this
rank got (Flight Recorder's collective counters per process group) and where its main thread is, answers ``run``'s
dump requests, and ends the process on a signal its main thread cannot take.

Why a thread: a rank waiting in a collective is blocked in C++ (the GIL released), so nothing in its main thread runs --
not a Python signal handler, not a dump. This thread still runs there: it reads the main thread's frame
(``sys._current_frames``) and the recorder's counters (``_dump_fr_trace`` without entries: microseconds), and it
writes the status file (:mod:`.status`) that ``run`` reads to tell progress from a hang.

Signals: a Python handler only runs when the main thread gets back to the interpreter, so a ``SIGTERM`` (torchrun
ending the ranks after one failed) or ``SIGINT`` sent to a rank blocked in a collective would wait for the collective's
timeout (minutes), and torchrun would SIGKILL it after its grace period, leaving no dump. The thread is woken by the
signal (``signal.set_wakeup_fd``, only where the program has none of its own); when the main thread has not taken the
signal within a second *and* is inside ``torch.distributed``, the thread writes the dump with the main thread's stack
and ends the process by that signal's default action, as it would have ended without the hook.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import status

_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
MAX_SAMPLE_SITES = 30  # distinct places kept in the samples (the most frequent)
SIGNAL_GRACE_S = 1.0  # how long the main thread has to take a signal itself


def main_stack(limit: int = 40) -> list[list]:
    """The main thread's stack now ((file, line, function), innermost last). Read from the frames alone: no source
    line is looked up (each lookup stats a file, and every system call hands the GIL back to a main thread that may
    hold it for up to the switch interval -- the beat must stay punctual beside a busy main thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    out: list[list] = []
    while frame is not None and len(out) < limit:
        out.append([frame.f_code.co_filename, frame.f_lineno or 0, frame.f_code.co_name])
        frame = frame.f_back
    out.reverse()
    return out


def in_distributed(stack: list) -> bool:
    return any(_TORCH_DIST in str(f[0]) for f in stack[-12:])


_HOST_BACKENDS = {"gloo", "mpi"}
_DEVICE_TYPES = {"cpu", "cuda", "xpu", "hpu", "mps", "npu", "meta"}  # ("cpu:gloo,cuda:nccl" names both)
_host_backend: list[bool] = []  # the default group's answer, once known


def host_backend() -> bool:
    """Does the default process group run on the host only (gloo, mpi -- no device backend beside it)?"""
    if not _host_backend:
        try:
            import torch.distributed as dist

            if not dist.is_initialized():
                return False
            names = set(str(dist.get_backend()).lower().replace(":", ",").split(",")) - _DEVICE_TYPES - {""}
        except Exception:  # noqa: BLE001 -- (never the program's failure)
            return False
        _host_backend.append(bool(names) and names <= _HOST_BACKENDS)
    return _host_backend[0]


def fr_counters() -> dict[str, list[int]] | None:
    """Per process group: [last enqueued, last started, last completed] collective, from Flight Recorder's status;
    None where the recorder is off or absent (no counters)."""
    try:
        import pickle

        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace(False, False, False)
        doc = pickle.loads(raw) if raw else {}
    except Exception:  # noqa: BLE001 -- (no recorder in this torch)
        return None
    groups = doc.get("pg_status") if isinstance(doc, dict) else None
    if not groups:
        return None
    return {str(name): [int(s.get(k, -1)) for k in ("last_enqueued_collective", "last_started_collective",
                                                    "last_completed_collective")]
            for name, s in groups.items() if isinstance(s, dict)}


def timing() -> dict[str, list[list]]:
    """When this rank entered each collective the recorder still holds: group -> [[seq, ns, op], ...]."""
    try:
        import pickle

        import torch

        doc = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
    except Exception:  # noqa: BLE001
        return {}
    out: dict[str, list[list]] = {}
    for e in doc.get("entries") or ():
        if not isinstance(e, dict) or e.get("is_p2p") or not isinstance(e.get("collective_seq_id"), int):
            continue
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "0"))
        op = str(e.get("profiling_name") or "?").rpartition(":")[2]
        out.setdefault(name, []).append([e["collective_seq_id"], int(e.get("time_created_ns") or 0), op])
    return out


class Beat:
    """The status file of this process and the thread that keeps it current."""

    def __init__(self, report_dir: str, period: float, dump: Callable[[str, list], None]) -> None:
        self.path = status.path_for(report_dir)
        self.request_path = os.path.join(report_dir, status.REQUEST)
        self.period = max(0.05, float(period))
        self.dump = dump  # writes torchdoctor-flight-rank<r>.json (reason, stack)
        self.doc: dict[str, Any] = {"v": 1, "host": status.host(), "pid": os.getpid(), "ppid": os.getppid()}
        self.lock = threading.Lock()
        self.samples: collections.Counter = collections.Counter()
        self.n_samples = 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.request_seen: tuple | None = None
        self.wake_r: int | None = None
        self.handled: collections.Counter = collections.Counter()  # signals the main thread took itself
        self.woken: collections.Counter = collections.Counter()  # signals this thread was woken by

    # -- the document
    def set(self, **parts: Any) -> None:
        with self.lock:
            self.doc.update(parts)
            with contextlib.suppress(OSError, TypeError, ValueError):
                status.write_json(self.path, self.doc)

    def end(self, how: str, **facts: Any) -> None:
        """How the process ends, as Python saw it (the first word stands: an exception, then the exit it causes)."""
        if "end" in self.doc:
            return
        self.set(end={"how": how, "t": time.time(), **facts})

    # -- the thread
    def start(self) -> None:
        if self.thread is not None:
            return
        self._wakeup()
        self.thread = threading.Thread(target=self._run, name="torchdoctor-beat", daemon=True)
        self.thread.start()

    def close(self, timeout: float = 1.0) -> None:
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _wakeup(self) -> None:
        """Be woken by signals (the main thread only; never where the program set its own wakeup fd)."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            os.set_blocking(r, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError, TypeError):
            return
        if old != -1:  # the program's own (asyncio's): give it back, go without
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self.wake_r = r

    def _run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):  # (never the program's failure)
                self.tick()
            if self.wake_r is None:
                self.stop.wait(self.period)
                continue
            try:
                ready, _, _ = select.select([self.wake_r], [], [], self.period)
            except (OSError, ValueError):
                self.wake_r = None
                continue
            if ready:
                with contextlib.suppress(OSError):
                    for signum in os.read(self.wake_r, 64):
                        self._signal(signum)

    def tick(self) -> None:
        stack = main_stack()
        groups = fr_counters()
        behind = bool(groups) and any(g[0] > g[2] for g in groups.values())
        # A host backend's collective holds the main thread in torch.distributed until it completes, so the stack
        # says it; its recorder's "last completed" lags (gloo's stayed 4 behind for seconds while the rank ran its own
        # code outside any collective, and run took that evaluation for a hang): "pending", and run tells a rank that
        # computes from one that waits (DDP's reducer under backward) by its CPU time. A device backend returns at once
        # and the main thread blocks later, anywhere (a CUDA sync in the user's line, perhaps spinning): the counters
        # say it is inside.
        inside = in_distributed(stack) or (behind and not host_backend())
        pending = behind and not inside
        if not inside and stack:
            from ...comm.hang.facts import user_site

            f = user_site(stack) or stack[-1]
            self.samples[(f[0], f[1], f[2])] += 1
            self.n_samples += 1
        top = [[*k, n] for k, n in self.samples.most_common(MAX_SAMPLE_SITES)]
        self.set(beat={"t": time.time(), "period": self.period, "groups": groups, "in_collective": inside,
                       "pending": pending, "stack": stack, "samples": top, "n_samples": self.n_samples})
        self._answer()

    def _answer(self) -> None:
        try:
            st = os.stat(self.request_path)
        except OSError:
            return
        key = (st.st_mtime_ns, st.st_size)
        if key == self.request_seen:
            return
        self.request_seen = key
        req = status.read_json(self.request_path) or {}
        rid = req.get("id")
        if rid is None or rid == self.doc.get("answered"):
            return
        self.dump(f"requested by torchdoctor run: {req.get('why') or 'a dump'}", main_stack())
        self.set(answered=rid)

    def _signal(self, signum: int) -> None:
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        self.woken[signum] += 1
        deadline = time.monotonic() + SIGNAL_GRACE_S
        while time.monotonic() < deadline:
            if self.handled[signum] >= self.woken[signum] or self.stop.is_set():
                return
            time.sleep(0.05)
        stack = main_stack()
        if not in_distributed(stack):
            return  # busy elsewhere: its own handler will run when it gets back
        name = signal.Signals(signum).name
        self.dump(f"{name} (the main thread was blocked in torch.distributed and could not take it)", stack)
        self.end("signal", signal=name, stack=stack, blocked=True)
        die(signum)


def die(signum: int) -> None:
    """End this process by ``signum``'s default action, from any thread (the C library's ``signal``: Python's own can
    only be called from the main thread)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(1.0)
    except Exception:  # noqa: BLE001
        pass
    os._exit(128 + signum)

"""The line handlers for crashes: Python tracebacks, faulthandler dumps, C++ ``terminate called``, the signal
messages shells print, CUDA runtime errors, the driver, Xid and ECC lines. Like :mod:`.handlers` they record facts
and judge nothing (:mod:`.judge_crash` does).

A traceback is followed rank by rank (torchrun prefixes every line with ``[rankN]:``, and ranks interleave): it is
*open* from its ``Traceback (most recent call last):`` while its frames keep coming (each within
``TB_GAP`` lines of the last), and ends at its exception line. The exception line is found by searching for
``patterns.EXC_NEEDLES`` only while a traceback is open (see :mod:`.scan`), so a log without tracebacks pays
nothing for it. A traceback printed right after another one's exception line (``During handling of the above
exception`` / ``The above exception was the direct cause``) is the same failure: it keeps the first one's
exception as its ``cause``.
"""

from __future__ import annotations

import re
from typing import Any

from . import patterns as P
from .common import HeadTail, add, clip
from .lines import ERROR_LEVELS, strip_prefixes

TB_GAP = 20                 # lines between two frames (or the last frame and the exception) of one traceback
TB_KEEP_HEAD, TB_KEEP_TAIL = 8, 24  # finished tracebacks kept: the first and the last
MAX_OPEN = 64               # tracebacks open at once (one per rank)

#: Path parts of code that is not the user's: installed packages, the standard library, frozen modules.
_LIBRARY_PARTS = ("site-packages", "dist-packages", "<frozen", "/lib/python", "\\lib\\", "\\Lib\\", "/lib64/python",
                  "/usr/lib/python", "<attrs generated", "<__array_function__", "/bin/", "\\Scripts\\")
#: The messages shells and strsignal print for a signal -> its number (Linux).
SIGNAL_WORDS = {"Segmentation fault": 11, "Bus error": 7, "Illegal instruction": 4, "Floating point exception": 8,
                "Aborted": 6, "Killed": 9, "Terminated": 15, "Interrupt": 2, "Hangup": 1, "Quit": 3,
                # zsh's words (lower case; "illegal hardware instruction", "abort")
                "segmentation fault": 11, "bus error": 7, "illegal instruction": 4, "illegal hardware instruction": 4,
                "floating point exception": 8, "abort": 6}
#: CUDA runtime messages -> the finding's kind (the first that is in the message wins).
#: cublasStatus_t (cublas_api.h): the numbers programs print for it
CUBLAS_STATUS = {1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED", 7: "CUBLAS_STATUS_INVALID_VALUE",
                 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                 13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                 15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}
CUDA_KINDS = (
    ("illegal memory access", "illegal-memory-access"), ("illegal address", "illegal-memory-access"),
    ("misaligned address", "illegal-memory-access"), ("unspecified launch failure", "illegal-memory-access"),
    ("illegal instruction", "illegal-memory-access"),
    ("no kernel image", "no-kernel-image"), ("device-side assert", "device-assert"),
    ("driver version is insufficient", "driver-too-old"), ("ECC", "ecc"),
)


_IPYTHON_MARK_RE = re.compile(r"-+>\s*(?P<ln>\d+)\s(?P<code>.*)")


def is_user_code(path: str) -> bool:
    """A frame in the user's own code (not site-packages, the standard library or a frozen module)."""
    return not any(part in path for part in _LIBRARY_PARTS)


def _plain(line: str) -> str:
    """A line read ahead of the scanner (which strips colours from the segments it hands out itself)."""
    return P.ANSI_RE.sub("", line) if "\x1b" in line else line


class CrashHandlers:
    """Mixin of :class:`~torchdoctor.logs.analyze.Analyzer`: crash facts."""

    def _init_crash(self) -> None:
        self._tb_open: dict[Any, dict] = {}     # rank -> the traceback whose frames are arriving
        self._tb_last: dict[Any, dict] = {}     # rank -> its last finished traceback (for chained ones)
        self._tbs = HeadTail(TB_KEEP_HEAD, TB_KEEP_TAIL)
        self._tb_n = 0
        self._cpp_pending: dict | None = None
        self._frame_pending: dict | None = None  # a frame whose code line is in the next buffer
        self._archs_pending = False
        self._cuda_errors: dict[str, dict] = {}  # kind -> {"count", "events": [...]}
        self._cuda_capability: dict | None = None
        self._driver_old: list[dict] = []
        self._device_asserts: list[dict] = []
        self._xids: list[dict] = []
        self._ecc: list[dict] = []
        self._exit_code: int | None = None      # the command's own exit status, when `run` knows it
        self._unknown = HeadTail(3, 3)          # error lines no rule knows (first and last), and how many
        self._unknown_n = 0

    # ------------------------------------------------------------------------------------------ tracebacks
    def _tb_close(self, rank: Any) -> None:
        tb = self._tb_open.pop(rank, None)
        if tb is not None:
            self._tbs.append(tb)
            self._tb_n += 1
            self._tb_last[rank] = tb

    def _tb_expire(self, lineno: int) -> None:
        """Close the tracebacks whose frames stopped coming (a log cut before the exception line)."""
        for rank in [r for r, tb in self._tb_open.items() if lineno - tb["last"] > TB_GAP]:
            self._tb_close(rank)

    def _new_tb(self, lineno: int, rank: Any, kind: str, exc: dict | None = None) -> dict:
        self._tb_close(rank)
        if len(self._tb_open) >= MAX_OPEN:
            self._tb_expire(1 << 62)
        tb = {"line": lineno, "rank": rank, "kind": kind, "frames": 0, "last": lineno, "user": None, "inner": None,
              "first_user": None, "exc": exc, "cause": None, "step": self._step, "chained": False}
        prev = self._tb_last.get(rank)
        if kind == "python" and prev is not None and prev["exc"] is not None and lineno - prev["exc"]["line"] <= 4:
            prev["chained"] = True  # "During handling of the above exception ..." / "... the direct cause of ..."
            tb["cause"] = prev["exc"] if prev["cause"] is None else prev["cause"]
            tb["first_user"] = prev["user"]
        self._tb_open[rank] = tb
        return tb

    def _on_traceback(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = self._rank(seg)
        if m["type"]:  # IPython's header: the exception's type now, its message at the end (often cut from a paste)
            exc = {"line": lineno, "type": m["type"], "msg": "", "text": self._quote(seg)}
            tb = self._new_tb(lineno, rank, "ipython", exc)
            self._event(lineno, "exception", seg)
            tb["frames"] = 1
        elif m["colon"]:
            self._new_tb(lineno, rank, "python")

    def _on_frame(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = self._rank(seg)
        tb = self._tb_open.get(rank)
        if tb is None or lineno - tb["last"] > TB_GAP:
            return  # a stack printed outside a traceback (a warning's), or one whose start is cut off
        frame = {"file": m["file"], "line": int(m["ln"] or 0), "func": m["fn"], "log_line": lineno, "code": None}
        if m.re is P.IPYTHON_FRAME_RE:  # the failing line is the one IPython marks with ---->, a few lines below
            for line in self._following(8) or ():
                mark = _IPYTHON_MARK_RE.match(line)
                if mark:
                    frame["line"], frame["code"] = int(mark["ln"]), clip(mark["code"].strip(), 160)
                    break
        else:
            nxt = self._following(1)
            if nxt is None:  # the code line is in the next buffer
                self._frame_pending = frame
            elif nxt:
                self._frame_code(frame, nxt[0])
        tb["frames"] += 1
        tb["last"] = lineno
        if tb["kind"] == "faulthandler":  # most recent call first: the innermost frame is the first one
            if tb["inner"] is None:
                tb["inner"] = frame
            if tb["user"] is None and is_user_code(frame["file"]):
                tb["user"] = frame
        else:
            tb["inner"] = frame
            if is_user_code(frame["file"]):
                tb["user"] = frame

    @staticmethod
    def _frame_code(frame: dict, line: str) -> None:
        code = strip_prefixes(_plain(line).strip()).text.strip()
        if code and not code.startswith(("File ", "^", "~")):
            frame["code"] = clip(code, 160)

    def _on_exc_line(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = self._rank(seg)
        tb = self._tb_open.get(rank)
        if tb is None or not tb["frames"] or lineno - tb["last"] > TB_GAP or seg[:1].isspace():
            return
        if tb["exc"] is not None and not (tb["kind"] == "ipython" and tb["exc"]["type"] == m["type"]):
            return  # IPython named the type in its header: the line that ends it carries the message
        tb["exc"] = {"line": lineno, "type": m["type"], "msg": clip(m["msg"] or "", 400), "text": self._quote(seg)}
        tb["step"] = self._step
        self._event(lineno, "exception", seg)
        self._tb_close(rank)

    def _on_fatal_python(self, m: re.Match, seg: str, lineno: int) -> None:
        """faulthandler: ``Fatal Python error: Segmentation fault``, then the stack, most recent call first."""
        rank = self._rank(seg)
        what = m["what"].strip()
        exc = {"line": lineno, "type": "Fatal Python error", "msg": clip(what, 200), "text": self._quote(seg)}
        self._new_tb(lineno, rank, "faulthandler", exc)
        sig = SIGNAL_WORDS.get(what)
        if sig is not None:
            self._exit(lineno, seg, -sig, "python faulthandler", rank=rank)

    def _on_cpp_terminate(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = self._rank(seg)
        tb = {"line": lineno, "rank": rank, "kind": "c++", "frames": 0, "last": lineno, "user": None, "inner": None,
              "first_user": None, "cause": None, "step": self._step, "chained": False,
              "exc": {"line": lineno, "type": m["type"], "msg": "", "text": self._quote(seg)}}
        self._tbs.append(tb)
        self._tb_n += 1
        self._event(lineno, "exception", seg)
        nxt = self._following(1)  # "  what():  <message>"
        if nxt is None:
            self._cpp_pending = tb
        elif nxt:
            self._cpp_what(tb, nxt[0])

    def _cpp_what(self, tb: dict, line: str) -> None:
        m = P.CPP_WHAT_RE.match(_plain(line).strip())
        if m:
            tb["exc"]["msg"] = clip(m["msg"], 400)

    def _finish_pending(self, buf: str, end: int) -> None:
        """A frame's code line, a C++ exception's ``what():``, the wheel's arch list: the first line of this buffer."""
        e = buf.find("\n", 0, min(end, 400))
        line = buf[: e if e >= 0 else min(end, 400)]
        if self._frame_pending is not None:
            frame, self._frame_pending = self._frame_pending, None
            self._frame_code(frame, line)
        if self._cpp_pending is not None:
            tb, self._cpp_pending = self._cpp_pending, None
            self._cpp_what(tb, line)
        if self._archs_pending:
            self._archs_pending = False
            self._cuda_archs(line)

    def _on_unknown_line(self, text: str, lineno: int) -> None:
        """A candidate line no rule took: kept when it reports an error in words no rule knows -- an exception line
        (``KeyError: 'losses'``), a logger's ERROR/FATAL level (``[ERROR]``, ``| ERROR |``, glog's ``F1204 ...``), an
        ``error:`` / ``FATAL`` label, glog's ``Check failed``, ``terminate called`` -- so a failed run is never
        clean."""
        level = self._line.level if text is self._line.text else None
        if level not in ERROR_LEVELS and not any(w in text for w in P.ERROR_WORDS):
            return  # most candidate lines: a rule's key without its message (NCCL INFO chatter)
        m = P.EXC_LINE_RE.match(text)
        if m is not None and not (m["msg"] and m["type"].endswith(P.ERROR_TYPE_ENDINGS)):
            m = None
        if m is None and level not in ERROR_LEVELS and not P.ERROR_LINE_RE.search(text):
            return
        self._unknown_n += 1
        kind = "exception" if m is not None else "error"
        self._unknown.append({"line": lineno, "step": self._step, "kind": kind, "level": level,
                              "type": m["type"] if m is not None else None, "text": self._quote(text)})

    # ------------------------------------------------------------------------------------- signals
    def _on_shell_signal(self, m: re.Match, seg: str, lineno: int) -> None:
        """``Segmentation fault (core dumped)``, ``script.sh: line 3: 123 Bus error  python x.py`` (bash, Slurm),
        ``zsh: segmentation fault  python x.py``."""
        if not (m["pid"] or m["core"] or m["zsh"] or not m["rest"].strip()):
            return  # "Aborted training ..." is a sentence, not a shell's report
        name = m["name"]
        sig = SIGNAL_WORDS.get(name) or SIGNAL_WORDS.get(name.lower()) or SIGNAL_WORDS[name.capitalize()]
        self._exit(lineno, seg, -sig, "shell", pid=int(m["pid"]) if m["pid"] else None)

    def _on_dataloader_killed(self, m: re.Match, seg: str, lineno: int) -> None:
        sig = SIGNAL_WORDS.get(m["name"].strip())
        if sig is not None:
            self._exit(lineno, seg, -sig, "DataLoader worker", pid=int(m["pid"]))

    # ----------------------------------------------------------------------------------------- CUDA
    def _cuda(self, kind: str, lineno: int, seg: str, msg: str, **extra: Any) -> None:
        d = self._cuda_errors.setdefault(kind, {"count": 0, "events": []})
        d["count"] += 1
        if d["count"] <= 16:
            self._event(lineno, "cuda-error", seg)
        add(d["events"], {"line": lineno, "step": self._step, "rank": self._rank(seg), "msg": clip(msg, 300),
                          "text": self._quote(seg), **extra}, 8)

    def _on_cuda_error(self, m: re.Match, seg: str, lineno: int) -> None:
        msg = next((m[g] for g in ("msg", "msg2", "msg3", "bare") if m[g] is not None), "")
        if msg.startswith("out of memory"):
            return  # memory.cuda-oom
        if "_STATUS_" in msg:
            return  # a cuBLAS / cuDNN status: _on_cuda_library
        kind = next((k for word, k in CUDA_KINDS if word in msg), "error")
        self._cuda(kind, lineno, seg, msg, code=m["code"] or m["code2"])

    def _on_cuda_library(self, m: re.Match, seg: str, lineno: int) -> None:
        """cuBLAS / cuDNN said a call failed: its status name (DeepSpeed's kernels print cuBLAS's number)."""
        status = m["status"] or CUBLAS_STATUS.get(int(m["code"]), f"cuBLAS status {m['code']}")
        self._cuda("library-error", lineno, seg, status, status=status)

    def _on_cuda_driver(self, m: re.Match, seg: str, lineno: int) -> None:
        if P.CUDA_ERROR_RE.search(seg):
            return  # the CUDA error rule records it (``CUDA error: CUDA driver version is insufficient ...``)
        self._cuda("driver-too-old", lineno, seg, m.group(0), found=m["found"])

    def _on_cuda_capability(self, m: re.Match, seg: str, lineno: int) -> None:
        if self._cuda_capability is None:
            self._cuda_capability = {"line": lineno, "capability": m["cap"],
                                     "arch_list": (m["archs"] or "").split(), "text": self._quote(seg)}
            self._event(lineno, "cuda-arch", seg)
            if not m["archs"]:  # torch prints them on the next line
                nxt = self._following(1)
                if nxt is None:
                    self._archs_pending = True
                elif nxt:
                    self._cuda_archs(nxt[0])

    def _cuda_archs(self, line: str) -> None:
        m = P.CUDA_ARCHS_RE.search(_plain(line))
        if m and self._cuda_capability is not None:
            self._cuda_capability["arch_list"] = m["archs"].split()
            self._cuda_capability["text"] += " / " + clip(line, 200)

    def _on_device_assert(self, m: re.Match, seg: str, lineno: int) -> None:
        if len(self._device_asserts) < 4 and not any(a["cond"] == m["cond"] for a in self._device_asserts):
            self._device_asserts.append({"line": lineno, "cond": m["cond"], "text": self._quote(seg)})

    def _on_xid(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "xid", seg)
        add(self._xids, {"line": lineno, "code": int(m["code"]), "pci": m["pci"], "detail": clip(m["rest"], 200),
                         "text": self._quote(seg)}, 8)

    def _on_ecc(self, m: re.Match, seg: str, lineno: int) -> None:
        if "CUDA error" in seg or "NVRM: Xid" in seg:
            return
        self._event(lineno, "ecc", seg)
        add(self._ecc, {"line": lineno, "text": self._quote(seg)}, 8)

"""Judging crashes: the run's final exception (``process.exception``); CUDA runtime errors are :mod:`.judge_cuda`'s.

A failed run is never "clean": its last traceback (or C++ ``terminate called``, or faulthandler dump) becomes
``process.exception`` with its exception line and the innermost frame in the user's own code. Which traceback:
launchers' own (torchrun's ``ChildFailedError``, ``CalledProcessError``) only say that a worker failed, so the
workers' come first; of those, the first of the last burst (ranks fail together; the first to fail is the root
cause) that training did not go on after. It is ``fail``, or ``info`` when another finding already explains it
(its exception line is a CUDA out-of-memory, NCCL, loss-scale, build line: see ``CAUSE_EVENTS``), or when the
command exited 0 (``torchdoctor run``: the program handled it).
"""

from __future__ import annotations

from ..findings import Finding
from . import patterns as P
from .common import at_step, clip
from .families import FAMILIES
from .lines import ERROR_LEVELS, strip_prefixes

#: Timeline events that name a cause: a traceback whose lines hold one is explained by that finding.
CAUSE_EVENTS = frozenset({
    "cuda-oom", "scale-min", "cuda-mismatch", "cuda-home", "compiler-error", "build-failed", "config-error",
    "cuda-error", "host-oom", "xid"}).union(*(f.CAUSE_EVENTS for f in FAMILIES))
LAUNCHER_TYPES = ("ChildFailedError", "CalledProcessError", "ProcessRaisedException", "ProcessExitedException",
                  "SystemExit")
#: Launcher code: a traceback whose innermost frame is here (and none in the user's code) is the launcher's.
LAUNCHER_FILES = ("torch/distributed/run.py", "torch/distributed/launcher/", "torch/distributed/elastic/",
                  "deepspeed/launcher/", "accelerate/commands/")
BURST_LINES = 300  # tracebacks this close to the last one are one failure seen by several ranks

#: Exception types / messages -> the first thing to try (matched on "Type: message").
EXCEPTION_HINTS = (
    (("ModuleNotFoundError", "ImportError"), "a package is missing or was built for another torch/Python: install it "
     "with the interpreter that runs the job (python -m pip install ...); `torchdoctor env` shows torch, CUDA and "
     "the compilers extensions are built with"),
    (("Expected all tensors to be on the same device",), "a tensor is on another device than the model: move the "
     "batch with the model (batch = batch.to(device)) and create new tensors with device=x.device"),
    (("shapes cannot be multiplied", "size mismatch", "must match the size of tensor"), "a shape mismatch: print the "
     "shapes going into the frame's line; a layer's in_features must equal the input's last dimension"),
    (("does not require grad and does not have a grad_fn",), "the loss is not connected to the parameters: no "
     "torch.no_grad()/detach()/.item() on the way to it, and the trainable parameters need requires_grad=True"),
    (("backward through the graph a second time",), "a tensor from the previous step's graph is reused: detach() "
     "carried state (RNN hidden states, EMA targets), or backward(retain_graph=True) if it is meant"),
    (("modified by an inplace operation",), "an in-place op overwrote a value autograd needs: "
     "torch.autograd.set_detect_anomaly(True) names the forward op; replace x += y by x = x + y, inplace=True by "
     "inplace=False"),
    (("FileNotFoundError", "No such file or directory"), "a path does not exist where the job runs: relative paths "
     "resolve against the working directory of each rank (and node)"),
    (("KeyboardInterrupt",), "the run was interrupted (Ctrl-C, or SIGINT from a launcher or scheduler)"),
)


def _is_launcher(t: dict) -> bool:
    if t["exc"] is not None and t["exc"]["type"].endswith(LAUNCHER_TYPES):
        return True
    inner = t["inner"]
    return t["user"] is None and inner is not None and any(p in inner["file"].replace("\\", "/")
                                                          for p in LAUNCHER_FILES)


def _where(frame: dict | None) -> str:
    return f"{frame['file']}:{frame['line']} in {frame['func']}" if frame else ""


def _frame_line(label: str, frame: dict) -> str:
    code = f": `{frame['code']}`" if frame.get("code") else ""
    return (f"{label}: File \"{frame['file']}\", line {frame['line']}, in {frame['func']}{code} "
            f"(log line {frame['log_line']})")


def _exc_text(exc: dict, n: int = 400) -> str:
    msg = exc.get("msg") or ""
    if len(msg) > n:
        msg = msg[: n - 3] + "..."
    return f"{exc['type']}: {msg}" if msg else exc["type"]


# findings that say only how a process ended, not why
_GENERIC_EXITS = ("process.exit-code", "process.exit")


class CrashJudge:
    """Mixin: ``_judge_cuda`` and ``_judge_exception``."""

    def set_exit(self, code: int | None) -> None:
        """The command's exit status (``torchdoctor run``): 0 makes a traceback in its output one it handled."""
        self._exit_code = code

    def _explained(self, tb: dict) -> str | None:
        lo, hi = tb["line"], tb["exc"]["line"] + 4 if tb["exc"] else tb["last"] + 4
        for e in self._timeline.items():
            if lo <= e["line"] <= hi and e["event"] in CAUSE_EVENTS:
                return e["event"]
        return None

    def _progressed(self, tb: dict) -> bool:
        """Did training go on after it (a later step than the one it happened at)?"""
        return self._step is not None and (tb["step"] is None or self._step > tb["step"])

    def _judge_exception(self, others: list[Finding]) -> list[Finding]:
        tbs = [t for t in self._tbs.items() if not t["chained"]]
        if not tbs:
            return self._judge_bare_exception(others)
        workers = [t for t in tbs if not _is_launcher(t)]
        fatal = [t for t in workers if not self._progressed(t)]
        exit_ok = self._exit_code == 0
        if not fatal:
            if workers:  # training went on after every one: handled (a retried download, a logged warning)
                t = workers[-1]
                return [Finding("process.exception", "info",
                                f"{len(workers)} traceback(s) in the log, and training went on after them; the last: "
                                f"{_exc_text(t['exc']) if t['exc'] else 'its exception line is cut'}",
                                [f"line {t['line']}: traceback, step {t['step']}; training reached step {self._step}"],
                                [], {"count": self._tb_n, "exception": t["exc"], "user_frame": t["user"]})]
            t = tbs[-1]
            killed = any(x["signum"] is not None or x["code"] for x in self._exits)
            sev = "info" if killed or exit_ok or any(f.severity == "fail" for f in others) else "warn"
            kind = f" ({t['exc']['type'].rsplit('.', 1)[-1]})" if t["exc"] else ""
            return [Finding(
                "process.exception", sev,
                f"the launcher reports a failed worker{kind}"
                + (": see the process finding" if killed else ", but the worker's own error is not in this log"),
                [f"line {t['exc']['line']}: {t['exc']['text']}" if t["exc"] else
                 f"line {t['line']}: the launcher's traceback (its last line is cut)"],
                [] if killed else ["the worker's traceback is in its own output: torchrun --tee 3 --log-dir DIR (or "
                                   "--redirects 3) keeps each rank's stdout/stderr; torchrun's error_file line names "
                                   "a file when the worker is wrapped in @record"],
                {"count": self._tb_n, "exception": t["exc"], "launcher": True})]
        last = fatal[-1]
        burst = [t for t in fatal if (last["exc"] or last)["line"] - (t["exc"] or t)["line"] <= BURST_LINES]
        t = burst[0]
        exc = t["exc"] or {"line": t["last"], "type": "an exception", "msg": "(its last line is cut from the log)",
                           "text": ""}
        who = f"rank {t['rank']}: " if t["rank"] is not None else ""
        user = t["user"] or t["first_user"]
        where = f" at {_where(user)}" if user else ""
        what = {"faulthandler": "faulthandler dump", "c++": "C++ exception"}.get(t["kind"], "traceback")
        ev = [f"line {t['line']}: {what} ({t['frames']} frame(s)), exception at line {exc['line']}: {_exc_text(exc)}"]
        if t["user"]:
            ev.append(_frame_line("innermost frame in your code", t["user"]))
        elif t["first_user"]:
            ev.append(_frame_line("frame in your code (of the exception it was handling)", t["first_user"]))
        elif t["frames"]:
            ev.append("no frame in your own code: every frame is in installed packages or the standard library")
        if t["inner"] and t["inner"] is not t["user"]:
            ev.append(_frame_line("raised in", t["inner"]))
        if t["cause"]:
            ev.append(f"while handling / caused by: {_exc_text(t['cause'])} (line {t['cause']['line']})")
        if len(burst) > 1:
            ranks = sorted({b["rank"] for b in burst[1:] if b["rank"] is not None})
            shown = f" (ranks {', '.join(map(str, ranks[:8]))})" if ranks else ""
            ev.append(f"{len(burst) - 1} more traceback(s) right after it{shown}"
                      f"; the last: {_exc_text(burst[-1]['exc']) if burst[-1]['exc'] else 'cut'}")
        if step := t["step"]:
            ev.append(f"at step {step}")
        cause = self._explained(t)
        text = _exc_text(exc, 160)
        if t["exc"] is None:  # cut: a pasted log that lost its end; another finding is then likely the failure
            sev = "info" if any(f.severity in ("fail", "warn") for f in others) else "warn"
            title = f"{who}a traceback{where} whose exception line is cut from the log"
        elif cause:
            sev, title = "info", f"{who}the run stopped with {text}{where} (explained by the finding above)"
        elif exit_ok:
            sev, title = "info", f"{who}a traceback ({text}{where}), but the command exited 0: it was handled"
        elif exc["type"].endswith("KeyboardInterrupt"):
            sev, title = "warn", f"{who}the run was interrupted (KeyboardInterrupt){where}"
        else:
            sev, title = "fail", f"{who}the run failed with {text}{where}"
        fix = [hint for words, hint in EXCEPTION_HINTS if any(w in text for w in words)][:2]
        if not cause and t["exc"] is not None:
            fix.append(f"start at {_where(user)}: the exception's line is the last one above it; rerun that step "
                       "alone (python -m pdb -c continue train.py stops there with the variables)" if user else
                       "the frames are all in libraries: the last call your code made into them (the outermost "
                       "library frame above) is what to inspect; the exception's message says what it refused")
        return [Finding("process.exception", sev, title, ev, fix,
                        {"count": self._tb_n, "exception": exc, "user_frame": user, "innermost_frame": t["inner"],
                         "rank": t["rank"], "line": t["line"], "kind": t["kind"], "explained_by": cause,
                         "cause": t["cause"]})]

    def _judge_bare_exception(self, others: list[Finding]) -> list[Finding]:
        """No traceback, but an error no rule knows: at least a warning, quoting it, unless another finding already
        says what failed (a bare exit code does not: it is what this explains) or the command exited 0.

        The output's end first (the last words of a failed run: an exception line from ``logger.error(e)`` or a cut
        paste, a ``FATAL``, ``error:``, ``[ERROR]``, ``terminate called`` line; the launcher's own lines after a worker
        failed, such as torch elastic's, looked past), then any such line anywhere (``_on_unknown_line``)."""
        if self._exit_code == 0 or any(f.severity in ("fail", "warn") and f.id not in _GENERIC_EXITS for f in others):
            return []
        tail = []
        for line in self.last_lines(12, errors=False):
            if P.LAUNCHER_TRAILER_RE.search(line):
                continue
            logical = strip_prefixes(line)
            if not P.LAUNCHER_TRAILER_RE.search(logical.text):
                tail.append((line, logical))
        tail = tail[-3:]
        for line, logical in reversed(tail):  # the output's very end, not an error it went past
            m = P.EXC_LINE_RE.match(logical.text)
            if m and m["msg"] and m["type"].endswith(("Error", "Exception")):
                return [Finding("process.exception", "warn", f"the output ends with an exception: {clip(line, 200)}",
                                [f"last lines: {x}" for x in self.last_lines(4)],
                                ["the traceback is not in this output: run with the full log (2>&1), or "
                                 "python -X faulthandler; the message names what failed"],
                                {"exception": {"type": m["type"], "msg": m["msg"], "text": clip(line)},
                                 "traceback": False})]
        for line, logical in reversed(tail):
            if logical.level in ERROR_LEVELS or P.ERROR_LINE_RE.search(logical.text):
                fatal = logical.level in ("FATAL", "CRITICAL")  # glog's F, a FATAL logger line: the process died
                return [Finding("process.error-line", "fail" if fatal else "warn",
                                f"the output ends with {'a fatal error' if fatal else 'an error'} no rule here knows: "
                                f"{clip(line, 200)}",
                                [f"last lines: {x}" for x in self.last_lines(4)],
                                ["the line names what failed and which program printed it; the lines above it say "
                                 "what it was doing"], {"text": clip(line), "count": self._unknown_n})]
        if not self._unknown_n:
            return []
        seen = self._unknown.items()
        first = seen[0]
        went_on = self._progressed(first)
        ev = [f"line {u['line']}{at_step(u)}: {u['text']}" for u in seen]
        if self._unknown_n > len(seen):
            ev.insert(len(self._unknown.head), f"... {self._unknown_n - len(seen)} more such line(s)")
        if went_on:
            ev.append(f"training went on after the first one (to step {self._step}): check that it is harmless")
        what = "an exception" if first["kind"] == "exception" else "an error"
        fatal = next((u for u in seen if u["level"] in ("FATAL", "CRITICAL")), None)
        if fatal is not None:  # glog's F and a logger's FATAL end the process: the run died there
            first, what = fatal, "a fatal error"
        title = (f"{what} no rule here knows, at line {first['line']}: {clip(first['text'], 160)}"
                 + (f" ({self._unknown_n} such lines)" if self._unknown_n > 1 else ""))
        return [Finding("process.error-line", "fail" if fatal is not None and not went_on else "warn", title, ev,
                        ["the line names what failed and which program printed it; the lines above it say what it "
                         "was doing"], {"text": first["text"], "line": first["line"], "count": self._unknown_n,
                                        "lines": seen, "training_went_on": went_on})]

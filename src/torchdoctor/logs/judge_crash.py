"""Judging crashes: the run's final exception (``process.exception``) and CUDA runtime errors (``cuda.*``).

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
from .common import clip
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


def _at_step(e: dict) -> str:
    return f" (step {e['step']})" if e.get("step") is not None else ""


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
                return [Finding("process.error-line", "warn",
                                f"the output ends with an error no rule here knows: {clip(line, 200)}",
                                [f"last lines: {x}" for x in self.last_lines(4)],
                                ["the line names what failed and which program printed it; the lines above it say "
                                 "what it was doing"], {"text": clip(line), "count": self._unknown_n})]
        if not self._unknown_n:
            return []
        seen = self._unknown.items()
        first = seen[0]
        went_on = self._progressed(first)
        ev = [f"line {u['line']}{_at_step(u)}: {u['text']}" for u in seen]
        if self._unknown_n > len(seen):
            ev.insert(len(self._unknown.head), f"... {self._unknown_n - len(seen)} more such line(s)")
        if went_on:
            ev.append(f"training went on after the first one (to step {self._step}): check that it is harmless")
        what = "an exception" if first["kind"] == "exception" else "an error"
        title = (f"{what} no rule here knows, at line {first['line']}: {clip(first['text'], 160)}"
                 + (f" ({self._unknown_n} such lines)" if self._unknown_n > 1 else ""))
        return [Finding("process.error-line", "warn", title, ev,
                        ["the line names what failed and which program printed it; the lines above it say what it "
                         "was doing"], {"text": first["text"], "line": first["line"], "count": self._unknown_n,
                                        "lines": seen, "training_went_on": went_on})]

    # ----------------------------------------------------------------------------------------------- CUDA
    def _judge_cuda(self) -> list[Finding]:
        out: list[Finding] = []
        errs = self._cuda_errors
        blocking = ("rerun with CUDA_LAUNCH_BLOCKING=1: kernels then run synchronously, so the traceback points at "
                    "the kernel that failed, not at a later call (CUDA reports errors asynchronously)")

        def ev_of(kind: str) -> list[str]:
            d = errs[kind]
            ev = [f"line {e['line']}{_at_step(e)}: {e['text']}" for e in d["events"][:3]]
            if d["count"] > 3:
                ev.append(f"{d['count']} such line(s) in all")
            return ev

        def data_of(kind: str, **more) -> dict:
            return {"count": errs[kind]["count"], "events": list(errs[kind]["events"]), **more}

        if "illegal-memory-access" in errs:
            msg = errs["illegal-memory-access"]["events"][0]["msg"]
            out.append(Finding(
                "cuda.illegal-memory-access", "fail", f"CUDA error: {msg}: a kernel read or wrote memory it must not",
                ev_of("illegal-memory-access"),
                [blocking,
                 "compute-sanitizer --tool memcheck python train.py (the CUDA toolkit's tool) names the kernel and "
                 "the bad address; with a small batch it runs in minutes",
                 "usual causes: an out-of-range index or a custom/fused kernel (flash-attn, apex, DeepSpeed ops, "
                 "Triton) built for another torch or GPU: rebuild it (torchdoctor env), or switch it off to see if "
                 "the error goes; a failing GPU shows Xid lines in dmesg"],
                data_of("illegal-memory-access")))
        if "device-assert" in errs:
            ev = ev_of("device-assert") + [f"line {a['line']}: {a['text']}" for a in self._device_asserts[:2]]
            conds = " ".join(a["cond"] for a in self._device_asserts)
            fix = [blocking,
                   "a device-side assert is an index out of range inside a kernel: labels outside [0, num_classes) "
                   "(or -1 instead of ignore_index=-100) in cross_entropy, token ids >= the embedding's size "
                   "(a tokenizer with added tokens: model.resize_token_embeddings(len(tokenizer)))",
                   "run the same batch on the CPU: the same mistake is a readable IndexError there"]
            if "n_classes" in conds:
                fix.insert(0, "the assert is cross-entropy's `t >= 0 && t < n_classes`: a label is negative or >= "
                              "the number of classes")
            elif "srcIndex" in conds or "index out of bounds" in conds:
                fix.insert(0, "the assert is an indexing kernel's (embedding / index_select): an index >= the "
                              "table's size, usually a token id >= vocab size")
            out.append(Finding("cuda.device-assert", "fail", "CUDA error: device-side assert triggered", ev, fix,
                               data_of("device-assert", asserts=list(self._device_asserts))))
        if "no-kernel-image" in errs or self._cuda_capability:
            cap = self._cuda_capability
            ev = ev_of("no-kernel-image") if "no-kernel-image" in errs else []
            what = "no kernel image for this GPU"
            if cap:
                ev.append(f"line {cap['line']}: {cap['text']}")
                archs = " ".join(cap["arch_list"]) or "?"
                what += f": the GPU is {cap['capability']}, the torch build has {archs}"
            fix = ["compare torch.cuda.get_arch_list() (the architectures this torch build carries) with "
                   "torch.cuda.get_device_capability() (the GPU's; (8, 9) is sm_89): `torchdoctor env` shows both",
                   "install a torch build that includes this GPU's architecture (a newer wheel, or one for a newer "
                   "CUDA from download.pytorch.org)",
                   "for an extension you built (DeepSpeed ops, flash-attn, apex): rebuild it with "
                   "TORCH_CUDA_ARCH_LIST set to the GPU's capability, e.g. TORCH_CUDA_ARCH_LIST=\"8.9\" pip install "
                   "--no-build-isolation --force-reinstall ..."]
            out.append(Finding("cuda.no-kernel-image", "fail" if "no-kernel-image" in errs else "warn",
                               what, ev, fix,
                               {**(data_of("no-kernel-image") if "no-kernel-image" in errs else {"count": 0}),
                                "capability": cap}))
        if "driver-too-old" in errs:
            found = next((e.get("found") for e in errs["driver-too-old"]["events"] if e.get("found")), None)
            ver = f" (found driver version {found})" if found else ""
            out.append(Finding(
                "cuda.driver-too-old", "fail",
                f"the NVIDIA driver is too old for the CUDA runtime torch uses{ver}", ev_of("driver-too-old"),
                ["nvidia-smi shows the driver and the newest CUDA it supports (top right); torch.version.cuda is what "
                 "torch needs: `torchdoctor env` shows both",
                 "update the driver, or install a torch build for an older CUDA (pip install torch --index-url "
                 "https://download.pytorch.org/whl/cu118); in a container the host's driver is the one that counts"],
                data_of("driver-too-old", found_version=found)))
        if "ecc" in errs or self._ecc:
            ev = (ev_of("ecc") if "ecc" in errs else []) + [f"line {e['line']}: {e['text']}" for e in self._ecc[:2]]
            out.append(Finding(
                "cuda.ecc", "fail", "an uncorrectable ECC memory error on a GPU: a hardware fault, not the code",
                ev, ["nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER on that node: pending retirements/remaps "
                     "need a GPU reset (nvidia-smi -r) or a reboot",
                     "take the node out of the pool (Slurm: scontrol update nodename=NODE state=drain "
                     "reason=ecc) and tell its admins if it recurs; resume from the last checkpoint elsewhere"],
                {"count": errs.get("ecc", {}).get("count", 0) + len(self._ecc), "lines": list(self._ecc)}))
        if self._xids:
            out.append(self._xid_finding())
        if "error" in errs:
            msg = errs["error"]["events"][0]["msg"]
            fix = [blocking]
            for words, hint in CUDA_ERROR_HINTS:
                if any(w in msg for w in words):
                    fix.insert(0, hint)
            out.append(Finding("cuda.error", "fail", f"CUDA error: {msg}", ev_of("error"), fix, data_of("error")))
        return out

    def _xid_finding(self) -> Finding:
        codes = sorted({x["code"] for x in self._xids})
        meaning = [f"Xid {c}: {XID_MEANINGS[c]}" for c in codes if c in XID_MEANINGS]
        hw = any(c in XID_HARDWARE for c in codes)
        ev = [f"line {x['line']}: {x['text']}" for x in self._xids[:3]] + meaning
        fix = ["nvidia-smi -q on that node (ECC, retired pages, clocks, power); dmesg -T | grep -i xid for the whole "
               "history; NVIDIA's Xid catalog says what each code means"]
        if hw:
            fix.append("a hardware/driver-level Xid: drain the node (Slurm: scontrol update nodename=NODE state=drain "
                       "reason=xid) and reset or replace the GPU; resume from the last checkpoint on another node")
        else:
            fix.append("Xid 13/31/43 usually follow an application error (an illegal memory access in a kernel): "
                       "rerun with CUDA_LAUNCH_BLOCKING=1, compute-sanitizer")
        return Finding("cuda.xid", "fail" if hw else "warn",
                       f"the NVIDIA driver logged Xid {', '.join(map(str, codes))}"
                       + (": a GPU hardware or driver fault" if hw else ": a GPU error (often the program's)"),
                       ev, fix, {"xids": list(self._xids), "codes": codes})


XID_MEANINGS = {
    13: "graphics engine exception (often an out-of-range access in a kernel)",
    31: "GPU memory page fault (an illegal address; the program's or the driver's)",
    43: "GPU stopped processing (the program's kernel was killed after an error)",
    45: "preemptive cleanup after an earlier error", 48: "double-bit ECC error (memory hardware)",
    61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping recorded", 64: "ECC page retirement / row remapping failed",
    74: "NVLink error", 79: "the GPU has fallen off the bus (power, PCIe, overheating)",
    92: "high single-bit ECC error rate", 94: "contained ECC error (restart the program)",
    95: "uncontained ECC error (reset the GPU)", 109: "context switch timeout", 119: "GSP RPC timeout",
    120: "GSP error",
}
XID_HARDWARE = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}
CUDA_ERROR_HINTS = (
    (("initialization error",), "CUDA was initialised before a fork: DataLoader workers / multiprocessing that touch "
     "CUDA need the 'spawn' start method (torch.multiprocessing.set_start_method('spawn')), and no CUDA calls at "
     "import time"),
    (("invalid device ordinal",), "a device index beyond the GPUs visible: CUDA_VISIBLE_DEVICES and "
     "--nproc_per_node / --num_gpus must agree; each rank should use cuda:LOCAL_RANK"),
    (("busy or unavailable",), "the GPU is in exclusive-process mode or taken: nvidia-smi shows its compute mode and "
     "the processes on it"),
    (("system not yet initialized",), "on NVSwitch systems (HGX A100/H100) the fabric manager must run: systemctl "
     "status nvidia-fabricmanager, with the same version as the driver"),
    (("CUBLAS_STATUS", "CUDNN_STATUS"), "a cuBLAS/cuDNN failure is often an earlier error surfacing (an illegal "
     "access, out of memory) or mismatched shapes/dtypes; CUDA_LAUNCH_BLOCKING=1 shows which"),
)

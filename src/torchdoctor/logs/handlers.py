"""The line handlers: each ``_on_*`` turns one matched log line into facts on the analyzer (counters, bounded
detail lists, the loss-scale trajectory) and a timeline event. They judge nothing: :mod:`.judge` and
:mod:`.scale_trajectory` do, once the whole log is read. One handler per rule in ``patterns.RULES``.
"""

from __future__ import annotations

import re
import signal as _signal
from typing import Any

from . import patterns as P
from .common import CURRENT, add, num, seen, signal_name
from .handlers_crash import CrashHandlers
from .lines import strip_prefixes
from .nonfinite import NonfiniteMessage
from .scalers import ScalerMessage, scale_of_lg

_OOM_ERROR_LINE = re.compile(r"(?<!except )(?<!except\()\b(?:\w+\.)*OutOfMemoryError: \S|CUDA error: out of memory"
                             r"|cuda runtime error \(2\)|cudaSuccess\. 2 vs 0|Cuda failure '?out of memory")
_NONFINITE_WORDS = ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")


_EVAL_WORDS_RE = re.compile(r"(?i)\b(?:val|valid|validation|eval|evaluation|evaluating|test|dev)\b")


def loss_name(key: str, before: str = "") -> str:
    """One name for one loss, however a trainer spells it: ``loss``, ``Loss``, ``train_loss``, Lightning's
    ``train_loss_step`` / ``train_loss_epoch`` are one; ``val_loss``, ``eval_loss`` are others, and so is a ``Loss``
    on a line that says it is validating (``Valid Epoch: 16 Loss: nan``: ``before`` is the line up to the key)."""
    key = key.lower()
    if before and _EVAL_WORDS_RE.search(before):
        key = "val_" + key
    for p in ("training_", "train_", "tr_"):
        key = key.removeprefix(p)
    for sfx in ("_step", "_epoch"):
        key = key.removesuffix(sfx)
    return key


def _nonfinite(text: str | None) -> bool:
    """``nan``, ``'inf'``, ``tensor(nan``, Lightning's padded ``nan.0``."""
    if text is None:
        return False
    word = text.strip("'\"").lower().removeprefix("tensor(")
    return word.rstrip("0").removesuffix(".") in _NONFINITE_WORDS


class Handlers(CrashHandlers):
    """Mixin of :class:`~torchdoctor.logs.analyze.Analyzer`: the state the handlers fill, and the handlers (the crash
    ones are in :mod:`.handlers_crash`)."""

    def _init_handlers(self) -> None:
        from .scale_trajectory import ScaleTrajectory

        self._init_crash()

        # fp16 loss scaling
        self._scale = ScaleTrajectory()
        self._static_ovf = 0
        self._scaleless_ovf = 0
        self._static_scale: float | None = None
        self._ds_frame_line = 0        # the last DeepSpeed update_scale traceback frame
        # losses
        self._loss_nf = 0
        self._loss_first: dict | None = None
        self._loss_last: dict | None = None
        self._loss_recovered = False
        self._loss_stopped: dict | None = None  # a tool said it stopped the run on the non-finite loss (nonfinite.py)
        self._nf_keys: dict[str, int] = {}  # loss name -> where its last non-finite value ends in the current buffer
        self._grad_said: list[dict] = []    # non-finite gradients a tool reported in words (nonfinite.MESSAGES)
        self._loss_hidden = 0          # Trainer dicts whose 'loss': 0.0 hides a NaN (see _on_norm)
        self._norm_nf = 0
        self._norm_first: dict | None = None
        self._hf_norms = 0             # Trainer dicts with a grad_norm (counted per chunk in scan.py) ...
        self._hf_norm_nf_tail = 0      # ... and the non-finite ones since the last finite one
        self._norm_nf_end: int | None = None  # end of the last such segment in the current buffer
        self._hf_norm_nf_finite_loss = 0
        # memory
        self._cuda_oom: list[dict] = []
        self._cuda_oom_n = 0
        self._gpu_mem_max: tuple[float, float] | None = None
        self._cpu_mem_pct_max: float | None = None
        self._cpu_mem_last: dict | None = None
        self._host_oom: list[dict] = []
        self._host_oom_n = 0
        # processes
        self._exits: list[dict] = []
        self._exit_keys: set = set()
        self._exit_n = 0
        self._tr_host: str | None = None
        self._tr_rank: int | None = None
        self._tr_local_rank: int | None = None
        self._sigterm_sent = 0
        self._cancel: dict | None = None
        # layouts: pip's box around a build's output (first line, last line, prefix, indent), a table's header
        self._box: tuple[int, int, str, int] | None = None
        self._table: list[str] | None = None
        # builds and configs
        self._build_keys: set = set()
        self._ds_config: list[dict] = []

    # ------------------------------------------------------------------------------- fp16 loss scaling
    def _on_overflow(self, m: re.Match, seg: str, lineno: int) -> None:
        rank = int(m["rank"]) if m["rank"] else self._rank(seg)
        att, new = num(m["att"]), num(m["new"])
        if att is None:
            e = self._event(lineno, "overflow-unscaled", seg)
            self._scaleless_ovf += 1
            self._scale.count_overflow(rank, e)
            return
        e = self._event(lineno, "overflow", seg)
        self._scale.count_overflow(rank, e)
        self._scale.dynamic += 1
        if m["hyst"] is not None:
            self._scale.hysteresis += 1
            self._scale.point(att, att, lineno, self._step, hysteresis=True)
        elif new is not None:
            self._scale.point(att, new, lineno, self._step)

    def _on_grad_overflow(self, m: re.Match, seg: str, lineno: int) -> None:
        it = int(m.group(1))
        self._set_step(it)
        self._iterations = max(self._iterations, it + 1)  # iterations count from 0
        e = self._event(lineno, "overflow", seg, step=it)
        self._scale.count_overflow(self._rank(seg), e)

    def _on_reducing(self, m: re.Match, seg: str, lineno: int) -> None:
        att, new = float(m.group(1)), float(m.group(2))
        self._scale.dynamic += 1
        self._scale.point(att, new, lineno, self._step)
        if att == new and not self._counts["scale-min"]:  # the overflow itself is on the line before
            self._event(lineno, "scale-min", seg)

    def _on_increasing(self, m: re.Match, seg: str, lineno: int) -> None:
        self._scale.rise(float(m.group(2)), lineno, self._step)
        self._event(lineno, "scale-up", seg)

    def _on_static_scale(self, m: re.Match, seg: str, lineno: int) -> None:
        self._static_ovf += 1
        self._static_scale = float(m.group(1))

    def _on_min_scale(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "scale-min", seg)
        self._scale.raised(lineno, self._step, self._quote(seg))

    def _on_ds_update_scale_frame(self, m: re.Match, seg: str, lineno: int) -> None:
        self._ds_frame_line = lineno

    def _on_exception_line(self, m: re.Match, seg: str, lineno: int) -> None:
        """``Exception: Current loss sc`` -- DeepSpeed's min-scale message cut short, under its update_scale frame."""
        msg = m["msg"]
        if ("already at minimum" in msg or not self._ds_frame_line or lineno - self._ds_frame_line > 60
                or len(msg) < 4 or not P.MIN_SCALE_MESSAGE.startswith(msg)):
            return
        self._event(lineno, "scale-min", seg)
        self._scale.raised(lineno, self._step,
                           self._quote(seg) + " (cut; raised in DeepSpeed's loss_scaler.update_scale)")

    def _on_scale_config(self, m: re.Match, seg: str, lineno: int) -> None:
        for c in P.DS_SCALE_CONFIG_RE.finditer(seg):
            v = num(c["val"])
            if v is None:
                continue
            if c["key"] in ("min_loss_scale", "min_scale"):
                self._scale.configure(min_loss_scale=v)
            elif c["key"] == "init_scale":
                self._scale.configure(init_scale=v)
            elif 0 <= v <= 64:
                self._scale.configure(init_scale=2.0 ** v)

    def _on_scaler(self, spec: ScalerMessage, m: re.Match, seg: str, lineno: int) -> None:
        """A line of another trainer's dynamic loss scaler (scalers.MESSAGES), read into the same trajectory."""
        t = self._scale
        t.use_trainer(spec.trainer, spec.floor, spec.init, spec.hint)
        groups = m.re.groupindex
        if spec.kind == "min":
            self._event(lineno, "scale-min", seg)
            t.raised(lineno, self._step, self._quote(seg),
                     f"{spec.trainer}'s loss scaler reached its minimum ({m['min']}) and stopped the run")
            return
        if spec.kind == "rise":
            t.rise(float(m["up"]), lineno, self._step)
            self._event(lineno, "scale-up", seg)
            return
        if spec.kind == "announce":  # the scale that overflowed, printed after "Grad overflow on iteration N"
            att = float(m["att"])
            t.dynamic += 1
            t.point(att, max(att / 2, spec.floor or 0.0), lineno, self._step)
            return
        e = self._event(lineno, "overflow", seg)
        t.count_overflow(self._rank(seg), e)
        t.dynamic += 1
        if "ratio" in groups:
            att = float(m["att"])
            t.point(att, att * float(m["ratio"]), lineno, self._step)
        elif "lg" in groups:
            lg = float(m["lg"])
            t.point(scale_of_lg(lg + 1), scale_of_lg(lg), lineno, self._step)
        elif "new" in groups:
            new = float(m["new"])
            t.point(t.last if t.last is not None and t.last > new else new * 2, new, lineno, self._step)

    def _on_megatron_iteration(self, m: re.Match, seg: str, lineno: int) -> None:
        it = P.MEGATRON_ITER_RE.search(seg)
        if it:
            self._bar_done = None
            self._set_step(int(it["it"]))
            self._planned = int(it["total"])
        norm = P.MEGATRON_NORM_RE.search(seg)
        nf = bool(norm and _nonfinite(norm["val"])) or bool(P.LOSS_RE.search(seg))
        scale = float(m["scale"])
        if nf:
            self._event(lineno, "scale-nonfinite", seg)
        self._scale.observe(scale, lineno, self._step, nf, "Megatron", self._quote(seg))

    def _on_megatron_counts(self, m: re.Match, seg: str, lineno: int) -> None:
        """Megatron's interval counters: nan iterations are non-finite losses; skipped iterations at a loss scale of 1
        (bf16/fp32: printed as 1.0, or no scale printed) are updates refused for non-finite gradients -- in fp16 they
        are the scaler's overflows, which the scale series already shows."""
        nan, skipped = int(m["nan"]), int(m["skipped"])
        if nan:
            self._nonfinite_loss(seg, lineno, "loss", f"nan/inf in {nan} iteration(s) of the interval (Megatron)")
        if skipped:
            sc = P.MEGATRON_SCALE_RE.search(seg)
            if sc is None or float(sc["scale"]) <= 1:
                self._event(lineno, "overflow-unscaled", seg)
                self._scaleless_ovf += skipped

    def _on_pip_box(self, m: re.Match, seg: str, lineno: int) -> None:
        """pip's box around a build's output: its lines are the build's own, indented to the box (see _unbox)."""
        phys = self._phys
        col = phys.find("╰")
        if col >= 0:
            self._box = (lineno, lineno + int(m["n"]) + 1, phys[:col], col + 4)

    def _on_fastprogress(self, m: re.Match, seg: str, lineno: int) -> None:
        self._set_step(int(m["n"]), "bar")
        self._planned = int(m["total"])
        self._nonfinite_loss(seg, lineno, "loss (fastai's smoothed loss in its progress bar)", m["val"])

    def _on_printed_scale(self, m: re.Match, seg: str, lineno: int) -> None:
        if float(m["scale"]) <= 0 or any(k in seg for k in ("scale_window", "scale_power", "min_loss_scale")):
            return  # a config print (DeepSpeed's "loss_scale": 0 means dynamic), not the scale in use
        nf = bool(P.LOSS_RE.search(seg))
        self._scale.observe(float(m["scale"]), lineno, self._step, nf, "printed", self._quote(seg))

    def _on_grad_scale(self, m: re.Match, seg: str, lineno: int) -> None:
        gs = P.GLOBAL_STEP_RE.search(seg)
        if gs:
            self._set_step(int(gs.group(1)))
        scale = float(m["scale"])
        nf = bool(P.LOSS_RE.search(seg)) or (self._loss_last is not None and self._loss_last["line"] >= lineno - 1
                                              and not self._loss_recovered)
        if scale <= 1:
            self._event(lineno, "scale-min", seg)
        self._scale.observe(scale, lineno, self._step, nf, "GradScaler", self._quote(seg))

    # -------------------------------------------------------------------------------------- losses
    def _nonfinite_loss(self, seg: str, lineno: int, key: str, value: str, hidden: bool = False) -> None:
        if self._loss_last is not None and self._loss_last["line"] == lineno:
            return  # the same line told twice (a value and a sentence: "Loss is nan, stopping training")
        self._training_metrics(seg)
        e = self._event(lineno, "loss-nonfinite", seg)
        self._loss_nf += 1
        self._loss_hidden += hidden
        self._loss_recovered = False
        at = seg.find(key)
        name = loss_name(key, seg[:at] if at > 0 else "")
        if len(self._nf_keys) < 64 or name in self._nf_keys:
            self._nf_keys[name] = self._seg_end
        d = {"line": lineno, "step": self._step, "key": key, "value": value, "text": e["text"], "hidden": hidden,
             "step_from": e.get("step_from"), "planned": e.get("planned")}
        sm = P.STEP_KEY_RE.search(seg) or P.GLOBAL_STEP_RE.search(seg)
        if sm:  # a metrics dict that names its own step
            d["step"] = e["step"] = int(sm.group(1))
            d["step_from"] = e["step_from"] = None
        em = P.EPOCH_RE.search(seg)
        if em:
            d["epoch"] = float(em.group(1))
        if self._loss_first is None:
            self._loss_first = d
        self._loss_last = d

    def _on_loss(self, m: re.Match, seg: str, lineno: int) -> None:
        self._nonfinite_loss(seg, lineno, m["key"], m["val"])

    def _on_nonfinite_message(self, spec: NonfiniteMessage, m: re.Match, seg: str, lineno: int) -> None:
        """A tool's own sentence about a non-finite loss or gradient (nonfinite.MESSAGES): the run stopped there, or
        it warned and went on."""
        groups = m.re.groupindex
        val = m["val"] if "val" in groups and m["val"] else "non-finite"
        if "step" in groups and m["step"]:
            self._set_step(int(m["step"]))
        said = {"line": lineno, "step": self._step, "tool": spec.tool, "stops": spec.stops, "value": val,
                "where": m["where"] if "where" in groups else None, "text": self._quote(seg)}
        if spec.what == "loss":
            self._nonfinite_loss(seg, lineno, f"loss ({spec.tool})", val)
            if spec.stops and self._loss_stopped is None:
                self._loss_stopped = said
            return
        e = self._event(lineno, "grad-norm-nonfinite", seg)
        self._norm_nf += 1
        add(self._grad_said, said, 8)
        if self._norm_first is None:
            self._norm_first = {"line": lineno, "step": e["step"], "key": spec.tool, "text": e["text"]}

    def _on_norm(self, m: re.Match, seg: str, lineno: int) -> None:
        if "oss" in seg and P.LOSS_RE.search(seg):
            return  # the loss itself is non-finite: reported as such
        if m["key"] == "grad_norm" and P.HF_ZERO_LOSS_RE.search(seg):
            # transformers' Trainer (logging_nan_inf_filter=True, its default) logs the mean of the finite step
            # losses since the last log: 0.0 when every one was NaN. With the NaN grad norm, the loss is NaN.
            self._nonfinite_loss(seg, lineno, "loss", "nan (logged as 0.0)", hidden=True)
            return
        self._training_metrics(seg)
        sm = P.STEP_KEY_RE.search(seg)
        e = self._event(lineno, "grad-norm-nonfinite", seg, step=int(sm.group(1)) if sm else CURRENT)
        self._norm_nf += 1
        if m["key"] == "grad_norm" and ("'grad_norm'" in seg or '"grad_norm"' in seg):  # a Trainer dict's
            self._hf_norm_nf_finite_loss += 1
            since = self._norm_nf_end if self._norm_nf_end is not None else 0
            if self._hf_norm_nf_tail and P.HF_FINITE_NORM_RE.search(self._buf, since, self._seg_start):
                self._hf_norm_nf_tail = 0  # a finite one came between: the run of non-finite ones starts again
            self._hf_norm_nf_tail += 1
            self._norm_nf_end = self._seg_end
        if self._norm_first is None:
            self._norm_first = {"line": lineno, "step": e["step"], "key": m["key"], "text": e["text"]}

    # ------------------------------------------------------------------------------------------ memory
    def _on_cuda_oom(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "cuda-oom", seg)
        self._cuda_oom_n += 1
        d: dict[str, Any] = {"line": lineno, "step": self._step, "rank": self._rank(seg),
                             "tried_to_allocate": m["req"], "text": self._quote(seg, 600)}
        g = P.CUDA_OOM_GPU_RE.search(seg)
        if g:
            d["gpu"] = int(g["gpu"] or g["gpu_old"])
            d["total_capacity"] = g["total"] or g["total_old"]
            d["free"] = g["free"] or g["free_old"]
        f = P.CUDA_OOM_FRAG_RE.search(seg)
        if f:
            d["reserved_unallocated"] = f["unalloc"]
        others = [(int(p["pid"]), p["size"]) for p in P.CUDA_OOM_PROC_RE.finditer(seg)]
        if others:
            d["other_processes"] = others
        me = P.CUDA_OOM_SELF_RE.search(seg)
        if me:
            d["this_process"] = me["size"]
        r = P.CUDA_OOM_RESERVED_RE.search(seg)
        if r:
            d["reserved"] = r["size"]
        add(self._cuda_oom, d, 16)

    def _on_cuda_oom_error(self, m: re.Match, seg: str, lineno: int) -> None:
        if "CUDA out of memory" in seg or not _OOM_ERROR_LINE.search(seg):
            return
        self._event(lineno, "cuda-oom", seg)
        self._cuda_oom_n += 1
        add(self._cuda_oom, {"line": lineno, "step": self._step, "rank": self._rank(seg), "tried_to_allocate": None,
                              "text": self._quote(seg, 600), "nccl": "Cuda failure" in seg}, 16)

    def _on_mem_gpu(self, m: re.Match, seg: str, lineno: int) -> None:
        max_ma, max_ca = float(m.group(2)), float(m.group(4))
        old = self._gpu_mem_max or (0.0, 0.0)
        self._gpu_mem_max = (max(old[0], max_ma), max(old[1], max_ca))

    def _on_mem_cpu(self, m: re.Match, seg: str, lineno: int) -> None:
        pct = float(m.group(2))
        self._cpu_mem_pct_max = pct if self._cpu_mem_pct_max is None else max(self._cpu_mem_pct_max, pct)
        self._cpu_mem_last = {"line": lineno, "used_gb": float(m.group(1)), "percent": pct}

    def _on_host_oom(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "host-oom", seg)
        self._host_oom_n += 1
        add(self._host_oom, {"line": lineno, "text": self._quote(seg)}, 8)

    # --------------------------------------------------------------------------------------- processes
    def _exit(self, lineno: int, seg: str, code: int, source: str, pid: int | None = None,
              rank: int | None = None, host: str | None = None, local_rank: int | None = None) -> None:
        """One process exit. ``rank`` is the global rank; ``local_rank`` the rank on its node (torchrun's
        ``failed (exitcode: -9) local_rank: 2`` names only that): never reported as the other."""
        sig = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
        if pid is not None and seen(self._exit_keys, (pid, sig if sig is not None else code)):
            for x in self._exits:  # the same death told again (torchrun's summary block): keep what it adds
                if x["pid"] == pid:
                    x["rank"] = x["rank"] if x["rank"] is not None else rank
                    x["local_rank"] = x["local_rank"] if x["local_rank"] is not None else local_rank
                    x["host"] = x["host"] or host
            return
        self._exit_n += 1
        self._event(lineno, "killed" if sig is not None else "exit", seg)
        add(self._exits, {"line": lineno, "step": self._step, "code": code,
                           "signal": signal_name(sig) if sig else None, "signum": sig, "pid": pid,
                           "rank": rank if rank is not None else self._rank(seg), "local_rank": local_rank,
                           "host": host,
                           "source": source, "text": self._quote(seg)}, 64)

    def _on_ds_exit(self, m: re.Match, seg: str, lineno: int) -> None:
        code = int(m.group(1))
        r = P.DS_LOCAL_RANK_RE.search(seg)
        if code:
            self._exit(lineno, seg, code, "deepspeed launcher", local_rank=int(r.group(1)) if r else None)

    def _on_torchrun_failed(self, m: re.Match, seg: str, lineno: int) -> None:
        code = int(m.group(1))
        if code:
            self._exit(lineno, seg, code, "torchrun", pid=int(m.group(3)), local_rank=int(m.group(2)))

    def _torchrun_block(self) -> None:
        """The host and rank lines of torchrun's failure summary, a few lines above its exitcode / signal line
        (``  host      : node1``, ``  rank      : 3 (local_rank: 1)``): read back from there, not found by the scan."""
        end = self._seg_start
        back = self._buf[max(0, end - 800):end]
        if end < 800:  # the block may have begun in the previous piece of the text
            back = "".join(self._tail)[-(800 - end):] + back
        for line in back.split("\n")[-7:]:
            text = strip_prefixes(line).text
            h = P.TORCHRUN_HOST_RE.match(text)
            r = P.TORCHRUN_RANK_RE.match(text)
            if h:
                self._tr_host = h.group(1)
            if r:
                self._tr_rank, self._tr_local_rank = int(r.group(1)), int(r.group(2))

    def _on_torchrun_exitcode(self, m: re.Match, seg: str, lineno: int) -> None:
        code = int(m.group(1))
        if code:
            self._torchrun_block()
            self._exit(lineno, seg, code, "torchrun", pid=int(m.group(2)) if m.group(2) else None,
                       rank=self._tr_rank, host=self._tr_host, local_rank=self._tr_local_rank)
        self._tr_rank = self._tr_host = self._tr_local_rank = None

    def _on_torchrun_signal(self, m: re.Match, seg: str, lineno: int) -> None:
        self._torchrun_block()
        self._exit(lineno, seg, -int(m.group(1)), "torchrun", pid=int(m.group(3)), rank=self._tr_rank,
                   host=self._tr_host, local_rank=self._tr_local_rank)

    def _on_torchrun_host(self, m: re.Match, seg: str, lineno: int) -> None:
        self._tr_host = m.group(1)

    def _on_torchrun_rank(self, m: re.Match, seg: str, lineno: int) -> None:
        self._tr_rank, self._tr_local_rank = int(m.group(1)), int(m.group(2))

    def _on_spawn(self, m: re.Match, seg: str, lineno: int) -> None:
        if m.group(2):
            sig = getattr(_signal, m.group(2), None)
            code = -int(sig) if sig is not None else -1
        else:
            code = int(m.group(3))
        if code:
            self._exit(lineno, seg, code, "torch.multiprocessing", rank=int(m.group(1)))

    def _on_subprocess_signal(self, m: re.Match, seg: str, lineno: int) -> None:
        self._exit(lineno, seg, -int(m.group(2)), "subprocess")

    def _on_bash_killed(self, m: re.Match, seg: str, lineno: int) -> None:
        self._exit(lineno, seg, -9, "shell", pid=int(m.group(1)) if m.group(1) else None)

    def _on_sigterm_sent(self, m: re.Match, seg: str, lineno: int) -> None:
        self._sigterm_sent += 1
        if self._sigterm_sent <= 8:
            self._event(lineno, "sigterm-sent", seg)

    def _on_slurm_cancel(self, m: re.Match, seg: str, lineno: int) -> None:
        self._event(lineno, "cancelled", seg)
        if self._cancel is None or (self._cancel["what"] == "STEP" and m["what"] == "JOB"):  # the job's line first
            self._cancel = {"line": lineno, "reason": m["why"] or "scancel", "what": m["what"], "id": m["id"],
                            "node": m["node"] or m["node2"], "at": m["at"], "text": self._quote(seg)}

    # ------------------------------------------------------------------------------------ DeepSpeed config
    def _build(self, lst: list, lineno: int, seg: str, event: str, key: Any = None, **d: Any) -> None:
        if seen(self._build_keys, (event, key if key is not None else self._quote(seg))):
            return
        self._event(lineno, event, seg)
        add(lst, {"line": lineno, "text": self._quote(seg), **d}, 16)

    def _on_ds_bf16_fp16(self, m: re.Match, seg: str, lineno: int) -> None:
        self._build(self._ds_config, lineno, seg, "config-error", kind="bf16-and-fp16")

    def _on_ds_batch(self, m: re.Match, seg: str, lineno: int) -> None:
        tb, mb, gas, ws = (int(x) for x in m.groups())
        self._build(self._ds_config, lineno, seg, "config-error", kind="batch-size", train_batch_size=tb,
                    micro_batch=mb, gradient_accumulation_steps=gas, world_size=ws)

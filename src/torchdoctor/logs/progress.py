"""Where the run was when a line came: the last training progress bar (``28/189 [``), DeepSpeed's ``step=N,
skipped=S`` line or Megatron's ``iteration N/ M`` line before an event, read lazily (only the last one before an event
matters, so bars are parsed only when an event needs the step).

:class:`Progress` is a mixin of :class:`~torchdoctor.logs.analyze.Analyzer`.
"""

from __future__ import annotations

from . import patterns as P
from .common import SEG_BEFORE, SEG_MAX


class Progress:
    """The step the log is at, how far the run was planned to go, DeepSpeed's skipped-step counter."""

    def _init_progress(self) -> None:
        self._step: int | None = None
        self._step_from = "step"   # "bar": the step is a progress bar's count (see _set_step)
        self._max_step: int | None = None
        self._planned: int | None = None
        self._ds_skipped: int | None = None
        self._ds_step: int | None = None
        self._iterations = 0
        self._pending: dict[str, tuple[int, str, int, int]] = {}  # progress markers not parsed yet
        self._pseq = 0
        self._bar_done: tuple | None = None  # progress before a finished bar set the step (it may not be training)

    def _progress_region(self, buf: str, a: int, b: int) -> None:
        """Note the last progress bar / DeepSpeed step line in buf[a:b]; parsed only when a step is needed."""
        t = max(buf.rfind(P.TQDM_MARKERS[0], a, b), buf.rfind(P.TQDM_MARKERS[1], a, b))
        d = buf.rfind(P.DS_STEP_MARKER, a, b)
        for p, kind in sorted(((t, "tqdm"), (d, "ds"))):
            if p >= 0:
                self._pseq += 1
                self._pending[kind] = (self._pseq, buf, a, p)

    def _resolve_progress(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for kind, (_, buf, a, p) in sorted(pending.items(), key=lambda kv: kv[1][0]):
            if kind == "tqdm":
                self._tqdm_at(buf, a, p)
            else:
                self._ds_step_line(self._segment_around(buf, p))

    @staticmethod
    def _segment_around(buf: str, p: int) -> str:
        lo, hi = max(0, p - SEG_BEFORE), min(len(buf), p + SEG_MAX)  # bounded, as in _scan
        ls = max(buf.rfind("\n", lo, p) + 1, lo)
        r = buf.rfind("\r", ls, p)
        s = r + 1 if r >= 0 else ls
        e = buf.find("\n", p, hi)
        e = hi if e < 0 else e
        r = buf.find("\r", p, e)
        return buf[s: r if r >= 0 else e]

    def _tqdm_at(self, buf: str, a: int, p: int) -> None:
        for _ in range(3):  # a stray "it/s" that is not a bar: try the one before
            if self._tqdm(self._segment_around(buf, p)):
                return
            p = max(buf.rfind(P.TQDM_MARKERS[0], a, p), buf.rfind(P.TQDM_MARKERS[1], a, p))
            if p < 0:
                return

    def _tqdm(self, seg: str) -> bool:
        m = None
        for m in P.TQDM_RE.finditer(seg):  # noqa: B007 -- the last bar in the segment
            pass
        if m is None:
            return False
        if P.TQDM_NOT_TRAINING_RE.search(seg, 0, m.start()):
            return True  # a loading/eval bar: not the training step, and no reason to look further back
        if m.group(1) is not None:
            n, total = int(m.group(1)), int(m.group(2))
            # a finished bar may be a preprocessing one: remember what it replaces (see _training_metrics)
            self._bar_done = (self._step, self._max_step, self._planned) if n == total else None
            self._set_step(n, "bar")
            self._planned = total
        else:
            self._bar_done = None
            self._set_step(int(m.group(3)), "bar")
        return True

    def _training_metrics(self, seg: str) -> None:
        """A Trainer metrics dict of a run in progress after a finished bar: that bar was not the training loop
        (a 7/7 preprocessing bar without a name), so its count is not the step."""
        if self._bar_done is not None and "epoch" in seg and "train_runtime" not in seg:
            self._step, self._max_step, self._planned = self._bar_done
            self._bar_done = None

    def _ds_step_line(self, seg: str) -> None:
        m = P.DS_STEP_RE.search(seg)
        if m:
            self._deepspeed = True  # DeepSpeed's engine prints it
            self._bar_done = None
            self._set_step(int(m.group(1)))
            self._ds_step = int(m.group(1))
            self._ds_skipped = int(m.group(2))

    def _set_step(self, n: int, source: str = "step") -> None:
        """The step the log is at; ``source`` "bar" when only a progress bar says so (its count may be batches of an
        epoch, not optimizer steps: findings then say "progress N/M", never "step N")."""
        self._step, self._step_from = n, source
        if self._max_step is None or n > self._max_step:
            self._max_step = n

"""The fp16 loss scale over a log, and the judging of where it is heading.

Counting overflows is not enough to tell a healthy run from a dying one: six halvings from 2**32 in the first
steps are the dynamic scaler finding its level (DeepSpeed starts high on purpose), six halvings from 64 at step
378 of 2724 put the scale one overflow away from ``min_loss_scale``, where DeepSpeed stops the run. So the log's
scale points (``Attempted loss scale: A, reducing to B``, ``Reducing/Increasing dynamic loss scale``, and the
scale that Megatron-DeepSpeed or a custom trainer prints on every iteration line) are kept as a trajectory, and
the verdict reads its direction (falling since the last rise or not), its recoveries, the distance to the
minimum in halvings (``min_loss_scale`` read from the log when DeepSpeed prints its config, else DeepSpeed's
default 1), and how far into the run it happened (step numbers, ``x/N`` progress).

The rules (:func:`judge_fp16`), in order:
  1. the minimum reached (DeepSpeed's exception, the scale at 1 or stuck, a printed scale at its floor with nan
     gradients, a GradScaler scale of 0): fail, unless the scale rose again afterwards with finite losses (warn);
  2. still falling at the end of the log (two or more halvings since the last rise, or one with at most
     ``LOW_HALVINGS`` left), and not a start-up search: warn, saying how many halvings are left;
  3. many skipped steps, or a long sawtooth decline: warn;
  4. a start-up search (the fall begins at the first scale of the log, in the first steps -- or, with no step
     numbers, at DeepSpeed's initial scale -- and ends ``STARTUP_MIN_HALVINGS`` or more above the minimum): info;
  5. otherwise (isolated overflows, recovered): info.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ..advice import fp16_collapse_fix
from ..findings import Finding
from .common import SCALE_RUNS_HEAD, SCALE_RUNS_TAIL, HeadTail, fmt_scale, scale_val

DS_DEFAULT_MIN_SCALE = 1.0      # DeepSpeed's fp16 "min_loss_scale" default (Megatron's --min-loss-scale too)
DS_DEFAULT_INIT_SCALE = 2.0**16  # DeepSpeed's default "initial_scale_power" 16 (the fused optimizer starts at 2**32)
STARTUP_STEPS = 100             # a fall that starts within the first this many steps ...
STARTUP_FRACTION = 0.01         # ... (or the first 1% of the planned steps) can be the start-up search
# ... if it ends at least this many halvings above the minimum: a scale S keeps gradients of magnitude g in fp16
# while g * S < 65504, so a healthy run settles where its largest gradients allow -- 2**8 for gradients of a few
# hundred (a large model's first steps, before clipping), 2**16 for gradients near 1. A search that stops at or above
# 2**8 is such a level; below it the gradients are too large for fp16 at any useful scale.
STARTUP_MIN_HALVINGS = 8
LOW_HALVINGS = 2                # one more halving at this distance from the minimum is already a warning
STARTUP_MANY_SKIPS = 5          # a start-up search this long is worth a lower initial_scale_power
LOCATE_FIX = ("find the first layer that overflows: wrap the model in torchdoctor.NumericsMonitor(model, "
              "optimizer=opt) (or torchdoctor.compat.DebugUnderflowOverflow, a drop-in for transformers')")


def halvings_left(scale: float | None, floor: float) -> int | None:
    """How many more halvings ``scale`` takes before it reaches ``floor`` (0 at or below it)."""
    if scale is None or floor <= 0:
        return None
    if scale <= floor:
        return 0
    return int(math.floor(math.log2(scale / floor) + 1e-9))


class ScaleTrajectory:
    """Bounded record of the fp16 loss scale in a log: its points, runs, rises, falls and the minimum.

    ``point`` takes an overflow line (attempted -> new), ``rise`` an increase, ``observe`` a scale printed on
    a progress line (Megatron's ``loss scale: 1.0``, ``Fp16 Grad Scale: 0``), ``raised`` DeepSpeed's
    min-scale exception, ``configure`` what DeepSpeed's config print says the floor and start are.
    """

    def __init__(self) -> None:
        self.overflows = 0                      # overflow lines (any kind)
        self.by_rank: Counter[int | None] = Counter()
        self.first_overflow: dict | None = None
        self.hysteresis = 0
        self.dynamic = 0                        # overflows that lowered (or tried to lower) a dynamic scale
        self.first: float | None = None
        self.max: float | None = None
        self.min: float | None = None
        self.last: float | None = None
        self.runs = HeadTail(SCALE_RUNS_HEAD, SCALE_RUNS_TAIL)
        self._run_break = False
        self.increases = 0
        self.last_increase_line = 0
        self.last_drop_line = 0
        self._equal_streak = 0
        self.min_reached: str | None = None
        self.min_value: float | None = None     # the scale judged to be the minimum
        self.min_first: dict | None = None      # where it was first reached
        self.at_min_line = 0                    # the last line that left the scale at that minimum
        self.min_raised: dict | None = None
        self.min_loss_scale: float | None = None  # printed by DeepSpeed's config
        self.init_scale: float | None = None
        self.first_line: int | None = None
        self.fall_start: dict | None = None     # where the fall since the last rise began (scale, line, step)
        self.drops_since_rise = 0
        self.last_drop: dict | None = None
        self.observed = 0                       # scales printed on progress lines
        self.observed_floor_nf: list[dict] = []  # ... at the floor with nan gradients/loss (first, last)
        self.observed_floor_nf_n = 0
        self.observed_source: str | None = None
        self.trainer: str | None = None         # the scaler that printed (scalers.MESSAGES); None: DeepSpeed's lines
        self.trainer_floor: float | None = None  # its default minimum; no_floor: it has none (halves towards 0)
        self.no_floor = False
        self.trainer_hint = ""

    # ------------------------------------------------------------------------------------------ input
    def configure(self, *, min_loss_scale: float | None = None, init_scale: float | None = None) -> None:
        if min_loss_scale is not None and min_loss_scale > 0:
            self.min_loss_scale = min_loss_scale
        if init_scale is not None and init_scale > 0:
            self.init_scale = init_scale

    def use_trainer(self, trainer: str, floor: float | None, init: float | None, hint: str = "") -> None:
        """The scaler printing this log (the first one seen): its default floor and start."""
        if self.trainer is None:
            self.trainer, self.trainer_floor, self.no_floor, self.trainer_hint = trainer, floor, floor is None, hint
            if init is not None and self.init_scale is None:
                self.init_scale = init

    @property
    def floor(self) -> float:
        """The minimum the scale stops at: the log's config, else the trainer's default; a scaler without one
        halves towards 0, and below 1 it is collapsed (every scale overflows)."""
        if self.min_loss_scale is not None:
            return self.min_loss_scale
        if self.trainer_floor is not None:
            return self.trainer_floor
        return DS_DEFAULT_MIN_SCALE

    def floor_words(self) -> str:
        """Where :attr:`floor` comes from, in words."""
        if self.min_loss_scale is not None:
            return f"min_loss_scale is {fmt_scale(self.floor)} in the log's config"
        if self.trainer is None:
            return "DeepSpeed's default min_loss_scale is 1"
        if self.no_floor:
            return (f"{self.trainer}'s scaler has no minimum and halves towards 0: below 1, the gradients overflow "
                    "whatever the scale")
        return f"{self.trainer}'s default minimum scale is {fmt_scale(self.floor)}"

    def count_overflow(self, rank: int | None, event: dict) -> None:
        self.overflows += 1
        self.by_rank[rank if len(self.by_rank) < 1024 else None] += 1
        if self.first_overflow is None:
            self.first_overflow = event

    def rise(self, new: float, line: int, step: int | None) -> None:
        self.increases += 1
        self.last_increase_line = line
        self._run_break = True
        self.last = new
        self.max = new if self.max is None else max(self.max, new)
        self.fall_start, self.drops_since_rise = None, 0

    def point(self, att: float, new: float, line: int, step: int | None, hysteresis: bool = False) -> None:
        """An overflow at scale ``att`` that left the scale at ``new`` (``att`` again for hysteresis)."""
        if self.last is not None and att > self.last:  # DynamicLossScaler raises the scale silently
            self.rise(att, line, step)
        run = self.runs.last()
        if run is not None and run["scale"] == scale_val(att) and not self._run_break:
            run["overflows"] += 1
        else:
            self.runs.append({"scale": scale_val(att), "overflows": 1, "line": line, "step": step})
        self._run_break = False
        if self.first is None:
            self.first, self.first_line = att, line
        self.max = att if self.max is None else max(self.max, att)
        self.min = new if self.min is None else min(self.min, new)
        self.last = new
        if self.fall_start is None:
            self.fall_start = {"scale": att, "line": line, "step": step}
        if hysteresis:
            return
        if new < att:
            self.last_drop_line = line
            self._equal_streak = 0
            self.drops_since_rise += 1
            self.last_drop = {"scale": new, "line": line, "step": step}
        elif new == att:
            self._equal_streak += 1
            if self.min_reached is None and (att <= self.floor or self._equal_streak >= 3):
                self.min_reached = f"the loss scale stayed at {fmt_scale(att)}: min_loss_scale reached"
        if (new < self.floor if self.no_floor else new <= self.floor) and self.min_reached is None:
            self.min_reached = f"the loss scale fell to {fmt_scale(new)} ({self.floor_words()})"
        self._note_min(new, line, step)

    def _note_min(self, new: float, line: int, step: int | None) -> None:
        if self.min_reached is not None:
            if self.min_first is None:
                self.min_value = new
                self.min_first = {"line": line, "step": step}
            if new <= (self.min_value or 0):
                self.at_min_line = line

    def observe(self, scale: float, line: int, step: int | None, nonfinite: bool, source: str, text: str) -> None:
        """A scale printed on a progress line; ``nonfinite``: that line's gradient norm or loss is nan/inf."""
        self.observed += 1
        self.observed_source = source
        if self.last is not None and scale > self.last:
            self.rise(scale, line, step)
        elif self.last is not None and scale < self.last:
            self.point(self.last, scale, line, step)
        elif self.first is None:
            self.first = self.max = self.min = self.last = scale
            self.first_line = line
        # torch's GradScaler has no floor (below 1 it is collapsed); DeepSpeed and Megatron stop at min_loss_scale
        # torch's GradScaler, and a scale a trainer only prints, have no floor known here: below 1 it is collapsed
        at_floor = scale < 1 if source in ("GradScaler", "printed") else scale <= self.floor
        if at_floor and (nonfinite or scale == 0):
            self.observed_floor_nf_n += 1
            d = {"line": line, "step": step, "scale": scale, "text": text}
            if len(self.observed_floor_nf) < 2:
                self.observed_floor_nf.append(d)
            else:
                self.observed_floor_nf[1] = d
            if self.min_reached is None:
                self.min_reached = (
                    "the GradScaler scale is 0, and a scale of 0 never grows back (it is doubled to recover)"
                    if scale == 0 else
                    f"the loss scale is at its minimum ({fmt_scale(scale)}) and the "
                    + ("loss" if source == "GradScaler" else "gradient norm") + " is still nan/inf")
            self._note_min(scale, line, step)
            self.at_min_line = line

    def raised(self, line: int, step: int | None, text: str, why: str | None = None) -> None:
        if self.min_raised is None:
            self.min_raised = {"line": line, "step": step, "text": text}
        self.min_reached = why or "DeepSpeed's loss scaler raised 'Current loss scale already at minimum'"

    # ------------------------------------------------------------------------------------------ reading
    def skipped(self, ds_skipped: int | None) -> int:
        return max(max(self.by_rank.values(), default=0), ds_skipped or 0)

    def history(self) -> list[dict]:
        return [dict(r) for r in self.runs.items()]

    def summary(self, limit: int = 10) -> str:
        parts = [f"{r['scale']}x{r['overflows']}" if r["overflows"] > 1 else str(r["scale"]) for r in self.history()]
        if len(parts) > limit:
            parts = [*parts[: limit // 2], "...", *parts[-(limit // 2):]]
        elif self.runs.dropped:
            parts.insert(SCALE_RUNS_HEAD, "...")
        return " -> ".join(parts)

    def falling(self) -> bool:
        """Still falling at the end: halvings since the last rise (two, or one this close to the minimum)."""
        left = halvings_left(self.last, self.floor)
        return self.drops_since_rise >= 2 or (self.drops_since_rise >= 1 and left is not None
                                               and 0 < left <= LOW_HALVINGS)

    def startup(self, planned: int | None) -> bool:
        """The fall is the dynamic scaler's search for its level at the start of the run, and it ends far above
        the minimum (a fall to a few halvings from it is not a search any more, wherever it starts)."""
        fs = self.fall_start
        if fs is None or self.increases or fs["line"] != self.first_line:
            return False
        left = halvings_left(self.last, self.floor)
        if left is None or left < STARTUP_MIN_HALVINGS:
            return False
        if fs["step"] is not None:
            return fs["step"] <= max(STARTUP_STEPS, STARTUP_FRACTION * (planned or 0))
        return fs["scale"] >= (self.init_scale or DS_DEFAULT_INIT_SCALE)


def _at(d: dict | None, planned: int | None = None) -> str:
    if not d:
        return ""
    s = f"line {d['line']}"
    if d.get("step") is not None:
        s += f" (step {d['step']}" + (f" of {planned}, {100 * d['step'] / planned:.0f}% into the run"
                                      if planned else "") + ")"
    return s


def _halvings_text(n: int | None, t: ScaleTrajectory) -> str:
    if t.min_loss_scale is not None:
        where = f"min_loss_scale {fmt_scale(t.floor)}, from the log's DeepSpeed config"
    elif t.trainer is None:
        where = "min_loss_scale 1: DeepSpeed's default, the log does not print its config"
    elif t.no_floor:
        where = f"{t.trainer}'s scaler has no minimum; counted to 1, below which every scale overflows"
    else:
        where = f"{fmt_scale(t.floor)}: {t.trainer}'s default"
    return f"{n} halving{'' if n == 1 else 's'} left before the minimum ({where})"


def judge_fp16(t: ScaleTrajectory, *, max_step: int | None, iterations: int, planned: int | None,
               ds_skipped: int | None, loss_last_line: int | None, loss_recovered: bool, loss_nf: int,
               deepspeed: bool = True) -> list[Finding]:
    """The fp16 findings of a trajectory (rules in the module docstring). ``loss_*``: the non-finite losses."""
    skipped = t.skipped(ds_skipped)
    if not (t.dynamic or t.min_reached or (ds_skipped or 0) > 0 or (t.observed and t.last_drop is not None)):
        return []
    total = max(max_step or 0, iterations) or None
    frac = min(1.0, skipped / total) if total else None
    shrinking = (t.dynamic >= 20 and t.last is not None and t.max is not None and t.last <= t.max / 1024
                 and t.last_increase_line < t.last_drop_line)
    many_skipped = skipped >= 10 and frac is not None and frac >= 0.1
    first = t.first_overflow
    left = halvings_left(t.last, t.floor)
    falling, startup = t.falling(), t.startup(planned)
    data: dict[str, Any] = {
        "skipped_steps": skipped, "total_steps": total, "planned_steps": planned,
        "min_scale_reached": t.min_reached is not None,
        "first_overflow_step": first["step"] if first else None,
        "first_overflow_line": first["line"] if first else None,
        "overflow_lines": t.overflows, "hysteresis_overflows": t.hysteresis,
        "scale_first": t.first, "scale_max": t.max, "scale_min": t.min, "scale_last": t.last,
        "scale_increases": t.increases, "scale_history": t.history(), "scale_history_dropped": t.runs.dropped,
        "min_loss_scale": t.floor, "min_loss_scale_from_log": t.min_loss_scale is not None,
        "halvings_left": left, "falling": falling, "startup_search": startup,
        "halvings_since_rise": t.drops_since_rise,
    }
    ev = []
    if first:
        at = f" (step {first['step']})" if first["step"] is not None else ""
        ev.append(f"first overflow at line {first['line']}{at}: {first['text']}")
    if t.max is not None:
        ev.append(f"loss scale {fmt_scale(t.first)} -> {fmt_scale(t.last)} (max {fmt_scale(t.max)}, min "
                  f"{fmt_scale(t.min)}), {t.increases} recover{'y' if t.increases == 1 else 'ies'}"
                  + (f": {t.summary()}" if t.runs else ""))
    for o in t.observed_floor_nf:
        ev.append(f"line {o['line']}" + (f" (step {o['step']})" if o["step"] is not None else "") + f": {o['text']}")
    if t.observed_floor_nf_n > 2:
        ev.append(f"{t.observed_floor_nf_n} progress line(s) in all at that scale with non-finite values")
    if t.observed_source == "Megatron" and t.observed_floor_nf and t.last == 1:
        ev.append("Megatron prints 'loss scale: 1.0' for a bf16 run too (bf16 needs no loss scaling): if this run "
                  "is bf16, the gradients themselves are nan and the fix starts with finding the first module that "
                  "produces them")
    steps = f"{skipped} skipped step(s)" + (f" of {total} ({100 * frac:.0f}%)" if frac is not None else "")
    if t.overflows or ds_skipped:  # a printed scale alone (Megatron, a GradScaler) says nothing of skipped steps
        ev.append(steps + (f", {t.hysteresis} absorbed by hysteresis" if t.hysteresis else ""))
    if t.min_raised:
        ev.append(f"line {t.min_raised['line']}: {t.min_raised['text']}")
    fix = [fp16_collapse_fix(deepspeed and t.trainer is None), LOCATE_FIX]
    if t.trainer_hint:
        fix.append(t.trainer_hint)
    if t.min_reached is not None:
        # Recovered: DeepSpeed did not give up, the scale rose again after the last time it sat at the
        # minimum, and no non-finite loss is left unanswered after that. Otherwise it stayed there to the end.
        mf = t.min_first or {}
        nan_after = loss_last_line is not None and loss_last_line > t.at_min_line and not loss_recovered
        recovered = (t.min_raised is None and t.last_increase_line > t.at_min_line and t.last is not None
                     and t.min_value is not None and t.last > t.min_value and not nan_after)
        data.update(recovered=recovered, min_scale=t.min_value, min_scale_first_line=mf.get("line"),
                    min_scale_first_step=mf.get("step"), min_scale_last_line=t.at_min_line or None)
        if recovered:
            at = f"line {mf['line']}" + (f" (step {mf['step']})" if mf.get("step") is not None else "")
            ev.append(f"the scale reached {fmt_scale(t.min_value)} at {at}, last sat there at line "
                      f"{t.at_min_line}, then rose again to {fmt_scale(t.last)}"
                      + ("; the losses logged after it are finite" if loss_nf else ""))
            title = (f"fp16 loss scale fell to {fmt_scale(t.min_value)} at {at} but recovered to "
                     f"{fmt_scale(t.last)}; {steps}")
            return [Finding("fp16.loss-scale-collapse", "warn", title, ev, fix, data)]
        title = f"fp16 loss scale collapsed: {t.min_reached}"
        if t.min_raised:
            title += "; the run stopped"
        elif t.last is not None and t.min_value is not None and t.last <= t.min_value:
            title += ", and stayed there to the end of the log"
        elif nan_after:
            title += "; the losses logged after it are not finite"
        return [Finding("fp16.loss-scale-collapse", "fail", title, ev, fix, data)]
    if falling and not startup:
        fs = t.fall_start or {}
        ev.append(f"the scale fell from {fmt_scale(fs.get('scale'))} at {_at(fs, planned)} to "
                  f"{fmt_scale(t.last)} at {_at(t.last_drop, planned)} and did not rise again before the log ends; "
                  "DeepSpeed stops the run when an overflow comes at the minimum")
        title = (f"fp16 loss scale is still falling at the end of the log ({fmt_scale(fs.get('scale'))} -> "
                 f"{fmt_scale(t.last)}, {t.drops_since_rise} halving(s) since the last rise, {t.increases} "
                 f"recover{'y' if t.increases == 1 else 'ies'}): {_halvings_text(left, t)}")
        return [Finding("fp16.loss-scale-collapse", "warn", title, ev, fix, data)]
    if shrinking or many_skipped:
        why = (f"the loss scale kept falling ({fmt_scale(t.max)} -> {fmt_scale(t.last)}) without recovering"
               if shrinking else f"{steps} were skipped by fp16 overflow")
        return [Finding("fp16.loss-scale-collapse", "warn", f"fp16 loss scale is collapsing: {why}", ev, fix, data)]
    if startup:
        ev.append("DeepSpeed starts the dynamic scale high on purpose (2**initial_scale_power) and halves it on "
                  "each overflow until the gradients fit: a fall in the first steps that stops far above the "
                  f"minimum is that search ({left} halvings left), not a collapse")
        extra: list[str] = []
        if skipped >= STARTUP_MANY_SKIPS and t.last is not None and t.last >= 1:
            power = int(math.log2(t.last))
            extra.append(f'optional: "initial_scale_power": {power} in the fp16 block starts the scale where this '
                         f"search ended (2**{power}) and saves these {skipped} skipped steps next time; it only moves "
                         "the starting scale -- it changes nothing about overflows later in the run, and it does not "
                         "help a scale that keeps falling")
        title = (f"fp16 loss-scale search at the start: {fmt_scale(t.first)} -> {fmt_scale(t.last)}, {skipped} "
                 f"skipped step(s), {left} halvings above the minimum (normal with dynamic loss scaling)")
        return [Finding("fp16.overflow", "info", title, ev, extra, data)]
    rose_after = t.last_increase_line > t.last_drop_line
    if rose_after:
        ev.append("dynamic loss scaling skips the odd overflowing step and lowers the scale; it rose again after")
        title = (f"{skipped} fp16 overflow step(s) skipped, the loss scale recovered (normal with dynamic loss "
                 "scaling)")
    else:
        ev.append("dynamic loss scaling skips the odd overflowing step and lowers the scale; an isolated halving "
                  "this far above the minimum is normal")
        title = (f"{skipped} fp16 overflow step(s) skipped; the loss scale is {fmt_scale(t.last)}, "
                 f"{left if left is not None else '?'} halvings above the minimum (normal with dynamic loss scaling)")
    return [Finding("fp16.overflow", "info", title, ev, [], data)]

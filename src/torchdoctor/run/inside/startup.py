"""What the bootstrap installs in a process of a ``run --numerics`` command: import hooks only, until the program
imports torch's optimizers or a trainer (nothing of torch is imported here).

Per process it writes a ``loaded`` marker (when ``run`` will read it back), then attaches one monitor per model
trained: through the trainer's callback (:mod:`.trainers`), the DeepSpeed engine, or the first stepped optimizer
(:mod:`.plain`). What it attached to is said once on stderr (``[torchdoctor][rank1] watching GPT2LMHeadModel (124M
params) with AdamW, DDP, grads=params``) and written as an ``attached`` marker; a model the script's own monitor
already watches is left to it, with one note. The switch's monitors give way to one the script attaches later (no
hooks are doubled).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import Any

from ...runvars import REPORT_DIR_VAR
from . import markers, trainers
from .imports import when_imported

OPTION_NAMES = ("watch", "transient", "grads", "headroom", "headroom_every", "trace_steps", "abort_after_step",
                "report_dir", "record", "record_every")


def _line(text: str) -> None:
    """One line on stderr in one write (ranks sharing the stream do not run their lines together)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


class Switch:
    """One process's ``--numerics``: its options, what it attached, and how it says so (:class:`trainers.Attach`)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.monitor_kwargs = {k: options[k] for k in OPTION_NAMES if options.get(k) is not None}
        self.report_dir = str(options.get("report_dir") or os.environ.get(REPORT_DIR_VAR) or os.getcwd())
        self.monitor_kwargs["report_dir"] = self.report_dir
        self.markers = bool(options.get("markers"))  # `run` will read them
        self.driven_by_trainer = False  # a Trainer got the callback: it watches the engines it makes
        self.monitors: list[Any] = []
        self._said: set[str] = set()

    # ------------------------------------------------------------------ saying
    def _tag(self, rank: int | None = None) -> str:
        rank = markers.rank_from_env() if rank is None else rank
        return "[torchdoctor]" if rank is None else f"[torchdoctor][rank{rank}]"

    def warn(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            _line(f"{self._tag()} {text}")

    def _mark(self, monitor: Any, data: dict[str, Any]) -> None:
        if not self.markers:
            return
        if monitor.rank is not None:  # (a Lightning rank has no RANK variable: torch.distributed's)
            data["rank"] = monitor.rank
        try:
            markers.write(self.report_dir, "attached", data, n=len(self.monitors))
        except OSError as e:
            self.warn(f"cannot write to the report folder {self.report_dir}: {e}")

    def announce(self, monitor: Any, via: str) -> None:
        self.monitors.append(monitor)
        _line(f"{self._tag(monitor.rank)} watching {monitor.watching}")
        self._mark(monitor, {"watching": monitor.watching, "via": via, "own": False})

    def _own(self, monitor: Any) -> bool:
        """A monitor already watches this model: the script's own (noted once), or one of ours."""
        if monitor is None:
            return False
        if monitor.via != "switch" and monitor not in self.monitors:
            self.monitors.append(monitor)
            self.warn(f"the script attaches its own monitor ({monitor.watching}): --numerics leaves it to it")
            self._mark(monitor, {"watching": monitor.watching, "via": monitor.via, "own": True})
        return True

    # ------------------------------------------------------------------ attaching
    def plain(self, model: Any, optimizer: Any, scaler: Any, call: tuple | None = None) -> None:
        """A plain loop's model (:mod:`.plain`): from its first training forward (``call``: the module call under
        way, handed to the monitor), or from inside the first ``optimizer.step()`` (its forward was not seen)."""
        from ...numerics.monitor import NumericsMonitor, monitor_of

        if self._own(monitor_of(model)):
            return
        monitor = NumericsMonitor(model, optimizer, scaler=scaler, _via="switch", **self.monitor_kwargs)
        if call is not None:
            monitor._joined_in_forward(*call)
        else:
            monitor._joined_mid_step()
        self.announce(monitor, "plain")

    def finish(self) -> None:
        """The process ends (``atexit``): close the monitors the switch attached, so that what they found only at the
        end (a loss scaler that skipped every step) is written."""
        for monitor in self.monitors:
            if monitor.via == "switch":
                try:
                    monitor.close()
                except Exception as e:  # (the process is ending: say it, never raise)
                    self.warn(f"could not close the monitor: {type(e).__name__}: {e}")

    def engine(self, engine: Any) -> None:
        """The engine ``deepspeed.initialize`` returned."""
        try:
            from ...numerics.monitor import NumericsMonitor, monitor_of

            if not self._own(monitor_of(engine)):
                self.announce(NumericsMonitor(engine, _via="switch", **self.monitor_kwargs), "deepspeed")
        except Exception as e:
            self.warn(f"could not attach to the DeepSpeed engine: {type(e).__name__}: {e}")


def _guarded(switch: Switch, what: str, fn: Callable[[Any], None]) -> Callable[[Any], None]:
    def call(module: Any) -> None:
        try:
            fn(module)
        except Exception as e:
            switch.warn(f"--numerics could not hook {what}: {type(e).__name__}: {e}")

    return call


def install(options: dict[str, Any]) -> Switch:
    """Install the switch in this process (the bootstrap calls it at start-up)."""
    switch = Switch(options)
    try:
        if switch.markers:
            markers.write(switch.report_dir, "loaded", {"argv": list(getattr(sys, "orig_argv", sys.argv))})
    except OSError as e:
        switch.warn(f"cannot write to the report folder {switch.report_dir}: {e}")

    loops: list[Any] = []

    def first_steps(optimizer: Any, args: Any, kwargs: Any) -> None:  # torch's global step pre-hook
        if not loops:  # (imported at the first step: torch is whole by then)
            from .plain import PlainLoops

            loops.append(PlainLoops(switch.plain, switch.warn))
        return loops[0].hook(optimizer, args, kwargs)

    def optimizers(module: Any) -> None:
        module.register_optimizer_step_pre_hook(first_steps)

    def modules(module: Any) -> None:  # (torch.nn.modules.module: imported while torch is; the hooks wait for calls)
        from .first_forward import FirstForward

        FirstForward(switch.plain, switch.warn).install(module)

    when_imported("torch.nn.modules.module", _guarded(switch, "torch's modules", modules))
    when_imported("torch.optim.optimizer", _guarded(switch, "torch's optimizers", optimizers))
    atexit.register(switch.finish)
    when_imported("transformers.trainer", _guarded(switch, "the HF Trainer", lambda m: trainers.hf(m, switch)))
    for name in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        when_imported(name, _guarded(switch, "Lightning's Trainer", lambda m: trainers.lightning(m, switch)))
    when_imported("deepspeed", _guarded(switch, "deepspeed.initialize", lambda m: trainers.deepspeed(m, switch)))
    return switch

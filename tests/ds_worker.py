"""The monitor on real DeepSpeed engines on CPU (DS_ACCELERATOR=cpu, gloo): one process, or 2 under torchrun.

``python ds_worker.py OUT_DIR CASE [CASE ...]``. A case is ``z<stage>-<fp32|bf16>`` (``deepspeed.initialize``
at that ZeRO stage: a clean step with host syncs counted, then a forward inf, then a backward-only blow-up,
each on the last rank only, each at the three gradient levels where asked), ``scaler`` (DeepSpeed's real
``DynamicLossScaler`` put into a bf16 ZeRO-2 engine: overflowing steps skipped and recorded, then a scale
collapse), ``standalone-scaler`` (a DynamicLossScaler driven by hand next to a torch optimizer, the way
DeepSpeed's optimizers use it) or ``hf`` (the HF Trainer with a DeepSpeed ZeRO-2 bf16 config file).
Each rank writes ``<CASE>-rank<r>.json``. Used by tests/test_engines_deepspeed.py.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch import nn

from conftest import Boom, leave_worker  # identity forward, a gradient times 1e39 (inf) in the backward when enabled
from torchdoctor import NonFiniteError, NumericsMonitor
from torchdoctor.numerics.judge.history import resolved
from torchdoctor.syncs import SyncCounter


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.boom = Boom()
        self.boom.enabled = False
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.hidden(self.boom(self.act(self.inp(x)))))


def ds_config(stage: int, bf16: bool, gas: int = 1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_engine(stage: int, bf16: bool, gas: int = 1):
    import deepspeed

    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, bf16, gas))
    return engine


def rank_world() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def batch(engine, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    rank, _ = rank_world()
    dtype = next(engine.module.parameters()).dtype
    return (torch.randn(4, 8, generator=g) + rank).to(dtype)


def train_step(engine, x) -> None:
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def snapshot(engine) -> list[torch.Tensor]:
    """Every tensor an update would change on this rank: model weights (their local partition under
    ZeRO-3), fp32 master partitions, optimizer state."""
    out = []
    for p in engine.module.parameters():
        out.append((p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().clone())
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        out += [t.detach().clone() for t in getattr(opt, attr, [])]
    basic = getattr(engine, "basic_optimizer", None) or opt
    for state in getattr(basic, "state", {}).values():
        out += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def identical(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def error_json(e: NonFiniteError) -> dict:
    return {"first": e.first.to_json() if e.first else None, "bad_ranks": e.details.bad_ranks, "report": e.report,
            "fix": e.details.fix}


def detect(engine, grads: str, kind: str, out_dir: str, tag: str) -> dict:
    """One bad step on the last rank (kind: forward inf / backward blow-up), checked before the update."""
    rank, world = rank_world()
    bad_rank = world - 1
    result: dict = {}
    with NumericsMonitor(engine, grads=grads, report_dir=os.path.join(out_dir, tag)) as mon:
        result["names"] = sorted({i.name for i in mon._watched.infos.values()})
        result["engine"] = mon._watched.engine.kind
        result["optimizer"] = type(mon.optimizer).__name__
        train_step(engine, batch(engine, 0))
        before = snapshot(engine)
        steps_before = engine.global_steps
        x = batch(engine, 1)
        if rank == bad_rank and kind == "forward":
            x[0, 3] = float("inf")
        engine.module.boom.enabled = rank == bad_rank and kind == "backward"
        try:
            train_step(engine, x)
            result["error"] = None
        except NonFiniteError as e:
            result["error"] = error_json(e)
        finally:
            engine.module.boom.enabled = False
        result["identical"] = identical(before, snapshot(engine))
        result["optimizer_stepped"] = engine.global_steps != steps_before
        result["steps"] = mon.step_index
    engine.optimizer.zero_grad()
    return result


def run_engine_case(case: str, out_dir: str) -> dict:
    stage, dtype = case.split("-")
    engine = make_engine(int(stage[1:]), dtype == "bf16")
    out: dict = {}
    for step in range(3):  # ZeRO-3 traces its modules in the first steps: count syncs once that is done
        train_step(engine, batch(engine, step))
    with SyncCounter() as bare:
        train_step(engine, batch(engine, 3))
    with NumericsMonitor(engine) as mon:
        train_step(engine, batch(engine, 2))
        with SyncCounter() as watched:
            train_step(engine, batch(engine, 3))
        out["extra_syncs"] = watched.count - bare.count
        out["clean_steps"] = mon.step_index
        out["zero3_weights"] = [
            line.label + ("" if line.scope is None else f" ({line.scope})") + f"={line.kind or 'measured'}"
            for f in resolved(list(mon._steps.history.records)) if f.name == "hidden" for line in f.lines if line.param
        ]
    for kind in ("forward", "backward"):
        for grads in ("none", "params", "modules"):
            if kind == "backward" and grads == "none":
                continue  # the forward-only level does not look at gradients
            out[f"{kind}-{grads}"] = detect(engine, grads, kind, out_dir, f"{case}-{kind}-{grads}")
    return out


def run_scaler_case(out_dir: str, passed: bool) -> dict:
    """DeepSpeed's real DynamicLossScaler inside a real ZeRO-2 optimizer: its own skip, our records. The
    gradients overflow on the last rank only (DeepSpeed's overflow check is shared: every rank skips).
    ``passed``: the engine's own scaler is also given as ``scaler=`` (it must not change anything)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    engine = make_engine(2, True)
    engine.optimizer.loss_scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=1000, min_scale=1.0,
                                                     delayed_shift=1, consecutive_hysteresis=False)
    rank, world = rank_world()
    boom = rank == world - 1
    out: dict = {}
    scaler = engine.optimizer.loss_scaler if passed else None
    with NumericsMonitor(engine, scaler=scaler, report_dir=os.path.join(out_dir, "scaler")) as mon:
        train_step(engine, batch(engine, 0))
        engine.module.boom.enabled = boom  # two overflowing steps: DeepSpeed skips them, the monitor records them
        before = snapshot(engine)
        for step in (1, 2):
            train_step(engine, batch(engine, step))
        out["skipped_identical"] = identical(before, snapshot(engine))
        out["overflows"] = [(o.step, o.scale, o.module, o.slot) for o in mon.overflows]
        out["scale_after"] = engine.optimizer.loss_scaler.cur_scale
        engine.module.boom.enabled = False
        train_step(engine, batch(engine, 3))
        out["recovered_step_applied"] = not identical(before, snapshot(engine))
        engine.module.boom.enabled = boom  # now every step overflows: the scale falls to its floor
        try:
            for step in range(4, 20):
                train_step(engine, batch(engine, step))
            out["error"] = None
        except NonFiniteError as e:
            out["error"] = error_json(e)
        except Exception as e:  # DeepSpeed's own "cannot decrease scale anymore" would land here
            out["error"] = {"other": f"{type(e).__name__}: {e}"}
        out["final_scale"] = engine.optimizer.loss_scaler.cur_scale
        out["overflow_scales"] = [o.scale for o in mon.overflows]
    return out


def run_accumulation(out_dir: str) -> dict:
    """ZeRO-2 bf16 with gradient_accumulation_steps=2: steps are DeepSpeed's real ones (p.grad is gone after
    every micro-step, which is no sign of a skipped step), and a bad micro-step is stopped before the update."""
    engine = make_engine(2, True, gas=2)
    out: dict = {}
    with NumericsMonitor(engine, report_dir=os.path.join(out_dir, "accumulation")) as mon:
        for micro in range(4):
            train_step(engine, batch(engine, micro))
        out["clean"] = (mon.step_index, engine.global_steps, len(mon.overflows))
        before = snapshot(engine)
        try:
            train_step(engine, batch(engine, 4))
            x = batch(engine, 5)
            x[0, 0] = float("inf")
            train_step(engine, x)
            out["error"] = None
        except NonFiniteError as e:
            out["error"] = error_json(e)
        out["identical"] = identical(before, snapshot(engine))
        out["overflows"] = len(mon.overflows)
    return out


def run_standalone_scaler(out_dir: str) -> dict:
    """A DynamicLossScaler used by hand the way DeepSpeed's FP16 optimizers use it, next to torch SGD."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.utils import has_inf_or_nan

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(init_scale=2.0**3, scale_window=1000, min_scale=1.0, delayed_shift=1,
                               consecutive_hysteresis=False)
    out: dict = {}
    with NumericsMonitor(model, optimizer=opt, scaler=scaler, report_dir=os.path.join(out_dir, "standalone")) as mon:
        model.boom.enabled = True
        try:
            for _ in range(10):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                (loss * scaler.loss_scale).backward()
                overflow = any(has_inf_or_nan(p.grad) for p in model.parameters() if p.grad is not None)
                scaler.update_scale(overflow)
                if not overflow:
                    opt.step()
                opt.zero_grad()
            out["error"] = None
        except NonFiniteError as e:
            out["error"] = error_json(e)
        except Exception as e:
            out["error"] = {"other": f"{type(e).__name__}: {e}"}
        out["overflow_scales"] = [o.scale for o in mon.overflows]
    return out


def run_hf(out_dir: str) -> dict:
    """The HF Trainer with a DeepSpeed config file: NumericsCallback finds the ZeRO optimizer itself."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from torchdoctor.integrations.hf import NumericsCallback

    ds_path = os.path.join(out_dir, "ds.json")
    with open(ds_path, "w") as fh:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, "steps_per_print": 10**9}, fh)

    def trainer(model, callback, steps):
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, 64, (8,), generator=g) for _ in range(8)]
        rows = [{"input_ids": i, "labels": i.clone()} for i in ids]
        args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2, use_cpu=True,
                                 bf16=True, deepspeed=ds_path, report_to="none", save_strategy="no",
                                 logging_strategy="no", learning_rate=1e-3, disable_tqdm=True)
        return Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])

    def gpt2():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32))

    out: dict = {}
    cb = NumericsCallback()
    seen: dict = {}
    t = trainer(gpt2(), cb, 3)
    original_end = cb.on_train_end

    def on_end(*a, **k):
        seen["steps"], seen["engine"] = cb.monitor.step_index, cb.monitor._watched.engine.kind
        seen["optimizer"] = type(cb.monitor.optimizer).__name__
        return original_end(*a, **k)

    cb.on_train_end = on_end
    t.train()
    out["clean"] = seen
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight.fill_(1e37)
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):  # the weights as DeepSpeed prepared them (bf16), before any step
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            out["snapshot"] = [p.detach().clone() for p in model.parameters()]

    t = trainer(model, NumericsCallback(), 3)
    t.add_callback(Snapshot())
    try:
        t.train()
        out["error"] = None
    except NonFiniteError as e:
        out["error"] = error_json(e)
    before = out.pop("snapshot")
    out["identical"] = all(torch.equal(a, b.detach()) for a, b in zip(before, t.model.parameters()))
    return out


def main(out_dir: str, cases: list[str]) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, _ = rank_world()
    for case in cases:
        try:
            if case in ("scaler", "scaler-passed"):
                result = run_scaler_case(out_dir, passed=case == "scaler-passed")
            elif case == "accumulation":
                result = run_accumulation(out_dir)
            elif case == "standalone-scaler":
                result = run_standalone_scaler(out_dir)
            elif case == "hf":
                result = run_hf(out_dir)
            else:
                result = run_engine_case(case, out_dir)
        except Exception:
            result = {"crash": traceback.format_exc()}
        with open(os.path.join(out_dir, f"{case}-rank{rank}.json"), "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    leave_worker()  # (conftest: past a torch abort at interpreter exit)

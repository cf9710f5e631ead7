"""Training scripts that know nothing of torchdoctor, for ``torchdoctor run --numerics`` (tests/test_run_switch.py).

``python switch_worker.py KIND OUT_DIR [options]``; KIND is ``plain`` (a loop: ``--fp16`` autocast, ``--ddp``
under torchrun, ``--optimizer sgd|adamw|lbfgs``, ``--closure``), ``hf`` (the HF Trainer on a GPT-2 built from a
config), ``lightning`` (automatic optimization, ``--devices N``), ``fabric`` or ``deepspeed``
(``deepspeed.initialize``, DS_ACCELERATOR=cpu). ``--bad-step N`` makes the forward of step N overflow (on
``--bad-rank R`` only, under several ranks); ``--own-monitor`` attaches torchdoctor's monitor in the script. Each
rank writes ``OUT_DIR/result-rank<r>.json``: the steps it finished, and when an exception ended it, its type and
whether the weights were still those from before the step that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from torch import nn

SCALE = 1e6  # times an input of the bad step: fp16's range (65504) overflows in fc1, fp32's does not


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()  # (Lightning's ranks have no RANK variable)
    return int(os.environ.get("RANK", "0"))


class Result:
    """What one rank saw, written when the script ends however it ends."""

    def __init__(self, out_dir: str, params) -> None:
        self.out_dir = out_dir
        self.params = list(params)
        self.steps_done = 0
        self.before: list[torch.Tensor] = []

    def step_starts(self) -> None:
        self.before = [p.detach().clone() for p in self.params]

    @contextlib.contextmanager
    def recorded(self):
        """Write the result however the block ends (an exception is re-raised)."""
        try:
            yield self
        except BaseException as e:
            self.write(e)
            raise
        self.write()

    def run_steps(self, args, one_step) -> None:
        """``one_step(step, x, y)`` for each step, each one recorded."""
        with self.recorded():
            for step in range(args.steps):
                self.step_starts()
                x, y = batch(step)
                one_step(step, bad_input(args, step, x), y)
                self.steps_done += 1

    def write(self, error: BaseException | None = None) -> None:
        data = {"steps_done": self.steps_done, "error": type(error).__name__ if error else None,
                "identical": all(torch.equal(a, p.detach()) for a, p in zip(self.before, self.params))}
        with open(os.path.join(self.out_dir, f"result-rank{rank()}.json"), "w") as fh:
            json.dump(data, fh)


def bad_input(args, step: int, x: torch.Tensor) -> torch.Tensor:
    hit = step == args.bad_step and (args.bad_rank is None or rank() == args.bad_rank)
    scale = SCALE if args.fp16 else 1e39  # fp32: inf in the input itself
    return x * scale if hit else x


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank() + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def make_optimizer(name: str, params):
    if name == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.1, max_iter=3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01)


def own_monitor(args, model, opt):
    if not args.own_monitor:
        return None
    import torchdoctor

    return torchdoctor.NumericsMonitor(model, opt)


def plain(args) -> None:
    torch.manual_seed(0)
    model = Net()
    if args.ddp:
        torch.distributed.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer(args.optimizer, model.parameters())
    mon = own_monitor(args, model, opt)  # noqa: F841 (kept alive)
    result = Result(args.out, model.parameters())

    def one_step(step, x, y):
        def closure():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=args.fp16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            return loss

        if args.closure or args.optimizer == "lbfgs":
            opt.step(closure)
        else:
            closure()
            opt.step()

    result.run_steps(args, one_step)
    if args.ddp:
        torch.distributed.destroy_process_group()


def hf(args) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    calls = {"n": 0}

    def blow_up(module, inputs, output):  # the MLP of block 1 overflows in the forward of step --bad-step
        calls["n"] += 1
        return output * 1e39 if model.training and calls["n"] >= args.bad_step + 1 else output  # (a fault that stays)

    model.transformer.h[1].mlp.register_forward_hook(blow_up)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids} for _ in range(16)]
    callbacks = []
    if args.own_monitor:
        from torchdoctor import NumericsCallback

        callbacks.append(NumericsCallback())
    targs = TrainingArguments(output_dir=os.path.join(args.out, "hf"), per_device_train_batch_size=2,
                              max_steps=args.steps, use_cpu=True, report_to=[], save_strategy="no",
                              logging_steps=1, disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=callbacks)
    result = Result(args.out, model.parameters())

    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        def on_step_begin(self, *a, **k):
            result.step_starts()

        def on_step_end(self, *a, **k):
            result.steps_done += 1

    trainer.add_callback(Snapshots())
    with result.recorded():
        trainer.train()


def lightning(args) -> None:
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.result: Result | None = None

        def on_train_batch_start(self, batch, batch_idx):
            self.result.step_starts()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.result.steps_done += 1

        def training_step(self, b, batch_idx):
            x, y = b
            return nn.functional.mse_loss(self.net(bad_input(args, batch_idx, x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    module = Regressor()
    data = [batch(i) for i in range(args.steps)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                        max_steps=args.steps, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, logger=False, num_sanity_val_steps=0,
                        default_root_dir=os.path.join(args.out, "pl"))
    module.result = Result(args.out, module.parameters())
    with module.result.recorded():
        trainer.fit(module, loader)


def fabric(args) -> None:
    import lightning as L

    f = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = Net()
    model, opt = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    result = Result(args.out, model.parameters())

    def one_step(step, x, y):
        opt.zero_grad()
        f.backward(nn.functional.mse_loss(model(x), y))
        opt.step()

    result.run_steps(args, one_step)


def deepspeed_engine(args) -> None:
    import deepspeed

    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
              "torch_adam": True}}, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    result = Result(args.out, engine.module.parameters())

    def one_step(step, x, y):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()

    result.run_steps(args, one_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["plain", "hf", "lightning", "fabric", "deepspeed"])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bad-step", type=int, default=None)
    p.add_argument("--bad-rank", type=int, default=None)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw", "lbfgs"])
    p.add_argument("--closure", action="store_true")
    p.add_argument("--own-monitor", action="store_true")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=None)  # (the deepspeed launcher passes it)
    args = p.parse_args()
    torch.set_num_threads(1)
    {"plain": plain, "hf": hf, "lightning": lightning, "fabric": fabric, "deepspeed": deepspeed_engine}[args.kind](args)
    print(f"rank {rank()}: done", file=sys.stderr)


if __name__ == "__main__":
    main()

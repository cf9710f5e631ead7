"""Seeing changes nothing: a healthy run's losses and final weights are bit for bit the same with the monitor and
without it -- the library and the switch, a GradScaler loop, DDP, torch.compile, the HF Trainer.

The monitor only reads: its hooks measure, its first step watches every module, it keeps each call's inputs and RNG
state by reference -- none of it may consume a random number, change a value in place or reorder an op.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import identity_worker as W
from conftest import torchrun
from runs import PY, torchdoctor_run

WORKER = str(Path(__file__).with_name("identity_worker.py"))


def results(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("result-rank*.json"))}


@pytest.mark.parametrize("kind", ["scaler", "compile"])
def test_the_library_changes_nothing(tmp_path, kind):
    for name, monitor in (("bare", False), ("watched", True)):
        (tmp_path / name).mkdir()
        W.run(kind, str(tmp_path / name), monitor=monitor)
    bare, watched = results(tmp_path / "bare"), results(tmp_path / "watched")
    assert bare and bare == watched


def test_the_switch_changes_nothing(tmp_path):
    import subprocess

    bare = tmp_path / "bare"
    subprocess.run([PY, WORKER, "scaler", str(bare)], check=True, timeout=300)
    rc, rep, _, err = torchdoctor_run(tmp_path, "--numerics", "--", PY, WORKER, "scaler", str(tmp_path / "switched"),
                                      timeout=300, OMP_NUM_THREADS=str(torch.get_num_threads()))
    assert rc == 0, err[-2000:]
    assert [f["id"] for f in rep["findings"] if f["id"].startswith("numerics.")] == ["numerics.attached"]
    assert results(bare) == results(tmp_path / "switched")


def test_ddp_changes_nothing(tmp_path):
    for name, extra in (("bare", ()), ("watched", ("--with-monitor",))):
        r = torchrun(WORKER, "ddp", str(tmp_path / name), *extra, ranks=2)
        assert r.returncode == 0, r.stderr[-3000:]
    bare, watched = results(tmp_path / "bare"), results(tmp_path / "watched")
    assert len(bare) == 2 and bare == watched


def test_the_hf_trainer_changes_nothing(tmp_path):
    transformers = pytest.importorskip("transformers")
    from conftest import tiny_gpt2
    from torchdoctor.integrations.hf import NumericsCallback

    def train(callbacks: list, out: Path) -> tuple[list, list]:
        model = tiny_gpt2(seed=0)
        g = torch.Generator().manual_seed(3)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, model.config.vocab_size, (16, 12),
                                                                             generator=g)]
        args = transformers.TrainingArguments(str(out), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                                              report_to=[], save_strategy="no", use_cpu=True, seed=5,
                                              dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, [p.detach().clone() for p in model.parameters()]

    bare_losses, bare_weights = train([], tmp_path / "bare")
    watched_losses, watched_weights = train([NumericsCallback()], tmp_path / "watched")
    assert bare_losses == watched_losses and len(bare_losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(bare_weights, watched_weights, strict=True))

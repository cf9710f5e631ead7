"""Shared builders: small real transformers models made from a config (no downloads)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

logging.getLogger("transformers").setLevel(logging.ERROR)

# One compute thread in each test process and in each process a test starts (unless the test names its own): `make
# test` runs two workers on a 2-core machine, and more threads than cores only wait for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

WATCH_LEVELS = ("boundaries", "every-module")


#: the files that take longest (a minute or more of a 2-core machine), started first: `make test`'s workers take a file
#: each in the order collected, and a long file collected last runs alone at the end while the other worker idles
#: (on 2 cores the tour, collected last, left one worker idle for about 90 s of a 12-minute run)
LONGEST_FIRST = ("test_tour.py", "test_hang_matrix.py", "test_comm_processes.py", "test_comm_launcher.py",
                 "test_run_switch.py", "test_rank_agreement.py", "test_env_cli.py", "test_engines_fsdp.py",
                 "test_ddp.py", "test_precision_user_code.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest keep their order)


def pytest_generate_tests(metafunc):
    """A test (module) marked ``both_levels`` runs once per watch level: its monitors' default ``watch`` is set to
    each (a test that names ``watch=`` keeps its own)."""
    if metafunc.definition.get_closest_marker("both_levels") is not None:
        metafunc.parametrize("watch_level", WATCH_LEVELS, indirect=True)


@pytest.fixture(autouse=True)
def watch_level(request):
    level = getattr(request, "param", None)
    if level is None:
        yield None
        return
    from torchdoctor import NumericsMonitor

    defaults = NumericsMonitor.__init__.__kwdefaults__
    saved, defaults["watch"] = defaults["watch"], level
    try:
        yield level
    finally:
        defaults["watch"] = saved


def tiny_t5(seed: int = 0, **overrides):
    from transformers import T5Config, T5ForConditionalGeneration

    kw = dict(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=64,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(**kw))


def t5_batch(seed: int = 0, batch: int = 2, src: int = 8, tgt: int = 4):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(2, 64, (batch, src), generator=g),
        "labels": torch.randint(2, 64, (batch, tgt), generator=g),
    }


def tiny_gpt2(seed: int = 0, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**kw))


def gpt2_batch(seed: int = 0, batch: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def overflowing_gpt2(seed: int = 0):
    """A half-precision GPT-2 whose block 1 MLP projection overflows fp16 in the forward."""
    model = tiny_gpt2(seed).half()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight.fill_(6e4)
    return model


class GradBoom(torch.autograd.Function):
    """Identity in the forward; multiplies the gradient by 1e39 in the backward (inf in fp32)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1e39


class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enabled = True

    def forward(self, x):
        return GradBoom.apply(x) if self.enabled else x * 1


def boom_mlp(seed: int = 0) -> torch.nn.Module:
    """fc1 -> act -> boom -> fc2: finite forward, inf gradient born in boom's backward."""
    torch.manual_seed(seed)
    layers = OrderedDict(fc1=torch.nn.Linear(8, 16), act=torch.nn.GELU(), boom=Boom(), fc2=torch.nn.Linear(16, 4))
    return torch.nn.Sequential(layers)


@pytest.fixture(autouse=True)
def _diagnoses_agree_with_their_frames(monkeypatch):
    """Every report the numerics monitor writes in a test -- raised, warned about, skipped -- is read back against
    its own frames (:func:`torchdoctor.numerics.explain.evidence.contradictions`): a diagnosis sentence the frames
    printed under it do not bear out fails the test that made it, whatever that test asserts itself."""
    from torchdoctor.numerics.explain.evidence import contradictions
    from torchdoctor.numerics.explain.report import NonFiniteReport

    written: list[NonFiniteReport] = []
    original = NonFiniteReport.write

    def write(self, *args, **kwargs):
        written.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(NonFiniteReport, "write", write)
    yield
    found = {id(r): (r, contradictions(r)) for r in written}
    bad = [f"step {r.step} ({r.cause}): {c}" for r, c in found.values() if c]
    assert not bad, "a report's diagnosis disagrees with its own frames:\n" + "\n".join(bad)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Reports are written to the working directory by default: keep them out of the repo."""
    monkeypatch.chdir(tmp_path)


def leave_worker() -> None:
    """End a torchrun worker whose results are written (and its process group destroyed, if it made one): exit 0 now,
    without Python's finalization. torch 2.13's gloo (CPU) sometimes aborts a process *after* its main
    returned ("terminate called without an active exception", SIGABRT, no Python frame): seen about once in
    15-40 runs of a plain DDP + GradScaler loop that never starts a monitor, so it is not the code under test,
    and a test that reads the workers' result files must not fail on it. Called only when main() returned: a
    worker that raised still exits 1 with its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(script: str, *args: str, ranks: int = 2, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """Run ``tests/<script>`` under torchrun with ``ranks`` real processes (gloo, one thread each); it must
    exit 0. The ranks report through files, since their stdout would interleave."""
    here = Path(__file__).parent
    full_env = {**os.environ, "PYTHONPATH": str(here.parent / "src"), "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(here / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# ---------------------------------------------------------------- DeepSpeed on CPU (one process, gloo)
def _ds_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src"), "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu", **extra}


def ds_single_env(port: int) -> dict[str, str]:
    return _ds_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def deepspeed_built() -> None:
    """Build DeepSpeed's CPU comm op once (a build killed midway leaves a lock that blocks the next forever)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for lock in root.glob("*/deepspeed_shm_comm/lock"):
        if time.time() - lock.stat().st_mtime > 900:
            lock.unlink()
    code = "import deepspeed; deepspeed.init_distributed(dist_backend='gloo')"
    proc = subprocess.run([sys.executable, "-c", code], env=ds_single_env(free_port()), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

"""``torchdoctor precision`` on small models built here, each against what the target dtype then really does: values
judged by their own dtype (an fp32 buffer or an fp32 logsumexp beside fp16 values is no fp16 value), the gradients
of every tensor the fp16 backward computes (a functional op's in the model's own forward too), the loss scale said
as its backward checks found it and as a real GradScaler loop then does, a backward already non-finite in fp32,
and the model's own code named by its line with a fix that can apply."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from torchdoctor.cli import main

MODELS = '''
import torch
from torch import nn


class Normed(nn.Module):
    """A BatchNorm whose running_var (a buffer, fp32 under autocast) holds VAR; a real regression loss."""

    def __init__(self, var):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.bn.running_var.fill_(var)

    def forward(self, x, y):
        return (self.head(self.bn(self.proj(x))).float() - y).pow(2).mean()


def normed(var=4.97e5):
    torch.manual_seed(0)
    return Normed(var), (torch.randn(16, 8), torch.randn(16, 1))


def normed_near():
    return normed(5.0e4)  # within 2x of fp16's 65504, but a buffer: never an fp16 value under autocast


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 1, 16)).permute(2, 0, 3, 1, 4).unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q * 200, k * 200, v, is_causal=True)


class Attention(nn.Module):
    """Attention scores near 5e4: CPU flash attention returns their logsumexp in fp32 beside its fp16 output."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.block(x).transpose(1, 2).flatten(-2)).float().pow(2).mean()


def attention():
    torch.manual_seed(0)
    return Attention(), (torch.randn(2, 8, 16),)


class Gate(nn.Module):
    """A saturated gate in the model's own forward, its output times 50: that fp16 tensor's gradient is 50, while
    every module output's and parameter's stays below 0.01."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(0.01)
            self.proj.bias.fill_(10.0)

    def forward(self, x):
        return (torch.sigmoid(self.proj(x)) * 50).float().sum()


def gate():
    torch.manual_seed(0)
    return Gate(), (torch.randn(4, 8) * 0.1,)


class Spectrum(nn.Module):
    """A learned filterbank, then sqrt(re**2 + im**2): exactly 0 on silent frames, where sqrt's gradient is inf."""

    def __init__(self):
        super().__init__()
        self.basis = nn.Parameter(torch.randn(16, 1, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        z = torch.nn.functional.conv1d(x, self.basis, stride=4)
        re, im = z[:, :8], z[:, 8:]
        mag = torch.sqrt(re * re + im * im)
        return self.head(mag.transpose(1, 2)).float().pow(2).mean()


def spectrum():
    torch.manual_seed(0)
    x = torch.randn(2, 1, 64)
    x[:, :, 16:40] = 0  # silence
    return Spectrum(), (x,)


class Tiny(nn.Module):
    """The model's own forward scales a module's output down to 1e-9: fp16 flushes those values to zero."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        small = self.proj(x) * 1e-9
        return small.float().pow(2).mean() * 1e18


def tiny():
    torch.manual_seed(0)
    return Tiny(), (torch.randn(4, 8),)
'''


@pytest.fixture
def models(tmp_path, monkeypatch):
    (tmp_path / "models36.py").write_text(textwrap.dedent(MODELS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import models36

    return importlib.reload(models36)


def line_of(text: str) -> int:
    """The line of ``text`` in the module written from MODELS."""
    return MODELS.splitlines().index(text) + 1


def run(spec: str, capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["precision", spec, "--json", *args])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def finding(result: dict, fid: str) -> dict | None:
    return next((f for f in result["findings"] if f["id"] == fid), None)


def assert_scale_agrees_with_its_checks(result: dict) -> None:
    """A failed check at a scale is never followed by "that scale works"."""
    f = finding(result, "precision.loss-scale")
    if f is None:
        return
    failed = {c["power"] for c in f["data"]["checks"] if not c["ok"]}
    for power in failed:
        assert f"the default 2**{power} works" not in f["title"] and f"start at 2**{power}" not in f["title"]
        assert not any(f"init_scale=2.0**{power})" in line for line in f["fix"])


def skipped_steps(model: nn.Module, batch: tuple, power: int, steps: int = 12) -> tuple[int, list[float]]:
    """A real fp16 loop on CPU (autocast, GradScaler from 2**power, SGD): how many of its first steps the scaler
    skipped (the scale went down), and the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** power, growth_interval=10 ** 6)
    skipped, losses = 0, []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(*batch) if isinstance(batch, tuple) else model(**batch).loss
        before = scaler.get_scale()
        scaler.scale(loss.float()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped += scaler.get_scale() < before
        losses.append(float(loss.detach()))
    return skipped, losses


def test_a_buffer_is_judged_as_a_buffer(models, capsys):
    """running_var is fp32 under autocast: no fp16 value, not absorbed, not at risk; but model.half() turns a
    running_var beyond 65504 into inf, and that is said."""
    rc, result = run("models36:normed", capsys)
    assert not result["overflow"] and not result["at_risk"] and not result["absorbed"]
    over = finding(result, "precision.buffers-out-of-range")
    assert over["severity"] == "warn" and over["data"]["buffers"][0][0] == "bn.running_var"
    assert "a model cast to fp16 (model.half(), DeepSpeed fp16) turns them inf" in over["title"]
    model, _ = models.normed()
    assert torch.isinf(model.half().bn.running_var).all()  # what it says, seen
    rc, result = run("models36:normed_near", capsys)  # 5e4: within 2x of 65504, but never an fp16 value
    assert rc == 0 and result["verdict"] == "safe" and not result["at_risk"] and not result["buffers"]["over"]
    model, _ = models.normed_near()
    assert torch.isfinite(model.half().bn.running_var).all()


def test_an_fp32_logsumexp_beside_fp16_attention_is_no_fp16_value(models, capsys):
    rc, result = run("models36:attention", capsys)
    assert rc == 0 and result["verdict"] == "safe", result["findings"]
    assert not result["at_risk"] and not result["overflow"] and result["fix"] is None
    # what the fp16 forward computes: the attention's output in fp16, its logsumexp in fp32 and large
    from torchdoctor.precision.ops import Recorder

    model, batch = models.attention()
    recorder = Recorder(torch.float16, measure=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), recorder:
        assert torch.isfinite(model(*batch))
    flash = next(op for op in recorder.read() if "attention" in op.name)
    assert flash.outs[0] == torch.float16 and torch.float32 in flash.outs[1:]
    q, k, _ = model.block.qkv(batch[0]).unflatten(-1, (3, 1, 16)).permute(2, 0, 3, 1, 4).unbind(0)
    scores = (q * 200) @ (k * 200).transpose(-1, -2) / 4
    assert scores.amax() > 65504 / 2  # its fp32 values are past 2x of fp16's range: they used to be counted


def test_the_gradient_of_a_functional_op_in_the_models_own_forward_counts(models, capsys):
    """torch.sigmoid(...) * 50 in the forward: its fp16 gradient is 50; the largest scale that keeps it finite is
    2**10 (50 * 2**10 < 65504 < 50 * 2**11), and a GradScaler loop from the default 2**16 skips 6 steps."""
    rc, result = run("models36:gate", capsys)
    assert_scale_agrees_with_its_checks(result)
    scale = finding(result, "precision.loss-scale")
    assert 49 < result["loss_scale"]["grad_peak"] <= 50.01
    assert scale["severity"] == "warn" and scale["title"].startswith("loss scale: start at 2**10 (checked)")
    checks = {c["power"]: c["ok"] for c in scale["data"]["checks"]}
    assert checks[10] and not checks[11] and not checks[16]
    assert any("the first 6 step(s) overflow" in line for line in scale["fix"])
    model, batch = models.gate()
    assert skipped_steps(model, batch, 16)[0] == 6  # what a real loop does
    model, batch = models.gate()
    assert skipped_steps(model, batch, 10)[0] == 0


def test_a_bf16_trained_llama_on_random_ids_is_not_no_loss_scale_works(tmp_path, capsys):
    """Large logits (what bf16 training leaves; here the head scaled x30): most logit gradients are tiny and fp16
    flushes them, but they carry nothing the parameters' gradients need -- scales do train."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(tmp_path / "llama", safe_serialization=True)
    rc, result = run(str(tmp_path / "llama"), capsys)
    assert_scale_agrees_with_its_checks(result)
    scale = finding(result, "precision.loss-scale")
    assert rc == 0 and scale["severity"] != "fail", scale
    ok = sorted(c["power"] for c in scale["data"]["checks"] if c["ok"])
    assert ok
    ids = torch.randint(0, 4096, (2, 128), generator=torch.Generator().manual_seed(0))
    for power in (8, max(ok)):
        trained = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
        skipped, losses = skipped_steps(trained, {"input_ids": ids, "labels": ids}, power, steps=3)
        assert skipped == 0 and all(torch.isfinite(torch.tensor(losses)))


def test_a_backward_already_nan_in_fp32_is_said_with_where(models, capsys):
    rc, result = run("models36:spectrum", capsys)
    assert rc == 1 and result["verdict"] == "broken"
    fault = finding(result, "precision.fp32-nonfinite")
    assert fault["severity"] == "fail" and fault["data"]["params"] == ["basis"]
    where = f"models36.py:{line_of('        mag = torch.sqrt(re * re + im * im)')} in forward"
    assert f"the one sqrt at {where} sent back" in fault["evidence"][0]
    assert finding(result, "precision.safe") is None
    model, (x,) = models.spectrum()
    model(x).backward()
    assert torch.isnan(model.basis.grad).any()  # fp32 itself, as said


def test_the_models_own_code_is_named_by_its_line_with_a_fix_that_can_apply(models, capsys):
    rc, result = run("models36:tiny", capsys)
    under = finding(result, "precision.underflow")
    where = f"models36.py:{line_of('        small = self.proj(x) * 1e-9')} in forward"
    assert f"of the nonzero values (the model) at {where} computes to zero" in under["title"]
    assert not any("keep_fp32" in line for line in under["fix"])  # keeping the root in fp32 is no fp16 at all
    assert any(f"({where}), outside any submodule" in line and "torch.autocast('cpu', enabled=False)" in line
               for line in under["fix"])
    said = json.dumps(result)
    assert "'s nonzero" not in said and "keep_fp32(model, '')" not in said

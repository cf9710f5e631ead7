"""``torchdoctor precision``: real transformers models built from configs and saved as safetensors folders, real
factories imported from a temp folder; the prediction checked against an fp16 forward of the same model."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from torchdoctor.cli import main
from torchdoctor.precision.fix import find_regions
from torchdoctor.precision.predict import predict
from torchdoctor.precision.probe import run_probe


def gpt2(scale: float = 1.0, layer: int = 1) -> GPT2LMHeadModel:
    """A tiny GPT-2 whose block ``layer`` MLP weights are ``scale`` times larger (what bf16 pretraining leaves)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64))
    with torch.no_grad():
        model.transformer.h[layer].mlp.c_fc.weight.mul_(scale)
        model.transformer.h[layer].mlp.c_proj.weight.mul_(scale)
    return model


def saved(tmp_path, model, name: str = "model"):
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # (what building and saving the model printed: DeepSpeed's import line)
    rc = main(["precision", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_an_fp16_overflow_is_predicted_where_an_fp16_forward_goes_inf_and_the_fix_is_verified(tmp_path, capsys):
    rc, out, _ = cli([saved(tmp_path, gpt2(1000.0)), "--seq-len", "32", "--json"], capsys)
    result = json.loads(out)
    assert rc == 1 and result["verdict"] == "overflow"
    first = result["overflow"][0]
    assert first["module"] == "transformer.h.1.mlp.c_proj" and first["peak"] > 65504 and first["headroom"] < 1
    assert result["observed_first"] == "transformer.h.1.mlp.c_proj"  # the same model's fp16 forward agrees
    fix = result["fix"]
    assert fix["verified"] and "transformer.h.1.mlp.c_proj" in fix["regions"] and fix["param_share"] < 0.5
    ids = [f["id"] for f in result["findings"]]
    assert ids[0] == "precision.overflow" and "precision.loss-scale" in ids
    overflow = result["findings"][0]
    assert any("torchdoctor.keep_fp32(model, 'transformer.h.1.mlp.c_proj')" in line for line in overflow["fix"])

    # the suggested regions, applied by hand: the fp16 forward is finite again
    model = gpt2(1000.0)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    import torchdoctor

    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        assert not torch.isfinite(model(x, labels=x).loss)
        guards = [torchdoctor.keep_fp32(model, r) for r in fix["regions"]]
        assert torch.isfinite(model(x, labels=x).loss)
    for g in guards:
        g.remove()


def test_a_healthy_model_is_safe_and_bf16_holds_what_fp16_cannot(tmp_path, capsys):
    rc, out, _ = cli([saved(tmp_path, gpt2()), "--seq-len", "16"], capsys)
    assert rc == 0 and "verdict: safe" in out and "[OK] no value computed in fp16" in out
    assert "the default 2**16 works" in out
    rc, out, _ = cli([saved(tmp_path, gpt2(1000.0), "big"), "--seq-len", "16", "--dtype", "bf16", "--json"], capsys)
    result = json.loads(out)
    assert rc == 0 and result["verdict"] == "safe" and result["loss_scale"] is None


def test_values_a_saturating_function_absorbs_are_said_not_counted():
    model = gpt2(300.0)  # GELU's x**3 overflows in fp16, tanh(inf) = 1: its output stays finite
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    prediction = predict(run_probe(model, {"input_ids": x, "labels": x}, torch.float16, "cpu"))
    assert not prediction.overflow and prediction.observed_first is None
    assert [s.module for s in prediction.absorbed] == ["transformer.h.1.mlp.act"]
    assert prediction.absorbed[0].op == "pow" and not prediction.absorbed[0].reaches_output


def test_a_weight_beyond_fp16_is_named_and_kept_in_fp32(tmp_path, capsys):
    model = gpt2()
    with torch.no_grad():
        model.transformer.h[0].attn.c_proj.weight[0, 0] = 1e5  # a bf16 checkpoint's outlier
    rc, out, _ = cli([saved(tmp_path, model), "--seq-len", "16", "--json"], capsys)
    result = json.loads(out)
    assert rc == 1 and result["weights"]["over"][0][0] == "transformer.h.0.attn.c_proj.weight"
    assert "transformer.h.0.attn.c_proj" in result["fix"]["regions"] and result["fix"]["verified"]


FACTORIES = '''
import torch
from torch import nn


class Wide(nn.Module):
    """Gradients from ~1e4 down to ~1e-10: wider than fp16 can hold at any loss scale."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).sum()


def wide():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    x[:, :4] *= 1e4
    x[:, 4:] *= 1e-10
    return Wide(), (x,)


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
    return model, (torch.randn(4, 16) * 1e-9,)


def not_a_pair():
    return nn.Linear(2, 2)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4).requires_grad_(False)

    def forward(self, x):
        return self.proj(x)


def frozen():
    return Frozen(), (torch.randn(2, 8),)


def wrong_shape():
    return nn.Linear(64, 4), (torch.randn(2, 10),)


class Saturating(nn.Module):
    """An fp16 overflow inside the model's own code that tanh absorbs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight[0, 0] = 1e6

    def forward(self, x):
        return self.proj(x).tanh()


def saturating():
    return Saturating(), (torch.ones(2, 8),)


def raises():
    raise RuntimeError("no data here")
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mymodels"


def test_no_loss_scale_fits_a_gradient_range_wider_than_fp16(factories, capsys):
    rc, out, _ = cli([f"{factories}:wide", "--json"], capsys)
    result = json.loads(out)
    scale = result["loss_scale"]
    assert rc == 1 and not scale["works"] and scale["grad_peak"] > 1e3
    finding = next(f for f in result["findings"] if f["id"] == "precision.loss-scale")
    assert finding["severity"] == "fail" and "bf16" in finding["fix"][0]


def test_values_fp16_flushes_to_zero_are_counted_per_module(factories, capsys):
    rc, out, _ = cli([f"{factories}:tiny", "--json"], capsys)
    result = json.loads(out)
    modules = {u["module"]: u for u in result["underflow"]}
    assert "0" in modules and modules["0"]["flushed"] > 0.5  # 1e-9-scale values: below fp16's 2**-25
    assert any(f["id"] == "precision.underflow" for f in result["findings"])


def test_no_gradient_to_measure_is_not_an_overflow_and_the_root_is_named(factories, capsys):
    rc, out, _ = cli([f"{factories}:frozen", "--json"], capsys)
    assert rc == 0 and json.loads(out)["verdict"] == "safe"
    rc, out, _ = cli([f"{factories}:saturating", "--json"], capsys)
    absorbed = next(f for f in json.loads(out)["findings"] if f["id"] == "precision.absorbed")
    line = FACTORIES.splitlines().index("        return self.proj(x).tanh()") + 1  # (the file is written dedented)
    assert absorbed["title"].startswith(f"inside (the model) at mymodels.py:{line} in forward (Saturating)")


@pytest.mark.parametrize("spec, message", [
    ("mymodels:wrong_shape", "the model's forward or backward on the batch raised RuntimeError: mat1 and mat2"),
    ("mymodels:not_a_pair", "must return (model, batch)"),
    ("mymodels:raises", "the factory raised RuntimeError: no data here"),
    ("mymodels:missing", "mymodels has no missing"),
    ("nosuchmodule:build", "cannot import nosuchmodule"),
    ("./nowhere", "no such folder"),
])
def test_bad_factories_and_paths_are_one_line_exit_2(factories, capsys, spec, message):
    rc, out, err = cli([spec], capsys)
    assert rc == 2 and out == "" and message in err and "Traceback" not in err


def test_pickled_weights_are_refused_and_text_needs_a_tokenizer(tmp_path, capsys):
    folder = tmp_path / "pickled"
    model = gpt2()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # what older transformers saved by default
    rc, _, err = cli([str(folder), "--seq-len", "16"], capsys)
    assert rc == 2 and "never unpickles" in err and "safe_serialization=True" in err
    good = saved(tmp_path, gpt2(), "good")
    (tmp_path / "text.txt").write_text("hello world\n")
    rc, _, err = cli([good, "--batch", str(tmp_path / "text.txt"), "--seq-len", "16"], capsys)
    assert rc == 2 and "has no tokenizer" in err
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5]}\n')
    rc, out, _ = cli([good, "--batch", str(tmp_path / "ids.jsonl"), "--json"], capsys)
    assert rc == 0 and json.loads(out)["batch"].startswith("2 row(s) of --batch ids.jsonl, token ids as given")
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 999]}\n')
    rc, _, err = cli([good, "--batch", str(tmp_path / "bad.jsonl")], capsys)
    assert rc == 2 and "token id 999 is outside the vocabulary (0..255)" in err
    (tmp_path / "mixed.jsonl").write_text('{"input_ids": [1, 2]}\n{"text": "hello"}\n')
    rc, _, err = cli([good, "--batch", str(tmp_path / "mixed.jsonl")], capsys)
    assert rc == 2 and "some lines give input_ids and others text" in err
    rc, _, err = cli([good, "--seq-len", "999"], capsys)
    assert rc == 2 and "at most 64 positions" in err
    for device in ("bogus", "meta"):
        rc, _, err = cli([good, "--device", device], capsys)
        assert rc == 2 and err.startswith(f"torchdoctor precision: --device {device}: ") and "Traceback" not in err
    with pytest.MonkeyPatch.context() as mp:  # (a machine without CUDA, whatever this one has)
        mp.setattr(torch.cuda, "is_available", lambda: False)
        rc, _, err = cli([good, "--device", "cuda"], capsys)
    assert rc == 2 and "torch sees no CUDA device here" in err


def test_text_is_tokenized_by_the_folders_tokenizer_and_encoder_decoder_models_get_decoder_inputs(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration, T5Model

    folder = saved(tmp_path, gpt2())
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)
    (tmp_path / "text.txt").write_text("hello world\nworld hello hello\n")
    rc, out, _ = cli([folder, "--batch", str(tmp_path / "text.txt"), "--json"], capsys)
    result = json.loads(out)
    assert rc == 0 and result["batch"] == ("2 row(s) of --batch text.txt, tokenized by the folder's tokenizer, up to "
                                           "3 tokens")
    torch.manual_seed(0)
    config = T5Config(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=64,
                      decoder_start_token_id=0, pad_token_id=0)
    for model in (T5ForConditionalGeneration(config), T5Model(config)):  # labels; decoder_input_ids
        rc, out, _ = cli([saved(tmp_path, model, type(model).__name__), "--seq-len", "8", "--json"], capsys)
        result = json.loads(out)
        assert rc == 0 and result["verdict"] == "safe" and result["paired"]
        assert result["model"].startswith(type(model).__name__)


def test_the_search_widens_a_region_until_the_forward_and_backward_are_clean():
    model = gpt2(1000.0)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}
    probe = run_probe(model, batch, torch.float16, "cpu")
    prediction = predict(probe)
    fix = find_regions(model, batch, probe, prediction)
    # c_proj's overflow, and GELU's x**3 whose backward (3 x**2) overflows at any scale: both kept; dropout, which
    # only passes c_proj's value on, is pruned once c_proj computes in fp32
    assert fix.verified and fix.regions == ["transformer.h.1.mlp.act", "transformer.h.1.mlp.c_proj"]
    assert all(p.grad is None for p in model.parameters())  # the checks put .grad back

"""How often ``torchdoctor precision`` predicts what fp16 training then does, and what the prediction costs.

Run from the repository root (CPU, about 2 minutes)::

    .venv/bin/python benchmarks/precision_accuracy.py                 # the development cases
    .venv/bin/python benchmarks/precision_accuracy.py --set held      # the cases kept back, judged once
    .venv/bin/python benchmarks/precision_accuracy.py --json out.json

Cases are models built from transformers configs (no downloads) -- GPT-2, BERT, Llama, T5 and, kept back, OPT,
RoBERTa, Mistral, GPT-NeoX -- healthy as initialized, or with a few MLP weights scaled the way bf16 pretraining
leaves some layers (x50-x300, in one block), plus the demo's T5. For each: the prediction (one fp16-autocast
forward, one fp32 forward and backward, then the fix search and its verification), and what happens when the same
model trains ``--steps`` steps in fp16 (CPU autocast, GradScaler, AdamW) with ``NumericsMonitor``: the first
module it names, or none. The prediction agrees when the named module is among the predicted overflow (or
at-risk) modules, or, when training stays finite, when the verdict is "safe" or "at-risk".
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

sys.path.insert(0, "src")

# (architecture, block whose MLP is scaled or None for the model as initialized, the MLP output's fp32 peak the
# scaling aims at, as a multiple of fp16's largest value)
DEV = [
    ("gpt2", None, None), ("gpt2", 1, 0.25), ("gpt2", 1, 0.7), ("gpt2", 1, 1.5), ("gpt2", 1, 4.0),
    ("bert", None, None), ("bert", 1, 0.25), ("bert", 1, 0.7), ("bert", 1, 1.5), ("bert", 1, 4.0),
    ("llama", None, None), ("llama", 1, 0.25), ("llama", 1, 0.7), ("llama", 1, 1.5), ("llama", 1, 4.0),
    ("t5", None, None), ("t5", 1, 0.7), ("t5", 1, 1.5), ("t5", 1, 4.0),
    ("demo", None, None),
]
HELD = [
    ("opt", None, None), ("opt", 1, 0.25), ("opt", 1, 0.7), ("opt", 1, 1.5), ("opt", 1, 4.0),
    ("roberta", None, None), ("roberta", 2, 0.7), ("roberta", 2, 2.0),
    ("mistral", None, None), ("mistral", 2, 0.25), ("mistral", 2, 1.5), ("mistral", 2, 4.0),
    ("gptneox", None, None), ("gptneox", 1, 0.7), ("gptneox", 1, 1.5), ("gptneox", 1, 4.0),
    ("gpt2", 2, 2.5), ("llama", 0, 2.5),
]
FP16_MAX = 65504.0


def build(arch: str, seed: int = 0):
    """(model, the names of its MLP weights per block) for ``arch``, a small config of that family."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if arch == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=128))
        return m, lambda i: [m.transformer.h[i].mlp.c_fc, m.transformer.h[i].mlp.c_proj]
    if arch == "bert":
        m = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                             intermediate_size=512, vocab_size=1024, max_position_embeddings=128))
        return m, lambda i: [m.bert.encoder.layer[i].intermediate.dense, m.bert.encoder.layer[i].output.dense]
    if arch == "roberta":
        m = tf.RobertaForMaskedLM(tf.RobertaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                                   intermediate_size=512, vocab_size=1024,
                                                   max_position_embeddings=130))
        return m, lambda i: [m.roberta.encoder.layer[i].intermediate.dense, m.roberta.encoder.layer[i].output.dense]
    if arch in ("llama", "mistral"):
        cfg_cls, model_cls = ((tf.LlamaConfig, tf.LlamaForCausalLM) if arch == "llama"
                              else (tf.MistralConfig, tf.MistralForCausalLM))
        m = model_cls(cfg_cls(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=344, vocab_size=1024, max_position_embeddings=128))
        return m, lambda i: [m.model.layers[i].mlp.up_proj, m.model.layers[i].mlp.down_proj]
    if arch == "t5":
        m = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=3, num_decoder_layers=3, d_model=128, d_ff=512,
                                                      d_kv=32, num_heads=4, vocab_size=1024,
                                                      decoder_start_token_id=0, pad_token_id=0))
        return m, lambda i: [m.encoder.block[i].layer[1].DenseReluDense.wi,
                             m.encoder.block[i].layer[1].DenseReluDense.wo]
    if arch == "opt":
        m = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, ffn_dim=512,
                                           vocab_size=1024, max_position_embeddings=128, word_embed_proj_dim=128))
        return m, lambda i: [m.model.decoder.layers[i].fc1, m.model.decoder.layers[i].fc2]
    if arch == "gptneox":
        m = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                                   intermediate_size=512, vocab_size=1024,
                                                   max_position_embeddings=128))
        return m, lambda i: [m.gpt_neox.layers[i].mlp.dense_h_to_4h, m.gpt_neox.layers[i].mlp.dense_4h_to_h]
    raise ValueError(arch)


def _peak(model, layer, batch) -> float:
    """The fp32 magnitude of ``layer``'s output on ``batch`` (a plain forward hook: measured apart from the tool)."""
    seen = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(float(o.detach().abs().amax())))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    return max(seen)


def case(arch: str, block: int | None, ratio: float | None, seq: int, batch: int):
    """(model, batch, the scaling factor, the peak reached as a multiple of fp16's max)."""
    if arch == "demo":
        from torchdoctor.demo.model import precision_case

        return (*precision_case(0), None, None)
    model, mlp = build(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (batch, seq), generator=g)
    data = {"input_ids": ids, "labels": ids}
    if block is None:
        return model, data, None, None
    first, second = mlp(block)
    model.eval()  # (calibrated without dropout)
    factor = 1.0
    for _ in range(4):  # both matrices scaled: the output grows about as factor**2; a few fixed-point steps
        now = _peak(model, second, data)
        step = (ratio * FP16_MAX / now) ** 0.5
        with torch.no_grad():
            first.weight.mul_(step)
            second.weight.mul_(step)
        factor *= step
    reached = _peak(model, second, data) / FP16_MAX
    model.train()
    return model, data, factor, reached


def observe(model, batch, steps: int) -> str | None:
    """Train ``steps`` fp16 steps (CPU autocast, GradScaler, AdamW) with the monitor: the first module it names."""
    import tempfile

    from torchdoctor import NonFiniteError, NumericsMonitor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    model.train()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with NumericsMonitor(model, optimizer=opt, report_dir=tmp):
                for _ in range(steps):
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = model(**batch).loss
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
        except NonFiniteError as e:
            return e.first.module if e.first is not None else "(unnamed)"
    return None


def run_case(arch: str, block: int | None, ratio: float | None, args) -> dict:
    from torchdoctor.precision.fix import find_regions
    from torchdoctor.precision.predict import predict
    from torchdoctor.precision.probe import run_probe

    model, batch, factor, reached = case(arch, block, ratio, args.seq, args.batch)
    params = sum(p.numel() for p in model.parameters())
    trained = copy.deepcopy(model)
    t0 = time.perf_counter()
    probe = run_probe(model, batch, torch.float16, "cpu")
    prediction = predict(probe)
    t1 = time.perf_counter()
    fix = find_regions(model, batch, probe, prediction) if prediction.overflow or prediction.at_risk else None
    t2 = time.perf_counter()
    bad = prediction.overflows
    verdict = "overflow" if bad else "at-risk" if prediction.at_risk else "safe"
    named = observe(trained, batch, args.steps)
    predicted = [s.module for s in prediction.overflow]
    risky = [s.module for s in prediction.at_risk]
    agree = (named in predicted + risky) if named is not None else verdict in ("safe", "at-risk")
    name = arch if block is None else f"{arch} mlp{block} x{factor:.0f} ({reached:.2f} max)"
    return {"case": name, "params": params, "verdict": verdict, "predicted": predicted[:3], "at_risk": risky[:3],
            "observed": named, "agree": agree, "fix": fix.regions if fix else None,
            "fix_verified": fix.verified if fix else None, "measure_s": t1 - t0, "verify_s": t2 - t1}


def sizes(args) -> None:
    """Seconds for the prediction (two passes) and the fix search with its verification, GPT-2 at three sizes,
    one MLP scaled to 1.5x fp16's max (so the search runs), batch 2 x 128 tokens."""
    import transformers as tf

    from torchdoctor.precision.fix import find_regions
    from torchdoctor.precision.predict import predict
    from torchdoctor.precision.probe import run_probe

    tf.logging.set_verbosity_error()
    for layers, width in ((4, 128), (6, 384), (12, 768)):
        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                                 vocab_size=50257, n_positions=256))
        ids = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(1))
        data = {"input_ids": ids, "labels": ids}
        first, second = model.transformer.h[1].mlp.c_fc, model.transformer.h[1].mlp.c_proj
        model.eval()
        for _ in range(4):
            step = (1.5 * FP16_MAX / _peak(model, second, data)) ** 0.5
            with torch.no_grad():
                first.weight.mul_(step)
                second.weight.mul_(step)
        model.train()
        t0 = time.perf_counter()
        model(**data).loss.backward()
        model.zero_grad()
        t1 = time.perf_counter()
        probe = run_probe(model, data, torch.float16, "cpu")
        prediction = predict(probe)
        t2 = time.perf_counter()
        fix = find_regions(model, data, probe, prediction)
        t3 = time.perf_counter()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"GPT-2 {layers} x {width} ({params:.0f}M): a plain fp32 forward+backward {t1 - t0:.2f} s; prediction "
              f"{t2 - t1:.2f} s ({(t2 - t1) / (t1 - t0):.1f}x); fix search + verification {t3 - t2:.2f} s "
              f"({fix.rounds} round(s), regions {fix.regions})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=("dev", "held"), default="dev")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--sizes", action="store_true", help="time the prediction on GPT-2 at three sizes instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.sizes:
        sizes(args)
        return
    rows = []
    for arch, block, ratio in DEV if args.set == "dev" else HELD:
        row = run_case(arch, block, ratio, args)
        rows.append(row)
        print(f"{row['case']:30s} {row['params'] / 1e6:5.2f}M  predicted {row['verdict']:8s} "
              f"{(row['predicted'] or row['at_risk'] or ['-'])[0]:45s} observed {row['observed'] or '(finite)':45s} "
              f"{'agree' if row['agree'] else 'DISAGREE'}  {row['measure_s']:.2f}+{row['verify_s']:.2f} s",
              flush=True)
    agree = sum(r["agree"] for r in rows)
    print(f"\n{agree}/{len(rows)} agree ({args.set} set, {args.steps} fp16 steps, batch {args.batch} x {args.seq})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

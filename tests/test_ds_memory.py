"""``torchdoctor ds memory``: parity with DeepSpeed's own estimators, the new rows by hand, --model on real
transformers configs, the findings, and bad input (exit 2)."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchdoctor.deepspeed import memory as M
from torchdoctor.deepspeed import memory_rules, memory_run

ds_zero2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
ds_zero3 = pytest.importorskip("deepspeed.runtime.zero.stage3")

GIB = 2**30
PARAMS = [1, 7, 1_000_003, 125_000_000, 1_300_000_000, 6_738_415_616, 7_000_000_000, 70_000_000_000, 175e9]
GPN = [1, 4, 8]
NODES = [1, 2, 4]


def close(a: float, b: float, rel: float = 1e-3) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    memory_run.add_arguments(parser)
    rc = memory_run.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def rows_by_key(rows):
    return {r.key: r for r in rows}


# -- parity with DeepSpeed -------------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [int(p) for p in PARAMS])
def test_zero2_rows_equal_deepspeed(total):
    for gpn, nodes, cpu_offload in itertools.product(GPN, NODES, (True, False)):
        want = ds_zero2.estimate_zero2_model_states_mem_needs(total, gpn, nodes, cpu_offload, 1.5)
        rows = rows_by_key(M.estimate(M.Inputs(total, None, gpn, nodes), ("fp16", "bf16")))
        for precision in ("fp16", "bf16"):
            r = rows[(2, "none", "cpu" if cpu_offload else "none", None, precision)]
            assert r.source == "deepspeed"
            assert close(r.cpu_bytes, want[0]) and close(r.gpu_bytes, want[1]), (gpn, nodes, cpu_offload, r, want)
            assert (r.cpu_bytes, r.gpu_bytes) == want  # same arithmetic: equal to the byte


@pytest.mark.parametrize("total", [int(p) for p in PARAMS if p >= 7])
def test_zero3_rows_equal_deepspeed(total):
    for frac, gpn, nodes in itertools.product((0.001, 0.02, 0.3, 1.0), GPN, NODES):
        largest = max(1, int(total * frac))
        rows = rows_by_key(M.estimate(M.Inputs(total, largest, gpn, nodes), ("fp16", "bf16")))
        for opt, param, zero_init in itertools.product((True, False), (True, False), (True, False)):
            if not opt and param:
                continue  # DeepSpeed's estimator skips it too
            cpu, gpu, _ = ds_zero3.estimate_zero3_model_states_mem_needs(
                total, largest, gpn, nodes, cpu_offload=opt, cpu_offload_params=param, zero_init=zero_init,
                additional_buffer_factor=1.5)
            for precision in ("fp16", "bf16"):
                key = (3, "cpu" if param else "none", "cpu" if opt else "none", zero_init, precision)
                r = rows[key]
                assert r.source == "deepspeed"
                assert close(r.cpu_bytes, cpu) and close(r.gpu_bytes, gpu), (key, gpn, nodes, r, cpu, gpu)
                assert (r.cpu_bytes, r.gpu_bytes) == (cpu, gpu)


def test_deepspeed_rows_are_exactly_the_ones_deepspeed_prints():
    rows = M.estimate(M.Inputs(7_000_000_000, 131_072_000, 8, 1))
    ds = sorted((r.stage, r.offload_param, r.offload_optimizer, r.zero_init) for r in rows
                if r.source == "deepspeed" and r.precision == "fp16")
    assert ds == sorted([(2, "none", "cpu", None), (2, "none", "none", None)]
                        + [(3, p, o, z) for p, o in (("cpu", "cpu"), ("none", "cpu"), ("none", "none"))
                           for z in (True, False)])
    assert not [r for r in rows if r.source == "deepspeed" and r.precision == "fp32"]


def test_reference_check_numbers_7b_on_1x8():
    rows = rows_by_key(M.estimate(M.Inputs(7_000_000_000, 131_072_000, 8, 1), ("fp16",)))

    def pair(key):
        r = rows[key + ("fp16",)]
        return round(r.cpu_gib, 2), round(r.gpu_gib, 2)

    assert pair((2, "none", "cpu", None)) == (312.92, 13.04)
    assert pair((2, "none", "none", None)) == (312.92, 27.71)
    assert pair((3, "cpu", "cpu", True)) == (176.02, 0.49)


def test_model_parity_with_deepspeed_model_to_params():
    """Our counter on a real CPU model agrees with DeepSpeed's model_to_params (tied weights once)."""
    from conftest import tiny_gpt2, tiny_t5

    for model in (tiny_gpt2(), tiny_t5()):
        total, largest, _ = M.count_params(model)
        assert (total, largest) == ds_zero3.model_to_params(model)
        assert total == ds_zero2.model_to_params(model)
        assert total < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))  # a tie was removed


# -- the new rows, by hand -------------------------------------------------------------------------------------


def test_new_rows_by_hand():
    inp = M.Inputs(1000, 100, gpus_per_node=2, nodes=1)
    r = rows_by_key(M.estimate(inp))
    get = lambda *k: (r[k].cpu_bytes, r[k].gpu_bytes)  # noqa: E731
    # ZeRO-0: 2+2 weights/grads, 4 fp32 grad copy, 4 master, 8 Adam = 20 B; fp32: 4+4+8 = 16 B (no master)
    assert get(0, "none", "none", None, "fp16") == (4 * 1000 * 2 * 1.5, 20 * 1000)
    assert get(0, "none", "none", None, "fp32") == (12000, 16 * 1000)
    # ZeRO-1: weights+grads replicated; fp32 grad copy + master + Adam (16 B) sharded; fp32: 8 B + 12 B/G
    assert get(1, "none", "none", None, "bf16") == (12000, 4 * 1000 + 16 * 1000 // 2)
    assert get(1, "none", "none", None, "fp32") == (12000, 8 * 1000 + 12 * 1000 // 2)
    assert get(1, "none", "cpu", None, "fp16") == (1000 * max(4 * 2, 16) * 1.5, 4 * 1000)
    # ZeRO-2 fp32: weights replicated, grads 4 + master clone 4 + Adam 8 sharded
    assert get(2, "none", "none", None, "fp32") == (12000, 4 * 1000 + 16 * 1000 // 2)
    assert get(2, "none", "cpu", None, "fp32") == (24000, 4 * 1000)
    # ZeRO-3 fp32: 8 B of the largest layer (weights+grads), shard 4 + 4 + 4 + 8 = 20 B
    assert get(3, "none", "none", True, "fp32") == (100 * 4 * 2 * 1.5, 8 * 100 + 20 * 1000 // 2)
    assert get(3, "cpu", "cpu", True, "fp32") == (1000 * 20 * 1.5, 800)
    assert get(3, "cpu", "cpu", False, "fp32") == (1000 * max(8, 20) * 1.5, 800)
    # fp16 and bf16 are the same optimizers and buffers
    assert all(get(*k[:4], "fp16") == get(*k[:4], "bf16") for k in r)


def test_nvme_rows_by_hand():
    nv = M.NvmeSettings(param_buffer_count=2, param_buffer_size=10, param_max_in_cpu=100, optimizer_buffer_count=4,
                        sub_group_size=50)
    r = rows_by_key(M.estimate(M.Inputs(1000, 100, gpus_per_node=2, nodes=1, nvme=nv), ("fp16",)))
    # per rank: P/G = 500; weights kept in host RAM min(500, max_in_cpu=100) + 2 x 10 swap buffers, 2 B each
    param_node = 2 * 2 * (100 + 2 * 10)  # 480
    # 4 pinned fp32 buffers of one sub-group min(500, 50)
    opt_node = 2 * 4 * 50 * 4  # 1600
    floor = 4 * 100 * 2  # zero.Init: one fp32 layer per rank
    assert (r[(3, "nvme", "nvme", True, "fp16")].cpu_bytes, r[(3, "nvme", "nvme", True, "fp16")].gpu_bytes) == (
        (param_node + opt_node) * 1.5, 4 * 100)
    assert r[(3, "nvme", "nvme", False, "fp16")].cpu_bytes == max(4 * 1000 * 2, param_node + opt_node) * 1.5
    assert r[(3, "none", "nvme", True, "fp16")].cpu_bytes == max(opt_node, floor) * 1.5
    assert r[(3, "none", "nvme", True, "fp16")].gpu_bytes == 4 * 100 + 2 * 1000 // 2
    assert r[(3, "cpu", "nvme", True, "fp16")].cpu_bytes == (2 * 1000 + opt_node) * 1.5
    assert r[(3, "nvme", "cpu", True, "fp16")].cpu_bytes == (param_node + 16 * 1000) * 1.5
    assert all(x.source == "torchdoctor" for k, x in r.items() if "nvme" in k)


def test_nvme_with_deepspeed_defaults_keeps_small_shards_in_host_ram():
    """DeepSpeed's defaults (max_in_cpu 1e9, sub_group_size 1e9) keep a 7B/8-rank shard on the host anyway."""
    r = rows_by_key(M.estimate(M.Inputs(7_000_000_000, 131_072_000, 8, 1), ("bf16",)))
    assert r[(3, "none", "nvme", True, "bf16")].cpu_bytes == r[(3, "none", "cpu", True, "bf16")].cpu_bytes
    assert r[(3, "nvme", "nvme", True, "bf16")].cpu_bytes > r[(3, "cpu", "cpu", True, "bf16")].cpu_bytes
    tuned = M.NvmeSettings(param_max_in_cpu=0, sub_group_size=100_000_000)
    t = rows_by_key(M.estimate(M.Inputs(7_000_000_000, 131_072_000, 8, 1, nvme=tuned), ("bf16",)))
    assert t[(3, "nvme", "nvme", True, "bf16")].cpu_bytes == (8 * (2 * 5 * 10**8) + 8 * 4 * 10**8 * 4) * 1.5


@settings(max_examples=60, deadline=None)
@given(st.integers(10**3, 10**12), st.floats(0.0, 0.5), st.sampled_from(GPN), st.sampled_from(NODES))
def test_properties(total, frac, gpn, nodes):
    largest = max(1, int(total * frac))
    r = rows_by_key(M.estimate(M.Inputs(total, largest, gpn, nodes)))
    for prec in M.PRECISIONS:
        g = [r[(s, "none", "none", z, prec)].gpu_bytes for s, z in ((0, None), (1, None), (2, None), (3, True))]
        g[3] -= (8 if prec == "fp32" else 4) * largest  # the gathered largest layer is ZeRO-3's own cost
        if prec == "fp32":
            g = g[1:]  # plain fp32 (ZeRO-0) steps the weights in place; ZeRO's optimizer clones an fp32 master
        assert g == sorted(g, reverse=True)  # each stage shards more
        for key, row in r.items():
            if key[4] == "fp32" and key[0] > 0:  # ZeRO-0 fp32 has no master copy: 16 B < 20 B
                lo = r[key[:4] + ("bf16",)]
                assert row.gpu_bytes >= lo.gpu_bytes and row.cpu_bytes >= lo.cpu_bytes
            if key[0] == 3 and key[3] is True:  # zero.Init never needs more host RAM
                assert row.cpu_bytes <= r[key[:3] + (False, key[4])].cpu_bytes


# -- reading a DeepSpeed config ----------------------------------------------------------------------------------


def test_configured_from_ds_config():
    c = M.configured_from_ds_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                                     "bf16": {"enabled": True}})
    assert c.key == (2, "none", "cpu", None, "bf16") and any("nvme as cpu" in n for n in c.notes)
    c = M.configured_from_ds_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                         "max_in_cpu": 0},
                                                           "offload_optimizer": {"device": "cpu"},
                                                           "sub_group_size": 1e8}})
    assert c.key == (3, "nvme", "cpu", True, "fp32") and any("zero.Init assumed" in n for n in c.notes)
    assert (c.nvme.param_max_in_cpu, c.nvme.sub_group_size) == (0, 100_000_000)
    c = M.configured_from_ds_config({"zero_optimization": {"stage": 1, "cpu_offload": True},
                                     "bfloat16": {"enabled": True}}, zero_init=False)
    assert c.key == (1, "none", "cpu", None, "bf16")
    c = M.configured_from_ds_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
                                     "fp16": {"enabled": "auto"}})
    assert c.key == (2, "none", "none", None, "fp16") and len(c.notes) == 2
    assert M.configured_from_ds_config({"zero_optimization": True}).stage == 1
    assert M.configured_from_ds_config({}, precision="fp16").key == (0, "none", "none", None, "fp16")
    assert M.configured_from_ds_config({"zero_optimization": {"stage": 3}}, zero_init=False).zero_init is False
    for bad in ({"zero_optimization": {"stage": 5}}, {"zero_optimization": {"stage": "auto"}},
                {"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
                {"fp16": {"enabled": True}, "bf16": {"enabled": True}}):
        with pytest.raises(ValueError):
            M.configured_from_ds_config(bad)


# -- --model: a transformers config on the meta device -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_model_counts_match_the_real_model(kind, tmp_path):
    from conftest import tiny_gpt2, tiny_t5

    real = tiny_gpt2() if kind == "gpt2" else tiny_t5()
    real.config.architectures = [type(real).__name__]
    real.config.to_json_file(tmp_path / "config.json")
    folder = memory_run.model_counts(str(tmp_path))
    file = memory_run.model_counts(str(tmp_path / "config.json"))
    assert folder == file
    total, largest, name = M.count_params(real)
    assert (folder["total_params"], folder["largest_layer"]) == ds_zero3.model_to_params(real) == (total, largest)
    assert folder["largest_layer_module"] == name and folder["class"] == type(real).__name__


# Hand-written config.json files, as users and scripts write them: with and without "architectures", tied and
# untied. Before issue 10 a config without architectures was built as the base model (AutoModel): an untied LM
# head (Llama's default) was not counted.
LM_CONFIGS = {
    "llama": ({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}, "LlamaForCausalLM",
              "LlamaModel", 1000 * 32),
    "gpt2": ({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 1000, "n_positions": 64},
             "GPT2LMHeadModel", "GPT2Model", 1000 * 32),
    "t5": ({"model_type": "t5", "d_model": 32, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 2,
            "d_kv": 16, "vocab_size": 1000, "decoder_start_token_id": 0}, "T5ForConditionalGeneration", "T5Model",
           1000 * 32),
}


def real_model(cls_name: str, folder):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    return getattr(transformers, cls_name)(cfg)


def real_counts(cls_name: str, folder) -> tuple[int, int]:
    """The model built for real on the CPU from the same config.json: (unique tensors' numel, largest layer), by
    DeepSpeed's own model_to_params (which dedups tied weights by data_ptr, right on real tensors)."""
    real = real_model(cls_name, folder)
    unique = {p.data_ptr(): p.numel() for p in real.parameters()}
    total, largest = ds_zero3.model_to_params(real)
    assert total == sum(unique.values())
    return total, largest


@pytest.mark.parametrize("kind", sorted(LM_CONFIGS))
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("with_architectures", [False, True])
def test_model_counts_the_lm_head_with_or_without_architectures(kind, tied, with_architectures, tmp_path):
    raw, lm_class, base_class, head = LM_CONFIGS[kind]
    raw = {**raw, "tie_word_embeddings": tied}
    if with_architectures:
        raw["architectures"] = [lm_class]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = memory_run.model_counts(str(tmp_path))
    assert got["class"] == lm_class
    if with_architectures:
        assert got["class_from"] == "architectures[0] in config.json"
    else:
        assert got["class_from"].startswith("no architectures in config.json; model_type")
    assert base_class in got["other_classes"]
    real = real_model(lm_class, tmp_path)
    real_tied = real.get_output_embeddings().weight is real.get_input_embeddings().weight
    if kind != "t5":  # transformers 5 ties T5 whatever the config says; Llama and GPT-2 follow it
        assert real_tied is tied
    assert got["head_tied"] is real_tied
    assert (got["total_params"], got["largest_layer"]) == real_counts(lm_class, tmp_path)
    base_total, _ = real_counts(base_class, tmp_path)
    # the head: its own vocab x hidden matrix when untied, nothing more when tied
    assert got["total_params"] - base_total == (0 if real_tied else head)


def test_model_class_chooses_another_head_and_says_so(tmp_path, capsys):
    raw = {**LM_CONFIGS["llama"][0], "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = memory_run.model_counts(str(tmp_path), "LlamaModel")
    assert got["class"] == "LlamaModel" and got["class_from"] == "--model-class"
    assert got["total_params"] == real_counts("LlamaModel", tmp_path)[0]
    got = memory_run.model_counts(str(tmp_path), "LlamaForSequenceClassification")
    assert got["total_params"] == real_counts("LlamaForSequenceClassification", tmp_path)[0]
    rc, out, _ = cli(["--model", str(tmp_path), "--gpus-per-node", "1", "--cpu-mem", "8", "--gpu-mem", "8"], capsys)
    assert rc == 0
    assert ("counted LlamaForCausalLM (output head untied: its own weights counted): no architectures in "
            "config.json; model_type 'llama' -> AutoModelForCausalLM "
            "(transformers' own mapping); another class: --model-class LlamaModel") in out
    rc, out, _ = cli(["--model", str(tmp_path), "--gpus-per-node", "1", "--cpu-mem", "8", "--gpu-mem", "8", "--json"],
                     capsys)
    model = json.loads(out)["inputs"]["model"]
    assert (model["class"], model["other_classes"], model["head_tied"]) == ("LlamaForCausalLM", ["LlamaModel"], False)
    assert "AutoModelForCausalLM" in model["class_from"]


def test_an_encoder_without_architectures_gets_its_masked_lm_head(tmp_path):
    raw = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "vocab_size": 500}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = memory_run.model_counts(str(tmp_path))
    assert got["class"] == "BertForMaskedLM" and "AutoModelForMaskedLM" in got["class_from"]
    assert got["total_params"] == real_counts("BertForMaskedLM", tmp_path)[0]


def test_an_architecture_transformers_lacks_falls_back_to_the_model_type_and_says_so(tmp_path):
    raw = {**LM_CONFIGS["llama"][0], "tie_word_embeddings": False, "architectures": ["MyLlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = memory_run.model_counts(str(tmp_path))
    assert got["class"] == "LlamaForCausalLM"
    assert got["class_from"].startswith("architectures[0] 'MyLlamaForCausalLM' is not a class of transformers")
    assert got["total_params"] == real_counts("LlamaForCausalLM", tmp_path)[0]


def test_model_cli_uses_the_counts(tmp_path, capsys):
    from conftest import tiny_gpt2

    real = tiny_gpt2()
    real.config.architectures = ["GPT2LMHeadModel"]
    real.config.to_json_file(tmp_path / "config.json")
    rc, out, _ = cli(["--model", str(tmp_path), "--gpus-per-node", "2", "--cpu-mem", "8", "--gpu-mem", "8",
                      "--json"], capsys)
    doc = json.loads(out)
    total, largest, _ = M.count_params(real)
    assert rc == 0 and doc["inputs"]["total_params"] == total and doc["inputs"]["largest_layer_params"] == largest
    assert doc["inputs"]["model"]["class"] == "GPT2LMHeadModel"
    z3 = [r for r in doc["rows"] if (r["stage"], r["offload_param"], r["offload_optimizer"], r["zero_init"],
                                     r["precision"]) == (3, "none", "none", True, "fp16")][0]
    assert z3["gpu_bytes"] == 4 * largest + int(18 * total / 2)


# -- findings through the command ------------------------------------------------------------------------------


def test_host_oom_with_config_fails(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                               "fp16": {"enabled": True}}))
    argv = ["--params", "7B", "--largest-layer", "131072000", "--gpus-per-node", "8", "--cpu-mem", "24",
            "--gpu-mem", "80", "--config", str(cfg)]
    rc, out, _ = cli(argv + ["--json"], capsys)
    doc = json.loads(out)
    assert rc == 1
    f = {x["id"]: x for x in doc["findings"]}["memory.host-oom-at-start"]
    assert f["severity"] == "fail"
    assert "needs 312.92 GiB host RAM per node, 24 GiB available" in f["title"]
    fixes = "\n".join(f["fix"])
    assert '"stage": 3' in fixes and "zero.Init" in fixes and "NVMe offload needs ZeRO-3" in fixes
    assert any("activations" in e for e in f["evidence"])
    configured = [r for r in doc["rows"] if r["configured"]]
    assert len(configured) == 1 and (configured[0]["stage"], configured[0]["offload_optimizer"]) == (2, "cpu")
    assert doc["judged"]["cpu_bytes"] == configured[0]["cpu_bytes"] == int(7e9 * 32 * 1.5)
    assert "activations" in doc["note"]

    rc, out, _ = cli(argv, capsys)
    assert rc == 1
    marked = [line for line in out.splitlines() if line.startswith(">")]
    assert len(marked) == 1 and "configured" in marked[0] and "no (host)" in marked[0]
    assert "[FAIL]" in out and "activations" in out and 'labelled "GB"' in out


def test_host_oom_without_config_warns_and_offers_what_fits(capsys):
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131M", "--gpus-per-node", "8", "--cpu-mem", "24",
                      "--gpu-mem", "80", "--json"], capsys)
    doc = json.loads(out)
    f = {x["id"]: x for x in doc["findings"]}["memory.host-oom-at-start"]
    assert rc == 0 and f["severity"] == "warn"
    assert f["title"].startswith("ZeRO-1, no offload") and "24 GiB available" in f["title"]
    assert f["fix"][0].startswith("use ZeRO-3, no offload, zero.Init")  # the only row that fits 24 GiB
    assert doc["judged"]["stage"] == 1


def test_nvme_config_gets_the_buffer_fix(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    zero = {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}
    cfg.write_text(json.dumps({"zero_optimization": zero, "bf16": {"enabled": True}}))
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131M", "--gpus-per-node", "8", "--cpu-mem", "64",
                      "--gpu-mem", "80", "--config", str(cfg), "--json"], capsys)
    f = {x["id"]: x for x in json.loads(out)["findings"]}["memory.host-oom-at-start"]
    assert rc == 1 and '"max_in_cpu": 0' in "\n".join(f["fix"]) and '"sub_group_size": 100000000' in "\n".join(f["fix"])


def test_gpu_oom_when_nothing_fits(capsys):
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131M", "--gpus-per-node", "8", "--cpu-mem", "1024",
                      "--gpu-mem", "0.25", "--json"], capsys)
    doc = json.loads(out)
    ids = {x["id"]: x for x in doc["findings"]}
    assert rc == 1 and ids["memory.gpu-oom"]["severity"] == "fail" and doc["judged"] is None
    assert "0.25 GiB per GPU" in ids["memory.gpu-oom"]["title"]


def test_configured_row_too_big_for_gpu(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}))
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131M", "--gpus-per-node", "8", "--cpu-mem", "1024",
                      "--gpu-mem", "80", "--config", str(cfg), "--json"], capsys)
    f = {x["id"]: x for x in json.loads(out)["findings"]}["memory.gpu-oom"]
    assert rc == 1 and f["title"].startswith("ZeRO-0") and "80 GiB available" in f["title"]
    assert f["fix"][0].startswith("use ZeRO-1, no offload")


def test_fits(capsys):
    rc, out, _ = cli(["--params", "125M", "--largest-layer", "38.6M", "--gpus-per-node", "8", "--nodes", "2",
                      "--cpu-mem", "256", "--gpu-mem", "80"], capsys)
    assert rc == 0 and "[OK] ZeRO-0 (plain data parallel), bf16 fits" in out and "(memory.fits)" not in out
    assert [line for line in out.splitlines() if line.startswith("*")][0].split()[1] == "0"


def test_unknown_largest_layer_gives_lower_bounds(capsys):
    rc, out, _ = cli(["--params", "7B", "--gpus-per-node", "8", "--cpu-mem", "512", "--gpu-mem", "80", "--json"],
                     capsys)
    doc = json.loads(out)
    z3 = [r for r in doc["rows"] if r["stage"] == 3]
    assert rc == 0 and all(r["gpu_lower_bound"] and r["fits_gpu"] is None for r in z3)
    assert "memory.largest-layer-unknown" in {f["id"] for f in doc["findings"]}


def test_example_two_nodes_text(capsys):
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131072000", "--gpus-per-node", "8", "--nodes", "2",
                      "--cpu-mem", "256", "--gpu-mem", "80"], capsys)
    table = [line[1:].split() for line in out.splitlines() if line[:1] in (" ", "*", ">")]
    table = [cells for cells in table if len(cells) > 2 and cells[0] in "0123" and cells[1] in ("none", "cpu", "nvme")]
    assert len(table) == 19
    table = [cells for cells in table if "DS" in cells]
    assert rc == 0 and len(table) == 8  # DeepSpeed's 2 + 6 rows, tagged
    assert "activations" in out and "host GiB/node" in out


# -- parsing and bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,want", [("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("1.3b", 1_300_000_000),
                                       ("350M", 350_000_000), ("125k", 125_000), ("7_000", 7000),
                                       ("1.5T", 1_500_000_000_000), ("131072000", 131_072_000),
                                       ("1.3e9", 1_300_000_000), ("0.5k", 500), ("1e16", 10**16),
                                       ("12345678901234567", None), ("1e400", None), ("1.5", None), ("1e-400", None),
                                       ("7.0000000001B", None), ("1e999999999", None), ("0e400", None)])
def test_parse_count(text, want):
    if want is None:
        with pytest.raises(memory_run.UsageError):
            memory_run.parse_count(text, "--params")
    else:
        assert memory_run.parse_count(text, "--params") == want


def test_host_ram_comes_from_the_shared_readers(monkeypatch):
    """MemTotal, or the cgroup limit when lower: torchdoctor._system's readers and rule, as env and run use them."""
    from torchdoctor import _system

    monkeypatch.setattr(_system, "read_meminfo", lambda: {"MemTotal": 32 * GIB, "MemAvailable": 20 * GIB})
    monkeypatch.setattr(_system, "cgroup_memory", lambda: (None, None))
    assert memory_run.host_ram_gib() == (32.0, "this machine's MemTotal")
    monkeypatch.setattr(_system, "cgroup_memory", lambda: (8 * GIB, 0))
    gib, source = memory_run.host_ram_gib()
    assert gib == 8.0 and "cgroup" in source
    monkeypatch.setattr(_system, "cgroup_memory", lambda: (64 * GIB, 0))
    assert memory_run.host_ram_gib()[0] == 32.0
    monkeypatch.setattr(_system, "read_meminfo", dict)
    monkeypatch.setattr(_system, "cgroup_memory", lambda: (None, None))
    assert memory_run.host_ram_gib() == (None, "unknown (no /proc/meminfo; pass --cpu-mem)")


def test_host_ram_on_this_machine_is_what_the_shared_rule_says():
    from torchdoctor import _system

    limit = _system.host_memory_limit()
    assert memory_run.host_ram_gib()[0] == (None if limit is None else limit / GIB)


@pytest.mark.parametrize("cpu, gpu, title", [
    ("23.5406", "79.32871", "ZeRO-1, no offload, bf16 needs 312.92 GiB host RAM per node, 23.5 GiB available"),
    ("1024", "0.25", "no ZeRO setup fits 0.25 GiB per GPU: the least is 0.49 GiB"),
    ("2048.04", "79.96", "ZeRO-1, no offload, bf16 fits: 39.12 GiB per GPU of 80, 312.92 GiB host RAM per node "
                         "of 2048"),
])
def test_available_memory_in_finding_titles_is_rounded_like_the_table(capsys, cpu, gpu, title):
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131M", "--gpus-per-node", "8", "--cpu-mem", cpu,
                      "--gpu-mem", gpu, "--json"], capsys)
    assert any(f["title"].startswith(title) for f in json.loads(out)["findings"]), out


@pytest.mark.parametrize("argv,msg", [
    ([], "give the model size"),
    (["--params", "7x"], "cannot read '7x'"),
    (["--params", "0"], "must be positive"),
    (["--params", "-5"], "cannot read"),
    (["--params", "inf"], "cannot read"),
    (["--params", "1e400"], "'1e400' is out of range (at most 1e16 parameters)"),
    (["--params", "1.5"], "'1.5' is not a whole number of parameters"),
    (["--params", "7B", "--largest-layer", "0.5"], "--largest-layer: '0.5' is not a whole number"),
    (["--params", "7B", "--nodes", "99999999999999999999999"], "--nodes: '99999999999999999999999' is out of range"),
    (["--params", "7B", "--gpus-per-node", "0"], "--gpus-per-node: must be a positive whole number"),
    (["--params", "7B", "--nodes", "0"], "--nodes"),
    (["--params", "7B", "--gpus-per-node", "2.5"], "--gpus-per-node"),
    (["--params", "7B", "--cpu-mem", "lots"], "--cpu-mem"),
    (["--params", "7B", "--gpu-mem", "0"], "--gpu-mem"),
    (["--params", "7B", "--largest-layer", "8B"], "cannot exceed"),
    (["--params", "7B", "--model", "x"], "not both"),
    (["--model", "{empty}"], "has no config.json"),
    (["--model", "{empty}/nope.json"], "no such file"),
    (["--model", "{bad_json}"], "bad.json:1:2: invalid JSON"),
    (["--params", "7B", "--config", "{bad_json}"], "--config: {bad_json}:1:2: invalid JSON"),
    (["--model", "{deep}"], "deep.json:1:501: nested more than 100 levels deep"),
    (["--params", "7B", "--config", "{deep}"], "--config: {deep}:1:501: nested more than 100 levels deep"),
    (["--model", "{deep_dir}"], "config.json:1:501: nested more than 100 levels deep"),
    (["--params", "7B", "--config", "{dup}"], 'duplicate key "stage"'),
    (["--model", "{array}"], "the top level is an array"),
    (["--model", "{weights}"], "is a pickle (torch.save), not JSON"),
    (["--params", "7B", "--model-class", "LlamaModel"], "--model-class chooses the class --model builds"),
    (["--model", "{llama}", "--model-class", "LlamaTokenizer"], "--model-class LlamaTokenizer: transformers"),
    (["--params", "7B", "--config", "{stage5}"], "stage must be 0, 1, 2 or 3"),
])
def test_bad_input_exits_2(argv, msg, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "stage5.json").write_text('{"zero_optimization": {"stage": 5}}')
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    (tmp_path / "deep.json").write_text(deep)
    (tmp_path / "deep_dir").mkdir()
    (tmp_path / "deep_dir" / "config.json").write_text(deep)
    (tmp_path / "dup.json").write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    (tmp_path / "array.json").write_text("[]")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    (tmp_path / "llama.json").write_text(json.dumps(LM_CONFIGS["llama"][0]))
    subst = {"llama": str(tmp_path / "llama.json"), "empty": str(tmp_path / "empty"),
             "bad_json": str(tmp_path / "bad.json"),
             "stage5": str(tmp_path / "stage5.json"), "deep": str(tmp_path / "deep.json"),
             "deep_dir": str(tmp_path / "deep_dir"), "dup": str(tmp_path / "dup.json"),
             "array": str(tmp_path / "array.json"), "weights": str(tmp_path / "pytorch_model.bin")}
    argv = [a.format(**subst) for a in argv]
    msg = msg.format(**subst)
    rc, out, err = cli(argv + ["--gpus-per-node", "1"] if "--gpus-per-node" not in argv else argv, capsys)
    assert rc == 2 and msg in err and "Traceback" not in err and out == ""


def test_model_counts_are_capped_like_params(tmp_path, capsys, monkeypatch):
    from conftest import tiny_gpt2

    real = tiny_gpt2()
    real.config.architectures = ["GPT2LMHeadModel"]
    real.config.to_json_file(tmp_path / "config.json")
    from torchdoctor.deepspeed import model_count

    assert M.count_params is model_count.count_params  # the old import path still works
    monkeypatch.setattr(model_count, "count_params", lambda model: (3 * 10**18, 10**17, "lm_head"))
    rc, out, err = cli(["--model", str(tmp_path), "--gpus-per-node", "1"], capsys)
    assert rc == 2 and out == "" and "3e+18 parameters is out of range (at most 1e16, as for --params)" in err


def test_host_oom_title_on_this_machine_is_rounded(capsys, monkeypatch):
    """Without --cpu-mem the RAM is this machine's, rarely a whole number of GiB: the title rounds it."""
    from torchdoctor import _system

    monkeypatch.setattr(_system, "read_meminfo", lambda: {"MemTotal": int(23.5406 * GIB)})
    monkeypatch.setattr(_system, "cgroup_memory", lambda: (None, None))
    rc, out, _ = cli(["--params", "7B", "--largest-layer", "131M", "--gpus-per-node", "8", "--gpu-mem", "80"], capsys)
    assert "needs 312.92 GiB host RAM per node, 23.5 GiB available" in out and "23.5406" not in out
    assert "host RAM per node: 23.5 GiB [this machine's MemTotal" in out


def _no_gpu_cli(argv: list[str]) -> tuple[int, str]:
    """The real CLI with no GPU visible (a CPU login node, where runs are planned), in its own process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "torchdoctor", "ds", "memory", *argv], capture_output=True, text=True,
                       env=env, timeout=120)
    return p.returncode, p.stdout


def test_without_gpu_memory_nothing_is_said_to_fit_the_gpu():
    """Issue 11: `ds memory --params 7B` on a CPU node marked a row needing >= 117 GiB/GPU as "likely: fastest setup
    that fits the GPU", id memory.fits, exit 0."""
    rc, out = _no_gpu_cli(["--params", "7B"])
    assert rc == 0, out
    assert "likely" not in out.split("NOTE")[1].split("no likely row")[0]  # no row marked likely ...
    assert "no likely row: GPU memory unknown: pass --gpu-mem" in out      # ... and it says why
    assert not [line for line in out.splitlines() if line.startswith("*")]
    assert "(memory.fits)" not in out and " fits:" not in out
    assert "≥" not in out and ">= 0.00" not in out and "0.00 GiB" not in out
    assert "GPU memory unknown: pass --gpu-mem" in out
    table = out.split("\n\n")[1].splitlines()
    assert all(" ? " not in f" {line} " or "host ?, GPU ?" in line for line in table[1:])  # every ? is "host/GPU ?"
    assert "? = cannot tell: GPU memory unknown (pass --gpu-mem)" in out and "+L = plus a term" in out
    rc, out = _no_gpu_cli(["--params", "7B", "--json"])
    doc = json.loads(out)
    assert rc == 0 and doc["judged"] is None
    ids = {f["id"] for f in doc["findings"]}
    assert "memory.fits" not in ids and "memory.gpu-mem-unknown" in ids
    need = next(f for f in doc["findings"] if f["id"] == "memory.gpu-mem-unknown")
    assert any("130.39 GiB" in e for e in need["evidence"])  # what each setup needs per GPU, fastest first


def test_a_row_not_known_to_fit_gets_no_fits_verdict(capsys):
    # with the GPU known, the likely row fits for sure: memory.fits, ok
    rc, out, _ = cli(["--params", "7B", "--gpus-per-node", "8", "--cpu-mem", "1024", "--gpu-mem", "80"], capsys)
    assert rc == 0 and "[OK] ZeRO-1, no offload, bf16 fits: 39.12 GiB per GPU of 80" in out
    assert "≥" not in out and "0.00+L" in out  # ZeRO-3 with offloaded params: only the largest layer
    # a configured row whose GPU side is unknown: what it needs, no "fits" (it was memory.fits, info)
    cfg = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    findings, row = memory_rules.judge(M.estimate(M.Inputs(7 * 10**9, None, 8, 1, 1024.0, None)), M.Inputs(
        7 * 10**9, None, 8, 1, 1024.0, None), "bf16", M.configured_from_ds_config(cfg, None, None))
    ids = {f.id: f for f in findings}
    assert row is not None and "memory.fits" not in ids and ids["memory.needs"].severity == "info"
    assert "whether that fits is not known" in ids["memory.needs"].title

"""``torchdoctor ds check``: the DeepSpeed config lint -- loading, DeepSpeed's own key tables, every rule, the CLI."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchdoctor.deepspeed import check_run, config_check, schema_tables
from torchdoctor.deepspeed import pydantic_models as ds_pydantic
from torchdoctor.deepspeed import schema as ds_schema
from torchdoctor.deepspeed.config_check import ConfigError, check, load
from torchdoctor.deepspeed.hf_fill import hf_fill
from torchdoctor.findings import Finding

FIX = Path(__file__).parent / "fixtures" / "ds_check"
SRC = str(Path(__file__).parent.parent / "src")
LIBAIO = "/usr/lib/x86_64-linux-gnu/libaio.so"
BASE = {"train_micro_batch_size_per_gpu": 4}


def lint(cfg: dict, *, world_size=None, for_="deepspeed", caps=("8.0",), libaio=LIBAIO) -> list[Finding]:
    return check(cfg, world_size=world_size, for_=for_, gpu_capabilities=list(caps), libaio=libaio, path="ds.json")


def of(findings: list[Finding], id_: str) -> list[Finding]:
    return [f for f in findings if f.id == id_]


def one(findings: list[Finding], id_: str) -> Finding:
    got = of(findings, id_)
    assert len(got) == 1, [(f.id, f.title) for f in findings]
    return got[0]


def text(f: Finding) -> str:
    return "\n".join([f.title, *f.evidence, *f.fix])


# -- loading -----------------------------------------------------------------------------------------------------


def test_load_reads_a_valid_config():
    cfg = load(str(FIX / "good.json"))
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_malformed_json_names_file_line_column_and_shows_the_line():
    path = str(FIX / "malformed.json")
    with pytest.raises(ConfigError) as e:
        load(path)
    lines = str(e.value).split("\n")
    assert lines[0] == f"{path}:3:3: invalid JSON: Expecting ',' delimiter"
    assert lines[1] == '    line 3:   "gradient_accumulation_steps": 1'
    assert lines[2] == "              ^"


def test_duplicate_key_is_an_error_at_its_second_occurrence():
    path = str(FIX / "duplicate.json")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value).startswith(f'{path}:5:5: duplicate key "enabled"')
    # the same key name in different objects is fine
    assert load(str(FIX / "good.json"))


@pytest.mark.parametrize("name, needle", [
    ("comment.json", "comment.json:3:3: invalid JSON: Expecting property name enclosed in double quotes (a comment"),
    ("trailing_comma.json", "(a trailing comma: remove the ',' before it)"),
    ("array.json", "array.json: the top level is an array; a DeepSpeed config is a JSON object"),
    ("missing.json", "missing.json: no such file"),
])
def test_unreadable_inputs_are_config_errors(name, needle):
    with pytest.raises(ConfigError) as e:
        load(str(FIX / name))
    assert needle in str(e.value)


def test_a_directory_and_binary_bytes_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load(str(tmp_path))
    (tmp_path / "x.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(str(tmp_path / "x.json"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40) | st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=3)).map(json.dumps))
def test_load_returns_an_object_or_raises_config_error(tmp_path, body):
    p = tmp_path / "c.json"
    p.write_text(body, encoding="utf-8")
    try:
        got = load(str(p))
    except ConfigError:
        return
    assert isinstance(got, dict) and got == json.loads(body)


# -- DeepSpeed's own tables, and the bundled copy -----------------------------------------------------------------


@pytest.fixture
def fresh_schema():
    config_check.schema.cache_clear()
    yield
    config_check.schema.cache_clear()


def test_key_tables_come_from_the_installed_deepspeed():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sch = config_check.schema()
    assert sch.from_deepspeed and sch.source.startswith("deepspeed ")
    assert set(sch.blocks["fp16"]) == set(DeepSpeedFP16Config.model_fields)
    zero_names = set(DeepSpeedZeroConfig.model_fields) | {f.alias for f in DeepSpeedZeroConfig.model_fields.values()
                                                          if f.alias}
    assert set(sch.blocks["zero_optimization"]) == zero_names
    assert "stage3_max_live_parameters" in sch.blocks["zero_optimization"]  # an alias
    assert {"train_batch_size", "zero_optimization", "fp16", "optimizer", "log_level"} <= set(sch.blocks[""])


def test_bundled_tables_match_the_installed_deepspeed():
    pytest.importorskip("deepspeed")
    t = config_check.deepspeed_tables()
    if t["version"] != config_check.FALLBACK_VERSION:
        pytest.skip(f"bundled tables are from DeepSpeed {config_check.FALLBACK_VERSION}, installed {t['version']}")
    assert t["models"] == schema_tables._FALLBACK_MODELS
    assert t["blocks"] == schema_tables._FALLBACK_BLOCKS
    assert t["removed"] == schema_tables._FALLBACK_REMOVED
    assert t["schedulers"] == schema_tables._FALLBACK_SCHEDULERS
    assert tuple(t["optimizers"]) == schema_tables._FALLBACK_OPTIMIZERS
    assert set(t["top"]) == set(schema_tables._FALLBACK_TOP_LEVEL)


def _signature(findings: list[Finding]) -> list[tuple[str, str, str]]:
    return sorted((f.id, f.severity, f.title) for f in findings if f.id != "config.ok")


def test_without_deepspeed_the_bundled_tables_give_the_same_verdicts(monkeypatch, fresh_schema):
    cfgs = [load(str(FIX / "problems.json")), load(str(FIX / "hf_auto.json")),
            {**BASE, "amp": {}, "fp16": {"enabled": True, "initial_scale_power": 16.5, "stagee": 1},
             "zero_optimization": {"stage": 3, "cpu_offload": True, "offload_param": {"device": "CPU"}},
             "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_step": 5}}}]
    with_ds = [_signature(lint(c)) for c in cfgs]
    config_check.schema.cache_clear()
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ImportError
    sch = config_check.schema()
    assert not sch.from_deepspeed
    assert sch.source == f"bundled DeepSpeed {config_check.FALLBACK_VERSION} tables (deepspeed not installed)"
    without = [_signature(lint(c)) for c in cfgs]
    assert without == with_ds
    assert any(id_ == "config.unknown-key" for id_, _, _ in without[2])


def test_a_deepspeed_whose_models_moved_falls_back_to_the_bundled_tables(monkeypatch, fresh_schema):
    pytest.importorskip("deepspeed")

    def moved(models):
        raise ModuleNotFoundError("No module named 'deepspeed.runtime.precision_config'",
                                  name="deepspeed.runtime.precision_config")

    monkeypatch.setattr(ds_schema, "_blocks_from_deepspeed", moved)
    sch = config_check.schema()
    assert not sch.from_deepspeed
    assert sch.source.endswith("'s tables could not be read: ModuleNotFoundError)")
    assert set(sch.blocks["fp16"]) == set(schema_tables._FALLBACK_BLOCKS["fp16"])


def test_a_deepspeed_that_fails_to_import_falls_back_too(monkeypatch, fresh_schema):
    def broken():
        raise RuntimeError("CUDA mismatch")

    monkeypatch.setattr(ds_schema, "deepspeed_tables", broken)
    sch = config_check.schema()
    assert sch.source.endswith("(deepspeed import failed: RuntimeError)")
    assert of(lint({**BASE, "zero_optimization": {"stagee": 2}}), "config.unknown-key")


FIELDS = [("fp16", "initial_scale_power"), ("fp16", "loss_scale"), ("fp16", "enabled"), ("bf16", "enabled"),
          ("zero_optimization", "stage"), ("zero_optimization", "reduce_bucket_size"),
          ("zero_optimization", "overlap_comm"), ("zero_optimization.offload_optimizer", "ratio"),
          ("zero_optimization.offload_param", "device"), ("zero_optimization.offload_param", "nvme_path")]
VALUES = [0, 1, 2, 3, 4, -1, 16, 0.5, 1.0, 16.5, 1e20, float("inf"), float("nan"), True, False, None, "16", " 3 ",
          "1e3", "true", "yes", "off", "cpu", "CPU", "nvme", "none", "/nvme", "", [1], {"a": 1}, 2**70]


@pytest.mark.parametrize("block, key", FIELDS)
def test_bad_value_fails_exactly_when_deepspeeds_model_refuses_the_value(block, key):
    """Our reading of a value agrees with DeepSpeed's own pydantic model, value by value."""
    pytest.importorskip("deepspeed")
    model = ds_pydantic.model_class(config_check.schema().models[block])
    for v in VALUES:
        try:
            model(**{key: v})
            refused = False
        except Exception:
            refused = True
        parts = block.split(".")
        cfg: dict = {key: v}
        for p in reversed(parts):
            cfg = {p: cfg}
        if parts[0] == "zero_optimization" and len(parts) > 1:
            cfg["zero_optimization"]["stage"] = 3
        found = [f for f in lint({**BASE, **cfg}) if f.id == "config.bad-value" and f.severity == "fail"
                 and f.data.get("key") == f"{block}.{key}"]
        assert bool(found) == refused, (block, key, v, refused, [f.title for f in found])


# -- schema checks: unknown keys, bad values, removed and deprecated keys -----------------------------------------


def test_a_valid_config_is_ok():
    findings = lint(load(str(FIX / "good.json")), world_size=4)
    assert [(f.id, f.severity) for f in findings] == [("config.ok", "ok")]


@pytest.mark.parametrize("cfg, severity, suggestion, fix", [
    ({**BASE, "zero_optimisation": {"stage": 2}}, "warn", "zero_optimization",
     'rename it: "zero_optimization": {"stage": 2}'),
    ({**BASE, "zero_optimization": {"stagee": 2}}, "fail", "zero_optimization.stage",
     'rename it: "zero_optimization": {"stage": 2}'),
    ({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}}, "fail",
     "zero_optimization.offload_param.pin_memory",
     'rename it: "zero_optimization": {"offload_param": {"pin_memory": true}}'),
    ({**BASE, "FP16": {"enabled": True}}, "warn", "fp16", 'rename it: "fp16": {"enabled": true}'),
    ({**BASE, "loss_scale": 0}, "warn", "fp16.loss_scale", 'move it: "fp16": {"loss_scale": 0}'),
    ({**BASE, "zero_optimization": {"stage": 3, "nvme_path": "/x"}}, "fail",
     "zero_optimization.offload_param.nvme_path",
     'move it: "zero_optimization": {"offload_param": {"nvme_path": "/x"}}'),
    ({**BASE, "optimizer": {"type": "AdamW", "parms": {}}}, "warn", "optimizer.params",
     'rename it: "optimizer": {"params": {}}'),
])
def test_unknown_keys_get_a_suggestion(cfg, severity, suggestion, fix):
    f = one(lint(cfg), "config.unknown-key")
    assert f.severity == severity
    assert f.data["suggestion"] == suggestion
    assert f'did you mean "{suggestion}"?' in f.title or "belongs in" in f.title
    assert f.fix == [fix]


def test_an_unknown_key_next_to_the_one_it_means_says_merge():
    f = one(lint({**BASE, "zero_optimization": {"stage": 2, "stagee": 3}}), "config.unknown-key")
    assert f.fix == ['"zero_optimization.stage" is set too (2): merge what you meant into it and remove '
                     '"zero_optimization.stagee"']


def test_unknown_key_without_a_near_name_lists_what_the_block_accepts():
    f = one(lint({**BASE, "bf16": {"enabled": True, "xyz": 1}}), "config.unknown-key")
    assert f.data["suggestion"] is None
    assert f.fix[0].startswith('remove "bf16.xyz" ("bf16" accepts: enabled, immediate_grad_update,')


def test_known_keys_are_not_flagged():
    assert not of(lint(load(str(FIX / "hf_auto.json")), for_="hf"), "config.unknown-key")


@pytest.mark.parametrize("cfg, key, severity, needle", [
    ({**BASE, "zero_optimization": {"stage": 4}}, "zero_optimization.stage", "fail",
     'e.g. "zero_optimization": {"stage": 3}'),
    ({**BASE, "fp16": {"initial_scale_power": 16.5}}, "fp16.initial_scale_power", "fail", "expected an integer"),
    ({**BASE, "fp16": {"loss_scale": -1}}, "fp16.loss_scale", "fail", "expected a finite number >= 0"),
    ({**BASE, "fp16": {"initial_scale_power": True}}, "fp16.initial_scale_power", "warn", "reads true as 1"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu", "fail", "expected an integer > 0"),
    ({"train_micro_batch_size_per_gpu": "4"}, "train_micro_batch_size_per_gpu", "fail", "a string, not an integer"),
    ({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "CPU"}}},
     "zero_optimization.offload_param.device", "fail", '"offload_param": {"device": "cpu"}'),
    ({**BASE, "log_level": "verbose"}, "log_level", "fail", '"debug", "info", "warning", "error", "critical"'),
    ({**BASE, "wall_clock_breakdown": "false"}, "wall_clock_breakdown", "fail", '"false" too -- counts as true'),
    ({**BASE, "gradient_clipping": -1.0}, "gradient_clipping", "fail", "expected a finite number >= 0"),
    ({**BASE, "fp16": []}, "fp16", "fail", "expected a JSON object"),
])
def test_bad_values_name_the_expected_type_or_range(cfg, key, severity, needle):
    f = one(lint(cfg), "config.bad-value")
    assert (f.data["key"], f.severity) == (key, severity)
    assert needle in text(f)


@pytest.mark.parametrize("cfg", [
    {**BASE, "fp16": {"initial_scale_power": "16", "enabled": "no"}},  # pydantic reads these
    {**BASE, "zero_optimization": {"stage": "3", "reduce_bucket_size": 5e8}},
    {**BASE, "log_level": "INFO"},
    {**BASE, "gradient_clipping": 0},
])
def test_values_deepspeed_accepts_are_not_flagged(cfg):
    assert not of(lint(cfg), "config.bad-value")


@pytest.mark.parametrize("cfg, needle", [
    ({**BASE, "optimizer": {"type": "sgd"}}, 'did you mean "SGD"?'),
    ({**BASE, "scheduler": {"type": "WarmUpLR", "params": {}}}, 'did you mean "WarmupLR"?'),
    ({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, "WarmupDecayLR needs total_num_steps"),
    ({**BASE, "scheduler": {"type": "WarmupLR"}}, 'scheduler "WarmupLR" has no "params"'),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, '"gradient_clipping": 1.0'),
])
def test_optimizer_and_scheduler_are_checked_against_what_deepspeed_can_build(cfg, needle):
    assert any(needle in text(f) for f in of(lint(cfg), "config.bad-value"))


def test_optimizer_and_scheduler_names_deepspeed_resolves_pass():
    cfg = {**BASE, "optimizer": {"type": "Adam"}, "scheduler": {"type": "StepLR", "params": {"step_size": 10}}}
    assert [f.id for f in lint(cfg)] == ["config.ok"]


def test_removed_and_deprecated_keys():
    findings = lint({**BASE, "amp": {"enabled": True}, "zero_optimization": {"stage": 2, "cpu_offload": True}})
    removed = one(findings, "config.removed-key")
    assert removed.severity == "fail" and "Apex AMP" in removed.evidence[0]
    dep = one(findings, "config.deprecated")
    assert dep.severity == "warn"
    assert dep.fix == ['"zero_optimization": {"offload_optimizer": {"device": "cpu"}}']


# -- the rules ---------------------------------------------------------------------------------------------------

FP16 = {**BASE, "fp16": {"enabled": True}, "log_level": "info"}


def test_fp16_and_bf16_together_fail_and_the_fix_follows_the_gpus():
    cfg = {**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": "true"}}
    f = one(lint(cfg), "precision.fp16-and-bf16")
    assert f.severity == "fail"
    assert f.fix[0] == 'keep one: "fp16": {"enabled": false}, "bf16": {"enabled": true} (Ampere/sm 8.0 or newer)'
    old = one(lint(cfg, caps=["7.0"]), "precision.fp16-and-bf16")
    assert old.fix[0].startswith('keep one: "fp16": {"enabled": true}, "bf16": {"enabled": false}')
    assert not of(lint({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": False}}), "precision.fp16-and-bf16")


@pytest.mark.parametrize("caps, severity", [(["8.0", "9.0"], "warn"), ([], "info"), (["7.0", "8.6"], None),
                                            (["7.5"], None)])
def test_prefer_bf16_when_every_gpu_has_it(caps, severity):
    got = of(lint(FP16, caps=caps), "precision.prefer-bf16")
    assert [f.severity for f in got] == ([severity] if severity else [])
    if severity:
        assert got[0].fix[0].startswith('"bf16": {"enabled": true} and remove the "fp16" block')
        assert "NaN loss" in text(got[0])
    assert not of(lint({**BASE, "fp16": {"enabled": False}}, caps=caps), "precision.prefer-bf16")


def test_bf16_on_pre_ampere_gpus_warns():
    assert one(lint({**BASE, "bf16": {"enabled": True}}, caps=["7.0"]), "precision.bf16-unsupported").severity == "warn"
    assert not of(lint({**BASE, "bf16": {"enabled": True}}, caps=["8.0"]), "precision.bf16-unsupported")


@pytest.mark.parametrize("fp16, severity, needle", [
    ({"loss_scale": 128}, "warn", "a static loss scale"),
    ({"hysteresis": 0}, "fail", "the dynamic loss scale is never lowered"),
    ({"initial_scale_power": 4}, "warn", "below 3.7e-09 flush to zero"),
    ({"initial_scale_power": 40}, "warn", "costs 25 skipped steps"),
    ({"loss_scale_window": 10}, "warn", "throws away about one step in 10"),
    ({"consecutive_hysteresis": True}, "warn", "only halves when 2 overflows come in a row"),
    ({"min_loss_scale": 65536}, "warn", "not below the initial scale 2^16"),
])
def test_loss_scale_settings_that_hide_or_cause_a_collapse(fp16, severity, needle):
    f = one(lint({**BASE, "fp16": {"enabled": True, **fp16}, "log_level": "info"}), "fp16.loss-scale")
    assert f.severity == severity and needle in text(f)
    assert f.fix and f.fix[0].startswith('"fp16": {')
    # the same settings with fp16 off are not judged
    assert not of(lint({**BASE, "fp16": {"enabled": False, **fp16}}), "fp16.loss-scale")


@pytest.mark.parametrize("fp16", [{}, {"initial_scale_power": 32}, {"hysteresis": 1, "consecutive_hysteresis": True},
                                  {"loss_scale_window": 100, "min_loss_scale": 2}])
def test_reasonable_loss_scale_settings_pass(fp16):
    assert not of(lint({**BASE, "fp16": {"enabled": True, **fp16}, "log_level": "info"}), "fp16.loss-scale")


def test_a_zero_loss_scale_window_is_refused_with_dynamic_scaling():
    f = one(lint({**BASE, "fp16": {"enabled": True, "loss_scale_window": 0}}), "config.bad-value")
    assert f.data["key"] == "fp16.loss_scale_window" and "must be > 0" in text(f)
    assert not of(lint({**BASE, "fp16": {"enabled": True, "loss_scale": 8, "loss_scale_window": 0}}),
                  "config.bad-value")


def test_auto_outside_hf_fails_and_fp16_auto_is_off():
    cfg = {**BASE, "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    findings = lint(cfg)
    f = one(findings, "config.auto-outside-hf")
    assert f.severity == "fail"
    assert 'fp16.enabled "auto" means fp16 off' in f.title
    assert f.data == {"dropped": ["fp16.enabled"], "passed_on": ["optimizer.params.lr"], "for": "deepspeed",
                      "edits": []}
    assert not of(findings, "logging.overflow-hidden")  # fp16 is off for DeepSpeed
    assert not of(lint(cfg, for_="hf"), "config.auto-outside-hf")


def test_with_hf_an_auto_the_hf_trainer_cannot_fill_fails_as_accelerate_does():
    """accelerate's deepspeed_config_process raises for every "auto" left after transformers filled its own."""
    for cfg, key in [({**BASE, "fp16": {"enabled": True, "initial_scale_power": "auto"}, "log_level": "info"},
                      "fp16.initial_scale_power"),
                     ({**BASE, "optimizer": {"type": "AdamW", "params": {"foo": "auto"}}}, "optimizer.params.foo")]:
        findings = lint(cfg, for_="hf")
        f = one(findings, "hf.auto-not-filled")
        assert f.severity == "fail" and f.data["unfilled"] == [key]
        assert f"ValueError: `{key}` not found in kwargs" in text(f)
        assert not of(findings, "config.auto-outside-hf")
    assert [f.id for f in lint(load(str(FIX / "hf_auto.json")), for_="hf")] == ["config.ok"]


def test_with_hf_an_auto_under_the_old_bfloat16_name_is_renamed_not_replaced():
    cfg = {**BASE, "bfloat16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    f = one(lint(cfg, for_="hf"), "hf.auto-not-filled")
    assert f.data["unfilled"] == ["bfloat16.enabled"]
    assert f.fix == ['rename "bfloat16" to "bf16" (its current name, the one transformers fills): "bf16": '
                     '{"enabled": "auto"}']
    fixed = {**BASE, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    assert not of(lint(fixed, for_="hf"), "hf.auto-not-filled")


def test_hf_fill_reads_which_training_argument_fills_each_key():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "foo": "auto"}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    got = hf_fill(cfg)
    assert got.source.startswith("transformers ")
    assert got.fills["train_micro_batch_size_per_gpu"] == "TrainingArguments.per_device_train_batch_size"
    assert got.fills["optimizer.params.lr"] == "TrainingArguments.learning_rate"
    assert got.fills["gradient_clipping"] == "TrainingArguments.max_grad_norm"
    assert "zero_optimization.reduce_bucket_size" in got.fills
    assert got.unfilled == ("optimizer.params.foo",)
    assert got.filled["optimizer"]["params"]["lr"] == 5e-05 and got.filled["optimizer"]["params"]["foo"] == "auto"
    assert cfg["optimizer"]["params"]["lr"] == "auto"  # the caller's config is not touched


def test_without_transformers_the_bundled_hf_table_gives_the_same_verdicts(monkeypatch):
    cfgs = [load(str(FIX / "hf_auto.json")), {**BASE, "fp16": {"enabled": "auto", "initial_scale_power": "auto"}},
            {**BASE, "pipeline": {"stages": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}]
    with_hf = [_signature(lint(c, for_="hf")) for c in cfgs]
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert hf_fill(cfgs[1]).source == "bundled table (transformers not installed)"
    assert [_signature(lint(c, for_="hf")) for c in cfgs] == with_hf


# "auto" where DeepSpeed's own default is "auto": DeepSpeed reads it itself, nothing for the HF Trainer to fill
DS_OWN_AUTO = [
    {"pipeline": {"stages": "auto"}},  # runtime/config.py get_pipeline_config
    {"data_types": {"keep_in_fp32_modules": "auto"}},  # constants.py KEEP_IN_FP32_MODULES_DEFAULT
    {"zero_optimization": {"stage": 2, "zenflow": {"select_strategy": "auto", "select_interval": "auto",
                                                   "update_interval": "auto"}}},  # ZenFlowConfig defaults
    {"expert_parallel": {"enabled": True, "score_apply": "auto", "combine_impl": "auto", "row_weighting_impl": "auto",
                         "score_func": "auto", "top_k": "auto", "routed_scaling_factor": "auto"}},
]


@pytest.mark.parametrize("cfg", DS_OWN_AUTO)
def test_auto_that_is_deepspeeds_own_default_is_not_flagged(cfg):
    findings = lint({**BASE, **cfg})
    assert not of(findings, "config.auto-outside-hf"), [f.title for f in findings]
    assert [f.id for f in findings] == ["config.ok"]


@pytest.mark.parametrize("cfg", DS_OWN_AUTO)
def test_with_hf_even_deepspeeds_own_auto_stops_accelerate(cfg):
    """accelerate walks every object value and refuses any "auto" it has no value for, DeepSpeed's own too."""
    f = one(lint({**BASE, **cfg}, for_="hf"), "hf.auto-not-filled")
    assert f.severity == "fail" and "not found in kwargs" in text(f)
    assert all(k in config_check.schema().ds_auto for k in f.data["unfilled"])
    assert f.fix[0].startswith("replace each with the value the run should use (or remove ")


def test_auto_elsewhere_in_the_same_blocks_is_still_flagged():
    f = one(lint({**BASE, "pipeline": {"partition": "auto"}, "data_types": {"keep_in_fp32_modules": ["auto"]}}),
            "config.auto-outside-hf")
    assert f.data["passed_on"] == ["pipeline.partition", "data_types.keep_in_fp32_modules[0]"]


def test_deepspeeds_own_auto_keys_come_from_deepspeed_and_match_the_bundled_copy(monkeypatch, fresh_schema):
    pytest.importorskip("deepspeed")
    t = config_check.deepspeed_tables()
    assert "data_types.keep_in_fp32_modules" in t["auto"]["config"] and "pipeline.stages" in t["auto"]["pipeline"]
    if t["version"] == config_check.FALLBACK_VERSION:
        assert t["auto"] == schema_tables._FALLBACK_DS_AUTO
    assert config_check.schema().ds_auto == {k for keys in t["auto"].values() for k in keys}
    # without deepspeed the bundled copy gives the same verdicts
    config_check.schema.cache_clear()
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert not config_check.schema().from_deepspeed
    for cfg in DS_OWN_AUTO:
        assert [f.id for f in lint({**BASE, **cfg})] == ["config.ok"]


def test_a_moved_private_reader_keeps_the_bundled_auto_keys(monkeypatch):
    pytest.importorskip("deepspeed")

    def moved():
        raise AttributeError("get_pipeline_config")

    from torchdoctor.deepspeed import schema_auto

    monkeypatch.setattr(schema_auto, "_auto_in_pipeline", moved)
    assert schema_auto.ds_auto_from_deepspeed()["pipeline"] == ("pipeline.stages",)


@pytest.mark.parametrize("cfg, ws, severity, needle", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, "fail",
     '"gradient_accumulation_steps": 4  (keeps train_batch_size 64)'),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, None, "info",
     "only fit a world size of 8"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, None, "fail",
     "no world size fits"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 3, "fail", "does not split"),
    ({"train_batch_size": 10}, 4, "fail", "not a multiple of world size 4"),
    ({"gradient_accumulation_steps": 2}, None, "fail", "neither train_batch_size nor"),
])
def test_batch_size_arithmetic(cfg, ws, severity, needle):
    f = one(lint(cfg, world_size=ws), "config.batch-size")
    assert f.severity == severity and needle in text(f)


@pytest.mark.parametrize("cfg, ws, for_", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8, "deepspeed"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 8, "deepspeed"),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 7, "deepspeed"),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, 4, "hf"),
])
def test_consistent_batch_sizes_pass(cfg, ws, for_):
    assert not of(lint(cfg, world_size=ws, for_=for_), "config.batch-size")


def test_no_batch_key_fails_under_hf_too_since_the_trainer_fills_only_auto_keys():
    # transformers fills a batch key only where it says "auto", so DeepSpeed then stops with "Either
    # train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
    found = of(lint({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}, for_="hf"),
               "config.batch-size")
    assert [f.severity for f in found] == ["fail"] and '"auto"' in found[0].title
    assert found[0].data["edits"] == [{"path": ["train_micro_batch_size_per_gpu"], "value": "auto"}]
    assert not of(lint({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}},
                       for_="hf"), "config.batch-size")


def test_under_hf_a_missing_accumulation_is_one_not_derived():
    # accelerate's DeepSpeedPlugin writes gradient_accumulation_steps 1 into a config without it
    cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    assert not of(lint(cfg, world_size=1, for_="deepspeed"), "config.batch-size")  # DeepSpeed derives 16
    found = of(lint(cfg, world_size=1, for_="hf"), "config.batch-size")
    assert [f.severity for f in found] == ["fail"] and "accumulation 1" in found[0].title


def test_offload_param_needs_stage_3():
    cfg = {**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    f = one(lint(cfg), "zero.offload-param-stage")
    assert f.severity == "warn" and f.fix[0] == '"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}'
    assert not of(lint({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
                  "zero.offload-param-stage")
    assert not of(lint({**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}}),
                  "zero.offload-param-stage")


def test_nvme_needs_a_path_and_libaio():
    cfg = {**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    findings = lint(cfg, libaio=None)
    assert one(findings, "zero.nvme-path").severity == "fail"
    aio = one(findings, "build.libaio-missing")
    assert aio.severity == "fail"
    assert "sudo apt install libaio-dev" in aio.fix[0] and "DS_BUILD_AIO=1" in aio.fix[1]
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/local_nvme"
    fine = lint(cfg, libaio=LIBAIO)
    assert not of(fine, "zero.nvme-path") and not of(fine, "build.libaio-missing")
    assert [f.id for f in fine] == ["config.ok"]


def test_nvme_optimizer_offload_below_stage_3_goes_to_cpu():
    cfg = {**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    findings = lint(cfg, libaio=None)
    assert one(findings, "zero.nvme-stage").severity == "warn"
    assert not of(findings, "zero.nvme-path") and not of(findings, "build.libaio-missing")  # NVMe is not used


def test_cli_nvme_config_on_a_machine_without_libaio(monkeypatch, capsys):
    monkeypatch.setattr(check_run, "_probe", lambda: (["9.0"], None))
    assert cli(str(FIX / "nvme.json"), "--json") == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert sorted((f["id"], f["severity"]) for f in findings) == [("build.libaio-missing", "fail"),
                                                                  ("zero.nvme-path", "fail")]
    assert [f["data"] for f in findings if f["id"] == "zero.nvme-path"] == [
        {"block": "zero_optimization.offload_optimizer",
         "edits": [{"path": ["zero_optimization", "offload_optimizer", "device"], "value": "nvme"},
                   {"path": ["zero_optimization", "offload_optimizer", "nvme_path"], "value": "/local_nvme"}]}]


def test_bfloat16_is_the_old_name_of_bf16():
    findings = lint({**BASE, "bfloat16": {"enabled": True}, "fp16": {"enabled": True}})
    assert one(findings, "config.deprecated").fix == ['rename it: "bf16": {"enabled": true}']
    assert one(findings, "precision.fp16-and-bf16").severity == "fail"


def test_overflow_lines_hidden_unless_log_level_info():
    f = one(lint({**BASE, "fp16": {"enabled": True}}), "logging.overflow-hidden")
    assert f.severity == "warn"
    assert f.fix[0].startswith('"log_level": "info"')
    assert "OVERFLOW! Rank 0 Skipping step" in text(f)
    assert "not its handler's" in text(one(lint({**BASE, "fp16": {"enabled": True}}, for_="hf"),
                                           "logging.overflow-hidden"))
    assert of(lint({**BASE, "fp16": {"enabled": True}, "log_level": "warning"}), "logging.overflow-hidden")
    for quiet in ({"fp16": {"enabled": True}, "log_level": "INFO"}, {"fp16": {"enabled": True}, "log_level": "debug"},
                  {"fp16": {"enabled": True, "loss_scale": 1024}},  # static scaling logs skips at WARNING
                  {"bf16": {"enabled": True}}):
        assert not of(lint({**BASE, **quiet}), "logging.overflow-hidden"), quiet


# -- never raises --------------------------------------------------------------------------------------------------

_SCHEMA = config_check.schema()
_ALL_KEYS = sorted({k for specs in _SCHEMA.blocks.values() for k in specs}
                   | {"params", "type", "lr", "total_num_steps", "max_grad_norm", "zero_optimisation", "amp"})
_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-2, 40)
         | st.floats(allow_nan=True, allow_infinity=True)
         | st.sampled_from(["auto", "cpu", "nvme", "none", "info", "WARNING", "WarmupLR", "AdamW", "sgd", "16", "true",
                            "", "/nvme"])
         | st.text(max_size=4))
_keys = st.sampled_from(_ALL_KEYS) | st.text(max_size=6)
_values = st.recursive(_leaf, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(_keys, ch, max_size=5),
                       max_leaves=12)


def _typed(spec: config_check.Spec) -> st.SearchStrategy:
    """Mostly values of the key's own type (so the rules behind the schema checks run), sometimes anything."""
    if spec.kind == "bool":
        typed = st.booleans()
    elif spec.kind == "int":
        typed = st.integers(-3, 70)
    elif spec.kind == "float":
        typed = st.sampled_from([0, 0.5, 1.0, 128.0, -1.0])
    elif spec.kind == "choice":
        typed = st.sampled_from(spec.values)
    elif spec.kind in ("str", "path"):
        typed = st.sampled_from(["/nvme", "", "info"])
    else:
        typed = _leaf
    return _mostly(typed, _leaf)


def _mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(0, 9).flatmap(lambda i: usual if i < 8 else rare)


def _block(block: str, only: tuple[str, ...] = ()) -> st.SearchStrategy:
    """Dicts shaped like DeepSpeed's blocks (any subset of their keys, mostly well typed), so the rules run deep."""
    optional = {}
    for key, spec in _SCHEMA.blocks[block].items():
        if only and key not in only:
            continue
        if spec.kind == "block" and spec.ref in _SCHEMA.blocks:
            optional[key] = _mostly(_block(spec.ref), _leaf)
        elif key == "params":
            names = sorted({p for ps, _ in _SCHEMA.schedulers.values() for p in ps} | {"lr", "max_grad_norm"})
            optional[key] = st.dictionaries(st.sampled_from(names) | st.text(max_size=3), _leaf, max_size=4) | _leaf
        elif key == "type":
            optional[key] = st.sampled_from([*_SCHEMA.schedulers, *_SCHEMA.optimizers, "Adam", "sgd"]) | _leaf
        else:
            optional[key] = _typed(spec)
    required = {k: optional.pop(k) for k in ("enabled", "stage", "device") if k in optional}  # the rules' switches
    return st.builds(lambda known, extra: {**known, **extra}, st.fixed_dictionaries(required, optional=optional),
                     st.dictionaries(_keys, _values, max_size=1))


_RULE_KEYS = ("fp16", "bf16", "bfloat16", "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "log_level", "optimizer", "scheduler")


@settings(max_examples=150, deadline=None)
@given(cfg=_block("", only=_RULE_KEYS) | _block("") | st.dictionaries(_keys, _values, max_size=8),
       for_=st.sampled_from(config_check.FOR_CHOICES), ws=st.none() | st.integers(1, 64),
       caps=st.lists(st.sampled_from(["7.0", "8.0", "9.0", "x", ""]), max_size=3),
       libaio=st.none() | st.just(LIBAIO))
def test_check_never_raises_on_json_like_input(cfg, for_, ws, caps, libaio):
    findings = lint(cfg, world_size=ws, for_=for_, caps=caps, libaio=libaio)
    assert findings and all(isinstance(f, Finding) for f in findings)
    json.dumps([f.to_json() for f in findings])
    for f in findings:
        if f.severity in ("warn", "fail"):
            assert f.fix, f


# -- the command ------------------------------------------------------------------------------------------------


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    check_run.add_arguments(parser)
    return check_run.run(parser.parse_args(list(argv)))


@pytest.fixture
def machine(monkeypatch):
    """An Ampere machine with libaio, whatever this one is (the real probe has its own test)."""
    monkeypatch.setattr(check_run, "_probe", lambda: (["8.0"], LIBAIO))


def test_cli_ok_config_exits_0(machine, capsys):
    assert cli(str(FIX / "good.json"), "--world-size", "4") == 0
    out = capsys.readouterr()
    assert "[OK]" in out.out and "world size 4" in out.out and out.err == ""


def test_cli_problems_exit_1_and_print_findings(machine, capsys):
    assert cli(str(FIX / "problems.json"), "--world-size", "4") == 1
    out = capsys.readouterr().out
    assert '[WARN] unknown key "zero_optimisation"; did you mean "zero_optimization"?  (config.unknown-key)' in out
    assert "(zero.offload-param-stage)" in out and "(config.batch-size)" in out


def test_cli_json(machine, capsys):
    path = str(FIX / "problems.json")
    assert cli(path, "--json", "--for", "hf") == 1
    out = json.loads(capsys.readouterr().out)
    assert out["config"] == path and out["for"] == "hf" and out["gpu_capabilities"] == ["8.0"]
    assert {f["id"] for f in out["findings"]} >= {"config.unknown-key", "zero.offload-param-stage"}
    for f in out["findings"]:
        assert set(f) == {"id", "severity", "title", "evidence", "fix", "data"}


@pytest.mark.parametrize("argv, message", [
    (["malformed.json"], "malformed.json:3:3: invalid JSON: Expecting ',' delimiter"),
    (["nope.json"], "nope.json: no such file"),
    (["array.json"], "the top level is an array"),
    (["good.json", "--world-size", "0"], "--world-size: 0 is not a positive number of ranks"),
    (["good.json", "--world-size", "four"], "--world-size: 'four' is not a whole number"),
])
def test_cli_usage_errors_exit_2_without_traceback(machine, capsys, argv, message):
    argv = [str(FIX / argv[0]), *argv[1:]]
    assert cli(*argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("torchdoctor ds check: ") and message in out.err
    assert "Traceback" not in out.err


def test_cli_with_the_real_probe_in_a_fresh_process():
    """End to end on this machine: DeepSpeed's import-time log lines must not reach the --json output."""
    proc = subprocess.run([sys.executable, "-m", "torchdoctor.deepspeed.check_run", str(FIX / "good.json"),
                           "--world-size", "4", "--json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    out = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert out["schema"].startswith("deepspeed ") and out["findings"]
    assert all(isinstance(c, str) and not math.isnan(float(c)) for c in out["gpu_capabilities"])
    assert "Traceback" not in proc.stderr


def test_cli_for_hf_in_a_fresh_process_keeps_json_clean():
    """transformers and accelerate run inside the check with --for hf: their log lines must not reach stdout."""
    proc = subprocess.run([sys.executable, "-m", "torchdoctor.deepspeed.check_run", str(FIX / "hf_auto.json"),
                           "--for", "hf", "--json"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": SRC})
    out = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert out["hf_fill"].startswith("transformers ") or out["hf_fill"].startswith("bundled table")
    assert [f["id"] for f in out["findings"]] == ["config.ok"]


@pytest.mark.parametrize("junk", [None, "x", [1], {"a": 1}, float("nan"), -(2**80), 2**80, True])
def test_junk_values_reach_the_rules_without_crashing(junk):
    """Every value the rules read, set to junk while the rule's switch is on (hypothesis rarely gets that deep)."""
    fp16 = {k: junk for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                              "consecutive_hysteresis", "min_loss_scale")}
    zero = {"stage": junk, "compute_grad_norm": junk,
            "offload_param": {"device": "nvme", "nvme_path": junk},
            "offload_optimizer": {"device": "nvme", "nvme_path": junk, "ratio": junk}}
    cfgs = [{"fp16": {"enabled": True, **fp16}, "log_level": junk, "train_batch_size": junk},
            *({"fp16": {"enabled": True, key: junk}, "train_batch_size": 8, "gradient_accumulation_steps": junk}
              for key in fp16),
            {"zero_optimization": zero, "train_micro_batch_size_per_gpu": junk, "gradient_accumulation_steps": junk},
            {"bf16": {"enabled": True, "bf16_optimizer_states": junk}, "zero_optimization": {**zero, "stage": 0}},
            {"optimizer": {"type": junk, "params": junk}, "scheduler": {"type": "WarmupLR", "params": junk}}]
    for cfg in cfgs:
        for for_ in config_check.FOR_CHOICES:
            findings = lint(cfg, world_size=4, for_=for_, libaio=None)
            assert findings
            json.dumps([f.to_json() for f in findings])


# -- every value a fix suggests is one the check accepts ----------------------------------------------------------

_COLON = re.compile(r"\s*:\s*")
_NEXT_MEMBER = re.compile(r"\s*,\s*(?=\")")
_SNIPPET_START = re.compile(r'(?:^|: |e\.g\. |or |keep one: |then )(?=")')


def snippets(line: str) -> list[dict]:
    """The JSON members a fix line suggests, each run of them as a dict to merge at the top level of the config:
    'set it to ..., e.g. "fp16": {"min_loss_scale": 1}' -> [{"fp16": {"min_loss_scale": 1}}]. Runs that are not
    JSON ('"params": {...}') are skipped."""
    out = []
    dec = json.JSONDecoder()
    for m in _SNIPPET_START.finditer(line):
        members, j = {}, m.end()
        try:
            while True:
                key, j = json.decoder.scanstring(line, j + 1)
                colon = _COLON.match(line, j)
                if not colon:
                    raise ValueError("no colon")
                members[key], j = dec.raw_decode(line, colon.end())
                more = _NEXT_MEMBER.match(line, j)
                if not more:
                    break
                j = more.end()
        except ValueError:
            continue
        out.append(members)
    return out


def merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for k, v in patch.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def leaves(d: dict, prefix: str = "", moved: object = None) -> list[str]:
    """Dotted paths of the values in ``d``; a block equal to ``moved`` (the user's own block, renamed or moved by
    the fix with its content) is one path: what is inside is the user's, with findings of its own."""
    out = []
    for k, v in d.items():
        descend = isinstance(v, dict) and v and not (isinstance(moved, dict) and v == moved)
        out += leaves(v, f"{prefix}{k}.", moved) if descend else [prefix + k]
    return out


def value_at(cfg: dict, dotted: str | None) -> object:
    v: object = cfg
    for part in (dotted or "").split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v


def test_snippets_reads_the_fix_formats():
    assert snippets('set it to an integer, e.g. "fp16": {"min_loss_scale": 1}') == [{"fp16": {"min_loss_scale": 1}}]
    assert snippets('"fp16": {"enabled": true, "loss_scale": 0}, "bf16": {"enabled": false}  (fp16 with dynamic') == [
        {"fp16": {"enabled": True, "loss_scale": 0}, "bf16": {"enabled": False}}]
    assert snippets('"scheduler": {"type": "WarmupLR", "params": {...}}') == []
    assert snippets('remove "bf16.xyz" ("bf16" accepts: enabled)') == []
    assert snippets('rename it: "zero_optimization": {"stage": 2}') == [{"zero_optimization": {"stage": 2}}]


def assert_fixes_are_accepted(cfg: dict, for_: str = "deepspeed", world_size: int | None = None) -> int:
    """Apply each JSON snippet of each fix to ``cfg``: the keys it sets must then draw no fail or warn.
    Returns how many snippets were checked."""
    checked = 0
    for f in lint(cfg, for_=for_, world_size=world_size):
        for line in f.fix:
            for snip in snippets(line):
                fixed = merge(cfg, snip)
                keys = set(leaves(snip, moved=value_at(cfg, f.data.get("key"))))
                after = lint(fixed, for_=for_, world_size=world_size)
                bad = [(g.id, g.title) for g in after if g.severity in ("fail", "warn") and g.data.get("key") in keys]
                assert not bad, (cfg, f.id, line, bad)
                checked += 1
    return checked


REVIEW_CONFIGS = [
    {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 10,
                                                   "hysteresis": 1, "min_loss_scale": 0.0001},
     "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme"}}},
    {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "min_loss_scale": 0, "loss_scale_window": 0}},
    {"train_micro_batch_size_per_gpu": -1, "gradient_accumulation_steps": "2",
     "zero_optimization": {"stage": 7, "overlap_com": True, "reduce_bucket_size": 1e400},
     "fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 64, "hysteresis": 0}, "steps_per_print": 1e30,
     "optimizer": {"type": "adamw", "params": {"lr": "3e-5"}}},
    {**BASE, "fp16": {"enabled": True, "loss_scale_window": 0.5, "min_loss_scale": -3.5, "initial_scale_power": 2.5,
                      "hysteresis": 0.3}},
    {**BASE, "fp16": {"enabled": True, "minloss_scale": 0.25, "loss_scale_windw": 0}},  # renamed with bad values
    {**BASE, "min_loss_scale": 0.1, "loss_scale_window": 0, "fp16": {"enabled": True}},  # moved with bad values
    {**BASE, "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": "maybe",
                                   "offload_optimizer": {"device": "disk", "ratio": 1.5}}},
    {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
     "fp16": {"enabled": True}, "bf16": {"enabled": True}},
]


@pytest.mark.parametrize("cfg", REVIEW_CONFIGS + [load(str(FIX / n)) for n in ("problems.json", "nvme.json")])
def test_every_fix_snippet_is_accepted_by_the_check(cfg):
    assert assert_fixes_are_accepted(cfg, world_size=4) > 0


def test_a_fractional_min_loss_scale_suggests_the_default_not_zero():
    cfg = {**BASE, "fp16": {"enabled": True, "min_loss_scale": 0.0001}}
    f = one(lint(cfg), "config.bad-value")
    assert f.fix == ['set it to an integer, e.g. "fp16": {"min_loss_scale": 1}']
    for_zero = one(lint({**BASE, "fp16": {"enabled": True, "min_loss_scale": 0}}), "config.bad-value")
    assert '"min_loss_scale": 1' in for_zero.fix[0]


def test_a_rename_to_a_key_that_refuses_the_value_suggests_one_it_accepts():
    f = one(lint({**BASE, "zero_optimization": {"stagee": 7}}), "config.unknown-key")
    assert f.fix == ['rename it: "zero_optimization": {"stage": 3}  (7 is not accepted there: one of 0, 1, 2, 3)']


@settings(max_examples=60, deadline=None)
@given(cfg=_block("", only=_RULE_KEYS), for_=st.sampled_from(config_check.FOR_CHOICES),
       ws=st.none() | st.integers(1, 16))
def test_fix_snippets_are_accepted_on_generated_configs(cfg, for_, ws):
    assert_fixes_are_accepted(cfg, for_=for_, world_size=ws)


# -- the command: stdin, nesting, non-finite values -----------------------------------------------------------------


def test_cli_reads_standard_input(machine, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(
        {**BASE, "pipeline": {"stages": "auto"}}).encode())))
    assert cli("-") == 0
    assert "[OK] <stdin>: no problems found" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"a": 1,}')))
    assert cli("-") == 2
    err = capsys.readouterr().err
    assert err.startswith("torchdoctor ds check: <stdin>:1:9: invalid JSON") and "trailing comma" in err


@pytest.mark.parametrize("text", ['{"a":' * 100_000 + "1" + "}" * 100_000, "[" * 5000 + "]" * 5000,
                                  '{"a":' * 101 + "1" + "}" * 101])
def test_cli_deeply_nested_json_is_exit_2_not_a_traceback(machine, capsys, tmp_path, text):
    p = tmp_path / "deep.json"
    p.write_text(text)
    assert cli(str(p)) == 2
    err = capsys.readouterr().err
    assert f"{p}:1:" in err and "nested more than 100 levels deep" in err and "Traceback" not in err
    assert max(len(line) for line in err.splitlines()) < 200  # the one long line is cut around the column


def test_cli_json_stays_valid_json_with_nan_and_infinity(machine, capsys, tmp_path):
    p = tmp_path / "nan.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true, "loss_scale": NaN}, '
                 '"gradient_clipping": Infinity}')
    assert cli(str(p), "--json") == 1
    out = capsys.readouterr().out
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the output"))
    values = {f["data"].get("key"): f["data"].get("value") for f in doc["findings"]}
    assert values["fp16.loss_scale"] == "nan" and values["gradient_clipping"] == "inf"


@pytest.mark.parametrize("text", ['1e5', '100000.0'])
def test_an_integral_float_deepspeed_keeps_as_given_is_a_warning_not_a_refusal(text):
    """`"steps_per_print": 1e5` is a float in JSON; DeepSpeed's parser keeps it as given and the run works, so it is
    not a fail -- unless the parser refuses it, which it does not here (checked with DeepSpeed's own steps)."""
    from torchdoctor.deepspeed.parse import refusal

    cfg = {**BASE, "steps_per_print": json.loads(text)}
    [f] = [f for f in lint(cfg) if f.id == "config.bad-value"]
    assert f.severity == "warn" and "stays a float" in f.evidence[0], f
    assert f.data["edits"] and f.data["edits"][0]["value"] == 100000
    pytest.importorskip("deepspeed")
    assert refusal(cfg, 1) is None

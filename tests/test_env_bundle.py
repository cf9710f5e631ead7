"""torchdoctor.env.bundle: the bug-report bundle. Real files in tmp_path, real TrainingArguments JSON, Facts by hand."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from torchdoctor.env import training_args
from torchdoctor.env.bundle import BundleError, load_ds_config, uses_nvme
from torchdoctor.env.bundle_render import render_markdown, to_json, versions
from torchdoctor.env.facts import Facts, Gpu, PackageFacts, Toolkit, TorchFacts
from torchdoctor.env.training_args import load_training_args, training_args_diff
from torchdoctor.findings import Finding

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
}


def write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


class Payload:
    """Unpickling this writes ``marker``: proof that a file was (or was not) unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('unpickled')",))


@pytest.fixture(scope="module")
def ta_module():
    transformers = pytest.importorskip("transformers")
    return transformers.TrainingArguments


@pytest.fixture(scope="module")
def user_ta_json(ta_module, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run") / "out")
    args = ta_module(output_dir=out, learning_rate=3e-5, fp16=True, per_device_train_batch_size=4)
    return out, args.to_json_string()


# -- DeepSpeed config -----------------------------------------------------------------------------------


def test_load_ds_config_reads_the_object(tmp_path):
    path = write(tmp_path / "ds.json", "\ufeff" + json.dumps(DS_CONFIG, indent=2))  # a BOM is fine
    assert load_ds_config(path) == DS_CONFIG


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.json", None, "no such file"),
        ("adir", "DIR", "is a directory"),
        ("bad.json", '{\n  "bf16": {"enabled": true},\n  "stage": 3,,\n}', "bad.json:3:14: invalid JSON"),
        ("list.json", "[1, 2]", "the top level is an array"),
        ("str.json", '"zero"', "the top level is a string"),
        ("empty.json", "  \n", "empty"),
        ("dup.json", '{"zero_optimization": {"stage": 2, "stage": 3}}', 'dup.json:1:36: duplicate key "stage"'),
        ("deep.json", '{"a":' * 5000 + "1" + "}" * 5000, "deep.json:1:501: nested more than 100 levels deep"),
        ("latin1.json", b'{"a": "\xe9"}', "not UTF-8"),
        ("ds.bin", json.dumps(DS_CONFIG), "pickle"),  # refused by its name, even if the bytes are JSON
        ("ds.pt", json.dumps(DS_CONFIG), "pickle"),
        ("ds.pkl", json.dumps(DS_CONFIG), "pickle"),
        ("zip.json", b"PK\x03\x04rest-of-a-torch-save", "pickle / torch.save"),
    ],
)
def test_load_ds_config_errors(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        write(path, content)
    with pytest.raises(BundleError) as e:
        load_ds_config(str(path))
    assert message in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nv"}}}, True),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "NVMe"}}}, True),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, False),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}, False),
        ({"zero_optimization": {"stage": 3, "nvme_path": "/nv"}}, False),  # a path alone offloads nothing
        ({"bf16": {"enabled": True}}, False),
        ({"zero_optimization": "auto"}, False),
    ],
)
def test_uses_nvme(config, expected):
    assert uses_nvme(config) is expected


# -- TrainingArguments ----------------------------------------------------------------------------------


def test_training_args_from_to_json_string_lists_only_what_the_user_set(user_ta_json, tmp_path):
    out, text = user_ta_json
    path = write(tmp_path / "training_args.json", text)
    args = load_training_args(path)
    assert len(args) > 100  # the whole dump, defaults included
    diff = training_args_diff(args)
    assert diff["changed"] == {"output_dir": out, "learning_rate": 3e-5, "fp16": True, "per_device_train_batch_size": 4}
    assert diff["unknown"] == []
    assert diff["defaults_from"].startswith("transformers ")
    assert "hub_token" not in diff["changed"]  # always "<HUB_TOKEN>" in the dump


def test_untouched_training_args_have_no_changes(ta_module):
    dumped = json.loads(ta_module().to_json_string())
    # The dump holds values __post_init__ derived (these would all be listed without the rules).
    assert dumped["output_dir"] == "trainer_output" and dumped["report_to"] == [] and dumped["debug"] == []
    assert isinstance(dumped["accelerator_config"], dict) and dumped["gradient_checkpointing"] is False
    diff = training_args_diff(dumped)
    assert diff["changed"] == {}, diff


def test_every_scalar_default_given_on_the_command_line_is_no_change(ta_module):
    words = []
    for f in dataclasses.fields(ta_module):
        d = f.default
        if isinstance(d, bool):
            words.append(f"--{f.name}={str(d).lower()}")
        elif isinstance(d, (int, float)):
            words.append(f"--{f.name} {d!r}")
        elif isinstance(d, str) and d and f.name not in training_args.SKIPPED_FIELDS:
            words.append(f"--{f.name} {d}")
    assert len(words) > 50
    args = load_training_args(" ".join(words))
    assert len(args) == len(words)
    assert training_args_diff(args)["changed"] == {}


def test_training_args_from_a_command_line():
    spec = (
        "python train.py --learning_rate 1e-4 --fp16 --per_device_train_batch_size=16 --bf16 false "
        "--report_to wandb tensorboard --label_names labels --no_dataloader_pin_memory --weight_decay=-0.1 "
        "--lr-scheduler-type cosine --tf32 None --accelerator_config '{\"split_batches\": true}' "
        "--my_script_flag --model_name_or_path gpt2 --num_train_epochs 2"
    )
    args = load_training_args(spec)
    assert args == {
        "learning_rate": 1e-4,
        "fp16": True,
        "per_device_train_batch_size": 16,
        "bf16": False,
        "report_to": ["wandb", "tensorboard"],
        "label_names": ["labels"],  # list[str] | None: a list even with one value
        "dataloader_pin_memory": False,
        "weight_decay": -0.1,
        "lr_scheduler_type": "cosine",
        "tf32": None,
        "accelerator_config": {"split_batches": True},
        "my_script_flag": True,
        "model_name_or_path": "gpt2",
        "num_train_epochs": 2,
    }
    assert type(args["learning_rate"]) is float and type(args["per_device_train_batch_size"]) is int
    diff = training_args_diff(args)
    assert diff["unknown"] == ["my_script_flag", "model_name_or_path"]
    # bf16=false, tf32=None are the defaults; the rest was changed
    assert set(diff["changed"]) == set(args) - {"bf16", "tf32"}


def test_command_line_single_list_word_stays_a_string_and_none_is_default():
    assert load_training_args("--report_to wandb") == {"report_to": "wandb"}
    assert training_args_diff(load_training_args("--report_to none --debug ''"))["changed"] == {}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("--learning_rate abc", "--learning_rate abc"),
        ("--fp16 maybe", "not a boolean"),
        ("--output_dir --fp16", "--output_dir needs a value"),
        ("--learning_rate 1 2", "takes one value, got 2"),
        ("--report_to=wandb tensorboard", "takes one value"),
        ("--lr_scheduler_type cosine --debug bogus_option other", "--debug"),
        ("train.py lr=3", "no --options"),
        ("--run_name 'unbalanced", "split"),
        ("   ", "empty"),
        ("missing_args.json", "no such file"),
    ],
)
def test_training_args_command_line_errors(spec, message):
    with pytest.raises(BundleError) as e:
        load_training_args(spec)
    assert message in str(e.value)


def test_training_args_file_errors(tmp_path):
    with pytest.raises(BundleError, match="a.json:1:2: invalid JSON"):
        load_training_args(write(tmp_path / "a.json", "{'learning_rate': 1}"))
    with pytest.raises(BundleError, match="is a JSON object"):
        load_training_args(write(tmp_path / "b.json", "[]"))
    with pytest.raises(BundleError, match="is a directory"):
        load_training_args(str(tmp_path))


def test_training_args_file_strings_take_the_field_type(tmp_path):
    path = write(tmp_path / "hand.json", json.dumps({"learning_rate": "5e-5", "fp16": "true", "output_dir": "o"}))
    args = load_training_args(path)
    assert args == {"learning_rate": 5e-5, "fp16": True, "output_dir": "o"}
    assert training_args_diff(args)["changed"] == {"fp16": True, "output_dir": "o"}


def test_pickled_training_args_are_refused_unread(tmp_path):
    payload = pickle.dumps(Payload(str(tmp_path / "proof")))
    pickle.loads(payload)  # our own bytes: shows the payload does write its marker when unpickled
    assert (tmp_path / "proof").read_text() == "unpickled"

    marker = tmp_path / "marker"
    data = pickle.dumps(Payload(str(marker)))
    for name in ("training_args.bin", "args.pt", "args.json", "args"):  # by name, or by the pickle's first bytes
        path = write(tmp_path / name, data)
        with pytest.raises(BundleError) as e:
            load_training_args(path)
        assert "to_json_string()" in str(e.value) and "pickle" in str(e.value)
        with pytest.raises(BundleError, match="pickle"):
            load_ds_config(path)
    with pytest.raises(BundleError, match="to_json_string"):
        load_training_args(str(tmp_path / "not-there" / "training_args.bin"))
    assert not marker.exists()


def test_diff_redacts_tokens_and_drops_the_deprecated_alias():
    args = {
        "hub_token": "hf_secret123",
        "push_to_hub": True,
        "gradient_checkpointing": True,
        "activation_checkpointing": True,
        "wandb_api_key": "k",
        "disable_tqdm": True,
        "local_rank": 3,
    }
    diff = training_args_diff(args)
    assert diff["changed"] == {
        "hub_token": "<redacted>", "push_to_hub": True, "activation_checkpointing": True, "wandb_api_key": "<redacted>",
    }
    assert diff["unknown"] == ["wandb_api_key"]
    assert "disable_tqdm" in diff["note"] and "local_rank" in diff["note"]
    assert "hf_secret123" not in json.dumps(diff)
    assert training_args_diff({"hub_token": "<HUB_TOKEN>", "local_rank": -1}) == {
        "changed": {}, "unknown": [], "defaults_from": diff["defaults_from"], "note": None,
    }


def test_diff_normalises_enums_and_tuples():
    from transformers.trainer_utils import IntervalStrategy, SchedulerType

    diff = training_args_diff({
        "lr_scheduler_type": SchedulerType.LINEAR,  # the default, as an enum
        "eval_strategy": IntervalStrategy.STEPS,
        "label_names": ("labels",),
        "include_num_input_tokens_seen": False,  # __post_init__ makes it "no", the default
        "num_train_epochs": 3,  # the float default 3.0
    })
    assert diff["changed"] == {"eval_strategy": "steps", "label_names": ["labels"]}


def test_without_transformers_everything_is_listed(monkeypatch):
    monkeypatch.setattr(training_args, "_ta_fields", lambda: None)
    args = load_training_args("--learning_rate 1e-4 --fp16 --warmup_steps=10 --report_to wandb tb --no_x --hub_token t")
    assert args == {"learning_rate": 1e-4, "fp16": True, "warmup_steps": 10, "report_to": ["wandb", "tb"],
                    "no_x": True, "hub_token": "t"}
    diff = training_args_diff(args)
    assert diff["changed"] == {**args, "hub_token": "<redacted>"}
    assert diff["unknown"] == [] and diff["defaults_from"] is None
    assert "defaults are unknown" in diff["note"]


# -- versions, markdown, JSON ---------------------------------------------------------------------------


def make_facts(**over) -> Facts:
    kw = dict(
        os="Linux-6.8.0-x86_64-with-glibc2.39",
        python="3.11.9",
        torch=TorchFacts(version="2.5.1+cu124", cuda="12.4", cudnn="90100", nccl="2.21.5", cuda_available=True),
        packages={
            "transformers": PackageFacts("transformers", "4.46.3", True),
            "accelerate": PackageFacts("accelerate", None),
            "deepspeed": PackageFacts("deepspeed", "0.16.1", True),
        },
        gpus=[Gpu(0, "NVIDIA H100 80GB HBM3", "9.0"), Gpu(1, "NVIDIA H100 80GB HBM3", "9.0"),
              Gpu(2, "NVIDIA A100-SXM4-40GB", "8.0")],
        driver="550.54.15",
        toolkits=[Toolkit("/usr/local/cuda-11.8", ["PATH"], version="11.8"),
                  Toolkit("/usr/local/cuda-12.4", ["/usr/local/cuda"], version="12.4", version_full="12.4.131")],
        deepspeed_cuda_home="/usr/local/cuda",
    )
    kw.update(over)
    return Facts(**kw)


FINDINGS = [
    Finding("cuda.ok-thing", "ok", "torch sees the GPUs"),
    Finding("cuda.torch-vs-nvcc", "warn", "nvcc 11.8 is first on PATH", ["PATH[0] = /usr/local/cuda-11.8/bin"],
            ["export PATH=/usr/local/cuda-12.4/bin:$PATH"]),
    Finding("deepspeed.aio", "fail", "libaio missing for NVMe offload"),
    Finding("env.skipped", "skip", "no ninja check"),
]


def test_versions_as_the_tools_print_them():
    assert versions(make_facts()) == {
        "python": "3.11.9",
        "os": "Linux-6.8.0-x86_64-with-glibc2.39",
        "torch": "2.5.1+cu124",
        "torch_cuda": "12.4",
        "torch_hip": None,
        "cudnn": "90100",
        "nccl": "2.21.5",
        "transformers": "4.46.3",
        "accelerate": None,
        "deepspeed": "0.16.1",
        "nvcc": "12.4",  # DeepSpeed's CUDA_HOME (/usr/local/cuda -> 12.4), not the 11.8 first on PATH
        "gpus": "2 x NVIDIA H100 80GB HBM3 (9.0), NVIDIA A100-SXM4-40GB (8.0)",
        "driver": "550.54.15",
    }
    one = make_facts(toolkits=[Toolkit("/opt/cuda", ["PATH"], version="12.6")], deepspeed_cuda_home=None,
                     nvcc_on_path_root="/opt/cuda")
    assert versions(one)["nvcc"] == "12.6"  # the nvcc on PATH
    two = make_facts(deepspeed_cuda_home="/somewhere/else")
    assert versions(two)["nvcc"] is None  # two toolkits, neither the build's: no guess
    bare = versions(Facts(python="3.12.1", torch=TorchFacts(version="2.13.0+cpu")))
    assert bare["torch"] == "2.13.0+cpu" and bare["torch_cuda"] is None
    assert bare["nvcc"] is bare["gpus"] is bare["driver"] is bare["deepspeed"] is None


def test_markdown_sections_in_order(user_ta_json):
    out, text = user_ta_json
    ds = {**DS_CONFIG, "comet": {"enabled": True, "api_key": "sekrit"}}
    md = render_markdown(make_facts(), FINDINGS, ds, training_args_diff(json.loads(text)))
    heads = ["### Versions", "### Environment findings", "### DeepSpeed config", "### TrainingArguments (non-default)"]
    positions = [md.index(h) for h in heads]
    assert positions == sorted(positions)
    assert md.rstrip().endswith("Generated by `torchdoctor report`.</sub>")
    versions_block = md[positions[0]:positions[1]]
    assert "torch: 2.5.1+cu124\n" in versions_block and "torch.version.cuda: 12.4\n" in versions_block
    assert "accelerate: not installed" in versions_block and "torch.version.hip" not in versions_block
    assert ("python -c 'import torch, transformers, deepspeed; print(torch.__version__, torch.version.cuda, "
            "transformers.__version__, deepspeed.__version__)'") in versions_block
    findings_block = md[positions[1]:positions[2]]
    assert findings_block.index("**FAIL**") < findings_block.index("**WARN**")
    assert "fix: export PATH" in findings_block
    assert "torch sees the GPUs" not in findings_block and "2 passing or skipped checks not shown" in findings_block
    ds_block = md[positions[2]:positions[3]]
    assert '```json\n{\n  "train_micro_batch_size_per_gpu": "auto"' in ds_block
    assert "sekrit" not in md and '"api_key": "<redacted>"' in ds_block
    ta_block = md[positions[3]:]
    assert "| `learning_rate` | `3e-05` |" in ta_block and "| `fp16` | `true` |" in ta_block
    assert f'| `output_dir` | `"{out}"` |' in ta_block
    assert "`seed`" not in ta_block and "`adam_beta1`" not in ta_block


def test_markdown_when_nothing_is_wrong_or_given():
    oks = [Finding("cuda.ok-thing", "ok", "torch sees the GPUs")]
    md = render_markdown(make_facts(), oks, None, None)
    assert "torch sees the GPUs" in md  # only passing findings: shown rather than nothing
    assert md.count("(not given)") == 2
    assert "(no findings)" in render_markdown(make_facts(), [], None, None)


def test_markdown_training_args_unknown_keys_and_raw_args():
    md = render_markdown(make_facts(), [], None, {"learning_rate": 1e-4, "model_name_or_path": "a|b"})
    assert "| `model_name_or_path` * | `\"a\\|b\"` |" in md  # raw args are diffed; a pipe cannot break the table
    assert "not a TrainingArguments field (kept as given): `model_name_or_path`" in md
    assert "(all defaults)" in render_markdown(make_facts(), [], None, training_args_diff({"seed": 42}))


def test_json_shape():
    ta = training_args_diff({"learning_rate": 1e-4})
    facts = make_facts()
    doc = to_json(facts, FINDINGS, {"wandb": {"api_key": "k"}}, ta)
    assert set(doc) == {"versions", "findings", "ds_config", "training_args", "facts"}
    assert doc["versions"] == versions(facts)
    assert doc["findings"] == [f.to_json() for f in FINDINGS]
    assert doc["ds_config"] == {"wandb": {"api_key": "<redacted>"}}
    assert doc["training_args"]["changed"] == {"learning_rate": 1e-4}
    assert doc["facts"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert json.loads(json.dumps(doc)) == doc
    empty = to_json(Facts(), [], None, None)
    assert empty["ds_config"] is None and empty["training_args"] is None and empty["findings"] == []


# -- the build toolkit is the one env's rules judge -----------------------------------------------------------------


@pytest.mark.parametrize("over", [
    {},
    {"build_toolkit_root": "/usr/local/cuda-11.8"},  # the probe resolved CUDA_HOME for builds with real paths
    {"deepspeed_cuda_home": None, "torch": TorchFacts(version="2.5.1+cu124", cuda="12.4",
                                                      cuda_home="/usr/local/cuda-11.8")},
    {"deepspeed_cuda_home": None, "nvcc_on_path_root": "/usr/local/cuda-11.8"},
    {"deepspeed_cuda_home": "/somewhere/else"},
    {"toolkits": [Toolkit("/opt/cuda", ["PATH"], version="12.6")], "deepspeed_cuda_home": None},
])
def test_the_nvcc_line_is_the_toolkit_envs_rules_use(over):
    from torchdoctor.env import rules

    facts = make_facts(**over)
    tk = rules.build_toolkit(facts)
    assert versions(facts)["nvcc"] == (tk.version if tk else None)
    if over.get("build_toolkit_root"):
        assert versions(facts)["nvcc"] == "11.8"


# -- TrainingArguments: what is left out is said ------------------------------------------------------------------


def test_words_before_the_first_option_are_named_in_a_note(ta_module):
    args = load_training_args("ñ --learning_rate 1")
    assert args == {"learning_rate": 1}
    diff = training_args_diff(args)
    assert diff["changed"] == {"learning_rate": 1}
    assert "ignored before the first --option: ñ" in diff["note"]
    md = render_markdown(make_facts(), [], None, diff)
    assert "Ignored before the first --option: ñ" in md
    launcher = training_args_diff(load_training_args("deepspeed train.py --fp16"))
    assert "deepspeed train.py" in launcher["note"]
    assert training_args_diff(load_training_args("--fp16"))["note"] is None


def test_the_note_survives_without_transformers(monkeypatch):
    monkeypatch.setattr(training_args, "_ta_fields", lambda: None)
    diff = training_args_diff(load_training_args("python x.py --lr 3"))
    assert "ignored before the first --option: python x.py" in diff["note"] and "not importable" in diff["note"]


@pytest.mark.parametrize("spec", ["", "  ", "\n"])
def test_empty_training_args_are_refused(spec):
    with pytest.raises(BundleError, match="empty"):
        load_training_args(spec)


# -- --json is valid JSON whatever the inputs hold ---------------------------------------------------------------


def test_to_json_maps_non_finite_floats_to_strings(tmp_path, ta_module):
    ds = load_ds_config(write(tmp_path / "nan.json", '{"fp16": {"enabled": true, "loss_scale": NaN}, '
                                                     '"gradient_clipping": Infinity, "x": -Infinity}'))
    ta = training_args_diff(load_training_args("--num_train_epochs 1e400 --learning_rate nan"))
    doc = to_json(make_facts(), FINDINGS, ds, ta)
    assert doc["ds_config"] == {"fp16": {"enabled": True, "loss_scale": "nan"}, "gradient_clipping": "inf",
                                "x": "-inf"}
    assert doc["training_args"]["changed"] == {"num_train_epochs": "inf", "learning_rate": "nan"}
    json.dumps(doc, allow_nan=False)


# -- the report command -------------------------------------------------------------------------------------------


@pytest.fixture
def report(monkeypatch, capsys):
    """``torchdoctor report`` in-process, on fabricated facts (the real probe has test_env_cli's tests)."""
    import argparse

    from torchdoctor.env import probe, report_run

    monkeypatch.setattr(probe, "collect", make_facts)

    def run(*argv: str, stdin: bytes | None = None) -> tuple[int, str, str]:
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", __import__("io").TextIOWrapper(__import__("io").BytesIO(stdin)))
        parser = argparse.ArgumentParser()
        report_run.add_arguments(parser)
        rc = report_run.run(parser.parse_args(list(argv)))
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_report_json_is_valid_json_with_inf_and_nan(report, tmp_path, ta_module):
    cfg = write(tmp_path / "nan.json", '{"fp16": {"enabled": true, "loss_scale": NaN}, "gradient_clipping": Infinity}')
    rc, out, err = report("--json", "--ds-config", cfg, "--training-args", "--num_train_epochs 1e400")
    assert rc == 0, err
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert doc["ds_config"]["fp16"]["loss_scale"] == "nan" and doc["ds_config"]["gradient_clipping"] == "inf"
    assert doc["training_args"]["changed"] == {"num_train_epochs": "inf"}


@pytest.mark.parametrize("argv, message", [
    (["--training-args", ""], "the training arguments are empty"),
    (["--ds-config", ""], "--ds-config is empty"),
    (["--ds-config", "{deep}"], "deep.json:1:501: nested more than 100 levels deep"),
    (["--training-args", "{deep}"], "deep.json:1:501: nested more than 100 levels deep"),
    (["--ds-config", "{dup}"], 'dup.json:1:19: duplicate key "a"'),
])
def test_report_refuses_bad_inputs_with_exit_2(report, tmp_path, argv, message):
    paths = {"deep": write(tmp_path / "deep.json", '{"a":' * 100_000 + "1" + "}" * 100_000),
             "dup": write(tmp_path / "dup.json", '{"a": {}, "b": 1, "a": 2}')}
    rc, out, err = report(*[a.format(**paths) for a in argv])
    assert rc == 2 and out == "" and message in err and "Traceback" not in err
    assert err.startswith("torchdoctor report: ")


def test_report_reads_the_ds_config_from_standard_input(report):
    rc, out, err = report("--json", "--ds-config", "-", stdin=b'{"zero_optimization": {"stage": 3}}')
    assert rc == 0 and json.loads(out)["ds_config"] == {"zero_optimization": {"stage": 3}}
    rc, out, err = report("--ds-config", "-", stdin=b"[1]")
    assert rc == 2 and "<stdin>: the top level is an array" in err


def test_report_markdown_notes_dropped_words(report, ta_module):
    rc, out, _ = report("--training-args", "ñ --learning_rate 1")
    assert rc == 0 and "| `learning_rate` | `1` |" in out and "Ignored before the first --option: ñ" in out

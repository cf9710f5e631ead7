"""``ds check`` held to DeepSpeed's own parser, on configs nobody here wrote and on our own fixtures.

Two rules (issue 10, items 7 and 8), checked with ``deepspeed.runtime.config.DeepSpeedConfig``'s parser
(:func:`torchdoctor.deepspeed.parse.refusal`, DS_ACCELERATOR=cpu, a world size given instead of a process group):

- no fix makes a config DeepSpeed accepts into one it refuses: every finding's machine-readable fix
  (``data["edits"]``) is applied and the result parsed whenever the original parsed;
- a ``fail`` means DeepSpeed (or, with ``--for hf``, the HF stack) refuses the config, or the run surely breaks
  (a short list of such rules, each named with why the parser cannot see it).

The real-world corpus lives in ``../shared/realworld/ds_configs`` (read in place, never copied); those tests skip
when it is absent. The fixtures under ``tests/fixtures/ds_check/`` are our own and always run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchdoctor.deepspeed.config_check import check, load
from torchdoctor.deepspeed.hf_fill import hf_fill
from torchdoctor.deepspeed.parse import edit, refusal

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

FIX = Path(__file__).parent / "fixtures" / "ds_check"
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "realworld" / "ds_configs"
CORPUS_ALL = sorted(CORPUS.glob("*.json")) if CORPUS.is_dir() else []


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except ValueError:
        return False
    return True


# A corpus file that is not JSON (a template with placeholders its launcher script fills in) is not a config
# DeepSpeed could read: ds check refuses it (test_a_corpus_file_that_is_not_json_is_refused_with_its_place).
CORPUS_FILES = [p for p in CORPUS_ALL if _is_json(p)]
CORPUS_NOT_JSON = [p for p in CORPUS_ALL if p not in CORPUS_FILES]
OWN = sorted((FIX / "parser").glob("*.json"))
WS = 1  # the world size the parser and the check both use

# fails DeepSpeed's parser cannot see, because they happen later in the run: (finding id, key or key prefix) -> why
# the run surely breaks there. None: any key.
BREAKS_LATER = {
    ("build.libaio-missing", None): "the async_io op cannot be built without libaio: NVMe offload stops at start",
    ("zero.nvme-path", None): "ZeRO-3 asserts on a missing nvme_path when it builds its swapper (engine init)",
    ("config.auto-outside-hf", None): 'the string "auto" reaches code that computes with it (a fail only then)',
    ("config.bad-value", "optimizer.type"): 'engine init: "X is not a supported DeepSpeed Optimizer"',
    ("config.bad-value", "optimizer.params.max_grad_norm"): "engine init refuses it as an optimizer parameter",
    ("config.bad-value", "scheduler."): "engine init builds Scheduler(optimizer, **params): unknown name, TypeError",
    ("config.unknown-key", "scheduler.params."): "engine init: Scheduler(optimizer, **params) is a TypeError",
    ("config.bad-value", "scheduler"): "engine init builds Scheduler(optimizer, **params)",
    ("fp16.loss-scale", "fp16.hysteresis"): "hysteresis <= 0: the scale is never lowered, steps skipped for ever",
    ("config.bad-value", "zero_optimization.offload_optimizer.ratio"): "engine init asserts ZeRO stage 3",
}


def _breaks_later(f) -> bool:
    key = str(f.data.get("key") or "")
    return any(f.id == id_ and (k is None or key == k or (k.endswith(".") and key.startswith(k)))
               for id_, k in BREAKS_LATER)


def _lint(cfg: dict, for_: str):
    return check(cfg, world_size=WS, for_=for_, gpu_capabilities=["8.0"], libaio="/usr/lib/libaio.so")


def _as_deepspeed_gets_it(cfg: dict, for_: str) -> dict | None:
    """The config ``deepspeed.initialize`` receives: as written, or after the HF Trainer filled its "auto" values
    (None when the HF stack refuses it first)."""
    if for_ == "deepspeed":
        return cfg
    h = hf_fill(cfg)
    if h.refused or h.unfilled or h.filled is None:
        return None
    return h.filled


def _fix_regressions(cfg: dict, for_: str) -> tuple[list[str], int]:
    """(problems, fixes checked): fixes whose edits make a config DeepSpeed accepts into one it refuses."""
    before = _as_deepspeed_gets_it(cfg, for_)
    if before is None or refusal(before, WS) is not None:
        return [], 0
    problems, checked = [], 0
    for f in _lint(cfg, for_):
        edits = f.data.get("edits")
        if f.severity in ("warn", "fail"):
            assert isinstance(edits, list), (f.id, f.title)  # every warn/fail says whether its fix is an edit
        if not edits:
            continue
        after = _as_deepspeed_gets_it(edit(cfg, edits), for_)
        why = "the HF stack refuses it" if after is None else refusal(after, WS)
        checked += 1
        if why:
            problems.append(f"{f.id} ({f.title}): fix {f.fix[0]!r} -> {why}")
    return problems, checked


def _unexplained_fails(cfg: dict, for_: str) -> list[str]:
    """fail findings on a config DeepSpeed (after the HF Trainer, for hf) accepts, not explained by BREAKS_LATER."""
    got = _as_deepspeed_gets_it(cfg, for_)
    if got is None or refusal(got, WS) is not None:
        return []
    out = []
    for f in _lint(cfg, for_):
        if f.severity != "fail":
            continue
        if _breaks_later(f):
            continue
        out.append(f"{f.id}: {f.title}")
    return out


# -- our own fixtures: always run --------------------------------------------------------------------------------


@pytest.mark.parametrize("for_", ["deepspeed", "hf"])
@pytest.mark.parametrize("path", OWN, ids=lambda p: p.name)
def test_fixes_never_break_a_config_deepspeed_accepts_own(path, for_):
    problems, _ = _fix_regressions(load(str(path)), for_)
    assert not problems, problems


def test_own_fixtures_exercise_edits():
    """The fixtures are meant to draw fixes that are edits, on configs DeepSpeed accepts: else the test above is
    vacuous."""
    checked = sum(_fix_regressions(load(str(p)), "deepspeed")[1] for p in OWN)
    assert checked >= 8


@pytest.mark.parametrize("path", OWN, ids=lambda p: p.name)
def test_fails_are_refusals_own(path):
    assert not _unexplained_fails(load(str(path)), "deepspeed")


def test_the_parser_stub_refuses_what_deepspeed_refuses():
    base = {"train_micro_batch_size_per_gpu": 1}
    assert refusal(base) is None
    assert refusal({**base, "compile": {"backend": "inductor"}}).startswith("ValidationError: 1 validation error for "
                                                                            "CompileConfig")
    assert refusal({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
                   world_size=8) is None
    assert refusal({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
                   world_size=4).startswith("AssertionError")
    assert edit({"a": {"b": 1}, "c": 2}, [{"path": ["a", "b"], "remove": True}, {"path": ["d", "e"], "value": 3}]) \
        == {"a": {}, "c": 2, "d": {"e": 3}}


def test_a_comment_key_is_never_renamed_into_a_real_key():
    base = {"train_micro_batch_size_per_gpu": 1}
    assert [f.id for f in _lint({**base, "_comment": "see the docs", "_note": 1}, "deepspeed")] == ["config.ok"]
    f = next(f for f in _lint({**base, "fp16": {"enabled": True, "_comment": "x"}, "log_level": "info"}, "deepspeed")
             if f.id == "config.unknown-key")
    assert f.severity == "fail" and f.data["suggestion"] is None and f.fix[0].startswith('remove "fp16._comment"')
    assert refusal({**base, "fp16": {"enabled": True, "_comment": "x"}}) is not None  # DeepSpeed refuses it there
    assert refusal(edit({**base, "fp16": {"_comment": "x"}}, f.data["edits"])) is None


def test_every_strict_block_deepspeed_validates_is_checked():
    """Each block the check treats as strict is one DeepSpeed's parser refuses an unknown key in, and the other way
    round for every top-level block it reads."""
    from torchdoctor.deepspeed.config_check import schema

    sch = schema()
    base = {"train_micro_batch_size_per_gpu": 1}
    for key in sorted(k for k in sch.blocks[""] if k not in ("bfloat16",)):
        cfg = {**base, key: {"__unknown_key__": 1}}
        refused = refusal(cfg)
        strict = key in sch.strict
        refused_for_the_key = refused is not None and refused.startswith("ValidationError")
        assert strict == refused_for_the_key, (key, refused)
        if strict:
            f = next(f for f in _lint(cfg, "deepspeed") if f.id == "config.unknown-key")
            assert f.severity == "fail"
    assert {"compile", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "tensor_parallel"} <= sch.strict


# -- the real-world corpus (read in place; skipped without it) -----------------------------------------------------

corpus = pytest.mark.skipif(not CORPUS_FILES, reason=f"{CORPUS} not here")


@corpus
@pytest.mark.parametrize("for_", ["deepspeed", "hf"])
def test_fixes_never_break_a_config_deepspeed_accepts_corpus(for_):
    problems, checked = [], 0
    for path in CORPUS_FILES:
        p, n = _fix_regressions(json.loads(path.read_text()), for_)
        problems += [f"{path.name}: {x}" for x in p]
        checked += n
    assert not problems, "\n".join(problems)
    assert checked > 0


@corpus
@pytest.mark.parametrize("for_", ["deepspeed", "hf"])
def test_fails_are_refusals_corpus(for_):
    out = []
    for path in CORPUS_FILES:
        out += [f"{path.name}: {x}" for x in _unexplained_fails(json.loads(path.read_text()), for_)]
    assert not out, "\n".join(out)


@corpus
def test_a_config_deepspeed_refuses_draws_a_fail_corpus():
    """The other direction: where the parser refuses the config as written, the check fails it too."""
    missed = []
    for path in CORPUS_FILES:
        cfg = json.loads(path.read_text())
        if refusal(cfg, WS) is not None and not any(f.severity == "fail" for f in _lint(cfg, "deepspeed")):
            missed.append(f"{path.name}: {refusal(cfg, WS)}")
    assert not missed, "\n".join(missed)


@pytest.mark.skipif(not CORPUS_NOT_JSON, reason="every corpus config is JSON")
@pytest.mark.parametrize("path", CORPUS_NOT_JSON, ids=lambda p: p.name[:60])
def test_a_corpus_file_that_is_not_json_is_refused_with_its_place(path, capsys):
    from torchdoctor import cli

    assert cli.main(["ds", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) <= 3 and "Traceback" not in err
    assert f"{path}:" in err and "invalid JSON" in err, err


@pytest.mark.parametrize("cfg", [
    {"train_micro_batch_size_per_gpu": 1},  # no ZeRO block
    {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}},
    {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 0}},
])
def test_accelerate_refuses_exactly_when_training_arguments_raise(cfg, tmp_path):
    """hf.accelerate-refuses against the real thing: TrainingArguments(deepspeed=config) builds the plugin."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    try:
        TrainingArguments(output_dir=str(tmp_path), deepspeed=dict(cfg), report_to="none")
        raised = None
    except ValueError as e:
        raised = str(e)
    got = [f for f in _lint(cfg, "hf") if f.id == "hf.accelerate-refuses"]
    assert bool(got) == bool(raised), (raised, [f.title for f in got])
    if got:
        assert got[0].data["message"] == raised
        fixed = edit(cfg, got[0].data["edits"])
        TrainingArguments(output_dir=str(tmp_path), deepspeed=fixed, report_to="none")  # the fix is accepted


def test_own_hf_fixture_exercises_edits_after_the_hf_trainer_filled_it():
    problems, checked = _fix_regressions(load(str(FIX / "parser" / "hf_trainer.json")), "hf")
    assert not problems and checked >= 3

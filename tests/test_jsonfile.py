"""torchdoctor.jsonfile: the one reader of the JSON files users pass (ds check, ds memory, env, report)."""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchdoctor import jsonfile
from torchdoctor.jsonfile import MAX_DEPTH, JsonFileError, dumps, json_safe, load_object, located, read_limited

SRC = Path(__file__).parent.parent / "src" / "torchdoctor"


def write(tmp_path, name: str, content: str | bytes) -> str:
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return str(p)


def error(path: str, what: str = "a DeepSpeed config") -> str:
    with pytest.raises(JsonFileError) as e:
        load_object(path, what)
    assert isinstance(e.value, ValueError)
    return str(e.value)


# -- what is accepted ---------------------------------------------------------------------------------------------


def test_an_object_with_a_bom_nan_and_infinity(tmp_path):
    path = write(tmp_path, "ds.json", '\ufeff{"a": {"b": [1, 2.5, null]}, "c": NaN, "d": -Infinity}')
    got = load_object(path)
    assert got["a"] == {"b": [1, 2.5, None]} and math.isnan(got["c"]) and got["d"] == -math.inf


def test_exactly_max_depth_is_fine(tmp_path):
    text = '{"a":' * MAX_DEPTH + "1" + "}" * MAX_DEPTH
    assert load_object(write(tmp_path, "ok.json", text))["a"]["a"]["a"]


def test_standard_input(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"x": 1}')))
    assert load_object("-") == {"x": 1}
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"[1]")))
    with pytest.raises(JsonFileError, match=r"^<stdin>: the top level is an array"):
        load_object("-")


# -- what is refused, and how it is said ----------------------------------------------------------------------


def test_invalid_json_is_located_with_the_line_and_a_caret(tmp_path):
    path = write(tmp_path, "bad.json", '{\n  "bf16": {"enabled": true},\n  "stage": 3,,\n}')
    assert error(path).split("\n") == [
        f"{path}:3:14: invalid JSON: Expecting property name enclosed in double quotes",
        '    line 3:   "stage": 3,,',
        "                         ^",
    ]


@pytest.mark.parametrize("text, needle", [
    ('{\n  // fp16\n  "a": 1\n}', ":2:3: invalid JSON: Expecting property name enclosed in double quotes (a comment"),
    ('{"a": 1,\n}', ":2:1: invalid JSON: Expecting property name enclosed in double quotes (a trailing comma"),
    ('{"a": [1, 2,]}', "(a trailing comma: remove the ',' before it)"),
    ('{"fp16": {"enabled": tru}}', ":1:22: invalid JSON: Expecting value"),
    ('{"a": 1} {"b": 2}', ":1:10: invalid JSON: Extra data"),
    ("{'a': 1}", ":1:2: invalid JSON: Expecting property name enclosed in double quotes"),
])
def test_invalid_json_messages(tmp_path, text, needle):
    assert needle in error(write(tmp_path, "c.json", text))


def test_a_duplicate_key_is_refused_at_its_second_occurrence(tmp_path):
    path = write(tmp_path, "dup.json", '{\n  "zero_optimization": {\n    "stage": 2,\n    "stage": 3\n  }\n}')
    msg = error(path)
    assert msg.startswith(f'{path}:4:5: duplicate key "stage" in one object')
    assert msg.split("\n")[1] == '    line 4:     "stage": 3'
    # the same name in different objects is fine
    assert load_object(write(tmp_path, "ok.json", '{"fp16": {"enabled": true}, "bf16": {"enabled": false}}'))


@pytest.mark.parametrize("text, kind", [("[1, 2]", "an array"), ('"zero"', "a string"), ("3", "a number"),
                                        ("null", "null"), ("true", "a boolean")])
def test_the_top_level_must_be_an_object(tmp_path, text, kind):
    path = write(tmp_path, "t.json", text)
    assert error(path) == f"{path}: the top level is {kind}; a DeepSpeed config is a JSON object {{...}}"


@pytest.mark.parametrize("text", [
    '{"a":' * 100_000 + "1" + "}" * 100_000,  # past Python's recursion limit
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1),  # parses, but deeper than any config
    '{"a": [' + "[" * 400 + "]" * 400 + "]}",
])
def test_deep_nesting_is_refused_where_it_goes_too_deep(tmp_path, text):
    path = write(tmp_path, "deep.json", text)
    msg = error(path)
    first, shown, caret = msg.split("\n")
    assert first.startswith(f"{path}:1:") and f"nested more than {MAX_DEPTH} levels deep" in first
    col = int(first.split(":")[2])
    assert text[col - 1] in "[{" and text[:col].count("[") + text[:col].count("{") == MAX_DEPTH + 1
    assert len(shown) < 130 and shown.startswith("    line 1: ...") and caret.strip() == "^"


@pytest.mark.parametrize("content, needle", [
    (b'{"a": "\xe9"}', ":1:8: not UTF-8 text (byte 0xe9 at offset 7)"),
    (b'{"a": 1,\n "b": "\xff\xfe"}', ":2:8: not UTF-8 text (byte 0xff at offset 16)"),
    (b"", "the file is empty"),
    (b"  \n\t", "the file is empty"),
    (pickle.dumps({"a": 1}), "this is a pickle / torch.save file, not JSON"),
    (pickle.dumps({"a": 1}, protocol=2), "this is a pickle / torch.save file, not JSON"),
    (b"PK\x03\x04rest-of-a-torch-save", "this is a pickle / torch.save file, not JSON"),
    (b'{"n": ' + b"1" * 5000 + b"}", "invalid JSON"),  # longer than Python's int digit limit
])
def test_bytes_that_are_not_a_json_text(tmp_path, content, needle):
    path = write(tmp_path, "x.json", content)
    msg = error(path)
    assert msg.startswith(path) and needle in msg


def test_missing_directory_empty_name_and_pickle_names(tmp_path):
    assert error(str(tmp_path / "nope.json")) == f"{tmp_path / 'nope.json'}: no such file (a DeepSpeed config)"
    assert error(str(tmp_path)).startswith(f"{tmp_path}: is a directory")
    assert "empty file name" in error("")
    for name in ("training_args.bin", "model.pt", "x.pkl", "y.ckpt"):
        # refused by name before it is opened: a pickle that does not even exist gets the same answer
        msg = error(str(tmp_path / name))
        assert "is a pickle (torch.save), not JSON" in msg and "never unpickles" in msg
    with pytest.raises(JsonFileError, match="to_json_string"):
        load_object(str(tmp_path / "training_args.bin"), pickle_hint="use to_json_string()")


def test_located_cuts_long_lines_around_the_column():
    text = "x" * 500 + "!" + "y" * 500
    first, shown, caret = located("f.json", text, 500, "here").split("\n")
    assert first == "f.json:1:501: here"
    assert shown.startswith("    line 1: ...x") and shown.endswith("y...") and len(shown) < 130
    assert shown[caret.index("^")] == "!"
    short = located("f.json", 'a\n\t"b": ?\n', 8, "bad").split("\n")
    assert short[1] == '    line 2: \t"b": ?' and short[2] == "    " + " " * len("line 2: ") + "\t     ^"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=60) | st.text(max_size=60).map(str.encode)
       | st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=3),
                      lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=3), ch, max_size=3),
                      max_leaves=10).map(lambda v: json.dumps(v).encode()))
def test_any_bytes_give_an_object_or_a_json_file_error(tmp_path, content):
    path = write(tmp_path, "h.json", content)
    try:
        got = load_object(path)
    except JsonFileError as e:
        assert str(e).startswith(path)
        return
    assert isinstance(got, dict)


# -- bounded reading ---------------------------------------------------------------------------------------------


def test_a_regular_file_past_the_cap_is_refused_by_its_size(tmp_path):
    path = write(tmp_path, "c.json", b"x" * 11)
    with pytest.raises(JsonFileError) as e:
        read_limited(path, "a DeepSpeed config", limit=10)
    assert str(e.value) == (f"{path}: 11 bytes, more than the 10 bytes torchdoctor reads of a DeepSpeed config; "
                            "one is a few KB: is it the right file?")
    assert read_limited(path, "a DeepSpeed config", limit=11) == (path, b"x" * 11)


def test_standard_input_past_the_cap_is_refused_there(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"y" * 11)))
    with pytest.raises(JsonFileError, match=r"^<stdin>: a stream that did not end within 10 bytes, the most "):
        read_limited("-", "a DeepSpeed config", limit=10)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"y" * 10)))
    assert read_limited("-", "a DeepSpeed config", limit=10) == ("<stdin>", b"y" * 10)


def test_the_default_cap_is_16_mib_and_load_object_uses_it(tmp_path):
    """(Endless sources -- /dev/zero, FIFOs, stdin -- are tested through the CLI under a memory limit:
    tests/test_inputs_bounds.py.)"""
    assert jsonfile.MAX_BYTES == 16 << 20
    path = tmp_path / "sparse.json"
    with open(path, "wb") as f:
        f.truncate(jsonfile.MAX_BYTES + 1)  # sparse: refused by its size, never read
    with pytest.raises(JsonFileError, match=r": 16,777,217 bytes, more than the 16 MiB torchdoctor reads of a config"):
        load_object(str(path), "a config")


# -- writing ---------------------------------------------------------------------------------------------------


def test_dumps_writes_valid_json_for_non_finite_floats():
    doc = {"a": math.inf, "b": [-math.inf, math.nan, 1.5], "c": (2, math.nan), "d": "inf", "e": None, "f": True}
    assert json_safe(doc) == {"a": "inf", "b": ["-inf", "nan", 1.5], "c": [2, "nan"], "d": "inf", "e": None,
                              "f": True}
    text = dumps(doc, indent=1)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == json_safe(doc)


# -- one reader for every command ----------------------------------------------------------------------------------


def test_every_command_reads_json_files_through_this_module():
    """No other module parses JSON files with hooks of its own (duplicate keys, pickles...)."""
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if p.name != "jsonfile.py" and ("object_pairs_hook" in p.read_text() or "py_make_scanner"
                                                 in p.read_text())]
    assert offenders == []


def test_ds_check_env_report_and_ds_memory_say_the_same(tmp_path, capsys):
    from torchdoctor.deepspeed import config_check, memory_run
    from torchdoctor.env import bundle, training_args

    path = write(tmp_path, "ds.json", '{"fp16": {"enabled": true,\n "enabled": false}}')
    expected = error(path)
    with pytest.raises(config_check.ConfigError) as e:
        config_check.load(path)
    assert str(e.value) == expected
    with pytest.raises(bundle.BundleError) as e:
        bundle.load_ds_config(path)
    assert str(e.value) == expected
    parser = argparse.ArgumentParser()
    memory_run.add_arguments(parser)
    rc = memory_run.run(parser.parse_args(["--params", "7B", "--gpus-per-node", "1", "--config", path]))
    assert rc == 2 and capsys.readouterr().err == f"torchdoctor ds memory: --config: {expected}\n"
    assert jsonfile.PICKLE_SUFFIXES == training_args.PICKLE_SUFFIXES

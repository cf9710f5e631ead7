"""Every reader of ``-`` with standard input closed, and every reader of a name that is a link: one wording each.

``<&-`` starts a process without descriptor 0 (Python then has no ``sys.stdin``): every command that reads ``-``
says "standard input is closed" in one line, exit 2. A symlink loop is "Too many levels of symbolic links" for every
JSON input (``ds memory --model`` and ``report --training-args`` took it for a missing file), a dangling link names
where it points, and a model folder whose config.json is a link to a device, a directory or a FIFO is read through
the same capped reader, which says what it is (it was "the folder has no config.json"). Real shells, links, FIFOs
and devices, bounded (tests/bounded.py).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from test_inputs_bounds import JSON_READERS, TD, bounded_sh, one_line_usage_error

# (command line reading standard input, the message's prefix)
STDIN_READERS = {
    "logs": ("logs -", "torchdoctor logs: "),
    "logs --json": ("logs --json -", "torchdoctor logs: "),
    "ds check": ("ds check -", "torchdoctor ds check: <stdin>: "),
    "ds memory --config": ("ds memory --params 7B --gpus-per-node 1 --cpu-mem 64 --gpu-mem 80 --config -",
                           "torchdoctor ds memory: --config: <stdin>: "),
    "env --ds-config": ("env --ds-config -", "torchdoctor env: --ds-config: <stdin>: "),
    "report --ds-config": ("report --ds-config -", "torchdoctor report: <stdin>: "),
}


@pytest.mark.parametrize("reader", STDIN_READERS)
def test_closed_standard_input_is_said_in_one_line(reader):
    args, prefix = STDIN_READERS[reader]
    rc, out, err = bounded_sh(f"exec {TD} {args} <&-")
    msg = one_line_usage_error(rc, out, err, prefix)
    assert "standard input is closed" in msg and "NoneType" not in msg, msg


def test_logs_reads_the_files_given_beside_a_closed_standard_input(tmp_path):
    """In such a process the log named first can get descriptor 0; `-` must still not read it as standard input."""
    log = Path(__file__).parent / "fixtures" / "logs" / "cuda_oom.log"
    rc, out, err = bounded_sh(f"exec {TD} logs {log} - <&-")
    assert rc == 2, err  # the log is reported, and the closed standard input is an unreadable source
    assert "[FAIL] CUDA out of memory" in out and out.count("torchdoctor logs: ") == 1
    assert err.splitlines() == ["torchdoctor logs: standard input is closed; pass the log files, or pipe a log in "
                                "(... | torchdoctor logs -)"]


@pytest.fixture
def loop(tmp_path) -> Path:
    a, b = tmp_path / "loop1", tmp_path / "loop2"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


@pytest.mark.parametrize("reader", JSON_READERS)
def test_a_symlink_loop_is_said_the_same_by_every_json_reader(loop, reader):
    args, prefix = JSON_READERS[reader]
    rc, out, err = bounded_sh(f"exec {TD} {args.format(src=loop)}")
    msg = one_line_usage_error(rc, out, err, prefix)
    assert f"{loop}: cannot read it: Too many levels of symbolic links" in msg, msg


def test_a_symlink_loop_is_said_the_same_by_logs(loop):
    rc, out, err = bounded_sh(f"exec {TD} logs {loop}")
    assert one_line_usage_error(rc, out, err, "torchdoctor logs: ") == \
        f"torchdoctor logs: cannot read {loop}: Too many levels of symbolic links"


@pytest.mark.parametrize("reader", JSON_READERS)
def test_a_dangling_link_names_where_it_points(tmp_path, reader):
    args, prefix = JSON_READERS[reader]
    link = tmp_path / "config.json"
    link.symlink_to(tmp_path / "gone" / "ds.json")
    rc, out, err = bounded_sh(f"exec {TD} {args.format(src=link)}")
    msg = one_line_usage_error(rc, out, err, prefix)
    assert f"{link}: a symbolic link to {tmp_path / 'gone' / 'ds.json'}, which does not exist" in msg, msg


# -- a model folder whose config.json is not a file --------------------------------------------------------------

MODEL = "ds memory --gpus-per-node 1 --cpu-mem 8 --gpu-mem 8 --model"
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 1000, "n_positions": 64,
        "architectures": ["GPT2LMHeadModel"]}


@pytest.mark.parametrize("kind, says", [
    ("link to /dev/zero", "config.json: a character device that did not end within 16 MiB"),
    ("directory", "config.json: is a directory"),
    ("link to a directory", "config.json: is a directory"),
    ("dangling link", "config.json: a symbolic link to "),
    ("symlink loop", "config.json: cannot read it: Too many levels of symbolic links"),
])
def test_a_config_json_that_is_no_file_is_named_for_what_it_is(tmp_path, kind, says):
    model = tmp_path / "model"
    model.mkdir()
    cfg = model / "config.json"
    if kind == "link to /dev/zero":
        cfg.symlink_to("/dev/zero")
    elif kind == "directory":
        cfg.mkdir()
    elif kind == "link to a directory":
        cfg.symlink_to(tmp_path)
    elif kind == "dangling link":
        cfg.symlink_to(tmp_path / "nowhere.json")
    else:
        (model / "other").symlink_to(cfg)
        cfg.symlink_to(model / "other")
    rc, out, err = bounded_sh(f"exec {TD} {MODEL} {model}")
    msg = one_line_usage_error(rc, out, err, "torchdoctor ds memory: --model: ")
    assert f"{cfg}" in msg and says in msg and "has no config.json" not in msg, msg


def test_a_folder_without_config_json_still_says_so(tmp_path):
    rc, out, err = bounded_sh(f"exec {TD} {MODEL} {tmp_path}")
    assert one_line_usage_error(rc, out, err, "torchdoctor ds memory: ") == \
        f"torchdoctor ds memory: --model {tmp_path}: the folder has no config.json"


@pytest.mark.parametrize("where", ["folder", "file"])
def test_a_config_json_fifo_is_read_once_and_counted(tmp_path, where):
    """A FIFO (or <(...)) is read once, through the cap, and the count is built from what was read (transformers
    reading the name again would wait on the FIFO, or take it for a Hub model id)."""
    pytest.importorskip("transformers")
    model = tmp_path / "model"
    model.mkdir()
    fifo = model / "config.json"
    os.mkfifo(fifo)
    plain = tmp_path / "plain" / "config.json"
    plain.parent.mkdir()
    plain.write_text(json.dumps(GPT2))
    target = model if where == "folder" else fifo
    rc, out, err = bounded_sh(f"cat {shlex.quote(str(plain))} > {fifo} & exec {TD} {MODEL} {target} --json")
    assert rc in (0, 1), err[-2000:]
    got = json.loads(out)["inputs"]["model"]
    rc2, out2, err2 = bounded_sh(f"exec {TD} {MODEL} {plain.parent} --json")
    want = json.loads(out2)["inputs"]["model"]
    assert rc2 in (0, 1), err2[-2000:]
    assert got["class"] == want["class"] == "GPT2LMHeadModel"
    assert (got["total_params"], got["largest_layer"]) == (want["total_params"], want["largest_layer"])
    assert got["config"] == str(fifo)

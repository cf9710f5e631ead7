"""``torchdoctor logs`` on something that is not a text log: one line naming what it is, exit 2, nothing analysed.

Every input is made here for real: a checkpoint by ``torch.save`` (its zip archive, and the legacy pickle format), a
``pickle.dump``, safetensors written by the safetensors package (skipped where it is absent), a numpy ``.npy``, an
xz-compressed log, a ``.tar.gz`` holding a checkpoint, a gzip of random bytes and plain random bytes -- passed as a
file and on standard input, each a real subprocess bounded by tests/bounded.py. The text side stays read: a gzip log,
a UTF-16 log, a log whose first blocks are a hole of zeros, a log with colour codes and a stray control byte.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import pickle
import random
import shlex
import tarfile
from pathlib import Path

import pytest

from test_inputs_bounds import TD, bounded_sh, one_line_usage_error
from torchdoctor.logs.analyze import analyze_stream, open_stream
from torchdoctor.logs.content import NotText, not_text

FIX = Path(__file__).parent / "fixtures" / "logs"
PREFIX = "torchdoctor logs: cannot read "


def _checkpoint(path: Path, **kw) -> Path:
    import torch

    torch.save({"model": {"w": torch.randn(64, 64)}, "step": 7}, path, **kw)
    return path


def _inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, words the refusal must hold)."""
    rng = random.Random(36)
    out = {
        "torch.save (zip)": (_checkpoint(tmp / "model.pt"), "PyTorch checkpoint"),
        "torch.save (legacy)": (_checkpoint(tmp / "legacy.pt", _use_new_zipfile_serialization=False),
                                "legacy (pickle) format"),
        "random bytes": (tmp / "random.bin", "binary data"),
        "pickle": (tmp / "state.pkl", "a pickle"),
        "npy": (tmp / "arr.npy", "numpy"),
        "xz log": (tmp / "train.log.xz", "xz-compressed"),
        "tar.gz of a checkpoint": (tmp / "ckpt.tar.gz", "gzip-compressed, and what it holds is a tar archive"),
        "gzip of random bytes": (tmp / "blob.gz", "gzip-compressed, and what it holds is binary data"),
    }
    out["random bytes"][0].write_bytes(rng.randbytes(1 << 20))
    with open(out["pickle"][0], "wb") as f:
        pickle.dump({"losses": [1.0, 0.5], "rng": rng.getstate()}, f)
    import numpy as np

    np.save(out["npy"][0], np.arange(1000, dtype=np.float32))
    out["xz log"][0].write_bytes(lzma.compress((FIX / "cuda_oom.log").read_bytes()))
    with tarfile.open(out["tar.gz of a checkpoint"][0], "w:gz") as t:
        t.add(out["torch.save (zip)"][0], arcname="run/model.pt")
    out["gzip of random bytes"][0].write_bytes(gzip.compress(rng.randbytes(200_000)))
    try:
        from safetensors.numpy import save_file
    except ImportError:
        pass
    else:
        save_file({"w": np.ones((8, 8), dtype=np.float32)}, str(tmp / "model.safetensors"))
        out["safetensors"] = (tmp / "model.safetensors", "safetensors")
    return out


def test_inputs_that_are_not_text_logs_are_refused_in_one_line(tmp_path):
    for name, (path, words) in _inputs(tmp_path).items():
        for feed in ("file", "stdin"):
            cmd = (f"exec {TD} logs {shlex.quote(str(path))}" if feed == "file" else
                   f"exec {TD} logs - < {shlex.quote(str(path))}")
            line = one_line_usage_error(*bounded_sh(cmd), PREFIX)
            assert "not a text log" in line and words in line, (name, feed, line)
            # --json: nothing analysed, nothing on stdout, the same one line on stderr
            rc, out, err = bounded_sh(cmd.replace(" logs ", " logs --json "))
            assert rc == 2 and out == "" and "not a text log" in err, (name, rc, out, err)


def test_a_pipe_that_delivers_a_checkpoint_in_small_pieces_is_still_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "model.pt")
    # dd writes 100-byte blocks: the sniffer waits for its 64 KiB, whatever the pipe's pieces
    rc, out, err = bounded_sh(f"dd if={shlex.quote(str(ckpt))} bs=100 status=none | {TD} logs -")
    assert "PyTorch checkpoint" in one_line_usage_error(rc, out, err, PREFIX)


def test_text_logs_of_every_encoding_and_layout_are_still_read(tmp_path):
    plain = (FIX / "cuda_oom.log").read_bytes()
    cases = {
        "gzip": gzip.compress(plain),
        "utf-16 (PowerShell's >)": plain.decode().encode("utf-16"),
        "utf-16-le without a BOM": plain.decode().encode("utf-16-le"),
        "a hole of zeros first": bytes(70_000) + plain,  # a crash before the first blocks were written
        "colours and one stray control byte": b"\x1b[32mstarting\x1b[0m \x07\n" + plain,
    }
    for name, data in cases.items():
        p = tmp_path / "train.log"
        p.write_bytes(data)
        rc, out, err = bounded_sh(f"exec {TD} logs --json {shlex.quote(str(p))}")
        assert rc == 1 and "Traceback" not in err, (name, rc, err[-1000:])
        assert "memory.cuda-oom" in [f["id"] for f in json.loads(out)["findings"]], name


def test_the_decision_is_made_from_the_first_bytes_only():
    # the same rule on the bytes, without a process: a share of control bytes above 1 in 100 is binary
    text = b"".join(b"step %d loss %.4f\n" % (i, 1 / (i + 1)) for i in range(3000))
    assert not_text(text) is None
    noisy = bytearray(text)
    for i in range(0, len(noisy), 50):  # 2 in 100
        noisy[i] = 0x01
    assert "binary data" in not_text(bytes(noisy))
    assert len(text) > 50_000 and not_text(text + bytes(range(32)) * 10) is None  # 260 stray control bytes: text
    # a stream: open_stream raises NotText (an OSError: the CLI's one-line path), analyze_stream itself never does
    with pytest.raises(NotText):
        open_stream(io.BytesIO(random.Random(1).randbytes(10_000)))
    assert analyze_stream(io.BytesIO(random.Random(1).randbytes(10_000))).lines >= 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_holding_text_is_read_as_written(tmp_path):
    fifo = tmp_path / "live.log"
    os.mkfifo(fifo)
    rc, out, err = bounded_sh(f"cat {shlex.quote(str(FIX / 'cuda_oom.log'))} > {shlex.quote(str(fifo))} & "
                              f"{TD} logs --json {shlex.quote(str(fifo))}")
    assert rc == 1 and "memory.cuda-oom" in out, err[-1000:]

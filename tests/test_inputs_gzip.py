"""A gzip log cut short or damaged part-way is read up to there, as ``zcat`` prints what it can.

Half of a gzip file is what a half-copied log of a crashed job is. ``torchdoctor logs`` analyses the text that
decompresses from it and adds a warning first (``logs.gzip-truncated`` / ``logs.gzip-corrupt``) that says so and
after how many lines; the exit code follows the findings. The oracle for "what decompresses" is zlib itself, fed
the damaged bytes directly (one byte at a time where the data is invalid: the output before the damage); the
findings must be those of that text written as a plain log, plus the warning. A file that gives no text at all
(a damaged header, a cut inside it) cannot be read: one line, exit 2. Every run is a real subprocess on a real
file or pipe, bounded (tests/bounded.py).
"""

from __future__ import annotations

import gzip
import json
import random
import shlex
import zlib
from pathlib import Path

import pytest

from test_inputs_bounds import TD, bounded_sh, one_line_usage_error
from torchdoctor.logs import analyze as A

FIX = Path(__file__).parent / "fixtures" / "logs"


def training_log(head: str = "cuda_oom.log", steps: int = 60_000) -> bytes:
    """A fixture's failure, then many steps of numbers that do not compress to nothing (so half a file is text)."""
    rng = random.Random(18)
    filler = "".join(f"step {i} loss {rng.random():.6f} lr {rng.random():.4e} tokens/s {rng.randrange(10**6)}\n"
                     for i in range(steps))
    return (FIX / head).read_bytes() + filler.encode()


def lines_of(text: bytes) -> int:
    return text.count(b"\n") + (0 if text.endswith(b"\n") or not text else 1)


def decodable(blob: bytes) -> bytes:
    """What zlib gives from ``blob`` before it ends or breaks, fed a byte at a time (nothing lost at an error)."""
    d, out = zlib.decompressobj(31), []
    for i in range(len(blob)):
        try:
            out.append(d.decompress(blob[i:i + 1]))
        except zlib.error:
            break
        if d.eof:
            break
    return b"".join(out)


def logs_json(path: Path | str, feed: str = "file") -> tuple[int, dict, str]:
    cmd = f"exec {TD} logs --json {shlex.quote(str(path))}" if feed == "file" else \
        f"cat {shlex.quote(str(path))} | {TD} logs --json -"
    rc, out, err = bounded_sh(cmd)
    assert "Traceback" not in out + err, err[-2000:]
    return rc, json.loads(out), err


def same_as_plain(tmp_path: Path, text: bytes) -> tuple[int, dict]:
    plain = tmp_path / "decodable.log"
    plain.write_bytes(text)
    rc, doc, _ = logs_json(plain)
    return rc, doc


@pytest.mark.parametrize("feed", ["file", "stdin"])
def test_half_of_a_gzip_log_is_read_up_to_the_cut_with_a_warning(tmp_path, feed):
    whole = gzip.compress(training_log())
    half = tmp_path / "train.log.gz"
    half.write_bytes(whole[: len(whole) // 2])
    text = zlib.decompressobj(31).decompress(half.read_bytes())  # all zlib can give: the input just stops
    assert 0 < len(text) < len(training_log())
    rc, doc, err = logs_json(half, feed)
    want_rc, want = same_as_plain(tmp_path, text)
    assert rc == want_rc == 1, err[-2000:]  # the CUDA OOM at the start is a fail: the exit code follows it
    warning, *rest = doc["findings"]
    assert warning["id"] == "logs.gzip-truncated" and warning["severity"] == "warn"
    assert doc["lines"] == lines_of(text) == warning["data"]["lines"]
    assert f"after {lines_of(text):,} lines" in warning["title"] and "ends early" in warning["title"]
    assert rest == want["findings"] and doc["timeline"] == want["timeline"]


def test_a_clean_log_cut_short_exits_0_with_the_warning(tmp_path):
    whole = gzip.compress(training_log("clean_run.log"))
    cut = tmp_path / "clean.log.gz"
    cut.write_bytes(whole[: len(whole) * 3 // 4])
    rc, doc, err = logs_json(cut)
    want_rc, want = same_as_plain(tmp_path, zlib.decompressobj(31).decompress(cut.read_bytes()))
    assert rc == want_rc == 0, err[-2000:]  # a warning does not fail the run
    assert doc["findings"][0]["id"] == "logs.gzip-truncated" and doc["findings"][1:] == want["findings"]
    assert "logs.clean" in [f["id"] for f in want["findings"]]


def test_the_text_output_says_it_ends_early_and_after_how_many_lines(tmp_path):
    whole = gzip.compress(training_log())
    half = tmp_path / "train.log.gz"
    half.write_bytes(whole[: len(whole) // 2])
    n = lines_of(zlib.decompressobj(31).decompress(half.read_bytes()))
    rc, out, err = bounded_sh(f"exec {TD} logs {half}")
    assert rc == 1 and err == "", err[-2000:]
    assert f"[WARN] the log ends early: its gzip data stops after {n:,} lines" in out
    assert f"torchdoctor logs: {half} ({n} lines," in out


def damaged_at(raw: bytes, at: int) -> tuple[bytes, int]:
    """(``raw`` gzipped, with the deflate block that starts at ``raw[at:]`` made invalid: a full flush there puts
    the next block header on a byte of its own, and 0x07 is BFINAL=1 with the reserved BTYPE 11; that byte's offset)."""
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    before = c.compress(raw[:at]) + c.flush(zlib.Z_FULL_FLUSH)
    after = c.compress(raw[at:]) + c.flush()
    return before + b"\x07" + after[1:], len(before)


def test_invalid_data_mid_file_is_read_up_to_the_damage(tmp_path):
    raw = training_log()
    at = raw.index(b"\n", len(raw) // 2) + 1
    blob, where = damaged_at(raw, at)
    bad = tmp_path / "damaged.log.gz"
    bad.write_bytes(blob)
    text = decodable(blob)
    assert text == raw[:at]  # the oracle: zlib itself stops at the damaged block
    # the damage is part-way through one of the reader's reads, so the text before it in that read is kept only
    # because the reader retries that read a byte at a time (one call would raise and lose it)
    assert where % A._GZ_IN not in (0, A._GZ_IN - 1)
    rc, doc, err = logs_json(bad)
    want_rc, want = same_as_plain(tmp_path, text)
    assert rc == want_rc == 1, err[-2000:]
    warning, *rest = doc["findings"]
    assert warning["id"] == "logs.gzip-corrupt" and warning["severity"] == "warn"
    assert warning["data"]["why"] == "the gzip data is damaged: invalid block type"
    assert doc["lines"] == lines_of(text) == warning["data"]["lines"]
    assert f"damaged after {lines_of(text):,} lines" in warning["title"]
    assert rest == want["findings"]


def test_a_crc_error_keeps_every_line_and_says_the_check_failed(tmp_path):
    raw = training_log()
    blob = bytearray(gzip.compress(raw))
    blob[-8] ^= 0xFF  # the CRC32 in the trailer: every byte decompresses, the check fails at the end
    bad = tmp_path / "crc.log.gz"
    bad.write_bytes(bytes(blob))
    rc, doc, err = logs_json(bad)
    warning = doc["findings"][0]
    assert (warning["id"], warning["data"]["why"]) == ("logs.gzip-corrupt",
                                                       "the gzip data is damaged: its CRC check failed (incorrect "
                                                       "data check)")
    assert doc["lines"] == lines_of(raw) and rc == 1, err[-2000:]


def test_several_members_and_their_padding_read_whole_without_a_warning(tmp_path):
    """What gzip -d reads whole (concatenated members, NUL padding after one) is whole here too."""
    raw = training_log()
    cut = raw.index(b"\n", len(raw) // 3) + 1
    blob = gzip.compress(raw[:cut]) + b"\0" * 512 + gzip.compress(raw[cut:])
    f = tmp_path / "members.log.gz"
    f.write_bytes(blob)
    rc, doc, err = logs_json(f)
    want_rc, want = same_as_plain(tmp_path, raw)
    assert rc == want_rc and doc["lines"] == lines_of(raw), err[-2000:]
    assert doc["findings"] == want["findings"]  # no warning
    tail = tmp_path / "trailing.log.gz"
    tail.write_bytes(blob + b"not gzip")
    _, doc, _ = logs_json(tail)
    assert doc["findings"][0]["id"] == "logs.gzip-corrupt" and doc["lines"] == lines_of(raw)
    assert "the bytes after its gzip data are not gzip" in doc["findings"][0]["data"]["why"]


@pytest.mark.parametrize("blob, says", [
    (gzip.compress(b"step 1 loss 0.5\n" * 1000)[:10], "the file ends inside its gzip data"),
    (b"\x1f\x8b\x08\x20 not gzip", "the gzip data is damaged: unknown header flags set"),
    (b"\x1f\x8b\x07" + bytes(20), "the gzip data is damaged: unknown compression method"),
], ids=["cut-in-header", "bad-flags", "bad-method"])
def test_a_gzip_file_that_gives_no_text_cannot_be_read(tmp_path, blob, says):
    f = tmp_path / "x.log.gz"
    f.write_bytes(blob)
    rc, out, err = bounded_sh(f"exec {TD} logs {f}")
    assert says in one_line_usage_error(rc, out, err, f"torchdoctor logs: cannot read {f}: ")


def test_a_cut_gzip_bomb_streams_in_bounded_memory(tmp_path):
    """512 MiB of zeros in one line, gzipped to about 0.5 MiB and cut: read to the cut in 256 MiB of memory."""
    c, parts = zlib.compressobj(9, zlib.DEFLATED, 31), []
    zeros = bytes(1 << 20)
    for _ in range(512):
        parts.append(c.compress(zeros))
    blob = b"".join(parts) + c.flush()
    f = tmp_path / "bomb.log.gz"
    f.write_bytes(blob[:-100])
    rc, out, err = bounded_sh(f"exec {TD} logs --json {f}", mem=256 << 20)
    assert rc == 0, err[-2000:]
    doc = json.loads(out)
    assert doc["findings"][0]["id"] == "logs.gzip-truncated" and doc["lines"] == 1

"""``torchdoctor run`` reads what a child writes in any encoding: real child processes writing UTF-16, Latin-1 and
binary garbage to real pipes. The verdict must be the one ``logs`` gives, and the bytes passed on to the terminal
and the ``--log`` file must be exactly the child's."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from torchdoctor.logs.analyze import analyze_stream
from torchdoctor.run import supervisor
from torchdoctor.run.pump import StreamText, decode_lines

pytestmark = pytest.mark.machine  # real runs read this machine's memory, cgroup and kernel log

PY = sys.executable
FIX = Path(__file__).parent / "fixtures" / "logs"

# writes the bytes of the file argv[1] to fd argv[2] in pieces cut at the offsets argv[3:], each piece its own
# pipe read (flush, pause), then exits with the code in the file argv[1] + ".rc" (or raises, see CRASH)
WRITER = r"""
import os, sys, time
data = open(sys.argv[1], "rb").read()
fd = int(sys.argv[2])
cuts = [int(c) for c in sys.argv[3:]]
at = 0
for c in [*cuts, len(data)]:
    os.write(fd, data[at:c])
    at = c
    time.sleep(0.03)
code = open(sys.argv[1] + ".rc").read()
if code == "raise":
    raise ValueError("labels and logits have different shapes")
sys.exit(int(code))
"""

TRAINING = ("***** Running training *****\n"
            " 10%|#         | 10/100 [00:02<00:18,  4.51it/s]\r 20%|##        | 20/100 [00:04<00:16,  4.50it/s]\n"
            "{'loss': 2.3151, 'grad_norm': 1.204, 'learning_rate': 4.95e-05, 'epoch': 0.1}\n"
            "{'loss': nan, 'grad_norm': nan, 'learning_rate': 4.9e-05, 'epoch': 0.2}\n")


def _run(tmp_path: Path, data: bytes, *, fd: int = 1, cuts: tuple[int, ...] = (), rc: str = "1"):
    """Run WRITER under run_command; returns (result, bytes on our stdout, bytes on our stderr, the --log bytes)."""
    src = tmp_path / "child.bin"
    src.write_bytes(data)
    Path(f"{src}.rc").write_text(rc)
    out, err, log = tmp_path / "out", tmp_path / "err", tmp_path / "run.log"
    out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err_fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with open(log, "ab", buffering=0) as log_file:
            r = supervisor.run_command([PY, "-c", WRITER, str(src), str(fd), *map(str, cuts)], log_file=log_file,
                                 interval=0.05, out_fd=out_fd, err_fd=err_fd)
    finally:
        os.close(out_fd)
        os.close(err_fd)
    return r, out.read_bytes(), err.read_bytes(), log.read_bytes()


def _ids(r) -> dict:
    return {f.id: f for f in r.findings}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])  # BOM (native order), iconv's, big-end
def test_a_utf16_child_is_judged_and_passed_through_untouched(tmp_path, encoding):
    data = TRAINING.encode(encoding)
    cuts = (1, 7, 40, len(data) // 2 + 1, len(data) - 3)  # code units and the BOM cut in two across pipe reads
    r, out, err, log = _run(tmp_path, data, cuts=cuts)
    assert out == data and log == data and err == b""
    f = _ids(r)["loss.nonfinite"]
    assert f.severity == "fail" and "{'loss': nan, 'grad_norm': nan" in f.evidence[0]
    assert "logs.analyzer-error" not in _ids(r) and r.exit_code == 1


def test_python_writing_utf16_line_by_line_repeats_the_bom_and_is_still_read(tmp_path):
    data = b"".join(line.encode("utf-16") for line in TRAINING.splitlines(keepends=True))  # a BOM per encode()
    r, out, _, log = _run(tmp_path, data, cuts=tuple(range(50, len(data), 111)))
    assert out == data and log == data
    f = _ids(r)["loss.nonfinite"]
    assert f.severity == "fail" and ": {'loss': nan, 'grad_norm'" in f.evidence[0] and "\ufeff" not in f.evidence[0]


def test_latin1_lines_keep_their_characters_and_the_nan_loss_is_judged(tmp_path):
    data = ("Epoch 1 - d\xe9j\xe0 vu, caf\xe9\n" + "step 1 | loss: 2.31 | lr 1e-4\n" * 200  # valid UTF-8 past the sniff
            + "{'loss': nan, 'epoch': 0.2} # r\xe9sum\xe9\n").encode("latin-1")
    r, out, _, log = _run(tmp_path, data, cuts=(5, 12, 3000))
    assert out == data and log == data
    f = _ids(r)["loss.nonfinite"]
    assert f.severity == "fail"
    assert "r\xe9sum\xe9" in f.evidence[0]  # decoded as Latin-1, not replaced: the line reads as written


def test_garbage_bytes_then_a_crash_traceback_is_a_process_exception(tmp_path):
    rng = random.Random(11)
    garbage = bytes(rng.randrange(256) for _ in range(20000))  # a binary blob on stderr, \n and \r and NULs in it
    assert b"\n" in garbage and b"\x00" in garbage
    r, out, err, log = _run(tmp_path, garbage, fd=2, cuts=(1, 4095, 4096, 9000), rc="raise")
    assert out == b""
    assert err.startswith(garbage) and b"ValueError: labels and logits" in err[len(garbage):]
    assert log == err  # the traceback the child printed after it, too: nothing added, nothing lost
    f = _ids(r)["process.exception"]
    assert f.severity == "fail" and r.exit_code == 1
    assert any("ValueError: labels and logits have different shapes" in e for e in [f.title, *f.evidence]), f


def test_each_stream_is_sniffed_on_its_own(tmp_path):
    """A tool writing UTF-16 to stdout while Python's traceback goes to stderr in UTF-8."""
    child = (f"import sys\nsys.stdout.buffer.write({TRAINING!r}.encode('utf-16')); sys.stdout.flush()\n"
             "raise RuntimeError('CUDA error: an illegal memory access was encountered')\n")
    out_r, out_w = os.pipe()
    log = io.BytesIO()
    r = supervisor.run_command([PY, "-c", child], log_file=log, interval=0.05, out_fd=out_w,
                         err_fd=os.open(os.devnull, os.O_WRONLY))
    os.close(out_w)
    with os.fdopen(out_r, "rb") as f:
        assert f.read() == TRAINING.encode("utf-16")
    ids = _ids(r)
    assert ids["loss.nonfinite"].severity == "fail"
    assert any("illegal memory access" in e for e in [ids["process.exception"].title,
                                                     *ids["process.exception"].evidence])


def test_run_on_a_utf16_log_finds_what_logs_finds(tmp_path):
    data = (FIX / "hf_trainer_nan.log").read_text(encoding="utf-8").encode("utf-16")
    log = tmp_path / "train.log"
    log.write_bytes(data)
    r = supervisor.run_command(["cat", str(log)], interval=0.05, out_fd=os.open(os.devnull, os.O_WRONLY))
    want = analyze_stream(io.BytesIO(data))
    assert [f.id for f in want.findings if f.severity == "fail"]  # the fixture has a verdict to compare
    got = [(f.id, f.severity, f.title) for f in r.findings if f.id != "process.exit"]
    assert got == [(f.id, f.severity, f.title) for f in want.findings]
    assert r.timeline == want.timeline


def test_the_cli_shows_the_verdict_for_a_utf16_child(tmp_path):
    child = f"import sys; sys.stdout.buffer.write({TRAINING!r}.encode('utf-16')); sys.exit(1)"
    rep = tmp_path / "r.json"
    p = subprocess.run([PY, "-m", "torchdoctor", "run", "--json", str(rep), "--", PY, "-c", child],
                       capture_output=True, timeout=120)
    assert p.returncode == 1 and p.stdout == TRAINING.encode("utf-16")
    assert b"(loss.nonfinite)" in p.stderr
    [f] = [f for f in json.loads(rep.read_text())["findings"] if f["id"] == "loss.nonfinite"]
    assert f["severity"] == "fail"


# ------------------------------------------------------------------------------------------ the decoder


def test_decode_lines_falls_back_to_latin1_only_for_the_bad_line():
    block = "caf\xe9 ok\n".encode() + b"d\xe9j\xe0 vu\n" + "na\xefve\n".encode() + b"\xff\xfe\x00 x\n" + b"end\n"
    assert decode_lines(block) == "caf\xe9 ok\nd\xe9j\xe0 vu\nna\xefve\n\xff\xfe\x00 x\nend\n"
    assert decode_lines(b"no newline \xe9") == "no newline \xe9"
    assert decode_lines(b"") == ""


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1", "utf-16", "utf-16-le", "utf-16-be"])
def test_stream_text_gives_the_same_text_however_the_bytes_are_cut(encoding):
    text = ("Epoch 1 - d\xe9j\xe0\n" if encoding == "latin-1" else "Epoch 1 \u2013 d\xe9j\xe0 \u4e0a\n") + TRAINING * 30
    data = text.encode(encoding)
    for step in (len(data), 4096, 97, 3, 1):
        s = StreamText()
        blocks = [b for at in range(0, len(data), step) for b in s.feed(data[at:at + step])] + s.flush()
        assert all(not partial for _, partial in blocks)
        assert "".join(b for b, _ in blocks) == text, (encoding, step)
        assert s.encoding == ("utf-8" if encoding in ("utf-8", "latin-1") else encoding)

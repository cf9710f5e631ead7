"""Every file, pipe or standard input the command line reads is bounded: real /dev/zero, real FIFOs, real folders.

A JSON input (a DeepSpeed config, TrainingArguments, a model config.json) is read up to jsonfile.MAX_BYTES (16 MiB)
and refused past it; a log is streamed in constant memory. Each run that reads an endless source runs under
tests/bounded.py's memory limit, so a broken cap is a failed test (killed, or MemoryError), not a machine out of
memory: 1 GiB is several times what these commands need (measured: ds check ~250 MiB with torch imported, the
refusals below ~50 MiB).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bounded import run_bounded
from torchdoctor.jsonfile import MAX_BYTES

SRC = str(Path(__file__).parent.parent / "src")
ENV = {**os.environ, "PYTHONPATH": SRC}
TD = f"{shlex.quote(sys.executable)} -m torchdoctor"
MEM = 1 << 30
GOOD = str(Path(__file__).parent / "fixtures" / "ds_check" / "good.json")

# (command line with {src} where the JSON input goes, the message's prefix before the source's name)
JSON_READERS = {
    "ds check": ("ds check {src}", "torchdoctor ds check: "),
    "ds memory --config": ("ds memory --params 7B --gpus-per-node 1 --cpu-mem 64 --gpu-mem 80 --config {src}",
                           "torchdoctor ds memory: --config: "),
    "ds memory --model": ("ds memory --model {src} --gpus-per-node 1", "torchdoctor ds memory: "),
    "env --ds-config": ("env --ds-config {src}", "torchdoctor env: --ds-config: "),
    "report --ds-config": ("report --ds-config {src}", "torchdoctor report: "),
    "report --training-args": ("report --training-args {src}", "torchdoctor report: "),
}


def bounded_sh(script: str, mem: int = MEM):
    """``script`` in sh, bounded; (exit code, stdout, stderr)."""
    r = run_bounded(["sh", "-c", script], mem_bytes=mem, max_procs=64, timeout=300, env=ENV)
    assert not r.timed_out, r.proc.stderr[-2000:]
    return r.proc.returncode, r.proc.stdout.decode(errors="replace"), r.proc.stderr.decode(errors="replace")


def one_line_usage_error(rc: int, out: str, err: str, prefix: str) -> str:
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in out + err
    lines = [ln for ln in err.splitlines() if ln.strip() and "probing" not in ln]  # env's progress line, if slow
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.mark.parametrize("reader", JSON_READERS)
def test_dev_zero_is_read_up_to_the_cap_and_refused(reader):
    args, prefix = JSON_READERS[reader]
    rc, out, err = bounded_sh(f"exec {TD} {args.format(src='/dev/zero')}")
    msg = one_line_usage_error(rc, out, err, prefix)
    assert "/dev/zero" in msg and "a character device that did not end within 16 MiB" in msg


@pytest.mark.parametrize("reader", ["ds check", "env --ds-config", "report --ds-config"])
def test_an_endless_fifo_is_read_up_to_the_cap_and_refused(tmp_path, reader):
    args, prefix = JSON_READERS[reader]
    fifo = tmp_path / "endless.json"
    os.mkfifo(fifo)
    # the writer never stops by itself: it ends with SIGPIPE once the reader gives up (run_bounded ends it anyway)
    rc, out, err = bounded_sh(f"cat /dev/zero > {fifo} & exec {TD} {args.format(src=fifo)}")
    msg = one_line_usage_error(rc, out, err, prefix)
    assert f"{fifo}: a pipe that did not end within 16 MiB" in msg


@pytest.mark.parametrize("feed", ["exec {td} ds check - < /dev/zero", "cat /dev/zero | {td} ds check -",
                                  "yes '{{\"a\": 1, ' | {td} ds check -"])
def test_endless_standard_input_is_read_up_to_the_cap_and_refused(feed):
    rc, out, err = bounded_sh(feed.format(td=TD))
    msg = one_line_usage_error(rc, out, err, "torchdoctor ds check: <stdin>: ")
    assert "did not end within 16 MiB" in msg


def test_a_fifo_holding_a_config_is_read_as_it_is_written(tmp_path):
    """A FIFO (or bash's <(...)) is a legitimate source: read to its end, checked like the file."""
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    rc, out, err = bounded_sh(f"cat {shlex.quote(GOOD)} > {fifo} & exec {TD} ds check --json {fifo}")
    assert rc == 0, err
    assert '"config.ok"' in out


def test_a_regular_file_over_the_cap_is_refused_unread(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # valid JSON, one byte past the cap: the size alone refuses it
        f.write(b'{"a": "' + b"x" * (MAX_BYTES - 8) + b'"}')
    assert big.stat().st_size == MAX_BYTES + 1
    rc, out, err = bounded_sh(f"exec {TD} ds check {big}")
    msg = one_line_usage_error(rc, out, err, "torchdoctor ds check: ")
    assert f"{big}: 16,777,217 bytes, more than the 16 MiB torchdoctor reads of a DeepSpeed config" in msg


def test_a_file_at_the_cap_is_read(tmp_path):
    """The good fixture with a JSON comment that pads it to exactly the cap: checked as the fixture is."""
    good = Path(GOOD).read_bytes().strip()
    head = b'{"_comment": "'
    tail = b'", ' + good[1:]
    at_cap = tmp_path / "at_cap.json"
    at_cap.write_bytes(head + b"x" * (MAX_BYTES - len(head) - len(tail)) + tail)
    assert at_cap.stat().st_size == MAX_BYTES
    rc, out, err = bounded_sh(f"exec {TD} ds check --json {at_cap}")
    assert rc == 0 and '"config.ok"' in out, err[-2000:]


@pytest.mark.parametrize("reader", JSON_READERS)
def test_a_directory_is_refused(tmp_path, reader):
    args, prefix = JSON_READERS[reader]
    d = tmp_path / "configs"
    d.mkdir()
    if reader == "ds memory --model":  # a folder is how --model takes a model: without config.json it says so
        rc, out, err = bounded_sh(f"exec {TD} {args.format(src=d)}")
        assert "has no config.json" in one_line_usage_error(rc, out, err, prefix)
        return
    rc, out, err = bounded_sh(f"exec {TD} {args.format(src=d)}")
    assert f"{d}: is a directory" in one_line_usage_error(rc, out, err, prefix)


# -- logs: streamed, never whole in memory ----------------------------------------------------------------------


def test_a_log_larger_than_the_memory_limit_is_streamed():
    """512 MiB with no newline through a pipe, in 256 MiB: only a stream that keeps no whole line gets through."""
    rc, out, err = bounded_sh(f"head -c 512M /dev/zero | {TD} logs --json -", mem=256 << 20)
    assert rc == 0, err[-2000:]
    assert '"lines": 1' in out


def test_a_log_from_a_fifo_is_streamed(tmp_path):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    log = Path(__file__).parent / "fixtures" / "logs" / "ds_legacy_collapse.log"
    rc, out, err = bounded_sh(f"(cat {log}; head -c 64M /dev/zero) > {fifo} & exec {TD} logs {fifo}", mem=256 << 20)
    assert rc == 1, err[-2000:]  # the collapse in the fixture is still found before the 64 MiB of zeros
    assert "(fp16.loss-scale-collapse)" in out


@pytest.mark.parametrize("script, says", [
    ("exec {td} logs /dev/zero", "torchdoctor logs: /dev/zero: a character device, not a log"),
    ("exec {td} logs - < /dev/zero", "torchdoctor logs: standard input: a character device, not a log"),
])
def test_a_log_that_is_an_endless_device_is_refused(script, says):
    rc, out, err = bounded_sh(script.format(td=TD), mem=256 << 20)
    assert one_line_usage_error(rc, out, err, "torchdoctor logs: ").startswith(says)


def test_a_log_directory_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchdoctor", "logs", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert one_line_usage_error(proc.returncode, proc.stdout, proc.stderr, "torchdoctor logs: ") == \
        f"torchdoctor logs: {tmp_path}: is a directory, and holds no Flight Recorder dumps; pass the log files in it"


def test_ds_check_from_a_terminal_says_it_is_reading_standard_input():
    """On a terminal, `ds check -` waits for the config to be typed: it says so instead of sitting there silently."""
    import pty

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "torchdoctor", "ds", "check", "--json", "-"], stdin=terminal,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        os.close(terminal)
        os.write(controller, b'{"train_micro_batch_size_per_gpu": 4}\n\x04')  # Ctrl-D at a line's start: the end
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # still waiting on the terminal: the reader missed the end
            proc.kill()
            proc.wait()
        os.close(controller)
    assert err.splitlines()[0] == "torchdoctor ds check: reading the config from standard input (end it with Ctrl-D)"
    assert proc.returncode in (0, 1) and '"findings"' in out, err[-2000:]

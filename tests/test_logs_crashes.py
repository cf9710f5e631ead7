"""A crashed run is never "OK" (issue 11): tracebacks, segfaults, CUDA runtime errors, undecoded logs, SIGKILLs.

Python tracebacks and segfaults come from real subprocesses (a script that raises, ``ctypes.string_at(0)``);
the CUDA messages (no GPU here) are fixtures written after torch's and the driver's own wording; the UTF-16 and
Latin-1 logs are real encodings of the fixtures, made with Python's codecs.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchdoctor.logs import logs_run
from torchdoctor.logs.analyze import analyze_lines, analyze_stream, open_log
from torchdoctor.run import supervisor
from torchdoctor.run.exit_findings import _memory_low

FIX = Path(__file__).parent / "fixtures" / "logs"
PY = sys.executable


def by_id(report) -> dict:
    return {f.id: f for f in report.findings}


def analyze_text(text: str):
    return analyze_stream(io.BytesIO(text.encode()))


def logs_exit(path: Path, capsys) -> int:
    p = argparse.ArgumentParser()
    logs_run.add_arguments(p)
    code = logs_run.run(p.parse_args([str(path)]))
    capsys.readouterr()
    return code


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "train.py"
    p.write_text(textwrap.dedent(body))
    return p


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


RAISES = """
    def step(batch):
        return batch["labels"] * 2

    def main():
        for i in range(3):
            print(f"step {i} loss 1.{i}", flush=True)
        step({"input_ids": [1]})

    main()
"""


# ------------------------------------------------------------------------------------------------ tracebacks
def test_a_real_traceback_is_a_failure_with_its_last_line_and_the_users_frame(tmp_path, capsys):
    script = _script(tmp_path, RAISES)
    p = _run([PY, str(script)])
    assert p.returncode == 1 and "KeyError" in p.stderr
    log = tmp_path / "run.log"
    log.write_text(p.stdout + p.stderr)
    report = analyze_stream(open_log(str(log)))
    f = by_id(report)["process.exception"]
    assert f.severity == "fail" and "logs.clean" not in by_id(report)
    assert f.title.startswith("the run failed with KeyError: 'labels' at ") and f.title.endswith(":3 in step")
    assert f.data["user_frame"]["file"] == str(script) and f.data["user_frame"]["line"] == 3
    assert f.data["user_frame"]["code"] == 'return batch["labels"] * 2'
    assert logs_exit(log, capsys) == 1


def test_the_innermost_user_frame_is_not_a_library_frame(tmp_path):
    script = _script(tmp_path, """
        import json

        def load(text):
            return json.loads(text)

        load("{not json")
    """)
    p = _run([PY, str(script)])
    f = by_id(analyze_text(p.stderr))["process.exception"]
    assert f.data["exception"]["type"] == "json.decoder.JSONDecodeError"
    assert f.data["user_frame"]["func"] == "load" and f.data["user_frame"]["line"] == 5
    assert "json/decoder.py" in f.data["innermost_frame"]["file"]  # the stdlib frame is where it was raised
    assert any(e.startswith("raised in: ") and "json/decoder.py" in e for e in f.evidence)


def test_a_chained_exception_keeps_its_cause(tmp_path):
    script = _script(tmp_path, """
        def read(path):
            try:
                open(path)
            except FileNotFoundError as e:
                raise RuntimeError("cannot load the dataset") from e

        read("/nonexistent/data.jsonl")
    """)
    p = _run([PY, str(script)])
    f = by_id(analyze_text(p.stderr))["process.exception"]
    assert f.severity == "fail" and "RuntimeError: cannot load the dataset" in f.title
    assert f.data["cause"]["type"] == "FileNotFoundError"
    assert any("caused by: FileNotFoundError" in e for e in f.evidence)
    assert len([x for x in analyze_text(p.stderr).findings if x.id == "process.exception"]) == 1


def test_a_traceback_training_went_on_after_is_only_info():
    lines = ["  1%|          | 10/1000 [00:10<16:30,  1.00it/s]",
             "Traceback (most recent call last):",
             '  File "/home/u/train.py", line 12, in log_metrics',
             "    wandb.log(m)",
             "ConnectionError: wandb is unreachable",
             "  2%|▏         | 20/1000 [00:20<16:20,  1.00it/s]"]
    f = by_id(analyze_lines(lines))["process.exception"]
    assert f.severity == "info" and "training went on" in f.title


def test_two_ranks_failing_together_report_the_first(tmp_path):
    tb = ["Traceback (most recent call last):", '  File "/w/train.py", line 9, in <module>', "    run()"]
    lines = [f"[rank1]: {x}" for x in tb] + ["[rank1]: ValueError: rank 1 saw an empty batch"]
    lines += [f"[rank0]: {x}" for x in tb] + ["[rank0]: RuntimeError: rank 0 waited for rank 1"]
    f = by_id(analyze_lines(lines))["process.exception"]
    assert f.title.startswith("rank 1: the run failed with ValueError: rank 1 saw an empty batch")
    assert any("1 more traceback(s) right after it (ranks 0)" in e for e in f.evidence)


def test_a_cpp_terminate_is_the_exception_and_its_abort_is_named():
    lines = ["terminate called after throwing an instance of 'c10::Error'",
             "  what():  unknown parameter type",
             "Aborted (core dumped)"]
    ids = by_id(analyze_lines(lines))
    assert ids["process.exception"].severity == "fail"
    assert "c10::Error: unknown parameter type" in ids["process.exception"].title
    assert ids["process.killed"].title.startswith("a process crashed with SIGABRT (-6) (core dumped)")


def test_a_sentence_that_starts_with_aborted_is_not_a_signal():
    assert "process.killed" not in by_id(analyze_lines(["Aborted training early: target loss reached"]))


# ------------------------------------------------------------------------------------------------ segfaults
def test_a_real_segfault_under_faulthandler_is_named_with_the_users_frame(tmp_path, capsys):
    script = _script(tmp_path, """
        import ctypes

        def crash():
            ctypes.string_at(0)

        crash()
    """)
    p = _run([PY, "-X", "faulthandler", str(script)])
    assert p.returncode == -11 and "Fatal Python error: Segmentation fault" in p.stderr
    log = tmp_path / "crash.log"
    log.write_text(p.stderr)
    ids = by_id(analyze_stream(open_log(str(log))))
    k = ids["process.killed"]
    assert k.severity == "fail" and "crashed with SIGSEGV (-11)" in k.title and "segmentation fault" in k.title
    assert "faulthandler" in k.fix[0]
    e = ids["process.exception"]
    assert e.data["kind"] == "faulthandler" and e.data["user_frame"]["func"] == "crash"
    assert logs_exit(log, capsys) == 1


def test_the_shells_core_dumped_line_is_a_crash(tmp_path):
    p = _run(["bash", "-c", f"{PY} -c 'import ctypes; ctypes.string_at(0)'; true"])
    assert "Segmentation fault" in p.stderr  # bash: "bash: line 1: PID Segmentation fault (core dumped) ..."
    k = by_id(analyze_text(p.stderr))["process.killed"]
    assert "crashed with SIGSEGV (-11)" in k.title and k.data["kills"][0]["source"] == "shell"


@pytest.mark.machine
def test_run_names_a_segfault(capfd):
    r = supervisor.run_command([PY, "-c", "import ctypes; ctypes.string_at(0)"], interval=0.05)
    capfd.readouterr()
    f = r.findings[0]
    assert r.exit_code == 139 and f.id == "process.exit" and f.severity == "fail"
    assert f.title.startswith("crashed with a segmentation fault (SIGSEGV) after")


# ------------------------------------------------------------------------------------------------ torchdoctor run
@pytest.mark.machine
def test_run_a_failing_script_is_a_failure_and_a_handled_traceback_is_not(tmp_path, capfd):
    script = _script(tmp_path, RAISES)
    r = supervisor.run_command([PY, str(script)], interval=0.05)
    capfd.readouterr()
    ids = {f.id: f for f in r.findings}
    assert r.exit_code == 1 and ids["process.exception"].severity == "fail"
    assert ids["process.exit"].title.endswith("see process.exception")
    handled = _script(tmp_path, """
        import traceback
        try:
            {}["labels"]
        except KeyError:
            traceback.print_exc()
        print("done")
    """)
    r = supervisor.run_command([PY, str(handled)], interval=0.05)
    capfd.readouterr()
    ids = {f.id: f for f in r.findings}
    assert r.exit_code == 0 and ids["process.exception"].severity == "info" and "exited 0" in ids[
        "process.exception"].title


@pytest.mark.machine
def test_run_a_nonzero_exit_with_no_known_cause_quotes_the_last_error_lines(capfd):
    code = ("import sys; print('epoch 1 done'); print('ERROR: quota exceeded writing /ckpt/step_100', "
            "file=sys.stderr); sys.exit(3)")
    r = supervisor.run_command([PY, "-c", code], interval=0.05)
    capfd.readouterr()
    f = r.findings[0]
    assert r.exit_code == 3 and f.severity == "warn" and "no known failure signature" in f.title
    assert "quota exceeded" in f.title and "  ERROR: quota exceeded writing /ckpt/step_100" in f.evidence


WORKER_KILLS_ITSELF = """
    import os, signal, time
    rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank} up", flush=True)
    time.sleep(0.5)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""


@pytest.mark.machine
def test_run_around_torchrun_does_not_blame_a_sigkill_with_plenty_of_memory_on_the_oom_killer(tmp_path, capfd):
    """What the verdict may say follows what this machine let ``run`` see: the kernel log (read: the OOM killer
    is ruled out; unreadable: only likelier or not) and memory (ran low: the OOM killer cannot be ruled out)."""
    torchrun = Path(PY).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("no torchrun next to the interpreter")
    script = _script(tmp_path, WORKER_KILLS_ITSELF)
    r = supervisor.run_command([str(torchrun), "--nproc_per_node", "2", str(script)], interval=0.1)
    capfd.readouterr()
    k = next(f for f in r.findings if f.id == "process.killed")
    assert k.severity == "fail" and k.title.startswith("rank 1 (pid ")  # torchrun's "localhost" is this machine
    assert "most likely" not in k.title and "(confirmed" not in k.title
    assert all("most likely the kernel's OOM killer" not in f.title for f in r.findings)
    low = _memory_low(r)
    if low:  # this machine really ran low on memory meanwhile: the OOM killer cannot be ruled out
        assert "likely the kernel's OOM killer: memory ran low" in k.title, k.title
        return
    assert any("scancel" in x and "sacct" in x and "PREEMPTED" in x for x in k.fix), k.fix
    if low is None:  # its cgroup's limit could not be read: whether memory ran low is not known
        assert any("its memory cgroup's limit could not be read" in e for e in k.evidence), k.evidence
    else:
        assert any("torchdoctor run: MemAvailable never fell below" in e for e in k.evidence)
    if r.kernel.readable and r.kernel.unseen_oom_lines:  # the kernel killed another process meanwhile (a shared
        assert "is likelier than the OOM killer" in k.title, k.title  # machine): it may have been the command's
    elif r.kernel.readable:
        assert "not the kernel's OOM killer: torchdoctor run found no OOM-killer entry" in k.title, k.title
        assert "kernel log" in " ".join(k.evidence) and "no OOM-killer entry" in " ".join(k.evidence)
    else:
        assert any("kernel log not readable" in e for e in k.evidence), k.evidence
        if low is None:  # nothing this machine lets run read tells the senders apart
            assert "the log does not say who sent it" in k.title, k.title
        else:
            assert "is likelier than the OOM killer" in k.title and "OOM killer:" not in k.title, k.title


def test_the_hidden_kernel_log_and_cgroup_are_what_run_reports(monkeypatch):
    """TORCHDOCTOR_UNREADABLE (what ``make test``'s second pass sets) really takes the unreadable branches."""
    from torchdoctor import _system

    monkeypatch.setenv("TORCHDOCTOR_UNREADABLE", "kernel-log,cgroup")
    k = supervisor.read_kernel_oom({os.getpid()})
    assert not k.readable and "TORCHDOCTOR_UNREADABLE=kernel-log" in k.source
    assert _system.cgroup_memory() == (None, None) and supervisor.memcg_limit("/") is None
    monkeypatch.setenv("TORCHDOCTOR_UNREADABLE", "cgroup")
    assert "TORCHDOCTOR_UNREADABLE" not in supervisor.read_kernel_oom({os.getpid()}).source


# ------------------------------------------------------------------------------------------------ CUDA errors
def test_an_illegal_memory_access_says_cuda_launch_blocking_and_compute_sanitizer(capsys):
    ids = by_id(analyze_stream(open_log(str(FIX / "cuda_illegal_access.log"))))
    f = ids["cuda.illegal-memory-access"]
    assert f.severity == "fail" and "CUDA_LAUNCH_BLOCKING=1" in f.fix[0] and "compute-sanitizer" in f.fix[1]
    e = ids["process.exception"]
    assert e.severity == "info" and e.data["explained_by"] == "cuda-error"
    assert e.data["user_frame"]["file"] == "/home/ana/proj/fused_rope.py" and e.data["rank"] == 1
    assert logs_exit(FIX / "cuda_illegal_access.log", capsys) == 1


def test_no_kernel_image_names_the_gpu_and_the_wheels_arch_list():
    f = by_id(analyze_stream(open_log(str(FIX / "cuda_no_kernel_image.log"))))["cuda.no-kernel-image"]
    assert f.severity == "fail" and "sm_120" in f.title and "sm_90" in f.title
    text = " ".join(f.fix)
    assert "torch.cuda.get_arch_list()" in text and "TORCH_CUDA_ARCH_LIST" in text and "torchdoctor env" in text


def test_a_driver_too_old_is_its_own_finding():
    f = by_id(analyze_stream(open_log(str(FIX / "cuda_driver_old.log"))))["cuda.driver-too-old"]
    assert f.severity == "fail" and "11040" in f.title and "nvidia-smi" in f.fix[0]


def test_xid_and_ecc_lines_point_at_the_hardware():
    ids = by_id(analyze_stream(open_log(str(FIX / "xid_ecc.log"))))
    x = ids["cuda.xid"]
    assert x.severity == "fail" and x.data["codes"] == [48, 79] and "drain" in x.fix[1]
    assert any("fallen off the bus" in e for e in x.evidence)
    assert ids["cuda.ecc"].severity == "fail" and "nvidia-smi -q -d ECC" in ids["cuda.ecc"].fix[0]


def test_a_device_side_assert_says_which_index_is_out_of_range():
    f = by_id(analyze_stream(open_log(str(FIX / "device_assert.log"))))["cuda.device-assert"]
    assert "n_classes" in f.fix[0] and any("CUDA_LAUNCH_BLOCKING=1" in x for x in f.fix)


# ------------------------------------------------------------------------------------------------ encodings
def _nan_log() -> str:
    return (FIX / "hf_trainer_nan.log").read_text(encoding="utf-8")


@pytest.mark.parametrize("encode", [
    lambda t: codecs.BOM_UTF16_LE + t.encode("utf-16-le"),            # PowerShell 5 `>` / Out-File
    lambda t: t.encode("utf-16"),                                      # with BOM, native order
    lambda t: codecs.BOM_UTF16_BE + t.encode("utf-16-be"),
    lambda t: t.replace("\n", "\r\n").encode("utf-16-le"),            # UTF-16LE, no BOM, CRLF
    lambda t: gzip.compress(t.encode("utf-16-le")),                   # and gzipped
    lambda t: codecs.BOM_UTF8 + t.encode("utf-8"),
], ids=["utf16le-bom", "utf16-bom", "utf16be-bom", "utf16le-nobom-crlf", "utf16le-gzip", "utf8-bom"])
def test_utf16_logs_are_decoded(encode, tmp_path):
    text = _nan_log()
    want = {f.id: f.severity for f in analyze_text(text).findings}
    assert want.get("loss.nonfinite") == "fail"
    p = tmp_path / "train.log"
    p.write_bytes(encode(text))
    with open_log(str(p)) as fh:
        report = analyze_stream(fh)
    assert {f.id: f.severity for f in report.findings} == want
    assert report.lines == text.count("\n")


def test_a_latin1_log_is_decoded_and_its_text_kept(tmp_path):
    text = "Época 1: démarrage\n" + _nan_log().replace("█", "#") + "Traceback (most recent call last):\n" \
           '  File "/home/josé/entraîner.py", line 4, in <module>\n    x()\nValueError: données vides\n'
    p = tmp_path / "latin1.log"
    p.write_bytes(text.encode("latin-1"))
    ids = by_id(analyze_stream(open_log(str(p))))
    assert ids["loss.nonfinite"].severity == "fail"
    assert ids["process.exception"].title.startswith("the run failed with ValueError: données vides at "
                                                      "/home/josé/entraîner.py:4")


def test_a_tracebacks_frames_across_a_chunk_boundary_keep_their_code_line():
    text = "x" * 100 + "\n" + _nan_log() + "Traceback (most recent call last):\n" \
           '  File "/w/t.py", line 4, in <module>\n    boom()\nValueError: v\n'
    cut = text.index("    boom()")
    whole = by_id(analyze_text(text))["process.exception"].data
    for size in (cut - 1, cut, cut + 1, 7):
        got = by_id(analyze_stream(io.BytesIO(text.encode()), chunk_size=size))["process.exception"].data
        assert got == whole, size
    assert whole["user_frame"]["code"] == "boom()"


def test_the_sniffed_head_of_a_tiny_log_is_not_lost():
    for data in (b"", b"x", b"{'loss': nan}\n", codecs.BOM_UTF16_LE + "{'loss': nan}\n".encode("utf-16-le")):
        report = analyze_stream(io.BytesIO(data), chunk_size=3)
        assert report.lines == (1 if data else 0)
        assert ("loss.nonfinite" in by_id(report)) == (b"nan" in data or len(data) > 20)


def test_no_crash_in_a_clean_log_is_still_clean():
    report = analyze_stream(open_log(str(FIX / "clean_run.log")))
    ids = by_id(report)
    assert ids["logs.clean"].severity == "ok" and os.path.getsize(FIX / "clean_run.log") > 0
    assert not any(i.startswith(("process.", "cuda.")) for i in ids)


def test_an_exception_line_without_a_traceback_is_at_least_a_warning():
    f = by_id(analyze_lines(["epoch 1: loss 2.31", "2026-02-11 10:00:01 ERROR trainer: boom",
                             "ValueError: tokenizer has no pad token"]))["process.exception"]
    assert f.severity == "warn" and "ValueError: tokenizer has no pad token" in f.title
    assert "logs.clean" not in by_id(analyze_lines(["ValueError: x is bad"]))


def test_a_launchers_exit_code_without_a_traceback_quotes_the_last_lines():
    lines = ["NCCL_DEBUG unset", "writing checkpoint to /ckpt", "OSError: [Errno 28] No space left on device",
             "[2026-02-11 10:00:03,000] [ERROR] [launch.py:325:sigkill_handler] ['python', 'train.py', "
             "'--local_rank=0'] exits with return code = 1"]
    ids = by_id(analyze_lines(lines))
    assert any("No space left on device" in e for e in ids["process.exit-code"].evidence)


def test_logs_reads_a_utf16_log_from_stdin():
    data = codecs.BOM_UTF16_LE + _nan_log().encode("utf-16-le")
    p = subprocess.run([PY, "-m", "torchdoctor", "logs", "-"], input=data, capture_output=True, timeout=120)
    assert p.returncode == 1 and b"(loss.nonfinite)" in p.stdout and b"[OK]" not in p.stdout


# ---------------------------------------------------------------- the end of a failed run, whatever its layout
BAR = " 45%|####5     | 450/1000 [01:00<01:13,  7.5it/s]"


@pytest.mark.parametrize("lines", [["step 3", BAR + "Killed"], ["step 3", BAR, "Killed"], ["step 3", "Killed"],
                                   ["step 3", "zsh: killed     python train.py"],
                                   ["step 3", BAR + "[1]    26478 killed     python train.py"],
                                   ["step 3", "[2]  + 4242 killed     torchrun train.py"]],
                         ids=["after-a-bar", "own-line-after-a-bar", "own-line", "zsh", "zsh-job-after-a-bar",
                              "zsh-job"])
def test_killed_is_found_on_its_own_line_or_after_a_progress_bar(lines):
    f = by_id(analyze_lines(lines))["process.killed"]
    assert f.severity == "fail"
    [kill] = f.data["kills"]
    assert (kill["signum"], kill["source"], kill["line"]) == (9, "shell", len(lines))


@pytest.mark.parametrize("line", ["some_tool: FATAL: could not open shard 17", "error: unrecognized arguments: --x",
                                  "2026-12-04 12:00:00 | ERROR | shard reader stopped", "[ERROR] dataset missing",
                                  "terminate called without an active exception"])
def test_an_error_no_rule_knows_at_the_end_is_never_ok(line):
    report = analyze_lines(["step 1 loss 2.3", "step 2 loss 2.2", line])
    ids = [f.id for f in report.findings]
    assert "logs.clean" not in ids
    f = by_id(report).get("process.error-line") or by_id(report).get("process.killed")
    assert f is not None and f.severity in ("warn", "fail"), ids
    if f.id == "process.error-line":
        assert line in f.title


@pytest.mark.parametrize("line", ["eval: error rate 0.12", "errors: 0", "no error so far", "MSE error 0.2",
                                  "3 workers killed  after the epoch (by design)"])
def test_the_word_error_in_prose_is_not_a_failure(line):
    assert [f.id for f in analyze_lines(["step 1 loss 2.3", line]).findings] == ["logs.clean"]


def test_an_exception_line_followed_by_the_launchers_lines_is_kept():
    lines = ["step 1 loss 2.3", "ValueError: expected 3 channels, got 4",
             "E1204 12:00:00.123000 2815 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
             "(exitcode: 1) local_rank: 0 (pid: 2820) of binary: /usr/bin/python",
             "============================================================"]
    report = analyze_lines(lines)
    f = by_id(report)["process.exception"]
    assert f.severity == "warn" and f.data["exception"]["type"] == "ValueError"
    assert "process.exit-code" in by_id(report)

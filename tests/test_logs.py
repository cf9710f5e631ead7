"""``torchdoctor logs``: the analyzer on real DeepSpeed output, on real-looking logs of every family, and the CLI.

The fp16 loss-scale logs are produced by DeepSpeed itself (tests/fixtures/logs/drive_ds_scaler.py drives its real
loss scalers into collapse in a subprocess); the other families are short logs in tests/fixtures/logs/ written
with the exact messages of the code that prints them (see torchdoctor.logs.patterns).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import socket
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchdoctor.advice import fp16_collapse_fix
from torchdoctor.logs import analyze as A
from torchdoctor.logs import logs_run
from torchdoctor.logs.analyze import Analyzer, analyze_lines, analyze_stream, open_log
from torchdoctor.logs.reading import SNIFF_BYTES, decoder_for

FIX = Path(__file__).parent / "fixtures" / "logs"


def by_id(report) -> dict:
    out = {}
    for f in report.findings:
        assert f.id not in out, f"duplicate finding {f.id}"
        out[f.id] = f
    return out


def fixture_report(name: str):
    with open(FIX / name, "rb") as f:
        return analyze_stream(f)


def first_line_no(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.split("\n"), 1) if needle in line)


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    logs_run.add_arguments(p)
    return logs_run.run(p.parse_args(list(argv)))


# ----------------------------------------------------------------------------- DeepSpeed's real loss scalers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_logs() -> dict[str, str]:
    """Output of DeepSpeed's scalers (one subprocess, stdout+stderr as `2>&1 | tee` would keep them)."""
    proc = subprocess.run([sys.executable, str(FIX / "drive_ds_scaler.py"), str(_free_port()), "fused", "recover",
                           "collapse"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = re.split(r"^=== scenario (\w+)\n", proc.stdout, flags=re.M)
    logs = dict(zip(parts[1::2], parts[2::2]))
    assert set(logs) == {"fused", "recover", "collapse"}, proc.stdout
    return logs


def test_real_dynamic_loss_scaler_collapse_is_a_fail_with_its_history(ds_logs):
    text = ds_logs["collapse"]
    assert "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2" in text
    assert "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." in text
    report = analyze_lines(text.splitlines())
    f = by_id(report)["fp16.loss-scale-collapse"]
    assert f.severity == "fail"
    n_overflow = text.count("OVERFLOW!")
    d = f.data
    assert d["min_scale_reached"] is True
    assert d["skipped_steps"] == n_overflow == 17
    assert d["total_steps"] == 17
    assert d["first_overflow_step"] is None  # it comes before DeepSpeed's first step line
    assert d["first_overflow_line"] == first_line_no(text, "OVERFLOW!")
    hist = d["scale_history"]
    assert hist[0] == {"scale": 65536, "overflows": 2, "line": first_line_no(text, "OVERFLOW!"),
                       "step": d["first_overflow_step"]}  # the hysteresis step, then the halving
    assert [h["scale"] for h in hist] == [2**k for k in range(16, 0, -1)]
    assert d["scale_last"] == 1 and d["hysteresis_overflows"] == 1
    assert "the run stopped" in f.title
    assert f.fix[0] == fp16_collapse_fix(deepspeed=True)  # the one collapse fix: bf16 first, never "raise to 32"
    assert not any("initial_scale_power\": 32" in x for x in f.fix) and any("NumericsMonitor" in x for x in f.fix)
    events = [e["event"] for e in report.timeline]
    assert events.count("overflow") == 17 and events[-1] == "scale-min"
    assert report.timeline[-1]["line"] == first_line_no(text, "Exception: Current loss scale already at minimum")


def test_real_fused_optimizer_sitting_at_min_scale_is_a_fail(ds_logs):
    text = ds_logs["fused"]
    assert "Reducing dynamic loss scale from 1 to 1" in text
    report = analyze_stream(io.BytesIO(text.encode()))
    d = by_id(report)["fp16.loss-scale-collapse"].data
    assert d["min_scale_reached"] is True
    assert d["first_overflow_step"] == 0 and d["skipped_steps"] == 24 and d["total_steps"] == 24
    assert d["scale_history"][-1]["scale"] == 1 and d["scale_history"][-1]["overflows"] == 24 - 16


def test_real_scaler_that_recovers_is_info_and_the_log_is_clean(ds_logs):
    report = analyze_lines(ds_logs["recover"].splitlines())
    f = by_id(report)
    assert set(f) == {"fp16.overflow", "logs.clean"}
    assert f["fp16.overflow"].severity == "info" and f["logs.clean"].severity == "ok"
    d = f["fp16.overflow"].data
    assert d["skipped_steps"] == 7 and d["min_scale_reached"] is False and d["scale_increases"] >= 1


# ------------------------------------------------------------------------------------------ fixture families
def test_legacy_deepscale_collapse_from_the_guide_with_tqdm_carriage_returns():
    report = fixture_report("ds_legacy_collapse.log")
    f = by_id(report)["fp16.loss-scale-collapse"]
    assert f.severity == "fail"
    assert f.data["skipped_steps"] == 31 and f.data["planned_steps"] == 189 and f.data["total_steps"] == 31
    assert f.data["first_overflow_step"] == 0 and f.data["first_overflow_line"] == 9
    assert f.data["scale_history"][-1] == {"scale": 1, "overflows": 12, "line": 47, "step": 19}
    assert report.lines == 70


def test_hf_trainer_nan_loss_names_the_step_line_and_epoch():
    report = fixture_report("hf_trainer_nan.log")
    f = by_id(report)["loss.nonfinite"]
    assert f.severity == "fail"
    assert (f.data["first_step"], f.data["first_line"], f.data["first_epoch"]) == (50, 13, 0.2)
    assert f.data["count"] == 2 and f.data["recovered"] is False
    assert "grad.nonfinite" not in by_id(report)  # the nan grad_norm is on the nan-loss lines
    assert any("bf16" in x for x in f.fix)


@pytest.mark.parametrize("line,value", [
    ("{'loss': 'nan', 'grad_norm': 'nan', 'learning_rate': '5e-05', 'epoch': '0.1'}", "nan"),  # transformers 5
    ("{'loss': inf, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}", "inf"),
    ('{"loss": -Infinity, "epoch": 0.1}', "-Infinity"),
    (" 41%|████  | 410/1000 [01:12<01:43,  5.70it/s, loss=nan, v_num=3]", "nan"),
    ("step 12 | loss: NaN | lr 1e-4", "NaN"),
    ("train_loss = tensor(nan, device='cuda:0')", "tensor(nan"),
])
def test_nonfinite_loss_forms(line, value):
    report = analyze_lines([line])
    f = by_id(report)["loss.nonfinite"]
    assert f.severity == "fail" and value in f.evidence[0]


@pytest.mark.parametrize("line", [
    "{'loss': '2.315', 'grad_norm': '1.204', 'learning_rate': '4.95e-05', 'epoch': '0.01'}",
    "loss_scale: inf is not a loss", "Loss scale: inf", "{'eval_loss': 'info'}", "loss_type=inference",
])
def test_finite_or_unrelated_loss_text_is_clean(line):
    assert [f.id for f in analyze_lines([line]).findings] == ["logs.clean"]


def test_nan_loss_that_recovers_is_a_warning():
    report = analyze_lines(["{'loss': nan, 'epoch': 0.1}", "noise", "{'loss': 2.31, 'epoch': 0.2}"])
    f = by_id(report)["loss.nonfinite"]
    assert f.severity == "warn" and f.data["recovered"] is True


@pytest.mark.parametrize("quote", ["'", '"'])
def test_the_trainers_end_summary_is_not_a_later_finite_loss(quote):
    q = quote
    lines = [f"{{{q}loss{q}: 2.31, {q}epoch{q}: 0.1}}", f"{{{q}loss{q}: nan, {q}epoch{q}: 0.2}}",
             f"{{{q}loss{q}: nan, {q}epoch{q}: 0.3}}",
             f"{{{q}train_runtime{q}: 12.5, {q}train_samples_per_second{q}: 40.1, {q}train_loss{q}: 1.87, "
             f"{q}epoch{q}: 0.3}}"]
    f = by_id(analyze_lines(lines))["loss.nonfinite"]
    assert f.severity == "fail" and f.data["recovered"] is False
    # a per-step metric of that name (Lightning's self.log("train_loss", ...)) still counts
    f = by_id(analyze_lines([*lines[:3], "Epoch 0: 40%|████ | 4/10 [00:01<00:02, train_loss=1.87]"]))["loss.nonfinite"]
    assert f.severity == "warn" and f.data["recovered"] is True


def test_jsonl_metrics_and_lightning_bar():
    j = by_id(fixture_report("metrics_jsonl_nan.log"))
    assert j["loss.nonfinite"].data["first_step"] == 300
    assert j["grad.nonfinite"].severity == "info" and j["grad.nonfinite"].data["nonfinite_grad_norms"] == 1
    lt = by_id(fixture_report("lightning_tqdm_nan.log"))["loss.nonfinite"]
    assert (lt.data["first_step"], lt.data["first_line"]) == (410, 4)


def test_nccl_watchdog_timeout_deduplicated_and_the_abort_explained():
    report = fixture_report("nccl_timeout.log")
    f = by_id(report)
    t = f["comm.nccl-timeout"]
    assert t.severity == "fail"
    assert t.data["count"] == 1 and t.data["ranks"] == [1]  # told three times by rank 1
    x = t.data["timeouts"][0]
    assert (x["op"], x["seq"], x["timeout_ms"], x["ran_ms"], x["line"], x["step"]) == (
        "ALLREDUCE", 2417, 600000, 600047, 5, 120)
    assert any(fx.startswith("torchdoctor comm") for fx in t.fix)
    k = f["process.killed"]
    assert k.severity == "warn" and "SIGABRT" in k.title
    assert len(k.data["kills"]) == 1  # failed (exitcode) + the summary block + Signal 6: one process
    assert (k.data["kills"][0]["pid"], k.data["kills"][0]["rank"], k.data["kills"][0]["host"]) == (
        3126, 1, "gpu-node-03")


def test_nccl_error_explained_by_the_socket_warning_before_it():
    """The NCCL WARN line says why the system error happened: a network finding naming the peer, with the NCCL
    error lines as its evidence (one finding, not two)."""
    ids = by_id(fixture_report("nccl_error.log"))
    f = ids["comm.network"]
    assert f.severity == "fail" and "10.0.0.12<45117>" in f.title and "connection abort" in f.title
    assert {e["kind"] for e in f.data["nccl_errors"]} == {"NCCL error", "ncclSystemError"}
    assert f.data["nccl_errors"][0]["rank"] == 0 and f.data["events"][0]["host"] == "gpu-node-01"
    assert any("NCCL_SOCKET_IFNAME" in x for x in f.fix)
    assert "comm.nccl-error" not in ids


def test_nccl_system_error_without_a_warning_is_the_nccl_error():
    lines = [line for line in (FIX / "nccl_error.log").read_text().splitlines() if "socketStartConnect" not in line]
    f = by_id(analyze_lines(lines))["comm.nccl-error"]
    assert f.severity == "fail" and "unhandled system error" in f.title
    assert {e["kind"] for e in f.data["errors"]} == {"NCCL error", "ncclSystemError"}
    assert any("NCCL_SOCKET_IFNAME" in x for x in f.fix)


def test_cuda_oom_details_and_the_fragmentation_fix():
    f = by_id(fixture_report("cuda_oom.log"))
    o = f["memory.cuda-oom"]
    e = o.data["events"][0]
    assert (e["tried_to_allocate"], e["gpu"], e["total_capacity"], e["free"], e["reserved_unallocated"]) == (
        "3.00 GiB", 0, "79.10 GiB", "1.94 GiB", "4.66 GiB")
    assert o.data["max_cached_gb"] == 32.0
    assert any("expandable_segments:True" in x for x in o.fix) and any("torchdoctor ds memory" in x for x in o.fix)
    assert f["process.exit-code"].severity == "warn" and f["process.exit-code"].data["exits"][0]["code"] == 1


def test_deepspeed_launcher_minus_9_is_host_oom():
    f = by_id(fixture_report("ds_launcher_killed.log"))["process.killed"]
    assert f.severity == "fail" and "SIGKILL" in f.title and "OOM" in f.title and "89.2%" in f.title
    # --local_rank=3 on the launcher's command line is the rank on that node, not the global rank
    assert f.data["kills"][0]["local_rank"] == 3 and f.data["kills"][0]["rank"] is None
    assert f.title.startswith("local rank 3 ") and f.data["cpu_memory_percent_max"] == 89.2
    assert any("torchdoctor ds memory" in x for x in f.fix) and any("dmesg -T | grep -i oom" in x for x in f.fix)


def test_torchrun_sigkill_block_is_one_kill_with_host_and_rank():
    report = fixture_report("torchrun_sigkill.log")
    f = by_id(report)["process.killed"]
    assert f.severity == "fail" and f.title.startswith("rank 0 (pid 48212) on gpu-node-07 was killed by SIGKILL")
    assert len(f.data["kills"]) == 1
    assert report.event_counts == {"sigterm-sent": 1, "killed": 1, "exception": 1}  # torchrun's ChildFailedError


@pytest.mark.parametrize("line,code,signame", [
    ("torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGKILL", -9, "SIGKILL"),
    ("./train.sh: line 12: 48211 Killed                  python train.py", -9, "SIGKILL"),
    ("Killed", -9, "SIGKILL"),
    ("subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGSEGV: 11>.", -11,
     "SIGSEGV"),
    ("[2026-01-01 00:00:00,000] [ERROR] [launch.py:325:sigkill_handler] ['python'] exits with return code = 137", 137,
     "SIGKILL"),
])
def test_other_launchers_kills(line, code, signame):
    k = by_id(analyze_lines([line]))["process.killed"].data["kills"][0]
    assert (k["code"], k["signal"]) == (code, signame)


def test_dmesg_oom_killer_line_alone_is_a_host_oom_kill():
    f = by_id(analyze_lines(["[Mon Mar  2 10:15:41 2026] Out of memory: Killed process 48212 (python3) "
                             "total-vm:412345678kB, anon-rss:398765432kB"]))["process.killed"]
    assert f.severity == "fail" and f.data["host_oom"] is True


def test_build_cuda_mismatch_and_compiler_fixtures():
    m = by_id(fixture_report("build_cuda_mismatch.log"))["build.cuda-mismatch"]
    assert m.severity == "fail" and m.data["mismatches"][0]["system"] == "12.4"
    assert m.data["mismatches"][0]["torch"] == "11.8" and any("torchdoctor env" in x for x in m.fix)
    c = by_id(fixture_report("build_gcc.log"))["build.compiler"]
    assert c.severity == "fail" and "fused_adam" in c.title and "newer" in c.title
    assert any("CC=gcc-12 CXX=g++-12" in x for x in c.fix)
    assert [d["kind"] for d in c.data["errors"]] == ["gcc-too-new", "ninja", "extension"]


@pytest.mark.parametrize("line,fid,sev", [
    ("Installed CUDA version 12.1 does not match the version torch was compiled with 12.4 but since the APIs are "
     "compatible, accepting this combination", "build.cuda-mismatch", "info"),
    ("[WARNING] DeepSpeed Op Builder: Installed CUDA version 12.8 does not match the version torch was compiled with "
     "11.8.Detected `DS_SKIP_CUDA_CHECK=1`: Allowing this combination of CUDA, but it may result in unexpected "
     "behavior.", "build.cuda-mismatch", "warn"),
    ("RuntimeError: The detected CUDA version (12.6) mismatches the version that was used to compilePyTorch (11.8). "
     "Please make sure to use the same CUDA versions.", "build.cuda-mismatch", "fail"),
    ("deepspeed.ops.op_builder.builder.MissingCUDAException: CUDA_HOME does not exist, unable to compile CUDA op(s)",
     "build.cuda-home", "fail"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_90'", "build.compiler", "fail"),
    ("RuntimeError: The current installed version of g++ (13.2.0) is greater than the maximum required version by "
     "CUDA 12.1. Please make sure to use an adequate version of g++ (>=6.0.0, <13.0).", "build.compiler", "fail"),
    ("RuntimeError: Unable to JIT load the fused_adam op due to ninja not being installed.", "build.compiler", "fail"),
    ("AssertionError: bfloat16 and fp16 modes cannot be simultaneously enabled", "ds.config-error", "fail"),
])
def test_build_and_config_lines(line, fid, sev):
    assert by_id(analyze_lines([line]))[fid].severity == sev


def test_ds_batch_assertion_says_the_right_value():
    f = by_id(fixture_report("ds_config_batch.log"))["ds.config-error"]
    assert '"train_batch_size": 16' in f.fix[0]


def test_clean_run_with_one_recovered_overflow_exits_0(capsys):
    report = fixture_report("clean_run.log")
    assert {f.id: f.severity for f in report.findings} == {"fp16.overflow": "info", "logs.clean": "ok"}
    assert cli(str(FIX / "clean_run.log")) == 0
    out = capsys.readouterr().out
    assert "[OK] no failure signatures in 17 lines\n" in out and "(logs.clean)" not in out


@pytest.mark.parametrize("line,event", [
    ("[2026-01-01 00:00:00,000] [INFO] [loss_scaler.py:266:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
     "Attempted loss scale: 1024, reducing to 512", "overflow"),
    ("[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.", "overflow-unscaled"),
    ("[deepspeed] OVERFLOW! Rank 0 Skipping step.", "overflow-unscaled"),
    ("Overflow detected. Skipping step. Attempted loss scale: 4096, reducing to 2048", "overflow"),
    ("[deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: 8.0, reducing to 4.0",
     "overflow"),
    ("Grad overflow on iteration: 7", "overflow"),
    ("Increasing dynamic loss scale from 1024.0 to 2048.0", "scale-up"),
    ("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.", "scale-min"),
    ("[rank0]:[E1218 20:27:21.426 ProcessGroupNCCL.cpp:1234] [PG ID 0 PG GUID 0(default_pg) Rank 3] Heartbeat "
     "monitor timed out! Process will be terminated after dumping debug info.", "nccl-heartbeat-timeout"),
    ("RuntimeError: NCCL communicator was aborted on rank 2.", "nccl-error"),
    ("ncclInternalError: Internal check failed.", "nccl-error"),
    ("node1:1:2 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer with error 12", "nccl-warn"),
    ("RuntimeError: CUDA error: out of memory", "cuda-oom"),
    ("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=4242.0. Some of your processes may have been killed "
     "by the cgroup out-of-memory handler.", "host-oom"),
    ("slurmstepd: error: *** STEP 4242.0 ON gpu-node-01 CANCELLED AT 2026-03-02T10:00:00 DUE TO TIME LIMIT ***",
     "cancelled"),
    ("  143 | #error -- unsupported GNU version! gcc versions later than 13 are not supported!", "compiler-error"),
])
def test_each_line_family_makes_its_event(line, event):
    assert event in analyze_lines([line]).event_counts


def test_static_scale_and_bf16_overflows_are_nonfinite_gradients():
    lines = ["Grad overflow on iteration 3", "Using static loss scale of: 128.0"] + [
        "[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated."] * 3
    f = by_id(analyze_lines(lines))["grad.nonfinite"]
    assert f.severity == "warn" and f.data["static_scale_overflows"] == 1 and f.data["unscaled_overflows"] == 3
    assert '"loss_scale": 0' in f.fix[0]


def test_many_skipped_steps_without_reaching_the_minimum_is_a_warning():
    lines = [f"[Rank 0] step={n}, skipped={n // 4}, lr=[1e-05], mom=[(0.9, 0.999)]" for n in range(10, 101, 10)]
    f = by_id(analyze_lines(lines))["fp16.loss-scale-collapse"]
    assert f.severity == "warn" and f.data["skipped_steps"] == 25 and f.data["total_steps"] == 100


# ------------------------------------------------------------------------------------------- input handling
def _ansi(text: str) -> str:
    """Colour it the way rich/coloredlogs do: levels, numbers, whole lines."""
    text = re.sub(r"\[(INFO|ERROR|WARNING)\]", lambda m: f"\x1b[1;32m[{m.group(1)}]\x1b[0m", text)
    text = re.sub(r"(?<=: )(\d+)", lambda m: f"\x1b[1;36m{m.group(1)}\x1b[0m", text)
    return "\n".join(f"\x1b[31m{line}\x1b[0m" if line else line for line in text.split("\n"))


@pytest.mark.parametrize("name", ["ds_legacy_collapse.log", "nccl_timeout.log", "cuda_oom.log", "hf_trainer_nan.log"])
def test_ansi_colours_change_nothing(name):
    text = (FIX / name).read_text()
    coloured = _ansi(text)
    assert coloured.count("\x1b[") > 2 * text.count("\n")
    plain, colour = analyze_lines(text.split("\n")[:-1]), analyze_lines(coloured.split("\n")[:-1])
    assert colour.to_json() == plain.to_json()
    assert any(f.severity == "fail" for f in colour.findings)


def test_ds_prefix_and_ansi_on_the_current_overflow_line():
    line = ("\x1b[32m[2026-03-02 10:00:00,123] [INFO] [loss_scaler.py:266:update_scale]\x1b[0m [deepspeed] "
            "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: \x1b[1m2\x1b[0m, reducing to \x1b[1m1\x1b[0m")
    f = by_id(analyze_lines([line]))["fp16.loss-scale-collapse"]
    assert f.data["scale_history"] == [{"scale": 2, "overflows": 1, "line": 1, "step": None}]


def test_gzip_input_and_gzip_detected_by_content(tmp_path, capsys):
    raw = (FIX / "nccl_timeout.log").read_bytes()
    gz = tmp_path / "train.log.gz"
    gz.write_bytes(gzip.compress(raw))
    disguised = tmp_path / "train.log"
    disguised.write_bytes(gzip.compress(raw))
    assert cli(str(FIX / "nccl_timeout.log")) == 1
    plain_out = capsys.readouterr().out
    assert cli(str(gz)) == 1
    assert capsys.readouterr().out.replace(str(gz), "X") == plain_out.replace(str(FIX / "nccl_timeout.log"), "X")
    with open_log(str(disguised)) as f:
        assert by_id(analyze_stream(f))["comm.nccl-timeout"].severity == "fail"


def test_stdin(monkeypatch, capsys):
    data = (FIX / "hf_trainer_nan.log").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert cli("-", "--json") == 1
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"findings", "timeline", "lines", "timeline_dropped", "event_counts"}
    assert out["lines"] == 15 and out["findings"][0]["id"] == "loss.nonfinite"
    assert out["timeline"][0] == {"line": 13, "step": 50, "event": "loss-nonfinite", "step_from": "bar",
                                  "planned": 750,  # the step is the Trainer's progress bar's count
                                  "text": "{'loss': nan, 'grad_norm': nan, 'learning_rate': 4.95e-05, 'epoch': 0.20}"}


def test_cli_unreadable_files_exit_2_with_a_clear_message(tmp_path, capsys):
    assert cli(str(tmp_path / "missing.log")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchdoctor logs: cannot read {tmp_path / 'missing.log'}: No such file or directory")
    # a gzip file that gives no text at all cannot be read: a damaged header, or one cut inside its header (one cut
    # after some text is read up to there: tests/test_inputs_gzip.py)
    for n, blob in enumerate((gzip.compress(bytes(range(256)) * 40)[:10], b"\x1f\x8b\x08 not gzip at all")):
        bad = tmp_path / f"bad{n}.gz"
        bad.write_bytes(blob)
        assert cli(str(bad)) == 2
        assert f"cannot read {bad}: " in capsys.readouterr().err
    cut = tmp_path / "cut.gz"
    text = "".join(f"step {i} loss {i * 0.37:.4f} lr {1e-4 / (i + 1):.3e}\n" for i in range(400)).encode()
    cut.write_bytes(gzip.compress(text)[:200])  # cut after some text: read up to there, a warning
    assert cli(str(cut), "--json") == 0
    assert [f["id"] for f in json.loads(capsys.readouterr().out)["findings"]][0] == "logs.gzip-truncated"
    assert cli(str(tmp_path)) == 2  # a directory
    capsys.readouterr()
    assert cli(str(tmp_path / "missing.log"), str(FIX / "cuda_oom.log")) == 2  # the readable one is still reported
    captured = capsys.readouterr()
    assert "cannot read" in captured.err and "[FAIL] CUDA out of memory" in captured.out


def test_cli_condenses_the_timeline_and_json_for_several_files(capsys):
    assert cli(str(FIX / "ds_legacy_collapse.log")) == 1
    out = capsys.readouterr().out
    assert "... 29 more overflow (lines 11-67, steps 1-29)" in out
    assert out.count("overflow  ") == 2  # first and last of the run
    assert "[FAIL] fp16 loss scale collapsed" in out
    assert cli(str(FIX / "clean_run.log"), str(FIX / "cuda_oom.log"), "--json") == 1
    files = json.loads(capsys.readouterr().out)["files"]
    assert [x["file"] for x in files] == [str(FIX / "clean_run.log"), str(FIX / "cuda_oom.log")]
    assert files[1]["findings"][0]["id"] == "memory.cuda-oom"


def test_a_huge_line_of_carriage_returns_is_read_in_bounded_pieces():
    bars = "".join(f"\r{n * 100 // 90000:3d}%|     | {n}/90000 [00:01<00:09,  9.99it/s]" for n in range(1, 90001))
    data = (bars + "\r 100%|#| 90000/90000 [00:09<00:00,  9.99it/s, loss=nan]\n{'loss': 2.0}").encode()
    assert len(data) > 3 * A.MAX_LINE
    report = analyze_stream(io.BytesIO(data))
    f = by_id(report)["loss.nonfinite"]
    assert (f.data["first_line"], f.data["first_step"], f.data["recovered"]) == (1, 90000, True)
    assert report.lines == 2


def test_empty_log_is_reported_as_empty(tmp_path, capsys):
    p = tmp_path / "empty.log"
    p.write_bytes(b"")
    assert cli(str(p)) == 0
    assert "the log is empty (0 lines)  (logs.empty)" in capsys.readouterr().out


def test_feed_line_with_or_without_newline_and_feed_bytes_agree():
    lines = (FIX / "nccl_timeout.log").read_text().splitlines()
    a, b, c = Analyzer(), Analyzer(), Analyzer()
    for line in lines:
        a.feed_line(line)
        b.feed_line(line + "\n")
    data = (FIX / "nccl_timeout.log").read_bytes()
    for i in range(0, len(data), 7):
        c.feed_bytes(data[i:i + 7])
    ra, rb, rc = a.finish(), b.finish(), c.finish()
    assert ra.to_json() == rb.to_json() == rc.to_json()
    assert ra.lines == len(lines)


# ------------------------------------------------------------------------------------------------- fuzzing
_FRAGMENTS = [
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4, reducing to 2\n",
    "[deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1\n",
    "Grad overflow on iteration 3\n", "Reducing dynamic loss scale from 2.0 to 1.0\n",
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.\n",
    "{'loss': nan, 'grad_norm': inf, 'epoch': 0.5}\n", "{'loss': 1.5}\n", "loss=nan",
    " 12%|█▏  | 120/1000 [04:01<29:31,  2.01it/s]\r", " 13%|█▎  | 130/1000 [04:21<29:11,  2.01it/s]\n",
    "[Rank 0] step=40, skipped=3, lr=[1e-5], mom=[(0.9, 0.999)]\n",
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=600000) ran for 600001 milliseconds before timing out.\n",
    "NCCL error in: x.cpp:1, unhandled system error, NCCL version 2.1\n",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8 GiB "
    "of which 1 GiB is free.\n",
    "  exitcode  : -9 (pid: 77)\n", "  host      : n1\n", "  rank      : 2 (local_rank: 0)\n",
    "['python'] exits with return code = -9\n", "Installed CUDA version 12.1 does not match the version torch was "
    "compiled with 11.8, unable to compile\n", "ninja: build stopped: subcommand failed.\n",
    "\x1b[31m", "\x1b[0m", "\r", "\n", "\r\n", "é", "█", "\ufffd", "\x00", " ", "nan", "OVERFLOW", "exitcode",
]
_texts = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=20)), max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_texts)
def test_fuzz_feed_line_never_raises_and_counts_lines(text):
    a = Analyzer()
    for line in text.split("\n"):
        a.feed_line(line)
    report = a.finish()
    assert report.lines == len(text.split("\n"))
    assert not [f for f in report.findings if f.id == "logs.analyzer-error"]
    json.dumps(report.to_json())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(st.binary(max_size=400), _texts.map(lambda t: t.encode("utf-8", "surrogatepass"))),
       chunk=st.integers(1, 64))
def test_fuzz_analyze_stream_on_bytes_is_chunking_independent(data, chunk):
    whole = analyze_stream(io.BytesIO(data), chunk_size=1 << 20)
    pieces = analyze_stream(io.BytesIO(data), chunk_size=chunk)
    assert pieces.to_json() == whole.to_json()
    # the encoding is sniffed from the first bytes (a BOM, UTF-16 NULs, invalid UTF-8: Latin-1); lines are "\n" of
    # the decoded text
    enc, _ = decoder_for(data[:SNIFF_BYTES])
    text = data.decode(enc, "replace")
    assert whole.lines == text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    lines = Analyzer()
    for line in text.split("\n")[: -1 if text.endswith("\n") else None] if text else []:
        lines.feed_line(line)
    assert lines.finish().to_json() == whole.to_json()
    if enc == "utf-8":  # `torchdoctor run` reads a command's pipes as UTF-8, and no terminal hard-wraps a pipe
        blocks = Analyzer(wraps=False)  # as torchdoctor run feeds a pipe: whole lines a read, the unfinished one waits
        for block, partial in _blocks(data, list(range(chunk, len(data), chunk))):
            blocks.feed_block(block, partial=partial)
        assert blocks.finish().to_json() == analyze_stream(io.BytesIO(data), wraps=False).to_json()
    assert not [f for f in whole.findings if f.id == "logs.analyzer-error"]


# --------------------------------------------------------------------------------------------- bounded memory
class _Generated(io.RawIOBase):
    """A long log produced on the fly (never held whole): one event of every kind, all distinct, per 28 lines."""

    def __init__(self, n_lines: int) -> None:
        self.n, self.i, self.buf, self.size, self.overflows = n_lines, 0, b"", 0, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        while len(self.buf) < size and self.i < self.n:
            i = self.i
            rows = [
                f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {2 ** (i % 17 + 1)}, "
                f"reducing to {2 ** (i % 17)}",
                f"{{'loss': nan, 'epoch': {i}}}",
                f"[Rank {i % 997}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={i}, OpType=ALLREDUCE"
                ", NumelIn=1, NumelOut=1, Timeout(ms)=1000) ran for 1001 milliseconds before timing out.",
                f"failed (exitcode: -9) local_rank: 0 (pid: {i}) of binary: python",
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {i} MiB.",
                f"/tmp/x{i}.cu(1): error: identifier {i} is undefined",
                f"NCCL WARN net {i}",
            ] + [f" 10%|█ | {i + k}/{self.n} [00:01<00:09,  9.99it/s]" for k in range(7)] + [
                f"{{'loss': '{k}.{i}', 'grad_norm': '0.5', 'learning_rate': '1e-05', 'epoch': '{i}'}}" for k in range(7)
            ] + [f"[INFO] [config.py:1003:print]   zero_config {'.' * k} {i}" for k in range(7)]
            rows = rows[: self.n - i]
            self.overflows += 1
            self.buf += ("\n".join(rows) + "\n").encode()
            self.i += len(rows)
        out, self.buf = self.buf[:size], self.buf[size:]
        self.size += len(out)
        return out


def test_memory_stays_bounded_over_200k_lines():
    gen = _Generated(200_000)
    tracemalloc.start()
    try:
        report = analyze_stream(gen, chunk_size=1 << 18)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.lines == 200_000 and gen.size > 12_000_000
    assert len(report.timeline) == A.TIMELINE_HEAD + A.TIMELINE_TAIL and report.timeline_dropped > 40_000
    f = by_id(report)
    hist = f["fp16.loss-scale-collapse"].data
    assert len(hist["scale_history"]) == A.SCALE_RUNS_HEAD + A.SCALE_RUNS_TAIL and hist["scale_history_dropped"] > 0
    assert hist["skipped_steps"] == gen.overflows
    assert len(f["comm.nccl-timeout"].data["timeouts"]) <= A.MAX_DETAILS
    assert len(f["process.killed"].data["kills"]) <= 64
    assert len(f["memory.cuda-oom"].data["events"]) <= 16 and len(f["build.compiler"].data["errors"]) <= 16
    assert len(json.dumps(report.to_json())) < 2_000_000
    assert peak < 8_000_000, peak  # the log is 12+ MB; chunks of 256 KiB and bounded state


# ------------------------------------------------------------------------------------ review 2 (issue 5)
def test_gzip_on_stdin_is_sniffed_like_a_file(monkeypatch, capsys):
    data = (FIX / "hf_trainer_nan.log").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(gzip.compress(data))))
    assert cli("-", "--json") == 1
    out = json.loads(capsys.readouterr().out)
    assert out["lines"] == 15 and out["findings"][0]["id"] == "loss.nonfinite"
    for raw in (b"", b"x", b"\x1f", data):  # short and plain input still reads whole
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
        cli("-", "--json")
        assert json.loads(capsys.readouterr().out)["lines"] == raw.count(b"\n") + (raw[-1:] not in b"\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(gzip.compress(data)[:40])))
    assert cli("-") == 2
    assert "cannot read standard input: " in capsys.readouterr().err


def _nccl_timeout_line(rank: int, seq: int) -> str:
    return (f"[rank{rank}]:[E ProcessGroupNCCL.cpp:607] [Rank {rank}] Watchdog caught collective operation timeout: "
            f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
            f"{600000 + seq} milliseconds before timing out.")


def test_nccl_timeout_title_names_the_lowest_seqnum_numerically():
    report = analyze_lines([_nccl_timeout_line(r, s) for r, s in ((0, 104), (1, 110), (2, 116), (3, 2), (4, 20))])
    f = by_id(report)["comm.nccl-timeout"]
    assert f.title == ("NCCL collective timed out: ALLREDUCE SeqNum=2 (earliest; later SeqNum 20, 104, 110, ... timed "
                       "out too) on rank(s) 0, 1, 2, 3, 4 after 600 s"), f.title
    assert (f.data["earliest"]["seq"], f.data["earliest"]["rank"]) == (2, 3)
    # the lowest SeqNum is found even past the detail lists' cap
    many = [_nccl_timeout_line(r, 1000 + r) for r in range(A.MAX_DETAILS + 5)] + [_nccl_timeout_line(999, 7)]
    assert "SeqNum=7 (earliest" in by_id(analyze_lines(many))["comm.nccl-timeout"].title


_OVF = ("[2025-01-01 12:00:00,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "
        "step. Attempted loss scale: {}, reducing to {}")
_UP = "[2025-01-01 12:00:00,000] [INFO] [loss_scaler.py:190:update_scale] Increasing dynamic loss scale from {} to {}"
_STEP = "[2025-01-01 12:00:00,000] [INFO] [logging.py:128:log_dist] [Rank 0] step={}, skipped=16, lr=[3e-05]"


def _fall_to_one() -> list[str]:
    return [_OVF.format(2 ** k, 2 ** (k - 1)) for k in range(16, 0, -1)]


def _climb_back() -> list[str]:
    return [_UP.format(2 ** k, 2 ** (k + 1)) for k in range(16)]


def _clean_steps(first: int, n: int) -> list[str]:
    out = []
    for s in range(first, first + n, 10):
        out += [f"{{'loss': 1.234, 'grad_norm': 0.5, 'learning_rate': 3e-05, 'epoch': {s / 5000:.2f}}}",
                _STEP.format(s)]
    return out


def test_loss_scale_that_touched_1_and_recovered_is_a_warning():
    lines = _fall_to_one() + _climb_back() + _clean_steps(20, 5000)
    f = by_id(analyze_lines(lines))["fp16.loss-scale-collapse"]
    assert f.severity == "warn", f.title
    assert f.title.startswith("fp16 loss scale fell to 1 at line 16 but recovered to 65536; 16 skipped step(s)")
    assert f.data["recovered"] is True and f.data["min_scale_reached"] is True and f.data["scale_last"] == 65536
    assert any("then rose again to 65536" in e for e in f.evidence)


@pytest.mark.parametrize("tail,why", [
    ([], "stayed there to the end of the log"),  # no recovery logged: it sits at the minimum
    (_climb_back() + _fall_to_one(), "stayed there to the end of the log"),  # recovered, then collapsed again
    (_climb_back() + ["{'loss': nan, 'grad_norm': nan, 'learning_rate': 3e-05, 'epoch': 0.5}"],
     "the losses logged after it are not finite"),
    (_climb_back() + [_OVF.format(1, 1), "Current loss scale already at minimum - cannot decrease scale anymore. "
                      "Exiting run."], "the run stopped"),
])
def test_loss_scale_at_the_minimum_to_the_end_or_deepspeeds_exception_stays_a_fail(tail, why):
    f = by_id(analyze_lines(_fall_to_one() + tail))["fp16.loss-scale-collapse"]
    assert f.severity == "fail" and f.data["recovered"] is False
    assert why in f.title, f.title


def _blocks(data: bytes, cuts: list[int]) -> list[tuple[bytes, bool]]:
    """data cut like torchdoctor run cuts a pipe: whole lines per read, overlong lines in pieces."""
    from torchdoctor.run.pump import _Lines

    lines, out, at = _Lines(), [], 0
    for c in [*cuts, len(data)]:
        out += lines.feed(data[at:c])
        at = c
    return out + lines.flush()


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("*.log")))
def test_feed_block_gives_what_analyze_stream_gives(name):
    data = (FIX / name).read_bytes()
    whole = analyze_stream(io.BytesIO(data)).to_json()
    for cuts in ([], list(range(7, len(data), 97)), list(range(1, len(data), 3))):
        a = Analyzer()
        for block, partial in _blocks(data, cuts):
            a.feed_block(block, partial=partial)
        assert a.finish().to_json() == whole


def test_feed_block_streams_interleave_without_mixing_lines():
    out = b"{'loss': 2.5, 'epoch': 0.1}\n{'loss': nan, 'grad_norm': nan, 'epoch': 0.2}\n"
    err = (FIX / "torchrun_sigkill.log").read_bytes()
    a = Analyzer()
    for block, partial in _blocks(out, [9, 40]):  # stdout arrives in pieces, stderr in between
        a.feed_block(block, partial=partial)
        a.feed_block(err[:200], partial=True)
        err = err[200:]
    a.feed_block(err)
    ids = by_id(a.finish())
    assert ids["loss.nonfinite"].data["first_text"] == "{'loss': nan, 'grad_norm': nan, 'epoch': 0.2}"
    assert ids["process.killed"].severity == "fail"


def test_an_overlong_line_without_newline_is_one_line_not_an_empty_log():
    for data in (b"x" * (4 * A.MAX_LINE), b"x" * (3 * A.MAX_LINE), b"x" * (4 * A.MAX_LINE) + b"\n"):
        report = analyze_stream(io.BytesIO(data))
        assert report.lines == 1 and "logs.empty" not in by_id(report)


def test_events_inside_a_huge_junk_line_are_found_fast():
    import base64
    import random
    import time

    rng = random.Random(5)
    junk = base64.b64encode(rng.randbytes(12 << 20))  # 16 MB on one line: "SIG", "OOM", "oss" by chance
    kill = b" [ERROR] [launch.py:325:sigkill_handler] ['python', 'train.py'] exits with return code = -9 "
    data = junk[: 8 << 20] + kill + junk[8 << 20:] + b"x" * (8 << 20) + b"\n{'loss': nan}\n"
    t = time.perf_counter()
    report = analyze_stream(io.BytesIO(data))
    dt = time.perf_counter() - t
    ids = by_id(report)
    assert ids["process.killed"].data["kills"][0]["line"] == 1 and ids["loss.nonfinite"].data["first_line"] == 2
    assert report.lines == 2
    assert dt < 4.0, f"{len(data) / 1e6 / dt:.1f} MB/s"  # was 6 s+ (2.6 MB/s on base64, 18 MB/s on x's)


def _sigkill_log() -> list[str]:
    return ["loading shards", "Killed"]


@pytest.mark.parametrize("evidence,sev,cause", [
    # no evidence either way (issue 11): not blamed on the OOM killer, the other senders named
    (None, "fail", "the log does not say who sent it: it could be the kernel's OOM killer"),
    (dict(oom_killer=None, memory_low=True, evidence=["kernel log not readable"], exit_code=137), "fail",
     "likely the kernel's OOM killer: memory ran low while torchdoctor run watched"),
    (dict(oom_killer=False, memory_low=False, evidence=["kernel log (dmesg -T) has no OOM-killer entry"],
          exit_code=0), "warn", "not the kernel's OOM killer"),
    (dict(oom_killer=False, memory_low=False, evidence=[], exit_code=1), "fail", "not the kernel's OOM killer"),
    (dict(oom_killer=True, memory_low=True, evidence=["kernel (dmesg -T): Out of memory: Killed process 7"],
          exit_code=1), "fail", "the kernel's OOM killer (confirmed by the kernel log torchdoctor run read)"),
    (dict(oom_killer=None, memory_low=False, evidence=["kernel log not readable"], exit_code=137), "fail",
     "host memory never ran low while torchdoctor run watched"),
])
def test_run_evidence_decides_what_a_logged_sigkill_is_blamed_on(evidence, sev, cause):
    a = Analyzer(source="command")
    for line in _sigkill_log():
        a.feed_line(line)
    assert [k["signum"] for k in a.kills()] == [9]
    if evidence is not None:
        a.set_run_evidence(**evidence)
    f = by_id(a.finish())["process.killed"]
    assert f.severity == sev and f"(-9): {cause}" in f.title, f.title
    if evidence is not None:
        assert all(e in f.evidence for e in evidence["evidence"])
    if evidence and evidence["oom_killer"] is False:
        assert "most likely" not in f.title and "ran out" not in f.title
        assert "sacct" in f.fix[0]
    if evidence is None:  # what else sends SIGKILL, and how to tell
        assert "most likely" not in f.title and "scancel" in f.title
        assert any("sacct" in x and "TIMEOUT" in x and "PREEMPTED" in x for x in f.fix), f.fix


def test_run_evidence_from_this_host_does_not_judge_a_kill_on_another():
    lines = (FIX / "torchrun_sigkill.log").read_text().splitlines()
    a = Analyzer(source="command")
    for line in lines:
        a.feed_line(line)
    a.set_run_evidence(oom_killer=False, memory_low=False, evidence=["no OOM line here"], exit_code=1,
                       host="not-" + str(a.kills()[0]["host"]))
    f = by_id(a.finish())["process.killed"]
    assert "OOM killer" in f.title and "not the kernel's" not in f.title


def test_an_empty_command_output_is_worded_for_a_command():
    f = by_id(Analyzer(source="command").finish())["logs.empty"]
    assert f.title == "the command printed nothing (no output to analyse)"
    assert "file name" not in " ".join(f.evidence)


# ------------------------------------------------------------------------ the loss-scale trajectory (issue 10)
@pytest.fixture(scope="module")
def ds_trajectories() -> dict[str, str]:
    """DeepSpeed's real DynamicLossScaler and config print (tests/fixtures/logs/drive_ds_trajectory.py)."""
    proc = subprocess.run([sys.executable, str(FIX / "drive_ds_trajectory.py"), str(_free_port()), "startup",
                           "falling"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = re.split(r"^=== scenario (\w+)\n", proc.stdout, flags=re.M)
    logs = dict(zip(parts[1::2], parts[2::2]))
    assert set(logs) == {"startup", "falling"}, proc.stdout
    return logs


def test_real_startup_search_from_2_32_is_info_and_may_suggest_a_lower_initial_scale_power(ds_trajectories):
    text = ds_trajectories["startup"]
    assert "Attempted loss scale: 4294967296, reducing to 2147483648" in text
    f = by_id(analyze_lines(text.splitlines()))
    assert set(f) == {"fp16.overflow", "logs.clean"}
    o = f["fp16.overflow"]
    assert o.severity == "info" and o.data["startup_search"] is True and o.data["scale_increases"] == 0
    assert o.data["halvings_left"] == 26 and "search at the start" in o.title
    assert len(o.fix) == 1 and '"initial_scale_power": 26' in o.fix[0] and "only moves the starting scale" in o.fix[0]


def test_real_scale_still_falling_reads_min_loss_scale_from_deepspeeds_config_print(ds_trajectories):
    text = ds_trajectories["falling"]
    assert "min_loss_scale=4" in text and "final loss scale 16.0" in text
    report = analyze_lines(text.splitlines())
    f = by_id(report)["fp16.loss-scale-collapse"]
    assert f.severity == "warn" and f.data["min_loss_scale"] == 4 and f.data["min_loss_scale_from_log"] is True
    assert f.data["halvings_left"] == 2 and f.data["falling"] is True and f.data["scale_increases"] == 0
    assert "still falling at the end of the log" in f.title and "2 halvings left" in f.title
    assert "from the log's DeepSpeed config" in f.title
    assert f.fix[0] == fp16_collapse_fix(deepspeed=True)
    assert cli_exit_code_of(text) == 0  # a warning: the run had not died yet


def cli_exit_code_of(text: str, tmp: Path | None = None) -> int:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as fh:
        fh.write(text)
    try:
        return cli(fh.name)
    finally:
        Path(fh.name).unlink()


_DS_OVF = ("[2026-04-01 10:00:00,000] [INFO] [loss_scaler.py:266:update_scale] [deepspeed] OVERFLOW! Rank 0 "
           "Skipping step. Attempted loss scale: {}, reducing to {}")
_BAR = "  {pct}%|##        | {n}/{total} [01:00:00<09:00:00,  9.00s/it]"


def _fall(start_power: int, end_power: int, first_step: int | None, total: int = 5000) -> list[str]:
    out = []
    for i, k in enumerate(range(start_power, end_power, -1)):
        if first_step is not None:
            n = first_step + i
            out.append(_BAR.format(pct=100 * n // total, n=n, total=total))
        out.append(_DS_OVF.format(2 ** k, 2 ** (k - 1)))
    return out


@pytest.mark.parametrize("first_step,sev,fid", [
    (5, "info", "fp16.overflow"),          # a search in the first steps, ending 11 halvings above the minimum
    (900, "warn", "fp16.loss-scale-collapse"),  # the same fall at step 900 of 5000: the scale is falling
    (None, "info", "fp16.overflow"),       # no step numbers: it starts at DeepSpeed's initial 2**16
])
def test_the_same_fall_is_a_search_at_the_start_and_a_warning_mid_run(first_step, sev, fid):
    f = by_id(analyze_lines(_fall(16, 11, first_step)))[fid]
    assert f.severity == sev, f.title
    assert f.data["halvings_left"] == 11 and f.data["startup_search"] is (sev == "info")
    if sev == "warn":
        assert "(step 900 of 5000, 18% into the run)" in " ".join(f.evidence)
        assert "11 halvings left before the minimum (min_loss_scale 1: DeepSpeed's default" in f.title


def test_a_fall_from_the_initial_scale_to_near_the_minimum_is_not_a_search():
    f = by_id(analyze_lines(_fall(16, 2, 3)))["fp16.loss-scale-collapse"]
    assert f.severity == "warn" and f.data["halvings_left"] == 2 and f.data["startup_search"] is False


def test_one_isolated_halving_mid_run_is_info_and_not_called_recovered():
    f = by_id(analyze_lines([_BAR.format(pct=50, n=2500, total=5000), _DS_OVF.format(65536, 32768)]))["fp16.overflow"]
    assert f.severity == "info" and "recovered" not in f.title and "15 halvings above the minimum" in f.title


def test_no_collapse_advice_says_raise_initial_scale_power():
    """Item 4: the one fix text (advice.fp16_collapse_fix) wherever logs gives collapse advice."""
    texts = [(FIX / n).read_text() for n in sorted(p.name for p in FIX.glob("*.log"))]
    texts.append("\n".join(_fall(16, 2, 900) + ["{'loss': nan, 'grad_norm': nan, 'learning_rate': 1e-05}"]))
    for text in texts:
        for f in analyze_lines(text.split("\n")).findings:
            assert not any("raise \"initial_scale_power\"" in x or "to 32" in x for x in f.fix), (f.id, f.fix)
            if f.id in ("fp16.loss-scale-collapse", "loss.nonfinite") and "OVERFLOW" in text:
                assert f.fix[0] == fp16_collapse_fix(deepspeed=True), (f.id, f.fix)


# ------------------------------------------------------------------------------ the HF Trainer's hidden NaN
def _trainer_output(nan_inf_filter: bool) -> str:
    """What transformers' real Trainer prints when every step's loss is NaN (a GPT-2 built from a config with a
    NaN embedding row, CPU, 4 steps, logging every step)."""
    import contextlib
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16))
    with torch.no_grad():
        model.transformer.wte.weight[3] = float("nan")
    data = [{"input_ids": torch.tensor([3, 1, 2, 4]), "labels": torch.tensor([3, 1, 2, 4])} for _ in range(8)]
    buf = io.StringIO()
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(buf):
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                                 report_to=[], disable_tqdm=True, save_strategy="no", use_cpu=True,
                                 logging_nan_inf_filter=nan_inf_filter)
        Trainer(model=model, args=args, train_dataset=data).train()
    return buf.getvalue()


def test_real_trainer_hides_an_all_nan_loss_as_zero_and_logs_says_the_loss_is_nan():
    text = _trainer_output(nan_inf_filter=True)
    dicts = [line for line in text.splitlines() if line.startswith("{'loss'")]
    assert len(dicts) == 4 and all("'grad_norm': 'nan'" in d and re.search(r"'loss': '0(\.0)?'", d) for d in dicts)
    report = analyze_lines(text.splitlines())
    f = by_id(report)["loss.nonfinite"]
    assert f.severity == "fail" and f.title.startswith("the loss is NaN from epoch 0.25")
    assert f.data["hidden_by_nan_inf_filter"] == 4 and f.data["recovered"] is False
    assert any("logging_nan_inf_filter=True" in e and "logs 'loss': 0.0" in e for e in f.evidence)
    assert any("logging_nan_inf_filter=False" in x for x in f.fix)
    assert "grad.nonfinite" not in by_id(report)  # the NaN grad norms are the same NaN, told once
    shown = _trainer_output(nan_inf_filter=False)  # the filter off: the Trainer prints the NaN itself
    g = by_id(analyze_lines(shown.splitlines()))["loss.nonfinite"]
    assert g.severity == "fail" and g.data["hidden_by_nan_inf_filter"] == 0


@pytest.mark.parametrize("lines,sev", [
    # a NaN loss shown as 0.0, then finite losses again: a warning (the run went on)
    (["{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.1}",
      "{'loss': 1.25, 'grad_norm': 0.8, 'learning_rate': 1e-05, 'epoch': 0.2}"], "warn"),
    # a finite loss then 0.0 with nan norms to the end: the loss is NaN
    (["{'loss': 0.3127, 'grad_norm': nan, 'learning_rate': 2e-05, 'epoch': 1.1}",
      "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 2e-05, 'epoch': 1.2}",
      "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 2e-05, 'epoch': 1.3}"], "fail"),
])
def test_hidden_nan_loss_recovered_or_not(lines, sev):
    assert by_id(analyze_lines(lines))["loss.nonfinite"].severity == sev


def test_a_zero_loss_with_a_finite_grad_norm_is_not_a_nan():
    assert "loss.nonfinite" not in by_id(analyze_lines(
        ["{'loss': 0.0, 'grad_norm': 0.0, 'learning_rate': 1e-05, 'epoch': 3.0}"]))


def test_occasional_nan_grad_norm_with_finite_losses_is_an_info_about_skipped_fp16_steps():
    bar = "100%|##########| 5/5 [00:00<00:00, 2210.50it/s]"  # a preprocessing bar without a name, before training
    lines = [bar] + [f"{{'loss': {0.2 + i / 100:.4f}, 'grad_norm': {'nan' if i in (0, 5) else 0.5}, "
                     f"'learning_rate': 0.0001, 'epoch': {0.05 * (i + 1):.2f}}}" for i in range(10)]
    report = analyze_lines(lines)
    f = by_id(report)
    assert f["grad.nonfinite"].severity == "info" and "steps the GradScaler skipped" in " ".join(
        f["grad.nonfinite"].evidence)
    assert f["logs.clean"].data["last_step"] is None  # 5/5 was not the training loop
    assert all(e["step"] is None for e in report.timeline)
    stuck = lines[:8] + [ln.replace("0.5,", "nan,") for ln in lines[8:]]  # nan from there on: not occasional
    assert by_id(analyze_lines(stuck))["grad.nonfinite"].severity == "warn"
    # every logged step nan for HF_DEAD_LOGS logs up to the end: the model is not training
    dead = lines[:4] + [ln.replace("0.5,", "nan,") for ln in lines[4:]]
    f = by_id(analyze_lines(dead))["grad.nonfinite"]
    assert f.severity == "fail" and "the last 7 logged grad norms are all non-finite" in " ".join(f.evidence)


# ---------------------------------------------------------------- messages over lines, cut lines, other trainers
def _torch_mismatch_message() -> str:
    from torch.utils.cpp_extension import CUDA_MISMATCH_MESSAGE

    return CUDA_MISMATCH_MESSAGE % ("11.7", "12.1")


def test_torchs_cuda_mismatch_message_printed_over_two_lines_is_joined():
    msg = _torch_mismatch_message()  # torch's own text; printed by pip/setuptools wrapped and indented
    cut = msg.index("compile") + len("compile")
    lines = ["RuntimeError:", "      " + msg[:cut], "      " + msg[cut:]]
    f = by_id(analyze_lines(lines))["build.cuda-mismatch"]
    assert f.severity == "fail" and f.title.startswith("CUDA toolkit 11.7 does not match torch's CUDA 12.1")
    assert f.data["mismatches"][0]["line"] == 2
    a = Analyzer()  # the second line in the next block (torchdoctor run reads a pipe in pieces)
    a.feed_block("\n".join(lines[:2]) + "\n")
    a.feed_block(lines[2] + "\n")
    assert by_id(a.finish())["build.cuda-mismatch"].title == f.title
    head_only = by_id(analyze_lines(lines[:2]))["build.cuda-mismatch"]  # the log ends after the first line
    assert head_only.severity == "fail" and "CUDA toolkit 11.7 does not match" in head_only.title


def test_torch_2_prints_the_mismatch_as_a_tuple():
    from torch.utils.cpp_extension import CUDA_MISMATCH_MESSAGE

    line = f"RuntimeError: {RuntimeError(CUDA_MISMATCH_MESSAGE, '11.8', '12.6')}"  # raise RuntimeError(fmt, a, b)
    f = by_id(analyze_lines([line]))["build.cuda-mismatch"]
    assert f.title.startswith("CUDA toolkit 11.8 does not match torch's CUDA 12.6")


def test_a_cut_mismatch_message_is_known_by_its_traceback_raise_line():
    lines = ['  File "/env/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 412, in '
             "_check_cuda_version",
             "    raise RuntimeError(CUDA_MISMATCH_MESSAGE.format(cuda_str_version, torch.version.cuda))",
             "RuntimeError:", "The detected CU"]
    f = by_id(analyze_lines(lines))["build.cuda-mismatch"]
    assert f.severity == "fail" and "versions are cut from the log" in f.title
    assert not any("None" in x for x in [f.title, *f.fix])


def test_a_cut_min_scale_exception_is_known_by_deepspeeds_update_scale_frame():
    frame = ('  File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/fp16/loss_scaler.py", line 201, in '
             "update_scale")
    cut = ["    raise Exception(", "Exception: Current loss sc"]
    f = by_id(analyze_lines([frame, *cut]))["fp16.loss-scale-collapse"]
    assert f.severity == "fail" and "the run stopped" in f.title
    assert "fp16.loss-scale-collapse" not in by_id(analyze_lines(cut))  # no DeepSpeed frame: not enough to tell
    longer = by_id(analyze_lines(["Exception: Current loss scale already at minimum - cannot dec"]))
    assert longer["fp16.loss-scale-collapse"].severity == "fail"


def test_a_killed_compiler_says_fewer_build_jobs():
    for line in ["x86_64-linux-gnu-g++: fatal error: Killed signal terminated program cc1plus",
                 "nvcc error   : 'cicc' died due to signal 9 (Kill signal)"]:
        f = by_id(analyze_lines([line, "compilation terminated."]))["build.compiler"]
        assert f.severity == "fail" and "compiler was killed" in f.title
        assert "MAX_JOBS=" in f.fix[0] and "OOM" in f.fix[1]


_MEGATRON = (" iteration {it:8d}/ {total:8d} | consumed samples: {s:12d} | elapsed time per iteration (ms): 3051.2 "
             "| learning rate: 1.500E-04 | global batch size:    16 |{loss} loss scale: {scale} | grad norm: {norm} | "
             "number of skipped iterations:   0 | number of nan iterations:   0 |")


def test_megatron_iteration_lines_at_loss_scale_1_with_nan_grad_norm_are_the_collapsed_scale():
    lines = [_MEGATRON.format(it=i, total=100000, s=16 * i, loss="", scale="1.0", norm="nan") for i in (812, 813, 814)]
    report = analyze_lines(lines)
    f = by_id(report)["fp16.loss-scale-collapse"]
    assert f.severity == "fail" and "at its minimum (1)" in f.title and f.data["min_scale_first_step"] == 812
    assert f.data["planned_steps"] == 100000 and not any("skipped step" in e for e in f.evidence)
    healthy = [_MEGATRON.format(it=i, total=100000, s=16 * i, loss=" lm loss: 2.311E+00 |", scale="65536.0",
                                norm="0.912") for i in range(10, 13)]
    f = by_id(analyze_lines(healthy))
    assert set(f) == {"logs.clean"} and f["logs.clean"].data["last_step"] == 12


def test_a_custom_trainer_with_nan_loss_and_a_gradscaler_scale_of_0():
    lines = ["Training: 2026-05-02 08:00:01,100-Speed 1890.22 samples/sec   Loss nan   LearningRate 0.100000   "
             f"Epoch: 1   Global Step: {n}   Fp16 Grad Scale: 0   Required: 50 hours" for n in (100, 150)]
    f = by_id(analyze_lines(lines))
    assert f["loss.nonfinite"].severity == "fail" and f["loss.nonfinite"].data["first_step"] == 100
    c = f["fp16.loss-scale-collapse"]
    assert c.severity == "fail" and "scale is 0" in c.title and c.fix[0] == fp16_collapse_fix(deepspeed=False)


def test_torchruns_local_rank_is_not_called_the_rank():
    line = ("E0101 10:00:00.000000 140000 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -9) "
            "local_rank: 3 (pid: 51234) of binary: /usr/bin/python3")
    f = by_id(analyze_lines([line]))["process.killed"]
    assert f.title.startswith("local rank 3 (pid 51234) was killed by SIGKILL")
    assert f.data["kills"][0]["local_rank"] == 3 and f.data["kills"][0]["rank"] is None

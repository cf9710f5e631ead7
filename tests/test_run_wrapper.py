"""``torchdoctor run``: real child processes, real /proc sampling, real signals.

Most tests drive ``command.run(args)`` in this process and read fd 1/2 with ``capfdbinary`` (the command's
bytes go to the file descriptors, torchdoctor's text to ``sys.stderr``); the signal tests start the wrapper
as its own process so a signal can be sent to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchdoctor.run import command, process, supervisor

pytestmark = pytest.mark.machine  # real runs read this machine's memory, cgroup and kernel log

PY = sys.executable
MIB = 1 << 20
WRAPPER = [PY, "-c", "import sys; from torchdoctor.run.command import main; sys.exit(main())"]
FIX = Path(__file__).parent / "fixtures" / "logs"


def memory_word() -> str:
    """What run measures memory against on this machine: its cgroup's limit where one below MemTotal is readable."""
    from torchdoctor import _system

    limit, _ = _system.cgroup_memory()
    total = _system.read_meminfo().get("MemTotal")
    return "cgroup limit" if limit is not None and (total is None or limit < total) else "RAM"


def run_wrapper(capfdbinary, *argv: str) -> tuple[int, bytes, str]:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    rc = command.run(parser.parse_args(list(argv)))
    cap = capfdbinary.readouterr()
    return rc, cap.out, cap.err.decode("utf-8", "replace")


def report(path: Path) -> dict:
    return json.loads(path.read_text())


def exit_finding(rep: dict) -> dict:
    [f] = [f for f in rep["findings"] if f["id"] == "process.exit"]
    return f


def sampled_peak(rep: dict) -> float:
    """Peak of the sampled tree RSS in bytes (not the kernel's ru_maxrss: this checks the sampler)."""
    return max(s["rss_gib"] for s in rep["memory"]) * (1 << 30)


# ------------------------------------------------------------------------------------- pass-through

CHATTY = r"""
import sys, time
out = sys.stdout.buffer
out.write(b"line one\n"); out.write(b"caf\xc3\xa9 \xff\xfe not utf-8\n")
out.write(b"\r 10%|#         |\r 50%|#####     |\r100%|##########|\n")
out.write(b"".join(b"%05d " % i for i in range(20000)))  # 120 kB in several pipe chunks
out.write(b"no newline at the end"); out.flush()
time.sleep(0.2)
sys.stderr.buffer.write(b"warning on stderr\n"); sys.stderr.flush()
"""
CHATTY_OUT = (b"line one\ncaf\xc3\xa9 \xff\xfe not utf-8\n\r 10%|#         |\r 50%|#####     |\r100%|##########|\n"
              + b"".join(b"%05d " % i for i in range(20000)) + b"no newline at the end")


def test_output_passes_through_byte_for_byte_and_is_logged(capfdbinary, tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"earlier run\n")  # --log appends
    rc, out, err = run_wrapper(capfdbinary, "--log", str(log), "--", PY, "-c", CHATTY)
    assert rc == 0
    assert out == CHATTY_OUT  # stdout untouched: nothing of torchdoctor's own goes there
    assert err.startswith("warning on stderr\n")
    assert log.read_bytes() == b"earlier run\n" + CHATTY_OUT + b"warning on stderr\n"
    assert re.search(rf"\[OK\] exited 0 after \d+\.\d s \(peak RSS \d+ MiB of [\d.]+ GiB {memory_word()}", err), err


def test_exit_code_is_propagated(capfdbinary, tmp_path):
    rc, out, err = run_wrapper(capfdbinary, "--json", str(tmp_path / "r.json"), "--",
                               PY, "-c", "import sys; print('bye'); sys.exit(3)")
    assert rc == 3
    assert out == b"bye\n"
    assert "[WARN] exited with code 3 after" in err
    rep = report(tmp_path / "r.json")
    assert (rep["exit_code"], rep["signal"]) == (3, None)
    assert exit_finding(rep)["severity"] == "warn"


def test_json_dash_goes_to_stdout_after_the_commands_output(capfdbinary):
    rc, out, err = run_wrapper(capfdbinary, "--json", "-", PY, "-c", "print('data line')")
    assert rc == 0
    assert out.startswith(b"data line\n")
    rep = json.loads(out[len(b"data line\n"):])
    assert set(rep) >= {"exit_code", "signal", "peak_rss_gib", "min_available_gib", "duration_s", "findings",
                        "timeline", "memory"}
    assert rep["exit_code"] == 0 and exit_finding(rep)["severity"] == "ok"
    assert rep["peak_rss_gib"] < 0.1  # a `print` child, not our own (pytest's) RSS inherited through fork
    assert 0 < rep["min_available_gib"] <= rep["mem_total_gib"]
    assert "\ndata line\n" not in "\n" + err  # the command's output is not copied to stderr


# ------------------------------------------------------------------------------------------ memory

HOLD_300MB = "import time; b = bytearray(b'x') * (300 * 1024 * 1024); time.sleep(0.6)"


def test_peak_rss_of_a_300mb_child_is_measured(capfdbinary, tmp_path):
    rc, _, err = run_wrapper(capfdbinary, "--interval", "0.1", "--json", str(tmp_path / "r.json"), "--",
                             PY, "-c", HOLD_300MB)
    assert rc == 0
    rep = report(tmp_path / "r.json")
    assert sampled_peak(rep) >= 300e6
    assert rep["peak_rss_gib"] * (1 << 30) >= 300e6
    assert rep["peak_rss_at_s"] is not None and 0 < rep["peak_rss_at_s"] < rep["duration_s"]


def test_grandchild_memory_is_counted_in_the_tree(capfdbinary, tmp_path):
    # child and grandchild hold ~210 MiB each at the same time: only their sum reaches 400 MiB
    child = (
        "import subprocess, sys; a = bytearray(b'x') * (200 * 1024 * 1024); "
        "subprocess.run([sys.executable, '-c', "
        "\"import time; b = bytearray(b'y') * (200 * 1024 * 1024); time.sleep(1.0)\"], check=True)"
    )
    rc, _, err = run_wrapper(capfdbinary, "--interval", "0.1", "--json", str(tmp_path / "r.json"), "--",
                             PY, "-c", child)
    assert rc == 0
    rep = report(tmp_path / "r.json")
    assert sampled_peak(rep) >= 400 * MIB, rep["memory"]
    assert "(2 processes;" in " ".join(exit_finding(rep)["evidence"])


def test_sigkill_after_allocating_is_explained(capfdbinary, tmp_path):
    child = ("import os, time; b = bytearray(b'x') * (300 * 1024 * 1024); print('loaded', flush=True); "
             "time.sleep(0.5); os.kill(os.getpid(), 9)")
    rc, out, err = run_wrapper(capfdbinary, "--interval", "0.1", "--json", str(tmp_path / "r.json"), "--",
                               PY, "-c", child)
    assert rc == 137
    assert out == b"loaded\n"
    rep = report(tmp_path / "r.json")
    assert (rep["exit_code"], rep["signal"]) == (137, "SIGKILL")
    f = exit_finding(rep)
    assert f["severity"] == "fail"
    # measured against the memory this machine lets run see: its cgroup's limit when readable and lower
    cg = rep["cgroup_limit_gib"]
    what = "cgroup limit" if cg is not None and cg < rep["mem_total_gib"] else "RAM"
    m = re.match(rf"killed by SIGKILL after \d+\.\d s: peak RSS (\d+) MiB of [\d.]+ GiB {what} \(\d+%\)", f["title"])
    assert m, f["title"]
    assert int(m.group(1)) * MIB >= 300e6
    evidence = " ".join(f["evidence"])
    # the kernel log was read (this self-kill left no OOM line) or we say it could not be
    assert "has no OOM-killer entry" in evidence or "kernel log not readable" in evidence
    fixes = " ".join(f["fix"])
    ruled_out = "has no OOM-killer entry" in evidence  # a readable kernel log rules the OOM killer out ...
    for remedy in ('"nvme"', "zero.Init", "--nproc_per_node", "torchdoctor ds memory"):
        assert (remedy in fixes) != ruled_out, fixes  # ... and the memory cures with it
    assert ("scancel" in fixes) == ruled_out or "kill -9" in fixes
    assert f"[FAIL] {f['title']}" in err


def _memory_cgroup(tmp_name: str, limit: int) -> Path | None:
    """A child memory cgroup of ours with ``limit`` bytes (v1 or v2), or None where we may not make one."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limit_file = Path(f"/sys/fs/cgroup/{controllers}{path}"), "memory.limit_in_bytes"
            break
    else:
        base, limit_file = Path("/sys/fs/cgroup" + Path("/proc/self/cgroup").read_text().split("::", 1)[-1].strip()), \
            "memory.max"
    cg = base / tmp_name
    try:
        cg.mkdir()
        (cg / limit_file).write_text(str(limit))
    except OSError:
        if cg.exists():
            cg.rmdir()
        return None
    return cg


def test_real_oom_kill_in_a_memory_cgroup_is_named(capfdbinary, tmp_path):
    cg = _memory_cgroup(f"torchdoctor-test-{os.getpid()}", 100 * MIB)
    if cg is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a writable cgroup tree)")
    try:
        child = (f"import os, time; open({str(cg / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                 "b = bytearray(b'x') * (300 * 1024 * 1024); time.sleep(1)")
        rc, _, err = run_wrapper(capfdbinary, "--interval", "0.1", "--json", str(tmp_path / "r.json"), "--",
                                 PY, "-c", child)
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert rc == 137
    rep = report(tmp_path / "r.json")
    f = exit_finding(rep)
    evidence = " ".join(f["evidence"])
    # what confirms the OOM kill is what this machine lets run read: the kernel log, else the cgroup's counter
    if "kernel log not readable" in evidence:
        if "oom_kill counter rose" in evidence:
            assert f["title"].startswith("killed by the kernel's OOM killer (SIGKILL)"), f["title"]
        else:  # nothing confirms it, and the samples (every 0.1 s) missed a spike that lasted less
            assert "OOM killer (SIGKILL)" not in f["title"] and "confirmed" not in f["title"], f["title"]
            if "cgroup's limit could not be read" in evidence:  # nor is "memory never ran low" known
                assert "nothing here tells them apart" in f["title"], f["title"]
            elif rep["min_available_gib"] > 0.2 * rep["mem_total_gib"]:
                assert "a spike shorter than 0.1 s, or something else sent SIGKILL" in evidence
        return
    assert f["title"].startswith("killed by the kernel's OOM killer (SIGKILL)"), f["title"]
    assert "cgroup limit" in f["title"] or "its cgroup's limit could not be read" in f["title"], f["title"]
    assert re.search(rf"Killed process {f['data']['pid']}\b|pid={f['data']['pid']}\b", evidence), evidence
    assert "CONSTRAINT_MEMCG" in evidence and "Raise the job's memory limit" in f["fix"][0]


# -------------------------------------------------------------------------------- findings, no I/O


def _result(**kw) -> supervisor.RunResult:
    base = dict(argv=["deepspeed", "train.py"], pid=4242, exit_code=137, signal=9, duration_s=12.34,
                peak_rss=int(21.4 * (1 << 30)), peak_rss_t=12.0, peak_rss_procs=9, child_maxrss=0,
                mem_total=int(23.5 * (1 << 30)), min_available=200 * MIB, min_available_t=12.1, cgroup_limit=None,
                cgroup_oom_kills=None, pids_seen={4242, 4250}, forwarded=[], killed_by_us=False, interval=0.5,
                samples=[], log_findings=[], timeline=[])
    base.update(kw)
    return supervisor.RunResult(**base)


def test_a_cgroup_limit_that_cannot_be_read_leaves_never_low_unknown():
    """Plenty of MemAvailable says nothing when the process's cgroup limit could not be read: a container's limit
    may be far below the machine's RAM. With no kernel log either, nothing tells the senders apart."""
    unread = supervisor.KernelLog(False, "kernel log not readable (dmesg -T, /dev/kmsg and journalctl -k ...)")
    plenty = dict(peak_rss=390 * MIB, min_available=22 * (1 << 30), kernel=unread)
    f = supervisor.exit_finding(_result(**plenty, cgroup_readable=False))
    assert "nothing here tells them apart" in f.title and "likelier" not in f.title, f.title
    assert any("its memory cgroup's limit could not be read" in e for e in f.evidence), f.evidence
    assert any("torchdoctor ds memory" in x for x in f.fix)  # memory stays a suspect
    f = supervisor.exit_finding(_result(**plenty))  # the same samples where the limit was read (no limit): not low
    assert "memory never ran low in the samples" in f.title, f.title


def test_a_kill_the_kernel_log_rules_out_gets_no_memory_cures():
    read = supervisor.KernelLog(True, "dmesg -T")
    f = supervisor.exit_finding(_result(peak_rss=2 * MIB, min_available=22 * (1 << 30), kernel=read))
    assert "no OOM-killer entry in the kernel log" in f.title
    assert len(f.fix) == 1 and "scancel" in f.fix[0] and "PREEMPTED" in f.fix[0], f.fix
    memcg = supervisor.KernelLog(True, "dmesg -T", ["Memory cgroup out of memory: Killed process 4242 (python)"],
                           memcg="/job_7", memcg_limit=None)  # the kernel names the cgroup; its limit unreadable
    f = supervisor.exit_finding(_result(kernel=memcg))
    assert f.title.startswith("killed by the kernel's OOM killer") and "(its cgroup's limit could not be read)" in \
        f.title and "GiB RAM" not in f.title, f.title


def test_sigkill_title_when_the_kernel_log_is_not_readable():
    r = _result(kernel=supervisor.KernelLog(False,
                                            "kernel log not readable (dmesg -T, /dev/kmsg and journalctl -k ...)"))
    f = supervisor.exit_finding(r)
    assert f.severity == "fail"
    # the samples saw memory run low (91% of RAM): evidence enough for "likely", not for "confirmed" (issue 11)
    assert f.title == ("killed by SIGKILL after 12.3 s: peak RSS 21.4 GiB of 23.5 GiB RAM (91%) -- memory ran low, "
                       "so likely the kernel's OOM killer (no kernel-log line for its processes confirms it)")
    assert any(e.startswith("kernel log not readable") for e in f.evidence)
    assert supervisor.memory_finding(r) is None  # process.exit already says it


def test_global_oom_line_is_matched_to_our_pids():
    log = (
        "[Sun Nov 29 10:00:00 2026] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,"
        "global_oom,task_memcg=/user.slice,task=python,pid=4250,uid=1000\n"
        "[Sun Nov 29 10:00:00 2026] Out of memory: Killed process 4250 (python) total-vm:30000000kB, "
        "anon-rss:20000000kB\n"
        "[Sun Nov 29 10:00:01 2026] Out of memory: Killed process 999 (other) total-vm:1kB\n"
    )
    lines, memcg = supervisor.parse_oom_lines(log, {4242, 4250})
    assert len(lines) == 2 and all("4250" in ln for ln in lines) and memcg is None
    r = _result(exit_code=1, signal=None, kernel=supervisor.KernelLog(True, "dmesg -T", lines))
    f = supervisor.exit_finding(r)  # torchrun exits 1 when a worker was OOM-killed
    assert f.severity == "fail" and "OOM killer killed a process of it" in f.title
    assert any("Killed process 4250" in e for e in f.evidence)


def test_low_memavailable_is_a_warning_even_when_the_command_succeeds():
    r = _result(exit_code=0, signal=None)
    assert supervisor.exit_finding(r).severity == "ok"
    m = supervisor.memory_finding(r)
    assert m is not None and m.severity == "warn" and "MemAvailable fell to 200 MiB of 23.5 GiB" in m.title
    assert supervisor.memory_finding(_result(exit_code=0, signal=None, min_available=10 << 30)) is None


# ------------------------------------------------------------------------------------ log findings

TRAINING_LOG = r"""
import sys, time
print("[2026-03-02 10:00:00,123] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 "
      "Skipping step. Attempted loss scale: 65536, reducing to 32768")
sys.stderr.write("\r  5%|5         | 5/100 [00:01<00:19, loss=2.3]"); sys.stderr.flush(); time.sleep(0.1)
sys.stderr.write("\r 10%|#         | 10/100 [00:02<00:18, loss=nan]\n"); sys.stderr.flush()
print("{'loss': nan, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.1}")
sys.exit(1)
"""


def test_log_findings_of_the_command_are_reported(capfdbinary, tmp_path):
    rc, out, err = run_wrapper(capfdbinary, "--json", str(tmp_path / "r.json"), "--", PY, "-c", TRAINING_LOG)
    assert rc == 1
    assert b"OVERFLOW! Rank 0" in out
    rep = report(tmp_path / "r.json")
    ids = {f["id"]: f for f in rep["findings"]}
    assert "logs.analyzer-error" not in ids
    assert ids["fp16.overflow"]["severity"] in ("info", "warn", "fail")
    assert ids["loss.nonfinite"]["severity"] == "fail"
    assert ids["process.exit"]["severity"] == "warn"
    events = [e["event"] for e in rep["timeline"]]
    assert "overflow" in events and "loss-nonfinite" in events
    assert "(loss.nonfinite)" in err and "(fp16.overflow)" in err


# ------------------------------------------------------------------------------------- bad input


def test_command_not_found_is_127_and_leaves_no_report_folder(capfdbinary, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHDOCTOR_REPORT_DIR", raising=False)
    rc, out, err = run_wrapper(capfdbinary, "--", "no-such-command-torchdoctor-xyz", "arg")
    assert rc == 127
    assert "no-such-command-torchdoctor-xyz: command not found" in err
    assert "Traceback" not in err and out == b""
    assert os.listdir(tmp_path) == []  # the folder is made only for a report (issue 36)


def test_a_report_folder_removed_as_empty_is_said_removed_where_a_finding_names_it(capfdbinary, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHDOCTOR_REPORT_DIR", raising=False)
    rc, _, _ = run_wrapper(capfdbinary, "--numerics", "--json", str(tmp_path / "r.json"), "--", "true")
    assert rc == 0 and os.listdir(tmp_path) == ["r.json"]
    [f] = [f for f in report(tmp_path / "r.json")["findings"] if f["id"] == "numerics.not-attached"]
    [line] = [e for e in f["evidence"] if "torchdoctor-reports" in e]
    assert line.endswith("(removed again: nothing was written to it)")


def test_not_executable_is_126(capfdbinary, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")
    rc, _, err = run_wrapper(capfdbinary, "--", str(script))
    assert rc == 126 and "permission denied" in err


@pytest.mark.parametrize("argv", [[], ["--"], ["--log", "x.log"]])
def test_no_command_is_usage_error(capfdbinary, argv):
    rc, _, err = run_wrapper(capfdbinary, *argv)
    assert rc == 2
    assert "no command given" in err and "usage: torchdoctor run" in err


def test_unwritable_log_is_usage_error_and_the_command_does_not_run(capfdbinary, tmp_path):
    marker = tmp_path / "ran"
    rc, _, err = run_wrapper(capfdbinary, "--log", str(tmp_path / "missing-dir" / "x.log"), "--",
                             PY, "-c", f"open({str(marker)!r}, 'w')")
    assert rc == 2
    assert "cannot write --log" in err and "Traceback" not in err
    assert not marker.exists()


def test_json_given_a_program_name_is_refused(capfdbinary):
    # `run --json python train.py` would otherwise write the report to a file named "python"
    rc, _, err = run_wrapper(capfdbinary, "--json", "python3", "train.py")
    assert rc == 2 and "--json takes a FILE" in err


def test_bad_interval_is_an_argparse_error():
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--interval", "0", "--", "true"])
    assert e.value.code == 2


# ------------------------------------------------------------------------------- signals, chunks


def _read_until(fd: int, needles: list[bytes], timeout: float = 10.0) -> bytes:
    buf, deadline = b"", time.monotonic() + timeout
    while not all(n in buf for n in needles):
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {needles} in {buf!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"EOF before {needles} in {buf!r}"
            buf += chunk
    return buf


SIGTERM_CHILD = r"""
import signal, subprocess, sys, time
gc = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\n"
    "def h(s, f):\n    print('grandchild got', s, flush=True); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, h)\nprint('grandchild ready', flush=True)\ntime.sleep(30)"])
def h(s, f):
    gc.wait(); print("child got", s, flush=True); sys.exit(5)
signal.signal(signal.SIGTERM, h)
sys.stdout.write("\r 10%|#         | progress"); sys.stdout.flush()
time.sleep(30)
"""


def test_sigterm_is_forwarded_to_the_whole_tree_and_chunks_are_not_held_back():
    p = subprocess.Popen([*WRAPPER, "--interval", "0.1", "--", PY, "-c", SIGTERM_CHILD],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # a progress-bar chunk without a newline arrives while the child still runs
        _read_until(p.stdout.fileno(), [b"\r 10%|#         | progress", b"grandchild ready\n"])
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 5, err
    assert b"grandchild got 15" in out and b"child got 15" in out
    assert "forwarded SIGTERM" in err and "Traceback" not in err
    assert "exited with code 5" in err and "after torchdoctor forwarded SIGTERM" in err


def test_ctrl_c_reaches_the_command_and_the_exit_code_says_sigint():
    p = subprocess.Popen([*WRAPPER, "--", PY, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _read_until(p.stdout.fileno(), [b"ready\n"])
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 130, err  # 128 + SIGINT: the wrapper itself was not interrupted
    assert "KeyboardInterrupt" in err  # the child's own traceback
    assert "[INFO] ended by SIGINT after" in err and "(forwarded by torchdoctor)" in err


def test_a_big_parent_does_not_inflate_a_small_childs_peak():
    """A forked child's ru_maxrss starts at the parent's high-water RSS: a `print` child must not inherit it."""
    from torchdoctor.run.supervisor import run_command

    big = bytearray(400 << 20)
    for i in range(0, len(big), 4096):
        big[i] = 1
    del big
    r = run_command([sys.executable, "-c", "print(1)"], out_fd=os.open(os.devnull, os.O_WRONLY))
    assert r.child_maxrss > 300 << 20  # the kernel's figure did inherit our peak ...
    assert r.peak_rss < 100 << 20  # ... and it was not taken for the command's


# ------------------------------------------------------------------------------ review 2 (issue 5)

# a launcher whose worker is SIGKILLed and which then exits by itself (torchrun's line names the worker's pid)
LAUNCHER = r"""
import subprocess, sys
w = subprocess.Popen([sys.executable, "-c", "import os; print('worker up', flush=True); os.kill(os.getpid(), 9)"])
w.wait()
print(f"E0211 08:28:46.512000 3110 api.py:874] failed (exitcode: {w.returncode}) local_rank: 0 (pid: {w.pid}) of "
      "binary: python", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]))
"""


def _fake_kernel(monkeypatch, oom_for_logged_pid: bool) -> list[set[int]]:
    calls: list[set[int]] = []

    def fake(pids: set[int], since: float | None = None) -> supervisor.KernelLog:
        calls.append(set(pids))
        lines = [f"Out of memory: Killed process {p} (python) total-vm:1kB" for p in pids if p not in seen[0]]
        return supervisor.KernelLog(True, "dmesg -T", lines if oom_for_logged_pid else [])

    seen: list[set[int]] = [set()]
    orig = process.Memory.sample

    def sample(self, now):  # remember what the sampler saw: the worker's pid comes only from the log
        orig(self, now)
        seen[0] = set(self.pids_seen)

    monkeypatch.setattr(supervisor, "read_kernel_oom", fake)
    monkeypatch.setattr(process.Memory, "sample", sample)
    return calls


@pytest.mark.parametrize("code", [0, 1])
def test_a_sigkilled_worker_without_an_oom_line_is_not_blamed_on_the_oom_killer(capfdbinary, tmp_path, monkeypatch,
                                                                               code):
    calls = _fake_kernel(monkeypatch, oom_for_logged_pid=False)
    rc, _, err = run_wrapper(capfdbinary, "--json", str(tmp_path / "r.json"), "--", PY, "-c", LAUNCHER, str(code))
    assert rc == code
    assert len(calls) == 1  # the kernel log is read for the worker's SIGKILL, whatever the command's exit status
    rep = report(tmp_path / "r.json")
    [k] = [f for f in rep["findings"] if f["id"] == "process.killed"]
    assert k["severity"] == ("warn" if code == 0 else "fail")
    assert "(-9): not the kernel's OOM killer" in k["title"] and "most likely" not in k["title"]
    ev = " ".join(k["evidence"])
    assert "torchdoctor run: kernel log (dmesg -T) has no OOM-killer entry" in ev and "MemAvailable never fell" in ev
    assert "sacct" in k["fix"][0]
    assert k["data"]["kills"][0]["pid"] in calls[0]  # the log's pid was looked up too


@pytest.mark.parametrize("code,sev", [(0, "warn"), (1, "fail")])
def test_a_sigkilled_worker_with_an_oom_line_is_confirmed(capfdbinary, tmp_path, monkeypatch, code, sev):
    _fake_kernel(monkeypatch, oom_for_logged_pid=True)
    rc, _, err = run_wrapper(capfdbinary, "--json", str(tmp_path / "r.json"), "--", PY, "-c", LAUNCHER, str(code))
    rep = report(tmp_path / "r.json")
    [k] = [f for f in rep["findings"] if f["id"] == "process.killed"]
    assert k["severity"] == "fail" and "confirmed by the kernel log torchdoctor run read" in k["title"]
    f = exit_finding(rep)
    assert f["severity"] == sev and "the kernel's OOM killer killed a process of it" in f["title"]


def test_the_reviewers_grandchild_kill_is_not_called_an_oom_kill(capfdbinary):
    rc, out, err = run_wrapper(capfdbinary, "--", "sh", "-c", 'sh -c "kill -9 \\$\\$"; echo x')
    assert rc == 0 and out == b"x\n"
    if "(process.killed)" in err:  # the shell said "Killed" (dash, bash): judged with what run saw itself
        assert "most likely" not in err and "confirmed" not in err
        # the kernel log may not rule the OOM killer out: it could not be read, or the kernel killed some other
        # process while this ran (a shared machine) that may have been one of the command's
        open_log = "kernel log not readable" in err or "newer processes it did not see" in err
        if open_log and "cgroup's limit could not be read" in err:  # nor is "memory never ran low" known
            assert "the log does not say who sent it" in err
            return
        if open_log:
            assert "is likelier than the OOM killer" in err and "host memory never ran low" in err
            return
        assert "host RAM ran out" not in err
        assert "not the kernel's OOM killer" in err or "host memory never ran low" in err


def test_run_feeds_the_analyzer_blocks_of_lines_and_finds_what_logs_finds(capfdbinary, tmp_path, monkeypatch):
    from torchdoctor.logs import analyze

    calls = []
    monkeypatch.setattr(analyze.Analyzer, "feed_line", lambda self, line: calls.append(line))
    log = tmp_path / "train.log"
    log.write_bytes((FIX / "clean_run.log").read_bytes() * 50 + (FIX / "hf_trainer_nan.log").read_bytes())
    rc, out, err = run_wrapper(capfdbinary, "--json", str(tmp_path / "r.json"), "--", "cat", str(log))
    assert rc == 0 and out == log.read_bytes()
    assert calls == []  # not line by line (4x slower than `torchdoctor logs`)
    rep = report(tmp_path / "r.json")
    with open(log, "rb") as f:
        want = analyze.analyze_stream(f)
    got = [(f["id"], f["severity"], f["title"]) for f in rep["findings"] if f["id"] != "process.exit"]
    assert got == [(f.id, f.severity, f.title) for f in want.findings]
    assert rep["timeline"] == want.timeline


def test_a_reader_that_goes_away_ends_the_command_like_a_pipe_does():
    child = ("import signal, sys\nsignal.signal(signal.SIGPIPE, signal.SIG_DFL)  # like yes, cat, ...\n"
             "while True:\n    sys.stdout.write('y' * 99 + '\\n')\n")
    p = subprocess.Popen([*WRAPPER, "--", PY, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _read_until(p.stdout.fileno(), [b"y" * 99 + b"\n"])
        p.stdout.close()  # `| head` has read enough
        p.stdout = None
        _, err = p.communicate(timeout=20)  # before: the wrapper drained the command's output forever
    finally:
        p.kill()
    err = err.decode()
    assert p.returncode == 128 + signal.SIGPIPE, err
    assert "[INFO] ended by SIGPIPE after" in err and "nobody was reading its stdout" in err
    assert "Traceback" not in err


def test_nothing_measured_is_said_so_and_an_empty_output_is_worded_for_a_command(capfdbinary):
    r = _result(exit_code=0, signal=None, peak_rss=0, peak_rss_t=None, child_maxrss=0)
    f = supervisor.exit_finding(r)
    assert "peak RSS not measured" in f.title and "0 MiB" not in f.title
    assert any(e.startswith("peak RSS: not measured") for e in f.evidence)
    assert not any("ru_maxrss of the command; the samples" in e for e in f.evidence)
    rc, _, err = run_wrapper(capfdbinary, "--", "true")
    assert rc == 0 and "the command printed nothing" in err and "check the file name" not in err


def test_one_signal_name_helper():
    from torchdoctor.logs import analyze
    from torchdoctor.run import result

    assert not hasattr(supervisor, "_signame") and not hasattr(analyze, "_signame")
    assert result.signame is analyze.signal_name and analyze.signal_name(9) == "SIGKILL"


def test_an_oom_kill_of_a_process_no_sample_saw_keeps_the_verdict_open(monkeypatch):
    log = ("[Sun Nov 29 10:00:00 2026] Out of memory: Killed process 100 (old) total-vm:1kB\n"
           "[Sun Nov 29 10:05:00 2026] Out of memory: Killed process 5012 (python) total-vm:30000000kB\n")
    monkeypatch.setattr(supervisor, "_run_quiet", lambda cmd, timeout: log if cmd[0] == "dmesg" else None)
    monkeypatch.delenv("TORCHDOCTOR_UNREADABLE", raising=False)  # this kernel log is the test's own
    k = supervisor.read_kernel_oom({5000, 5001})
    assert k.readable and k.oom_lines == [] and k.unseen_oom_lines == [log.splitlines()[1]]  # not the older pid 100
    f = supervisor.exit_finding(_result(pid=5000, pids_seen={5000, 5001}, kernel=k))
    assert f.data["oom_killer"] is None and "so likely the kernel's OOM killer (no kernel-log line" in f.title
    assert any("newer processes it did not see" in e for e in f.evidence)
    clean = supervisor.read_kernel_oom({6000})
    assert clean.unseen_oom_lines == []  # older than the command: not ours
    assert supervisor.exit_finding(_result(pid=6000, kernel=clean)).data["oom_killer"] is False


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


@needs_dev_full
def test_kernel_log_lines_dated_before_the_command_are_not_about_it(monkeypatch):
    """pids wrap around (at 32768 by default) and the kernel log keeps days: an OOM line written before the command
    started neither confirms an OOM kill of a process that now has that pid nor leaves the verdict open."""
    started = time.mktime(time.strptime("Fri Dec  4 03:40:00 2026", "%a %b %d %H:%M:%S %Y"))
    old_ours = "[Fri Dec  4 03:32:50 2026] Memory cgroup out of memory: Killed process 5000 (python3) total-vm:1kB"
    old_other = "[Fri Dec  4 03:39:00 2026] Out of memory: Killed process 31492 (python3) total-vm:1kB"
    new_other = "[Fri Dec  4 03:40:05 2026] Out of memory: Killed process 17 (python3) total-vm:1kB"
    monkeypatch.delenv("TORCHDOCTOR_UNREADABLE", raising=False)  # this kernel log is the test's own

    def kernel(*lines):
        monkeypatch.setattr(supervisor, "_run_quiet",
                            lambda cmd, timeout: "\n".join(lines) if cmd[0] == "dmesg" else None)
        return supervisor.read_kernel_oom({5000, 5001}, since=started)

    k = kernel(old_ours, old_other)
    assert k.readable and k.oom_lines == [] and k.unseen_oom_lines == []
    assert supervisor.exit_finding(_result(pid=5000, pids_seen={5000, 5001}, kernel=k)).data["oom_killer"] is False
    k = kernel(old_ours, old_other, new_other)  # a process killed while it ran, whatever its pid: maybe its own
    assert k.oom_lines == [] and k.unseen_oom_lines == [new_other]
    k = kernel(old_ours.replace("03:32:50", "03:40:01"))
    assert k.oom_lines == [old_ours.replace("03:32:50", "03:40:01")]
    assert supervisor.read_kernel_oom({5000}).oom_lines  # undated use (no start time): the line counts, as before


def test_kernel_log_times_are_read_from_dmesg_and_kmsg_prefixes():
    assert supervisor.line_time("[Fri Dec  4 03:40:05 2026] x") == time.mktime(time.strptime("2026-12-04 03:40:05",
                                                                                         "%Y-%m-%d %H:%M:%S"))
    boot = time.time() - time.monotonic()
    assert abs(supervisor.line_time("[   12.500000] Out of memory") - (boot + 12.5)) < 1.0
    assert supervisor.line_time("Dec 04 03:40:05 host kernel: Out of memory") is None  # journalctl's: not dated


def test_a_full_disk_for_json_or_log_is_a_warning_after_the_run_never_a_false_written():
    """`run --json /dev/full`: the command runs, its exit code stands, the report goes to stdout instead."""
    td = [PY, "-m", "torchdoctor", "run"]
    p = subprocess.run([*td, "--json", "/dev/full", "--", PY, "-c", "print('hi'); raise SystemExit(3)"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "Traceback" not in p.stderr
    assert "could not be written to --json /dev/full: No space left on device" in p.stderr
    assert "report written" not in p.stderr
    assert json.loads(p.stdout[p.stdout.index("{"):])["exit_code"] == 3
    p = subprocess.run([*td, "--log", "/dev/full", "--", PY, "-c", "print('hi')"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "hi" and "Traceback" not in p.stderr
    assert "could not be saved in --log /dev/full" in p.stderr and "output saved" not in p.stderr


@needs_dev_full
def test_stdout_on_a_full_disk_is_one_clear_error_exit_2(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1 loss 0.5\n")
    with open("/dev/full", "w") as full:
        p = subprocess.run([PY, "-m", "torchdoctor", "logs", "--json", str(log)], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "Exception ignored" not in p.stderr
    assert "cannot write the output: No space left on device" in p.stderr


def test_an_unwritable_json_target_is_refused_before_the_command_starts(tmp_path):
    marker = tmp_path / "ran"
    p = subprocess.run([PY, "-m", "torchdoctor", "run", "--json", str(tmp_path / "no" / "r.json"), "--",
                        PY, "-c", f"open({str(marker)!r}, 'w')"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cannot write --json" in p.stderr and not marker.exists()

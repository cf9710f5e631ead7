"""``torchdoctor demo`` ends cleanly however it is ended, and refuses a report it could not write before training.

Signals: a driver starts the demo as a terminal would (SIGINT and SIGQUIT at their default, whatever the test run
inherited: a shell without job control starts ``make test &`` with both ignored, and the demo rightly keeps a signal it
was started ignoring ignored), with TMPDIR a folder of the test's own, waits until the demo's temporary folder
exists (at the start, or mid-training once the fix is being applied), stops the demo (SIGSTOP), checks the folder
is still there, sends the signal and lets it go on (SIGCONT): the signal is delivered while the folder exists,
whatever the machine's speed. The demo must exit 128 + the signal (130 for SIGINT, as Ctrl-C), say so in one line,
and leave no ``torchdoctor-demo-*`` folder. The driver runs under tests/bounded.py, which ends the demo whatever
happens.

Report files: an existing report file that cannot be written (immutable or append-only where ``chattr`` works here,
read-only to a non-root user, a folder, a FIFO, a link into nowhere) is refused up front in one line, exit 2, and
left as it was. Writing that fails later anyway (here: a file-size limit, RLIMIT_FSIZE, set after the check has
passed) means the demo did not go as shown: said plainly, exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from bounded import run_bounded
from test_inputs_bounds import ENV

REPORT = "torchdoctor-nonfinite-rank0"

DRIVER = r'''
import json, os, signal, subprocess, sys, time
tmp, sig, when, *extra = sys.argv[1:]
sig = getattr(signal, sig)
ignored = os.environ.get("DRIVER_IGNORES")  # started with this signal ignored, as nohup starts a command
def start():
    # as a terminal starts a command: SIGINT and SIGQUIT at their default -- a shell without job control starts
    # `cmd &` with both ignored, and so does everything below a test run started that way (the demo keeps a signal
    # it was started ignoring ignored, as it should: that is what the shell asked for)
    for name in ("SIGINT", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    if ignored:
        signal.signal(getattr(signal, ignored), signal.SIG_IGN)
p = subprocess.Popen([sys.executable, "-m", "torchdoctor", "demo", "--steps", "1000", *extra],
                     env={**os.environ, "TMPDIR": tmp, "PYTHONUNBUFFERED": "1"},
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=start)
def ours():
    return sorted(n for n in os.listdir(tmp) if n.startswith("torchdoctor-demo-"))
head = b""
if when == "start":  # as soon as the folder exists
    while p.poll() is None and not ours():
        time.sleep(0.01)
else:  # mid-training: the fixed run has begun
    while p.poll() is None:
        line = p.stdout.readline()
        head += line
        if not line or line.startswith(b"applying the fix"):
            break
os.kill(p.pid, signal.SIGSTOP)
seen = ours()  # still there with the demo stopped: the signal below arrives before any cleanup
os.kill(p.pid, sig)
os.kill(p.pid, signal.SIGCONT)
out, err = p.communicate()
print(json.dumps({"rc": p.returncode, "seen": seen, "left": ours(), "out": (head + out).decode(errors="replace"),
                  "err": err.decode(errors="replace")}))
'''


def drive(tmp_path, sig: str, when: str, *extra: str, ignores: str = "") -> dict:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_bounded([sys.executable, "-c", DRIVER, str(tmp), sig, when, *extra], mem_bytes=4 << 30, max_procs=128,
                    timeout=300, env={**ENV, "DRIVER_IGNORES": ignores})
    assert not r.timed_out and r.proc.returncode == 0, r.proc.stderr[-3000:]
    return json.loads(r.proc.stdout)


@pytest.mark.parametrize("sig, when, extra", [
    ("SIGTERM", "start", ()),
    ("SIGHUP", "start", ()),
    ("SIGQUIT", "start", ()),
    ("SIGUSR1", "start", ()),
    ("SIGTERM", "training", ()),
    ("SIGHUP", "training", ()),
    ("SIGTERM", "start", ("--json",)),
])
def test_a_signal_ends_the_demo_and_removes_its_temporary_folder(tmp_path, sig, when, extra):
    got = drive(tmp_path, sig, when, *extra)
    assert len(got["seen"]) == 1, got  # the folder existed when the signal came
    assert got["left"] == [], got
    assert got["rc"] == 128 + getattr(signal, sig), (got["rc"], got["err"][-3000:])  # (the demo's own stderr)
    assert got["err"].splitlines() == [f"torchdoctor demo: ended by {sig}"], got["err"][-3000:]
    if extra:
        assert got["out"] == ""  # no half JSON object
    elif when == "training":
        assert "applying the fix" in got["out"]


@pytest.mark.parametrize("when", ["start", "training"])
def test_sigint_ends_it_as_ctrl_c_does(tmp_path, when):
    got = drive(tmp_path, "SIGINT", when)
    assert len(got["seen"]) == 1 and got["left"] == [], got
    assert got["rc"] == 130 and got["err"].splitlines() == ["interrupted"], got


def test_nohup_keeps_sighup_ignored(tmp_path):
    """A demo started with SIGHUP ignored (nohup) is not ended by one that comes once it runs: the hang-up it was
    started to survive. It trains to the end and still removes its folder."""
    got = drive(tmp_path, "SIGHUP", "start", "--steps", "2", "--json", ignores="SIGHUP")
    assert len(got["seen"]) == 1 and got["left"] == [], got
    assert got["rc"] == 0 and got["err"] == "", got
    assert json.loads(got["out"])["fixed_run"]["finite"] is True


# -- report files that cannot be written ---------------------------------------------------------------------------


def demo(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchdoctor", "demo", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def chattr(flag: str, path) -> bool:
    """Whether ``chattr flag path`` worked (root with CAP_LINUX_IMMUTABLE, on a file system that has the flags)."""
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def refused_unchanged(report_dir, name: str, says: str) -> None:
    target = report_dir / name
    before = (target.lstat().st_mtime_ns, target.read_bytes() if target.is_file() else None)
    proc = demo("--report-dir", str(report_dir), timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"torchdoctor demo: --report-dir {report_dir}: {name} {says}"]
    assert (target.lstat().st_mtime_ns, target.read_bytes() if target.is_file() else None) == before


@pytest.mark.parametrize("ext", [".txt", ".json"])
@pytest.mark.parametrize("flag", ["+i", "+a"], ids=["immutable", "append-only"])
def test_a_report_file_chattr_protects_is_refused_up_front(tmp_path, ext, flag):
    target = tmp_path / (REPORT + ext)
    target.write_text("an earlier report\n")
    if not chattr(flag, target):
        pytest.skip(f"chattr {flag} does not work here (needs root and a file system with the flag)")
    try:
        refused_unchanged(tmp_path, target.name, "cannot be written: Operation not permitted")
    finally:
        chattr(flag.replace("+", "-"), target)


def test_a_report_file_read_only_to_this_user_is_refused_up_front(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes a read-only file anyway (the chattr test covers root)")
    target = tmp_path / (REPORT + ".txt")
    target.write_text("an earlier report\n")
    target.chmod(0o444)
    refused_unchanged(tmp_path, target.name, "cannot be written: Permission denied")


@pytest.mark.parametrize("kind, says", [
    ("folder", "is a folder; the monitor writes its report to that file name"),
    ("fifo", "is a FIFO, not a file the report can be written to"),
    ("dangling", "is a link to {tmp}/gone/report.txt, in a folder that does not exist"),
    ("loop", "cannot be written: Too many levels of symbolic links"),
])
def test_a_report_path_that_is_no_writable_file_is_refused_up_front(tmp_path, kind, says):
    """Works for any user: the report's own name is a folder, a FIFO, a link that leads nowhere."""
    target = tmp_path / (REPORT + ".txt")
    if kind == "folder":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dangling":
        target.symlink_to(tmp_path / "gone" / "report.txt")
    else:
        (tmp_path / "other").symlink_to(target)
        target.symlink_to(tmp_path / "other")
    refused_unchanged(tmp_path, target.name, says.format(tmp=tmp_path))


def test_an_existing_writable_report_is_overwritten_as_before(tmp_path):
    (tmp_path / (REPORT + ".txt")).write_text("an earlier report\n")
    proc = demo("--steps", "2", "--report-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / (REPORT + ".txt")).read_text() != "an earlier report\n"


FSIZE_DRIVER = r'''
import json, resource, signal, subprocess, sys
def limit():  # every file this demo writes stops at 64 bytes (EFBIG: SIGXFSZ ignored, as a shell's ulimit -f)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
p = subprocess.run([sys.executable, "-m", "torchdoctor", "demo", "--steps", "2", *sys.argv[1:]],
                   capture_output=True, preexec_fn=limit)
print(json.dumps({"rc": p.returncode, "out": p.stdout.decode(errors="replace"),
                  "err": p.stderr.decode(errors="replace")}))
'''


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_a_report_that_fails_to_write_later_means_the_demo_did_not_go_as_shown(tmp_path, json_out):
    args = ["--report-dir", str(tmp_path)] + (["--json"] if json_out else [])
    r = run_bounded([sys.executable, "-c", FSIZE_DRIVER, *args], mem_bytes=4 << 30, timeout=300, env=ENV)
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]
    got = json.loads(r.proc.stdout)
    assert got["rc"] == 1 and "Traceback" not in got["err"], got
    why = f"could not write the report to {tmp_path}: [Errno 27] File too large"
    if json_out:
        findings = {f["id"]: f for f in json.loads(got["out"])["findings"]}
        assert findings["demo.report-not-written"]["severity"] == "fail"
        assert findings["demo.report-not-written"]["title"].startswith(f"the demo did not go as shown: the monitor "
                                                                       f"{why}")
        assert findings["demo.fix-works"]["severity"] == "ok"  # the rest went as shown; the report did not
    else:
        lines = got["out"].splitlines()
        assert any(line.startswith(f"the demo did not go as shown: the monitor {why}") for line in lines), got["out"]
        assert lines[-1] == "the report was not written: the demo did not go as shown (exit 1)"

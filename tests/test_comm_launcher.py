"""``comm --local N`` as a launcher: what the machine holds, batches, Ctrl-C, a stopped rank, and no rank left
behind -- real launches under ``run_bounded`` (a memory and process limit, every started process killed after),
whose ``leftovers`` name any rank still alive once the command had exited."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from bounded import run_bounded
from test_comm_processes import _env, the_json
from torchdoctor._system import GIB, MIB, fmt_bytes, read_meminfo
from torchdoctor.comm.capacity import (
    BENCH_COPIES,
    MIN_BATCH,
    RANK_BYTES,
    RANKS_PER_CPU,
    Machine,
    batch_size,
    most_ranks,
    rank_bytes,
    refusal,
    this_machine,
)

COMM = [sys.executable, "-m", "torchdoctor", "comm"]
REFUSAL = re.compile(
    r"^torchdoctor comm: --local (\d+) needs ~(.+) for \1 interpreters \((.+) each\); this machine has (.+) "
    r"available and (\d+) CPUs?; at most (\d+) here \((.+)\); --force to insist$")

# -- the rules, over fabricated machines ------------------------------------------------------------------------


def test_the_cpu_rule_allows_some_ranks_per_cpu():
    m = Machine(cpus=2, available=64 * GIB)
    assert most_ranks(m, RANK_BYTES) == 2 * RANKS_PER_CPU
    assert refusal(2 * RANKS_PER_CPU, m, RANK_BYTES) is None
    msg = refusal(2 * RANKS_PER_CPU + 1, m, RANK_BYTES)
    assert msg == (f"--local {2 * RANKS_PER_CPU + 1} needs ~{fmt_bytes((2 * RANKS_PER_CPU + 1) * RANK_BYTES)} for "
                   f"{2 * RANKS_PER_CPU + 1} interpreters (256 MiB each); this machine has 64.0 GiB available and 2 "
                   f"CPUs; at most {2 * RANKS_PER_CPU} here ({RANKS_PER_CPU} per CPU); --force to insist")


def test_the_memory_rule_counts_what_is_available():
    m = Machine(cpus=64, available=2 * GIB)
    assert most_ranks(m, RANK_BYTES) == 2 * GIB // RANK_BYTES == 8
    assert refusal(8, m, RANK_BYTES) is None
    assert refusal(9, m, RANK_BYTES).endswith("2.0 GiB available and 64 CPUs; at most 8 here (what its memory "
                                              "holds); --force to insist")
    assert "1 CPU;" in refusal(100, Machine(cpus=1, available=64 * GIB), RANK_BYTES)
    unknown = Machine(cpus=4, available=None)  # no /proc/meminfo: the CPUs alone decide
    assert most_ranks(unknown, RANK_BYTES) == 4 * RANKS_PER_CPU
    assert "unknown memory and 4 CPUs" in refusal(4 * RANKS_PER_CPU + 1, unknown, RANK_BYTES)
    assert most_ranks(Machine(cpus=8, available=100 * MIB), RANK_BYTES) == 0


def test_a_benchmark_on_host_memory_costs_its_buffers():
    assert rank_bytes(None, host_buffers=True) == RANK_BYTES
    assert rank_bytes(64 * MIB, host_buffers=True) == RANK_BYTES + BENCH_COPIES * 64 * MIB
    assert rank_bytes(64 * MIB, host_buffers=False) == RANK_BYTES  # NCCL: the buffers live on the GPU
    m = Machine(cpus=64, available=4 * GIB)
    assert most_ranks(m, rank_bytes(256 * MIB, True)) < most_ranks(m, rank_bytes(None, True))


def test_ranks_start_one_per_cpu_and_a_few_at_least():
    assert batch_size(Machine(cpus=1, available=None)) == MIN_BATCH
    assert batch_size(Machine(cpus=48, available=None)) == 48


def test_this_machine_is_what_this_process_may_use():
    m = this_machine()
    assert m.cpus == len(os.sched_getaffinity(0))
    total = read_meminfo().get("MemTotal")
    if m.available is not None and total is not None:
        assert 0 < m.available <= total


# -- real launches ---------------------------------------------------------------------------------------------

_PINNED = """import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
os.execv(sys.executable, [sys.executable, "-m", "torchdoctor", "comm", *sys.argv[2:]])
"""


def pinned(*args: str, **bounds):
    """``comm ARGS`` on one CPU of this machine (what sched_getaffinity tells it), bounded."""
    cpu = min(os.sched_getaffinity(0))
    return run_bounded([sys.executable, "-c", _PINNED, str(cpu), *args], env=_env(), **bounds)


def refused(b) -> re.Match:
    assert b.proc.returncode == 2, b.proc.stderr[-2000:]
    err = b.proc.stderr.decode()
    assert b.proc.stdout == b"" and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    m = REFUSAL.match(err.strip())
    assert m, err
    assert not b.leftovers and not b.timed_out
    return m


def test_local_100000_is_refused_in_one_line_with_the_machines_figures():
    # the bound is what protects this machine if the refusal is broken: a few processes, little memory
    b = run_bounded([*COMM, "--local", "100000"], mem_bytes=512 * MIB, max_procs=8, timeout=120, env=_env())
    m = refused(b)
    assert m.group(2) == fmt_bytes(100000 * RANK_BYTES) and m.group(3) == fmt_bytes(RANK_BYTES)
    cpus, most = int(m.group(5)), int(m.group(6))
    assert cpus == len(os.sched_getaffinity(0))
    assert most <= RANKS_PER_CPU * cpus
    # with --bench on gloo each rank also holds 3x the largest message
    b = run_bounded([*COMM, "--local", "100000", "--bench", "--sizes", "1G", "--backend", "gloo"],
                    mem_bytes=512 * MIB, max_procs=8, timeout=120, env=_env())
    assert refused(b).group(3) == fmt_bytes(RANK_BYTES + 3 * GIB)


def _progress(stderr: str) -> list[tuple[int, int]]:
    """(joined, started) of each join progress line that says how many were started."""
    return [(int(j), int(s)) for j, s in re.findall(r"(\d+)/\d+ ranks joined \(\d+ s\), (\d+) started", stderr)]


def test_on_one_cpu_the_cpu_rule_refuses_force_insists_and_ranks_start_in_batches():
    m = refused(pinned("--local", "100000", mem_bytes=6 * GIB, max_procs=8, timeout=120))
    assert m.group(5) == "1"
    most = int(m.group(6))
    assert most <= RANKS_PER_CPU
    if most < RANKS_PER_CPU:
        pytest.skip(f"this machine holds {most} ranks by memory: starting {RANKS_PER_CPU + 1} would strain it")
    n = RANKS_PER_CPU + 1
    m = refused(pinned("--local", str(n), mem_bytes=6 * GIB, max_procs=8, timeout=120))
    assert (m.group(6), m.group(7)) == (str(RANKS_PER_CPU), f"{RANKS_PER_CPU} per CPU")
    b = pinned("--local", str(n), "--force", "--json", "--timeout", "120", mem_bytes=6 * GIB, max_procs=512,
               timeout=600)
    err = b.proc.stderr.decode()
    assert b.proc.returncode == 0, err[-3000:]
    out = the_json(b.proc.stdout.decode())
    assert [r["status"] for r in out["ranks"]] == ["ok"] * n and [f["id"] for f in out["findings"]] == ["comm.ok"]
    assert not b.leftovers
    # one CPU: batches of MIN_BATCH, the next once the last has joined -- never more than one batch still starting
    lines = _progress(err)
    assert lines and any(started < n for _, started in lines), err
    assert all(started - joined <= MIN_BATCH for joined, started in lines), lines


DRIVER = r'''
"""Start `torchdoctor comm ARGS`, wait for its benchmark to run, do ACTION; one JSON line says what happened."""
import json, os, signal, subprocess, sys, threading, time

def ranks_of(parent):
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == parent:
            out.update({int(e[5:]): int(d) for e in env if e.startswith(b"RANK=")})
    return out

action, args = sys.argv[1], sys.argv[2:]
# a session of its own, as a shell gives a job: its process group is the terminal's foreground group
p = subprocess.Popen([sys.executable, "-m", "torchdoctor", "comm", *args], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, start_new_session=True)
out, err, bench = [], [], threading.Event()

def read(stream, into, watch=False):
    for line in iter(stream.readline, b""):
        into.append((time.monotonic(), line.decode()))
        if watch and b"[bench] 5 ops" in line:
            bench.set()

threading.Thread(target=read, args=(p.stdout, out), daemon=True).start()
threading.Thread(target=read, args=(p.stderr, err, True), daemon=True).start()
if action.endswith("-early"):  # as soon as both ranks run (exec'd: RANK is in their environment): still importing torch
    deadline = time.monotonic() + 180
    while len(ranks_of(p.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    action = action.removesuffix("-early")
else:
    assert bench.wait(180), "".join(t for _, t in err)
    time.sleep(1.0)
ranks = ranks_of(p.pid)
t0 = time.monotonic()
if action == "kill-launcher":
    p.kill()
    p.wait()
    print(json.dumps({"ranks": ranks}), flush=True)
    os._exit(0)  # a rank left behind holds the pipes open: do not wait for the readers
states = {}
if action == "ctrl-z":  # what the terminal does on Ctrl-Z, then `fg` (it resumes the job's group), then Ctrl-C
    os.killpg(p.pid, signal.SIGTSTP)
    time.sleep(1.0)
    states = {r: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] for r, pid in ranks.items()}
    states["launcher"] = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0]
    os.killpg(p.pid, signal.SIGCONT)
    time.sleep(1.0)
    states["resumed"] = {r: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] for r, pid in ranks.items()}
    action = "ctrl-c"
if action == "ctrl-c":
    os.killpg(p.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole foreground group
elif action == "sigint":
    p.send_signal(signal.SIGINT)
elif action == "stop-rank-1":
    os.kill(ranks[1], signal.SIGSTOP)
elif action == "term-rank-1":  # a SIGTERM to one rank's own process, not through the launcher
    os.kill(ranks[1], signal.SIGTERM)
elif action in ("sigterm", "sighup"):  # what `timeout` / `kill` / a closed terminal send to the command
    p.send_signal(signal.SIGTERM if action == "sigterm" else signal.SIGHUP)
rc = p.wait(timeout=300)
time.sleep(0.5)

def state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None

after = {r: state(pid) for r, pid in ranks.items()}  # None: gone (a zombie would be "Z")
print(json.dumps({"ranks": ranks, "rc": rc, "states": states, "after": after, "exit_s": time.monotonic() - t0,
                  "verdict_s": out[0][0] - t0 if out else None,
                  "stdout": "".join(t for _, t in out), "stderr": "".join(t for _, t in err)}), flush=True)
os._exit(0)
'''

BENCH_FOREVER = ("--bench", "--sizes", "8M", "--iters", "100000")  # all_reduce 8M runs (practically) forever


def drive(action: str, *args: str, **env: str) -> tuple[dict, object]:
    b = run_bounded([sys.executable, "-c", DRIVER, action, *args], mem_bytes=4 * GIB, max_procs=256, timeout=400,
                    env=_env(**env))
    assert b.proc.returncode == 0 and not b.timed_out, (b.proc.stdout[-2000:], b.proc.stderr[-3000:])
    return json.loads(b.proc.stdout.decode().strip().splitlines()[-1]), b


def test_a_launcher_killed_by_sigkill_leaves_no_rank_behind():
    report, b = drive("kill-launcher", "--local", "2", "--timeout", "30", *BENCH_FOREVER)
    assert sorted(report["ranks"]) == ["0", "1"]  # both ranks ran when the launcher was killed
    assert b.leftovers == [], f"ranks outlived their launcher: {b.leftovers} (ranks were {report['ranks']})"


@pytest.mark.parametrize("action, json_out", [("ctrl-c", False), ("sigint", True)])
def test_ctrl_c_is_interrupted_by_the_user_exit_130(action, json_out):
    timeout = 30
    report, b = drive(action, "--local", "2", "--timeout", str(timeout), *BENCH_FOREVER,
                      *(["--json"] if json_out else []))
    assert report["rc"] == 130, report["stderr"][-3000:]
    assert report["exit_s"] < timeout + 15
    text = report["stdout"]
    assert "SIGTERM" not in text and "scancel" not in text and "stopped from outside" not in text
    if json_out:
        out = the_json(text)
        assert [f["id"] for f in out["findings"]] == ["comm.interrupted"]
        assert out["findings"][0]["title"].startswith("interrupted by the user (Ctrl-C) during bench all_reduce 8M")
        assert [r["status"] for r in out["ranks"]] == ["interrupted", "interrupted"]
    else:
        assert "[SKIP] interrupted by the user (Ctrl-C) during bench all_reduce 8M" in text
        assert text.count("INTERRUPTED (interrupted in bench all_reduce 8M)") == 2
    assert "Traceback" not in report["stderr"]
    assert b.leftovers == []


def test_ctrl_z_stops_the_ranks_with_their_launcher_and_fg_resumes_them():
    report, b = drive("ctrl-z", "--local", "2", "--json", "--timeout", "30", *BENCH_FOREVER)
    states = report["states"]
    assert (states["launcher"], states["0"], states["1"]) == ("T", "T", "T"), states
    assert "T" not in states["resumed"].values(), states
    assert report["rc"] == 130, report["stderr"][-3000:]
    out = the_json(report["stdout"])
    assert [f["id"] for f in out["findings"]] == ["comm.interrupted"]  # nobody timed out over the pause
    assert b.leftovers == []


def test_ctrl_c_while_the_ranks_start_is_no_fault_of_theirs():
    """The ranks are still importing torch: the launcher kills them (a Ctrl-C there would print a traceback per
    rank) and reports the interruption from the store."""
    report, b = drive("ctrl-c-early", "--local", "2", "--json", "--timeout", "30")
    assert sorted(report["ranks"]) == ["0", "1"]
    assert report["rc"] == 130, report["stderr"][-3000:]
    out = the_json(report["stdout"])
    assert [(f["id"], f["title"]) for f in out["findings"]] == [
        ("comm.interrupted", "interrupted by the user (Ctrl-C) before any rank joined: nothing was checked")]
    assert [(r["status"], r["detail"]) for r in out["ranks"]] == [("interrupted", "interrupted before joining")] * 2
    assert "Traceback" not in report["stderr"] and "interrupted" not in report["stderr"], report["stderr"]
    assert b.leftovers == []


def test_a_stopped_rank_is_stuck_not_dead_and_the_command_ends_soon_after():
    timeout = 5
    report, b = drive("stop-rank-1", "--local", "2", "--json", "--timeout", str(timeout), *BENCH_FOREVER)
    assert report["rc"] == 1, report["stderr"][-3000:]
    # the verdict within the stage deadline (+ settle), the exit a few seconds after it -- not the ~55 s it took
    assert report["verdict_s"] is not None and report["exit_s"] < timeout + 15, report
    out = the_json(report["stdout"])
    fails = [f for f in out["findings"] if f["severity"] == "fail"]
    assert [f["id"] for f in fails] == ["comm.rank-stuck"]
    f = fails[0]
    pid = report["ranks"]["1"]
    # TracerPid read at the verdict, while the process still existed: 0, no debugger held it
    assert f["data"] == {"rank": 1, "stage": "bench", "detail": "all_reduce 8M", "process": "stopped", "pid": pid,
                         "tracer_pid": 0, "tracer": None, "ended_by_launcher": True}
    assert f["title"].endswith("is frozen (stopped) in bench all_reduce 8M")
    # --local ends the stopped rank after the verdict: no command is aimed at its pid, and the pid is gone
    assert report["after"]["1"] is None, report["after"]
    assert any(f"process {pid} is gone by the time you read this" in e for e in f["evidence"]), f["evidence"]
    assert not any(str(pid) in fx for fx in f["fix"]), f["fix"]
    assert any("SIGSTOP" in fx for fx in f["fix"]) and any("before the verdict" in fx for fx in f["fix"])
    assert out["ranks"][1]["detail"] == "is frozen (stopped) in bench all_reduce 8M"
    assert out["ranks"][0] == {**out["ranks"][0], "status": "ok",
                               "detail": "cut short in bench by another rank: rank 1 (host "
                                         f"{out['ranks'][1]['host']}, local rank 1) is frozen"}
    assert b.leftovers == [], "the stopped rank outlived its launcher"


def test_a_rank_stopped_before_it_joins_is_stuck_not_missing():
    """The launcher started it and posted its pid: the verdict sees it stopped (state T) while importing torch."""
    timeout = 5
    report, b = drive("stop-rank-1-early", "--local", "2", "--json", "--timeout", str(timeout))
    assert report["rc"] == 1, report["stderr"][-3000:]
    out = the_json(report["stdout"])
    assert out["ranks"][1]["identity"] is None  # it was stopped before it could join
    fails = [f for f in out["findings"] if f["severity"] == "fail"]
    assert [f["id"] for f in fails] == ["comm.rank-stuck"], out["findings"]
    f, pid = fails[0], report["ranks"]["1"]
    assert f["title"] == "rank 1 is frozen (stopped) before joining"
    assert f["data"] == {"rank": 1, "stage": None, "detail": None, "process": "stopped", "pid": pid,
                         "tracer_pid": 0, "tracer": None, "ended_by_launcher": True}
    assert not any("nc -zv" in fx or "launcher started" in fx for fx in f["fix"])
    assert not any(str(pid) in fx for fx in f["fix"])
    assert [(r["status"], r["detail"]) for r in out["ranks"]] == [
        ("ok", "cut short in join by another rank: rank 1 is frozen"),
        ("broken", "is frozen (stopped) before joining")]
    assert report["after"]["1"] is None and b.leftovers == []


@pytest.mark.parametrize("action, signame, code", [("sigterm", "SIGTERM", 143), ("sighup", "SIGHUP", 129)])
def test_a_signal_to_the_launcher_is_stopped_from_outside_not_a_failure(action, signame, code):
    report, b = drive(action, "--local", "2", "--json", "--timeout", "30", *BENCH_FOREVER)
    assert report["rc"] == code, report["stderr"][-3000:]
    out = the_json(report["stdout"])
    assert [(f["id"], f["severity"]) for f in out["findings"]] == [("comm.terminated", "skip")]
    f = out["findings"][0]
    assert f["title"].startswith(f"stopped from outside ({signame} to torchdoctor comm: ")
    assert f["title"].endswith("during bench all_reduce 8M: the stages after it were not checked")
    assert f["data"] == {"ranks": [0, 1], "signal": signame}
    text = report["stdout"]
    assert "sacct" not in text and "SLURM" not in text and "first process that failed" not in text
    assert [(r["status"], r["detail"]) for r in out["ranks"]] == [
        ("interrupted", f"stopped from outside ({signame}) in bench all_reduce 8M")] * 2
    assert "Traceback" not in report["stderr"]
    assert b.leftovers == []


def test_sigterm_inside_a_slurm_job_names_its_time_limit_and_scancel():
    report, b = drive("sigterm", "--local", "2", "--timeout", "30", *BENCH_FOREVER, SLURM_JOB_ID="4321")
    assert report["rc"] == 143, report["stderr"][-3000:]
    text = report["stdout"]
    assert "[SKIP] stopped from outside (SIGTERM to torchdoctor comm: " in text
    assert "sacct -j 4321" in text and "BROKEN" not in text
    assert text.count("INTERRUPTED (stopped from outside (SIGTERM) in bench all_reduce 8M)") == 2
    assert b.leftovers == []


def test_sigterm_while_the_ranks_start_blames_none_of_them():
    report, b = drive("sigterm-early", "--local", "2", "--json", "--timeout", "30")
    assert report["rc"] == 143, report["stderr"][-3000:]
    out = the_json(report["stdout"])
    assert [(f["id"], f["severity"]) for f in out["findings"]] == [("comm.terminated", "skip")]
    assert out["findings"][0]["title"].endswith("before any rank joined: nothing was checked")
    assert [(r["status"], r["detail"]) for r in out["ranks"]] == [
        ("interrupted", "stopped from outside (SIGTERM) before joining")] * 2
    assert "Traceback" not in report["stderr"] and "rendezvous store" not in report["stderr"], report["stderr"]
    assert b.leftovers == []


def test_a_sigterm_sent_to_one_rank_itself_is_named_as_such():
    timeout = 5
    report, b = drive("term-rank-1", "--local", "2", "--json", "--timeout", str(timeout), *BENCH_FOREVER)
    assert report["rc"] == 1, report["stderr"][-3000:]
    out = the_json(report["stdout"])
    fails = [f for f in out["findings"] if f["severity"] == "fail"]
    assert [(f["id"], f["data"]) for f in fails] == [("comm.terminated", {"ranks": [1]})]
    assert fails[0]["fix"][0].startswith("a SIGTERM reached rank 1 directly, not through torchdoctor comm --local")
    assert "sacct" not in report["stdout"]
    assert out["ranks"][0]["status"] == "ok" and out["ranks"][1]["status"] == "broken"
    assert b.leftovers == []


@pytest.mark.parametrize("args", [
    ["--local", "1_0"], ["--local", "+2"], ["--local", " 2"], ["--local", "٢"], ["--local", "2.0"], ["--local", "two"],
    ["--local", "2", "--bench", "--iters", "1_0"], ["--local", "2", "--bench", "--warmup", "+1"],
])
def test_a_count_in_any_other_spelling_than_plain_digits_is_refused_in_one_line(args):
    # bounded: `--local 1_0` used to start 10 ranks
    b = run_bounded([*COMM, *args], mem_bytes=512 * MIB, max_procs=8, timeout=120, env=_env())
    assert b.proc.returncode == 2 and b.proc.stdout == b"", b.proc.stderr[-2000:]
    err = b.proc.stderr.decode()
    flag = args[-2]
    assert err == f"torchdoctor comm: {flag} takes a count in plain digits (0-9), got {args[-1]!r}\n"
    assert not b.leftovers and not b.timed_out


@pytest.mark.parametrize("value", ["1_0", "1e1", "+5", "nan"])
def test_a_timeout_in_any_other_spelling_than_plain_digits_is_refused_in_one_line(value):
    b = run_bounded([*COMM, "--local", "2", "--timeout", value], mem_bytes=512 * MIB, max_procs=8, timeout=120,
                    env=_env())
    assert b.proc.returncode == 2 and b.proc.stdout == b"", b.proc.stderr[-2000:]
    err = b.proc.stderr.decode()
    assert err == ("torchdoctor comm: --timeout must be a number of seconds, at least 1 (plain digits, such as 60 "
                   f"or 2.5), got {value!r}\n")
    assert not b.leftovers and not b.timed_out

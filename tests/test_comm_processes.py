"""``torchdoctor comm`` with real processes on gloo: torchrun, --local, env launches, dead and missing ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchdoctor.comm.bandwidth import bus_factor
from torchdoctor.comm.launch import free_port

SRC = str(Path(__file__).parent.parent / "src")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
COMM = ["-m", "torchdoctor", "comm"]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NCCL_", "SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", **extra)
    return env


def comm(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *COMM, *args], capture_output=True, text=True, timeout=timeout,
                          env=env or _env())


def torchrun(nproc: int, *args: str, extra: tuple[str, ...] = ("--standalone",), env=None, **popen):
    cmd = [*TORCHRUN, *extra, "--nproc_per_node", str(nproc), *COMM, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _env(),
                            **popen)


def _no_constant(name: str):
    raise AssertionError(f"--json wrote {name}, which is not JSON")


def the_json(stdout: str) -> dict:
    """Exactly one JSON object on stdout: one reporter, no interleaving; strict JSON (no NaN / Infinity)."""
    objs = [json.loads(line, parse_constant=_no_constant) for line in stdout.splitlines() if line.startswith("{")]
    assert len(objs) == 1, stdout
    return objs[0]


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return sorted(out)


def rank_processes(n: int, *args: str, ranks=None, port: int | None = None, extra_env: dict | None = None):
    """Ranks started by hand, as any launcher would (RANK, WORLD_SIZE, MASTER_*): rank 0 hosts the store."""
    port = port or free_port()
    procs = {}
    for r in ranks if ranks is not None else range(n):
        env = _env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **(extra_env or {}))
        procs[r] = subprocess.Popen([sys.executable, *COMM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)
    return procs


def assert_all_ok(out: dict, n: int) -> None:
    assert out["world_size"] == n and out["backend"] == "gloo"
    assert [r["rank"] for r in out["ranks"]] == list(range(n))
    assert all(r["status"] == "ok" and r["stage"] == "done" for r in out["ranks"]), out["ranks"]
    assert [f["id"] for f in out["findings"]] == ["comm.ok"]


@pytest.mark.parametrize("n", [2, 4])
def test_local_ranks_all_pass(n):
    proc = comm("--local", str(n), "--json", "--timeout", "30")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = the_json(proc.stdout)
    assert_all_ok(out, n)
    assert out["launch"] == "local"
    assert sorted(r["local_rank"] for r in out["ranks"]) == list(range(n))


@pytest.mark.parametrize("n", [2, 4])
def test_torchrun_ranks_all_pass(n):
    p = torchrun(n, "--json", "--timeout", "30")
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-2000:]
    out = the_json(stdout)
    assert_all_ok(out, n)
    assert out["launch"] == "torchrun"


def test_table_is_printed_once_by_one_rank():
    proc = comm("--local", "3", "--timeout", "30")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("torchdoctor comm: 3 ranks, backend gloo") == 1
    lines = proc.stdout.splitlines()
    start = lines.index("torchdoctor comm: 3 ranks, backend gloo")
    assert lines[start + 1].split() == ["rank", "host", "local", "device", "status"]
    assert [ln.split()[0] for ln in lines[start + 2:start + 5]] == ["0", "1", "2"]
    assert all(ln.rstrip().endswith("OK") for ln in lines[start + 2:start + 5])
    assert "[OK] all 3 ranks passed every stage" in proc.stdout


def test_one_rank_has_nothing_to_test():
    proc = comm("--local", "1")
    assert proc.returncode == 2
    assert "world size 1 without a GPU" in proc.stderr and "--local 2" in proc.stderr
    p = torchrun(1)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "exitcode  : 2" in err  # torchrun itself exits 1 and shows the rank's 2
    assert "world size 1 without a GPU" in err


def test_two_nodes_on_localhost_and_an_extra_nccl_variable_is_flagged():
    port = free_port()
    base = ["--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    node1 = torchrun(2, "--json", "--timeout", "30", extra=(*base, "--node_rank", "1"), env=_env(NCCL_ALGO="Ring"))
    node0 = torchrun(2, "--json", "--timeout", "30", extra=(*base, "--node_rank", "0"))
    out0, err0 = node0.communicate(timeout=120)
    out1, err1 = node1.communicate(timeout=120)
    assert node0.returncode == 0 and node1.returncode == 0, (err0[-2000:], err1[-2000:])
    out = the_json(out0 + out1)  # one table for the whole job, whichever node printed it
    assert out["world_size"] == 4
    assert all(r["status"] == "ok" for r in out["ranks"])
    assert sorted((r["rank"], r["local_rank"]) for r in out["ranks"]) == [(0, 0), (1, 1), (2, 0), (3, 1)]
    mismatch = [f for f in out["findings"] if f["id"] == "comm.env-mismatch"]
    assert len(mismatch) == 1 and mismatch[0]["severity"] == "warn"
    assert mismatch[0]["data"] == {"variable": "NCCL_ALGO", "values": {"None": [0, 1], "Ring": [2, 3]}}
    assert "comm.ok" in [f["id"] for f in out["findings"]]


def test_a_rank_that_never_joins_is_named_within_the_timeout():
    timeout = 4
    t0 = time.monotonic()
    procs = rank_processes(3, "--json", "--timeout", str(timeout), ranks=[0, 2])  # rank 1 is never started
    outs = {r: p.communicate(timeout=timeout + 30) for r, p in procs.items()}
    elapsed = time.monotonic() - t0
    assert elapsed < timeout + 15
    assert all(p.returncode == 1 for p in procs.values()), {r: o[1][-1000:] for r, o in outs.items()}
    out = the_json(outs[0][0] + outs[2][0])
    by_rank = {r["rank"]: r for r in out["ranks"]}
    assert by_rank[1]["status"] == "missing" and by_rank[1]["stage"] == "join"
    assert by_rank[0]["status"] == by_rank[2]["status"] == "ok"  # they only waited for rank 1
    assert "rank 1 never joined" in by_rank[0]["detail"]
    fails = [f for f in out["findings"] if f["severity"] == "fail"]
    assert [f["id"] for f in fails] == ["comm.rank-missing"] and fails[0]["data"] == {"rank": 1}


def _wait_for_line(stream, needle: str, deadline: float) -> str:
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never appeared in: {''.join(seen)[-2000:]}")


def test_a_rank_killed_mid_benchmark_is_named_by_the_survivor():
    timeout = 8
    args = ("--json", "--timeout", str(timeout), "--bench", "--sizes", "8M", "--iters", "100000")
    procs = rank_processes(2, *args)
    # rank 0 announces the benchmark on stderr; then all_reduce 8M runs (practically) forever
    _wait_for_line(procs[0].stderr, "[bench] 5 ops x 1 sizes", time.monotonic() + 60)
    time.sleep(1.0)
    procs[1].send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    stdout, _ = procs[0].communicate(timeout=timeout + 30)
    verdict_s = time.monotonic() - t_kill
    procs[1].wait()
    assert verdict_s < timeout + 15
    assert procs[0].returncode == 1
    out = the_json(stdout)
    by_rank = {r["rank"]: r for r in out["ranks"]}
    assert by_rank[1]["status"] == "broken" and by_rank[1]["stage"] == "bench"
    assert by_rank[1]["detail"] == "died during bench all_reduce 8M"
    assert by_rank[0]["status"] == "ok" and "rank 1 (host" in by_rank[0]["detail"]
    died = [f for f in out["findings"] if f["id"] == "comm.rank-died"]
    assert len(died) == 1 and died[0]["data"]["rank"] == 1 and died[0]["data"]["stage"] == "bench"
    assert "died during bench all_reduce 8M" in died[0]["title"]


def test_rank0_killed_under_torchrun_is_named_by_the_survivor():
    """The store lives in torchrun's agent, so the side channel survives the death of rank 0 itself."""
    timeout = 8
    p = torchrun(2, "--json", "--timeout", str(timeout), "--bench", "--sizes", "8M", "--iters", "100000")
    deadline = time.monotonic() + 60
    _wait_for_line(p.stderr, "[bench] 5 ops x 1 sizes", deadline)
    time.sleep(1.0)
    rank0 = children(p.pid)[0]  # torchrun starts local ranks in order
    os.kill(rank0, signal.SIGKILL)
    t_kill = time.monotonic()
    stdout, _ = p.communicate(timeout=timeout + 40)
    assert time.monotonic() - t_kill < timeout + 15
    assert p.returncode != 0
    out = the_json(stdout)
    by_rank = {r["rank"]: r for r in out["ranks"]}
    assert by_rank[0]["status"] == "broken" and by_rank[0]["stage"] == "bench"
    assert by_rank[1]["status"] == "ok"
    assert [f["data"]["rank"] for f in out["findings"] if f["id"] == "comm.rank-died"] == [0]


def test_bench_bandwidths_follow_the_nccl_tests_formulas():
    n = 4
    proc = comm("--local", str(n), "--json", "--bench", "--sizes", "4K,1000000", "--iters", "3", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = the_json(proc.stdout)
    bench = out["bench"]
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
    assert [b["op"] for b in bench] == [op for op in ops for _ in range(2)]
    for b in bench:
        assert set(b) == {"op", "bytes", "dtype", "algbw_gbps", "busbw_gbps", "p50_us", "p99_us"}
        assert b["dtype"] == "float32" and 0 < b["p50_us"] <= b["p99_us"]
        assert b["busbw_gbps"] / b["algbw_gbps"] == pytest.approx(bus_factor(b["op"], n), rel=1e-9)
        assert b["algbw_gbps"] == pytest.approx(b["bytes"] / (b["p50_us"] * 1e-6) / 1e9, rel=1e-9)
    # 1,000,000 bytes: whole float32 elements per rank's shard (n * 4 bytes) for the sharded ops
    sizes = {b["op"]: b["bytes"] for b in bench if b["bytes"] > 4096}
    assert sizes == {"all_reduce": 1000000, "broadcast": 1000000, "all_gather": 1000000,
                     "reduce_scatter": 1000000, "all_to_all": 1000000}
    assert "comm.bench-one-rank" not in {f["id"] for f in out["findings"]}
    proc = comm("--local", "3", "--json", "--bench", "--sizes", "1000000", "--iters", "2", "--warmup", "0")
    sizes = {b["op"]: b["bytes"] for b in the_json(proc.stdout)["bench"]}
    # 3 ranks x 4-byte elements: the sharded ops round down to whole shards of 83333 floats
    assert sizes == {"all_reduce": 1000000, "broadcast": 1000000, "all_gather": 999996,
                     "reduce_scatter": 999996, "all_to_all": 999996}
    assert bus_factor("all_reduce", n) == 1.5 and bus_factor("all_gather", n) == 0.75


@pytest.mark.parametrize(
    "args, message",
    [
        (["--local", "2", "--sizes", "1Q"], "'1Q' is not a size"),
        (["--local", "2", "--sizes", "64M:1K"], "ends below its start"),
        (["--local", "2", "--backend", "nccl"], "--backend nccl needs CUDA"),
        (["--local", "2", "--timeout", "0"], "--timeout must be a number of seconds, at least 1"),
        (["--local", "2", "--timeout", "nan"], "--timeout must be a number of seconds, at least 1"),
        (["--local", "2", "--timeout", "inf"], "--timeout must be a number of seconds, at least 1"),
        (["--local", "0"], "at least 1 rank"),
        (["--backend", "mpi"], "invalid choice: 'mpi'"),
        ([], "no launcher found"),
    ],
)
def test_bad_input_is_a_clear_message_and_exit_2(args, message):
    proc = comm(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_launcher_variables_are_exit_2():
    proc = comm(env=_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"))
    assert proc.returncode == 2 and "MASTER_PORT not set" in proc.stderr
    proc = comm(env=_env(RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"))
    assert proc.returncode == 2 and "rank 3 is outside world size 2" in proc.stderr


def test_a_frozen_rank_is_found_by_the_watchdog_not_waited_on_forever():
    """SIGSTOP: the peer's sockets stay open, so only the stage deadline can end the wait."""
    timeout = 5
    procs = rank_processes(2, "--json", "--timeout", str(timeout), "--bench", "--sizes", "8M", "--iters", "100000")
    _wait_for_line(procs[0].stderr, "[bench] 5 ops x 1 sizes", time.monotonic() + 60)
    time.sleep(1.0)
    procs[1].send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        stdout, _ = procs[0].communicate(timeout=timeout + 30)
        verdict_s = time.monotonic() - t_stop
    finally:
        procs[1].kill()
        procs[1].wait()
    assert timeout - 1 < verdict_s < timeout + 15
    assert procs[0].returncode == 1
    out = the_json(stdout)
    by_rank = {r["rank"]: r for r in out["ranks"]}
    assert by_rank[1]["status"] == "broken" and by_rank[1]["detail"] == "is frozen (stopped) in bench all_reduce 8M"
    assert by_rank[0]["status"] == "ok" and by_rank[0]["stage"] == "bench"
    # alive but not running: stuck, not dead
    fails = [f for f in out["findings"] if f["severity"] == "fail"]
    assert [f["id"] for f in fails] == ["comm.rank-stuck"]
    assert fails[0]["data"]["process"] == "stopped" and fails[0]["data"]["pid"] == procs[1].pid


def test_local_parent_reports_when_every_rank_was_killed():
    p = subprocess.Popen([sys.executable, *COMM, "--local", "2", "--json", "--timeout", "20", "--bench", "--sizes",
                          "8M", "--iters", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env())
    _wait_for_line(p.stderr, "[bench] 5 ops x 1 sizes", time.monotonic() + 60)
    time.sleep(1.0)
    kids = children(p.pid)
    assert len(kids) == 2
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
    stdout, _ = p.communicate(timeout=60)
    assert p.returncode == 1
    out = the_json(stdout)
    assert [r["status"] for r in out["ranks"]] == ["broken", "broken"]
    # the parent reaped both: it knows how they ended
    assert all(r["detail"] == "was killed by SIGKILL during bench all_reduce 8M" for r in out["ranks"])
    died = [f for f in out["findings"] if f["id"] == "comm.rank-died"]
    assert sorted(f["data"]["rank"] for f in died) == [0, 1] and {f["data"]["signal"] for f in died} == {"SIGKILL"}


def _free_slurm_job_id() -> int:
    """A job id whose derived port (20000 + id % 1000 * 10, step 0) is free right now."""
    import socket

    for job in range(4321, 14321):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job % 1000 * 10))
            except OSError:
                continue
            return job
    pytest.skip("no free port in 20000-29999")


def test_srun_without_torchrun_derives_ranks_and_master_from_slurm_variables():
    job = _free_slurm_job_id()
    procs = []
    for r in range(2):
        env = _env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_JOB_ID=str(job),
                   SLURM_JOB_NODELIST="localhost,otherhost")
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, *COMM, "--json", "--timeout", "30", "--nccl-debug", "INFO"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    out = the_json(outs[0][0] + outs[1][0])
    assert out["launch"] == "slurm" and out["world_size"] == 2
    assert [(r["rank"], r["local_rank"], r["status"]) for r in out["ranks"]] == [(0, 0, "ok"), (1, 1, "ok")]
    # --nccl-debug sets NCCL_DEBUG on every rank alike: recorded, and no mismatch
    assert all(r["identity"]["env"].get("NCCL_DEBUG") == "INFO" for r in out["ranks"])
    assert [f["id"] for f in out["findings"]] == ["comm.ok"]


def test_an_unreachable_store_is_named_with_its_address():
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    proc = comm("--json", "--timeout", "3",
                env=_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert time.monotonic() - t0 < 3 + 15
    assert proc.returncode == 1
    out = the_json(proc.stdout)
    assert [f["id"] for f in out["findings"]] == ["comm.store-unreachable"]
    assert f"127.0.0.1:{port}" in out["findings"][0]["title"]
    assert out["findings"][0]["evidence"] == ["no answer within 3 s"]


# A daemon thread inside a C++ store call when Python finalizes is killed by pthread_exit through a noexcept
# frame: SIGABRT ("terminate called without an active exception"). CI once saw a passing rank die so, its
# heartbeat thread caught mid-add at exit. A passing rank must leave without finalizing.
_BUSY_STORE_THREAD = """
import datetime, sys, threading
from torch.distributed import TCPStore
from torchdoctor.comm.launch import Launch, free_port
from torchdoctor.comm.session import Options, RankSession

port = free_port()
launch = Launch(0, 1, 0, "127.0.0.1", port, "env")
session = RankSession(launch, Options(backend="gloo", timeout=20, json=True))
if sys.argv[1] == "busy":
    def hammer():
        client = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=20))
        while True:
            client.add("busy", 1)
    started = session.enter  # the store exists once the session has connected: start hammering then
    def enter(name, detail=""):
        started(name, detail)
        if name == "join":
            threading.Thread(target=hammer, daemon=True).start()
    session.enter = enter
session.run()
print("run() returned", flush=True)
"""


@pytest.mark.parametrize("mode", ["quiet", "busy"])
def test_passing_rank_leaves_without_finalizing(mode):
    p = subprocess.run([sys.executable, "-c", _BUSY_STORE_THREAD, mode], capture_output=True, text=True,
                       timeout=120, env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    assert "run() returned" not in p.stdout
    out = the_json(p.stdout)
    assert [r["status"] for r in out["ranks"]] == ["ok"]


def test_closing_the_side_channel_stops_the_heartbeat_thread():
    from torchdoctor.comm.launch import Launch
    from torchdoctor.comm.sidechannel import SideChannel

    ch = SideChannel(Launch(0, 1, 0, "127.0.0.1", free_port(), "env"), timeout=10)
    ch.start_heartbeat()
    time.sleep(0.3)
    assert ch.heartbeats()[0] >= 1
    ch.close()
    assert not ch._beat_thread.is_alive()


def test_one_rank_benchmark_says_its_figures_are_not_a_bandwidth():
    script = """
from torchdoctor.comm.launch import Launch, free_port
from torchdoctor.comm.session import Options, RankSession
RankSession(Launch(0, 1, 0, "127.0.0.1", free_port(), "env"),
            Options(backend="gloo", timeout=20, json=True, bench=True, sizes=[1024], iters=2, warmup=1)).run()
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    out = the_json(p.stdout)
    assert {b["op"] for b in out["bench"]} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    note = [f for f in out["findings"] if f["id"] == "comm.bench-one-rank"]
    assert len(note) == 1 and note[0]["severity"] == "info"


# A store that accepts the connection and never answers: the rank is inside its first store call, before it has a
# side channel, when the signal comes.
_SILENT_STORE = r"""
import json, os, signal, socket, subprocess, sys
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(8)
env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": str(srv.getsockname()[1])}
p = subprocess.Popen([sys.executable, "-m", "torchdoctor", "comm", "--json", "--timeout", "60"], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
srv.settimeout(120)
conn, _ = srv.accept()  # the rank is connecting: torch is imported, the store has not answered
p.send_signal(getattr(signal, sys.argv[1]))
out, err = p.communicate(timeout=120)
print(json.dumps({"rc": p.returncode, "stdout": out, "stderr": err}))
"""


@pytest.mark.parametrize("sig, code, words", [
    ("SIGTERM", 1, "stopped by SIGTERM (launchers stop every rank when one fails)"),
    ("SIGINT", 130, "interrupted by the user (SIGINT, Ctrl-C)"),
])
def test_a_rank_stopped_before_it_reaches_the_store_says_so_and_is_not_unreachable(sig, code, words):
    """Every thread of a rank blocks SIGTERM / SIGINT from before torch's import (torch starts threads of its own):
    the signal is reported, not a silent death by SIGTERM nor, 60 s later, an unreachable store."""
    from bounded import run_bounded

    b = run_bounded([sys.executable, "-c", _SILENT_STORE, sig], mem_bytes=3 << 30, max_procs=64, timeout=300,
                    env=_env())
    assert b.proc.returncode == 0 and not b.timed_out, b.proc.stderr[-2000:]
    report = json.loads(b.proc.stdout.decode().strip().splitlines()[-1])
    assert report["rc"] == code, report
    assert report["stdout"] == "" and "store-unreachable" not in report["stderr"]
    assert report["stderr"] == (f"[rank 1] torchdoctor comm: {words}, before this rank reached the rendezvous store: "
                                "nothing was checked\n")
    assert not b.leftovers

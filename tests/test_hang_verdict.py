"""The verdict's parts on inputs written here: NCCL RAS output in the format NCCL's client writes, the slow-rank rule,
the init_process_group comparison, the class order (a cause before its consequences), and gloo's completion counter
not taken as completion. The real jobs are in tests/test_hang_matrix.py."""

from __future__ import annotations

import json

import pytest

from torchdoctor.comm.hang import ras, slow
from torchdoctor.comm.hang.analyze import analyze
from torchdoctor.comm.hang.dumps import Dumps, RankDump
from torchdoctor.comm.hang.facts import JobFacts, RankFacts
from torchdoctor.comm.hang.init_check import check
from torchdoctor.comm.hang.verdict import judge


def ras_doc(comms: list[dict]) -> str:
    """``ncclras -f json`` as NCCL's src/ras/client_support.cc writes it (jsonWriteHeader ... jsonWriteFooter)."""
    return json.dumps({"nccl_version": "2.28.7", "cuda_runtime_version": 12080, "cuda_driver_version": 12080,
                       "timestamp": "2026-01-01 00:00:00", "communicators_count": len(comms), "communicators": comms,
                       "ras": {"collection_time_sec": 0.012, "timeouts_count": 0}}, indent=2)


def ras_rank(rank: int, allreduce: int, error: int = 0, host: str = "node-a") -> dict:
    counts = {"Broadcast": 1, "Reduce": 0, "AllGather": 4, "ReduceScatter": 0, "AllReduce": allreduce}
    return {"rank": rank, "host": host, "pid": 1000 + rank, "cuda_dev": rank, "nvml_dev": rank,
            "status": {"init_state": 0, "async_error": error, "finalize_called": False, "destroy_flag": False,
                       "abort_flag": False}, "collective_counts": counts}


def test_ras_names_missing_behind_and_failing_ranks():
    text = ras_doc([{"hash": "0x1a2b", "secondary_hash": "0x3:0x4", "size": 4, "ranks_count": 3,
                     "missing_ranks_count": 1,
                     "ranks": [ras_rank(0, 120), ras_rank(1, 119), ras_rank(2, 120, error=6)],
                     "missing_ranks": [{"rank": 3, "host": "node-b", "pid": 2003, "cuda_dev": 3, "nvml_dev": 3,
                                        "status": {"unresponsive": True, "considered_dead": False}}]}])
    comms, why = ras.parse(text)
    assert why is None and len(comms) == 1
    said = "\n".join(ras.lines(comms))
    assert "rank 3 on node-b (pid 2003) is unresponsive" in said
    assert "rank 1 ran 124 collectives, the others up to 125" in said
    assert "rank 2 reports ncclRemoteError" in said
    assert ras.suspects(comms) == [1, 2, 3]
    assert all(line.startswith("NCCL RAS: ") for line in ras.lines(comms))


def test_ras_text_output_and_damaged_json_are_said_not_guessed():
    comms, why = ras.parse("Job summary\n===========\n")  # NCCL 2.24-2.27 write text only
    assert comms == [] and why.startswith("not the JSON ncclras writes")
    comms, why = ras.parse('{"nccl_version": "2.28.7"}')
    assert comms == [] and "no communicators" in why or "without a communicators list" in why
    healthy, _ = ras.parse(ras_doc([{"hash": "0x1", "size": 2, "ranks": [ras_rank(0, 10), ras_rank(1, 10)],
                                     "missing_ranks": []}]))
    assert ras.lines(healthy) == [] and ras.suspects(healthy) == []


def timing(starts: list[float]) -> dict:
    return {"0": [[i + 1, int(t * 1e9), "all_reduce"] for i, t in enumerate(starts)]}


def test_the_slow_rule_names_the_rank_the_others_wait_for_and_nothing_in_a_healthy_job():
    steps = [1.0 + i for i in range(8)]
    fast = timing(steps)
    late = timing([t + 0.6 for t in steps])  # 0.6 s after the others at every collective
    found = slow.find({0: fast, 1: late, 2: timing([t + 0.01 for t in steps])})
    assert found is not None and found.rank == 1 and found.big_at == 8
    assert abs(found.big_lag_s - 0.59) < 0.02 and found.share > 0.9
    jitter = [0.0, 0.003, 0.001, 0.004, 0.0, 0.002, 0.001, 0.003]  # scheduling noise only: nobody is slow
    assert slow.find({0: fast, 1: timing([t + j for t, j in zip(steps, jitter)]), 2: fast}) is None
    short = [1.0 + i * 0.01 for i in range(8)]  # a job of milliseconds: a large share of nothing is no finding
    assert slow.find({0: timing(short), 1: timing([t + 0.005 for t in short])}) is None


def proc(env_rank: int, pid: int, **init) -> RankFacts:
    env = {"RANK": str(env_rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    record = {"backend": "gloo", "rank": None, "world_size": None, "init_method": None, "store": False,
              "env": env, "stack": [["/job/train.py", 12, "setup"]], "done": None, "error": None}
    record.update(init)
    return RankFacts(env_rank, "h", pid, "running", init=record)


def test_init_check_finds_the_odd_world_size_port_and_duplicate_rank():
    found = check([proc(0, 10), proc(1, 11, world_size=4), proc(2, 12)])
    assert found["what"] == "world size" and [c.pid for c in found["culprits"]] == [11]
    assert found["expected"] == 3
    found = check([proc(0, 10), proc(1, 11, init_method="tcp://localhost:29501"), proc(2, 12)])
    assert found["what"] == "address" and [c.pid for c in found["culprits"]] == [11]
    assert found["expected"] == "localhost:29500"  # 127.0.0.1 and localhost are one host
    found = check([proc(0, 10), proc(1, 11, rank=0), proc(2, 12)])
    assert found["what"] == "rank" and [c.pid for c in found["culprits"]] == [11]  # its RANK was 1: it is the odd one
    assert check([proc(0, 10), proc(1, 11), proc(2, 12)]) is None


def entries(n: int, op: str = "all_reduce", last: str | None = None) -> list[dict]:
    out = []
    for seq in range(1, n + 1):
        name = last if last and seq == n else op
        out.append({"collective_seq_id": seq, "is_p2p": False, "process_group": ("0", "default_pg"),
                    "profiling_name": f"gloo:{name}", "input_sizes": [[4]], "input_dtypes": ["Float"],
                    "output_sizes": [[4]], "output_dtypes": ["Float"], "state": "scheduled"})
    return out


def dump(rank: int, n: int, completed: int, reason: str, stack: list, last: str | None = None) -> RankDump:
    fr = {"entries": entries(n, last=last), "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1, 2]"}},
          "pg_status": {"0": {"last_enqueued_collective": n, "last_started_collective": -1,
                              "last_completed_collective": completed}}}
    return RankDump(rank, f"torchdoctor-flight-rank{rank}.json", fr, "h", reason, stack, 100 + rank, "run", 3)


WAIT = [("/job/train.py", 40, "step"), ("/venv/site-packages/torch/distributed/distributed_c10d.py", 3252,
                                           "all_reduce")]


def test_gloo_counting_a_timed_out_collective_as_completed_is_not_taken_for_completion():
    """Every rank timed out in collective 9 (gloo then says 'completed: 9'): not a job where all completed."""
    timeout = "exception: RuntimeError: Timed out waiting 6000ms for recv operation to complete"
    dumps = Dumps({r: dump(r, 9, 9, timeout, WAIT) for r in range(3)})
    [p] = analyze(dumps)
    assert p.seq == 9 and not p.all_completed and p.waiting == [0, 1, 2]
    assert all(c == 8 for c in p.last_completed.values())


def test_a_rank_that_raised_is_the_culprit_and_the_others_timeouts_are_its_consequences():
    timeout = "RuntimeError: Timed out waiting 6000ms for recv operation to complete"
    dumps = Dumps({0: dump(0, 9, 9, "exception: " + timeout, WAIT), 2: dump(2, 9, 9, "exception: " + timeout, WAIT),
                   1: dump(1, 8, 8, "exception: ValueError: bad batch", [("/job/train.py", 30, "load")])})
    job = JobFacts(world_size=3)
    for r in range(3):
        d = dumps.ranks[r]
        how = {"how": "exception", "error": d.reason.partition(": ")[2], "stack": [list(f) for f in d.stack],
               "t": 100.0 + (0 if r == 1 else 6)}
        job.ranks[r] = RankFacts(r, "h", 100 + r, "gone", end=how)
    v = judge(dumps, analyze(dumps), job)
    assert v.cls == "exception" and v.culprits == [1] and v.site == ("/job/train.py", 30, "load")
    text = "\n".join(v.evidence)
    assert "rank 0 then failed with RuntimeError: Timed out" in text and "(a consequence)" in text


def test_a_mismatch_blames_the_minority_and_two_ranks_blame_nobody():
    dumps = Dumps({0: dump(0, 5, 4, "requested", WAIT), 2: dump(2, 5, 4, "requested", WAIT),
                   1: dump(1, 5, 4, "requested", [("/job/train.py", 44, "gather")], last="all_gather")})
    v = judge(dumps, analyze(dumps), JobFacts(world_size=3))
    assert v.cls == "collective-mismatch" and v.culprits == [1] and v.site == ("/job/train.py", 44, "gather")
    two = Dumps({0: dump(0, 5, 4, "requested", WAIT),
                 1: dump(1, 5, 4, "requested", [("/job/train.py", 44, "gather")], last="all_gather")})
    v = judge(two, analyze(two), JobFacts(world_size=2))
    assert v.cls == "collective-mismatch" and v.culprits == [] and "cannot be told" in v.title


def test_a_job_that_moved_when_interrupted_gets_no_hang_verdict_from_a_snapshot():
    dumps = Dumps({0: dump(0, 6, 5, "requested", WAIT), 1: dump(1, 5, 5, "requested", [("/job/t.py", 9, "f")]),
                   2: dump(2, 6, 5, "requested", WAIT)})
    assert judge(dumps, analyze(dumps), JobFacts(world_size=3, settled=True)).cls == "never-arrived"
    assert judge(dumps, analyze(dumps), JobFacts(world_size=3, settled=False)) is None


def test_a_stopped_rank_outranks_the_timeouts_it_caused():
    dumps = Dumps({0: dump(0, 9, 8, "requested", WAIT), 2: dump(2, 9, 8, "requested", WAIT),
                   1: dump(1, 8, 8, "SIGTERM", [("/job/train.py", 50, "main")])})
    job = JobFacts(world_size=3, live=True, how="while it hung")
    job.ranks = {0: RankFacts(0, "h", 100, "running"), 2: RankFacts(2, "h", 102, "running"),
                 1: RankFacts(1, "h", 101, "stopped", state_witness="/proc/101/stat: T", stopped_at=5.0)}
    v = judge(dumps, analyze(dumps), job)
    assert v.cls == "stopped" and v.culprits == [1] and v.site == ("/job/train.py", 50, "main")
    assert v.finding().data["witnesses"] == sorted({"Flight Recorder", "process state", "stack (SIGTERM)",
                                                    "torchdoctor run"})


def test_an_nccl_job_that_hangs_gets_ncclras_asked_and_its_answer_read(tmp_path, monkeypatch):
    """run's watch starts NCCL's own client (here a stand-in on PATH printing the format NCCL writes) when a rank
    uses NCCL, and its answer becomes the job's RAS facts."""
    import os
    import subprocess
    import time

    from torchdoctor.run import flight
    from torchdoctor.run.inside import status
    from torchdoctor.run.watch import Watch

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    doc = ras_doc([{"hash": "0x9", "size": 2, "ranks_count": 1, "missing_ranks_count": 1, "ranks": [ras_rank(0, 7)],
                    "missing_ranks": [{"rank": 1, "host": "node-b", "pid": 77, "cuda_dev": 1, "nvml_dev": 1,
                                       "status": {"unresponsive": True, "considered_dead": True}}]}])
    (bin_dir / "doc.json").write_text(doc)
    tool = bin_dir / "ncclras"
    tool.write_text(f"#!/bin/sh\n[ \"$1 $2\" = '-f json' ] || exit 3\ncat {bin_dir / 'doc.json'}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rank = subprocess.Popen(["sleep", "60"])
    try:
        status.write_json(status.path_for(str(tmp_path), rank.pid), {
            "pid": rank.pid, "rank": 0, "world": 2, "init": {"backend": "nccl", "done": 1.0, "timeout_s": 600},
            "beat": {"t": time.time(), "period": 1.0, "groups": {"0": [7, 7, 6]}, "in_collective": True}})
        w = Watch(str(tmp_path), 2.0, time.monotonic() - 10)
        w.poll(time.monotonic())
        w._request("a test", time.monotonic())
        deadline = time.monotonic() + 30
        while w.step(time.monotonic(), []) != "judge" and time.monotonic() < deadline:
            time.sleep(0.05)
        job, _ = flight.job_facts(w, live=True)
        assert [c.hash for c in job.ras] == ["0x9"], w.notes
        assert ras.lines(job.ras) == ["NCCL RAS: communicator 0x9 (2 ranks): rank 1 on node-b (pid 77) is considered "
                                      "dead"]
    finally:
        rank.kill()
        rank.wait()


def test_status_files_of_another_job_in_the_same_folder_are_not_taken_for_this_ones(tmp_path):
    import subprocess
    import time

    from torchdoctor.run.inside import status
    from torchdoctor.run.watch import Watch

    command, other = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        for pid in (other.pid,):  # a rank of another run sharing --report-dir: alive, not below this command
            status.write_json(status.path_for(str(tmp_path), pid), {"pid": pid, "rank": 0, "init": {"done": 1.0}})
        w = Watch(str(tmp_path), 2.0, time.monotonic())
        w.root = command.pid
        w.poll(time.monotonic())
        assert w.procs == {} and len(w.foreign) == 1
    finally:
        for p in (command, other):
            p.kill()
            p.wait()


@pytest.mark.parametrize("busy_beat, hangs", [({"pending": True}, False), ({"in_collective": True}, True),
                                               ({"in_collective": True, "late": True}, False)])
def test_a_rank_that_computes_with_a_host_backends_collective_pending_is_working(tmp_path, busy_beat, hangs):
    """gloo's recorder says "last completed" late: a rank computing its own code outside any collective can show a
    collective still pending (the beat's ``pending``). Its CPU time then counts as work, and the other rank waiting
    in the next collective is no hang. A rank *inside* a collective (a device backend's sync may spin) stays a wait
    however busy its CPU is: past the threshold, it hangs -- unless its heartbeat is late: a wait hands the GIL over
    and the beat comes on time, so a late one says the main thread is busy in Python, its "inside" from before."""
    import subprocess
    import sys
    import time

    from torchdoctor.run.inside import status
    from torchdoctor.run.watch import Watch

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    waiting = subprocess.Popen(["sleep", "60"])
    try:
        def beats() -> None:  # (each rank's heartbeat, every period; a late one stays 5 s behind)
            for pid, rank, beat in ((busy.pid, 1, dict(busy_beat)), (waiting.pid, 0, {"in_collective": True})):
                status.write_json(status.path_for(str(tmp_path), pid), {
                    "pid": pid, "rank": rank, "world": 2, "init": {"backend": "gloo", "done": 1.0, "timeout_s": 600},
                    "beat": {"t": time.time() - (5.0 if beat.pop("late", False) else 0.0), "period": 0.25,
                             "groups": {"0": [9 - rank, -1, 4 + 4 * (1 - rank)]}, **beat}})

        beats()
        w = Watch(str(tmp_path), 2.0, time.monotonic() - 10)  # (its CPU time is read every second)
        stalled, end = None, time.monotonic() + 5.0
        while time.monotonic() < end and stalled is None:
            now = time.monotonic()
            w.poll(now)
            stalled = w.stalled(now)
            time.sleep(0.05)
            beats()
        assert (stalled is not None) == hangs, (stalled, {k: (p.cpu, p.changed) for k, p in w.procs.items()})
    finally:
        for p in (busy, waiting):
            p.kill()
            p.wait()


@pytest.mark.parametrize("host, inside", [(True, False), (False, True)])
def test_a_lagging_completion_counter_is_pending_on_a_host_backend_and_inside_on_a_device_one(tmp_path, monkeypatch,
                                                                                             host, inside):
    """The beat of a rank running its own line while the recorder says 8 entered, 4 completed: on gloo the stack is
    believed (a gloo collective holds the main thread in torch.distributed), so it is pending, not inside; on NCCL the
    main thread blocks anywhere after the launch, so it is inside."""
    from torchdoctor.run.inside import beat, status

    monkeypatch.setattr(beat, "fr_counters", lambda: {"0": [8, -1, 4]})
    monkeypatch.setattr(beat, "host_backend", lambda: host)
    monkeypatch.setattr(beat, "main_stack", lambda: [["/job/train.py", 73, "evaluate"]])
    b = beat.Beat(str(tmp_path), 0.25, lambda why, stack: None)
    b.tick()
    doc = status.read_json(b.path)["beat"]
    assert (doc["in_collective"], doc["pending"]) == (inside, not inside)
    monkeypatch.setattr(beat, "main_stack", lambda: [["/job/train.py", 77, "reduce"],
                                                     ["/site-packages/torch/distributed/c10d.py", 9, "all_reduce"]])
    b.tick()
    assert status.read_json(b.path)["beat"]["in_collective"] is True


def test_a_rank_that_leaves_a_collective_has_moved_and_a_due_heartbeat_holds_the_verdict(tmp_path):
    """What a rank does now is known from its last heartbeat, a period old at best. A beat that says it left the
    collective it was in (gloo's recorder has not counted it completed yet: same counters) is progress; and while a
    running rank's next beat is due and not seen, nothing is judged on its last one -- until that beat is late (a main
    thread holding the GIL), when the rank is judged by what it does (here: asleep, so the job hangs)."""
    import subprocess
    import time

    from torchdoctor.run import watch as watch_mod
    from torchdoctor.run.inside import status
    from torchdoctor.run.watch import Watch

    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]

    def beat(i: int, age: float, inside: bool) -> None:
        status.write_json(status.path_for(str(tmp_path), ranks[i].pid), {
            "pid": ranks[i].pid, "rank": i, "world": 2, "init": {"backend": "gloo", "done": 1.0, "timeout_s": 600},
            "beat": {"t": time.time() - age, "period": 1.0, "groups": {"0": [8 + i, -1, 8]}, "in_collective": inside}})

    try:
        beat(0, 0.0, True)
        beat(1, 0.0, True)
        w = Watch(str(tmp_path), 2.0, time.monotonic() - 10)
        t0 = time.monotonic()
        w.poll(t0)
        key = next(k for k, p in w.procs.items() if p.rank == 1)
        beat(1, 0.0, False)  # out of the collective, counters unchanged
        w.next_poll = 0.0
        w.poll(t0 + 1.0)
        assert w.procs[key].changed == t0 + 1.0
        beat(1, 0.0, True)  # into the next one: progress too
        w.next_poll = 0.0
        w.poll(t0 + 1.5)
        assert w.procs[key].changed == t0 + 1.5
        # both inside, no progress for 2.5 s, and rank 1's beat 1.8 s old: due, not late -- no verdict yet
        beat(0, 0.0, True)
        beat(1, 1.0 + watch_mod.DUE_SLACK_S + 0.3, True)
        w.next_poll = 0.0
        w.poll(t0 + 4.0)
        assert w.procs[key].beat_due() and w.stalled(t0 + 4.0) is None
        beat(1, 0.2, True)  # the beat came: still inside; the verdict is due
        w.next_poll = 0.0
        w.poll(t0 + 4.0)
        assert w.stalled(t0 + 4.1) is not None
        beat(1, watch_mod.LATE_BEATS * 1.0 + 1.0, True)  # late, and its process asleep: a wait all the same
        w.next_poll = 0.0
        w.poll(t0 + 4.2)
        assert not w.procs[key].beat_due() and w.stalled(t0 + 4.2) is not None
    finally:
        for p in ranks:
            p.kill()
            p.wait()

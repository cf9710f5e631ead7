"""Hang post-mortems from PyTorch's Flight Recorder: a healthy job, a job with the recorder off, one with the hook off
under ``torchdoctor run`` (the fault matrix is tests/test_hang_matrix.py), folders of dumps read by ``torchdoctor
logs``, and the unpickler that refuses any object."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest

from runs import PY, ids, the, torchdoctor_run
from torchdoctor.comm.hang import post_mortem
from torchdoctor.comm.hang.dumps import NotPlainData, plain_loads, read_folder

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fault_worker.py")
TORCHRUN = (PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node")


def hung(tmp_path, mode: str, ranks: int = 3, *extra: str, **env: str):
    return torchdoctor_run(tmp_path, "--report-dir", str(tmp_path / "rep"), *extra, "--", *TORCHRUN, str(ranks),
                           WORKER, mode, timeout=180, OMP_NUM_THREADS="1", HANG_TIMEOUT="4", **env)


def test_a_job_that_ends_well_gets_no_comm_finding_and_leaves_no_file(tmp_path):
    rc, rep, _, err = hung(tmp_path, "ok", 2)
    assert rc == 0, err[-2000:]
    assert not any(i.startswith("comm.") for i in ids(rep))
    assert not (tmp_path / "rep").exists() or os.listdir(tmp_path / "rep") == []


def test_with_the_recorder_off_the_ranks_stacks_still_name_the_rank_outside(tmp_path):
    """No --hang-after: the threshold is a quarter of the job's 4 s collective timeout; no collective is recorded,
    so the progress is read from the ranks' stacks and the culprit from where each stands."""
    rc, rep, _, _ = hung(tmp_path, "sleep", 3, TORCH_FR_BUFFER_SIZE="0")
    head = rep["findings"][0]
    assert head["id"] == "comm.never-arrived" and head["data"]["culprit_ranks"] == [1]
    assert head["data"]["call_site_function"] == "load_batch"
    evidence = "\n".join(head["evidence"])
    assert "Flight Recorder: off" in evidence and evidence.startswith("torchdoctor run: judged while it hung")
    stacks = the(rep, "comm.flight-stacks")
    assert "comm.flight-records" not in ids(rep)
    text = "\n".join(stacks["evidence"])
    assert "rank 1 (requested by torchdoctor run" in text and "in load_batch" in text and "in reduce_grads" in text


def test_no_flight_leaves_the_job_alone(tmp_path):
    rc, rep, _, _ = hung(tmp_path, "sleep", 2, "--no-flight")
    assert not [f for f in rep["findings"] if f["data"].get("class")]
    assert not (tmp_path / "rep").exists() or not os.listdir(tmp_path / "rep")


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > " + os.devnull,))


def test_the_unpickler_builds_plain_data_and_refuses_any_object():
    plain = {"entries": [{"collective_seq_id": 1, "input_sizes": [[4]], "frames": [("a.py", 3, "f")]}],
             "version": "2.10", "pg_config": {"0": {"ranks": "[0, 1]"}}, "x": {1.5, 2}, "b": b"\x00"}
    assert plain_loads(pickle.dumps(plain)) == plain
    with pytest.raises(NotPlainData, match="posix.system|os.system"):
        plain_loads(pickle.dumps(Boom()))
    with pytest.raises(NotPlainData, match="collections.OrderedDict"):
        plain_loads(pickle.dumps(__import__("collections").OrderedDict(a=1)))


def entry(seq: int, op: str = "all_reduce", sizes=((4,),), state: str = "completed") -> dict:
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "process_group": ("0", "default_pg"),
            "profiling_name": f"nccl:{op}", "input_sizes": [list(s) for s in sizes], "input_dtypes": ["Float"],
            "output_sizes": [list(s) for s in sizes], "output_dtypes": ["Float"], "state": state,
            "frames": [{"name": "train_step", "filename": "/job/train.py", "line": 40 + seq}]}


def nccl_dump(folder, rank: int, entries: list[dict], ranks="[0, 1, 2, 3]", name="nccl_trace_rank_") -> None:
    doc = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
           "pg_status": {}, "entries": entries}
    (folder / f"{name}{rank}").write_bytes(pickle.dumps(doc))


def test_logs_reads_a_folder_of_dumps_someone_collected_and_says_what_it_could_not_read(tmp_path, capsys):
    from torchdoctor.cli import main

    folder = tmp_path / "dumps"
    folder.mkdir()
    for r in (0, 1, 3):  # NCCL's own pickles: rank 2 stopped after collective 6; 0, 1 and 3 wait in 7
        nccl_dump(folder, r, [entry(s) for s in range(1, 7)] + [entry(7, state="started")])
    nccl_dump(folder, 2, [entry(s) for s in range(1, 7)])
    (folder / "nccl_trace_rank_4").write_bytes(pickle.dumps(Boom()))  # an object: refused, never run
    (folder / "nccl_trace_rank_5").write_bytes(pickle.dumps({"entries": []})[:-5])  # truncated
    nccl_dump(folder, 6, [entry(1)], ranks="[0, 1, 2, 3, 4, 5, 6, 7]", name="other_rank_")  # another job's
    capsys.readouterr()
    rc = main(["logs", "--json", str(folder)])
    result = json.loads(capsys.readouterr().out)
    assert rc == 1
    hang = result["findings"][0]
    assert hang["id"] == "comm.never-arrived" and hang["data"]["culprit_ranks"] == [2]
    assert hang["data"]["missing"] == [2] and hang["data"]["seq"] == 7 and hang["data"]["waiting"] == [0, 1, 3]
    assert "/job/train.py:47 in train_step" in "\n".join(hang["evidence"])  # (NCCL's pickles keep the frames)
    assert hang["evidence"][0] == "dumps alone: judged after the job ended"
    problems = next(f for f in result["findings"] if f["id"] == "comm.dump-unreadable")["evidence"]
    assert any(p.startswith("nccl_trace_rank_4: a pickle that is not a plain dump") for p in problems)
    assert any(p.startswith("nccl_trace_rank_5: a truncated or damaged pickle") for p in problems)
    assert any(p.startswith("other_rank_6: rank 6 is from another run") for p in problems)


def test_an_all_to_all_is_decided_by_what_all_ranks_send_and_receive(tmp_path):
    folder = tmp_path / "a2a"
    folder.mkdir()
    split = {0: ((6,),), 1: ((2,),)}
    for r in (0, 1):  # per-rank sizes differ by design: 8 elements sent, 8 received -- consistent
        e = entry(1, "all_to_all", split[r])
        e["output_sizes"] = [[4]]
        nccl_dump(folder, r, [e, entry(2)], ranks="[0, 1]")
    assert [f.id for f in post_mortem(str(folder))] == ["comm.flight-records"]
    e = entry(1, "all_to_all", ((6,),))
    e["output_sizes"] = [[5]]  # 12 sent, 9 received: a real mismatch
    nccl_dump(folder, 0, [e, entry(2)], ranks="[0, 1]")
    found = {f.id: f for f in post_mortem(str(folder))}
    assert found["comm.collective-mismatch"].data["state"] == "SIZE_OR_SYNTAX_MISMATCH"


def test_ranks_that_left_no_dump_keep_the_verdict_from_saying_all_is_well(tmp_path):
    """torchdoctor's own dumps carry the job's rank count: two of four ranks dumped and agree -- not an OK."""
    for r in (0, 3):
        (tmp_path / f"torchdoctor-flight-rank{r}.json").write_text(json.dumps({
            "rank": r, "world_size": 4, "reason": "SIGTERM", "stack": [["/job/train.py", 9, "step"]],
            "run_id": "job-1", "fr": {"version": "2.10", "pg_config": {"0": {"ranks": "[]"}}, "pg_status": {},
                                      "entries": [entry(1), entry(2)]}}))
    found = {f.id: f for f in post_mortem(str(tmp_path))}
    assert set(found) == {"comm.flight-incomplete"}
    assert found["comm.flight-incomplete"].data["no_dump"] == [1, 2]


def test_a_dump_folder_with_nothing_in_it_is_nothing(tmp_path):
    assert post_mortem(str(tmp_path)) == []
    (tmp_path / "notes.txt").write_text("hello")
    assert read_folder(str(tmp_path)).problems == []
    io.BytesIO()  # (keeps the import honest)

"""The fault matrix: real 3-rank gloo jobs under ``torchdoctor run -- torchrun ...`` (tests/fault_worker.py), one fault
on rank 1 at step 3 each, judged as a new user would read the report: the first finding is the headline -- the
culprit rank, the class, the culprit's own call site (the line the worker marks ``# site: <case>``) --, no other FAIL
blames another rank, the exit code is the job's, and no process is left behind.

Three ranks where a majority tells the culprit from the others, two elsewhere. Hangs are judged while they hang
(``--hang-after 2``, the collectives' timeout 10 s: the verdict comes first);
failures that end the job by themselves are judged after it ended. Then the same on Ctrl-C and SIGTERM sent to
``run`` while the job hangs, and after the collectives' own timeout (``--hang-after off``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from bounded import run_bounded
from runs import PY, SRC

HERE = Path(__file__).resolve().parent
WORKER = HERE / "fault_worker.py"
TORCHRUN = (PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node")
#: three ranks where a majority tells the culprit from the innocent, two where one rank is enough to blame wrongly
RANKS = {"skip": 3, "other-op": 3, "sleep": 3, "transport": 3}
CLASS = {"skip": "collective-mismatch", "other-op": "collective-mismatch", "sleep": "never-arrived",
         "stop": "stopped", "kill": "killed", "exit0": "exited-early", "raise": "exception", "slow": "slow",
         "init-world": "init-mismatch", "init-port": "init-mismatch", "transport": "transport"}


def site(case: str) -> str:
    for i, line in enumerate(WORKER.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# site: {case}"):
            return f"{WORKER}:{i}"
    raise AssertionError(case)


def env(**more: str) -> dict:
    out = {k: v for k, v in os.environ.items() if k != "TORCHDOCTOR_REPORT_DIR"}
    out.update({"PYTHONPATH": SRC, "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "HANG_TIMEOUT": "10", **more})
    return out


def job(case: str) -> list[str]:
    return [*TORCHRUN, str(RANKS.get(case, 2)), str(WORKER), case]


def judge(tmp_path: Path, case: str, *extra: str, **more: str) -> tuple[int, dict, str, list[int]]:
    rep = tmp_path / "report.json"
    r = run_bounded([PY, "-m", "torchdoctor", "run", "--report-dir", str(tmp_path / "rep"), "--json", str(rep), *extra,
                     "--", *job(case)], env=env(**more), cwd=str(tmp_path), timeout=150, mem_bytes=6 << 30,
                    max_procs=128, settle_s=2.0)
    err = r.proc.stderr.decode("utf-8", "replace")
    assert not r.timed_out, err[-3000:]
    return r.proc.returncode, json.loads(rep.read_text()), err, r.leftovers


def headline(report: dict, case: str, err: str) -> dict:
    """The first finding is the verdict, as the issue defines one: culprit, class, call site, with its witnesses."""
    first = report["findings"][0]
    cls = CLASS[case]
    assert first["id"] == f"comm.{cls}" and first["data"]["class"] == cls, (first["title"], err[-3000:])
    assert first["severity"] == ("warn" if case == "slow" else "fail")
    assert first["data"]["culprit_ranks"] == ([] if case == "transport" else [1]), first["title"]
    assert first["data"]["witnesses"], first
    others = [f for f in report["findings"][1:] if f["severity"] == "fail"]
    for f in others:  # consistent with it, never a second culprit
        assert not f["data"].get("class"), f["title"]
        named = {int(n) for n in re.findall(r"\brank (\d+)\b", f["title"])}
        assert named <= {1}, f["title"]
    return first


@pytest.mark.parametrize("case", ["skip", "other-op", "sleep", "init-world", "init-port"])
def test_a_hang_is_judged_while_it_hangs_and_the_job_is_ended(tmp_path, case):
    rc, report, err, left = judge(tmp_path, case, "--hang-after", "2")
    first = headline(report, case, err)
    assert first["data"]["call_site"] == site(case), first["title"]
    assert first["evidence"][0].startswith("torchdoctor run: judged while it hung: no progress for")
    # said at once, before the job was ended: the first line run prints, then the same headline
    live = err.index("torchdoctor run: while it hung")
    assert first["title"] in err[live:live + 2000]
    assert rc != 0 and left == [], (rc, left)
    exit_finding = next(f for f in report["findings"] if f["id"] == "process.exit")
    assert exit_finding["severity"] == "info" and "torchdoctor run ended the job" in exit_finding["title"]
    files = os.listdir(tmp_path / "rep")
    assert not [n for n in files if n.startswith(("torchdoctor-rank-", "torchdoctor-request"))]  # (bookkeeping)
    if not case.startswith("init"):  # every rank answered: its dump, with where it was
        assert sorted(n for n in files if n.startswith("torchdoctor-flight-rank")) == [
            f"torchdoctor-flight-rank{r}.json" for r in range(RANKS.get(case, 2))]


@pytest.mark.parametrize("case", ["kill", "exit0", "raise", "transport"])
def test_a_failure_that_ends_the_job_is_named_after_it(tmp_path, case):
    rc, report, err, left = judge(tmp_path, case, "--hang-after", "2")
    first = headline(report, case, err)
    states = first["data"]["process_states"]
    assert set(states) == {str(r) for r in range(RANKS.get(case, 2))} and all(s["pid"] for s in states.values())
    assert rc != 0 and left == [], (rc, left)
    if case == "kill":
        # nothing runs in a SIGKILLed process: where it was comes from its last heartbeat, said as such
        assert first["data"]["call_site"].startswith(f"{WORKER}:")
        text = "\n".join(first["evidence"])
        assert "its last heartbeat" in text and "launcher log: " in text and "exitcode: -9" in text
        assert first["data"]["oom"] is False or "kernel log: " in text  # the OOM killer only where the kernel says
    else:
        assert first["data"]["call_site"] == site(case), first["title"]
    if case == "transport":
        assert "no rank is behind" in first["title"]


def test_a_rank_that_computes_while_the_others_wait_is_not_taken_for_a_hang(tmp_path):
    """Rank 1 computes for 6 s (an evaluation) while rank 0 waits in the next collective: past --hang-after 2, but a
    rank that keeps a CPU busy is working; the job ends well, and the wait is said, as a slow rank."""
    rc, report, err, left = judge(tmp_path, "busy", "--hang-after", "2", BUSY_S="6")
    assert rc == 0 and left == [], err[-3000:]
    assert "torchdoctor run: while it hung" not in err
    assert not [f for f in report["findings"] if f["severity"] == "fail"]
    first = report["findings"][0]
    assert first["id"] == "comm.slow" and first["data"]["culprit_ranks"] == [1]
    assert first["data"]["call_site"] == site("busy")


def test_a_rank_that_holds_the_others_back_is_named_with_where_its_time_went(tmp_path):
    rc, report, err, left = judge(tmp_path, "slow", "--hang-after", "2", STEPS="4", SLOW_S="0.5")
    first = headline(report, "slow", err)
    assert rc == 0 and left == []
    assert first["data"]["call_site"] == site("slow") and first["data"]["lag_at"] >= 4
    assert 0.3 < first["data"]["lag_s"] < 2.0  # (its 0.5 s sleep per step, as the others waited for it)
    assert not (tmp_path / "rep").exists() or not os.listdir(tmp_path / "rep")  # a job that ended well: no file


SIGNAL_DRIVER = r'''
import json, os, signal, subprocess, sys, time
sig, case, *cmd = sys.argv[1:]
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
seen = b""
while seen.count(b"step 3") < int(sys.argv[-3]):  # every rank started step 3: the job hangs there
    chunk = os.read(p.stdout.fileno(), 4096)
    if not chunk:
        break
    seen += chunk
time.sleep(3.0)
sent = time.time()
os.kill(p.pid, getattr(signal, sig))
out, err = p.communicate(timeout=120)
print(json.dumps({"rc": p.returncode, "after_signal_s": time.time() - sent, "err": err.decode(errors="replace")}))
'''


@pytest.mark.parametrize("sig, case", [("SIGINT", "sleep"), ("SIGTERM", "stop")])
def test_ctrl_c_or_sigterm_on_a_hung_job_gives_the_verdict_and_ends_every_rank(tmp_path, sig, case):
    """No --hang-after: the signal alone makes run collect the ranks' state, say the verdict, and end the job -- the
    stopped rank included -- long before the collectives' 60 s timeout would have."""
    rep = tmp_path / "report.json"
    cmd = [PY, "-m", "torchdoctor", "run", "--report-dir", str(tmp_path / "rep"), "--json", str(rep),
           "--hang-after", "off", "--", *job(case)]
    r = run_bounded([sys.executable, "-c", SIGNAL_DRIVER, sig, case, *cmd], env=env(HANG_TIMEOUT="60"),
                    cwd=str(tmp_path), timeout=150, mem_bytes=6 << 30, max_procs=128, settle_s=2.0)
    assert not r.timed_out and r.proc.returncode == 0, r.proc.stderr[-3000:]
    got = json.loads(r.proc.stdout)
    report = json.loads(rep.read_text())
    first = headline(report, case, got["err"])
    assert first["data"]["call_site"] == site(case)
    assert first["evidence"][0] == f"torchdoctor run: judged when torchdoctor run got {sig}"
    assert got["rc"] != 0 and got["after_signal_s"] < 60 and r.leftovers == [], (got["rc"], r.leftovers)


def test_after_the_collectives_time_out_a_skipped_collective_is_still_the_culprits(tmp_path):
    """--hang-after off: the ranks time out (gloo then counts that collective as completed: not believed), torchrun
    ends them; the verdict is made from their dumps and status files."""
    rc, report, err, left = judge(tmp_path, "skip", "--hang-after", "off", HANG_TIMEOUT="4")
    first = headline(report, "skip", err)
    assert first["data"]["call_site"] == site("skip") and first["evidence"][0] == (
        "torchdoctor run: judged after the job ended")
    assert rc != 0 and left == []
    consequences = [f for f in report["findings"] if "a consequence of comm.collective-mismatch" in f["title"]]
    assert consequences and all(f["severity"] == "info" for f in consequences)

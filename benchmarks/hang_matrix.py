"""The fault matrix: one fault on rank 1 of a 3-rank gloo job (tests/fault_worker.py), judged four ways, side by side.

Run from the repository root::

    .venv/bin/python benchmarks/hang_matrix.py                 # every case, about 6 minutes on 2 cores
    .venv/bin/python benchmarks/hang_matrix.py --cases sleep stop --json
    .venv/bin/python benchmarks/hang_matrix.py --overhead 2000 --reps 5    # a healthy job: the hook's cost

For each case (``skip`` ... ``transport``, see tests/fault_worker.py; collective timeout 6 s):

* **torchrun**: the job alone. Time from the fault (the faulty rank prints ``fault <time>``) to the launcher's exit,
  and the rank torchrun's "Root Cause" names.
* **run live**: ``torchdoctor run --hang-after 2``: time from the fault to the first line of ``run``'s verdict on
  stderr (printed while the job hangs, or after it ends when it ends first), the class and culprit of the first
  FAIL/WARN finding, and whether its call site is the line the worker marks ``# site: <case>``.
* **run after**: ``torchdoctor run --hang-after off``: the verdict after the job ended on its own (the collectives'
  timeout), same columns.
* **torchfrtrace**: PyTorch's own Flight Recorder analyzer (``torchfrtrace``, shipped with torch) on the dumps the
  "run after" job left (written out as Flight Recorder's pickles, ``fr_<rank>``): its first line that names a
  problem, or how it failed.

Leftover processes (any process of the run -- found by a marker in its environment -- still alive 2 s after the
command) are counted for every run, then ended.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fault_worker.py")
PY = sys.executable
CASES = ("skip", "other-op", "sleep", "stop", "kill", "exit0", "raise", "slow", "init-world", "init-port",
         "transport")
EXPECTED = {"skip": "collective-mismatch", "other-op": "collective-mismatch", "sleep": "never-arrived",
            "stop": "stopped", "kill": "killed", "exit0": "exited-early", "raise": "exception", "slow": "slow",
            "init-world": "init-mismatch", "init-port": "init-mismatch", "transport": "transport"}
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3", WORKER]


def site_line(case: str) -> int | None:
    with open(WORKER) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# site: {case}"):
                return i
    return None


MARKER = "TORCHDOCTOR_BENCH_RUN"


def marked(value: str) -> list[int]:
    """Processes of this run (its marker in their environment): whatever session they moved to, and no one else's."""
    needle = f"{MARKER}={value}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                continue
    return out


def timed_run(cmd: list[str], env: dict, limit: float = 150.0) -> dict:
    """Run ``cmd``; every output line with the time it arrived; its processes still alive 2 s after it ended."""
    t0 = time.time()
    mark = f"{os.getpid()}-{t0}"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, MARKER: mark},
                         start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, "out")
    sel.register(p.stderr, selectors.EVENT_READ, "err")
    lines: list[tuple[float, str, str]] = []
    partial = {"out": b"", "err": b""}
    open_ = 2
    while open_ and time.time() - t0 < limit:
        for key, _ in sel.select(0.5):
            data = os.read(key.fileobj.fileno(), 65536)
            if not data:
                sel.unregister(key.fileobj)
                open_ -= 1
                continue
            now = time.time()
            buf = partial[key.data] + data
            *done, partial[key.data] = buf.split(b"\n")
            lines += [(now, key.data, ln.decode("utf-8", "replace")) for ln in done]
    try:
        rc = p.wait(timeout=max(1.0, limit - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
    end = time.time()
    time.sleep(2.0)
    left = marked(mark)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return {"rc": rc, "t0": t0, "end": end, "lines": lines, "leftover": len(left)}


def fault_time(r: dict) -> float | None:
    for _, _, ln in r["lines"]:
        m = re.search(r"fault (\d+\.\d+)", ln)
        if m:
            return float(m.group(1))
    return None


def plain(case: str, env: dict) -> dict:
    r = timed_run(TORCHRUN + [case], env)
    text = "\n".join(ln for _, _, ln in r["lines"])
    m = re.search(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", text, re.S)
    ft = fault_time(r)
    return {"rc": r["rc"], "root_cause_rank": int(m.group(1)) if m else None,
            "fault_to_exit_s": round(r["end"] - ft, 1) if ft else None, "wall_s": round(r["end"] - r["t0"], 1),
            "leftover": r["leftover"]}


def judged(case: str, env: dict, hang_after: str, folder: str) -> dict:
    rep = os.path.join(folder, "report.json")
    dumps = os.path.join(folder, "dumps")
    cmd = [PY, "-m", "torchdoctor", "run", "--report-dir", dumps, "--json", rep, "--hang-after", hang_after, "--",
           *TORCHRUN, case]
    r = timed_run(cmd, env)
    ft = fault_time(r)
    verdict_at = next((t for t, s, ln in r["lines"] if s == "err" and (
        ln.startswith("torchdoctor run: ") or ln.startswith("--- torchdoctor run:"))), None)
    out = {"rc": r["rc"], "leftover": r["leftover"], "wall_s": round(r["end"] - r["t0"], 1),
           "fault_to_verdict_s": round(verdict_at - ft, 1) if ft and verdict_at else None}
    try:
        with open(rep) as f:
            findings = json.load(f)["findings"]
    except (OSError, ValueError, KeyError):
        return {**out, "error": "no report"}
    head = next((f for f in findings if f["severity"] in ("fail", "warn")), None)
    if head is None:
        return {**out, "class": None}
    data = head["data"]
    line = site_line(case)
    site = data.get("call_site") or ""
    fails = [f for f in findings if f["severity"] == "fail"]
    out.update({"id": head["id"], "class": data.get("class"), "culprits": data.get("culprit_ranks"),
                "call_site": os.path.basename(site),
                "site_right": bool(line) and site.endswith(f"fault_worker.py:{line}"),
                "right_class": data.get("class") == EXPECTED[case], "other_fails": [f["id"] for f in fails[1:]]})
    return out


def frtrace(folder: str, repair: bool = False) -> dict:
    """torchfrtrace on the dumps of a run: ours (JSON, with the records as Flight Recorder dumped them) as pickles.
    ``repair``: gloo's default group is dumped under the name '' in pg_config (its entries say '0'), which
    torchfrtrace 2.13 cannot look up; renamed to '0' / 'default_pg' to see what it says past that."""
    dumps = os.path.join(folder, "dumps")
    tr = os.path.join(folder, "fr-repaired" if repair else "fr")
    os.makedirs(tr, exist_ok=True)
    n = 0
    for name in sorted(os.listdir(dumps)) if os.path.isdir(dumps) else ():
        m = re.match(r"torchdoctor-flight-rank(\d+)\.json$", name)
        if not m:
            continue
        with open(os.path.join(dumps, name)) as f:
            fr = json.load(f).get("fr")
        if fr and repair and "" in (fr.get("pg_config") or {}):
            fr["pg_config"]["0"] = {**fr["pg_config"].pop(""), "name": "0", "desc": "default_pg"}
        if fr:
            with open(os.path.join(tr, f"fr_{m.group(1)}"), "wb") as f:
                pickle.dump(fr, f)
            n += 1
    exe = shutil.which("torchfrtrace") or os.path.join(os.path.dirname(PY), "torchfrtrace")
    if not n:
        return {"dumps": 0, "says": "no dumps to read"}
    p = subprocess.run([exe, tr, "-p", "fr_", "--allow-incomplete-ranks"], capture_output=True, text=True,
                       timeout=120)
    text = (p.stdout + p.stderr).strip().splitlines()
    said = [ln for ln in text if re.search(r"mismatch|missing|not|error|Error|rank", ln)
            and "tabulate" not in ln][:2]
    return {"dumps": n, "rc": p.returncode, "says": " / ".join(s.strip()[:160] for s in said) or
            (text[-1][:160] if text else "")}


def overhead(env: dict, steps: int, reps: int) -> dict:
    """A healthy job's loop time under ``torchdoctor run`` with its default flight hook (heartbeat every second)
    against ``--no-flight``, the two alternating, first one rotating; the median of each and of the per-pair ratio."""
    import statistics

    times: dict[str, list[float]] = {"flight": [], "no-flight": []}
    ratios = []
    for i in range(reps):
        pair = {}
        for variant in (("flight", "no-flight") if i % 2 == 0 else ("no-flight", "flight")):
            with tempfile.TemporaryDirectory(prefix="hang-overhead-") as tmp:
                cmd = [PY, "-m", "torchdoctor", "run", "--report-dir", tmp,
                       *(["--no-flight"] if variant == "no-flight" else []), "--", *TORCHRUN, "ok"]
                r = timed_run(cmd, {**env, "STEPS": str(steps)})
            loop = next(float(m.group(1)) for _, _, ln in r["lines"] if (m := re.match(r"loop (\S+) s", ln)))
            times[variant].append(loop)
            pair[variant] = loop
        ratios.append(pair["flight"] / pair["no-flight"])
    return {"steps": steps, "reps": reps, **{f"{k}_median_s": round(statistics.median(v), 3) for k, v in times.items()},
            "ratio_median": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--overhead", type=int, metavar="STEPS", default=0,
                    help="instead: a healthy job of STEPS steps with the hook against --no-flight (--reps pairs)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src"), "NO_COLOR": "1",
           "STEPS": "8"}
    if args.overhead:
        print(json.dumps(overhead(env, args.overhead, args.reps)))
        return
    rows = []
    for case in args.cases:
        with tempfile.TemporaryDirectory(prefix="hang-matrix-") as tmp:
            live_dir, after_dir = os.path.join(tmp, "live"), os.path.join(tmp, "after")
            os.makedirs(live_dir)
            os.makedirs(after_dir)
            row = {"case": case, "expected": EXPECTED[case], "torchrun": plain(case, env),
                   "live": judged(case, env, "2", live_dir), "after": judged(case, env, "off", after_dir)}
            row["torchfrtrace"] = frtrace(after_dir)
            row["torchfrtrace_repaired"] = frtrace(after_dir, repair=True)
        rows.append(row)
        if not args.json:
            print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

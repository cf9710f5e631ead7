"""Real programs nobody here wrote, faults from step 0 and from a later step (issue 31).

Given a checkout of a public training program, this runs its own training script at a tiny size on CPU
under ``torchdoctor run --numerics`` with one fault at a time, and judges each verdict against the fault
it injected:

  a<k>  fp16 overflow: one layer's weight scaled (before training forward k) so its largest value is
        3e4 -- it still fits fp16, as a bf16-pretrained checkpoint's large weights do -- and its fp16
        output overflows; the program's own fp16 recipe (autocast, and its GradScaler where it has one)
  b<k>  a NaN in one value of the batch of step k (the program's data path)
  c0    an invalid op only in the backward: ``torch.where(x > 0, x.sqrt(), 0)`` (sqrt of a negative in
        the branch not taken: the forward is finite, the backward is 0 * nan) in place of one line of the
        model's activation (nanoGPT's MLP, timm's BasicBlock), after the encoder in the Lightning README's
        training_step, or as the activation module of the HF model
  d     healthy, same recipe: must be silent

Each stop's printed fix is then applied in a second run (``keep_fp32`` regions, bf16, or the repaired
line) to see whether it trains. Only small patches are kept here, as data (a file, the text of one line,
what it becomes); the program's code is read from the checkout given on the command line and copied,
patched, to a temporary folder. Nothing of the checkout is changed.

  python benchmarks/real_programs.py nanogpt  /path/to/nanoGPT                 [--json FILE]
  python benchmarks/real_programs.py timm     /path/to/pytorch-image-models    [--json FILE]
  python benchmarks/real_programs.py lightning /path/to/pytorch-lightning      (the README's LitAutoEncoder)
  python benchmarks/real_programs.py hf       -                                (transformers' Trainer, ViT)

timm needs torchvision and Pillow importable (``--extra-path DIR`` adds a folder to the programs'
``sys.path``); the Lightning README example needs torchvision imported too (it is not used for data here).
The programs, their patches and the fault injector are kept as data in real_programs_drivers.py; this file
runs them and judges each verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

from real_programs_drivers import API_VARIANT, PROGRAMS, Case, Program

VENV_BIN = os.path.dirname(sys.executable)
TORCHDOCTOR = os.path.join(VENV_BIN, "torchdoctor")


# --- running and judging -----------------------------------------------------------------------------------
def run_once(prog: Program, case: Case, variant: str, fault: dict, flags: dict, tag: str, timeout: float) -> dict:
    rep = os.path.join(prog.work, "reports", f"{case.name}-{variant}-{tag}")
    js = rep + ".json"
    c = Case(case.name, fault, flags, case.expect)
    inner = prog.command(c, variant)
    if variant == "switch":
        cmd = [TORCHDOCTOR, "run", "--numerics", "--report-dir", rep, "--json", js, "--"] + inner
    else:  # the program's own callback (api): run still reads the reports the callback writes
        cmd = [TORCHDOCTOR, "run", "--report-dir", rep, "--json", js, "--"] + inner
    env = prog.env()
    env["TDFAULT"] = json.dumps(fault)
    env.update(getattr(prog, "case_env", lambda c, v: {})(c, variant))
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=prog.work)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    res = {"rc": rc, "seconds": round(time.time() - t0, 1), "cmd": cmd, "findings": [], "nonfinite": None}
    m = re.findall(r"\[tdfault\] summary (\{.*\})", out)
    res["summary"] = json.loads(m[-1]) if m else None
    res["injected"] = re.findall(r"\[tdfault\] (scaled .*|NaN put .*|applied keep_fp32 .*|keep_fp32 as printed .*)",
                                 out)
    try:
        with open(js) as f:
            report = json.load(f)
        res["findings"] = [(f["id"], f["severity"]) for f in report.get("findings", [])]
        for f in report.get("findings", []):
            if f["id"] == "numerics.nonfinite":
                res["nonfinite"] = f.get("data") or {}
                res["title"] = f.get("title")
            if f["id"] == "numerics.scaler_never_stepped":
                res["never_stepped"] = f.get("title")
    except (OSError, ValueError):
        res["tail"] = out[-3000:]
    if res["nonfinite"] is None and rc not in (0,):
        res["tail"] = out[-3000:]
    return res


def judge(case: Case, res: dict, fix_res: dict | None) -> tuple[str, list[str]]:
    """right / partly / wrong, with the reasons (each a field checked against what was injected)."""
    e, nf, why = case.expect, res.get("nonfinite"), []
    bad = [f for f, s in res["findings"] if s in ("fail", "warn") and f.startswith("numerics")]
    if not e:
        if bad or res["rc"] != 0:
            return "wrong", [f"healthy run not silent: rc={res['rc']} findings={bad}"]
        return "right", []
    if not nf:
        return "wrong", [f"not stopped: rc={res['rc']}, findings={res['findings']}"]
    summ = res.get("summary") or {}
    if summ and summ.get("params_finite") is False:
        why.append("the bad update was applied (parameters non-finite at exit)")
    if nf.get("step") != e["step"]:
        why.append(f"step {nf.get('step')} (injected {e['step']})")
    if nf.get("phase") != e["phase"]:
        why.append(f"phase {nf.get('phase')} (expected {e['phase']})")
    mod = nf.get("module") or ""
    # "" (the watched model itself) matches only itself: every name ends with ""
    if not any(mod == m or (m and mod.endswith(("." + m, m))) for m in e["modules"]):
        why.append(f"module {mod!r} (expected one of {e['modules']})")
    cause, diag = nf.get("cause") or "", (nf.get("diagnosis") or "") + " " + (nf.get("fix") or "")
    want = e["cause"]
    if cause == "numerics.scaler_never_stepped":
        why.append("ran to the end, the loss scaler skipping every update (not stopped at the bad step)")
    wrong_cause = False
    if want == "overflow" and "overflow" not in cause:
        why.append(f"cause {cause} (an fp16 overflow was injected)")
        wrong_cause = True
    if want == "data" and not re.search(r"data|input", cause + " " + diag, re.I):
        why.append(f"cause {cause}: the batch is not named")
        wrong_cause = True
    if want == "update" and not re.search(r"Adam|eps|optimizer|update", diag):
        why.append(f"cause {cause}: the optimizer's update in fp16 is not named")
        wrong_cause = True
    if want == "update" and re.search(r"checkpoint", nf.get("fix") or ""):
        why.append(f"fix points at a checkpoint, none was loaded: {nf.get('fix')}")
    if want == "invalid":
        if "invalid" not in cause:
            why.append(f"cause {cause}: the invalid op is not named")
            wrong_cause = True
        if e.get("op") and e["op"] not in diag:
            why.append(f"op {e['op']} not named")
        if re.search(r"keep_fp32|bf16|loss scale", nf.get("fix") or ""):
            why.append(f"a dtype fix printed for an invalid op: {nf.get('fix')}")
    broken = re.findall(r"'([^'\]]*\[[^\]']*)'", (nf.get("diagnosis") or "") + " " + (nf.get("fix") or ""))
    if broken:
        why.append(f"a name with an unclosed bracket: {broken[0]!r}")
    if "loss is computed outside the model" in (nf.get("fix_check_reason") or "") and case.expect.get("loss_inside"):
        why.append("says the loss is computed outside the model; the watched model computes it")
    # a region the diagnosis tells to keep in fp32 while the printed fix (checked) is another one
    told = set(re.findall(r"[Kk]eep (\S+) in fp32", nf.get("diagnosis") or ""))
    fixed = set(re.findall(r"keep_fp32\(model, '([^']*)'\)", nf.get("fix") or ""))
    if told and fixed and not told & fixed:
        why.append(f"the diagnosis says keep {sorted(told)} in fp32, the checked fix is {sorted(fixed)}")
    tried = (nf.get("fix_check_reason") or "").partition("tried first, not enough")
    if tried[1] and told and not fixed and any(f"keep_fp32('{r}')" in tried[0] for r in told):
        why.append(f"the diagnosis says keep {sorted(told)} in fp32, which its fix check found not enough")
    if e.get("fix_check") and nf.get("fix_check") != e["fix_check"]:
        why.append(f"fix_check {nf.get('fix_check')!r} (expected {e['fix_check']!r})")
    if fix_res is not None and not fix_res.get("as_printed", True):
        why.append("the printed keep_fp32 name does not apply to the program's model (a wrapper's path)")
    if fix_res is not None and fix_res.get("trains") is False:
        why.append(f"the printed fix, applied, does not train ({fix_res.get('why')})")
    hard = [w for w in why if w.startswith(("step", "the bad update", "not stopped"))]
    return ("right" if not why else "wrong" if hard or wrong_cause else "partly"), why


def run_program(name: str, checkout: str, extra_path: list[str], only: list[str] | None, variants: list[str],
                timeout: float, keep: bool) -> dict:
    work = tempfile.mkdtemp(prefix=f"td-real-{name}-")
    prog = PROGRAMS[name](checkout, work, extra_path)
    print(f"[{name}] setting up in {work}", file=sys.stderr, flush=True)
    prog.setup()
    rows = []
    for case in prog.cases():
        if only and case.name not in only:
            continue
        for variant in variants:
            if variant == "api" and name not in API_VARIANT:
                continue
            res = run_once(prog, case, variant, case.fault, case.flags, "1", timeout)
            fix_res = None
            nf = res.get("nonfinite")
            if nf and case.expect:
                ff = prog.fix_flags(nf.get("fix") or "", case)
                if ff is not None:
                    r2 = run_once(prog, case, variant, ff["fault"], ff["flags"], "fix", timeout)
                    s2 = r2.get("summary") or {}
                    bad2 = [f for f, s in r2["findings"] if s in ("fail", "warn") and f.startswith("numerics")]
                    ok = r2["rc"] == 0 and not bad2 and (s2.get("updates") or 0) > 0 and s2.get("params_finite")
                    fix_res = {"applied": ff, "trains": bool(ok), "rc": r2["rc"], "findings": bad2,
                               "as_printed": not any("as printed does not apply" in i for i in r2["injected"]),
                               "injected": r2["injected"],
                               "updates": s2.get("updates"),
                               "why": None if ok else f"rc={r2['rc']} findings={bad2} updates={s2.get('updates')}"
                               + (f" / {r2['nonfinite'].get('title') if r2.get('nonfinite') else ''}")}
            verdict, why = judge(case, res, fix_res)
            row = {"program": name, "case": case.name, "via": variant, "rc": res["rc"], "seconds": res["seconds"],
                   "injected": res["injected"], "summary": res["summary"], "findings": res["findings"],
                   "verdict": verdict, "why": why, "fix_run": fix_res}
            if nf:
                row.update({k: nf.get(k) for k in ("step", "phase", "module", "slot", "value", "cause", "fix",
                                                    "fix_check", "fix_check_reason", "observed", "diagnosis",
                                                    "replay")})
            if res.get("never_stepped"):
                row["never_stepped"] = res["never_stepped"]
            if res.get("tail") and verdict != "right":
                row["tail"] = res["tail"]
            rows.append(row)
            print(f"[{name}] {case.name:3s} {variant:6s} {verdict:6s} "
                  f"{row.get('step', '-')}/{row.get('phase', '-')}/{row.get('module', '-')} "
                  f"cause={row.get('cause', '-')} fix_check={row.get('fix_check', '-')} "
                  f"fix-trains={None if fix_res is None else fix_res['trains']}  {'; '.join(why)}",
                  file=sys.stderr, flush=True)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return {"program": name, "commit": prog.commit(), "rows": rows, "work": work if keep else None}


def table(results: list[dict]) -> str:
    lines = [f"{'program':10s} {'fault':5s} {'via':6s} {'verdict':7s} {'step/phase/module':50s} {'cause':34s} "
             f"{'fix_check':10s} fix trains"]
    for r in results:
        for row in r["rows"]:
            spm = f"{row.get('step', '-')}/{row.get('phase', '-')}/{row.get('module', '-')}"
            fr = row["fix_run"]
            lines.append(f"{row['program']:10s} {row['case']:5s} {row['via']:6s} {row['verdict']:7s} {spm:50s} "
                         f"{str(row.get('cause', '-')):34s} {str(row.get('fix_check', '-')):10s} "
                         f"{'-' if fr is None else fr['trains']}")
    counts: dict[str, int] = {}
    for r in results:
        for row in r["rows"]:
            counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    lines.append("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=textwrap.dedent(__doc__.split("\n\n", 1)[1]))
    ap.add_argument("program", choices=sorted(PROGRAMS))
    ap.add_argument("checkout", help="path of the program's checkout ('-' for hf: the installed transformers)")
    ap.add_argument("--cases", help="comma-separated cases (a0,a3,b0,b3,c0,d); default all")
    ap.add_argument("--via", default="switch", help="switch, api or both (api: the Trainer callback)")
    ap.add_argument("--extra-path", action="append", default=[], metavar="DIR",
                    help="a folder put on the programs' sys.path (e.g. where torchvision and Pillow are)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (drivers, reports)")
    ap.add_argument("--json", metavar="FILE", help="write every row as JSON ('-': stdout)")
    a = ap.parse_args(argv)
    prog = PROGRAMS[a.program]
    checkout = os.path.abspath(a.checkout) if a.checkout != "-" else "-"
    if prog.needs_checkout and not os.path.isdir(checkout):
        print(f"real_programs: {a.checkout}: not a folder (the program's checkout)", file=sys.stderr)
        return 2
    variants = ["switch", "api"] if a.via == "both" else [a.via]
    if any(v not in ("switch", "api") for v in variants):
        print(f"real_programs: --via {a.via}: use switch, api or both", file=sys.stderr)
        return 2
    only = a.cases.split(",") if a.cases else None
    sys.path[:0] = [os.path.abspath(p) for p in a.extra_path]  # the set-up writes images with Pillow
    results = [run_program(a.program, checkout, [os.path.abspath(p) for p in a.extra_path], only, variants,
                           a.timeout, a.keep)]
    if a.json == "-":
        print(json.dumps(results, indent=1))
    else:
        print(f"{a.program} at {results[0]['commit']}")
        print(table(results))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchdoctor over material nobody on the project wrote: public DeepSpeed configs and user logs.

Run from the repository root (the corpus lives beside the checkout, in ``../shared/realworld``)::

    .venv/bin/python benchmarks/realworld.py                 # both halves, a few minutes on 2 cores
    .venv/bin/python benchmarks/realworld.py --only logs     # or --only configs
    .venv/bin/python benchmarks/realworld.py --json out.json # the tables, and every row as JSON in out.json
    .venv/bin/python benchmarks/realworld.py --corpus DIR    # another copy of the corpus

**Logs.** ``torchdoctor logs --json`` runs on each ``logs/*.log``; its finding ids, severities and exit code
are printed next to the cause that ``logs/SOURCES.md`` gives for the thread, and compared with what that cause
calls for (``LOG_EXPECTED`` below: a verdict family and whether the run must be reported as failed, must
stay quiet, or needs at least a warning). The labels are this project's reading of each thread's cause; the
thread text itself is in SOURCES.md.

**Configs.** The judge is DeepSpeed's own parser, not this project. For each ``ds_configs/*.json``:

- ``--for deepspeed``: does ``deepspeed.runtime.config.DeepSpeedConfig`` accept the file as it is?
- ``--for hf``: do transformers and accelerate get the file to DeepSpeed (``TrainingArguments(deepspeed=...)``
  with arguments that agree with the file's explicit values, as a user's command line would; the Trainer's
  ``trainer_config_finalize`` with a small model's ``hidden_size``; accelerate's ``deepspeed_config_process``
  with what ``Accelerator.prepare`` passes), and does DeepSpeed's parser then accept it?

Both judge at world size 1 (the parser runs in one process), so ``ds check`` gets ``--world-size 1``. A ``ds check``
run agrees when it exits 1 with a ``fail`` finding exactly when the parser refuses. The two
ways to disagree are counted apart: a *miss* (ds check passes a config DeepSpeed then refuses -- the costly
one) and a *false alarm* (a failure on a config DeepSpeed accepts; it may still be right when the setting
breaks later at run time, so each is listed with its finding id for a reader to judge).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT.parent / "shared" / "realworld"
TORCHDOCTOR = [sys.executable, "-m", "torchdoctor"]
SUBPROCESS = False  # --subprocess: run each check as its own `python -m torchdoctor` (slower, the user's path)

# What each log's cause (logs/SOURCES.md) calls for: (verdict, id prefixes any of which counts).
# verdict "fail": exit 1 with a fail finding of that family; "warn": at least a warn finding of that family;
# "quiet": no warn or fail at all (a benign log: start-up loss-scale search, a skipped fp16 step).
LOG_EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "build_cc1plus_killed": ("fail", ("build.",)),
    "build_missing_cuda_header": ("fail", ("build.",)),
    "cuda_mismatch_ds_exception_class": ("fail", ("build.cuda-mismatch",)),
    "cuda_mismatch_ds_op_builder": ("fail", ("build.cuda-mismatch",)),
    "cuda_mismatch_torch_cpp_extension": ("fail", ("build.cuda-mismatch",)),
    "cuda_mismatch_torch_setup_traceback": ("fail", ("build.cuda-mismatch",)),
    "cuda_oom_quoted_then_rc1": ("fail", ("memory.cuda-oom",)),
    "cuda_oom_rank_prefixed": ("fail", ("memory.cuda-oom",)),
    "cuda_oom_single_line": ("fail", ("memory.cuda-oom",)),
    "cuda_oom_zero3_optimizer_step": ("fail", ("memory.cuda-oom",)),
    "custom_loss_nan_grad_scale_0": ("fail", ("loss.", "fp16.")),
    "ds_min_scale_exception_only": ("fail", ("fp16.loss-scale-collapse",)),
    "ds_min_scale_traceback": ("fail", ("fp16.loss-scale-collapse",)),
    "ds_overflow_hysteresis_start": ("quiet", ()),
    "ds_overflow_midrun_tqdm": ("warn", ("fp16.",)),
    "ds_overflow_recovered": ("quiet", ()),
    "ds_overflow_stage2_legacy_start": ("quiet", ()),
    "ds_overflow_stage3_legacy": ("quiet", ()),
    "ds_overflow_to_2": ("warn", ("fp16.",)),
    "gcc_unsupported_gt11": ("fail", ("build.compiler",)),
    "gcc_unsupported_gt12": ("fail", ("build.compiler",)),
    "gcc_unsupported_torch_ext_build": ("fail", ("build.compiler",)),
    "hf_grad_norm_nan_intermittent": ("quiet", ()),
    "hf_grad_norm_nan_loss_zero": ("fail", ("loss.",)),
    "hf_loss_nan_intermittent": ("fail", ("loss.",)),
    "megatron_ls1_grad_norm_nan": ("fail", ("fp16.", "grad.", "loss.")),
    "nccl_timeout_allreduce": ("fail", ("comm.nccl-timeout",)),
    "nccl_timeout_diverged_seqnums": ("fail", ("comm.nccl-timeout",)),
    "nccl_timeout_old_format": ("fail", ("comm.nccl-timeout",)),
    "nccl_timeout_reduce_scatter": ("fail", ("comm.nccl-timeout",)),
    "nccl_watchdog_terminate": ("fail", ("comm.nccl-timeout",)),
    "sigkill_accelerate_exitcode-9_rich": ("fail", ("process.killed",)),
    "sigkill_ds_launcher_rc-9": ("fail", ("process.killed",)),
    "sigkill_torchrun_exitcode-9_loading_shards": ("fail", ("process.killed",)),
    # the 20 logs added to the corpus on 2026-12-04 (issue 20), labelled from SOURCES.md's cause column
    "build_cuda_mismatch_9.1_vs_11.8_at_train": ("fail", ("build.cuda-mismatch",)),
    "build_gcc_too_old_need_gcc9_cpu_adam": ("fail", ("build.compiler",)),
    "build_mismatch_accepted_but_curand_header_missing": ("fail", ("build.compiler",)),
    "cuda_driver_too_old_userwarning": ("fail", ("cuda.driver-too-old",)),
    "cuda_illegal_memory_access_in_nccl_watchdog": ("fail", ("cuda.illegal-memory-access",)),
    "cuda_no_kernel_image_sm86": ("fail", ("cuda.no-kernel-image",)),
    "cuda_oom_new_format_then_chained": ("fail", ("memory.cuda-oom",)),
    "cuda_oom_old_format_during_ds_init": ("fail", ("memory.cuda-oom",)),
    "ds_min_scale_exception_then_launcher_kills": ("fail", ("fp16.loss-scale-collapse",)),
    "ds_overflow_startup_hysteresis_to_512": ("quiet", ()),
    "ds_scale_stuck_at_1_legacy_zero2": ("fail", ("fp16.loss-scale-collapse",)),
    "hf_grad_norm_nan_bf16_and_fp16": ("fail", ("loss.", "grad.")),
    "hf_loss_zero_grad_norm_nan_llamafactory_callback": ("fail", ("loss.",)),
    "nccl_system_error_no_route_to_host": ("fail", ("comm.nccl-error", "comm.network")),
    "nccl_timeout_broadcast_seqnum4_wrapped": ("fail", ("comm.nccl-timeout",)),
    "nccl_watchdog_terminate_broadcast": ("fail", ("comm.nccl-timeout",)),
    "sigkill_bare_killed_loading_shards": ("fail", ("process.killed",)),
    "sigkill_torchrun_exitcode-9_at_load": ("fail", ("process.killed",)),
    "traceback_keyerror_in_validation": ("fail", ("process.exception",)),
    "traceback_unscale_fp16_gradients": ("fail", ("process.exception",)),
}
SEVERE = ("warn", "fail")


def sources_table(path: Path) -> dict[str, list[str]]:
    """The rows of a SOURCES.md markdown table, keyed by file name (the first column)."""
    rows: dict[str, list[str]] = {}
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) >= 2 and cells[0].endswith((".log", ".json")):
            rows[cells[0]] = cells
    return rows


def run_json(args: list[str]) -> tuple[int, dict]:
    """``torchdoctor ARGS --json``: in this process (the CLI's own ``main``), or as a command with --subprocess."""
    if SUBPROCESS:
        proc = subprocess.run([*TORCHDOCTOR, *args, "--json"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NO_COLOR": "1"})
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        from torchdoctor.cli import main

        out_buf, err_buf = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
            rc = main([*args, "--json"])
        out, err = out_buf.getvalue(), err_buf.getvalue()
    try:
        return rc, json.loads(out)
    except json.JSONDecodeError:
        return rc, {"findings": [], "error": (err or out)[-400:]}


def severe_ids(findings: list[dict]) -> list[str]:
    return [f"{f['id']}:{f['severity']}" for f in findings if f.get("severity") in SEVERE + ("info",)]


def log_stem(name: str) -> str:
    return name.split("__", 1)[0]


def judge_log(name: str, rc: int, findings: list[dict]) -> tuple[str, bool]:
    verdict, prefixes = LOG_EXPECTED.get(log_stem(name), ("?", ()))
    sev = {f["id"]: f["severity"] for f in findings}
    family = [s for i, s in sev.items() if i.startswith(prefixes)] if prefixes else []
    if verdict == "fail":
        ok = rc == 1 and "fail" in family
    elif verdict == "warn":
        ok = any(s in SEVERE for s in family)
    elif verdict == "quiet":
        ok = rc == 0 and not any(s in SEVERE for s in sev.values())
    else:
        ok = False
    expected = f"{verdict} {'|'.join(prefixes)}".strip()
    return expected, ok


def eval_logs(corpus: Path) -> list[dict]:
    causes = sources_table(corpus / "logs" / "SOURCES.md")
    rows = []
    files = sorted((corpus / "logs").glob("*.log"))
    for i, path in enumerate(files, 1):
        print(f"  logs {i}/{len(files)} {path.name}", file=sys.stderr)
        rc, out = run_json(["logs", str(path)])
        expected, ok = judge_log(path.name, rc, out.get("findings", []))
        cells = causes.get(path.name, [])
        rows.append({"file": path.name, "rc": rc, "findings": severe_ids(out.get("findings", [])),
                     "expected": expected, "agree": ok, "cause": cells[-1] if cells else "(not in SOURCES.md)"})
    return rows


# --- configs: DeepSpeed's parser as the judge --------------------------------------------------------------

def _quiet_imports():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.disable(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.config import DeepSpeedConfig
        from transformers import TrainingArguments
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    return DeepSpeedConfig, TrainingArguments, HfTrainerDeepSpeedConfig


def parser_verdict(config: dict) -> str:
    """'' when DeepSpeed's parser accepts the config, else the error's type and first line."""
    DeepSpeedConfig, _, _ = _quiet_imports()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            DeepSpeedConfig(copy.deepcopy(config))
    except Exception as e:  # the parser raises many types: each is a refusal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return ""


class _TinyConfig:
    hidden_size = 64


class _TinyModel:
    config = _TinyConfig()


def _explicit(config: dict, *path: str):
    node = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node == "auto" else node


def hf_filled(config: dict, tmp: str) -> tuple[dict | None, str]:
    """The config as the HF Trainer hands it to DeepSpeed, or what the HF stack raises before that.

    The real path: ``TrainingArguments(deepspeed=config)`` (transformers fills the "auto" values and builds
    accelerate's ``DeepSpeedPlugin``), ``trainer_config_finalize`` with a small model, then accelerate's
    ``deepspeed_config_process`` with the values ``Accelerator._prepare_deepspeed`` passes. The Trainer also
    refuses explicit values that disagree with its arguments (lr, betas, batch sizes...): that is about the
    command line, not the file, so every explicit value is taken to agree.
    """
    _, TrainingArguments, HfTrainerDeepSpeedConfig = _quiet_imports()
    kw: dict = {"output_dir": tmp, "report_to": [], "use_cpu": True}
    for key, arg in (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                     ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                     ("gradient_clipping", "max_grad_norm")):
        value = _explicit(config, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kw[arg] = value
    train, micro = _explicit(config, "train_batch_size"), _explicit(config, "train_micro_batch_size_per_gpu")
    if "gradient_accumulation_steps" not in kw and isinstance(train, int) and isinstance(micro, int) and micro:
        kw["gradient_accumulation_steps"] = max(1, train // micro)  # what DeepSpeed derives on one rank
    for dtype in ("fp16", "bf16"):
        if _explicit(config, dtype, "enabled") is True:
            kw[dtype] = True
    lr = _explicit(config, "optimizer", "params", "lr")
    if isinstance(lr, (int, float)):
        kw["learning_rate"] = lr
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = TrainingArguments(**kw, deepspeed=copy.deepcopy(config))
            hf = args.hf_deepspeed_config
            hf.mismatches.clear()
            hf.fill_match = lambda key, val, hf_key=None, must_match=True: HfTrainerDeepSpeedConfig.fill_match(
                hf, key, val, hf_key, must_match=False)
            hf.trainer_config_finalize(args, _TinyModel(), 100)
            micro = hf.get_value("train_micro_batch_size_per_gpu")
            micro = micro if isinstance(micro, int) else 1
            gas = hf.get_value("gradient_accumulation_steps")
            gas = gas if isinstance(gas, int) else 1
            args.deepspeed_plugin.deepspeed_config_process(
                must_match=False, **{"train_micro_batch_size_per_gpu": micro, "train_batch_size": micro * gas,
                                     "gradient_clipping": 1.0,
                                     "zero_optimization.stage3_gather_16bit_weights_on_model_save": False})
    except Exception as e:  # what the Trainer or accelerate raises before DeepSpeed sees the config
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return hf.config, ""


def config_row(path: Path, who: str, tmp: str) -> dict:
    config = json.loads(path.read_text(encoding="utf-8"))
    if who == "hf":
        filled, refusal = hf_filled(config, tmp)
        if filled is not None:
            refusal = parser_verdict(filled)
    else:
        refusal = parser_verdict(config)
    rc, out = run_json(["ds", "check", "--for", who, "--world-size", "1", str(path)])
    findings = out.get("findings", [])
    failed = rc == 1 and any(f.get("severity") == "fail" for f in findings)
    kind = "agree" if failed == bool(refusal) else ("miss" if refusal else "false alarm")
    return {"file": path.name, "for": who, "rc": rc, "parser": refusal or "accepts",
            "findings": [f"{f['id']}:{f['severity']}" for f in findings if f.get("severity") in SEVERE],
            "result": kind}


def eval_configs(corpus: Path) -> list[dict]:
    import tempfile

    files = sorted((corpus / "ds_configs").glob("*.json"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(files, 1):
            print(f"  configs {i}/{len(files)} {path.name}", file=sys.stderr)
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except ValueError as e:  # a template its launcher fills in: no config DeepSpeed could read
                print(f"  configs {i}/{len(files)} skipped, not JSON ({e}): {path.name}", file=sys.stderr)
                continue
            for who in ("deepspeed", "hf"):
                rows.append(config_row(path, who, tmp))
    return rows


def short(name: str, width: int = 58) -> str:
    return name if len(name) <= width else name[: width - 1] + "~"


def print_logs(rows: list[dict]) -> None:
    print("\n## logs: torchdoctor logs vs the cause in logs/SOURCES.md\n")
    print("| file | exit | findings (warn/fail/info) | expected | agree |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {short(r['file'])} | {r['rc']} | {', '.join(r['findings']) or '-'} | {r['expected']} | "
              f"{'yes' if r['agree'] else '**no**'} |")
    agree = sum(r["agree"] for r in rows)
    print(f"\nlogs: {agree}/{len(rows)} agree with the thread's cause")


def print_configs(rows: list[dict]) -> None:
    print("\n## configs: torchdoctor ds check vs DeepSpeed's own parser\n")
    print("| file | --for | exit | warn/fail findings | DeepSpeed's parser | result |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        result = r["result"] if r["result"] == "agree" else f"**{r['result']}**"
        print(f"| {short(r['file'])} | {r['for']} | {r['rc']} | {', '.join(r['findings']) or '-'} | "
              f"{r['parser'][:70]} | {result} |")
    for who in ("deepspeed", "hf"):
        mine = [r for r in rows if r["for"] == who]
        counts = {k: sum(r["result"] == k for r in mine) for k in ("agree", "miss", "false alarm")}
        print(f"\nconfigs --for {who}: {counts['agree']}/{len(mine)} agree, {counts['miss']} missed "
              f"(passed, DeepSpeed refuses), {counts['false alarm']} false alarms (failed, DeepSpeed accepts)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="the realworld folder (default: %(default)s)")
    p.add_argument("--only", choices=("logs", "configs"), help="run one half")
    p.add_argument("--json", metavar="FILE", help="also write every row as JSON to FILE")
    p.add_argument("--subprocess", action="store_true",
                   help="run each check as `python -m torchdoctor ...` (the user's path; ~2 s more per check)")
    a = p.parse_args(argv)
    global SUBPROCESS
    SUBPROCESS = a.subprocess
    if not (a.corpus / "logs").is_dir() or not (a.corpus / "ds_configs").is_dir():
        print(f"no corpus at {a.corpus} (expected logs/ and ds_configs/ in it)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result: dict = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                    "python": platform.python_version()}
    if a.only in (None, "logs"):
        result["logs"] = eval_logs(a.corpus)
    if a.only in (None, "configs"):
        result["configs"] = eval_configs(a.corpus)
    if "logs" in result:
        print_logs(result["logs"])
    if "configs" in result:
        print_configs(result["configs"])
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\n({result['seconds']} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

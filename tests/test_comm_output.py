"""What ``torchdoctor comm`` prints: severity marks coloured on a terminal only (as every command), and ``--json``
that a strict parser reads (no NaN / Infinity), with its ``findings`` list."""

from __future__ import annotations

import json
import math
import sys

from bounded import run_bounded
from test_comm_processes import _env
from torchdoctor.comm.bench import BenchResult
from torchdoctor.comm.launch import Launch
from torchdoctor.comm.session import Options, RankSession
from torchdoctor.findings import Finding

# Runs comm with its standard output on a pseudo-terminal and copies what it printed to ours.
_ON_A_TERMINAL = r"""
import os, pty, subprocess, sys
master, slave = pty.openpty()
p = subprocess.Popen([sys.executable, "-m", "torchdoctor", "comm", *sys.argv[1:]], stdout=slave,
                     stderr=subprocess.DEVNULL)
os.close(slave)
out = b""
while True:
    try:
        chunk = os.read(master, 65536)
    except OSError:  # EIO: every writer closed the terminal
        break
    if not chunk:
        break
    out += chunk
sys.stdout.write(out.decode(errors="replace"))
sys.exit(p.wait())
"""

OK_MARK = "[OK] all 2 ranks passed every stage"
GREEN = "\033[32m[OK]\033[0m all 2 ranks passed every stage"


def _terminal_env(**extra) -> dict[str, str]:
    env = _env(TERM="xterm", **extra)
    for k in ("NO_COLOR", "FORCE_COLOR"):
        if k not in extra:
            env.pop(k, None)
    return env


def test_marks_are_coloured_on_a_terminal():
    b = run_bounded([sys.executable, "-c", _ON_A_TERMINAL, "--local", "2", "--timeout", "30"], mem_bytes=3 << 30,
                    max_procs=128, timeout=180, env=_terminal_env())
    out = b.proc.stdout.decode()
    assert b.proc.returncode == 0, out[-2000:]
    assert GREEN in out, out
    assert not b.leftovers


def test_no_colour_with_no_color_set_even_on_a_terminal():
    b = run_bounded([sys.executable, "-c", _ON_A_TERMINAL, "--local", "2", "--timeout", "30"], mem_bytes=3 << 30,
                    max_procs=128, timeout=180, env=_terminal_env(NO_COLOR="1"))
    out = b.proc.stdout.decode()
    assert b.proc.returncode == 0, out[-2000:]
    assert OK_MARK in out and "\033[" not in out


def test_no_colour_in_a_pipe():
    b = run_bounded([sys.executable, "-m", "torchdoctor", "comm", "--local", "2", "--timeout", "30"],
                    mem_bytes=3 << 30, max_procs=128, timeout=180, env=_terminal_env())
    out = b.proc.stdout.decode()
    assert b.proc.returncode == 0, b.proc.stderr[-2000:]
    assert OK_MARK in out and "\033[" not in out


def _strict(text: str) -> dict:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_stays_valid_with_non_finite_figures(capsys):
    """A timer too coarse for a tiny message gives an infinite bandwidth: --json says "inf", not Infinity."""
    session = RankSession(Launch(0, 2, 0, "127.0.0.1", 1, "local"), Options(backend="gloo", json=True, bench=True))
    session.bench_results = [BenchResult("all_reduce", 1024, "float32", math.inf, math.inf, 0.0, math.nan)]
    rows = [{"rank": r, "host": "h", "local_rank": r, "device": "cpu", "status": "ok", "stage": "done", "detail": ""}
            for r in range(2)]
    session._print(rows, [Finding("comm.ok", "ok", "all 2 ranks passed every stage")])
    out = _strict(capsys.readouterr().out)
    assert out["bench"][0]["algbw_gbps"] == "inf" and out["bench"][0]["p99_us"] == "nan"
    assert [f["id"] for f in out["findings"]] == ["comm.ok"]


def test_a_zero_time_is_an_infinite_bandwidth_not_a_crash():
    from torchdoctor.comm.bandwidth import algbw_gbps, busbw_gbps

    assert algbw_gbps(1024, 0.0) == math.inf and busbw_gbps("all_reduce", 1024, 0.0, 2) == math.inf
    assert algbw_gbps(10**9, 1.0) == 1.0

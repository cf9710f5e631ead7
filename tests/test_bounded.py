"""The suite's own guard (tests/bounded.py): a memory limit that holds, and no process left behind."""

from __future__ import annotations

import sys

import pytest

from bounded import alive, run_bounded

HOG = "b = bytearray(800 * 1024 * 1024); print('allocated')"


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup-if-possible", "setrlimit"])
def test_a_command_past_its_memory_limit_is_stopped(cgroup):
    r = run_bounded([sys.executable, "-c", HOG], mem_bytes=300 << 20, cgroup=cgroup)
    assert b"allocated" not in r.proc.stdout
    assert r.proc.returncode != 0  # SIGKILLed in a cgroup, MemoryError under setrlimit
    if not cgroup:
        assert r.how == "setrlimit" and b"MemoryError" in r.proc.stderr


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup-if-possible", "setrlimit"])
def test_a_process_that_left_the_session_is_seen_and_ended(cgroup):
    r = run_bounded(["bash", "-c", "setsid sleep 300 & echo started"], cgroup=cgroup, settle_s=0.5)
    assert r.proc.returncode == 0 and r.proc.stdout == b"started\n"
    assert len(r.leftovers) == 1
    assert not any(alive(pid) for pid in r.leftovers)  # ended once run_bounded returned


def test_a_command_that_outlives_its_timeout_is_killed():
    r = run_bounded(["sleep", "300"], timeout=0.5)
    assert r.timed_out and r.proc.returncode == -9

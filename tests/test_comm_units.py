"""Unit tests of the pure parts of `torchdoctor comm`: sizes, bandwidth, launch, findings and bench helpers."""

from __future__ import annotations

import io
import json
import math
from decimal import Decimal

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from torchdoctor.comm import bandwidth, bench, launch
from torchdoctor.comm.bandwidth import algbw_gbps, bus_factor, busbw_gbps, message_elements
from torchdoctor.comm.bench import render_bench
from torchdoctor.comm.launch import LaunchError, expand_hostlist, from_env
from torchdoctor.comm.sizes import MAX_BYTES, SizeError, format_bytes, parse_size, parse_sizes
from torchdoctor.findings import Finding, render_markdown, render_text, worst

K, M, G = 1 << 10, 1 << 20, 1 << 30


# -- sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("512", 512), ("512B", 512), ("1K", K), ("64k", 64 * K), ("1KB", 1000), ("1KiB", K), ("1M", M), ("3mb", 3_000_000),
    ("2G", 2 * G), ("2GiB", 2 * G), (" 16 M ", 16 * M), ("1", 1), ("1024G", MAX_BYTES),
])
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


def test_parse_sizes_list_sorted_dedup():
    assert parse_sizes("1K,1M,64M") == [K, M, 64 * M]
    assert parse_sizes("64M,1K,1M") == [K, M, 64 * M]
    assert parse_sizes("1M,1024K,1K,1M") == [K, M]
    assert parse_sizes(" 8 , 8B ,,16") == [8, 16]
    assert parse_sizes("4K") == [4 * K]


def test_parse_sizes_range_doubles_by_default():
    got = parse_sizes("1K:64M")
    assert got[0] == K and got[-1] == 64 * M
    assert len(got) == 17  # 2^10 .. 2^26
    assert all(b == 2 * a for a, b in zip(got, got[1:]))
    assert parse_sizes("1K:1K") == [K]


def test_parse_sizes_range_with_factor():
    got = parse_sizes("8:1G:4")
    assert got == [8 * 4**i for i in range(14)]
    assert got[-1] == 512 * M  # the next step (2G) is past the end
    assert parse_sizes("1K:10K:3") == [K, 3 * K, 9 * K]  # an end that is not on the grid is not included
    assert parse_sizes("1K:64M: 4")[:2] == [K, 4 * K]


@pytest.mark.parametrize("text", [
    "", ",", " , ", "1Q", "0", "-1", "0K", "1.5K", "K", "2T", "1025G", f"{MAX_BYTES + 1}", "1048577M",
    "1K:2", "64M:1K", "1K:64M:1", "1K:64M:0", "1K:64M:x", "1K:64M:-2", "1K:64M:2.5", "a:b:c:d", "1K:2K:2:2",
    "a:b", "1K:", ":1K", "1K:0", "1K:2T", "1K,1Q",
])
def test_parse_sizes_rejects(text):
    with pytest.raises(SizeError):
        parse_sizes(text)


def test_size_error_is_value_error_and_names_the_input():
    with pytest.raises(ValueError, match="'1Q'"):
        parse_size("1Q")


@pytest.mark.parametrize("n, expected", [
    (1, "1B"), (1023, "1023B"), (K, "1K"), (1536, "1.5K"), (64 * K, "64K"), (M, "1M"), (5 * M // 2, "2.5M"),
    (G, "1G"), (1024 * G, "1T"), (3 * G, "3G"), (1048572, "1023.996K"), (999996, "976.559K"),
])
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@given(k=st.integers(1, 1024), unit=st.sampled_from([1, K, M, G]))
def test_format_parse_round_trip(k, unit):
    n = k * unit
    text = format_bytes(n)
    assert parse_size(text) == n
    assert format_bytes(parse_size(text)) == text


@given(n=st.integers(1, MAX_BYTES))
@example(n=53440)  # 52.1875K rounds to 52.188K: a tie, exactly on the bound (CI once drew it)
def test_format_bytes_integral_outputs_parse_back_exactly(n):
    text = format_bytes(n)
    if "." not in text:
        assert parse_size(text) == n
    else:  # up to three decimals: within half a thousandth of the unit (exact arithmetic: ties sit on the bound)
        scale = {"K": K, "M": M, "G": G, "T": 1 << 40}[text[-1]]
        assert abs(Decimal(text[:-1]) * scale - n) <= Decimal("0.0005") * scale


# -- bandwidth --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 17))
def test_bus_factor_matches_nccl_tests(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "reduce", "send_recv"):
        assert bus_factor(op, n) == 1.0


def test_bus_factor_known_values():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("all_reduce", 1) == 0.0
    assert bandwidth.OPS == ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@pytest.mark.parametrize("op", ["allreduce", "all-reduce", "", "gather"])
def test_unknown_op_raises(op):
    with pytest.raises(ValueError, match="unknown op"):
        bus_factor(op, 4)
    with pytest.raises(ValueError, match="unknown op"):
        busbw_gbps(op, 1000, 1.0, 4)


def test_algbw_is_bytes_per_second_in_gb():
    assert algbw_gbps(10**9, 1.0) == pytest.approx(1.0)
    assert algbw_gbps(64 * M, 0.001) == pytest.approx(64 * M / 0.001 / 1e9)
    assert algbw_gbps(2 * 10**9, 0.5) == pytest.approx(4.0)


@pytest.mark.parametrize("op", bandwidth.OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_busbw_over_algbw_is_the_factor(op, n):
    nbytes, t = 3 * M, 0.00123
    alg = algbw_gbps(nbytes, t)
    assert busbw_gbps(op, nbytes, t, n) == pytest.approx(alg * bus_factor(op, n))


def test_busbw_examples():
    # 1 GB all_reduce in 1 s on 4 ranks: algbw 1, busbw 1.5
    assert busbw_gbps("all_reduce", 10**9, 1.0, 4) == pytest.approx(1.5)
    assert busbw_gbps("broadcast", 10**9, 2.0, 4) == pytest.approx(0.5)


def test_message_elements_rounds_sharded_ops_down_to_whole_shards():
    assert message_elements("all_gather", 1000, 4, 3) == (83, 996)
    assert message_elements("reduce_scatter", 1000, 4, 3) == (83, 996)
    assert message_elements("all_to_all", 64 * M, 4, 3) == (5592405, 67108860)
    assert message_elements("all_gather", 4096, 2, 8) == (256, 4096)


def test_message_elements_unsharded_ops_round_to_whole_elements():
    assert message_elements("all_reduce", 1000, 4, 3) == (250, 1000)
    assert message_elements("broadcast", 1001, 4, 3) == (250, 1000)
    assert message_elements("all_reduce", 10, 8, 16) == (1, 8)


@pytest.mark.parametrize("op", bandwidth.OPS)
def test_message_elements_at_least_one_element_per_rank(op):
    shard, nbytes = message_elements(op, 1, 4, 8)
    assert shard == 1
    assert nbytes == (4 * 8 if op in bandwidth.SHARDED else 4)


@given(op=st.sampled_from(bandwidth.OPS), nbytes=st.integers(1, 1 << 32), elem=st.sampled_from([1, 2, 4, 8]),
       n=st.integers(1, 64))
def test_message_elements_properties(op, nbytes, elem, n):
    shard, actual = message_elements(op, nbytes, elem, n)
    per = n if op in bandwidth.SHARDED else 1
    assert shard >= 1
    assert actual == shard * elem * per
    if nbytes >= elem * per:
        assert actual <= nbytes < actual + elem * per  # the largest whole-shard size not above the request


# -- launch -----------------------------------------------------------------------------------------

def _torchrun_env(**kw):
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


def _slurm_env(**kw):
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[01-03,07]",
           "SLURM_JOB_ID": "1234"}
    env.update(kw)
    return {k: v for k, v in env.items() if v is not None}


def test_from_env_torchrun():
    got = from_env(_torchrun_env())
    assert got == launch.Launch(3, 8, 1, "10.0.0.1", 29500, "torchrun", True, "abc.2")


def test_from_env_torchrun_without_agent_store():
    got = from_env(_torchrun_env(TORCHELASTIC_USE_AGENT_STORE="False", TORCHELASTIC_RESTART_COUNT=None))
    assert got.mode == "torchrun"
    assert got.agent_store is False
    assert got.run_id == "abc.0"


def test_from_env_generic():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "host0", "MASTER_PORT": "1234"}
    got = from_env(env)
    assert got == launch.Launch(0, 2, 0, "host0", 1234, "env", False, "0.0")
    assert from_env({**env, "RANK": "1"}).local_rank == 1  # no LOCAL_RANK: the rank


def test_from_env_torchdoctor_local_mode():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40000",
           "TORCHDOCTOR_LAUNCH_MODE": "local", "TORCHDOCTOR_AGENT_STORE": "1"}
    got = from_env(env)
    assert (got.mode, got.agent_store, got.rank, got.local_rank) == ("local", True, 1, 1)


def test_from_env_slurm():
    got = from_env(_slurm_env())
    assert got == launch.Launch(5, 8, 1, "gpu01", 22340, "slurm", False, "1234")


def test_from_env_slurm_port_derivation_and_fallbacks():
    # 20000 + job % 1000 * 10 + step % 10: distinct for 1000 consecutive jobs and 10 concurrent steps
    assert from_env(_slurm_env(SLURM_JOB_ID="987654321")).master_port == 20000 + 321 * 10
    assert from_env(_slurm_env(SLURM_STEP_ID="3")).master_port == 22343
    ports = {from_env(_slurm_env(SLURM_JOB_ID=str(j), SLURM_STEP_ID=str(s))).master_port
             for j in range(55000, 56000) for s in range(10)}
    assert len(ports) == 10000 and min(ports) >= 20000 and max(ports) < 30000
    assert from_env(_slurm_env(SLURM_JOB_ID=None)).master_port == 20000
    assert from_env(_slurm_env(SLURM_JOB_ID="abc")).master_port == 29500
    got = from_env(_slurm_env(SLURM_JOB_NODELIST=None, SLURM_NODELIST="n[3-4]", SLURM_LOCALID=None))
    assert (got.master_addr, got.local_rank) == ("n3", 0)


def test_from_env_slurm_master_overrides():
    got = from_env(_slurm_env(MASTER_ADDR="head", MASTER_PORT="31000"))
    assert (got.master_addr, got.master_port, got.mode) == ("head", 31000, "slurm")
    got = from_env(_slurm_env(SLURM_JOB_NODELIST=None, MASTER_ADDR="head"))
    assert (got.master_addr, got.master_port) == ("head", 22340)


def test_from_env_rank_takes_precedence_over_slurm():
    env = {**_slurm_env(), "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "2"}
    got = from_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.mode) == (2, 4, 0, "env")


def test_from_env_empty_is_none():
    assert from_env({}) is None
    assert from_env({"PATH": "/bin", "LOCAL_RANK": "0", "SLURM_PROCID": "0"}) is None  # SLURM_NTASKS missing


@pytest.mark.parametrize("env, match", [
    (_torchrun_env(MASTER_PORT=None), "MASTER_PORT"),
    ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT"),
    (_torchrun_env(RANK="one"), "RANK='one'"),
    (_torchrun_env(WORLD_SIZE="2.0"), "WORLD_SIZE"),
    (_torchrun_env(LOCAL_RANK=""), "LOCAL_RANK"),
    (_torchrun_env(MASTER_PORT="http"), "MASTER_PORT"),
    (_torchrun_env(RANK="8"), "rank 8 is outside world size 8"),
    (_torchrun_env(RANK="-1"), "outside world size"),
    (_torchrun_env(RANK="0", WORLD_SIZE="0"), "outside world size 0"),
    (_torchrun_env(MASTER_PORT="0"), "port 0"),
    (_torchrun_env(MASTER_PORT="70000"), "port 70000"),
    (_torchrun_env(MASTER_PORT="65536"), "port 65536"),
    (_slurm_env(SLURM_PROCID="8"), "outside world size"),
    (_slurm_env(SLURM_NTASKS="x"), "SLURM_NTASKS"),
    (_slurm_env(MASTER_PORT="70000"), "port 70000"),
    (_slurm_env(SLURM_JOB_NODELIST="n[5-2]"), "n\\[5-2\\]"),
    (_slurm_env(SLURM_JOB_NODELIST=None), "SLURM_JOB_NODELIST"),
])
def test_from_env_errors(env, match):
    with pytest.raises(LaunchError, match=match):
        from_env(env)


def test_launch_error_is_value_error():
    assert issubclass(LaunchError, ValueError)


def test_from_env_slurm_empty_master_addr_without_nodelist_is_a_launch_error():
    with pytest.raises(LaunchError):
        from_env(_slurm_env(SLURM_JOB_NODELIST=None, MASTER_ADDR=""))


@pytest.mark.parametrize("spec, hosts", [
    ("a,b", ["a", "b"]),
    ("login1", ["login1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("x[1,3-4]y", ["x1y", "x3y", "x4y"]),
    ("c[01-02],d[7]", ["c01", "c02", "d7"]),
    ("gpu[01-02],login1", ["gpu01", "gpu02", "login1"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n-a[1-2].cluster", ["n-a1.cluster", "n-a2.cluster"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[5-2]", "n[a-b]", "n[1-x]", "n[-3]", "", ","])
def test_expand_hostlist_rejects(spec):
    with pytest.raises(LaunchError):
        expand_hostlist(spec)


# -- findings ---------------------------------------------------------------------------------------

def _f(severity, id_="comm.x", title="t", **kw):
    return Finding(id_, severity, title, **kw)


def test_finding_to_json_shape():
    f = Finding("comm.rank-died", "fail", "rank 1 died", evidence=["e1"], fix=["do x", "do y"], data={"rank": 1})
    j = f.to_json()
    assert list(j) == ["id", "severity", "title", "evidence", "fix", "data"]
    assert j == {"id": "comm.rank-died", "severity": "fail", "title": "rank 1 died", "evidence": ["e1"],
                 "fix": ["do x", "do y"], "data": {"rank": 1}}
    assert json.loads(json.dumps(j)) == j
    j["evidence"].append("mutated")
    j["data"]["rank"] = 9
    assert f.evidence == ["e1"] and f.data == {"rank": 1}  # copies, not the finding's own lists


def test_finding_defaults():
    f = Finding("comm.ok", "ok", "fine")
    assert (f.evidence, f.fix, f.data) == ([], [], {})
    assert Finding("a", "ok", "x").id == "a"
    assert Finding("cuda.torch-vs-nvcc", "info", "x").id == "cuda.torch-vs-nvcc"


@pytest.mark.parametrize("bad_id", ["Comm.x", "comm..x", "comm.x.", ".comm", "comm x", "comm_x", "", "comm.-x"])
def test_finding_rejects_bad_id(bad_id):
    with pytest.raises(AssertionError, match="dotted lowercase"):
        Finding(bad_id, "ok", "t")


@pytest.mark.parametrize("bad", ["error", "FAIL", "warning", ""])
def test_finding_rejects_bad_severity(bad):
    with pytest.raises(AssertionError, match="unknown severity"):
        Finding("comm.x", bad, "t")


def test_worst():
    assert worst([]) == "ok"
    assert worst([_f("skip")]) == "skip"
    assert worst([_f("skip"), _f("ok")]) == "ok"
    assert worst([_f("ok"), _f("info")]) == "info"
    assert worst([_f("info"), _f("warn"), _f("ok")]) == "warn"
    assert worst(iter([_f("warn"), _f("fail"), _f("ok")])) == "fail"


def test_render_text_orders_by_severity_and_shows_fixes():
    fs = [_f("ok", "comm.ok", "all good"), _f("warn", "comm.w", "a warning", evidence=["seen this"]),
          _f("skip", "comm.s", "skipped"), _f("info", "comm.i", "note"),
          _f("fail", "comm.rank-died", "rank 1 died", evidence=["no heartbeat"], fix=["read its log", "dmesg"])]
    text = render_text(fs)
    lines = text.splitlines()
    heads = [ln for ln in lines if ln.startswith("[")]
    assert heads == ["[FAIL] rank 1 died  (comm.rank-died)", "[WARN] a warning  (comm.w)", "[INFO] note  (comm.i)",
                     "[OK] all good", "[SKIP] skipped  (comm.s)"]
    # an OK line leaves out the check's id (often named for the problem: build.ninja-missing); markdown too
    assert "(comm.ok)" not in text and "comm.ok" not in render_markdown(fs) and "`comm.w`" in render_markdown(fs)
    i = lines.index("[FAIL] rank 1 died  (comm.rank-died)")
    assert lines[i + 1:i + 4] == ["    no heartbeat", "    fix: read its log", "         dmesg"]
    assert lines[lines.index("[WARN] a warning  (comm.w)") + 1] == "    seen this"
    assert text.count("fix:") == 1


def test_render_text_wraps_long_lines():
    long = " ".join(["word"] * 60)
    text = render_text([_f("fail", fix=[long], evidence=[long])], width=40)
    lines = text.splitlines()
    assert all(len(ln) <= 40 for ln in lines)
    assert lines[1].startswith("    word") and lines[2].startswith("      word")
    fix_at = next(i for i, ln in enumerate(lines) if ln.startswith("    fix: "))
    assert lines[fix_at + 1].startswith("         word")
    assert render_text([]) == ""


def test_render_markdown():
    fs = [_f("warn", "comm.env-mismatch", "NCCL_X differs", evidence=["a", "b"], fix=["set it"]),
          _f("ok", "comm.ok", "fine")]
    assert render_markdown(fs).splitlines() == [
        "- **WARN** NCCL_X differs (`comm.env-mismatch`)", "  - a", "  - b", "  - fix: set it",
        "- **OK** fine",
    ]


# -- bench helpers ----------------------------------------------------------------------------------

def test_percentile_nearest_rank():
    v = [10.0, 20.0, 30.0, 40.0]
    assert bench._percentile(v, 50) == 20.0
    assert bench._percentile(v, 51) == 30.0
    assert bench._percentile(v, 99) == 40.0
    assert bench._percentile(v, 100) == 40.0
    assert bench._percentile(v, 0) == 10.0
    assert bench._percentile(v, 25) == 10.0
    assert bench._percentile(v, 26) == 20.0
    assert bench._percentile([7.0], 50) == 7.0
    hundred = [float(i) for i in range(1, 101)]
    assert bench._percentile(hundred, 99) == 99.0
    assert bench._percentile(hundred, 50) == 50.0
    assert bench._percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0


@given(values=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200), q=st.integers(0, 100))
def test_percentile_property(values, q):
    s = sorted(values)
    k = max(1, math.ceil(q * len(s) / 100))
    assert bench._percentile(s, q) == s[k - 1]


def test_progress_non_tty_one_line_per_step():
    out = io.StringIO()
    p = bench.Progress(3, stream=out)
    assert not p.tty
    for label in ("all_reduce 1K", "all_reduce 1M", "all_gather 1K"):
        p.step(label)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[bench] 1/3 all_reduce 1K (") and lines[0].endswith("s)")
    assert lines[1].startswith("[bench] 2/3 all_reduce 1M (")
    assert lines[2].startswith("[bench] 3/3 all_gather 1K (")
    assert "\r" not in out.getvalue()
    assert p.done == 3


def test_progress_disabled_writes_nothing():
    out = io.StringIO()
    p = bench.Progress(2, stream=out, enabled=False)
    p.step("a")
    p.step("b")
    assert out.getvalue() == ""
    assert p.done == 2


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_tty_redraws_one_line():
    out = _Tty()
    p = bench.Progress(2, stream=out)
    assert p.tty
    p.step("all_reduce 1K")
    first = out.getvalue()
    assert first.startswith("\r[bench] [" + "#" * 15 + "." * 15 + "] 1/2 all_reduce 1K")
    assert not first.endswith("\n")
    p.step("all_reduce 1M")
    assert out.getvalue().count("\r") == 2
    assert out.getvalue().endswith("\n")
    assert "[" + "#" * 30 + "] 2/2 all_reduce 1M" in out.getvalue()


def test_render_bench():
    rs = [bench.BenchResult("all_reduce", M, "float32", 12.5, 21.875, 83.9, 120.04),
          bench.BenchResult("all_gather", 996, "bfloat16", 0.001234, 0.000925, 5.0, 6.0),
          bench.BenchResult("all_to_all", 64 * M, "float32", 100.0, 87.5, 671.0, 700.0)]
    text = render_bench(rs, 8)
    lines = text.splitlines()
    assert lines[0].split() == ["op", "size", "dtype", "algbw", "GB/s", "busbw", "GB/s", "p50", "us", "p99", "us"]
    assert lines[1].split() == ["all_reduce", "1M", "float32", "12.5", "21.88", "83.9", "120.0"]
    assert lines[2].split()[:3] == ["all_gather", "996B", "bfloat16"]
    assert lines[3].split()[:2] == ["all_to_all", "64M"]
    assert lines[-1].startswith("(n = 8 ranks; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather")
    assert "GB = 1e9 bytes" in lines[-1]
    assert len(lines) == 5


def test_bench_result_to_json():
    r = bench.BenchResult("broadcast", 4 * K, "float16", 1.0, 1.0, 2.0, 3.0)
    assert r.to_json() == {"op": "broadcast", "bytes": 4096, "dtype": "float16", "algbw_gbps": 1.0,
                           "busbw_gbps": 1.0, "p50_us": 2.0, "p99_us": 3.0}



def test_render_text_ends_with_a_summary_and_colours_only_when_asked():
    fs = [_f("ok"), _f("fail"), _f("warn"), _f("fail")]
    text = render_text(fs)
    assert text.splitlines()[-1] == "2 FAIL, 1 WARN, 1 OK" and "\033[" not in text
    assert render_text(fs[:1]).count("\n") == render_text(fs[:1], with_summary=False).count("\n")  # one: no summary
    coloured = render_text(fs, color=True)
    assert "\033[1;31m[FAIL]\033[0m" in coloured and "\033[32m[OK]\033[0m" in coloured


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch, tmp_path):
    from torchdoctor.findings import use_color

    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    with open(tmp_path / "out.txt", "w") as fh:
        assert use_color(Tty()) and not use_color(fh)
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("TERM", "dumb")
    assert not use_color(Tty())


def test_local_join_progress_counts_the_ranks_that_posted_their_identity(capsys):
    import datetime

    from torch.distributed import TCPStore

    from torchdoctor.comm.launch import free_port
    from torchdoctor.comm.local import _JoinProgress

    store = TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=10),
                     wait_for_workers=False)
    progress = _JoinProgress(store, 3)
    progress.poll()
    assert capsys.readouterr().err == ""  # nothing in the first 2 s
    progress.start -= 10
    store.set("id/0", "{}")
    store.set("id/2", "{}")
    progress.poll()
    assert "2/3 ranks joined (10 s)" in capsys.readouterr().err
    progress.poll()
    assert capsys.readouterr().err == ""  # at most one line every 5 s
    store.set("id/1", "{}")
    progress.last_print -= 10
    progress.poll()
    assert "3/3 ranks joined" in capsys.readouterr().err
    progress.last_print -= 10
    progress.poll()
    assert capsys.readouterr().err == ""  # all joined: silent from then on


def test_local_join_progress_says_how_many_ranks_were_started(capsys):
    import datetime

    from torch.distributed import TCPStore

    from torchdoctor.comm.launch import free_port
    from torchdoctor.comm.local import _JoinProgress

    store = TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=10),
                     wait_for_workers=False)
    progress = _JoinProgress(store, 8)
    progress.start -= 10
    store.set("id/0", "{}")
    progress.poll(started=4)  # --local starts ranks in batches: the others wait for a CPU
    assert capsys.readouterr().err.strip() == "torchdoctor comm --local: 1/8 ranks joined (10 s), 4 started"
    progress.last_print -= 10
    progress.poll(started=8)
    assert capsys.readouterr().err.strip() == "torchdoctor comm --local: 1/8 ranks joined (10 s)"


def test_each_rank_that_joins_renews_the_join_deadline():
    """--local starts ranks in batches: the first ones must wait as long as ranks keep arriving."""
    import time

    from torchdoctor.comm.launch import Launch, free_port
    from torchdoctor.comm.sidechannel import SideChannel

    ch = SideChannel(Launch(0, 3, 0, "127.0.0.1", free_port(), "env"), timeout=10)
    ch.put("id/0", {})
    arrivals = []

    def arrived() -> float:  # the next rank arrives whenever one did, each after the first deadline passed
        arrivals.append(len(arrivals))
        ch.put(f"id/{len(arrivals)}", {})
        return time.monotonic() + 10

    assert ch.wait_for("id", time.monotonic() - 1, on_arrival=arrived) == set()
    assert arrivals == [0, 1]
    ch.put("id/1", None)  # absent again: a deadline already passed, and nothing renews it
    assert ch.wait_for("id", time.monotonic() - 1, ranks=[0, 1, 2]) == {1}
    ch.close()


# -- what this host sees of a rank's process (real processes) -------------------------------------------------

def test_process_status_reads_the_state_and_the_tracer_of_a_real_process():
    import os
    import signal
    import subprocess
    import sys
    import time

    from torchdoctor.comm.procs import process_status

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_status(p.pid) == {"process": "running", "tracer_pid": 0, "tracer": None}
        os.kill(p.pid, signal.SIGSTOP)
        for _ in range(200):  # the stop is asynchronous: wait for the state to show it (bounded, 10 s)
            if process_status(p.pid)["process"] == "stopped":
                break
            time.sleep(0.05)
        assert process_status(p.pid) == {"process": "stopped", "tracer_pid": 0, "tracer": None}
    finally:
        p.kill()
        p.wait()
    assert process_status(p.pid) == {"process": "gone", "tracer_pid": None, "tracer": None}
    assert process_status(None) == {"process": None, "tracer_pid": None, "tracer": None}


def test_the_launcher_tells_a_complete_verdict_from_a_cut_one():
    """A signal that came after every rank passed changed nothing: --local exits with the verdict's code."""
    import datetime

    from torch.distributed import TCPStore

    from torchdoctor.comm.launch import free_port
    from torchdoctor.comm.local import _all_passed

    store = TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=10),
                     wait_for_workers=False)
    ok = json.dumps({"status": "ok", "stage": "done"})
    store.set("final/0", ok)
    assert not _all_passed(store, 2)  # rank 1 has not finished
    store.set("final/1", json.dumps({"status": "broken", "stage": "bench", "kind": "terminated"}))
    assert not _all_passed(store, 2)
    store.set("final/1", ok)
    assert _all_passed(store, 2)


# -- counts on the command line are plain digits ---------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("10", 10), ("0", 0), ("007", 7)])
def test_a_count_in_plain_digits_is_read(text, expected):
    from torchdoctor.comm.run import count

    assert count("--local", text) == expected


@pytest.mark.parametrize("text", ["1_0", "+2", "-2", " 2", "2 ", "2.0", "0x2", "1e1", "٢", "２", "", "two"])
def test_any_other_spelling_of_a_count_is_refused_in_one_line(text):
    from torchdoctor.comm.run import count

    msg = count("--local", text)
    assert msg == f"--local takes a count in plain digits (0-9), got {text!r}"
    assert "\n" not in msg

"""One reading of byte sizes for every size flag: 80GB = 80 x 10^9 bytes, 80GiB (and 80G) = 80 x 2^30, a plain number
in the flag's own unit (bytes for comm --sizes, GiB for ds memory --gpu-mem / --cpu-mem)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from torchdoctor import cli
from torchdoctor.comm.sizes import SizeError as CommSizeError
from torchdoctor.comm.sizes import parse_size, parse_sizes
from torchdoctor.units import GIB, SizeError, parse_bytes


@pytest.mark.parametrize("text, plain, expected", [
    ("80GB", 1, 80 * 10**9), ("80gb", 1, 80 * 10**9), ("80 GB", 1, 80 * 10**9),
    ("80GiB", 1, 80 << 30), ("80G", 1, 80 << 30), ("80g", 1, 80 << 30), ("80", GIB, 80 << 30), ("80", 1, 80),
    ("1.5GiB", 1, 3 << 29), ("0.5TB", 1, 5 * 10**11), ("512B", 1, 512), ("64K", 1, 64 << 10), ("64KB", 1, 64000),
    ("3MiB", 1, 3 << 20), ("3MB", 1, 3 * 10**6), ("1TiB", 1, 1 << 40), ("1T", 1, 1 << 40), (".5G", 1, 1 << 29),
])
def test_parse_bytes(text, plain, expected):
    assert parse_bytes(text, plain=plain) == expected


@pytest.mark.parametrize("text", ["", "GB", "80XB", "80 G B", "-1G", "1e3", "inf", "nan", "80GiBs", "1,5G", "0x10"])
def test_parse_bytes_refuses(text):
    with pytest.raises(SizeError, match="is not a size"):
        parse_bytes(text)


def test_parse_bytes_is_exact():
    assert parse_bytes("0.1GB") == Fraction(10**8) and parse_bytes("1.1GiB") == Fraction(11, 10) * GIB


def test_comm_sizes_read_units_as_every_size_flag_does():
    assert parse_sizes("1KB,1KiB,1K") == [1000, 1024]
    assert parse_sizes("1MB:4MB:2") == [10**6, 2 * 10**6, 4 * 10**6]
    assert parse_size("64") == 64  # plain numbers are bytes, as before
    with pytest.raises(CommSizeError):
        parse_size("1.5K")  # message sizes are whole numbers, as nccl-tests' -b / -e


def ds_memory(capsys, *args: str) -> dict:
    rc = cli.main(["ds", "memory", "--params", "7B", "--gpus-per-node", "8", "--json", *args])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    return json.loads(out)["inputs"]


@pytest.mark.parametrize("flag", ["--gpu-mem", "--cpu-mem"])
def test_ds_memory_reads_gb_as_decimal_and_gib_and_plain_numbers_as_binary(flag, capsys):
    other = "--cpu-mem" if flag == "--gpu-mem" else "--gpu-mem"
    name = flag[2:5]  # gpu, cpu
    got = {v: ds_memory(capsys, flag, v, other, "80") for v in ("80GB", "80GiB", "80G", "80", "81920MiB")}
    gib = {v: inputs[f"{name}_mem_gib"] for v, inputs in got.items()}
    assert gib["80GiB"] == gib["80G"] == gib["80"] == gib["81920MiB"] == 80
    assert gib["80GB"] == pytest.approx(80e9 / 2**30)  # 74.5 GiB
    assert got["80GB"][f"{name}_mem_source"] == f"{flag} 80GB"


@pytest.mark.parametrize("value, says", [
    ("80XB", "'80XB' is not a size (examples: 80 or 80GiB = 80 x 2^30 bytes, 80GB = 80 x 10^9)"),
    ("0GB", "must be a positive amount of memory, got '0GB'"),
    ("99999999999TiB", "'99999999999TiB' is out of range (at most 1024 TiB)"),
])
def test_ds_memory_bad_sizes_are_one_line_usage_errors(value, says, capsys):
    rc = cli.main(["ds", "memory", "--params", "7B", "--gpu-mem", value])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"torchdoctor ds memory: --gpu-mem: {says}\n"


def test_ds_memory_help_says_which_unit(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ds", "memory", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu-mem SIZE memory per GPU, e.g. 80 or 80GiB; a plain number is GiB; 80GB is 80 x 10^9 bytes" in out
    assert "--cpu-mem SIZE host RAM per node, e.g. 256 or 256GiB; a plain number is GiB" in out

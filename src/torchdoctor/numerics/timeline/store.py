"""A recorded run on disk: one folder per rank, the statistics in ``.npy`` chunks any tool reads.

Layout of ``RUN_DIR/rank<r>/`` (``rank0`` for a single process)::

    settings.json         what was recorded and how: format version, rank, world size, torch and torchdoctor
                          versions, the model watched, record_every, the autocast seen
    keys.json             the rows' keys, in column order: [module, class, phase ("fwd"/"bwd"), slot, dtype]
    steps-00000.npy       int64 (n,): the steps of chunk 0
    values-00000.npy      float32 (n, k, 2): per step and key, (abs min, abs max); -1 where that key was not
                          recorded in that step (statistics are absolute values, so -1 is never one); nan / inf
                          as they were
    report.json           the non-finite report (NonFiniteReport.to_json), when the run stopped on one

Why ``.npy``: an open, documented format (a magic string, a small header dict, the raw little-endian array) that
numpy, Julia, Rust and a few lines of Python read, written here without numpy (which the install does not bring);
no new dependency (Parquet would need pyarrow). Size: 8 bytes per key and recorded step, plus 8 per step --
500 modules (1,000 keys, forward and backward) x 10,000 steps is 80 MB; ``record_every=N`` divides it by N.
A chunk is written whole to a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import ast
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .collect import Key

FORMAT = 1
_MAGIC = b"\x93NUMPY"
_DESCR = {torch.float32: "<f4", torch.int64: "<i8"}
_DTYPES = {v: k for k, v in _DESCR.items()}


def write_npy(path: str, t: torch.Tensor) -> None:
    """``t`` (float32 or int64, on the CPU) as a ``.npy`` file (format 1.0), written atomically."""
    t = t.contiguous().clone()  # (its own storage: the bytes written are the tensor's, and only its)
    header = f"{{'descr': '{_DESCR[t.dtype]}', 'fortran_order': False, 'shape': {tuple(t.shape)}, }}"
    pad = 64 - (len(_MAGIC) + 4 + len(header) + 1) % 64
    header = (header + " " * pad + "\n").encode("latin1")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header)
        f.write(bytes(t.untyped_storage())[: t.numel() * t.element_size()])
    os.replace(tmp, path)


def read_npy(path: str) -> torch.Tensor:
    """A ``.npy`` file written by :func:`write_npy` (or numpy: little-endian float32 / int64, C order)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_MAGIC):
        raise ValueError(f"{path}: not a .npy file")
    major = data[6]
    size_len = 2 if major == 1 else 4
    (n,) = struct.unpack("<H" if major == 1 else "<I", data[8:8 + size_len])
    start = 8 + size_len
    header = ast.literal_eval(data[start:start + n].decode("latin1"))
    if header.get("fortran_order") or header.get("descr") not in _DTYPES:
        raise ValueError(f"{path}: not a C-order float32 / int64 array")
    dtype = _DTYPES[header["descr"]]
    body = bytearray(data[start + n:])
    shape = tuple(header["shape"])
    return torch.frombuffer(body, dtype=dtype).reshape(shape) if body else torch.empty(shape, dtype=dtype)


class TimelineWriter:
    """Appends recorded steps to ``run_dir/rank<r>/`` (see the module docstring): kept on the device, written every
    ``flush_every`` steps with one host read."""

    def __init__(self, run_dir: str, rank: int | None, settings: dict[str, Any], flush_every: int = 50) -> None:
        self.dir = os.path.join(os.fspath(run_dir), f"rank{rank or 0}")
        os.makedirs(self.dir, exist_ok=True)
        self.flush_every = flush_every
        self.keys: list[Key] = []
        self._column: dict[Key, int] = {}
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, columns, values) on the device
        self._chunk = len([n for n in os.listdir(self.dir) if n.startswith("values-")])
        self.settings = {"format": FORMAT, **settings}
        self._write_json("settings.json", self.settings)

    def update_settings(self, **more: Any) -> None:
        """Add to (or correct) what ``settings.json`` says, e.g. once the monitor has attached."""
        self.settings.update(more)
        self._write_json("settings.json", self.settings)

    def add(self, step: int, keys: list[Key], values: torch.Tensor | None) -> None:
        """One recorded step: its rows' keys and (n, 2) statistics (on their device; nothing is read)."""
        if values is None:
            return
        columns = []
        for key in keys:
            column = self._column.get(key)
            if column is None:
                column = self._column[key] = len(self.keys)
                self.keys.append(key)
            columns.append(column)
        self._pending.append((step, torch.tensor(columns, device=values.device), values))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the steps kept so far as one chunk: one host read."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        device = pending[0][2].device
        table = torch.full((len(pending), len(self.keys), 2), -1.0, dtype=torch.float32, device=device)
        for i, (_, columns, values) in enumerate(pending):
            table[i].index_copy_(0, columns.to(device), values.to(device))
        table = table.cpu()  # THE read of a flush
        steps = torch.tensor([s for s, _, _ in pending], dtype=torch.int64)
        name = f"{self._chunk:05d}"
        self._chunk += 1
        self._write_json("keys.json", [list(k) for k in self.keys])  # (first: a chunk never has keys unnamed)
        write_npy(os.path.join(self.dir, f"values-{name}.npy"), table)
        write_npy(os.path.join(self.dir, f"steps-{name}.npy"), steps)

    def close(self, report: dict[str, Any] | None = None) -> None:
        self.flush()
        if report is not None:
            self._write_json("report.json", report)

    def _write_json(self, name: str, data: Any) -> None:
        path = os.path.join(self.dir, name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


@dataclass
class RankTimeline:
    """One rank's recording, read back: ``values[i, j]`` is (abs min, abs max) of ``keys[j]`` at ``steps[i]``
    (-1: not recorded then)."""

    rank: int
    settings: dict[str, Any]
    keys: list[Key]
    steps: torch.Tensor  # int64 (n,)
    values: torch.Tensor  # float32 (n, k, 2)
    report: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)


def read_rank(folder: str) -> RankTimeline:
    """``RUN_DIR/rank<r>`` read back (chunks with fewer keys than the last are padded with -1)."""
    with open(os.path.join(folder, "settings.json"), encoding="utf-8") as f:
        settings = json.load(f)
    keys_path = os.path.join(folder, "keys.json")
    keys = []
    if os.path.exists(keys_path):
        with open(keys_path, encoding="utf-8") as f:
            keys = [tuple(k) for k in json.load(f)]
    steps, values, problems = [], [], []
    chunks = sorted(n[len("values-"):-len(".npy")] for n in os.listdir(folder)
                    if n.startswith("values-") and n.endswith(".npy"))
    for name in chunks:
        try:
            v = read_npy(os.path.join(folder, f"values-{name}.npy"))
            s = read_npy(os.path.join(folder, f"steps-{name}.npy"))
        except (OSError, ValueError) as e:
            problems.append(f"chunk {name}: {e}")
            continue
        if v.shape[1] < len(keys):
            v = torch.cat([v, torch.full((v.shape[0], len(keys) - v.shape[1], 2), -1.0)], dim=1)
        steps.append(s)
        values.append(v)
    report = None
    report_path = os.path.join(folder, "report.json")
    if os.path.exists(report_path):
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
    rank = int(os.path.basename(folder.rstrip(os.sep)).removeprefix("rank") or 0)
    return RankTimeline(rank, settings, keys,
                        torch.cat(steps) if steps else torch.empty(0, dtype=torch.int64),
                        torch.cat(values) if values else torch.empty(0, len(keys), 2),
                        report, problems)


def read_run(run_dir: str) -> list[RankTimeline]:
    """Every rank's recording in ``run_dir``, by rank."""
    folders = sorted((n for n in os.listdir(run_dir) if n.startswith("rank") and n[4:].isdigit()),
                     key=lambda n: int(n[4:]))
    return [read_rank(os.path.join(run_dir, n)) for n in folders]

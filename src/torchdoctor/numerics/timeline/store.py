"""A recorded run on disk: one folder per rank, the statistics in ``.npy`` chunks any tool reads.

Layout of ``RUN_DIR/rank<r>/`` (``rank0`` for a single process)::

    settings.json         what was recorded and how: format version, rank, world size, torch and torchdoctor
                          versions, the model watched, record_every, the autocast seen
    keys.json             the rows' keys, in column order: [module, class, phase ("fwd"/"bwd"), slot, dtype]
    steps-00000.npy       int64 (n,): the steps of chunk 0
    values-00000.npy      float32 (n, k, 2): per step and key, (abs min, abs max); -1 where that key was not
                          recorded in that step (statistics are absolute values, so -1 is never one); nan / inf
                          as they were
    report.json           the non-finite report (NonFiniteReport.to_json), when the run stopped on one (or the monitor
                          closed holding one); report.txt: the same report as the monitor printed it

Why ``.npy``: an open, documented format (a magic string, a small header dict, the raw little-endian array) that
numpy, Julia, Rust and a few lines of Python read, written here without numpy (which the install does not bring);
no new dependency (Parquet would need pyarrow). Size: 8 bytes per key and recorded step, plus 8 per step --
500 modules (1,000 keys, forward and backward) x 10,000 steps is 80 MB; ``record_every=N`` divides it by N.
A chunk is written whole to a temporary name and renamed, so a reader never sees half of one. A module called
several times in one step (a dropout module reused, micro-batches) is one key: its (smallest abs min, largest abs
max) over the calls. Reading it with numpy::

    import json, numpy as np
    keys = json.load(open("run/rank0/keys.json"))
    steps = np.concatenate([np.load(f"run/rank0/steps-{i:05d}.npy") for i in range(n)])
    values = [np.load(f"run/rank0/values-{i:05d}.npy") for i in range(n)]  # pad earlier chunks' keys with -1

:func:`read_run` does the same with torch (:func:`load_run` also refuses, in one line, a folder that is not a
recording).
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .collect import Key

FORMAT = 1
_MAGIC = b"\x93NUMPY"
_DESCR = {torch.float32: "<f4", torch.int64: "<i8"}
_DTYPES = {v: k for k, v in _DESCR.items()}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a CPU tensor, in C order, without numpy. (``bytes(t.untyped_storage())`` walks the storage one
    byte at a time in Python: 2 s for a 400 KB chunk; this is one copy.)"""
    t = t.detach().cpu().contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def write_npy(path: str, t: torch.Tensor) -> None:
    """``t`` (float32 or int64, on the CPU) as a ``.npy`` file (format 1.0), written atomically."""
    header = f"{{'descr': '{_DESCR[t.dtype]}', 'fortran_order': False, 'shape': {tuple(t.shape)}, }}"
    pad = 64 - (len(_MAGIC) + 4 + len(header) + 1) % 64
    header = (header + " " * pad + "\n").encode("latin1")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header)
        f.write(tensor_bytes(t))
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


#: the rank folders being recorded in this process, by real path: one writer each (a writer no monitor keeps any
#: more -- collected -- leaves by itself)
_OPEN: weakref.WeakValueDictionary[str, TimelineWriter] = weakref.WeakValueDictionary()


class TimelineWriter:
    """Appends recorded steps to ``run_dir/rank<r>/`` (see the module docstring): kept on the device, written every
    ``flush_every`` steps with one host read."""

    def __init__(self, run_dir: str, rank: int | None, settings: dict[str, Any], flush_every: int = 50) -> None:
        if rank is None:  # (no process group: a launcher's RANK keeps two processes out of each other's folder)
            rank = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0
        self.dir = os.path.join(os.fspath(run_dir), f"rank{rank}")
        key = os.path.realpath(self.dir)
        if _OPEN.get(key) is not None:  # two monitors of one process (two models) would mix their columns
            raise ValueError(f"record={os.fspath(run_dir)!r}: {self.dir} is being recorded by another monitor in this "
                             f"process; give each monitor a folder of its own (e.g. record="
                             f"{os.path.join(os.fspath(run_dir), '<model>')!r})")
        os.makedirs(self.dir, exist_ok=True)
        _OPEN[key] = self
        self._key = key
        self.flush_every = flush_every
        self.keys: list[Key] = []
        self._column: dict[Key, int] = {}
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, columns, values) on the device
        # the last step's keys and their columns (on the values' device): a step calling the same modules as the
        # one before -- nearly every step -- reuses them, no per-key work and no host-to-device copy
        self._last: tuple[list[Key], list[int], torch.Tensor] | None = None
        self._keys_written = 0
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
        last = self._last
        if last is not None and last[2].device == values.device and keys == last[0]:
            columns, at = last[1], last[2]
        else:
            columns = []
            for key in keys:
                column = self._column.get(key)
                if column is None:
                    column = self._column[key] = len(self.keys)
                    self.keys.append(key)
                columns.append(column)
            at = torch.tensor(list(dict.fromkeys(columns)), device=values.device)
            self._last = (list(keys), columns, at)
        if at.shape[0] < len(columns):  # a module called more than once this step: one row per key
            values = _combined(columns, values)
        self._pending.append((step, at, values))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the steps kept so far as one chunk: one host read."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        device = pending[0][2].device
        table = torch.full((len(pending), len(self.keys), 2), -1.0, dtype=torch.float32, device=device)
        i = 0
        while i < len(pending):  # steps that share their columns are written by one copy
            j = i + 1
            while j < len(pending) and pending[j][1] is pending[i][1]:
                j += 1
            values = torch.stack([v.to(device) for _, _, v in pending[i:j]])
            table[i:j].index_copy_(1, pending[i][1].to(device), values)
            i = j
        table = table.cpu()  # THE read of a flush
        steps = torch.tensor([s for s, _, _ in pending], dtype=torch.int64)
        name = f"{self._chunk:05d}"
        self._chunk += 1
        if len(self.keys) != self._keys_written:  # (first: a chunk never has keys unnamed)
            self._write_json("keys.json", [list(k) for k in self.keys])
            self._keys_written = len(self.keys)
        write_npy(os.path.join(self.dir, f"values-{name}.npy"), table)
        write_npy(os.path.join(self.dir, f"steps-{name}.npy"), steps)

    def close(self, report: dict[str, Any] | None = None, text: str | None = None) -> None:
        """The last write (what is kept, the report where there is one); the folder is free for another monitor."""
        if _OPEN.get(self._key) is self:
            del _OPEN[self._key]
        self.write_report(report, text)

    def write_report(self, report: dict[str, Any] | None = None, text: str | None = None) -> None:
        """What is kept so far, and the report (JSON, and the text the monitor printed) beside it; still open."""
        self.flush()
        if report is not None:
            self._write_json("report.json", report)
        if text is not None:
            path = os.path.join(self.dir, "report.txt")
            with open(f"{path}.{os.getpid()}.tmp", "w", encoding="utf-8") as f:
                f.write(text.rstrip("\n") + "\n")
            os.replace(f"{path}.{os.getpid()}.tmp", path)

    def _write_json(self, name: str, data: Any) -> None:
        path = os.path.join(self.dir, name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


def _combined(columns: list[int], values: torch.Tensor) -> torch.Tensor:
    """Rows of one step that share a column folded into one, in the order of the columns' first rows: the smallest
    abs min, the largest abs max (nan propagates, as in the statistics themselves). Device ops only."""
    where = {c: i for i, c in enumerate(dict.fromkeys(columns))}
    at = torch.tensor([where[c] for c in columns], device=values.device)
    lo = values.new_zeros(len(where)).scatter_reduce_(0, at, values[:, 0], "amin", include_self=False)
    hi = values.new_zeros(len(where)).scatter_reduce_(0, at, values[:, 1], "amax", include_self=False)
    return torch.stack([lo, hi], dim=1)


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
    report_text: str | None = None  # report.txt: the report as the monitor printed it


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
    text = None
    if os.path.exists(os.path.join(folder, "report.txt")):
        with open(os.path.join(folder, "report.txt"), encoding="utf-8", errors="replace") as f:
            text = f.read()
    rank = int(os.path.basename(folder.rstrip(os.sep)).removeprefix("rank") or 0)
    return RankTimeline(rank, settings, keys,
                        torch.cat(steps) if steps else torch.empty(0, dtype=torch.int64),
                        torch.cat(values) if values else torch.empty(0, len(keys), 2),
                        report, problems, text)


def read_run(run_dir: str) -> list[RankTimeline]:
    """Every rank's recording in ``run_dir``, by rank."""
    folders = sorted((n for n in os.listdir(run_dir) if n.startswith("rank") and n[4:].isdigit()),
                     key=lambda n: int(n[4:]))
    return [read_rank(os.path.join(run_dir, n)) for n in folders]


class NotARecording(ValueError):
    """A path given as a recording that is not one (said in one line)."""


def load_run(path: str) -> list[RankTimeline]:
    """:func:`read_run`, for a path a user typed: a run folder (``rank<r>/`` inside) or one rank's folder. Anything
    else -- missing, a file, no ``settings.json``, a newer format, unreadable JSON -- is :class:`NotARecording`
    with one line that says which."""
    if not os.path.exists(path):
        raise NotARecording(f"{path}: no such folder")
    if not os.path.isdir(path):
        raise NotARecording(f"{path}: not a folder (a recording is the folder given to --record)")
    if os.path.exists(os.path.join(path, "settings.json")):
        folders = [path]
    else:
        names = sorted((n for n in os.listdir(path) if n.startswith("rank") and n[4:].isdigit()
                        and os.path.exists(os.path.join(path, n, "settings.json"))), key=lambda n: int(n[4:]))
        if not names:
            raise NotARecording(f"{path}: not a numerics recording (no rank<r>/settings.json inside; record one "
                                "with run --numerics --record DIR or NumericsMonitor(record=DIR))")
        folders = [os.path.join(path, n) for n in names]
    ranks = []
    for folder in folders:
        try:
            r = read_rank(folder)
        except (OSError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
            raise NotARecording(f"{folder}: unreadable recording ({e})") from None
        if not isinstance(r.settings, dict) or r.settings.get("format") not in range(1, FORMAT + 1):
            got = r.settings.get("format") if isinstance(r.settings, dict) else None
            raise NotARecording(f"{folder}: recording format {got!r}, this torchdoctor reads 1 to {FORMAT} "
                                "(written by a newer torchdoctor?)")
        ranks.append(r)
    return ranks

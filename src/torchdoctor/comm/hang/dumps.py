"""Reading Flight Recorder dumps: one per rank, from a folder.

Two kinds of file, told apart by their first bytes, never by trust:

* ``torchdoctor-flight-rank<r>.json``: what ``torchdoctor run``'s start-up hook wrote in a rank as it ended
  (:mod:`torchdoctor.run.inside.flight`): the Flight Recorder dump as JSON, plus the rank, host, why it dumped and
  the Python stack it was at;
* Flight Recorder's own pickles (``<prefix><rank>``, e.g. ``nccl_trace_rank_3``: NCCL's watchdog writes them on a
  timeout with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, ``torch.distributed`` writes them on request). A pickle can run
  any code when loaded, so it is read by :class:`PlainUnpickler`, which builds dicts, lists, tuples, strings,
  numbers, booleans and None and refuses every class or function a pickle names -- never ``pickle.load``.

Each file that cannot be read is one line of :attr:`Dumps.problems` (truncated, a pickle naming an object, not a
dump, a rank twice, ranks from two runs), and the others are still read.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

MAX_DUMP_BYTES = 256 << 20  # one rank's dump; Flight Recorder's default 2000 entries are a few MB
MAX_FILES = 4096
OURS = re.compile(r"^torchdoctor-flight-rank(\d+)\.json$")
_RANK_SUFFIX = re.compile(r"^(.*?)(\d+)$")
_PICKLE_START = (b"\x80",)  # protocol 2+ pickles begin with PROTO


class NotPlainData(pickle.UnpicklingError):
    """The pickle names a class or function: it is not a plain dump (and loading it could run code)."""


class PlainUnpickler(pickle.Unpickler):
    """Builds only what needs no class lookup (dict, list, tuple, set, str, bytes, int, float, bool, None): any
    GLOBAL / STACK_GLOBAL / INST / OBJ opcode asks :meth:`find_class`, which refuses; persistent ids too."""

    def find_class(self, module: str, name: str) -> Any:
        raise NotPlainData(f"it names {module}.{name}, an object, not plain data (refused: loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise NotPlainData("it refers to outside objects (persistent ids), not plain data")


def plain_loads(data: bytes) -> Any:
    """Unpickle ``data`` into plain containers and numbers only (:class:`PlainUnpickler`)."""
    return PlainUnpickler(io.BytesIO(data)).load()


@dataclass
class RankDump:
    rank: int
    path: str
    fr: dict  # Flight Recorder's dump: version, pg_config, pg_status, entries (with frames when it kept stacks)
    host: str | None = None
    reason: str | None = None  # why it dumped ("SIGTERM", "exception: RuntimeError: ...", "timeout")
    stack: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, function), innermost last
    pid: int | None = None
    run_id: str | None = None  # the job it belongs to (torchrun's run id, or the master address and port)
    world_size: int | None = None  # the job's ranks (torchdoctor's dumps say; Flight Recorder's pickles do not)
    time: float | None = None  # when it was written (seconds since the epoch; torchdoctor's dumps)


@dataclass
class Dumps:
    ranks: dict[int, RankDump] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int | None:
        """The job's rank count, when a dump says it."""
        return max((d.world_size for d in self.ranks.values() if d.world_size), default=None)

    @property
    def without_dump(self) -> list[int]:
        """The job's ranks that left no (readable) dump, when the rank count is known."""
        world = self.world_size
        return [r for r in range(world) if r not in self.ranks] if world else []

    @property
    def entries(self) -> int:
        return sum(len(d.fr.get("entries") or ()) for d in self.ranks.values())


def frames_of(raw: Any, innermost_first: bool = False) -> list[tuple[str, int, str]]:
    """(file, line, function) frames, innermost last (Flight Recorder's entries list the innermost first)."""
    out = []
    for f in raw or ():
        if isinstance(f, dict):
            out.append((str(f.get("filename", "?")), int(f.get("line", 0) or 0), str(f.get("name", "?"))))
        elif isinstance(f, (list, tuple)) and len(f) >= 3:
            out.append((str(f[0]), int(f[1] or 0), str(f[2])))
    return out[::-1] if innermost_first else out


def _check_fr(fr: Any) -> dict:
    if not isinstance(fr, dict) or not isinstance(fr.get("entries", []), list):
        raise ValueError("not a Flight Recorder dump (no entries list)")
    return fr


def read_file(path: str, rank_hint: int | None = None) -> RankDump:
    """One rank's dump (raises ValueError with the reason, one line)."""
    size = os.path.getsize(path)
    if size > MAX_DUMP_BYTES:
        raise ValueError(f"{size >> 20} MiB, more than a dump ({MAX_DUMP_BYTES >> 20} MiB at most)")
    with open(path, "rb") as f:
        data = f.read(MAX_DUMP_BYTES + 1)
    if not data:
        raise ValueError("empty (the rank was killed while it wrote it?)")
    if data.startswith(_PICKLE_START):
        try:
            fr = plain_loads(data)
        except NotPlainData as e:
            raise ValueError(f"a pickle that is not a plain dump: {e}") from None
        except (EOFError, pickle.UnpicklingError, IndexError, ValueError, TypeError, MemoryError) as e:
            raise ValueError(f"a truncated or damaged pickle ({type(e).__name__}: {str(e)[:80] or 'cut short'})") \
                from None
        if rank_hint is None:
            raise ValueError("a pickle whose name carries no rank number (Flight Recorder names them <prefix><rank>)")
        return RankDump(rank_hint, path, _check_fr(fr))
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"neither a Flight Recorder pickle nor torchdoctor's JSON dump ({type(e).__name__})") from None
    if not isinstance(doc, dict) or "fr" not in doc or not isinstance(doc.get("rank"), int):
        raise ValueError("JSON, but not a torchdoctor flight dump (no rank / fr)")
    fr = doc["fr"]
    if fr is None:
        fr = {"entries": [], "pg_config": {}, "pg_status": {}, "version": None}
    world = doc.get("world_size")
    when = doc.get("time")
    return RankDump(doc["rank"], path, _check_fr(fr), doc.get("host"), doc.get("reason"), frames_of(doc.get("stack")),
                    doc.get("pid"), doc.get("run_id"), world if isinstance(world, int) and world > 0 else None,
                    float(when) if isinstance(when, (int, float)) else None)


def read_folder(folder: str, prefixes: tuple[str, ...] = (), out: Dumps | None = None) -> Dumps:
    """Every rank's dump in ``folder``: torchdoctor's JSON dumps, and pickles named ``<prefix><rank>`` (``prefixes``
    given, e.g. from ``TORCH_FR_DUMP_TEMP_FILE``; else any file ending in digits that starts like a pickle). With
    ``out``, added to the dumps already read (a rank found twice keeps the richer dump)."""
    out = Dumps() if out is None else out
    try:
        names = sorted(os.listdir(folder))[:MAX_FILES]
    except OSError as e:
        out.problems.append(f"{folder}: {e.strerror or e}")
        return out
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        ours = OURS.match(name)
        rank = int(ours.group(1)) if ours else None
        if rank is None:
            m = _RANK_SUFFIX.match(name)
            if not m or (prefixes and m.group(1) not in prefixes):
                continue
            if not prefixes and not _starts_like_pickle(path):
                continue
            rank = int(m.group(2))
        try:
            dump = read_file(path, rank)
        except (OSError, ValueError) as e:
            out.problems.append(f"{name}: {e}")
            continue
        if dump.rank in out.ranks:
            _merge(out, dump)
            continue
        out.ranks[dump.rank] = dump
    _one_run(out)
    return out


def _merge(out: Dumps, dump: RankDump) -> None:
    """A second dump of one rank: torchdoctor's own (with the rank's stack) and Flight Recorder's pickle of the same
    process complete each other; two of one kind are a rank twice."""
    first = out.ranks[dump.rank]
    ours = [d for d in (first, dump) if OURS.match(os.path.basename(d.path))]
    if len(ours) == 1:
        mine, theirs = ours[0], dump if ours[0] is first else first
        if len(theirs.fr.get("entries", [])) >= len(mine.fr.get("entries", [])):
            mine.fr = theirs.fr  # the records with more entries, the stack and reason of ours
        out.ranks[dump.rank] = mine
        return
    keep = dump if _richer(dump, first) else first
    out.ranks[dump.rank] = keep
    out.problems.append(f"{os.path.basename(dump.path)}: rank {dump.rank} again (also "
                        f"{os.path.basename(first.path)}); kept {os.path.basename(keep.path)}")


def _richer(a: RankDump, b: RankDump) -> bool:
    """Prefer the dump that kept stacks (Flight Recorder's own pickle has frames; ours has the rank's stack)."""
    return len(a.fr.get("entries", [])) > len(b.fr.get("entries", []))


def _starts_like_pickle(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(1) in (b"\x80",)
    except OSError:
        return False


def _one_run(dumps: Dumps) -> None:
    """Ranks from two jobs in one folder cannot be compared: keep the larger group (by run id, else by the process
    group's rank list), say which files were left out."""
    def key(d: RankDump) -> str:
        if d.run_id:
            return d.run_id
        config = d.fr.get("pg_config") or {}
        default = config.get("0") or config.get("") or next(iter(config.values()), {})
        return json.dumps(default, sort_keys=True, default=str) if default else ""

    groups: dict[str, list[int]] = {}
    for rank, dump in dumps.ranks.items():
        groups.setdefault(key(dump), []).append(rank)
    known = {k: v for k, v in groups.items() if k}
    if len(known) <= 1:
        return
    keep = max(known, key=lambda k: len(known[k]))
    for k, ranks in known.items():
        if k == keep:
            continue
        for r in ranks:
            dumps.problems.append(f"{os.path.basename(dumps.ranks[r].path)}: rank {r} is from another run than "
                                  f"ranks {sorted(known[keep])} (left out)")
            del dumps.ranks[r]

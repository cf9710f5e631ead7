"""Run a command under a memory and process limit of its own, and end every process it started.

A test of something that spawns processes or reads input must not be able to hurt the machine running the
suite when the code under test is wrong (a `comm --local 100000` that really starts every rank, a `ds check
/dev/zero` that really reads forever). `run_bounded` puts the command in a child cgroup with `memory.max` /
`memory.limit_in_bytes` and `pids.max` where this process may make one (root, a writable cgroup v2 or v1 tree),
else under `resource.setrlimit` (address space and, for a non-root user, process count). Either way the
command starts in a session of its own, and every process carrying this run's marker in its environment --
whatever session or process group it moved to -- is killed when the run ends; `Bounded.leftovers` says which
were still alive when the command itself had exited (a launcher that left a rank behind).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "TORCHDOCTOR_TEST_BOUND"


@dataclass
class Bounded:
    proc: subprocess.CompletedProcess
    how: str  # "cgroup v2", "cgroup v1" or "setrlimit"
    leftovers: list[int] = field(default_factory=list)  # marked processes alive once the command had exited
    timed_out: bool = False


def _own_cgroup(controller: str) -> tuple[Path, str] | None:
    """(this process's cgroup directory for ``controller``, its version) or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controller in controllers.split(","):
            return Path(f"/sys/fs/cgroup/{controllers}{path}"), "v1"
        if controllers == "":
            v2 = path
    if v2 is not None:
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            d = root / v2.lstrip("/")
            if (d / "cgroup.controllers").exists() and controller in (d / "cgroup.controllers").read_text().split():
                return d, "v2"
    return None


class _Cgroups:
    """Child cgroups (memory, pids) that the command joins before it execs; removed afterwards."""

    def __init__(self, mem_bytes: int, max_procs: int):
        self.dirs: list[Path] = []
        self.how = ""
        name = f"torchdoctor-bounded-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        mem = _own_cgroup("memory")
        if mem is None:
            raise OSError("no memory cgroup")
        base, version = mem
        self.how = f"cgroup {version}"
        self._make(base / name, {"memory.max" if version == "v2" else "memory.limit_in_bytes": str(mem_bytes)})
        if version == "v2":
            with contextlib.suppress(OSError):  # the pids controller may not be enabled for children
                (self.dirs[0] / "pids.max").write_text(str(max_procs))
            with contextlib.suppress(OSError):
                (self.dirs[0] / "memory.swap.max").write_text("0")
        else:
            pids = _own_cgroup("pids")
            if pids is not None and pids[1] == "v1":
                with contextlib.suppress(OSError):
                    self._make(pids[0] / name, {"pids.max": str(max_procs)})

    def _make(self, d: Path, limits: dict[str, str]) -> None:
        d.mkdir()
        self.dirs.append(d)
        try:
            for k, v in limits.items():
                (d / k).write_text(v)
        except OSError:
            self.remove()
            raise

    def join(self) -> None:  # in the child, before exec
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def remove(self) -> None:
        for d in reversed(self.dirs):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    for pid in (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else ():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
                    time.sleep(0.05)
        self.dirs = []


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``MARKER=marker`` (ours: same user, or root)."""
    needle = f"{MARKER}={marker}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            env = (p / "environ").read_bytes()
            state, ppid = (p / "stat").read_text().rsplit(")", 1)[-1].split()[:2]
            for _ in range(5):  # a process in the middle of execve() reads as an empty environment for a moment
                if env or state == "Z" or ppid in ("0", "2"):  # (kernel threads have none at all)
                    break
                time.sleep(0.01)
                env = (p / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            out.append(int(p.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _owner(d: Path) -> int | None:
    try:
        return d.stat().st_uid
    except OSError:
        return None


def _kill_marked(marker: str) -> None:
    for _ in range(50):
        pids = marked_pids(marker)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def run_bounded(cmd: list[str], *, mem_bytes: int = 2 << 30, max_procs: int = 64, timeout: float = 120,
                env: dict[str, str] | None = None, input: bytes | None = None, cwd: str | None = None,
                settle_s: float = 1.0, cgroup: bool = True) -> Bounded:
    """Run ``cmd`` bounded; ``settle_s`` seconds after it exits, marked processes still alive are leftovers.
    ``cgroup=False`` takes the setrlimit fallback even where a cgroup could be made."""
    marker = uuid.uuid4().hex
    full_env = {**(os.environ if env is None else env), MARKER: marker}
    try:
        cg: _Cgroups | None = _Cgroups(mem_bytes, max_procs) if cgroup else None
    except OSError:
        cg = None

    def preexec() -> None:
        if cg is not None:
            cg.join()
        else:
            # address space, not RSS: an interpreter that imports torch maps a few GiB it never touches
            resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
            if os.geteuid() != 0:  # root ignores RLIMIT_NPROC; it also counts the user's other processes
                mine = sum(1 for d in Path("/proc").iterdir() if d.name.isdigit() and _owner(d) == os.geteuid())
                n = max_procs + mine
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))

    timed_out = False
    leftovers: list[int] = []
    # files, not pipes: a process left behind keeps a pipe open, and reading to its end would wait for it
    with tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
        try:
            p = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdin=subprocess.PIPE if input is not None else
                                 subprocess.DEVNULL, stdout=fout, stderr=ferr, start_new_session=True,
                                 preexec_fn=preexec)
            if input is not None:
                with contextlib.suppress(BrokenPipeError):
                    p.stdin.write(input)
                p.stdin.close()
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline and marked_pids(marker):
                time.sleep(0.05)
            leftovers = marked_pids(marker)
            fout.seek(0)
            ferr.seek(0)
            return Bounded(subprocess.CompletedProcess(cmd, p.returncode, fout.read(), ferr.read()),
                           cg.how if cg is not None else "setrlimit", leftovers, timed_out)
        finally:
            _kill_marked(marker)
            if cg is not None:
                cg.remove()

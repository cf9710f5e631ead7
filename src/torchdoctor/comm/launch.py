"""Where this process sits in the job: rank, world size, local rank and the rendezvous address.

Read from, in order: the torchrun / generic launcher variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), then SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of
SLURM_JOB_NODELIST). Pure functions over an environment mapping, so every case is testable.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass


class LaunchError(ValueError):
    """The environment does not describe a usable job (a user mistake: exit code 2)."""


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    mode: str  # "torchrun" | "env" | "slurm" | "local"
    # True when a process that outlives the ranks hosts the store (torchrun's agent, `--local`'s parent):
    # the side channel then survives any rank's death, rank 0's included.
    agent_store: bool = False
    run_id: str = "0"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM node list such as ``gpu[01-03,07],login1`` into host names."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", spec):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix.strip() and not ranges:
            continue
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise LaunchError(f"cannot read the SLURM node list {spec!r} (range {part!r})")
            hosts.extend(f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1))
    if not hosts:
        raise LaunchError(f"cannot read the SLURM node list {spec!r}")
    return hosts


def from_env(env: Mapping[str, str]) -> Launch | None:
    """The launch described by ``env``, or None when no launcher variables are set."""
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise LaunchError(f"launcher variables incomplete: {', '.join(missing)} not set")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        agent = (env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
                 or env.get("TORCHDOCTOR_AGENT_STORE") == "1")
        run_id = f"{env.get('TORCHELASTIC_RUN_ID', '0')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        mode = env.get("TORCHDOCTOR_LAUNCH_MODE") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
        launch = Launch(rank, world, local, env["MASTER_ADDR"], _int(env, "MASTER_PORT"), mode, agent, run_id)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        # the step's nodes: a step on part of the allocation does not include the job's first node
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodes and not env.get("MASTER_ADDR"):
            raise LaunchError("under srun but neither SLURM_JOB_NODELIST nor MASTER_ADDR is set")
        addr = env.get("MASTER_ADDR") or expand_hostlist(nodes)[0]
        job = env.get("SLURM_JOB_ID", "0")
        step = env.get("SLURM_STEP_ID", "0")
        # A port every task derives alike without talking, below the ephemeral range: distinct for 1000
        # consecutive job ids and 10 concurrent steps of one job (MASTER_PORT overrides it).
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        elif job.isdigit():
            port = 20000 + int(job) % 1000 * 10 + (int(step) % 10 if step.isdigit() else 0)
        else:
            port = 29500
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        launch = Launch(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), local, addr, port, "slurm", False, job)
    else:
        return None
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise LaunchError(f"rank {launch.rank} is outside world size {launch.world_size}")
    if not 0 < launch.master_port < 65536:
        raise LaunchError(f"master port {launch.master_port} is not a TCP port")
    return launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

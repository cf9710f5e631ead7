"""The connectivity checks, one function per stage; each raises on a failure it can see itself.

A stage that never returns is the watchdog's business (:mod:`torchdoctor.comm.session`), not theirs.
"""

from __future__ import annotations

import json
from typing import Any


class WrongResult(RuntimeError):
    """A collective completed but delivered the wrong values (corruption, not a hang)."""


def allocate(torch, device) -> None:
    """Select the device and allocate (and touch) 4 MiB on it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    x = torch.ones(1 << 20, device=device)
    if float(x.sum().item()) != float(1 << 20):
        raise WrongResult(f"a 4 MiB tensor of ones on {device} sums to {x.sum().item()}")


def _compare(torch, got, want, what: str) -> None:
    bad = (got != want).nonzero()
    if bad.numel():
        i = int(bad[0, 0]) if bad.dim() > 1 else int(bad[0])
        raise WrongResult(
            f"{what}: {bad.shape[0]} of {got.numel()} elements wrong; first at [{i}]: got "
            f"{got.flatten()[i].item():g}, expected {want.flatten()[i].item():g}"
        )


def all_reduce(torch, dist, device, rank: int, n: int) -> None:
    """Sum of (rank+1)*(i+1) over ranks: exact in float32 for these sizes, so compared exactly."""
    i = torch.arange(1, 4097, dtype=torch.float32, device=device)
    x = i * (rank + 1)
    dist.all_reduce(x)
    _compare(torch, x, i * (n * (n + 1) // 2), "all_reduce sum")


def all_gather_json(torch, dist, device, obj: Any, n: int) -> list[Any]:
    """Every rank's ``obj`` (plain JSON data), in rank order: the sizes gathered, then the encoded bytes padded to the
    longest. Not ``all_gather_object``: that turns the bytes back with ``tensor.numpy()`` (torch 2.x
    ``distributed_c10d._tensor_to_object``), and numpy is no dependency of torch's wheel -- without it every rank
    fails with "Numpy is not available"; and JSON, unlike its pickle, runs no code of another process."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(parts, mine)
    return [json.loads(bytes(p[:k].cpu().tolist())) for p, k in zip(parts, lengths)]


def all_gather_identity(torch, dist, device, ident: dict[str, Any], n: int, expected: dict[int, dict]) -> None:
    got = all_gather_json(torch, dist, device, ident, n)
    for r, g in enumerate(got):
        want = expected.get(r)
        if not isinstance(g, dict) or g.get("rank") != r or (want and g.get("pid") != want.get("pid")):
            raise WrongResult(f"all_gather of identities: slot {r} holds {str(g)[:80]!r}, expected rank {r}'s")


def broadcast(torch, dist, device, rank: int) -> None:
    want = (torch.arange(1 << 16, device=device) % 251).to(torch.float32)
    x = want.clone() if rank == 0 else torch.zeros_like(want)
    dist.broadcast(x, src=0)
    _compare(torch, x, want, "broadcast from rank 0")


def ring(torch, dist, device, rank: int, n: int, post) -> None:
    """Each rank sends its rank to the next and receives from the previous; ``post`` records progress."""
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    out = torch.full((1024,), float(rank), device=device)
    inc = torch.full((1024,), -1.0, device=device)
    send = dist.isend(out, nxt)
    recv = dist.irecv(inc, prv)
    recv.wait()
    post({"received": True, "sent": False})
    send.wait()
    post({"received": True, "sent": True})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _compare(torch, inc, torch.full_like(inc, float(prv)), f"ring recv {prv}->{rank}")

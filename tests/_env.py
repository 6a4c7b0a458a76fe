"""Environment of the child Python processes that tests start."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pythonpath(root: Path) -> str:
    """``root`` first, then the caller's ``PYTHONPATH`` (packages installed with ``pip --target``
    are found only through it)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a gloo process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, job: Callable[[int, Path], object], port: int, out: str, nprocs: int,
               timeout_s: float) -> None:
    """One spawned rank: one torch thread, a gloo group of ``nprocs``, ``job(rank, out)`` saved
    as ``out/rank<rank>.pt``, the group destroyed whatever happens."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                            timeout=timedelta(seconds=timeout_s))
    try:
        torch.save(job(rank, Path(out)), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(job: Callable[[int, Path], object], out: Path, nprocs: int, *, weights_only: bool = False,
                timeout_s: float = 300.0) -> list:
    """Run ``job(rank, out)`` on ``nprocs`` local gloo ranks (``torch.multiprocessing``; a
    collective that waits longer than ``timeout_s`` fails instead of hanging) and return each
    rank's result, by rank (saved as ``out/rank<r>.pt`` and loaded here).  ``job`` must be a
    module-level function (it is pickled)."""
    mp.spawn(_rank_main, args=(job, free_port(), str(out), nprocs, timeout_s), nprocs=nprocs, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=weights_only) for r in range(nprocs)]

"""Environment of the child Python processes that tests start."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
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


def spawn_ranks(worker: Callable[[int, int, str], None], out: Path, nprocs: int, *,
                weights_only: bool = False) -> list:
    """Run ``worker(rank, port, str(out))`` in ``nprocs`` processes (``torch.multiprocessing``),
    each of which saves its result as ``out/rank<r>.pt``; return those results by rank."""
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=nprocs, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=weights_only) for r in range(nprocs)]

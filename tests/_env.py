"""Environment of the child Python processes that tests start."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - imported before any group, as laplace_debiased.cli does
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
    as ``out/rank<rank>.pt``, every rank waiting for the others after a success, the group
    destroyed whatever happens."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                            timeout=timedelta(seconds=timeout_s))
    try:
        torch.save(job(rank, Path(out)), Path(out) / f"rank{rank}.pt")
        # no rank destroys the group while a peer may still be in a collective with it
        if dist.is_initialized():  # a failed distributed fit destroyed the group itself
            dist.barrier()
    finally:
        if dist.is_initialized():  # a failed distributed fit destroys it itself
            dist.destroy_process_group()


def spawn_ranks(job: Callable[[int, Path], object], out: Path, nprocs: int, *, weights_only: bool = False,
                timeout_s: float = 1800.0) -> list:
    """Run ``job(rank, out)`` on ``nprocs`` local gloo ranks (``torch.multiprocessing``; a
    collective that waits longer than ``timeout_s`` fails instead of hanging) and return each
    rank's result, by rank (saved as ``out/rank<r>.pt`` and loaded here).  ``job`` must be a
    module-level function (it is pickled).  The default ``timeout_s`` is generous on purpose: a
    rank of a loaded machine may wait minutes for a peer that is still importing torch, and
    that must not fail a test."""
    mp.spawn(_rank_main, args=(job, free_port(), str(out), nprocs, timeout_s), nprocs=nprocs, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=weights_only) for r in range(nprocs)]


def _outcome_main(rank: int, job: Callable[[int, Path], object], port: int, out: str, nprocs: int,
                  env: dict[str, str]) -> None:
    """One rank of :func:`spawn_ranks_outcomes`: ``env`` set, then :func:`_rank_main` with the
    outcome ``{"result": ...}`` or ``{"error": (type name, message)}`` saved instead of raised."""
    os.environ.update(env)

    def recorded(rank: int, out: Path) -> dict:
        try:
            return {"result": job(rank, out)}
        except Exception as err:  # noqa: BLE001 - the outcome under test
            return {"error": (type(err).__name__, str(err))}

    _rank_main(rank, recorded, port, out, nprocs, timeout_s=1800.0)


def spawn_ranks_outcomes(job: Callable[[int, Path], object], out: Path, nprocs: int, *,
                         env: dict[str, str] | None = None, hang_guard_s: float = 900.0) -> list:
    """Run ``job(rank, out)`` on ``nprocs`` local gloo ranks with ``env`` added to their
    environment, and wait for every rank to end by itself: nothing stops a rank because another
    failed (unlike ``mp.spawn``). Returns ``(exit code, outcome or None)`` by rank; a killed
    rank has exit code ``-SIGKILL`` and no outcome. The collective timeout is 30 minutes, so a
    rank that ends does so because the failure reached it, not because it timed out; a rank
    still running after ``hang_guard_s`` is a hang: it is killed and the call raises."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_outcome_main, args=(r, job, port, str(out), nprocs, env or {}))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + hang_guard_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    if hung:
        raise AssertionError(f"rank(s) {hung} still running after {hang_guard_s} s: a hang")
    found = [out / f"rank{r}.pt" for r in range(nprocs)]
    return [(p.exitcode, torch.load(f, weights_only=False) if f.exists() else None) for p, f in zip(procs, found)]


def assert_every_rank_equals(states: Sequence[Mapping], single: Mapping,
                             flat: Callable[[Mapping], list[tuple[str, torch.Tensor]]], *,
                             same: Sequence[str] = (), rtol: float = 1e-6,
                             atol: float | Callable[[torch.Tensor], float] = 1e-9) -> None:
    """Every rank's state equals the single-process one: the fields ``same`` exactly, and the
    tensors ``flat(state)`` (``(name, tensor)`` pairs) in the same names, shapes and order, to
    ``rtol`` / ``atol`` (a number, or a function of the single-process tensor)."""
    want_items = flat(single)
    for r, state in enumerate(states):
        for key in same:
            assert state[key] == single[key], f"rank {r} {key}"
        got_items = flat(state)
        assert [k for k, _ in got_items] == [k for k, _ in want_items], f"rank {r}: other fields"
        for (key, got), (_, want) in zip(got_items, want_items):
            assert got.shape == want.shape, f"rank {r} {key}"
            tol = atol(want) if callable(atol) else atol
            torch.testing.assert_close(got, want, rtol=rtol, atol=tol, msg=f"rank {r} {key}")

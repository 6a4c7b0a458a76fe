"""What the ranks of a ``torch.distributed`` group tell each other when one of them fails.

A rank that fails inside a collective section (a distributed fit,
[`fail_together`][laplace_debiased.parallel.distributed.fail_together]) writes its error into the
group's key-value store ([`report_failure`][laplace_debiased.parallel.rank_failures.report_failure]) *before*
it leaves the group. The peers blocked in a collective with it then get a communication error from the backend
(gloo: "Connection closed by peer"), which
[`peer_failure`][laplace_debiased.parallel.rank_failures.peer_failure] turns into a
[`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError] that names the failed rank and quotes
its error: the store entry exists before the connection closes, so no timing decides what the message says. A
rank that cannot write (killed, ``SIGKILL``; crashed in native code) is named when it ran on this host and its
process is gone (each rank announces its host and pid in the store,
[`announce`][laplace_debiased.parallel.rank_failures.announce]).

[`wait_for_peers`][laplace_debiased.parallel.rank_failures.wait_for_peers] lets the command line keep a failed
rank alive until every other rank has reported its own error (or is gone), so that a launcher that stops the
remaining workers when one exits (``torchrun``) cannot cut a peer's error message.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["PeerRankError", "announce", "report_failure", "peer_failure", "wait_for_peers"]

_PREFIX = "laplace_debiased"
#: how long, at most, a killed rank's process may take to disappear after its sockets closed
_EXIT_GRACE_S = 10.0
_kept_stores: list = []  # the store a failed rank reported into stays served until it exits


class PeerRankError(RuntimeError):
    """Raised on the ranks whose own work succeeded when another rank failed; names that rank
    and, when it could report it, its error."""


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no group, or one without a store
        return None


def _key(kind: str, rank: int) -> str:
    return f"{_PREFIX}/{kind}/{rank}"


def announce() -> None:
    """Record this rank's host and pid in the group's store (collective-free, once per group)."""
    store = _store()
    if store is not None:
        store.set(_key("pid", dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")


def report_failure(err: BaseException, what: str) -> None:
    """Record this rank's failure in the group's store, where
    [`peer_failure`][laplace_debiased.parallel.rank_failures.peer_failure] finds it."""
    store = _store()
    if store is None:
        return
    _kept_stores.append(store)
    message = f"{type(err).__name__}: {err}"[:4000]
    store.set(_key("failed", dist.get_rank()), f"{what}: {message}")


def _read(store, key: str) -> str | None:
    try:
        return store.get(key).decode(errors="replace") if store.check([key]) else None
    except RuntimeError:  # the store went away with its host rank
        return None


def _gone(pid: int) -> bool:
    """The process ``pid`` of this host has exited (no such process, or a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    except OSError:
        return False
    return state in ("Z", "X")


def _local_pids(store, ranks: list[int]) -> dict[int, int]:
    """Peers of this host among ``ranks``: ``{rank: pid}`` (from
    [`announce`][laplace_debiased.parallel.rank_failures.announce])."""
    host, pids = socket.gethostname(), {}
    for r in ranks:
        entry = _read(store, _key("pid", r))
        if entry and entry.rsplit(" ", 1)[0] == host:
            pids[r] = int(entry.rsplit(" ", 1)[1])
    return pids


def _dead_peers(store, world: int, me: int) -> list[int]:
    """Ranks of this host whose process is gone, waiting up to ``_EXIT_GRACE_S`` for a
    peer whose connection closed to finish exiting."""
    pids = _local_pids(store, [r for r in range(world) if r != me])
    deadline = time.monotonic() + _EXIT_GRACE_S
    while True:
        dead = [r for r, pid in pids.items() if _gone(pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def peer_failure(err: BaseException, what: str) -> PeerRankError:
    """The [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError] for a collective that
    failed with ``err`` during ``what``: it names the rank(s) that reported a failure, else this host's peers
    that are gone."""
    store, me, world = _store(), dist.get_rank(), dist.get_world_size()
    if store is not None:
        reports = {r: _read(store, _key("failed", r)) for r in range(world) if r != me}
        failed = {r: m for r, m in reports.items() if m is not None}
        if failed:
            named = "; ".join(f"rank {r} failed in {m}" for r, m in sorted(failed.items()))
            return PeerRankError(f"{named} (rank {me} stopped during {what})")
        dead = _dead_peers(store, world, me)
        if dead:
            return PeerRankError(
                f"rank {', '.join(map(str, dead))} stopped without reporting an error (killed, or "
                f"crashed in native code) while rank {me} was in {what}; its launcher's log says why "
                f"({type(err).__name__}: {err})")
    return PeerRankError(
        f"rank {me} lost contact with its peers during {what}; no rank reported an error (see the "
        f"launcher's log for which rank stopped) ({type(err).__name__}: {err})")


def wait_for_peers(timeout_s: float) -> None:
    """Mark this rank finished and wait until every other rank is finished too, or gone, or
    ``timeout_s`` has passed (then say so on stderr). Called by a failed rank before it exits."""
    store = _store()
    if store is None:
        return
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(_key("finished", me), "1")
    except RuntimeError:  # the store went away with its host rank: nobody to wait for
        return
    others = [r for r in range(world) if r != me]
    pids = _local_pids(store, others)
    deadline = time.monotonic() + timeout_s
    while others:
        others = [r for r in others if _read(store, _key("finished", r)) is None
                  and not (r in pids and _gone(pids[r]))]
        if others and time.monotonic() >= deadline:
            print(f"laplace-debiased: rank {me} stops without waiting longer for rank(s) {others} "
                  f"({timeout_s:.0f} s)", file=sys.stderr, flush=True)
            return
        time.sleep(0.1)

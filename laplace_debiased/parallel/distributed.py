"""Sharding a two-batch fit across the ranks of an initialised ``torch.distributed`` group.

Every rank selects the same B and B̃ (same loader, same order or seeded ``generator``); rank
``r`` of ``W`` then takes rows ``torch.tensor_split(rows, W)[r]`` of *every* batch, so the work
is balanced for any number of batches. K-FAC sums of the shards are added with one
``all_reduce`` ([`all_reduce_sum_`][laplace_debiased.parallel.distributed.all_reduce_sum_]), rank 0
eigendecomposes and [`broadcast_`][laplace_debiased.parallel.distributed.broadcast_] sends the eigenbasis to
the others, so every rank ends with an identical posterior.

Before sharding, [`check_same_fit_inputs`][laplace_debiased.parallel.distributed.check_same_fit_inputs]
refuses ranks whose models or selected batches differ (digests, all-gathered); a fit runs inside
[`fail_together`][laplace_debiased.parallel.distributed.fail_together], so a rank that fails takes the others
out of their collectives at once, and every collective here turns a lost peer into a
[`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError] naming it
([`laplace_debiased.parallel.rank_failures`][laplace_debiased.parallel.rank_failures]).

Without an initialised process group (or with one rank) every function is the identity; so is
every function inside [`local_fits`][laplace_debiased.parallel.distributed.local_fits], which lets one rank
fit alone while a group is initialised (the prior-precision sweep shards its jobs over the ranks that way).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch
import torch.distributed as dist

from laplace_debiased.data.shards import HeldRows, check_indices, own_copy
from laplace_debiased.data.batch import Batch, batch_size
from laplace_debiased.parallel.rank_failures import PeerRankError, announce, peer_failure, report_failure

__all__ = [
    "rank_world",
    "is_distributed",
    "local_fits",
    "gather_results",
    "PeerRankError",
    "RankMismatchError",
    "check_same_fit_inputs",
    "fail_together",
    "shard_batch",
    "all_reduce_sum_",
    "broadcast_",
    "local_shards",
    "broadcast_computed",
    "run_with_reduced_operator",
    "fetch_rows",
]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)
_local: ContextVar[bool] = ContextVar("laplace_debiased_local_fits", default=False)


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` if none, or inside
    [`local_fits`][laplace_debiased.parallel.distributed.local_fits]."""
    if not _local.get() and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def local_fits() -> Iterator[None]:
    """Fit in this process alone while a process group is initialised.

    Inside the block [`rank_world`][laplace_debiased.parallel.distributed.rank_world] is ``(0, 1)``: no
    debiased structure shards its batches or communicates. Use it where the ranks do
    different work (one fit each); a collective fit instead needs every rank to call ``fit``.
    """
    token = _local.set(True)
    try:
        yield
    finally:
        _local.reset(token)


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    return rank_world()[1] > 1


#: the store of the group this rank last announced itself in (not the group: a reference to it
#: would keep its connections open after
#: [`fail_together`][laplace_debiased.parallel.distributed.fail_together] destroys it)
_announced: list = [None]


def _comm(collective: Callable[..., object], /, *args: object, **kwargs: object) -> None:
    """Run ``collective(*args, **kwargs)``; a backend error (a peer gone, a closed connection, a timeout)
    becomes a [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError] naming the rank that
    failed ([`peer_failure`][laplace_debiased.parallel.rank_failures.peer_failure])."""
    store = dist.distributed_c10d._get_default_store()
    if _announced[0] is not store:
        announce()
        _announced[0] = store
    try:
        collective(*args, **kwargs)
    except RuntimeError as err:  # DistBackendError and gloo's errors are RuntimeErrors
        raise peer_failure(err, collective.__name__) from err


#: attribute set on an exception raised on every rank at the same collective step
_EVERY_RANK = "laplace_debiased_on_every_rank"


def _on_every_rank(err: E) -> E:
    """Mark ``err`` as raised by every rank at the same collective step (each rank raising its
    own error or a [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError]):
    [`fail_together`][laplace_debiased.parallel.distributed.fail_together] then keeps the group."""
    setattr(err, _EVERY_RANK, True)
    return err


@contextmanager
def fail_together(what: str) -> Iterator[None]:
    """Run a collective section (every rank runs it) so that a failure on one rank ends it on
    every rank at once, instead of leaving the others blocked in their next collective.

    On an exception that the other ranks do not raise at the same step (those that the helpers
    here raise everywhere, [`RankMismatchError`][laplace_debiased.parallel.distributed.RankMismatchError]
    included, keep the group usable) this rank records its error in the group's store
    ([`report_failure`][laplace_debiased.parallel.rank_failures.report_failure]; not for a
    [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError], which is a consequence) and
    destroys its process group, which closes its connections: a peer in a collective with it gets an error at
    once and raises a [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError] naming this
    rank and its error. The group is unusable afterwards on every rank (destroy it and initialise a new one to
    go on). Without a group: nothing.
    """
    if not is_distributed():
        yield
        return
    try:
        yield
    except Exception as err:
        if getattr(err, _EVERY_RANK, False):  # the others raise at the same step: keep the group
            raise
        if not isinstance(err, PeerRankError):
            report_failure(err, what)
        dist.destroy_process_group()
        raise


class RankMismatchError(ValueError):
    """The ranks of a distributed fit hold different models or selected different batches
    ([`check_same_fit_inputs`][laplace_debiased.parallel.distributed.check_same_fit_inputs]); raised on every
    rank."""


def _leaves(obj: object) -> Iterator[torch.Tensor]:
    """The tensors of a batch (nested tuples, lists and mappings; mappings in key order)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from _leaves(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _leaves(item)


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (first 16 hex digits) of the tensors' dtypes, shapes and bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


_FIX = {
    "the model (parameters and buffers)": (
        "every rank must fit the same network: call torch.manual_seed(seed) with the same seed on "
        "every rank before building the model, or load the same weights on every rank (e.g. "
        "rank 0's state_dict, sent with torch.distributed.broadcast_object_list)"),
    "the direction batches B": (
        "every rank must select the same B and B̃ (the fit shards their rows itself): give every "
        "rank the same loader over the same data in the same order, i.e. no shuffling, or "
        "shuffle with the same seed (DataLoader(..., generator=torch.Generator().manual_seed(s))), "
        "or pass fit(..., generator=torch.Generator().manual_seed(s)) with the same s; not a "
        "DistributedSampler, which hands each rank different rows"),
}
_FIX["the magnitude batches B̃"] = _FIX["the direction batches B"]


def check_same_fit_inputs(model: torch.nn.Module, direction: Sequence[Batch],
                          magnitude: Sequence[Batch]) -> None:
    """Refuse, on every rank, a distributed fit whose ranks disagree on the model or on B, B̃.

    Collective. Each rank hashes (SHA-256 of the bytes) its model's ``state_dict`` and its
    selected batches B and B̃ (every tensor of every batch, before the rows are sharded); one
    ``all_gather_object`` of the three digests lets every rank compare them with rank 0's and
    raise the same [`RankMismatchError`][laplace_debiased.parallel.distributed.RankMismatchError], which says
    what differs and how to fix it.
    Bitwise: ranks must hold identical weights and batches. Without a group: nothing.
    """
    if not is_distributed():
        return
    digests = gather_results(lambda: (_digest(_leaves(model.state_dict())), _digest(_leaves(direction)),
                                      _digest(_leaves(magnitude))))
    differing: dict[str, list[str]] = {}  # how to fix it -> what differs
    for i, (what, fix) in enumerate(_FIX.items()):
        ranks = [r for r, d in enumerate(digests) if d[i] != digests[0][i]]
        if ranks:
            differing.setdefault(fix, []).append(f"{what} on rank(s) {ranks}")
    problems = [f"{' and '.join(whats)} differ from rank 0's; {fix}" for fix, whats in differing.items()]
    if problems:
        raise _on_every_rank(RankMismatchError(
            "the ranks of this distributed fit disagree: " + ". ".join(problems) + "."))


def gather_results(fn: Callable[[], T]) -> list[T]:
    """Call ``fn()`` on this rank and all-gather the results: ``[result of rank 0, ...]``.

    Collective (every rank must call it, in the same order); results must pickle. If ``fn``
    raises on any rank, every rank raises (the failing rank its own exception, the others a
    [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError], a ``RuntimeError``, naming it),
    so no rank waits forever in a later collective. Without a
    group: ``[fn()]``.
    """
    if not is_distributed():
        return [fn()]
    try:
        result, error = fn(), None
    except Exception as err:  # re-raised below, after every rank knows
        result, error = None, err
    parts: list = [None] * dist.get_world_size()
    _comm(dist.all_gather_object, parts, (result, None if error is None else repr(error)))
    if error is not None:
        raise _on_every_rank(error)
    failed = [(r, e) for r, (_, e) in enumerate(parts) if e is not None]
    if failed:
        rank, message = failed[0]
        raise _on_every_rank(PeerRankError(f"rank {rank} failed: {message}"))
    return [r for r, _ in parts]


def fetch_rows(held: HeldRows, wanted: Iterable[int]) -> HeldRows:
    """``held`` plus the rows ``wanted`` that it lacks, sent by the ranks whose own rows hold them.

    Collective (every rank calls it, each with its own ``wanted``, possibly empty): one
    ``all_gather_object`` of the requests, then one ``scatter_object_list`` per rank, which sends
    every other rank exactly the requested rows of its own shard
    ([`HeldRows`][laplace_debiased.data.shards.HeldRows]); each row is sent by its one owner, as the item its
    data set serves (tensors copied: a row, not the storage it views), so a fetched row is bitwise the row.
    A request outside ``[0, len(held))`` or a row no rank owns raises on every rank. Without a
    group: ``held`` (which must then hold every wanted row).
    """
    if not is_distributed():
        check_indices(wanted, len(held))
        return held
    rank, world = rank_world()
    requests = gather_results(lambda: [i for i in check_indices(wanted, len(held)) if i not in held.own])
    unowned = gather_results(lambda: [i for req in requests for i in req if i in held.own])
    if sum(map(len, unowned)) != sum(map(len, requests)):
        raise _on_every_rank(ValueError(
            f"{sum(map(len, requests)) - sum(map(len, unowned))} requested row(s) are held by no rank's own "
            "shard; every rank must load its shard_range of the same data set"))
    got: dict[int, object] = {}
    for src in range(world):
        part: list = [None]
        sending = [[(i, own_copy(held[i])) for i in req if i in held.own] for req in requests] if rank == src else None
        _comm(dist.scatter_object_list, part, sending, src=src)
        got.update(part[0])
    return held.with_rows(got)


def shard_batch(batch: Batch, n: int, rank: int, world: int) -> Batch:
    """This rank's rows of a batch of ``n`` samples (``tensor_split`` into ``world`` parts).

    ``(X, y)`` pairs are split row-wise; dict batches have every tensor with leading
    dimension ``n`` split. May return zero rows when ``n < world``.
    """
    if world == 1:
        return batch
    bounds = torch.tensor_split(torch.arange(n), world)[rank]
    start, stop = (int(bounds[0]), int(bounds[-1]) + 1) if len(bounds) else (0, 0)

    def cut(t: object) -> object:
        if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] == n:
            return t[start:stop]
        return t

    if isinstance(batch, MutableMapping):
        return type(batch)({k: cut(v) for k, v in batch.items()})
    return type(batch)(cut(t) for t in batch)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat_(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def all_reduce_sum_(tensors: Sequence[torch.Tensor]) -> int:
    """Sum ``tensors`` over all ranks in place (one ``all_reduce`` on a flat buffer).

    Returns the number of bytes each rank sends into the reduction (0 without a group)."""
    if not is_distributed():
        return 0
    flat = _flat(tensors)
    _comm(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
    _unflat_(flat, tensors)
    return flat.numel() * flat.element_size()


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0) -> int:
    """Overwrite ``tensors`` on every rank with rank ``src``'s (one flat ``broadcast``).

    Returns the number of bytes broadcast (0 without a group)."""
    if not is_distributed():
        return 0
    flat = _flat(tensors)
    _comm(dist.broadcast, flat, src=src)
    _unflat_(flat, tensors)
    return flat.numel() * flat.element_size()


def local_shards(batches: Sequence[Batch], dict_key_x: str, dict_key_y: str, *, rank: int,
                 world: int) -> list[Batch]:
    """Rank ``rank``'s rows of every batch
    ([`shard_batch`][laplace_debiased.parallel.distributed.shard_batch]) among ``world`` ranks, empty shards
    left out, so a sum over the shards of all ranks is the sum over ``batches``. One rank: ``batches``."""
    if world == 1:
        return list(batches)
    shards = []
    for b in batches:
        n = batch_size(b, dict_key_x, dict_key_y)
        bounds = torch.tensor_split(torch.arange(n), world)[rank]
        if len(bounds):
            shards.append(shard_batch(b, n, rank, world))
    return shards


def broadcast_computed(
    compute: Callable[[], Sequence[torch.Tensor]], device: torch.device | str, src: int = 0
) -> list[torch.Tensor]:
    """Call ``compute()`` on rank ``src`` only and send its tensors (one dtype) to every rank.

    Collective. The shapes travel first (``broadcast_object_list``), then the values in one
    [`broadcast_`][laplace_debiased.parallel.distributed.broadcast_]; the other ranks receive into tensors on
    ``device``. If ``compute`` raises on ``src``, ``src`` re-raises it and the other ranks raise
    [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError]. Without a group:
    ``list(compute())``.
    """
    if not is_distributed():
        return list(compute())
    rank, _ = rank_world()
    tensors: list[torch.Tensor] = []
    meta: list = [None]
    error: Exception | None = None
    if rank == src:
        try:
            tensors = [t.contiguous() for t in compute()]
            meta = [([tuple(t.shape) for t in tensors], tensors[0].dtype if tensors else None, None)]
        except Exception as err:  # re-raised below, after every rank knows
            error = err
            meta = [(None, None, repr(err))]
    _comm(dist.broadcast_object_list, meta, src=src)
    shapes, dtype, message = meta[0]
    if error is not None:
        raise _on_every_rank(error)
    if message is not None:
        raise _on_every_rank(PeerRankError(f"rank {src} failed: {message}"))
    if rank != src:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
    if tensors:
        broadcast_(tensors, src=src)
    return tensors


class _ReducedOperator:
    """``v ↦ Σ_ranks local_product(v)``, driven by rank ``src`` and served by the others
    ([`run_with_reduced_operator`][laplace_debiased.parallel.distributed.run_with_reduced_operator])."""

    def __init__(self, local_product: Callable[[torch.Tensor], torch.Tensor], dim: int, dtype: torch.dtype,
                 device: torch.device | str, src: int) -> None:
        self.local_product, self.dim, self.dtype, self.device, self.src = local_product, dim, dtype, device, src
        self.own_error: list[Exception] = []

    def reduced(self, v: torch.Tensor) -> torch.Tensor:
        """This rank's product plus every other rank's (one ``all_reduce``, with a failure flag)."""
        try:
            out = self.local_product(v).reshape(-1).to(self.dtype)
            failed = 0.0
        except Exception as err:  # reported to every rank through the sum below
            self.own_error.append(err)
            out, failed = torch.zeros(self.dim, dtype=self.dtype, device=self.device), 1.0
        flat = torch.cat([out, out.new_full((1,), failed)])
        _comm(dist.all_reduce, flat, op=dist.ReduceOp.SUM)
        if flat[-1] > 0:
            raise self.own_error[0] if self.own_error else PeerRankError("a rank failed computing a product")
        return flat[:-1]

    def signal(self, go: bool) -> None:
        """Tell the serving ranks that another product follows (``True``) or that ``run`` ended."""
        _comm(dist.broadcast, torch.full((1,), float(go), dtype=self.dtype, device=self.device), src=self.src)

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        """The operator ``run`` sees on rank ``src``."""
        self.signal(True)
        v = v.reshape(-1).to(device=self.device, dtype=self.dtype).contiguous()
        _comm(dist.broadcast, v, src=self.src)
        return self.reduced(v)

    def serve(self) -> None:
        """On the other ranks: apply the local product to every ``v`` of ``src`` until it ends."""
        while True:
            go = torch.empty(1, dtype=self.dtype, device=self.device)
            _comm(dist.broadcast, go, src=self.src)
            if go.item() == 0:
                break
            v = torch.empty(self.dim, dtype=self.dtype, device=self.device)
            _comm(dist.broadcast, v, src=self.src)
            try:
                self.reduced(v)
            except Exception:  # src stops the iteration and reports the failure
                pass


def run_with_reduced_operator(
    local_product: Callable[[torch.Tensor], torch.Tensor],
    run: Callable[[Callable[[torch.Tensor], torch.Tensor]], Sequence[torch.Tensor]],
    dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    src: int = 0,
) -> list[torch.Tensor]:
    """``run(operator)`` on rank ``src`` with ``operator(v) = Σ_ranks local_product(v)``, its
    tensors sent to every rank
    ([`broadcast_computed`][laplace_debiased.parallel.distributed.broadcast_computed]). Collective.

    Rank ``src`` alone drives ``run`` (e.g. an iterative eigensolver, which then takes one path
    whatever the round-off elsewhere); for every product it broadcasts ``v`` (``(dim,)``,
    ``dtype``), each rank applies its ``local_product`` and one ``all_reduce`` adds them. The
    other ranks serve products until ``src`` signals the end. A failing ``local_product`` on any
    rank makes every rank raise (its own exception, or
    [`PeerRankError`][laplace_debiased.parallel.rank_failures.PeerRankError]). Without a group:
    ``list(run(local_product))``.
    """
    if not is_distributed():
        return list(run(local_product))
    operator = _ReducedOperator(local_product, dim, dtype, device, src)
    result: list[torch.Tensor] = []
    error: Exception | None = None
    if rank_world()[0] == src:
        try:
            result = list(run(operator))
        except Exception as err:  # re-raised on every rank below
            error = err
        operator.signal(False)
    else:
        operator.serve()

    def finish() -> list[torch.Tensor]:
        if error is not None:
            raise error
        return result

    try:
        return broadcast_computed(finish, device, src)
    except PeerRankError:
        if operator.own_error:
            raise _on_every_rank(operator.own_error[0]) from None
        raise

"""The reducer: the cross-rank operations of a fit, as one object that the computations take.

A two-batch fit needs four collectives: a sum of per-rank partial sums (K-FAC factor sums, the
summed loss), a broadcast of what rank 0 computed (eigenbases), a call whose results every rank
gathers (the digests that check the ranks fit the same inputs), and a computation run on rank
0 whose tensors every rank receives. :class:`Reducer` does them in one process, where each is
the identity; :class:`ProcessGroupReducer` does them over the default ``torch.distributed``
group (:mod:`laplace_debiased.parallel.distributed`). A fit takes the reducer of
:func:`current_reducer`; :func:`use_reducer` installs another one (tests inject failures that
way, with a reducer whose collectives fail on a chosen rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

from laplace_debiased.parallel.distributed import (
    all_reduce_sum_,
    broadcast_,
    broadcast_computed,
    gather_results,
    is_distributed,
    rank_world,
)

__all__ = ["ProcessGroupReducer", "Reducer", "current_reducer", "use_reducer"]

T = TypeVar("T")


class Reducer:
    """The collectives of a fit in one process (a world of one rank): every one is the identity."""

    @property
    def rank(self) -> int:
        """This process's rank (0 here)."""
        return 0

    @property
    def world(self) -> int:
        """The number of ranks (1 here)."""
        return 1

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor by its sum over the ranks, in place (here: unchanged)."""

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite each tensor with rank ``src``'s, in place (here: unchanged)."""

    def gather(self, fn: Callable[[], T]) -> list[T]:
        """``[fn() of rank 0, fn() of rank 1, ...]``; every rank gets the whole list.

        Raises:
            Exception: whatever ``fn`` raised, on every rank.
        """
        return [fn()]

    def computed_on_rank0(self, compute: Callable[[], Sequence[torch.Tensor]],
                          device: torch.device | str) -> list[torch.Tensor]:
        """``compute()`` on rank 0, its tensors (of one dtype) sent to every rank onto ``device``."""
        return list(compute())


class ProcessGroupReducer(Reducer):
    """The collectives over the default ``torch.distributed`` group (identities outside one, or
    inside :func:`~laplace_debiased.parallel.distributed.local_fits`). A rank that fails in one
    makes every rank raise (:mod:`laplace_debiased.parallel.rank_failures`)."""

    @property
    def rank(self) -> int:
        return rank_world()[0]

    @property
    def world(self) -> int:
        return rank_world()[1]

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        all_reduce_sum_(tensors)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        broadcast_(tensors, src=src)

    def gather(self, fn: Callable[[], T]) -> list[T]:
        return gather_results(fn)

    def computed_on_rank0(self, compute: Callable[[], Sequence[torch.Tensor]],
                          device: torch.device | str) -> list[torch.Tensor]:
        return broadcast_computed(compute, device)


_installed: list[Reducer] = []


def current_reducer() -> Reducer:
    """The reducer a fit uses now: the innermost one of :func:`use_reducer`, else a
    :class:`ProcessGroupReducer` under an initialised group of several ranks, else a
    :class:`Reducer`."""
    if _installed:
        return _installed[-1]
    return ProcessGroupReducer() if is_distributed() else Reducer()


@contextmanager
def use_reducer(reducer: Reducer) -> Iterator[Reducer]:
    """Make ``reducer`` the one :func:`current_reducer` returns inside the block."""
    _installed.append(reducer)
    try:
        yield reducer
    finally:
        _installed.remove(reducer)

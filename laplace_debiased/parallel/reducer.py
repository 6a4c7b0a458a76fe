"""The reducer: the cross-rank operations of a fit, as one object that the computations take.

A two-batch K-FAC fit needs two collectives: a sum of per-rank partial sums (K-FAC factor sums,
the summed loss) and a broadcast of what rank 0 computed (the eigenbases). :class:`Reducer` does
them in one process, where each is the identity; :class:`ProcessGroupReducer` does them over the
default ``torch.distributed`` group (:mod:`laplace_debiased.parallel.distributed`). A fit takes the reducer of
:func:`current_reducer`; :func:`use_reducer` installs another one (tests inject failures that
way, with a reducer whose collectives fail on a chosen rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from laplace_debiased.parallel.distributed import (
    all_reduce_sum_,
    broadcast_,
    is_distributed,
    rank_world,
)

__all__ = ["ProcessGroupReducer", "Reducer", "current_reducer", "use_reducer"]

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

"""The reducer: the cross-rank operations of a fit, as one object that the computations take.

A two-batch fit needs four collectives: a sum of per-rank partial sums (K-FAC factor sums, dense
curvatures, the summed loss), a broadcast of what rank 0 computed into tensors of known shapes
(the K-FAC eigenbases), a computation on rank 0 whose tensors, of shapes only rank 0 knows, every
rank receives (the eigenpairs of a dense curvature), and an iterative solver on rank 0 whose
every product is summed over the ranks (Lanczos on the summed curvature).
[`Reducer`][laplace_debiased.parallel.reducer.Reducer] does them in one process, where each is the identity;
[`ProcessGroupReducer`][laplace_debiased.parallel.reducer.ProcessGroupReducer] does them over the default
``torch.distributed`` group
([`laplace_debiased.parallel.distributed`][laplace_debiased.parallel.distributed]). A fit takes the reducer of
[`current_reducer`][laplace_debiased.parallel.reducer.current_reducer];
[`use_reducer`][laplace_debiased.parallel.reducer.use_reducer] installs another one (tests inject failures
that way, with a reducer whose collectives fail on a chosen rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from laplace_debiased.parallel.distributed import (
    all_reduce_sum_,
    broadcast_,
    broadcast_computed,
    is_distributed,
    rank_world,
    run_with_reduced_operator,
)

__all__ = ["ProcessGroupReducer", "Reducer", "current_reducer", "use_reducer"]

class Reducer:
    """The collectives of a fit in one process (a world of one rank): every one is the identity.

    A reducer over several ranks overrides every method and property here."""

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

    def computed_on_rank0(self, compute: Callable[[], Sequence[torch.Tensor]],
                          device: torch.device | str) -> list[torch.Tensor]:
        """``compute()`` on rank 0, its tensors (of one dtype, any shapes) sent to every rank.

        Args:
            compute: called on rank 0 only; returns the tensors.
            device: where the other ranks receive them.

        Returns:
            Rank 0's tensors, on every rank (here: ``list(compute())``).

        Raises:
            Exception: what ``compute`` raised, on every rank.
        """
        return list(compute())

    def run_with_summed_operator(
        self,
        local_product: Callable[[torch.Tensor], torch.Tensor],
        run: Callable[[Callable[[torch.Tensor], torch.Tensor]], Sequence[torch.Tensor]],
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> list[torch.Tensor]:
        """``run(operator)`` on rank 0 with ``operator(v) = Σ_ranks local_product(v)``.

        Args:
            local_product: this rank's share ``v ↦ A_r v`` of the operator, ``(dim,)`` to
                ``(dim,)``.
            run: the solver, driven by rank 0 alone (e.g. Lanczos); returns tensors of one dtype.
            dim: the length of ``v``.
            dtype: the dtype of ``v`` and of the products.
            device: where ``v`` and the products live.

        Returns:
            ``run``'s tensors, on every rank (here: ``list(run(local_product))``).

        Raises:
            Exception: what ``run`` or any rank's ``local_product`` raised, on every rank.
        """
        return list(run(local_product))


class ProcessGroupReducer(Reducer):
    """The collectives over the default ``torch.distributed`` group (identities outside one, or
    inside [`local_fits`][laplace_debiased.parallel.distributed.local_fits]). A rank that fails in one
    makes every rank raise
    ([`laplace_debiased.parallel.rank_failures`][laplace_debiased.parallel.rank_failures])."""

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

    def computed_on_rank0(self, compute: Callable[[], Sequence[torch.Tensor]],
                          device: torch.device | str) -> list[torch.Tensor]:
        return broadcast_computed(compute, device)

    def run_with_summed_operator(
        self,
        local_product: Callable[[torch.Tensor], torch.Tensor],
        run: Callable[[Callable[[torch.Tensor], torch.Tensor]], Sequence[torch.Tensor]],
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> list[torch.Tensor]:
        return run_with_reduced_operator(local_product, run, dim, dtype, device)


_installed: list[Reducer] = []


def current_reducer() -> Reducer:
    """The reducer a fit uses now: the innermost one of
    [`use_reducer`][laplace_debiased.parallel.reducer.use_reducer], else a
    [`ProcessGroupReducer`][laplace_debiased.parallel.reducer.ProcessGroupReducer] under an initialised group
    of several ranks, else a [`Reducer`][laplace_debiased.parallel.reducer.Reducer]."""
    if _installed:
        return _installed[-1]
    return ProcessGroupReducer() if is_distributed() else Reducer()


@contextmanager
def use_reducer(reducer: Reducer) -> Iterator[Reducer]:
    """Make ``reducer`` the one [`current_reducer`][laplace_debiased.parallel.reducer.current_reducer] returns
    inside the block."""
    _installed.append(reducer)
    try:
        yield reducer
    finally:
        _installed.remove(reducer)

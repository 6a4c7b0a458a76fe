"""Two ranks played in one process: fake reducers for tests of the computers.

A computation over two ranks runs first as rank 1 (:class:`Rank1`, which records the tensors it
adds to the sums and the products it serves), then as rank 0 (:class:`Rank0`, which adds them to
its own). Rank 1's computations on rank 0's behalf (``computed_on_rank0``, a solver) run on its
own inputs and are dropped, as a real rank 1 would receive rank 0's; so a computation whose
rank 1 share depends on what rank 0 computed is out of reach here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from laplace_debiased.parallel.reducer import Reducer

T = TypeVar("T")


class Rank1(Reducer):
    """Rank 1 of two: records what it adds to each sum and the products it serves."""

    rank, world = 1, 2

    def __init__(self) -> None:
        self.shares: list[list[torch.Tensor]] = []
        self.products: list[Callable[[torch.Tensor], torch.Tensor]] = []

    def sum_(self, tensors):
        self.shares.append([t.clone() for t in tensors])

    def run_with_summed_operator(self, local_product, run, dim, dtype, device):
        self.products.append(local_product)
        return list(run(local_product))


class Rank0(Reducer):
    """Rank 0 of two: adds rank 1's recorded shares to its sums and products."""

    rank, world = 0, 2

    def __init__(self, rank1: Rank1) -> None:
        self.shares, self.products = iter(rank1.shares), iter(rank1.products)

    def sum_(self, tensors):
        for t, share in zip(tensors, next(self.shares), strict=True):
            t.add_(share)

    def run_with_summed_operator(self, local_product, run, dim, dtype, device):
        other = next(self.products)
        return list(run(lambda v: local_product(v) + other(v)))


def over_two_ranks(compute: Callable[[int, Reducer], T]) -> T:
    """``compute(rank, reducer)`` as rank 0 of two, rank 1 run first and recorded."""
    rank1 = Rank1()
    compute(1, rank1)
    return compute(0, Rank0(rank1))

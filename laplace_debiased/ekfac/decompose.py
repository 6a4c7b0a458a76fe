"""The two-batch EKFAC decomposition, as plain functions of the K-FAC factors, this rank's rows of
the measured batch set, and a reducer.

Per Linear/Conv2d block the eigenbasis ``Q = Q_G ⊗ Q_A`` is that of B's K-FAC factors and the
eigenvalues ``Λ = diag(Qᵀ C_B̃ Q)`` are B̃'s exact GGN / empirical-Fisher curvature along it
([`measure_ekfac_eigenvalues`][laplace_debiased.ekfac.passes.measure_ekfac_eigenvalues]), scaled to ``N``
data
points: ``N/|B̃|`` times the sum over B̃ (times the loss factor). The other blocks (embeddings,
normalisation layers' dense blocks) get the debiased K-FAC blocks of B's and B̃'s factors
([`debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron]; a dense block's ``diag(Uᵀ G_B̃ U)`` is
its exact EKFAC eigenvalue).

Over several ranks rank 0 decomposes B's factors (already summed over the ranks) and every rank
receives the basis, every rank measures the eigenvalue sums on its rows and the sums are added
through the reducer; rank 0 then sends the basis the measurement used, so every rank holds the
same decomposition.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from laplace_debiased.ekfac.passes import extended_shape, kron_eigenbasis, measure_ekfac_eigenvalues
from laplace_debiased.curvature.linalg import debiased_kron
from laplace_debiased.parallel.reducer import Reducer

__all__ = [
    "EKFACDecomposition",
    "EKFACMeasurement",
    "decompose_ekfac",
    "kron_basis_on_rank0",
    "measured_kfac_blocks",
    "weight_blocks",
]

#: blocks of 1 or 2 square factors (laplace-torch's ``Kron.kfacs`` layout)
Kfacs = list[list[Tensor]]
#: per block and factor, the rows ``X`` of B's factor ``F = XᵀX`` where known, else ``None``
Rows = list[list[Tensor | None]]
#: per block and factor, the rank-one terms summed into B's factor
Terms = list[list[int]]


@dataclass(frozen=True)
class EKFACMeasurement:
    """What B̃'s exact curvature along a K-FAC eigenbasis is measured with.

    Attributes:
        model: the network.
        loss_func: its loss with ``reduction="sum"``.
        params: the Linear/Conv2d parameters, one per K-FAC block, in block order.
        batches: this rank's ``(X, y)`` rows of the measured batch set (``X`` a tensor or a
            mapping the model consumes); empty when this rank has none.
        fisher_type: a ``curvlinops.FisherType`` (exact GGN, MC Fisher or empirical Fisher).
        batch_size_fn: curvlinops' ``batch_size_fn`` for mapping inputs, ``None`` for tensors.
        scale: the factor of the summed curvature: ``N / |B̃| ·`` the loss factor.
        dtype: the model's dtype (of a rank without rows' zero eigenvalues).
    """

    model: nn.Module
    loss_func: nn.Module
    params: list[Tensor]
    batches: list[tuple[Any, Tensor]]
    fisher_type: str
    batch_size_fn: Callable[[MutableMapping], int] | None
    scale: float
    dtype: torch.dtype


@dataclass(frozen=True)
class EKFACDecomposition:
    """Per parameter block, ``Q diag(vec Λ) Qᵀ``.

    Attributes:
        eigenvectors: per block ``[Q_G (d_out, d_out), Q_A (d_in, d_in)]`` or ``[Q (d, d)]``; a
            factor with fewer rows than its width ``(d, r)``, its complement implicit
            ([`laplace_debiased.ekfac.passes`][laplace_debiased.ekfac.passes]).
        eigenvalues: per block ``Λ`` ``(d_out, d_in)`` or ``(d,)``, scaled to ``N``; with an
            implicit complement one more row / column, its values
            ([`extended_shape`][laplace_debiased.ekfac.passes.extended_shape]).
    """

    eigenvectors: Kfacs
    eigenvalues: list[Tensor]


def kron_basis_on_rank0(
    kfacs: Kfacs, reducer: Reducer, rows: Rows | None = None, terms: Terms | None = None
) -> Kfacs:
    """The eigenvectors of every factor
    ([`kron_eigenbasis`][laplace_debiased.ekfac.passes.kron_eigenbasis]), computed on rank 0 and sent to
    every rank.

    Args:
        kfacs: per block 1 or 2 square factors ``(d, d)``, of one dtype.
        reducer: the ranks' collectives.
        rows: ``None``, or per block and factor B's rows where known (rank 0's): a factor with
            fewer rows than its width is decomposed through them.
        terms: ``None``, or per block and factor the rank-one terms summed into B's factor: a
            factor with fewer than its width keeps its complement implicit (without rows, from
            its ``eigh``).

    Returns:
        Per block and factor the ``(d, d)`` (through the rows ``(d, r)``) orthonormal eigenvectors,
        in the factors' dtype.
    """
    flat = iter(reducer.computed_on_rank0(
        lambda: [Q for Qs in kron_eigenbasis(kfacs, rows, terms) for Q in Qs], kfacs[0][0].device
    ))
    return [[next(flat) for _ in block] for block in kfacs]


def weight_blocks(model: nn.Module, params: Sequence[Tensor]) -> dict[int, int]:
    """``{bias block: its layer's weight block}`` for the layers with both parameters among
    ``params`` (one block each): EKFAC measures such a bias in the weight's ``Q_G``
    ([`measure_ekfac_eigenvalues`][laplace_debiased.ekfac.passes.measure_ekfac_eigenvalues]), so its own
    factor need not be decomposed."""
    index = {id(p): k for k, p in enumerate(params)}
    found = {}
    for module in model.modules():
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if isinstance(weight, Tensor) and isinstance(bias, Tensor) and id(weight) in index and id(bias) in index:
            found[index[id(bias)]] = index[id(weight)]
    return found


def measured_kfac_blocks(
    kfacs: Kfacs, measurement: EKFACMeasurement, reducer: Reducer, rows: Rows | None = None,
    terms: Terms | None = None,
) -> tuple[Kfacs, list[Tensor]]:
    """EKFAC basis and eigenvalues of the Linear/Conv2d blocks with B's factors ``kfacs``.

    Args:
        kfacs: B's factors of these blocks (summed over the ranks).
        measurement: the measured batch set B̃ and how to measure it.
        reducer: the ranks' collectives: rank 0's basis, the eigenvalue sums added.
        rows: ``None``, or per block and factor B's rows where known
            ([`kron_basis_on_rank0`][laplace_debiased.ekfac.decompose.kron_basis_on_rank0]).
        terms: ``None``, or per block and factor the rank-one terms of B's factor (same).

    Returns:
        ``(eigenvectors, eigenvalues)``: per block ``[Q_G, Q_A]`` or ``[Q_G]`` (a bias block with
        its layer's weight ``Q_G``, its own factor not decomposed:
        [`weight_blocks`][laplace_debiased.ekfac.decompose.weight_blocks]) and ``Λ`` ``(d_out, d_in)`` or ``(d_out,)`` times
        ``measurement.scale``, in the model's dtype.
    """
    shared = weight_blocks(measurement.model, measurement.params)
    own = [k for k in range(len(kfacs)) if k not in shared]
    pick = lambda items: None if items is None else [items[k] for k in own]  # noqa: E731
    computed = dict(zip(own, kron_basis_on_rank0(pick(kfacs), reducer, pick(rows), pick(terms))))
    basis = [computed[k] if k in computed else [computed[shared[k]][0]] for k in range(len(kfacs))]
    if measurement.batches:
        basis, lams = measure_ekfac_eigenvalues(
            measurement.model, measurement.loss_func, measurement.params, measurement.batches, basis,
            fisher_type=measurement.fisher_type, batch_size_fn=measurement.batch_size_fn,
        )
    else:  # fewer rows than ranks: this rank adds nothing
        basis = [[Q.to(measurement.dtype) for Q in Qs] for Qs in basis]
        lams = [Qs[0].new_zeros(extended_shape(Qs)) for Qs in basis]
    reducer.broadcast_([Q for Qs in basis for Q in Qs])  # rank 0 always has rows
    reducer.sum_(lams)
    return basis, [measurement.scale * lam for lam in lams]


def decompose_ekfac(
    direction: Kfacs, magnitude: Kfacs, extra: Sequence[bool], measurement: EKFACMeasurement, reducer: Reducer,
    rows: Rows | None = None, terms: Terms | None = None,
) -> EKFACDecomposition:
    """The EKFAC decomposition with B's eigenbasis and B̃'s curvature (module docstring).

    Args:
        direction: B's factors of every block (laplace-torch's ``Kron.kfacs`` layout).
        magnitude: B̃'s factors, same layout.
        extra: per block, whether it is an embedding or normalisation block (debiased K-FAC)
            rather than a Linear/Conv2d block (measured).
        measurement: B̃'s rows and how to measure the Linear/Conv2d blocks.
        reducer: the ranks' collectives.
        rows: ``None``, or per block and factor the rows of B's factor where known (``direction``'s
            layout): a Linear/Conv2d factor with fewer rows than its width is decomposed through
            them, its complement implicit.
        terms: ``None``, or per block and factor the rank-one terms summed into B's factor: a
            Linear/Conv2d factor with fewer than its width keeps its complement implicit.

    Returns:
        The [`EKFACDecomposition`][laplace_debiased.ekfac.decompose.EKFACDecomposition], blocks in
        ``direction``'s order.
    """
    pick = lambda blocks, want: [b for b, e in zip(blocks, extra) if e == want]  # noqa: E731
    basis, lams = iter([]), iter([])
    if not all(extra):
        measured_rows, measured_terms = (None if t is None else pick(t, False) for t in (rows, terms))
        basis, lams = map(iter, measured_kfac_blocks(
            pick(direction, False), measurement, reducer, measured_rows, measured_terms
        ))
    ext_basis, ext_lams = map(iter, debiased_kron(pick(direction, True), pick(magnitude, True)))
    out_basis, out_lams = [], []
    for e in extra:
        out_basis.append(next(ext_basis) if e else next(basis))
        lam = next(ext_lams) if e else next(lams)
        out_lams.append(torch.outer(*lam) if e and len(lam) == 2 else (lam[0] if e else lam))
    return EKFACDecomposition(out_basis, out_lams)

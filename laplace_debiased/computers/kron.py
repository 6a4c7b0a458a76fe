"""The two-batch K-FAC decomposition (Tatzel et al., ICLR 2025, Sec. 4.2.2 / App. A.3.3), as
plain functions of the factors.

Per parameter block, the K-FAC factors ``[G, A]`` of the direction batch B give the
eigenvectors and the factors ``[D, C]`` of the independent magnitude batch B̃ give the
eigenvalues ``diag(U_Gᵀ D U_G)``, ``diag(U_Aᵀ C U_A)``
(:func:`laplace_debiased.curvature.linalg.debiased_kron`); by the mixed-product rule these are
exactly ``uᵀ(D ⊗ C)u`` for the eigenvectors ``u = u_G ⊗ u_A`` of ``G ⊗ A``. Directions that B
does not distinguish (its null space, where a factor is wider than B) get their magnitude by
the ``null_space`` rule (:mod:`laplace_debiased.curvature.completion`).

Scale convention (that of a laplace-torch ``KronLaplace`` fit over all ``N`` data): the factors
of a batch set of ``m`` samples are ``G = N/m · Σ g gᵀ`` (output side, summed loss; bias blocks
likewise) and ``A = mean a aᵀ`` (input side), so ``G ⊗ A`` estimates the K-FAC of the summed
loss over ``N`` points.

Factors are laplace-torch's ``Kron.kfacs`` layout: a list with one entry per parameter block,
each a list of one (bias, dense block) or two (output side, input side) square tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laplace_debiased.computers.coverage import Coverage, coverage_record
from laplace_debiased.computers.kron_estimators import CORRECTED, Correction, corrected_decomposition, on_rank0
from laplace_debiased.curvature.completion import debiased_factor_mode
from laplace_debiased.curvature.linalg import debiased_kron
from laplace_debiased.parallel.reducer import Reducer

__all__ = ["KronDecomposition", "combine_kfacs", "decompose_two_batch", "paired_rows"]

#: blocks of 1 or 2 square factors (``Kron.kfacs`` layout)
Kfacs = list[list[torch.Tensor]]
#: per block and factor, the rows ``X`` with ``F = XᵀX`` where known, else ``None``
Rows = list[list[torch.Tensor | None]]


@dataclass(frozen=True)
class KronDecomposition:
    """The decomposed two-batch K-FAC curvature.

    Attributes:
        eigenvectors: per block and factor, ``(d, d)``, or ``(d, r)`` for a factor whose null
            space stays implicit (then it has ``r + 1`` eigenvalues, the last on the complement).
        eigenvalues: per block and factor, the measured eigenvalues (B̃'s Rayleigh quotients, or
            the corrected ones).
        swapped: the role-swapped decomposition (B̃'s eigenvectors, B's Rayleigh quotients) of a
            cross-fitted estimate, else ``None``.
        coverage: what the first decomposition covers (:class:`~laplace_debiased.computers.coverage.Coverage`).
        correction: what the corrected estimate changed, on rank 0 of a corrected fit, else ``None``.
    """

    eigenvectors: Kfacs
    eigenvalues: Kfacs
    swapped: tuple[Kfacs, Kfacs] | None
    coverage: Coverage
    correction: Correction | None


def combine_kfacs(old: Kfacs, new: Kfacs, n_old: int, n_new: int) -> Kfacs:
    """K-FAC of ``n_old + n_new`` points from two fits (online): output-side factors (and
    single-factor blocks) add up, input-side factors are averaged with weights
    ``n / (n_old + n_new)``."""
    w_old, w_new = n_old / (n_old + n_new), n_new / (n_old + n_new)
    return [[F_old[0] + F_new[0], w_old * F_old[1] + w_new * F_new[1]] if len(F_old) == 2
            else [F_old[0] + F_new[0]] for F_old, F_new in zip(old, new)]


def paired_rows(direction_rows: Rows | None, magnitude_rows: Rows | None
                ) -> list[list[tuple[torch.Tensor, torch.Tensor] | None]] | None:
    """Per block and factor ``(B's rows, B̃'s rows)`` where both are known (the ``rows`` of
    :func:`~laplace_debiased.curvature.linalg.debiased_kron` and
    :func:`~laplace_debiased.computers.coverage.coverage_record`), ``None`` without rows."""
    if direction_rows is None or magnitude_rows is None:
        return None
    return [[None if d is None or m is None else (d, m) for d, m in zip(bd, bm)]
            for bd, bm in zip(direction_rows, magnitude_rows)]


def _debiased(direction: Kfacs, magnitude: Kfacs, rows: Rows | None, magnitude_rows: Rows | None,
              null_space: str, terms: int, reducer: Reducer) -> tuple[Kfacs, Kfacs]:
    """Eigenvectors of ``direction``, Rayleigh quotients of ``magnitude``, computed on rank 0.

    B's degenerate groups follow ``null_space``, except when B̃ is B (the same list), where
    the plain eigendecomposition (``"aligned"``) keeps B's own eigenvalues: the isotropic mean
    over B's tied runs would move them by up to the round-off tolerance. ``terms`` (the samples
    summed into the factors) sets that tolerance."""
    rule = "aligned" if magnitude is direction else null_space
    return on_rank0(lambda: debiased_kron(
        direction, magnitude, paired_rows(rows, magnitude_rows),
        factor=lambda D, M: debiased_factor_mode(D, M, rule, terms), null_space=rule,
    ), direction, reducer)


def decompose_two_batch(
    direction: Kfacs,
    magnitude: Kfacs,
    *,
    rows: tuple[Rows | None, Rows | None] = (None, None),
    null_space: str,
    estimator: str,
    cross_fit: bool,
    sizes: tuple[int, int],
    n_data: int,
    names: Sequence[tuple[str, str]],
    reducer: Reducer,
) -> KronDecomposition:
    """The two-batch decomposition of B's and B̃'s K-FAC factors.

    Args:
        direction: B's factors (``Kron.kfacs`` layout, scaled to ``n_data`` points).
        magnitude: B̃'s factors; the same list object for the reduction B̃ = B (stock K-FAC).
        rows: B's and B̃'s factor rows per block and factor (``None`` where unknown); a factor
            wider than its rows is decomposed through them, with an implicit null space.
        null_space: ``"isotropic"`` or ``"aligned"``, the treatment of B's null space.
        estimator: ``"paper"`` (B's eigenvectors, B̃'s Rayleigh quotients), ``"corrected"``,
            ``"shrunk"`` or ``"stein"`` (:mod:`laplace_debiased.curvature.corrected`; B̃ = B falls back to the
            paper's, which is then stock K-FAC).
        cross_fit: also the role-swapped decomposition (``"paper"`` only).
        sizes: samples summed into B's and B̃'s factors.
        n_data: the training data B and B̃ were drawn from (finite-population scaling).
        names: ``(layer, parameter)`` per block, for the records.
        reducer: the ranks' collectives: rank 0 decomposes, every rank receives the result.

    Returns:
        The :class:`KronDecomposition`.
    """
    same = magnitude is direction
    correction = None
    swapped = None
    if estimator in CORRECTED and not same:
        vecs, vals, correction = corrected_decomposition(
            direction, magnitude, sizes, list(names), n_data, reducer, paired_rows(rows[0], rows[-1]),
            rule=estimator)
    else:
        terms = max(sizes)
        vecs, vals = _debiased(direction, magnitude, rows[0], rows[-1], null_space, terms, reducer)
        if cross_fit and not same:
            swapped = _debiased(magnitude, direction, rows[-1], rows[0], null_space, terms, reducer)
    coverage = coverage_record(
        direction, magnitude, vecs, vals, list(names), rows=paired_rows(rows[0], rows[-1]),
        null_space=null_space, direction_size=sizes[0], magnitude_size=sizes[1],
    )
    return KronDecomposition(vecs, vals, swapped, coverage, correction)

"""The two-batch K-FAC decomposition (Tatzel et al., ICLR 2025, Sec. 4.2.2 / App. A.3.3), as
plain functions of the factors.

Per parameter block, the K-FAC factors ``[G, A]`` of the direction batch B give the
eigenvectors and the factors ``[D, C]`` of the independent magnitude batch B̃ give the
eigenvalues ``diag(U_Gᵀ D U_G)``, ``diag(U_Aᵀ C U_A)``
([`laplace_debiased.curvature.linalg.debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron]); by the
mixed-product rule these are exactly ``uᵀ(D ⊗ C)u`` for the eigenvectors ``u = u_G ⊗ u_A`` of ``G ⊗ A``.
Directions that B does not distinguish (its null space, where a factor is wider than B) get their magnitude by
the ``null_space`` rule ([`laplace_debiased.curvature.completion`][laplace_debiased.curvature.completion]).

Scale convention (that of a laplace-torch ``KronLaplace`` fit over all ``N`` data): the factors
of a batch set of ``m`` samples are ``G = N/m · Σ g gᵀ`` (output side, summed loss; bias blocks
likewise) and ``A = mean a aᵀ`` (input side), so ``G ⊗ A`` estimates the K-FAC of the summed
loss over ``N`` points.

Factors are laplace-torch's ``Kron.kfacs`` layout: a list with one entry per parameter block,
each a list of one (bias, dense block) or two (output side, input side) square factors: tensors, or
for a factor with fewer rows than its width its rows
([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]), which every decomposition and record here
reads without forming the ``d × d`` matrix (formed only on a dense route: a factor pair both held as rows
with as many rows together as its width, or without its rows). A factor held as rows beside the other batch's
dense factor (a batch narrower than the width beside one as wide) is never formed: B's eigenvectors come from its
Gram matrix, B̃'s Rayleigh quotients and the pooled factor of the corrected estimates from its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, replace

import torch

from laplace_debiased.two_batch.coverage import BlockCoverage, Coverage, coverage_record
from laplace_debiased.kron.corrected import Spectra
from laplace_debiased.kron.estimators import CORRECTED, Correction, corrected_decomposition, on_rank0
from laplace_debiased.curvature.completion import debiased_factor_mode
from laplace_debiased.curvature.linalg import FactorRows, RowFactor, debiased_kron
from laplace_debiased.parallel.reducer import Reducer

__all__ = ["KronDecomposition", "combine_kfacs", "decompose_two_batch", "paired_rows"]

#: blocks of 1 or 2 square factors (``Kron.kfacs`` layout), each a tensor or held as rows
#: ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor])
Kfacs = list[list[torch.Tensor | RowFactor]]
#: per block and factor, the rows ``X`` with ``F = XᵀX`` where known, else ``None``
Rows = list[list[torch.Tensor | None]]
#: per block and factor, the rank-one terms summed into the factor
Terms = list[list[int]]


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
        coverage: what the first decomposition covers
            ([`Coverage`][laplace_debiased.two_batch.coverage.Coverage]).
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
                ) -> list[list[FactorRows | None]] | None:
    """Per block and factor ``(B's rows, B̃'s rows)`` ([`FactorRows`][laplace_debiased.curvature.linalg.FactorRows],
    their Gram matrix formed once) where both are known (the ``rows`` of
    [`debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron] and
    [`coverage_record`][laplace_debiased.two_batch.coverage.coverage_record]), ``None`` without rows."""
    if direction_rows is None or magnitude_rows is None:
        return None
    return [[None if d is None or m is None else FactorRows(d, m) for d, m in zip(bd, bm)]
            for bd, bm in zip(direction_rows, magnitude_rows)]


def _debiased(direction: Kfacs, magnitude: Kfacs, pairs: list[list[FactorRows | None]] | None,
              null_space: str, terms: list[list[int]], reducer: Reducer) -> tuple[Kfacs, Kfacs]:
    """Eigenvectors of ``direction``, Rayleigh quotients of ``magnitude``, computed on rank 0.

    B's degenerate groups follow ``null_space``, except when B̃ is B (the same list), where
    the plain eigendecomposition (``"aligned"``) keeps B's own eigenvalues: the isotropic mean
    over B's tied runs would move them by up to the round-off tolerance. ``terms`` (per block and
    factor, the rank-one terms summed into ``magnitude``'s factor) sets that tolerance."""
    rule = "aligned" if magnitude is direction else null_space
    return on_rank0(lambda: debiased_kron(
        direction, magnitude, pairs,
        factor=lambda D, M, t: debiased_factor_mode(D, M, rule, t), null_space=rule, terms=terms,
    ), direction, reducer)


def proportional_blocks(direction: Kfacs, magnitude: Kfacs) -> dict[int, tuple[int, float]]:
    """Single-factor blocks (a layer's bias) whose factor is, in B and B̃ alike, ``s`` times the
    output-side factor of the block before it (the same layer's weight: ``c N/m Σ g gᵀ`` against
    ``√c N/m Σ g gᵀ`` for the loss factor ``c``), up to the round-off of that scaling: ``block ->
    (weight block, s)``. Their decomposition is the weight's, eigenvalues times ``s`` (every estimate
    is linear in the scale of both factors), so it is not computed twice."""
    found = {}
    for k in range(1, len(direction)):
        if len(direction[k]) != 1 or len(direction[k - 1]) != 2 or direction[k][0].shape != direction[k - 1][0].shape:
            continue
        s_d = _ratio(direction[k][0], direction[k - 1][0])
        s_m = _ratio(magnitude[k][0], magnitude[k - 1][0])
        if s_d is not None and s_m is not None and abs(s_d - s_m) <= 8 * torch.finfo(direction[k][0].dtype).eps * s_d:
            found[k] = (k - 1, s_d)
    return found


def _ratio(F: torch.Tensor | RowFactor, G: torch.Tensor | RowFactor) -> float | None:
    """``s`` with ``F = s G`` up to a few roundings of ``F``'s dtype, else ``None``; for factors held
    as rows ``F = XᵀX``, ``G = YᵀY``: ``X = √s Y`` up to as many roundings (then ``F = s G``)."""
    if isinstance(F, RowFactor) or isinstance(G, RowFactor):
        if not (isinstance(F, RowFactor) and isinstance(G, RowFactor)) or F.rows.shape != G.rows.shape:
            return None
        trace = G.trace()
        if trace <= 0:
            return None
        s = F.trace() / trace
        X, Y = F.rows.double(), G.rows.double()
        tol = 8 * torch.finfo(F.dtype).eps * float(torch.linalg.vector_norm(X))
        return s if float(torch.linalg.vector_norm(X - s**0.5 * Y)) <= tol else None
    trace = float(G.diagonal().sum())
    if trace <= 0:
        return None
    s = float(F.diagonal().sum()) / trace
    tol = 8 * torch.finfo(F.dtype).eps * float(torch.linalg.matrix_norm(F))
    return s if float(torch.linalg.matrix_norm(F - s * G)) <= tol else None


def _expand(values: list, copies: dict[int, tuple[int, float]], copy: Callable[[Any, float], Any]) -> list:
    """Per-block ``values`` of the blocks that are not ``copies``, with each copy inserted at its
    place as ``copy(value of its weight block, s)``."""
    kept = iter(values)
    out: list = []
    index: dict[int, int] = {}
    for k in range(len(values) + len(copies)):
        if k in copies:
            j, s = copies[k]
            out.append(copy(out[index[j]], s))
        else:
            index[k] = len(out)
            out.append(next(kept))
    return out


def _drop(values: Sequence | None, copies: dict[int, tuple[int, float]]) -> list | None:
    return None if values is None else [v for k, v in enumerate(values) if k not in copies]


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
    terms: tuple[Terms | None, Terms | None] = (None, None),
) -> KronDecomposition:
    """The two-batch decomposition of B's and B̃'s K-FAC factors.

    A bias block whose factor is a multiple of its weight's output-side factor takes the weight's
    decomposition, scaled ([`proportional_blocks`][laplace_debiased.kron.decompose.proportional_blocks]).

    Args:
        direction: B's factors (``Kron.kfacs`` layout, scaled to ``n_data`` points).
        magnitude: B̃'s factors; the same list object for the reduction B̃ = B (stock K-FAC).
        rows: B's and B̃'s factor rows per block and factor (``None`` where unknown); a factor
            wider than its rows is decomposed through them, with an implicit null space.
        null_space: ``"isotropic"`` or ``"aligned"``, the treatment of B's null space.
        estimator: ``"paper"`` (B's eigenvectors, B̃'s Rayleigh quotients), ``"corrected"``,
            ``"shrunk"`` or ``"stein"`` ([`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected]; B̃ =
            B falls back to the paper's, which is then stock K-FAC).
        cross_fit: also the role-swapped decomposition (``"paper"`` only).
        sizes: samples summed into B's and B̃'s factors.
        n_data: the training data B and B̃ were drawn from (finite-population scaling).
        names: ``(layer, parameter)`` per block, for the records.
        reducer: the ranks' collectives: rank 0 decomposes, every rank receives the result.
        terms: B's and B̃'s rank-one terms per block and factor (samples × positions × loss-Hessian
            columns; their round-off tolerance); ``None``: the samples ``max(sizes)``.

    Returns:
        The [`KronDecomposition`][laplace_debiased.kron.decompose.KronDecomposition].
    """
    copies = proportional_blocks(direction, magnitude)
    if copies:
        same = magnitude is direction
        reduced = _drop(direction, copies)
        result = decompose_two_batch(
            reduced, reduced if same else _drop(magnitude, copies), rows=(_drop(rows[0], copies), _drop(rows[-1], copies)),
            null_space=null_space, estimator=estimator, cross_fit=cross_fit, sizes=sizes, n_data=n_data,
            names=_drop(names, copies), reducer=reducer, terms=(_drop(terms[0], copies), _drop(terms[-1], copies)),
        )
        return _expanded(result, copies, list(names))
    return _decompose(direction, magnitude, rows=rows, null_space=null_space, estimator=estimator, cross_fit=cross_fit,
                      sizes=sizes, n_data=n_data, names=names, reducer=reducer, terms=terms)


def _expanded(result: KronDecomposition, copies: dict[int, tuple[int, float]], names: list[tuple[str, str]]
              ) -> KronDecomposition:
    """``result`` of the blocks without ``copies``, with each copy's decomposition, correction and
    coverage inserted (the weight's output-side factor; eigenvalues scaled)."""
    def vectors(vecs: Kfacs) -> Kfacs:
        return _expand(vecs, copies, lambda block, s: [block[0]])

    def values(vals: Kfacs) -> Kfacs:
        return _expand(vals, copies, lambda block, s: [s * block[0]])

    swapped = None if result.swapped is None else (vectors(result.swapped[0]), values(result.swapped[1]))
    correction = None
    if result.correction is not None:
        correction = Correction(names, _expand(result.correction.factors, copies, lambda fs, s: [fs[0]]))

    def block(b: BlockCoverage, s: float) -> BlockCoverage:
        f = replace(b.factors[0], factor="bias")
        return BlockCoverage("", "", (f,), f.dimension, 1.0 - (f.dimension - f.zero_eigenvalues) / f.dimension)

    blocks = _expand(list(result.coverage.blocks), copies, block)
    blocks = [replace(b, layer=layer, parameter=param) for b, (layer, param) in zip(blocks, names)]
    coverage = replace(result.coverage, blocks=tuple(blocks))
    return KronDecomposition(vectors(result.eigenvectors), values(result.eigenvalues), swapped, coverage, correction)


def _decompose(
    direction: Kfacs,
    magnitude: Kfacs,
    *,
    rows: tuple[Rows | None, Rows | None],
    null_space: str,
    estimator: str,
    cross_fit: bool,
    sizes: tuple[int, int],
    n_data: int,
    names: Sequence[tuple[str, str]],
    reducer: Reducer,
    terms: tuple[Terms | None, Terms | None],
) -> KronDecomposition:
    """[`decompose_two_batch`][laplace_debiased.kron.decompose.decompose_two_batch] of blocks that all need their own decomposition."""
    same = magnitude is direction
    correction = None
    swapped = None
    counts = [t if t is not None else [[max(sizes)] * len(F) for F in direction] for t in terms]
    pairs = paired_rows(rows[0], rows[-1])  # one Gram matrix per factor pair, shared below
    spectra: list[list[Spectra]] = [[{} for _ in F] for F in direction]  # dense spectra, for the coverage's ranks
    if estimator in CORRECTED and not same:
        vecs, vals, correction = corrected_decomposition(
            direction, magnitude, sizes, list(names), n_data, reducer, pairs, rule=estimator,
            terms=[[max(b, m) for b, m in zip(*pair)] for pair in zip(*counts)], spectra=spectra)
    else:
        vecs, vals = _debiased(direction, magnitude, pairs, null_space, counts[-1], reducer)
        if cross_fit and not same:
            swapped = _debiased(magnitude, direction, paired_rows(rows[-1], rows[0]), null_space, counts[0], reducer)
    coverage = coverage_record(
        direction, magnitude, vecs, vals, list(names), rows=pairs, spectra=spectra,
        null_space=null_space, direction_size=sizes[0], magnitude_size=sizes[1],
    )
    return KronDecomposition(vecs, vals, swapped, coverage, correction)

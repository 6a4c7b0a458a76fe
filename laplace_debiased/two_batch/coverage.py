"""What the curvature of a debiased K-FAC fit covers, per layer and factor.

A K-FAC factor of a batch has rank at most its number of rows (samples, times the spatial
positions of a convolution). When a factor is wider than that, e.g. the input factor ``A``
``(1024, 1024)`` of ``Linear(1024, 32)`` fitted on 256 images, B's eigenvectors span only part of
it, and a debiased eigenvalue can be exactly zero: then the posterior precision of the weights
along that Kronecker direction is the prior ``δ`` alone and their variance ``1/δ`` (``1e4`` at
``δ = 1e-4``), which turns sampled predictions into noise at small ``δ``.

[`coverage_record`][laplace_debiased.two_batch.coverage.coverage_record] counts, for every block of a fit:

* per factor: its dimension ``d``; the numerical ranks of B's factor, B̃'s factor and of their
  sum (the span of B ∪ B̃), each the number of eigenvalues above one tolerance, the
  [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] of the sum
  ([`factor_ranks`][laplace_debiased.two_batch.coverage.factor_ranks]: so the union's rank is at least each
  part's); the debiased eigenvalues that are exactly ``0``; the eigenvalues set by the isotropic completion of
  B's null space ([`laplace_debiased.curvature.completion`][laplace_debiased.curvature.completion]);
* per block: the share of its weights whose only curvature is the prior, i.e. of the Kronecker
  eigen-directions ``u_G ⊗ u_A`` whose eigenvalue ``λ_G · λ_A`` is zero:
  ``1 - (nonzero λ_G)(nonzero λ_A) / (d_G d_A)``.

The ranks of a factor whose rows are known (the Gram route of
[`debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron], fewer rows than its dimension ``d``)
come from the Gram matrices ([`row_rank`][laplace_debiased.curvature.linalg.row_rank] of B's rows, B̃'s
rows and both stacked, ``O(d (n + m)²)``), and its zero count from the extended spectrum of its
implicit null space ([`extended_spectrum`][laplace_debiased.curvature.completion.extended_spectrum]): the
record adds no ``d × d`` eigendecomposition to such a fit. A factor that a corrected estimate decomposed
densely is counted from the spectra that decomposition computed (B's, B̃'s, and the union's from the pooled
spectrum where it decides it; ``factor_ranks``'s ``spectra``). Other factors are counted by inertia
([`eigenvalues_above`][laplace_debiased.curvature.linalg.eigenvalues_above]), a quarter of an ``eigvalsh``'s
flops.

"Zero" is up to round-off: at most
[`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] of B̃'s factor (the tolerance
that sets B's degenerate groups).

Which zeros more data would cover. For samples in general position from a curvature whose
support (at that tolerance) has dimension ``s``, ``rank B = min(|B|, s)``, ``rank B̃ = min(|B̃|, s)``
and ``rank(B ∪ B̃) = min(|B| + |B̃|, s)``. So:

* ``rank(B ∪ B̃) < rank B + rank B̃`` (the batches' spans overlap): the union is *saturated*, it
  reaches the whole support, and a direction it does not reach is one no batch reaches (a dead
  ReLU unit, an input feature that is always 0, the softmax-invariant direction of a classifier's
  output factor). Such zeros are *structural*: the full-batch factor has them too.
* ``rank(B ∪ B̃) = rank B + rank B̃ > rank B`` and below ``d``: the rank is limited by the number of
  samples, and more samples (magnitude batches, a larger B) would reach further. Every zero of
  such a factor is *sample-limited*.

The record keeps the raw zero count
([`FactorCoverage.zero_eigenvalues`][laplace_debiased.two_batch.coverage.FactorCoverage.zero_eigenvalues]) and
splits it
([`FactorCoverage.structural_zeros`][laplace_debiased.two_batch.coverage.FactorCoverage.structural_zeros],
[`FactorCoverage.sample_limited_zeros`][laplace_debiased.two_batch.coverage.FactorCoverage.sample_limited_zeros]);
a block's
[`BlockCoverage.sample_limited_share`][laplace_debiased.two_batch.coverage.BlockCoverage.sample_limited_share]
is the part of its prior-only share that the structural zeros alone do not explain. The fit warns (once,
naming the layers) about blocks whose sample-limited share is at least
[`PRIOR_ONLY_WARN_SHARE`][laplace_debiased.two_batch.coverage.PRIOR_ONLY_WARN_SHARE], and advises what would
help (more samples, and the isotropic completion only when the fit does not use it already).

With ``null_space="aligned"`` the zero count of a factor is ``d - rank(B ∪ B̃)`` (B̃'s factor,
compressed on B's null space, has rank ``rank(B ∪ B̃) - rank(B)`` there); with the isotropic
completion it is ``0`` unless B̃'s mean curvature on B's null group is below the tolerance. That
group holds B's eigenvalues within the tolerance of zero
([`tied_groups`][laplace_debiased.curvature.linalg.tied_groups]). When a factor's norm is ruled by one
large eigenvalue (the mean of non-negative features), the tolerance is large, the group takes in
B's small nonzero eigenvalues, and the completion's value can fall below the tolerance: zeros of
a saturated factor, which the full-batch fit has as well (digits_cnn's ``Linear(256, 32)``,
docs/wide-layers.md).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from laplace_debiased.curvature.linalg import (
    FactorRows,
    RowFactor,
    dense_factor,
    eigenvalues_above,
    factor_rows,
    frobenius_tolerance,
    roundoff_tolerance,
    row_rank,
)
from laplace_debiased.curvature.completion import extended_spectrum

__all__ = ["FactorCoverage", "BlockCoverage", "Coverage", "coverage_record", "factor_ranks", "numerical_rank",
           "PRIOR_ONLY_WARN_SHARE", "report_coverage"]

logger = logging.getLogger("laplace_debiased")

#: a block whose prior-only share reaches this is named in the fit's warning
PRIOR_ONLY_WARN_SHARE = 0.01
_FACTOR_NAMES = {2: ("output", "input"), 1: ("bias",)}


def numerical_rank(F: torch.Tensor, tolerance: float | None = None) -> int:
    """Eigenvalues of the symmetric PSD ``F`` ``(d, d)`` (float64) above ``tolerance`` (default
    [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] ``(F)``), counted by inertia
    ([`eigenvalues_above`][laplace_debiased.curvature.linalg.eigenvalues_above]), not by an
    eigendecomposition."""
    return eigenvalues_above(F, roundoff_tolerance(F) if tolerance is None else tolerance)


def factor_ranks(Fd: torch.Tensor | RowFactor, Fm: torch.Tensor | RowFactor, rows: FactorRows | None = None,
                 spectra: dict | None = None) -> tuple[int, int, int]:
    """Numerical ranks of B's factor ``Fd``, B̃'s factor ``Fm`` and their union (``Fd + Fm``;
    ``Fd`` alone when ``Fm is Fd``, B̃ = B), each ``(d, d)`` PSD, from the rows where known.

    All three are counted at one tolerance, the union's
    [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]: by Weyl's inequality
    ``λ_i(Fd + Fm) ≥ λ_i(Fd)``, so ``rank(B ∪ B̃) ≥ max(rank B, rank B̃)``. (Each matrix at its own
    norm-relative tolerance breaks this: the sum's norm is larger, and a part's eigenvalues between
    its tolerance and the sum's count for the part but not for the union.) Where a factor is held as
    rows ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]) the union's norm comes from the
    rows' Gram matrix (``‖XᵀX‖_F = ‖XXᵀ‖_F``) and the union is formed densely only where neither the
    rows nor the spectra decide its rank; a part held as rows beside a dense one (``rows`` unknown) is counted
    from its rows and enters the union as ``XᵀX``, never formed alone.

    Args:
        Fd: B's factor ``(d, d)``.
        Fm: B̃'s factor ``(d, d)`` (the same object for B̃ = B).
        rows: ``(B's rows, B̃'s rows)`` with ``XᵀX`` the factor, or None: a part with fewer rows
            than ``d`` is counted from its Gram matrix
            ([`row_rank`][laplace_debiased.curvature.linalg.row_rank]).
        spectra: the spectra a decomposition of the pair computed (``0``: ``Fd``'s, ``1``: ``Fm``'s,
            ``(w_d, w_m)``: ``w_d Fd + w_m Fm``'s; float64): a part without rows is counted from its
            spectrum, the union from the pooled one where that decides it (``_union_rank``).

    Returns:
        ``(rank B, rank B̃, rank B ∪ B̃)``.
    """
    same = Fm is Fd
    spectra = spectra or {}
    held_as_rows = isinstance(Fd, RowFactor) or isinstance(Fm, RowFactor)
    if rows is None and held_as_rows and not same:  # a part narrower than the factor beside a wider one
        union = _union(Fd, Fm)
        tol = roundoff_tolerance(union)
        rank_d, rank_m = (_rank(F, F.rows if isinstance(F, RowFactor) else None, tol, None, spectra.get(i))
                          for i, F in enumerate((Fd, Fm)))
        return rank_d, rank_m, _union_rank(Fd, Fm, union, tol, spectra)
    if rows is None or not held_as_rows:
        dense_d = dense_factor(Fd)
        union = dense_d if same else dense_d + dense_factor(Fm)
        tol = roundoff_tolerance(union)
    else:
        rows = factor_rows(rows)
        union = None  # formed only where needed (_union_rank)
        K = rows.block(0, 0) if same else rows.gram
        tol = frobenius_tolerance(Fd.shape[0], Fd.dtype, float(torch.linalg.matrix_norm(K)))
    if rows is None:
        rank_d, rank_m = _rank(Fd, None, tol, None, spectra.get(0)), _rank(Fm, None, tol, None, spectra.get(1))
        return rank_d, rank_m, rank_d if same else _union_rank(Fd, Fm, union, tol, spectra)
    rows = factor_rows(rows)  # one Gram matrix for the three counts
    Xd, Xm = rows
    d = Fd.shape[0]
    rank_d = _rank(Fd, Xd, tol, rows.block(0, 0) if len(Xd) < d else None, spectra.get(0))
    rank_m = _rank(Fm, Xm, tol, rows.block(1, 1) if len(Xm) < d else None, spectra.get(1))
    if same:
        return rank_d, rank_m, rank_d
    if len(Xd) + len(Xm) >= d:
        return rank_d, rank_m, _union_rank(Fd, Fm, union, tol, spectra)
    return rank_d, rank_m, _rank(Fd, torch.cat([Xd, Xm]), tol, rows.gram)


def _union(Fd: torch.Tensor | RowFactor, Fm: torch.Tensor | RowFactor) -> torch.Tensor:
    """``Fd + Fm`` ``(d, d)``, a factor held as rows ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor])
    added as ``XᵀX`` to the other, not formed alone."""
    dense = [F for F in (Fd, Fm) if not isinstance(F, RowFactor)]
    union = dense[0].clone() if dense else torch.zeros(Fd.shape, dtype=Fd.dtype, device=Fd.device)
    for F in (Fd, Fm):
        if isinstance(F, RowFactor):
            union.addmm_(F.rows.T, F.rows)
    return union


def _union_rank(Fd: torch.Tensor | RowFactor, Fm: torch.Tensor | RowFactor, union: torch.Tensor | None,
                tolerance: float, spectra: dict) -> int:
    """The rank of ``union = F_B + F_B̃`` at ``tolerance``, from a pooled spectrum in ``spectra`` where it
    decides it, else by inertia ([`numerical_rank`][laplace_debiased.two_batch.coverage.numerical_rank];
    ``union`` formed from ``Fd`` and ``Fm`` there where not given).

    The pooled factor ``P = w_B F_B + w_B̃ F_B̃`` (``w`` positive) lies between ``min(w) U`` and ``max(w) U``
    in the Loewner order, so (Weyl) ``λ_i(P) / max(w) ≤ λ_i(U) ≤ λ_i(P) / min(w)``: where both bounds count
    the same eigenvalues above the tolerance, so does ``U`` (equal batches: always, ``P = U / 2``)."""
    for weights, L in spectra.items():
        if isinstance(weights, tuple):
            lower, upper = int((L > tolerance * max(weights)).sum()), int((L > tolerance * min(weights)).sum())
            if lower == upper:
                return lower
    return numerical_rank(dense_factor(Fd) + dense_factor(Fm) if union is None else union, tolerance)


@dataclass(frozen=True)
class FactorCoverage:
    """One factor of one block (see the module docstring)."""

    factor: str  # "output" (G), "input" (A) or "bias"
    dimension: int
    rank_direction: int
    rank_magnitude: int
    rank_union: int
    zero_eigenvalues: int
    completed: int  # eigenvalues set by the isotropic completion of B's null space

    @property
    def sample_limited(self) -> bool:
        """The rank B ∪ B̃ reach is limited by their samples, not by the curvature's support:
        ``rank B < rank(B ∪ B̃) = rank B + rank B̃ < d`` (module docstring). False for a saturated
        union (``rank(B ∪ B̃) < rank B + rank B̃``), for B̃ = B, and for a factor of full rank."""
        return self.rank_direction < self.rank_union == self.rank_direction + self.rank_magnitude < self.dimension

    @property
    def sample_limited_zeros(self) -> int:
        """The zero eigenvalues more samples would give curvature to: all of them if the factor is
        [`sample_limited`][laplace_debiased.two_batch.coverage.FactorCoverage.sample_limited], else none."""
        return self.zero_eigenvalues if self.sample_limited else 0

    @property
    def structural_zeros(self) -> int:
        """The zero eigenvalues of a saturated factor (``zero_eigenvalues - sample_limited_zeros``)."""
        return self.zero_eigenvalues - self.sample_limited_zeros

    def describe(self) -> str:
        """``"input factor: z of d eigenvalues zero = dimension d − rank r reached by B ∪ B̃"``
        (the equality holds for ``null_space="aligned"``; otherwise the two counts differ, and
        ``"...zero; dimension d − rank r reached by B ∪ B̃ = u unreached"`` gives both)."""
        zeros = f"{self.factor} factor: {self.zero_eigenvalues} of {self.dimension} eigenvalues zero"
        reach = f"dimension {self.dimension} − rank {self.rank_union} reached by B ∪ B̃"
        unreached = self.dimension - self.rank_union
        if self.zero_eigenvalues == unreached:
            return f"{zeros} = {reach}"
        return f"{zeros}; {reach} = {unreached} unreached"


@dataclass(frozen=True)
class BlockCoverage:
    """One parameter block: ``layer`` (module name), ``parameter`` ("weight"/"bias"), its
    factors, its number of weights and the share of them with prior-only curvature."""

    layer: str
    parameter: str
    factors: tuple[FactorCoverage, ...]
    n_weights: int
    prior_only_share: float

    @property
    def sample_limited_share(self) -> float:
        """The part of
        [`prior_only_share`][laplace_debiased.two_batch.coverage.BlockCoverage.prior_only_share] that the
        structural zeros alone do not explain: ``prior_only_share - (1 - Π (d - structural zeros) / Π d)``
        over the factors."""
        structural = 1.0 - math.prod(f.dimension - f.structural_zeros for f in self.factors) / self.n_weights
        return max(self.prior_only_share - structural, 0.0)


@dataclass(frozen=True)
class Coverage:
    """Coverage of every block of a fit (``la.coverage`` after a debiased K-FAC fit)."""

    blocks: tuple[BlockCoverage, ...]
    null_space: str
    direction_size: int
    magnitude_size: int

    def flagged(self, share: float = PRIOR_ONLY_WARN_SHARE) -> list[BlockCoverage]:
        """Blocks whose
        [`BlockCoverage.sample_limited_share`][laplace_debiased.two_batch.coverage.BlockCoverage.sample_limited_share]
        is at least ``share``."""
        return [b for b in self.blocks if b.sample_limited_share >= share]

    def rows(self) -> list[dict]:
        """One flat dict per factor (for tables, JSON)."""
        return [
            {"layer": b.layer, "parameter": b.parameter, "factor": f.factor, "dimension": f.dimension,
             "rank_B": f.rank_direction, "rank_B~": f.rank_magnitude, "rank_B∪B~": f.rank_union,
             "zero_eigenvalues": f.zero_eigenvalues, "structural_zeros": f.structural_zeros,
             "completed": f.completed, "prior_only_share": b.prior_only_share,
             "sample_limited_share": b.sample_limited_share}
            for b in self.blocks for f in b.factors
        ]

    def markdown(self) -> str:
        """A markdown table of [`rows`][laplace_debiased.two_batch.coverage.Coverage.rows]."""
        head = ("| layer | parameter | factor | dim. | rank B | rank B̃ | rank B ∪ B̃ | zero eigenvalues "
                "| isotropically completed | prior-only weights [%] | of which sample-limited [%] |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|")
        lines = [
            f"| {r['layer']} | {r['parameter']} | {r['factor']} | {r['dimension']} | {r['rank_B']} | {r['rank_B~']} "
            f"| {r['rank_B∪B~']} | {r['zero_eigenvalues']} | {r['completed']} | {100 * r['prior_only_share']:.1f} "
            f"| {100 * r['sample_limited_share']:.1f} |"
            for r in self.rows()
        ]
        return "\n".join([head, *lines])

    def advice(self) -> str:
        """The warning text for the flagged blocks ('' if none): per block its sample-limited
        share and factors
        ([`FactorCoverage.describe`][laplace_debiased.two_batch.coverage.FactorCoverage.describe]), and what
        would help. The isotropic completion is advised only when the fit does not use it."""
        bad = self.flagged()
        if not bad:
            return ""
        names = "; ".join(
            f"'{b.layer}' {b.parameter} ({100 * b.sample_limited_share:.0f} %: "
            + ", ".join(f.describe() for f in b.factors if f.sample_limited_zeros) + ")"
            for b in bad
        )
        helps = "more samples in B̃ (n_magnitude_batches) or in B, so that B ∪ B̃ reaches further"
        if self.null_space != "isotropic":
            helps = ("null_space='isotropic' (B̃'s mean curvature on the directions B does not see), or "
                     + helps)
        return (
            f"debiased K-FAC (B = {self.direction_size}, B̃ = {self.magnitude_size} samples, "
            f"null_space={self.null_space!r}): in layer(s) {names} that share of the weights has no "
            "curvature but the prior for lack of samples, so their posterior variance is 1/δ and "
            f"dominates the predictive at small prior precision δ. What helps: {helps} "
            "(see la.coverage and docs/wide-layers.md)."
        )


def _rank(F: torch.Tensor | RowFactor, X: torch.Tensor | None, tolerance: float, K: torch.Tensor | None = None,
          spectrum: torch.Tensor | None = None) -> int:
    """[`numerical_rank`][laplace_debiased.two_batch.coverage.numerical_rank] ``(F, tolerance)``; from the rows ``X`` (``XᵀX = F``, Gram matrix ``K``
    where formed) when they are fewer than ``F``'s dimension
    ([`row_rank`][laplace_debiased.curvature.linalg.row_rank]), else from ``F``'s eigenvalues where a
    decomposition computed them (``spectrum``, float64)."""
    if X is not None and len(X) < F.shape[0]:
        return row_rank(X, F.dtype, tolerance, K)
    if spectrum is not None:
        return int((spectrum > tolerance).sum())
    return numerical_rank(dense_factor(F), tolerance)


def _factor(
    name: str, Fd: torch.Tensor | RowFactor, Fm: torch.Tensor | RowFactor, Q: torch.Tensor, lam: torch.Tensor,
    rows: FactorRows | None, spectra: dict | None,
) -> FactorCoverage:
    """Ranks of B's, B̃'s and the summed factor (from ``rows`` or ``spectra`` where known), and the zero count
    of the debiased factor ``(Q, lam)`` (implicit null space counted ``d - r`` times; the tolerance of
    ``Fm`` from its rows' Gram matrix where it is held as rows)."""
    rank_d, rank_m, rank_u = factor_ranks(Fd, Fm, rows, spectra)
    if isinstance(Fm, RowFactor) and rows is not None:
        K = factor_rows(rows).block(1, 1)
        tol = frobenius_tolerance(Fm.shape[0], Fm.dtype, float(torch.linalg.matrix_norm(K)))
    else:
        tol = roundoff_tolerance(Fm)
    ext, multiplicity = extended_spectrum(Q, lam)
    return FactorCoverage(
        factor=name, dimension=Fd.shape[0], rank_direction=rank_d, rank_magnitude=rank_m, rank_union=rank_u,
        zero_eigenvalues=int(multiplicity[ext <= tol].sum()), completed=0,
    )


def coverage_record(
    direction_kfacs: Sequence[Sequence[torch.Tensor]],
    magnitude_kfacs: Sequence[Sequence[torch.Tensor]],
    eigenvectors: Sequence[Sequence[torch.Tensor]],
    eigenvalues: Sequence[Sequence[torch.Tensor]],
    names: Sequence[tuple[str, str]],
    *,
    rows: Sequence[Sequence[FactorRows | None]] | None = None,
    spectra: Sequence[Sequence[dict]] | None = None,
    null_space: str,
    direction_size: int,
    magnitude_size: int,
) -> Coverage:
    """The [`Coverage`][laplace_debiased.two_batch.coverage.Coverage] of a debiased K-FAC decomposition.

    Every argument but the keywords holds one entry per block (laplace-torch ``Kron.kfacs``
    layout: a weight block has 2 factors, a bias block 1).

    Args:
        direction_kfacs: B's K-FAC factors, square ``(d, d)`` matrices.
        magnitude_kfacs: B̃'s K-FAC factors, in the layout of ``direction_kfacs``.
        eigenvectors: The debiased decomposition's eigenvectors
            (``DebiasedKronDecomposed.eigenvectors``): ``Q (d, d)``, or ``Q (d, r)`` for an
            implicit factor.
        eigenvalues: The decomposition's eigenvalues (``DebiasedKronDecomposed.eigenvalues``):
            ``d`` of them, or ``r + 1`` for an implicit factor.
        names: ``(layer, parameter)`` per block.
        rows: Per block and factor ``(B's rows, B̃'s rows)`` or ``None`` (as for
            [`debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron]): a factor with rows takes
            its ranks from the Gram matrices, one without from the factors. ``None``: no factor
            has rows.
        spectra: Per block and factor the spectra its decomposition computed (as for
            [`factor_ranks`][laplace_debiased.two_batch.coverage.factor_ranks]), ``None``: none.
        null_space: The treatment of B's null space, ``"isotropic"`` or ``"aligned"``.
        direction_size: The number of samples in B.
        magnitude_size: The number of samples in B̃.

    Returns:
        The coverage per block and factor.
    """
    blocks = []
    rows = rows if rows is not None else [[None] * len(Fds) for Fds in direction_kfacs]
    spectra = spectra if spectra is not None else [[None] * len(Fds) for Fds in direction_kfacs]
    for Fds, Fms, Qs, lams, block_rows, block_spectra, (layer, param) in zip(
        direction_kfacs, magnitude_kfacs, eigenvectors, eigenvalues, rows, spectra, names, strict=True
    ):
        factors = []
        for name, Fd, Fm, Q, lam, r, s in zip(_FACTOR_NAMES[len(Fds)], Fds, Fms, Qs, lams, block_rows, block_spectra):
            factor = _factor(name, Fd, Fm, Q, lam, r, s)
            if null_space == "isotropic" and Fm is not Fd:  # B̃ = B: its null space stays 0
                factor = replace(factor, completed=factor.dimension - factor.rank_direction)
            factors.append(factor)
        n = math.prod(f.dimension for f in factors)
        covered = math.prod(f.dimension - f.zero_eigenvalues for f in factors)
        blocks.append(BlockCoverage(layer, param, tuple(factors), n, 1.0 - covered / n))
    return Coverage(tuple(blocks), null_space, direction_size, magnitude_size)


def report_coverage(coverage: Coverage) -> None:
    """Log the coverage (INFO, one line per block) and warn once per fit, naming the layers whose
    sample-limited prior-only share reaches
    [`PRIOR_ONLY_WARN_SHARE`][laplace_debiased.two_batch.coverage.PRIOR_ONLY_WARN_SHARE]
    ([`Coverage.advice`][laplace_debiased.two_batch.coverage.Coverage.advice])."""
    for b in coverage.blocks:
        dims = " x ".join(f"{f.factor} {f.dimension} (rank B {f.rank_direction}, B̃ {f.rank_magnitude}, "
                          f"B∪B̃ {f.rank_union}, zero {f.zero_eigenvalues}, completed {f.completed})" for f in b.factors)
        logger.info("coverage %s.%s: %s; prior-only weights %.1f %% (sample-limited %.1f %%)", b.layer,
                    b.parameter, dims, 100 * b.prior_only_share, 100 * b.sample_limited_share)
    text = coverage.advice()
    if text:
        warnings.warn(text, UserWarning, stacklevel=3)

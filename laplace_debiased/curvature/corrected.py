"""The ``"corrected"`` two-batch estimate of a curvature factor: the eigenbasis of both batches
pooled, and its eigenvalues corrected by the regression-to-the-mean gap that the two batches
measure against each other.

The theory, for one PSD factor ``F`` (a K-FAC factor or a dense block) estimated from ``m``
independent samples as ``F̂ = F + E`` (``E`` zero-mean, ``E[E_ij²] = s_ij / m``), with an
independent estimate ``F̃`` of the same ``F``. Second-order perturbation theory of the
eigenpairs ``(λ_i, u_i)`` of ``F`` (distinct eigenvalues) gives, for the eigenpairs
``(λ̂_i, û_i)`` of ``F̂``:

.. math::

    E[λ̂_i] = λ_i + β_i / m, \\qquad E[û_iᵀ F̃ û_i] = λ_i - β_i / m, \\qquad
    β_i = \\sum_{j ≠ i} s_{ij} / (λ_i - λ_j) + O(m^{-1}).

The same-batch eigenvalue over-states the top of the spectrum and under-states the bottom
(``β_i`` has the sign of the top/bottom position), and the cross-batch value of the paper
(Tatzel et al., ICLR 2025, Sec. 3.2.2: B chooses, B̃ measures) errs by the same amount the
other way: the gap ``g_i = λ̂_i - û_iᵀ F̃ û_i`` estimates ``2 β_i / m``.

A single batch of ``n = m_B + m_B̃`` samples (B ∪ B̃, the pooled factor ``F_P``) has better
directions than either half, but its eigenvalues carry the bias ``β_i / n``. Along its own
eigenvectors ``u_{P,i}`` the curvature of ``F`` (the target: ``U_P diag(u_{P,i}ᵀ F u_{P,i})
U_Pᵀ`` is the matrix closest to ``F`` in Frobenius norm among those diagonal in ``U_P``) is
``λ_{P,i} - 2 β_i / n``. Each order of the two batches estimates ``β_i`` (``m_B g_{B,i} / 2``
with B choosing, ``m_B̃ g_{B̃,i} / 2`` with B̃ choosing); their mean gives

.. math::

    \\hat λ_i = λ_{P,i} - (m_B g_{B,i} + m_{B̃} g_{B̃,i}) / (2 n),

clamped at 0 (a curvature). Batches drawn without replacement from ``N`` training data have
the finite-population variance ``s_ij (1/m - 1/N)`` (up to ``N/(N-1)``), so each order's gap
is scaled by ``(1/n - 1/N) / (1/m - 1/N)`` instead of ``m / n`` (the same for ``N → ∞``), and
a pooled batch of all ``N`` data is left uncorrected: it is the full batch. The bias left is of
third order, ``O(n^{-2})``; the noise added is
that of the gaps, which shrink like ``1/m`` with the bias they measure, so for large batches the
estimate tends to the single batch of ``n`` samples, and for small ones it removes the bias the
single batch has. Eigenvalues are matched by position in the sorted spectra; inside a tied run
of a half (its null space above all, where the eigenvectors are an arbitrary basis) the gaps are
averaged, so the result does not depend on the basis ``eigh`` returns there.

With B̃ = B every gap is zero in exact arithmetic and the estimate is the single batch's
eigendecomposition (to round-off; the Laplace class takes its exact stock path then).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from laplace_debiased.curvature.completion import group_means
from laplace_debiased.curvature.linalg import (
    remeasure_eigenvalues,
    roundoff_tolerance,
    symmetric_eigh64,
    tied_groups,
)

__all__ = ["FactorCorrection", "corrected_factor", "corrected_kron", "same_minus_cross"]


@dataclass(frozen=True)
class FactorCorrection:
    """What the correction did to one factor.

    Attributes:
        change: ``‖λ̂ - λ_P‖₂ / ‖λ_P‖₂``, the relative change of the pooled (single-batch)
            spectrum; 0 where nothing was corrected.
        change_b: the same change from one order alone (B choosing the directions), an
            estimate of ``change`` of its own.
        change_b_tilde: the same with B̃ choosing.
        stderr: ``|change_b - change_b_tilde| / 2``, the standard error of ``change`` from the
            two orders (one degree of freedom: a rough scale, not a confidence bound).
    """

    change: float
    change_b: float
    change_b_tilde: float
    stderr: float


def same_minus_cross(direction: torch.Tensor, magnitude: torch.Tensor, terms: int = 0) -> torch.Tensor:
    """Gaps ``g_i = λ_i(D) - u_iᵀ M u_i`` (float64, ascending order of ``D``'s eigenvalues).

    Args:
        direction: ``(d, d)`` PSD factor ``D`` of the batch that chooses the directions.
        magnitude: ``(d, d)`` PSD factor ``M`` of the independent batch that measures them, on
            the same scale as ``D``.
        terms: samples summed into ``M`` (its round-off tolerance,
            :func:`~laplace_debiased.curvature.linalg.roundoff_tolerance`).

    Returns:
        ``(d,)`` float64 gaps, averaged over each tied run of ``D``'s eigenvalues.
    """
    check_finite(direction, "the direction batch")
    L, U = symmetric_eigh64(direction)
    # diag(Uᵀ M U) in float64, at the round-off tolerance of M's own precision
    cross = remeasure_eigenvalues(U, magnitude, terms, dtype=torch.float64)
    return group_means(L - cross, tied_groups(L, roundoff_tolerance(direction)))


def check_finite(F: torch.Tensor, batch: str) -> None:
    if not torch.isfinite(F).all():
        raise ValueError(f"the curvature factor of {batch} contains NaN or Inf; check the inputs and the model output on that batch.")


def _change(values: torch.Tensor, pooled: torch.Tensor) -> float:
    scale = float(torch.linalg.vector_norm(pooled))
    return float(torch.linalg.vector_norm(values - pooled)) / scale if scale > 0 else 0.0


def _order_weight(m: int, n: int, n_data: int | None) -> float:
    """``(1/n - 1/N) / (1/m - 1/N)``: the bias of a batch of ``n`` over that of ``m`` drawn from
    ``N = n_data`` (``m / n`` for ``n_data=None``, an infinite population)."""
    if n_data is None:
        return m / n
    if n > n_data:
        raise ValueError(f"B ∪ B̃ has {n} samples but the data only {n_data}; pass the training-set size as n_data.")
    return (1 / n - 1 / n_data) / (1 / m - 1 / n_data)


def corrected_factor(
    direction: torch.Tensor, magnitude: torch.Tensor, m_direction: int, m_magnitude: int, terms: int = 0,
    n_data: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FactorCorrection]:
    """Pooled eigenvectors and corrected eigenvalues of one factor (module docstring).

    Args:
        direction: ``(d, d)`` PSD factor of B, scaled as an estimate of the full-data factor.
        magnitude: ``(d, d)`` PSD factor of B̃, same layer, position and scale.
        m_direction: samples in B (the pooled factor is the samples-weighted mean of the two,
            exactly the factor a single batch B ∪ B̃ gives).
        m_magnitude: samples in B̃.
        terms: samples summed into either factor (round-off tolerance of the quotients).
        n_data: the number ``N`` of training data the batches were drawn from without
            replacement (finite-population scaling); ``None``: an infinite population.

    Returns:
        ``(U, lam, record)``: ``U (d, d)`` orthonormal eigenvectors of the pooled factor
        (ascending), ``lam (d,)`` the corrected eigenvalues, both in ``direction.dtype``, and
        the :class:`FactorCorrection`.
    """
    if direction.shape != magnitude.shape:
        raise ValueError(
            f"direction factor {tuple(direction.shape)} and magnitude factor "
            f"{tuple(magnitude.shape)} differ in shape."
        )
    if m_direction < 1 or m_magnitude < 1:
        raise ValueError(f"both batches need samples, got {m_direction} and {m_magnitude}.")
    check_finite(direction, "B")
    check_finite(magnitude, "B̃")
    n = m_direction + m_magnitude
    pooled = (m_direction * direction.double() + m_magnitude * magnitude.double()) / n
    L, U = symmetric_eigh64(pooled)
    shift_b = _order_weight(m_direction, n, n_data) * same_minus_cross(direction, magnitude, terms) / 2
    shift_t = _order_weight(m_magnitude, n, n_data) * same_minus_cross(magnitude, direction, terms) / 2
    lam = (L - shift_b - shift_t).clamp(min=0.0)
    L0 = L.clamp(min=0.0)
    one_b, one_t = (L - 2 * shift_b).clamp(min=0.0), (L - 2 * shift_t).clamp(min=0.0)
    record = FactorCorrection(
        change=_change(lam, L0), change_b=_change(one_b, L0), change_b_tilde=_change(one_t, L0),
        stderr=abs(_change(one_b, L0) - _change(one_t, L0)) / 2,
    )
    return U.to(direction.dtype), lam.to(direction.dtype), record


def corrected_kron(
    direction_kfacs: Sequence[Sequence[torch.Tensor]],
    magnitude_kfacs: Sequence[Sequence[torch.Tensor]],
    m_direction: int,
    m_magnitude: int,
    terms: int = 0,
    n_data: int | None = None,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[FactorCorrection]]]:
    """:func:`corrected_factor` for every factor of a layer-wise K-FAC approximation.

    A block's Kronecker eigenvalues are the products of its factors' corrected eigenvalues
    (each factor is corrected on its own).

    Args:
        direction_kfacs: B's factors, one entry per parameter block in laplace-torch
            ``Kron.kfacs`` order, each a list of one or two dense square factors.
        magnitude_kfacs: B̃'s factors, the same blocks.
        m_direction: samples in B.
        m_magnitude: samples in B̃.
        terms: samples summed into the factors (round-off tolerance).
        n_data: the training-set size the batches were drawn from (:func:`corrected_factor`).

    Returns:
        ``(eigenvectors, eigenvalues, records)``, lists of lists per block and factor, the
        first two ready for ``laplace.utils.matrix.KronDecomposed``.
    """
    if len(direction_kfacs) != len(magnitude_kfacs):
        raise ValueError(
            f"B has {len(direction_kfacs)} K-FAC blocks but B̃ has {len(magnitude_kfacs)}; "
            "both must come from the same parameters."
        )
    vectors, values, records = [], [], []
    for F_dir, F_mag in zip(direction_kfacs, magnitude_kfacs):
        block = [corrected_factor(D, M, m_direction, m_magnitude, terms, n_data) for D, M in zip(F_dir, F_mag)]
        vectors.append([b[0] for b in block])
        values.append([b[1] for b in block])
        records.append([b[2] for b in block])
    return vectors, values, records

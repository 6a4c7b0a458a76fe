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

clamped at 0 (a curvature). Batches drawn without replacement from ``N`` training data (the
target is then the full-batch factor ``F_N``) have the finite-population variance
``s_ij (1/m - 1/N)`` (up to ``N/(N-1)``), so an ``m``-batch's eigenvalue is biased against
``u_iᵀ F_N u_i`` by ``2 β_i (1/m - 1/N)`` and the pooled one by ``2 β_i (1/n - 1/N)``. B̃, disjoint
from B, is drawn from the ``N - m_B`` data outside it: ``E[F_B̃ | B] = (N F_N - m_B F_B) / (N - m_B)``,
so the gap of the order B chooses measures ``N / (N - m_B)`` times B's bias. Each order's gap is
therefore scaled by

.. math::

    \\frac{N - m}{N} \\cdot \\frac{1/n - 1/N}{1/m - 1/N} = \\frac{m}{n} \\Bigl(1 - \\frac{n}{N}\\Bigr)

(``m`` the size of the batch that chooses; ``m / n`` for ``N → ∞``), and a pooled batch of all
``N`` data is left uncorrected: it is the full batch. The bias left is of third order,
``O(n^{-2})``; the noise added is that of the gaps, which shrink like ``1/m`` with the bias they
measure, so for large batches the estimate tends to the single batch of ``n`` samples, and for
small ones it removes the bias the single batch has. Eigenvalues are matched by position in the
sorted spectra; inside a tied run of a half (its null space above all, where the eigenvectors are
an arbitrary basis) the gaps are averaged, so the result does not depend on the basis ``eigh``
returns there.

With B̃ = B every gap is zero in exact arithmetic and the estimate is the single batch's
eigendecomposition (to round-off; the Laplace class takes its exact stock path then).

**The two orders in the pooled basis.** Write ``Δ = U_Pᵀ (F_B - F_B̃) U_P`` for the two batches'
difference in the pooled eigenbasis (``F_P = diag(λ_P)``), ``a = m_B̃ / n``, ``b = m_B / n``, so that
``F_B = F_P + aΔ`` and ``F_B̃ = F_P - bΔ``. Second-order perturbation theory gives each order's gap as

.. math::

    g_{B,i} = Δ_{ii} + 2a\\,h_i, \\qquad g_{B̃,i} = -Δ_{ii} + 2b\\,h_i, \\qquad
    h_i = \\sum_{j ≠ i} Δ_{ij}^2 / (λ_{P,i} - λ_{P,j}),

so the correction ``x_i = k_B g_{B,i} + k_B̃ g_{B̃,i}`` with the order weights above,
``k = (m/n)(1 - n/N)/2``, is ``x_i = (1 - n/N)(b - a) Δ_ii / 2 + 2c h_i`` with ``c = ab (1 - n/N)``:
a second-order part that estimates the bias, and for unequal batches a first-order part of mean
zero. The only weights with the same bias under which the first-order part cancels are the balanced
``k_B = k_B̃ = c``; they are not used: where a bulk of nearly equal eigenvalues splits at first order
(``h_i`` then grows like ``√m``, not ``m``), both weightings under-correct and the size-proportional
ones less (the known-truth study, ``benchmarks/results/estimator_candidates.md``, ``balanced``
against ``stein``); the first-order part is instead counted in the noise below.

**The ``"stein"`` weight** (minimum mean squared error). Write ``r_i = λ_{P,i} - u_{P,i}ᵀ F u_{P,i}``
for the pooled eigenvalue's error against its target. The estimate ``λ_{P,i} - w x_i`` has the
error ``r_i - w x_i``; the weight minimising ``E Σ_i a_i (r_i - w x_i)²`` is
``w* = E Σ a_i r_i x_i / E Σ a_i x_i²``. For Gaussian (or, through the central limit theorem, many)
samples ``r_i``'s first-order noise ``(E_P)_ii`` and ``Δ`` are uncorrelated (``E_P`` the
samples-weighted mean of the two batches' errors, ``Δ`` their difference), so ``E[r_i x_i] ≈
b_i E[x_i]`` with ``b_i = E r_i = E x_i``, and ``w* = Σ a_i b_i² / (Σ a_i b_i² + Σ a_i V_i)``,
``V_i = Var x_i``. Its plug-in ``w = max(0, 1 - Σ a_i V̂_i / Σ a_i x_i²)`` (``E x_i² = b_i² + V_i``)
is a positive-part James–Stein weight, one per factor. ``V_i`` is measured from the two batches:
the entries of ``Δ`` are sums over the samples of both batches, near-Gaussian (central limit),
independent across ``j`` in the eigenbasis, with ``Var Δ_ij² = 2 (E Δ_ij²)²`` estimated by
``(2/3) Δ_ij⁴`` (``E Δ⁴ = 3 (E Δ²)²``), so

.. math::

    \\hat V_i = 4c^2 \\cdot \\tfrac23 \\sum_{j ≠ i} \\frac{Δ_{ij}^4}{(λ_{P,i} - λ_{P,j})^2 + 4ab\\,Δ_{ij}^2}
    + \\Bigl(\\frac{(1 - n/N)(b - a)}{2}\\Bigr)^2 Δ_{ii}^2 .

The ``4ab Δ_ij²`` next to the squared separation is the two-level resummation: a pair of levels
``s`` apart coupled by ``t`` (``4t² = 4ab Δ_ij²`` over the two orders) moves by
``(√(s² + 4t²) - s)/2``, whose derivative in ``t²`` is ``1/√(s² + 4t²)``, where the perturbation
series has ``1/s``. The errors are relative, ``a_i = 1 / λ_{P,i}²`` (the KL divergence of the
Gaussians as the prior precision goes to 0 weighs each eigenvalue's error so); with ``a_i = 1`` the
largest eigenvalues' noise decides and the weight discards the small ones' bias (``stein-abs`` in
the study). Costs: ``Δ`` in the pooled basis (two products of ``d × d`` matrices, or ``r × r`` from
the rows), no eigendecomposition beyond the corrected estimate's.

On the pooled null space the single batch has no curvature, and the two orders fill it with their
null runs' mean gap, the curvature the other batch finds outside one batch's range. That curvature
cannot grow with the batch, so the ``"stein"`` rule takes the smaller of the two orders' (equal
batches: the two agree up to noise) at the weight ``(1 - n/N)/4`` per order: where the larger batch
already spans the factor's range (a rank-deficient factor), the pooled null space is the true one
and stays empty, where the ``"corrected"`` rule fills it from the smaller batch's null run.

Assumptions and where the weight fails. (i) Separated eigenvalues: in a clustered bulk the pair
terms are not small, the bias is first order, the resummed ``V̂`` is still conservative and the
weight gives up part of a real correction (``flat`` and ``spiked`` in the study, where the oracle
weight exceeds 1). (ii) ``m < d``: with fewer samples than dimensions the range's spectrum is far
from its target and ``V̂`` is dominated by the null-space edge; there the weight tends to 0 on the
range and only the null-space fill is kept (the ``m < d`` rows of the study). (iii) Near-Gaussian
``Δ``: heavy-tailed rows over few samples make ``(2/3) Δ⁴`` under-state ``Var Δ²``. (iv) A
factor's rows are not its samples (a K-FAC factor of a convolution sums over positions); ``V̂``
uses only ``Δ``, whatever the rows. Measured against a known truth
(``benchmarks/results/correction_variance.md``, d = 60, 400 draws per cell), ``Σ a_i V̂_i`` over-states
``Σ a_i Var x_i`` 1.8–19× for Gaussian rows, most where a bulk of equal eigenvalues carries the
weights ``a_i``: there the weight is conservative and gives up part of the correction. Under heavy
tails the ratio falls, to 0.55–0.9 for Student-t rows on a power-law spectrum at 32 + 96 and
64 + 64 samples. Resampling is not calibrated either: a delete-a-group jackknife (8 groups)
over-states the same sum 3.5–7.2×, a split-half scaled to the full sizes under-states it 0.16–0.9×.

**Shrinkage** (``rule="shrunk"``): the earlier weight ``w = max(0, 1 - Σ_i e_i² / Σ_i x_i²)`` with
``e = s_B - s_B̃`` the two orders' difference (``s = k g``). ``e_i`` is dominated by ``Δ_ii``, the
single batch's own first-order noise, not the noise of ``x_i``, so the weight is not a James–Stein
weight for ``x``: it falls to 0 as the batch grows, including where the correction is much larger
than its noise (the study's ``shrunk`` column). Offered for comparison.

With B̃ = B every ``Δ`` and gap is zero (to round-off), and so is every correction, whatever the
weight: the single batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from laplace_debiased.curvature.completion import group_means
from laplace_debiased.curvature.linalg import (
    FactorRows,
    RowFactor,
    compress,
    compress_diagonal,
    dense_factor,
    factor_rows,
    frobenius_tolerance,
    gram_eigenpairs,
    gram_spectrum,
    order_weight,
    order_weights,
    remeasure_eigenvalues,
    roundoff_tolerance,
    symmetric_eigh64,
    through_rows,
    tied_groups,
)

__all__ = ["RULES", "FactorCorrection", "Spectra", "correction_variance", "corrected_factor", "corrected_factor_rows",
           "corrected_kron", "same_minus_cross", "shrinkage_weight", "stein_weight"]

#: the weights of the correction on the pooled range (module docstring)
RULES = ("corrected", "shrunk", "stein")

#: the spectra (float64, ascending) of the dense factors one factor's decomposition computed, for the
#: rank counts of the coverage record: ``0`` B's factor, ``1`` B̃'s, ``(w_B, w_B̃)`` the pooled
#: ``w_B F_B + w_B̃ F_B̃`` (each the symmetrised factor as decomposed)
Spectra = dict[int | tuple[float, float], torch.Tensor]


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
        kept: the share ``w`` of the correction kept on the pooled range (module docstring:
            1 without shrinkage, ``[0, 1]`` with it).
    """

    change: float
    change_b: float
    change_b_tilde: float
    stderr: float
    kept: float = 1.0


def same_minus_cross(direction: torch.Tensor, magnitude: torch.Tensor, terms: int = 0) -> torch.Tensor:
    """Gaps ``g_i = λ_i(D) - u_iᵀ M u_i`` (float64, ascending order of ``D``'s eigenvalues).

    Args:
        direction: ``(d, d)`` PSD factor ``D`` of the batch that chooses the directions.
        magnitude: ``(d, d)`` PSD factor ``M`` of the independent batch that measures them, on
            the same scale as ``D``.
        terms: rank-one terms summed into ``M`` (its round-off tolerance,
            [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).

    Returns:
        ``(d,)`` float64 gaps, averaged over each tied run of ``D``'s eigenvalues.
    """
    return _same_minus_cross(direction, magnitude, terms)[0]


def _same_minus_cross(direction: torch.Tensor, magnitude: torch.Tensor | RowFactor, terms: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """[`same_minus_cross`][laplace_debiased.kron.corrected.same_minus_cross] and the spectrum of ``direction`` (float64, ascending)."""
    check_finite(direction, "the direction batch")
    L, U = symmetric_eigh64(direction)
    # diag(Uᵀ M U) in float64, at the round-off tolerance of M's own precision
    cross = remeasure_eigenvalues(U, magnitude, terms, dtype=torch.float64)
    return group_means(L - cross, tied_groups(L, roundoff_tolerance(direction))), L


def check_finite(F: torch.Tensor | RowFactor, batch: str) -> None:
    """Raise a ``ValueError`` naming ``batch`` where the factor ``F`` (dense or held as rows) is not finite."""
    if not (F.isfinite() if isinstance(F, RowFactor) else bool(torch.isfinite(F).all())):
        raise ValueError(f"the curvature factor of {batch} contains NaN or Inf; check the inputs and the model output on that batch.")


def _change(values: torch.Tensor, pooled: torch.Tensor) -> float:
    scale = float(torch.linalg.vector_norm(pooled))
    return float(torch.linalg.vector_norm(values - pooled)) / scale if scale > 0 else 0.0


def correction_variance(difference: torch.Tensor, L: torch.Tensor, m_direction: int, m_magnitude: int,
                        n_data: int | None, tolerance: float) -> torch.Tensor:
    """Estimated variance of each eigenvalue's correction ``x_i`` on the pooled range (module docstring).

    Args:
        difference: ``(r, r)`` float64 ``Δ = U_Pᵀ (F_B - F_B̃) U_P``, the two batches' difference in
            the pooled eigenbasis of the range.
        L: ``(r,)`` float64 pooled eigenvalues of the range, ascending.
        m_direction: samples in B.
        m_magnitude: samples in B̃.
        n_data: the training-set size (``None``: an infinite population).
        tolerance: eigenvalue separations up to it count as ties (no pair term).

    Returns:
        ``(r,)`` float64 ``V_i = 4 c² · (2/3) Σ_{j≠i} Δ_ij⁴ / ((λ_i - λ_j)² + 4ab Δ_ij²)
        + (c (b - a) / (2ab))² Δ_ii²`` with ``a = m_B̃ / n``, ``b = m_B / n`` and
        ``c = ab (1 - n / N)``.
    """
    n = m_direction + m_magnitude
    a, b = m_magnitude / n, m_direction / n
    c = a * b * order_weight(n, n, n_data)
    sep = L[:, None] - L[None, :]
    square = difference.square()
    denominator = sep.square() + 4 * a * b * square
    skip = (sep.abs() <= tolerance) | (denominator == 0)
    terms = square.square() / torch.where(skip, torch.ones_like(denominator), denominator)
    second = 4 * c**2 * (2 / 3) * terms.masked_fill(skip, 0.0).sum(1)
    return second + (c * (b - a) / (2 * a * b)) ** 2 * difference.diagonal().square()


def _null_shifts(shift_b: torch.Tensor, shift_t: torch.Tensor, gaps_b: torch.Tensor, gaps_t: torch.Tensor,
                 k: float, null: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``"stein"`` on the pooled null space (the first ``null`` entries): both orders' shifts
    ``k · max(g_B, g_B̃)``, the null-run gap of smaller size, ``k = (1 - n/N) / 4`` the mean of the
    size-proportional order weights (module docstring)."""
    if null == 0:
        return shift_b, shift_t
    shift_b, shift_t = shift_b.clone(), shift_t.clone()
    shift_b[:null] = shift_t[:null] = k * torch.maximum(gaps_b[:null], gaps_t[:null])
    return shift_b, shift_t


def corrected_factor(
    direction: torch.Tensor | RowFactor, magnitude: torch.Tensor | RowFactor, m_direction: int, m_magnitude: int, terms: int = 0,
    n_data: int | None = None, rule: str = "corrected", rows: FactorRows | None = None, spectra: Spectra | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FactorCorrection]:
    """Pooled eigenvectors and corrected eigenvalues of one factor (module docstring).

    Args:
        direction: ``(d, d)`` PSD factor of B, scaled as an estimate of the full-data factor; or held as
            rows ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]) beside a dense ``magnitude``: then
            never formed alone (it enters the pooled factor, its order's gaps come from its Gram matrix).
        magnitude: ``(d, d)`` PSD factor of B̃, same layer, position and scale (held as rows likewise).
        m_direction: samples in B (the pooled factor is the samples-weighted mean of the two,
            exactly the factor a single batch B ∪ B̃ gives).
        m_magnitude: samples in B̃.
        terms: rank-one terms summed into either factor (round-off tolerance of the quotients).
        n_data: the number ``N`` of training data the batches were drawn from without
            replacement (finite-population scaling); ``None``: an infinite population.
        rule: one of [`RULES`][laplace_debiased.kron.corrected.RULES]: the whole correction (``"corrected"``), or the
            correction on the pooled range weighted by the ``"shrunk"`` or the ``"stein"`` rule (module docstring).
        rows: B's and B̃'s rows where known: the gap of each order whose batch has fewer rows than
            ``d`` comes from the Gram matrices (``_gaps_from_rows``, no ``d × d`` eigh).
        spectra: where given, receives the spectra computed here ([`Spectra`][laplace_debiased.kron.corrected.Spectra]).

    Returns:
        ``(U, lam, record)``: ``U (d, d)`` orthonormal eigenvectors of the pooled factor
        (ascending), ``lam (d,)`` the corrected eigenvalues, both in ``direction.dtype``, and
        the [`FactorCorrection`][laplace_debiased.kron.corrected.FactorCorrection].
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
    pooled = _pooled(direction, magnitude, m_direction, m_magnitude)
    L, U = symmetric_eigh64(pooled)
    k_b, k_t = order_weights(m_direction, m_magnitude, n_data)
    spectra = {} if spectra is None else spectra
    spectra[m_direction / n, m_magnitude / n] = L
    gaps_b, gaps_t = (_order_gaps(direction, magnitude, k, terms, rows, spectra) for k in (0, 1))
    shift_b, shift_t = k_b * gaps_b, k_t * gaps_t
    tol = frobenius_tolerance(L.numel(), direction.dtype, float(torch.linalg.matrix_norm(pooled)))
    null = int((L <= tol).sum())
    variance = None
    if rule == "stein":
        shift_b, shift_t = _null_shifts(shift_b, shift_t, gaps_b, gaps_t, order_weight(n, n, n_data) / 4, null)
        difference = _difference(direction, magnitude, U)
        variance = correction_variance(difference[null:, null:], L[null:], m_direction, m_magnitude, n_data, tol)
    lam, record = _corrected_values(L, shift_b, shift_t, null, rule, variance)
    return U.to(direction.dtype), lam.to(direction.dtype), record


def _order_gaps(direction: torch.Tensor, magnitude: torch.Tensor, chooser: int, terms: int,
                rows: FactorRows | None, spectra: Spectra) -> torch.Tensor:
    """The gaps of the order in which batch ``chooser`` (``0``: B, ``1``: B̃) chooses the directions: through its
    rows where they are fewer than the dimension (``_gaps_from_rows``; ``_gaps_beside_dense`` where only its factor
    is held as rows), else densely ([`same_minus_cross`][laplace_debiased.kron.corrected.same_minus_cross], the other
    factor read through its rows where held so), its spectrum then kept in ``spectra[chooser]``."""
    if rows is not None and len(rows[chooser]) < direction.shape[0]:
        return _gaps_from_rows(rows, chooser, direction.dtype)[0]
    chosen, other = (direction, magnitude) if chooser == 0 else (magnitude, direction)
    if isinstance(chosen, RowFactor):
        return _gaps_beside_dense(chosen.rows, other, direction.dtype)
    gaps, spectra[chooser] = _same_minus_cross(chosen, other, terms)
    return gaps


def _gaps_from_rows(rows: FactorRows, chooser: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """[`same_minus_cross`][laplace_debiased.kron.corrected.same_minus_cross] of ``D = XdᵀXd`` (the rows ``rows[chooser]``) and ``M = XmᵀXm`` (the
    other rows) from their Gram matrices alone (blocks of ``rows.gram``), without a ``d``-long
    vector: ``(gaps (d,) float64 ascending, size of D's null group)``.

    ``D``'s spectrum is its Gram eigenvalues ([`gram_spectrum`][laplace_debiased.curvature.linalg.gram_spectrum])
    below ``d - k`` zeros. Along the eigenvector ``e = Xdᵀ v / √λ`` (``Xd Xdᵀ v = λ v``) B̃ measures
    ``‖Xm e‖² = ‖(Xm Xdᵀ) v‖² / λ``. On the tied run holding the zeros (dimension ``s``, the
    complement ``P`` of the eigenvectors outside it) the mean gap is ``(Σ_run λ - ‖Xm P‖_F²) / s``
    with ``‖Xm P‖_F² = tr(Xm Xmᵀ) - Σ_outside ‖Xm e‖²``, so its basis is never formed."""
    other = 1 - chooser
    return _gaps_of_gram(rows.block(chooser, chooser), rows[0].shape[1], dtype,
                         lambda V: (rows.block(other, chooser) @ V).square().sum(0),
                         float(rows.block(other, other).diagonal().sum()))


def _gaps_beside_dense(chosen_rows: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_gaps_from_rows`` of ``D = XdᵀXd`` (``chosen_rows`` ``(n, d)``, fewer than ``d``) against a dense
    ``M`` ``(d, d)``: B̃ measures ``vᵀ (Xd M Xdᵀ) v / λ`` along ``e = Xdᵀ v / √λ`` and ``tr M`` in all, so
    nothing of ``D`` is formed (``(d,)`` float64 gaps, ascending)."""
    X = chosen_rows.double()
    return _gaps_of_gram(X @ X.T, X.shape[1], dtype, lambda V: compress_diagonal(other, X.T @ V),
                         float(other.double().diagonal().sum()))[0]


def _gaps_of_gram(K: torch.Tensor, d: int, dtype: torch.dtype, measured: Callable[[torch.Tensor], torch.Tensor],
                  other_trace: float) -> tuple[torch.Tensor, int]:
    """The gaps of ``D = XᵀX`` (Gram matrix ``K = XXᵀ``, float64) against the other factor ``M``, given
    ``measured(V) = diag(Vᵀ X M Xᵀ V)`` and ``tr M`` (``_gaps_from_rows``): ``(gaps (d,) float64 ascending,
    size of D's null group)``."""
    L, V = gram_spectrum(K)
    zeros = d - L.numel()
    full = torch.cat([L.new_zeros(zeros), L])
    groups = tied_groups(full, frobenius_tolerance(d, dtype, float(torch.linalg.matrix_norm(K))))
    null = groups[0].stop if zeros else 0
    keep = slice(null - zeros, None)
    cross = measured(V[:, keep]) / L[keep]
    gaps = full.clone()
    gaps[null:] -= cross
    if null:
        outside = other_trace - float(cross.sum())
        gaps[:null] = (float(full[:null].sum()) - outside) / null
    return group_means(gaps, [g for g in groups if g.start >= null]), null


def _pooled(direction: torch.Tensor | RowFactor, magnitude: torch.Tensor | RowFactor, m_direction: int,
            m_magnitude: int) -> torch.Tensor:
    """The pooled factor ``(m_B F_B + m_B̃ F_B̃) / n`` ``(d, d)`` in float64; a factor held as rows
    ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]) enters as ``XᵀX`` added to the other, not
    formed alone (both held as rows: both formed)."""
    n = m_direction + m_magnitude
    if isinstance(direction, RowFactor) == isinstance(magnitude, RowFactor):
        return (m_direction * dense_factor(direction).double() + m_magnitude * dense_factor(magnitude).double()) / n
    (X, m_rows), (F, m_dense) = sorted(((direction, m_direction), (magnitude, m_magnitude)),
                                       key=lambda pair: not isinstance(pair[0], RowFactor))
    X = X.rows.double()
    return (m_dense * F.double()).addmm_(X.T, X, alpha=m_rows).div_(n)


def _difference(direction: torch.Tensor | RowFactor, magnitude: torch.Tensor | RowFactor, U: torch.Tensor
                ) -> torch.Tensor:
    """``Uᵀ (F_B - F_B̃) U`` in float64 (``U`` ``(d, k)``), each factor compressed through its rows where held so."""
    if not (isinstance(direction, RowFactor) or isinstance(magnitude, RowFactor)):
        return U.T @ (direction.double() - magnitude.double()) @ U
    return compress(direction, U) - compress(magnitude, U)


def corrected_factor_rows(
    direction_rows: torch.Tensor, magnitude_rows: torch.Tensor, m_direction: int, m_magnitude: int,
    dtype: torch.dtype, n_data: int | None = None, rule: str = "corrected", rows: FactorRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FactorCorrection] | None:
    """[`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor] of a factor wider than its
    rows, through the rows (``O(d n²)``).

    Args:
        direction_rows: ``(n_B, d)`` rows of B's factor ``D = XdᵀXd`` (its scaling).
        magnitude_rows: ``(n_B̃, d)`` rows of B̃'s factor ``M = XmᵀXm``.
        m_direction: samples in B.
        m_magnitude: samples in B̃.
        dtype: the dtype of the dense factors (round-off tolerances, the results).
        n_data: the training-set size (finite-population scaling, [`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor]).
        rule: one of [`RULES`][laplace_debiased.kron.corrected.RULES] ([`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor]).
        rows: the same rows as [`FactorRows`][laplace_debiased.curvature.linalg.FactorRows], whose Gram
            matrix every decomposition here shares (formed here otherwise).

    Returns:
        ``(Q, lam, record)``: ``Q (d, r)`` orthonormal eigenvectors of the pooled factor
        outside its null space (ascending), ``lam (r + 1,)`` their corrected eigenvalues and
        last the one of the implicit complement ``I - QQᵀ``, and the
        [`FactorCorrection`][laplace_debiased.kron.corrected.FactorCorrection]; equal to
        [`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor] on the dense factors to
        round-off. ``None`` if the pooled null space reaches beyond a half's null run (then the complement
        would not be isotropic; use the dense route).
    """
    n = m_direction + m_magnitude
    rows = factor_rows((direction_rows, magnitude_rows)) if rows is None else rows
    weights = torch.cat([rows.gram.new_full((len(direction_rows),), (m_direction / n) ** 0.5),
                         rows.gram.new_full((len(magnitude_rows),), (m_magnitude / n) ** 0.5)])
    pooled_rows = torch.cat(rows.double).mul_(weights[:, None])
    L, Q = gram_eigenpairs(pooled_rows, weights[:, None] * rows.gram * weights)
    d, r = pooled_rows.shape[1], L.numel()
    gaps_b, null_b = _gaps_from_rows(rows, 0, dtype)
    gaps_t, null_t = _gaps_from_rows(rows, 1, dtype)
    if d - r > min(null_b, null_t):
        return None
    full = torch.cat([L.new_zeros(d - r), L])
    k_b, k_t = order_weights(m_direction, m_magnitude, n_data)
    shift_b, shift_t = k_b * gaps_b, k_t * gaps_t
    variance = None
    if rule == "stein":
        shift_b, shift_t = _null_shifts(shift_b, shift_t, gaps_b, gaps_t, order_weight(n, n, n_data) / 4, d - r)
        YB, YM = direction_rows.double() @ Q, magnitude_rows.double() @ Q
        tol = frobenius_tolerance(d, dtype, float(torch.linalg.vector_norm(L)))
        variance = correction_variance(YB.T @ YB - YM.T @ YM, L, m_direction, m_magnitude, n_data, tol)
    lam, record = _corrected_values(full, shift_b, shift_t, d - r, rule, variance)
    values = torch.cat([lam[d - r:], lam[:1]]) if r < d else lam
    return Q.to(dtype), values.to(dtype), record


def shrinkage_weight(shift_b: torch.Tensor, shift_t: torch.Tensor) -> float:
    """The positive-part James–Stein weight ``max(0, 1 - Σ e_i² / Σ x_i²)`` of the correction
    ``x = shift_b + shift_t`` (both ``(k,)``, one per pooled range direction), with the orders'
    difference ``e = shift_b - shift_t`` measuring the pooled eigenvalues' noise (module
    docstring); 0 where ``x`` is zero."""
    total = float((shift_b + shift_t).square().sum())
    if total == 0.0:
        return 0.0
    return max(0.0, 1.0 - float((shift_b - shift_t).square().sum()) / total)


def stein_weight(x: torch.Tensor, variance: torch.Tensor, L: torch.Tensor) -> float:
    """The positive-part James–Stein weight ``max(0, 1 - Σ_i a_i V_i / Σ_i a_i x_i²)`` of the
    correction ``x`` ``(r,)`` on the pooled range, ``V`` ``(r,)`` its estimated variance
    ([`correction_variance`][laplace_debiased.kron.corrected.correction_variance]), ``a_i = 1 / λ_i²`` (``L`` the pooled eigenvalues, relative
    errors; module docstring); 0 where ``x`` is zero."""
    a = 1.0 / L.square()
    total = float((a * x.square()).sum())
    if total == 0.0:
        return 0.0
    return max(0.0, 1.0 - float((a * variance).sum()) / total)


def _corrected_values(L: torch.Tensor, shift_b: torch.Tensor, shift_t: torch.Tensor, null: int, rule: str,
                      variance: torch.Tensor | None = None) -> tuple[torch.Tensor, FactorCorrection]:
    """The corrected eigenvalues ``(L - w (shift_b + shift_t))⁺`` (all ``(d,)``, ascending; ``w = 1``
    on the first ``null`` entries, the pooled null space, and for ``rule="corrected"``; ``variance``
    ``(d - null,)`` the correction's estimated variance on the range for ``"stein"``) and the record
    of what each order and both changed."""
    if rule == "shrunk":
        kept = shrinkage_weight(shift_b[null:], shift_t[null:])
    elif rule == "stein":
        kept = stein_weight(shift_b[null:] + shift_t[null:], variance, L[null:])
    else:
        kept = 1.0
    weight = torch.full_like(L, kept)
    weight[:null] = 1.0
    lam = (L - weight * (shift_b + shift_t)).clamp(min=0.0)
    L0 = L.clamp(min=0.0)
    one_b, one_t = (L - 2 * weight * shift_b).clamp(min=0.0), (L - 2 * weight * shift_t).clamp(min=0.0)
    change_b, change_t = _change(one_b, L0), _change(one_t, L0)
    record = FactorCorrection(change=_change(lam, L0), change_b=change_b, change_b_tilde=change_t,
                              stderr=abs(change_b - change_t) / 2, kept=kept)
    return lam, record


def corrected_kron(
    direction_kfacs: Sequence[Sequence[torch.Tensor]],
    magnitude_kfacs: Sequence[Sequence[torch.Tensor]],
    m_direction: int,
    m_magnitude: int,
    terms: int | Sequence[Sequence[int]] = 0,
    n_data: int | None = None,
    rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor] | None]] | None = None,
    rule: str = "corrected",
    spectra: Sequence[Sequence[Spectra]] | None = None,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[FactorCorrection]]]:
    """[`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor] for every factor of a
    layer-wise K-FAC approximation.

    A block's Kronecker eigenvalues are the products of its factors' corrected eigenvalues
    (each factor is corrected on its own). A factor whose rows are known and fewer than its
    dimension goes through them
    ([`corrected_factor_rows`][laplace_debiased.kron.corrected.corrected_factor_rows]): its eigenvectors
    are then ``(d, r)`` with one more eigenvalue, that of the implicit complement.

    Args:
        direction_kfacs: B's factors, one entry per parameter block in laplace-torch
            ``Kron.kfacs`` order, each a list of one or two square factors (tensors, or
            [`RowFactor`][laplace_debiased.curvature.linalg.RowFactor] where held as rows).
        magnitude_kfacs: B̃'s factors, the same blocks.
        m_direction: samples in B.
        m_magnitude: samples in B̃.
        terms: rank-one terms summed into either factor (round-off tolerance): one count, or one
            per block and factor.
        n_data: the training-set size the batches were drawn from ([`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor]).
        rows: ``None``, or per block and factor ``(B's rows, B̃'s rows)`` (``F = XᵀX``) where known.
        rule: one of [`RULES`][laplace_debiased.kron.corrected.RULES], for every factor ([`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor]).
        spectra: ``None``, or per block and factor a dict that receives the spectra its dense
            decomposition computes ([`Spectra`][laplace_debiased.kron.corrected.Spectra]).

    Returns:
        ``(eigenvectors, eigenvalues, records)``, lists of lists per block and factor, the
        first two ready for
        [`laplace_debiased.kron.posterior.ImplicitKronDecomposed`][laplace_debiased.kron.posterior.ImplicitKronDecomposed]
        (for ``laplace.utils.matrix.KronDecomposed`` when every eigenvector matrix is square).
    """
    if len(direction_kfacs) != len(magnitude_kfacs):
        raise ValueError(
            f"B has {len(direction_kfacs)} K-FAC blocks but B̃ has {len(magnitude_kfacs)}; "
            "both must come from the same parameters."
        )
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}.")
    vectors, values, records = [], [], []
    for i, (F_dir, F_mag) in enumerate(zip(direction_kfacs, magnitude_kfacs)):
        block_rows = rows[i] if rows is not None else [None] * len(F_dir)
        block_terms = [terms] * len(F_dir) if isinstance(terms, int) else terms[i]
        block_spectra = spectra[i] if spectra is not None else [None] * len(F_dir)
        block = [_corrected_route(D, M, r, m_direction, m_magnitude, t, n_data, rule, s)
                 for D, M, r, t, s in zip(F_dir, F_mag, block_rows, block_terms, block_spectra)]
        vectors.append([b[0] for b in block])
        values.append([b[1] for b in block])
        records.append([b[2] for b in block])
    return vectors, values, records


def _corrected_route(
    direction: torch.Tensor | RowFactor, magnitude: torch.Tensor | RowFactor, rows: tuple[torch.Tensor, torch.Tensor] | None,
    m_direction: int, m_magnitude: int, terms: int, n_data: int | None, rule: str, spectra: Spectra | None,
) -> tuple[torch.Tensor, torch.Tensor, FactorCorrection]:
    """[`corrected_factor_rows`][laplace_debiased.kron.corrected.corrected_factor_rows] where [`through_rows`][laplace_debiased.curvature.linalg.through_rows]
    (and it applies), else [`corrected_factor`][laplace_debiased.kron.corrected.corrected_factor] on the dense factors (with the gaps of a batch
    narrower than the factor through its rows), formed from the rows here where both factors are held as rows
    ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]); where only one is, it stays rows (``corrected_factor``
    reads it through them)."""
    if through_rows(rows, direction.shape[0]):
        check_finite(direction, "B")
        check_finite(magnitude, "B̃")
        result = corrected_factor_rows(*rows, m_direction, m_magnitude, direction.dtype, n_data, rule,
                                       rows=factor_rows(rows))
        if result is not None:
            return result
    if isinstance(direction, RowFactor) != isinstance(magnitude, RowFactor):  # one narrower than the factor
        return corrected_factor(direction, magnitude, m_direction, m_magnitude, terms, n_data, rule, spectra=spectra)
    return corrected_factor(dense_factor(direction), dense_factor(magnitude), m_direction, m_magnitude, terms, n_data,
                            rule, rows=None if rows is None else factor_rows(rows), spectra=spectra)

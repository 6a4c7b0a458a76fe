"""Log-determinant and functional covariance of a posterior precision ``s·Q diag(h) Qᵀ + D``
from the curvature's eigenpairs (pure functions, float64).

``Q`` ``(P, r)`` has orthonormal columns (to float64 round-off), ``h`` ``(r,)`` ``≥ 0`` are the
curvature's eigenvalues on them (the curvature is zero on the complement of ``Q``), ``s`` is
laplace-torch's ``_H_factor`` ``1/σ²/T`` and ``D = diag(p)`` the prior precision.  A scalar
prior ``p = δ`` shares the eigenbasis: every quantity is a function of ``s·h + δ`` and costs
``O(r)`` (log-determinant) or ``O(n C P r)`` (covariances), whatever ``δ``.  A layer-wise or
diagonal prior does not share it; the log-determinant then takes the rank-``r`` form of the
matrix determinant lemma, ``O(P r²)``, which is the dense ``O(P³)`` when ``r = P``.
Everything is differentiable in ``s`` and ``p`` (marglik tuning uses autograd).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _float64(value: float | Tensor) -> Tensor:
    return value.double() if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float64)


def eigen_log_det(Q: Tensor, h: Tensor, h_factor: float | Tensor, prior: Tensor) -> Tensor:
    """``log det(s·Q diag(h) Qᵀ + diag(p))``, float64 scalar.

    Args:
        Q: ``(P, r)`` orthonormal columns.
        h: ``(r,)`` non-negative eigenvalues of the curvature along ``Q``.
        h_factor: ``s``, a number or a 0-d tensor (may require grad).
        prior: ``(1,)`` (scalar ``δ``) or ``(P,)`` (any other prior, as laplace-torch's
            ``prior_precision_diag``), positive; may require grad.

    Scalar: ``Σ_i log(s h_i + δ) + (P − r) log δ``.  Otherwise, with ``W = Q diag(√h)``,
    ``Σ_j log p_j + log det(I_r + s·Wᵀ D⁻¹ W)`` (Cholesky of an ``r × r`` matrix ``≥ I``).
    """
    n_params, rank = Q.shape
    s, p = _float64(h_factor), prior.double().reshape(-1)
    if p.numel() == 1:
        delta = p[0]
        return (s * h.double() + delta).log().sum() + (n_params - rank) * delta.log()
    if p.numel() != n_params:
        raise ValueError(f"prior must have 1 or {n_params} entries, got {p.numel()}.")
    W = Q.double() * h.double().clamp_min(0.0).sqrt()
    K = torch.eye(rank, dtype=torch.float64, device=Q.device) + s * (W.T / p) @ W
    return p.log().sum() + 2.0 * torch.linalg.cholesky(K).diagonal().log().sum()


def eigen_functional_covariance(J: Tensor, Q: Tensor, h_scaled: Tensor, delta: float | Tensor) -> Tensor:
    """``J (Q diag(h̃) Qᵀ + δ I)⁻¹ Jᵀ`` for a scalar prior ``δ``: J ``(n, C, P)``, Q ``(P, r)``
    orthonormal, ``h̃ = s·h`` ``(r,)`` ``≥ 0`` -> ``(n, C, C)`` in ``J.dtype``, computed in float64.

    ``(JQ) diag(1/(h̃ + δ)) (JQ)ᵀ + J (I − QQᵀ) Jᵀ/δ``; the residual term is absent when
    ``r = P``. It is formed as ``(JJᵀ − (JQ)(JQ)ᵀ)/δ`` (one ``n C P r`` product, that of ``JQ``)
    where that difference's float64 cancellation stays below the rounding of ``J.dtype``
    ([`gram_residual_is_exact`][laplace_debiased.eigen.marglik.gram_residual_is_exact]), else as
    ``R Rᵀ/δ`` with ``R = J − (JQ)Qᵀ`` (a second ``n C P r`` product, PSD for every ``δ > 0`` whatever the
    round-off)."""
    d = _float64(delta).reshape(())
    J64, Q64, h64 = J.double(), Q.double(), h_scaled.double()
    JQ = J64 @ Q64
    if Q.shape[1] == Q.shape[0]:
        return ((JQ / (h64 + d)) @ JQ.transpose(-1, -2)).to(J.dtype)
    if gram_residual_is_exact(h64, d, Q.shape[0], J.dtype):
        weights = h64 / (d * (h64 + d))  # 1/δ − 1/(h̃ + δ) >= 0
        cov = J64 @ J64.transpose(-1, -2) / d - (JQ * weights) @ JQ.transpose(-1, -2)
        return cov.to(J.dtype)
    R = J64 - JQ @ Q64.T
    cov = (JQ / (h64 + d)) @ JQ.transpose(-1, -2) + R @ R.transpose(-1, -2) / d
    return cov.to(J.dtype)


def gram_residual_is_exact(h_scaled: Tensor, delta: Tensor, n_params: int, dtype: torch.dtype) -> bool:
    """Whether ``JJᵀ/δ − (JQ) diag(1/δ − 1/(h̃+δ)) (JQ)ᵀ`` in float64 is as accurate as ``dtype``.

    Its terms are of size ``‖J‖²/δ`` and their float64 round-off ``~ √P · ε₆₄ · ‖J‖²/δ`` (inner
    products of length ``P``, and ``QᵀQ = I`` to that order); the result is at least
    ``‖J‖²/(max h̃ + δ)`` on its diagonal. The relative error ``√P · ε₆₄ · (max h̃ + δ)/δ`` must
    not exceed ``ε`` of ``dtype``: true for a float32 result up to a condition number of about
    ``10⁷``, never for a float64 result."""
    kappa = float((h_scaled.max() + delta) / delta) if h_scaled.numel() else 1.0
    return math.sqrt(n_params) * torch.finfo(torch.float64).eps * kappa <= torch.finfo(dtype).eps

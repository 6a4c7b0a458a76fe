"""Functional (co)variances for laplace-torch's own predictive paths, float64,
cancellation-free (used by [`laplace_debiased.eigen.laplace`][laplace_debiased.eigen.laplace]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace_debiased.curvature.linalg import symmetric_eigh64


def lowrank_functional_covariance(J: Tensor, U: Tensor, lam: Tensor, prior: Tensor) -> Tensor:
    """The functional covariance ``J (U diag(λ) Uᵀ + diag(p))⁻¹ Jᵀ`` of a low-rank precision.

    With ``D = diag(p)`` and the thin SVD ``D^{-1/2} U diag(√λ) = Q diag(σ) Vᵀ`` the precision is
    ``D^{1/2} (I + Q diag(σ²) Qᵀ) D^{1/2}``, so with ``J̃ = J D^{-1/2}``, ``R = J̃ - (J̃Q)Qᵀ``:

        Σ = (J̃Q) diag(1/(1+σ²)) (J̃Q)ᵀ + R Rᵀ,

    two Gram matrices with positive weights: no "prior term minus a correction" cancellation
    (for scalar ``p = δ``: ``1/(1+σ²)/δ = 1/(λ+δ)`` along ``U``, ``1/δ`` on its complement).
    ``U`` need only be orthonormal to its dtype's round-off; negative ``λ`` are clamped to 0.

    Args:
        J: ``(n, C, P)`` Jacobians.
        U: ``(P, k)`` orthonormal eigenvectors of the scaled curvature.
        lam: ``(k,)`` eigenvalues ``λ ≥ 0`` of the scaled curvature (e.g. laplace-torch's
            ``posterior_precision[0]``).
        prior: ``(P,)`` prior precisions ``p > 0``.

    Returns:
        ``(n, C, C)`` covariances in ``J.dtype``, computed in float64.
    """
    Jt = J.double() / prior.double().sqrt()
    W = U.double() / prior.double().sqrt()[:, None] * lam.double().clamp_min(0.0).sqrt()
    Q, sigma, _ = torch.linalg.svd(W, full_matrices=False)
    JQ = Jt @ Q
    R = Jt - JQ @ Q.T
    cov = (JQ / (1.0 + sigma.square())) @ JQ.transpose(-1, -2) + R @ R.transpose(-1, -2)
    return cov.to(J.dtype)


def dense_posterior_scale(H: Tensor, h_factor: float | Tensor, prior: Tensor) -> Tensor:
    """A square root ``S`` of the posterior covariance ``S Sᵀ = (s·H + diag(p))⁻¹``.

    ``D^{-1/2} s H D^{-1/2} = V diag(μ) Vᵀ`` (float64 eigh, round-off negative ``μ`` clamped
    to 0) gives ``S = D^{-1/2} V diag((1+μ)^{-1/2})``; the
    functional variance ``(JS)(JS)ᵀ`` is then a Gram, finite and PSD for every ``p > 0``.

    Args:
        H: ``(P, P)`` dense PSD curvature, in any dtype.
        h_factor: its scale ``s``.
        prior: ``(P,)`` prior precisions ``p > 0``.

    Returns:
        ``S``, ``(P, P)`` float64.
    """
    d = prior.double().rsqrt()
    mu, V = symmetric_eigh64(float(h_factor) * H.double() * d[:, None] * d[None, :])
    mu = mu.clamp_min(0.0)
    return d[:, None] * V * (1.0 + mu).rsqrt()

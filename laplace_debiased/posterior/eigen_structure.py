"""``EigenStructure``: the full or low-rank posterior ``s·U diag(λ) Uᵀ + δ I``, rotated once,
covariances and variances for a whole grid of prior precisions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from laplace_debiased.curvature.linalg import symmetric_eigh64
from laplace_debiased.posterior.grams import as_prior, jacobian_float64, residual_gram, weighted_grams
from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.posterior.links import project_classes


class EigenStructure:
    """Posterior ``s·U diag(λ) Uᵀ + δ I`` with orthonormal ``U`` ``(P, k)``, scalar ``δ``.

    ``k = P`` is a full (dense) posterior; ``k < P`` a low-rank one whose complement of ``U`` has
    precision ``δ``: ``Σ(δ) = JU diag(1/(sλ+δ)) (JU)ᵀ + R Rᵀ/δ`` with the residual
    ``R = J - (JU)Uᵀ`` (a Gram of the residual, not the cancelling ``JJᵀ - JU(JU)ᵀ``).
    ``U`` and ``λ`` are re-orthonormalised and re-diagonalised in float64
    ([`orthonormal_eigenpairs`][laplace_debiased.posterior.eigen_structure.orthonormal_eigenpairs]), round-off negative
    eigenvalues clamped to 0 (``H`` is PSD: a negative ``sλ + δ`` at small ``δ`` is what made float32
    predictives non-finite); everything computed is float64.
    """

    def __init__(self, U: Tensor, eigenvalues: Tensor, h_factor: float | Tensor) -> None:
        if U.ndim != 2 or U.shape[1] != len(eigenvalues):
            raise ValueError(f"U must be (P, k) with k = len(eigenvalues); got {tuple(U.shape)}")
        self.U, self.lam = orthonormal_eigenpairs(U, eigenvalues)
        self.s = float(h_factor)
        self.low_rank = U.shape[1] < U.shape[0]

    @classmethod
    def from_dense(cls, H: Tensor, h_factor: float | Tensor) -> EigenStructure:
        """Eigendecompose a dense symmetric ``H`` (full Laplace) in float64."""
        lam, U = symmetric_eigh64(H)
        self = cls.__new__(cls)
        self.U, self.lam, self.s, self.low_rank = U, lam.clamp_min(0.0), float(h_factor), False
        return self

    def rotate(self, jacs: Sequence[LayerJacobian]) -> tuple[Tensor, Tensor | None]:
        """``(JU, R Rᵀ)`` (float64) with ``R = J - (JU)Uᵀ``; ``R Rᵀ`` is ``None`` for a full
        posterior.  ``R`` is formed in pieces of the parameters
        ([`residual_gram`][laplace_debiased.posterior.grams.residual_gram])."""
        jacs = [jacobian_float64(j) for j in jacs]
        sizes = [j.dense.shape[-1] if j.dense is not None else j.g.shape[-1] * j.a.shape[-1] for j in jacs]
        if sum(sizes) != self.U.shape[0]:
            raise ValueError(f"U has {self.U.shape[0]} rows but the parameters have {sum(sizes)}")
        blocks = self.U.split(sizes)
        JU = sum(jac.matmul(U_b) for jac, U_b in zip(jacs, blocks))
        if not self.low_rank:
            return JU, None
        return JU, sum(residual_gram(jac, JU, U_b) for jac, U_b in zip(jacs, blocks))

    def covariances(self, rotated, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        """``Σ(δ_g)`` for every prior precision of a grid, shape ``(G, n, C, C)``, float64."""
        JU, rest = rotated
        d = self._deltas(prior_precisions)
        cov = weighted_grams(JU, 1.0 / (self.s * self.lam + d[:, None]))
        return cov if rest is None else cov + rest / d[:, None, None, None]

    def covariance(self, rotated, delta: float | Tensor) -> Tensor:
        """``Σ(δ)`` of shape ``(n, C, C)``:
        [`covariances`][laplace_debiased.posterior.eigen_structure.EigenStructure.covariances] at one prior
        precision."""
        return self.covariances(rotated, [delta])[0]

    def variances(self, rotated, prior_precisions: Sequence[float | Tensor], project: bool = False) -> Tensor:
        """``diag Σ(δ_g)`` (or ``diag ΠΣ(δ_g)Π``), shape ``(G, n, C)``, float64: squares of the
        (projected) ``JU`` weighted by ``1/(sλ+δ)``, plus the residual Gram's (projected) diagonal
        over ``δ``."""
        JU, rest = rotated
        d = self._deltas(prior_precisions)
        A2 = (project_classes(JU) if project else JU).square()
        var = (A2 @ (1.0 / (self.s * self.lam + d[:, None])).T).permute(2, 0, 1)
        if rest is not None:
            r = project_classes(project_classes(rest, -1), -2) if project else rest
            var = var + r.diagonal(dim1=-2, dim2=-1) / d[:, None, None]
        return var

    def _deltas(self, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        """The grid as a float64 vector on the device of the eigenpairs (a CUDA fit's Jacobians
        and eigenvalues live there)."""
        return torch.stack([as_prior(delta, 1, torch.float64)[0] for delta in prior_precisions]).to(self.lam.device)


def orthonormal_eigenpairs(U: Tensor, eigenvalues: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q, μ)`` in float64 with ``QᵀQ = I`` to float64 round-off and ``Q diag(μ) Qᵀ =
    U diag(λ) Uᵀ`` (``U`` ``(P, k)`` orthonormal only to its own dtype's round-off).

    ``U = Q₀R`` ([`orthonormal_factor`][laplace_debiased.posterior.eigen_structure.orthonormal_factor]),
    ``R diag(λ) Rᵀ = V diag(μ) Vᵀ`` (eigh), ``Q = Q₀V``; negative ``μ`` clamped to 0 (a float32 ``U`` makes
    complement formulas like ``I - UUᵀ`` wrong by ``1e-7``, which ``1/δ`` amplifies)."""
    Q0, R = orthonormal_factor(U.double())
    mu, V = symmetric_eigh64((R * eigenvalues.double()) @ R.T)
    return Q0 @ V, mu.clamp_min(0.0)


def orthonormal_factor(U: Tensor) -> tuple[Tensor, Tensor]:
    """``U = Q R`` for float64 ``U`` ``(P, k)`` of full column rank: ``Q`` ``(P, k)`` with
    ``QᵀQ = I`` to float64 round-off, ``R`` ``(k, k)`` upper triangular.

    Cholesky QR (``UᵀU = RᵀR``, ``Q = U R⁻¹``: two ``P k²`` products) when ``U`` is nearly
    orthonormal, ``‖UᵀU − I‖₂ ≤ ‖UᵀU − I‖₁ ≤ ½`` (the largest column sum bounds the spectral
    norm of a symmetric matrix): then ``κ(U)² ≤ 3`` and its loss of orthogonality,
    ``O(ε₆₄ κ(U)²)``, is round-off. Otherwise (and for ``k = 0``) Householder QR."""
    k = U.shape[1]
    if k == 0:
        return torch.linalg.qr(U)
    gram = U.T @ U
    if float((gram - torch.eye(k, dtype=gram.dtype, device=gram.device)).abs().sum(0).max()) > 0.5:
        return torch.linalg.qr(U)
    L = torch.linalg.cholesky(gram)
    return torch.linalg.solve_triangular(L, U.T, upper=False).T, L.T

"""Re-orthonormalised eigenpairs: orthonormal to float64 round-off, the same matrix, both for a
nearly orthonormal basis (Cholesky QR) and a far from orthonormal one (Householder QR)."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.posterior.eigen import orthonormal_eigenpairs, orthonormal_factor

EPS64 = torch.finfo(torch.float64).eps


def _largest(A: torch.Tensor) -> float:
    return float(A.abs().max()) if A.numel() else 0.0


@pytest.mark.parametrize("perturbation", [0.0, 1e-7, 1e-3, 1.0])
@pytest.mark.parametrize("k", [0, 12])
def test_orthonormal_eigenpairs(perturbation, k):
    g = torch.Generator().manual_seed(0)
    P = 60
    basis, _ = torch.linalg.qr(torch.randn(P, k, generator=g, dtype=torch.float64))
    U = basis + perturbation * torch.randn(P, k, generator=g, dtype=torch.float64)
    lam = torch.rand(k, generator=g, dtype=torch.float64) * 10
    Q, R = orthonormal_factor(U)
    torch.testing.assert_close(Q @ R, U, atol=20 * P * EPS64 * _largest(U), rtol=0)
    assert torch.equal(R, R.triu())
    Qe, mu = orthonormal_eigenpairs(U, lam)
    eye = torch.eye(k, dtype=torch.float64)
    torch.testing.assert_close(Qe.T @ Qe, eye, atol=20 * P * EPS64, rtol=0)
    dense = (U * lam) @ U.T
    torch.testing.assert_close((Qe * mu) @ Qe.T, dense, atol=20 * P * EPS64 * _largest(dense), rtol=0)

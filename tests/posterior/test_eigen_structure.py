"""Eigen structures (:mod:`laplace_debiased.posterior.eigen_structure`): a low-rank structure's covariance
equals the dense formula; re-orthonormalised eigenpairs are orthonormal to float64 round-off, the same matrix, both for a
nearly orthonormal basis (Cholesky QR) and a far from orthonormal one (Householder QR)."""

from __future__ import annotations

import pytest
import torch
from _models import fit_tiny_conv

from laplace_debiased.posterior.eigen_structure import EigenStructure, orthonormal_eigenpairs, orthonormal_factor
from laplace_debiased.posterior.from_laplace import laplace_params
from laplace_debiased.posterior.jacobians import LayerJacobian, logit_jacobians
from laplace_debiased.posterior.links import project_logits
from tests.eigen.test_posterior import _dense_reference

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


def test_low_rank_structure_equals_dense_formula():
    la, X = fit_tiny_conv("full", "all")
    H = la.H
    lam, U = torch.linalg.eigh(H)
    k = 5
    struct = EigenStructure(U[:, -k:], lam[-k:], la._H_factor)
    delta = 0.3
    precision = U[:, -k:] @ torch.diag(lam[-k:]) @ U[:, -k:].T + delta * torch.eye(la.n_params, dtype=H.dtype)
    Js, f = la.backend.jacobians(X[:5])
    cov_ref = torch.einsum("ncp,pq,ndq->ncd", Js, torch.linalg.inv(precision), Js)
    _, jacs = logit_jacobians(la.model, laplace_params(la), X[:5])
    cov = struct.covariance(struct.rotate(jacs), delta)
    torch.testing.assert_close(cov, cov_ref)


@pytest.mark.parametrize("buffer", [None, 7])
def test_eigen_variances_equal_diagonal_of_explicit_projected_covariance(buffer, monkeypatch):
    from laplace_debiased.posterior import grams

    if buffer is not None:  # the residual Gram in many small pieces
        monkeypatch.setattr(grams, "PAIR_BUFFER", buffer)
    g = torch.Generator().manual_seed(4)
    P, k, C, n = 15, 6, 4, 5
    U = torch.linalg.qr(torch.randn(P, k, generator=g, dtype=torch.float64))[0]
    lam = torch.rand(k, generator=g, dtype=torch.float64) * 5
    jacs = [  # a factored 3 x 3 weight and a dense 6-parameter block
        LayerJacobian(g=torch.randn(n, C, 3, generator=g, dtype=torch.float64),
                      a=torch.randn(n, 3, generator=g, dtype=torch.float64)),
        LayerJacobian(dense=torch.randn(n, C, 6, generator=g, dtype=torch.float64)),
    ]
    for struct in (EigenStructure(U, lam, 0.5), EigenStructure.from_dense((U * lam) @ U.T, 0.5)):
        rotated = struct.rotate(jacs)
        grid = [1e-8, 1.0, 1e3]
        cov = struct.covariances(rotated, grid)
        J = torch.cat([j.full() for j in jacs], -1)
        for gi, delta in enumerate(grid):  # against the explicit inverse
            ref = _dense_reference(J, U, 0.5 * lam, torch.full((P,), delta, dtype=torch.float64))
            torch.testing.assert_close(cov[gi], ref, rtol=1e-6, atol=0)  # the explicit inverse: cond ≤ 1e9
        f = torch.zeros(n, C, dtype=torch.float64)
        for project in (False, True):
            ref = torch.stack([(project_logits(f, c)[1] if project else c).diagonal(dim1=-2, dim2=-1) for c in cov])
            torch.testing.assert_close(struct.variances(rotated, grid, project=project), ref, rtol=1e-9, atol=1e-12)

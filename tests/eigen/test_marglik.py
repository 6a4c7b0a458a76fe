"""Eigenbasis log-determinant and functional covariance (:mod:`laplace_debiased.eigen.marglik`)
against dense float64 formulas, for a scalar and a per-parameter prior, both covariance routes."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.eigen.marglik import eigen_functional_covariance, eigen_log_det, gram_residual_is_exact


def _basis(P: int = 9, r: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(P, r, generator=g, dtype=torch.float64)).Q
    h = torch.rand(r, generator=g, dtype=torch.float64) * 10
    return Q, h, g


@pytest.mark.parametrize("per_parameter", [False, True])
def test_log_det_equals_the_dense_slogdet(per_parameter):
    Q, h, g = _basis()
    s = 0.7
    prior = torch.rand(9, generator=g, dtype=torch.float64) + 0.1 if per_parameter else torch.tensor([0.3], dtype=torch.float64)
    dense = s * (Q * h) @ Q.T + torch.diag(prior.expand(9))
    torch.testing.assert_close(eigen_log_det(Q, h, s, prior), torch.linalg.slogdet(dense).logabsdet)


def test_log_det_is_differentiable_in_the_prior_and_factor():
    Q, h, _ = _basis()
    prior = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
    s = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    grad_p, grad_s = torch.autograd.grad(eigen_log_det(Q, h, s, prior), (prior, s))
    # d/dδ log det = tr(Σ), d/ds = tr(Σ Q diag(h) Qᵀ), with Σ the inverse of the dense matrix
    cov = torch.linalg.inv(s.detach() * (Q * h) @ Q.T + 0.5 * torch.eye(9, dtype=torch.float64))
    torch.testing.assert_close(grad_p, cov.trace().reshape(1))
    torch.testing.assert_close(grad_s, (cov @ (Q * h) @ Q.T).trace())


def test_a_prior_of_the_wrong_length_is_refused():
    Q, h, _ = _basis()
    with pytest.raises(ValueError, match="prior must have 1 or 9 entries, got 3"):
        eigen_log_det(Q, h, 1.0, torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float32: the JJᵀ route; float64: R Rᵀ
@pytest.mark.parametrize("r", [4, 9])
def test_functional_covariance_equals_the_dense_inverse(dtype, r):
    Q, h, g = _basis(r=r)
    J = torch.randn(3, 2, 9, generator=g, dtype=torch.float64)
    delta = 0.4
    ref = torch.einsum("ncp,pq,nkq->nck", J, torch.linalg.inv((Q * h) @ Q.T + delta * torch.eye(9, dtype=torch.float64)), J)
    ours = eigen_functional_covariance(J.to(dtype), Q.to(dtype), h.to(dtype), delta)
    assert ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_the_gram_route_is_exact_for_float32_results_up_to_a_condition_bound_and_never_for_float64():
    h = torch.tensor([1.0, 100.0], dtype=torch.float64)
    delta = torch.tensor(1.0, dtype=torch.float64)
    assert gram_residual_is_exact(h, delta, 100, torch.float32)
    assert not gram_residual_is_exact(h, delta, 100, torch.float64)
    assert not gram_residual_is_exact(h * 1e9, delta, 100, torch.float32)

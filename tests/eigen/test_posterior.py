"""The low-rank functional covariance (:mod:`laplace_debiased.eigen.posterior`) against a dense
float64 inverse, marginal and joint, and without cancellation at a tiny prior."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.eigen.posterior import lowrank_functional_covariance


def _dense_reference(J: torch.Tensor, U: torch.Tensor, lam: torch.Tensor, prior: torch.Tensor):
    """``J (U diag(λ) Uᵀ + diag(prior))⁻¹ Jᵀ`` by an explicit float64 inverse."""
    P = (U * lam) @ U.T + torch.diag(prior)
    return torch.einsum("ncp,pq,nkq->nck", J, torch.linalg.inv(P), J)


@pytest.mark.parametrize("per_parameter_prior", [False, True])
def test_lowrank_functional_covariance_equals_dense_inverse(per_parameter_prior):
    g = torch.Generator().manual_seed(1)
    P, k = 12, 4
    U = torch.linalg.qr(torch.randn(P, k, generator=g, dtype=torch.float64))[0]
    lam = torch.tensor([50.0, 3.0, 0.2, 0.0], dtype=torch.float64)
    prior = torch.rand(P, generator=g, dtype=torch.float64) + 0.5 if per_parameter_prior else torch.full((P,), 0.3, dtype=torch.float64)
    J = torch.randn(5, 3, P, generator=g, dtype=torch.float64)
    ref = _dense_reference(J, U, lam, prior)
    ours = lowrank_functional_covariance(J, U, lam, prior)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    # joint: one (n·C, n·C) covariance whose diagonal blocks are the marginal ones
    joint = lowrank_functional_covariance(J.reshape(1, 15, P), U, lam, prior)[0]
    torch.testing.assert_close(joint.reshape(5, 3, 5, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1), ref)


def test_lowrank_functional_covariance_without_cancellation():
    """Large curvature, tiny prior: the variance along span(U) is 1/λ, tiny next to 1/δ; a
    'prior term minus correction' form in float64 loses it, ours keeps it to round-off."""
    P = 6
    U = torch.eye(P, dtype=torch.float64)[:, :3]
    lam = torch.tensor([1e6, 1e7, 1e8], dtype=torch.float64)
    prior = torch.full((P,), 1e-8, dtype=torch.float64)
    J = torch.zeros(1, 1, P, dtype=torch.float64)
    J[0, 0, :3] = 1.0
    J[0, 0, 3] = 1e-9  # a small complement part: 1e-18 / 1e-8 = 1e-10
    expected = 1 / 1e6 + 1 / 1e7 + 1 / 1e8 + 1e-10
    ours = lowrank_functional_covariance(J, U, lam, prior)
    torch.testing.assert_close(ours.squeeze(), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    # float32 inputs: computed in float64 and cast back
    ours32 = lowrank_functional_covariance(J.float(), U.float(), lam.float(), prior.float())
    assert ours32.dtype == torch.float32
    assert abs(ours32.item() / expected - 1) < 1e-6

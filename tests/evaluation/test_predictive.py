"""Sampled linearised predictive (:mod:`laplace_debiased.evaluation.predictive`, Eq. 18): logits of
parameter samples have the structured covariance, and the Monte Carlo grid agrees with it."""

from __future__ import annotations

import pytest
import torch
from _models import fit_tiny_conv

from laplace_debiased.evaluation.predictive import linearized_logit_samples, sampled_linearized_predictive
from laplace_debiased.posterior.from_laplace import laplace_params
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import logit_jacobians

@pytest.mark.slow
def test_parameter_sampling_logits_have_the_structured_covariance():
    """Eq. 18 path (θ_s ~ posterior, JVPs) vs the rotated-Jacobian covariance Σ(δ)."""
    la, X = fit_tiny_conv("kron", "all")
    delta, S, x = 0.05, 4000, X[:4]
    la.prior_precision = delta
    samples = linearized_logit_samples(la, x, n_samples=S, generator=torch.Generator().manual_seed(0))
    pred = GridPredictive(la)
    f, jacs = logit_jacobians(la.model, laplace_params(la), x)
    rotated = pred.structure.rotate(jacs)
    cov = pred.structure.covariance(rotated, delta)
    centred = samples - f
    emp = torch.einsum("sni,snj->nij", centred, centred) / S
    rel = lambda a, b: float((a - b).norm() / b.norm())
    # Wishart relative error ~ sqrt(2/S) ≈ 0.02; a prior off by 2x is far outside
    assert rel(emp, cov) < 0.08
    assert rel(emp, pred.structure.covariance(rotated, 2 * delta)) > 0.2
    assert (samples.mean(0) - f).abs().max() < 4 * cov.diagonal(dim1=1, dim2=2).sqrt().max() / S**0.5


@pytest.mark.slow
def test_mc_grid_agrees_with_parameter_sampling_eq18():
    la, X = fit_tiny_conv("kron", "all")
    delta, S, x = 0.05, 3000, X[:8]
    la.prior_precision = delta
    grid_mc = GridPredictive(la).grid(
        x, [delta], links=("mc",), n_samples=S, generator=torch.Generator().manual_seed(0)
    )["mc"][0]
    eq18 = sampled_linearized_predictive(la, x, n_samples=S, generator=torch.Generator().manual_seed(1))
    assert (grid_mc - eq18).abs().mean() < 0.015

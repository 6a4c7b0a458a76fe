"""Regression grid search of the debiased classes: δ by the Gaussian predictive NLL.

laplace-torch's default regression score, the MSE of the predictive mean, does not depend on δ
under the GLM predictive (the mean is the MAP output), so every grid point ties and the bottom
of the grid wins.  The debiased classes score by ``-log N(y; f(x), J P(δ)⁻¹ Jᵀ + σ² I)`` with the
object's ``sigma_noise``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401

GRID = dict(log_prior_prec_min=-4, log_prior_prec_max=4, grid_size=41)


@functools.cache
def _map_and_data():
    """A tanh MLP 1-16-1 trained to its MAP on ``y = sin(3x) + 0.1 ε`` (float64), its residual
    standard deviation, and train / validation loaders."""
    g = torch.Generator().manual_seed(0)

    def data(n: int) -> TensorDataset:
        x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 4 - 2
        return TensorDataset(x, torch.sin(3 * x) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64))

    train, val = data(128), data(128)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = train.tensors
    for _ in range(1500):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    with torch.no_grad():
        sigma = float((model(x) - y).pow(2).mean().sqrt())
    return model, sigma, DataLoader(train, batch_size=32, shuffle=False), DataLoader(val, batch_size=64)


def _fitted(structure: str):
    model, sigma, train_loader, _ = _map_and_data()
    paper = {"estimator": "paper"} if structure in ("debiased_kron", "debiased_ekfac") else {}
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure, sigma_noise=sigma, **paper)
    la.fit(train_loader)
    return la


def _grid_nll(la, val_loader, delta: float) -> float:
    """Mean Gaussian predictive NLL of the validation targets at prior precision ``delta``."""
    la.prior_precision = delta
    total, count = 0.0, 0
    for x, y in val_loader:
        mean, var = la(x, pred_type="glm")
        cov = var + la.sigma_noise.square() * torch.eye(var.shape[-1], dtype=var.dtype)
        total -= float(torch.distributions.MultivariateNormal(mean, cov).log_prob(y).sum())
        count += len(y)
    return total / count


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full"])
def test_gridsearch_picks_an_interior_delta_like_marglik(structure):
    _, _, _, val_loader = _map_and_data()
    la = _fitted(structure)
    la.optimize_prior_precision(method="marglik", pred_type="glm")
    marglik = float(la.prior_precision)
    la.optimize_prior_precision(method="gridsearch", val_loader=val_loader, pred_type="glm", **GRID)
    chosen = float(la.prior_precision)
    grid = torch.logspace(-4, 4, GRID["grid_size"], dtype=torch.float64)
    assert grid[0] < marglik < grid[-1], "the test's premise: marglik picks an interior δ"
    assert grid[0] < chosen < grid[-1], f"gridsearch picked {chosen:g}, an end of the grid"
    scores = [_grid_nll(la, val_loader, float(d)) for d in grid]
    assert chosen == pytest.approx(float(grid[int(torch.tensor(scores).argmin())]), rel=1e-6)


def test_mse_score_is_refused_for_the_glm_predictive():
    import torchmetrics

    _, _, _, val_loader = _map_and_data()
    la = _fitted("debiased_kron")
    with pytest.raises(ValueError, match="does not depend on the prior precision.*loss=None"):
        la.optimize_prior_precision(method="gridsearch", val_loader=val_loader, pred_type="glm",
                                    loss=torchmetrics.MeanSquaredError(), **GRID)

"""Curvature factors (:mod:`laplace_debiased.curvature.factors`): the output factor squares to the
softmax Hessian, ``V Vᵀ`` is the exact GGN, the per-sample route gives the same columns, and
directional curvatures are Rayleigh quotients of the dense curvature."""

from __future__ import annotations

import pytest
import torch
from _models import exact_ggn
from torch import nn

from laplace_debiased.curvature.factors import (
    curvature_factor,
    dense_curvature,
    directional_curvatures,
    output_curvature_factor,
    per_sample_factor_columns,
)


def _model_and_data(likelihood: str, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(7, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (7,)) if likelihood == "classification" else torch.randn(7, 3, dtype=torch.float64)
    return model, X, y


def test_the_output_factor_squares_to_the_softmax_hessian_and_padding_has_none():
    f = torch.randn(5, 4, dtype=torch.float64)
    A = output_curvature_factor(f, torch.tensor([0, 1, 2, 3, -100]), "classification")
    p = torch.softmax(f, -1)
    hessian = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    torch.testing.assert_close((A @ A.transpose(1, 2))[:4], hessian[:4])
    assert not A[4].any()
    eye = output_curvature_factor(f, torch.zeros(5, 4), "regression")
    assert torch.equal(eye, torch.eye(4, dtype=torch.float64).expand(5, -1, -1))


def test_the_empirical_fisher_factor_is_the_scaled_loss_gradient():
    f = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 2, dtype=torch.float64)
    A = output_curvature_factor(f, y, "regression", "ef")
    (grad,) = torch.autograd.grad(0.5 * ((f - y) ** 2).sum(), f)  # laplace-torch: ½ × MSE(sum)
    torch.testing.assert_close(A.squeeze(-1), 2 ** 0.5 * grad)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_the_factor_squares_to_the_exact_ggn_and_the_per_sample_route_agrees(likelihood):
    model, X, y = _model_and_data(likelihood)
    V = curvature_factor(model, [(X[:4], y[:4]), (X[4:], y[4:])], likelihood)
    torch.testing.assert_close(V @ V.T, exact_ggn(model, X, likelihood))
    columns = torch.cat(list(per_sample_factor_columns(model, X, y, likelihood)), 1)
    torch.testing.assert_close(columns, V)
    torch.testing.assert_close(dense_curvature(model, [(X, y)], likelihood), exact_ggn(model, X, likelihood))


def test_directional_curvatures_are_rayleigh_quotients_and_refuse_bad_names():
    model, X, y = _model_and_data("classification", seed=1)
    G = dense_curvature(model, [(X, y)], "classification")
    U = torch.randn(G.shape[0], 5, dtype=torch.float64)
    ours = directional_curvatures(model, [(X[:3], y[:3]), (X[3:], y[3:])], U, "classification", chunk_size=2)
    torch.testing.assert_close(ours, ((G @ U) * U).sum(0))
    with pytest.raises(ValueError, match="curvature must be one of"):
        dense_curvature(model, [(X, y)], "classification", "hessian_diag")

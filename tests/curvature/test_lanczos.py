"""Matrix-free top eigenpairs and curvature products (:mod:`laplace_debiased.curvature.lanczos`)
against dense matrices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_debiased.curvature.factors import dense_curvature
from laplace_debiased.curvature.lanczos import lanczos_top_k, summed_curvature_product


def test_top_k_equal_the_dense_eigendecomposition():
    g = torch.Generator().manual_seed(0)
    P = 40
    Q = torch.linalg.qr(torch.randn(P, P, generator=g, dtype=torch.float64)).Q
    evals = torch.logspace(1, -2, P, dtype=torch.float64)
    A = (Q * evals) @ Q.T
    pairs = lanczos_top_k(lambda v: A @ v, P, 4, seed=3)
    assert pairs.method == "lanczos" and pairs.vectors.shape == (P, 4)
    torch.testing.assert_close(pairs.values, evals[:4])
    # eigenvectors up to sign, and reproducible from the seed
    torch.testing.assert_close((pairs.vectors.T @ Q[:, :4]).abs(), torch.eye(4, dtype=torch.float64), atol=1e-8, rtol=0)
    assert torch.equal(lanczos_top_k(lambda v: A @ v, P, 4, seed=3).values, pairs.values)


@pytest.mark.parametrize("k", [0, 5, 6])
def test_k_outside_the_lanczos_range_is_refused(k):
    with pytest.raises(ValueError, match="Lanczos needs 0 < k < dim=5"):
        lanczos_top_k(lambda v: v, 5, k)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_summed_product_equals_the_dense_curvature(likelihood):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X = torch.randn(10, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (10,)) if likelihood == "classification" else torch.randn(10, 2, dtype=torch.float64)
    batches = [(X[:6], y[:6]), (X[6:], y[6:])]
    dense = dense_curvature(model, batches, likelihood, "ggn")
    product = summed_curvature_product(model, batches, likelihood, "ggn", n_outputs=2)
    V = torch.randn(dense.shape[0], 3, dtype=torch.float64)
    torch.testing.assert_close(torch.stack([product(v) for v in V.T], 1), dense @ V)
    assert torch.equal(summed_curvature_product(model, [], likelihood, "ggn", 2)(V[:, 0]), torch.zeros_like(V[:, 0]))

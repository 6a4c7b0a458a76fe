"""Shared set-ups of the diagnostics tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from laplace_debiased.diagnostics.bias import DiagnosisConfig, diagnose_bias


@pytest.fixture
def float64() -> Iterator[None]:
    """Closed-form comparisons in float64; the default dtype is restored afterwards so other test
    modules are unaffected."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def wide_least_squares(N: int = 160, P: int = 24, seed: int = 0):
    """Linear regression with more features than points per batch: batch GGNs are rank-deficient."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, P, generator=g, dtype=torch.float64) * torch.linspace(0.5, 1.5, P, dtype=torch.float64)
    y = X @ torch.randn(P, 1, generator=g, dtype=torch.float64) + 0.5 * torch.randn(N, 1, generator=g, dtype=torch.float64)
    model = nn.Linear(P, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(X, y).solution.T)
    return model, X, y


@pytest.fixture(scope="session")
def diagnosis():
    """The bias diagnosis of :func:`wide_least_squares` (batches of 8, a ladder 8, 32, 80), built once
    per process and read only by the tests."""
    model, X, y = wide_least_squares()
    config = DiagnosisConfig(batch_size=8, beta=1e-3, top_k=4, cg_steps=4, n_sources=4, ladder=(8, 32, 80),
                             tolerance=0.1, seed=0)
    return diagnose_bias(model, nn.MSELoss(), X, y, config)

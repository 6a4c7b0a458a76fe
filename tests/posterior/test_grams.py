"""Weighted Gram matrices (:mod:`laplace_debiased.posterior.grams`) against the explicit formula."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.posterior import grams
from laplace_debiased.posterior.grams import weighted_grams

@pytest.mark.parametrize("buffer", [grams.PAIR_BUFFER, 7])
def test_weighted_grams_equal_explicit_formula(monkeypatch, buffer):
    """Pair-product path (G >= 3, also in pieces over inputs and columns) and the per-point path
    (G <= 2) against ``A diag(w_g) Aᵀ`` written out."""
    monkeypatch.setattr(grams, "PAIR_BUFFER", buffer)
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(5, 4, 9, dtype=torch.float64, generator=gen)
    W = torch.rand(4, 9, dtype=torch.float64, generator=gen)
    ref = torch.einsum("ncp,gp,ndp->gncd", A, W, A)
    torch.testing.assert_close(weighted_grams(A, W), ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(weighted_grams(A, W[:2]), ref[:2], rtol=1e-13, atol=1e-13)

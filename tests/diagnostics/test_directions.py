"""Top eigenpairs of a matrix-vector product (:mod:`laplace_debiased.diagnostics.directions`)."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.diagnostics.directions import top_eigenpairs
from laplace_debiased.diagnostics.overlap import overlap_matrix

pytestmark = pytest.mark.usefixtures("float64")


def test_lanczos_matches_dense_eigh():
    P = 150
    Q = torch.linalg.qr(torch.randn(P, P, generator=torch.Generator().manual_seed(0)))[0]
    evals = torch.logspace(2, -3, P)
    A = Q @ torch.diag(evals) @ Q.T
    top = top_eigenpairs(lambda v: A @ v, P, 5, seed=1)
    torch.testing.assert_close(top.values, evals[:5])
    torch.testing.assert_close(overlap_matrix(top.vectors, Q[:, :5]), torch.eye(5), atol=1e-8, rtol=0)


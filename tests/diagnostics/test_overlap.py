"""Subspace overlaps (:mod:`laplace_debiased.diagnostics.overlap`)."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.diagnostics.overlap import mean_row_mass, overlap_matrix

pytestmark = pytest.mark.usefixtures("float64")


def test_overlap_rows_sum_to_one_over_complete_basis():
    P = 7
    U = torch.linalg.qr(torch.randn(P, 3))[0]
    V = torch.linalg.qr(torch.randn(P, P))[0]
    omega = overlap_matrix(U, V)
    torch.testing.assert_close(omega.sum(1), torch.ones(3))
    # an incomplete basis loses mass; identical subspaces keep it
    assert (overlap_matrix(U, V[:, :4]).sum(1) < 1 - 1e-6).any()
    assert mean_row_mass(overlap_matrix(U, U @ torch.linalg.qr(torch.randn(3, 3))[0])) == pytest.approx(1.0)


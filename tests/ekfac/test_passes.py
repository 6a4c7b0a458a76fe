"""EKFAC bases and dense blocks (:mod:`laplace_debiased.ekfac.passes`): the Kronecker
eigenbasis diagonalises each factor, dense blocks equal ``Q diag((λ + δ)^e) Qᵀ``, and malformed
factors are refused."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.ekfac.passes import ekfac_block_dense, ekfac_to_dense, kron_eigenbasis


def _psd(n: int, seed: int) -> torch.Tensor:
    X = torch.randn(n + 2, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X.T @ X


def test_the_eigenbasis_diagonalises_every_factor():
    kfacs = [[_psd(3, 0), _psd(4, 1)], [_psd(3, 2)]]
    basis = kron_eigenbasis(kfacs)
    assert [len(b) for b in basis] == [2, 1]
    for block, Qs in zip(kfacs, basis):
        for F, Q in zip(block, Qs):
            torch.testing.assert_close(Q.T @ Q, torch.eye(len(F), dtype=torch.float64))
            D = Q.T @ F @ Q
            torch.testing.assert_close(D, torch.diag(D.diagonal()), atol=1e-10 * float(F.abs().max()), rtol=0)


def test_dense_blocks_with_the_kfac_eigenvalues_are_the_kronecker_product_and_inverses_invert():
    G, A = _psd(3, 3), _psd(4, 4)
    (QG, QA), = kron_eigenbasis([[G, A]])
    lam = ((QG.T @ G @ QG).diagonal()[:, None] * (QA.T @ A @ QA).diagonal()[None, :])  # K-FAC's eigenvalues
    torch.testing.assert_close(ekfac_block_dense([QG, QA], lam), torch.kron(G, A))
    delta = 0.5
    dense = ekfac_to_dense([[QG, QA], [QG]], [lam, torch.ones(3, dtype=torch.float64)], torch.tensor([delta, 1.0]))
    inverse = ekfac_to_dense([[QG, QA], [QG]], [lam, torch.ones(3, dtype=torch.float64)], torch.tensor([delta, 1.0]), -1.0)
    torch.testing.assert_close(dense[:12, :12], torch.kron(G, A) + delta * torch.eye(12, dtype=torch.float64))
    torch.testing.assert_close(dense @ inverse, torch.eye(15, dtype=torch.float64))


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="block 0 has 3 factors"):
        kron_eigenbasis([[_psd(2, 0)] * 3])
    with pytest.raises(ValueError, match="K-FAC block 1"):
        kron_eigenbasis([[_psd(2, 0)], [torch.ones(2, 3, dtype=torch.float64)]])

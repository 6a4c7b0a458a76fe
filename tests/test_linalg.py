"""Identities of the pure debiasing maths in ``laplace_debiased.curvature.linalg`` (float64)."""

import pytest
import torch

from laplace_debiased.curvature.linalg import (
    clamp_roundoff_negatives,
    debiased_factor,
    debiased_kron,
    eigh_float64,
    remeasure_eigenvalues,
    roundoff_tolerance,
)


def _psd(n: int, rank: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(rank, n, generator=g, dtype=torch.float64)
    return (X.T @ X).to(dtype)


def test_remeasure_is_rayleigh_quotient_per_column():
    C = _psd(6, 10, 0)
    U, _ = torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    lam = remeasure_eigenvalues(U, C)
    expected = torch.stack([U[:, i] @ C @ U[:, i] for i in range(4)])
    torch.testing.assert_close(lam, expected, rtol=1e-12, atol=1e-12)


def test_same_matrix_gives_its_own_eigenvalues():
    A = _psd(5, 8, 2)
    U, lam = debiased_factor(A, A)
    L, _ = torch.linalg.eigh(A)
    torch.testing.assert_close(lam, L, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, A, rtol=1e-10, atol=1e-10)


def test_debiased_kron_block_matches_dense_formula():
    G, A, D, C = _psd(3, 2, 3), _psd(4, 3, 4), _psd(3, 5, 5), _psd(4, 6, 6)
    bias_dir, bias_mag = _psd(3, 2, 7), _psd(3, 4, 8)
    vecs, vals = debiased_kron([[G, A], [bias_dir]], [[D, C], [bias_mag]])
    # dense: eigenvectors of G ⊗ A are kron(U_G, U_A); eigenvalues u^T (D ⊗ C) u
    _, UG = torch.linalg.eigh(G)
    _, UA = torch.linalg.eigh(A)
    Ud = torch.kron(UG, UA)
    lam_dense = torch.diag(Ud.T @ torch.kron(D, C) @ Ud)
    block = torch.kron(vecs[0][0] @ torch.diag(vals[0][0]) @ vecs[0][0].T,
                       vecs[0][1] @ torch.diag(vals[0][1]) @ vecs[0][1].T)
    torch.testing.assert_close(block, Ud @ torch.diag(lam_dense) @ Ud.T, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.outer(vals[0][0], vals[0][1]).flatten(),
                               torch.outer(torch.diag(UG.T @ D @ UG), torch.diag(UA.T @ C @ UA)).flatten())
    _, Ub = torch.linalg.eigh(bias_dir)
    torch.testing.assert_close(vals[1][0], torch.diag(Ub.T @ bias_mag @ Ub), rtol=1e-10, atol=1e-10)
    # debiased block differs from both plain K-FAC blocks (the test can fail)
    assert not torch.allclose(block, torch.kron(G, A))
    assert not torch.allclose(block, torch.kron(D, C))


def test_float32_inputs_computed_in_float64_and_cast_back():
    A = _psd(7, 3, 9, torch.float32)  # rank deficient: round-off negatives
    U, lam = debiased_factor(A, A)
    assert U.dtype == lam.dtype == torch.float32
    assert (lam >= 0).all()
    L64 = torch.linalg.eigvalsh(A.double())
    torch.testing.assert_close(lam.double(), L64.clamp(min=0), atol=1e-4, rtol=1e-4)


def test_roundoff_negatives_clamped_large_negatives_raise():
    vals = torch.tensor([1.0, -1e-14, 0.5], dtype=torch.float64)
    out = clamp_roundoff_negatives(vals, 1e-12)
    assert out[1] == 0 and out[0] == 1.0
    with pytest.raises(ValueError, match="not positive"):
        clamp_roundoff_negatives(torch.tensor([1.0, -0.1]), 1e-6)
    indefinite = torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="not positive"):
        debiased_factor(torch.eye(2, dtype=torch.float64), indefinite)
    assert roundoff_tolerance(indefinite) < 1e-12


def test_bad_blocks_raise_instead_of_dropping_layers():
    G = _psd(3, 3, 0)
    with pytest.raises(ValueError, match="K-FAC blocks"):
        debiased_kron([[G], [G]], [[G]])
    with pytest.raises(ValueError, match="factors"):
        debiased_kron([[G, G]], [[G]])
    with pytest.raises(ValueError, match="shape"):
        debiased_kron([[G]], [[_psd(4, 3, 1)]])
    with pytest.raises(ValueError, match="NaN or Inf"):
        debiased_kron([[G]], [[G * float("nan")]])
    with pytest.raises(ValueError, match="square"):
        eigh_float64(torch.ones(3))

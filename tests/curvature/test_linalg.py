"""Identities of the pure debiasing maths in ``laplace_debiased.curvature.linalg`` (float64)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from laplace_debiased.curvature.linalg import (
    clamp_roundoff_negatives,
    debiased_factor,
    debiased_kron,
    degenerate_groups,
    eigenvalues_above,
    remeasure_eigenvalues,
    roundoff_tolerance,
    symmetric_eigh64,
    tied_groups,
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
        symmetric_eigh64(torch.ones(3))


def _factor_matrix(U: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    return (U * lam) @ U.T


def _rotation_inside(V: torch.Tensor, cols: slice, seed: int) -> torch.Tensor:
    """An orthogonal Q with Q V[:, cols] = V[:, cols] W (random W), identity elsewhere."""
    g = torch.Generator().manual_seed(seed)
    k = V[:, cols].shape[1]
    W, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))
    Vc = V[:, cols]
    return torch.eye(V.shape[0], dtype=torch.float64) + Vc @ (W - torch.eye(k, dtype=torch.float64)) @ Vc.T


def test_degenerate_groups_chain_close_eigenvalues():
    values = torch.tensor([0.0, 1e-17, 2e-17, 0.5, 1.0, 1.0 + 1e-16, 3.0], dtype=torch.float64)
    assert degenerate_groups(values, 1e-15) == [slice(0, 3), slice(3, 4), slice(4, 6), slice(6, 7)]
    assert degenerate_groups(values[:0], 1e-15) == []


def test_rank_deficient_factor_is_basis_invariant():
    """B's factor has a 3-dim null space; the debiased factor does not depend on which basis of it
    eigh returns (nor on a rotation inside it): it is the compression of B̃'s factor there."""
    G, D = _psd(6, 3, 10), _psd(6, 9, 11)
    U, lam = debiased_factor(G, D)
    _, V = torch.linalg.eigh(G)
    Q = _rotation_inside(V, slice(0, 3), 12)  # null space of G comes first (ascending)
    G_rot = Q @ G @ Q.T  # = G up to round-off, but eigh sees another null basis
    U2, lam2 = debiased_factor(G_rot, D)
    torch.testing.assert_close(_factor_matrix(U2, lam2), _factor_matrix(U, lam), atol=1e-12, rtol=1e-10)
    # on the null space: the compression P D P of B̃'s factor
    P = V[:, :3] @ V[:, :3].T
    R = V[:, 3:] @ V[:, 3:].T
    torch.testing.assert_close(P @ _factor_matrix(U, lam) @ P, P @ D @ P, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(R @ _factor_matrix(U, lam) @ P, torch.zeros(6, 6, dtype=torch.float64), atol=1e-12, rtol=0)


def test_repeated_eigenvalue_is_basis_invariant():
    g = torch.Generator().manual_seed(13)
    V, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))
    G = (V * torch.tensor([1.0, 2.0, 2.0, 2.0, 5.0], dtype=torch.float64)) @ V.T
    D = _psd(5, 7, 14)
    Q = _rotation_inside(V, slice(1, 4), 15)
    a = _factor_matrix(*debiased_factor(G, D))
    b = _factor_matrix(*debiased_factor(Q @ G @ Q.T, D))
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    P = V[:, 1:4] @ V[:, 1:4].T
    torch.testing.assert_close(P @ a @ P, P @ D @ P, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tiny_perturbation_does_not_change_debiased_factor(dtype):
    G, D = _psd(8, 3, 16, dtype), _psd(8, 12, 17, dtype)
    eps = torch.finfo(dtype).eps
    E = _psd(8, 8, 18)
    E = (E / torch.linalg.matrix_norm(E) * float(torch.linalg.matrix_norm(G.double())) * 5 * eps).to(dtype)
    a = _factor_matrix(*debiased_factor(G, D)).double()
    b = _factor_matrix(*debiased_factor(G + E, D)).double()
    assert float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(a)) < 100 * eps


def test_same_matrix_rank_deficient_is_exact():
    G = _psd(6, 2, 19)
    torch.testing.assert_close(_factor_matrix(*debiased_factor(G, G)), G, atol=1e-12, rtol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 7),
    rank_fraction=st.floats(0.0, 1.0),
    repeated=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_debiased_factor_is_orthogonally_equivariant(n, rank_fraction, repeated, seed):
    """factor(Q G Qᵀ, Q D Qᵀ) = Q factor(G, D) Qᵀ for every orthogonal Q: the result depends on
    the two matrices only, never on the basis eigh picks (null spaces, repeated eigenvalues)."""
    g = torch.Generator().manual_seed(seed)
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    rank = int(round(rank_fraction * n))
    values = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    if repeated:
        values[: max(n // 2, 1)] = 1.0
    values[rank:] = 0.0
    G = (V * values) @ V.T
    D = _psd(n, n + 2, seed % 1000 + 1)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    a = _factor_matrix(*debiased_factor(G, D))
    b = _factor_matrix(*debiased_factor(Q @ G @ Q.T, Q @ D @ Q.T))
    torch.testing.assert_close(b, Q @ a @ Q.T, atol=1e-10 * float(D.norm()), rtol=1e-8)


def test_tied_groups_have_bounded_spread_and_cover_everything():
    values = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.35, 2.0, 2.05, 5.0])
    groups = tied_groups(values, 0.15)
    assert [(g.start, g.stop) for g in groups] == [(0, 2), (2, 5), (5, 7), (7, 8)]
    assert all(float(values[g.stop - 1] - values[g.start]) <= 0.15 for g in groups)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 30), st.integers(0, 2**31 - 1), st.floats(-3.0, 3.0))
def test_eigenvalues_above_counts_by_inertia(d, seed, threshold):
    """Spectrum slicing: for a symmetric ``S = Q diag(λ) Qᵀ`` with eigenvalues of both signs (so
    that Bunch–Kaufman takes 2 × 2 pivots), kept at least ``1e-6`` from the threshold (far above
    the float64 backward error), the count by inertia equals the count of ``λ > threshold``."""
    g = torch.Generator().manual_seed(seed)
    lam = 8 * torch.rand(d, generator=g, dtype=torch.float64) - 4
    lam = torch.where((lam - threshold).abs() < 1e-6, lam + 2e-6, lam)
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    S = Q @ torch.diag(lam) @ Q.T
    before = S.clone()
    assert eigenvalues_above(S, threshold) == int((lam > threshold).sum())
    assert torch.equal(S, before)  # the float64 input is counted, not shifted in place

"""The null-space completions of :mod:`laplace_debiased.curvature.completion`.

Nested directions in B's null space (``nested_factor``): identities against dense matrices,
reductions, invariances and seeded statistics.

The isotropic completion averages only over eigenvalues that are equal up to round-off.

A dense stretch of small, distinct eigenvalues of B's factor (neighbours closer than the
round-off tolerance, the whole stretch far wider) must not be chained into B's null space and
flattened: two of B's directions share a completed eigenvalue only if their eigenvalues differ by
at most the tolerance. Checked on the dense route and on the rows (Gram) route."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laplace_debiased.curvature.completion import isotropic_factor, nested_factor
from laplace_debiased.curvature.linalg import debiased_factor, lowrank_debiased_factor, roundoff_tolerance

EPS64 = torch.finfo(torch.float64).eps


def _gram(d: int, m: int, seed: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_n x_n x_nᵀ`` of ``m`` Gaussian samples in ``d`` dims (rank ``min(m, d)``), float64."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(m, d, generator=g, dtype=torch.float64)
    X = X * scales if scales is not None else X
    return X.T @ X / m


def _tol(*Ms: torch.Tensor) -> float:
    """Round-off bound of float64 eigendecompositions and a few products: 100 · d · eps · ‖M‖."""
    return 100 * Ms[0].shape[0] * EPS64 * max(float(torch.linalg.matrix_norm(M)) for M in Ms)


def _null_basis(D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    L, V = torch.linalg.eigh(D)
    return V[:, L > _tol(D)], V[:, L <= _tol(D)]


def _matrix(U: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    return U @ torch.diag(lam) @ U.T


def test_dense_identity():
    """On B's range: Rayleigh quotients of M = w C₁ + (1 − w) C₂. On its null space P: B̃₁'s
    eigenvectors of Pᵀ C₁ P with B̃₂'s Rayleigh quotients, and B̃₂'s mean curvature on the part of P
    that B̃₁ does not reach either."""
    d, r, r1, w = 16, 4, 5, 0.3
    D, C1, C2 = _gram(d, r, 0), _gram(d, r1, 1), _gram(d, 6, 2)
    U, lam = nested_factor(D, C1, C2, choose_share=w)
    R, N = _null_basis(D)
    M = w * C1 + (1 - w) * C2
    S1, S2 = N.T @ C1 @ N, N.T @ C2 @ N
    l1, Y = torch.linalg.eigh(S1)
    seen, unseen = Y[:, l1 > _tol(S1)], Y[:, l1 <= _tol(S1)]
    assert seen.shape[1] == r1
    W, Z = N @ seen, N @ unseen
    expected = (R @ torch.diag(((M @ R) * R).sum(0)) @ R.T + W @ torch.diag(((C2 @ W) * W).sum(0)) @ W.T
                + torch.trace(Z.T @ C2 @ Z) / Z.shape[1] * Z @ Z.T)
    tol = _tol(D, C1, C2)
    torch.testing.assert_close(U.T @ U, torch.eye(d, dtype=U.dtype), atol=tol, rtol=0)
    torch.testing.assert_close(_matrix(U, lam), expected, atol=tol, rtol=0)


def test_reductions():
    """B̃₁ = B̃₂ = B: the ordinary eigendecomposition. B̃₁ = B̃₂ = C: B̃ chooses and measures in
    the null space, as ``null_space="aligned"`` (:func:`debiased_factor`)."""
    D, C = _gram(12, 4, 3), _gram(12, 5, 4)
    torch.testing.assert_close(_matrix(*nested_factor(D, D, D)), D, atol=_tol(D), rtol=0)
    torch.testing.assert_close(_matrix(*nested_factor(D, C, C)), _matrix(*debiased_factor(D, C)),
                               atol=_tol(D, C), rtol=0)


def test_full_rank_direction_factor_is_the_two_batch_estimator():
    """Without a null space nothing is nested: the isotropic two-batch factor of M."""
    D, C1, C2 = _gram(6, 40, 5), _gram(6, 40, 6), _gram(6, 40, 7)
    torch.testing.assert_close(_matrix(*nested_factor(D, C1, C2)), _matrix(*isotropic_factor(D, 0.5 * (C1 + C2))),
                               atol=_tol(D, C1, C2), rtol=0)


@settings(max_examples=25, deadline=None)
@given(d=st.integers(4, 14), r=st.integers(1, 6), r1=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_trace_on_the_null_space_and_basis_invariance(d, r, r1, seed):
    """tr over P equals tr(Pᵀ C₂ P) (B̃₂'s curvature there, redistributed), and rotating every
    factor by one orthogonal Q rotates the result: U diag(λ) Uᵀ -> Q U diag(λ) Uᵀ Qᵀ."""
    r, r1 = min(r, d - 2), min(r1, d - 1)
    D, C1, C2 = _gram(d, r, seed), _gram(d, r1, seed + 1), _gram(d, 3, seed + 2)
    F = _matrix(*nested_factor(D, C1, C2))
    _, N = _null_basis(D)
    tol = _tol(D, C1, C2)
    assert abs(float(torch.trace(N.T @ F @ N) - torch.trace(N.T @ C2 @ N))) <= tol
    Q = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).Q
    rotated = _matrix(*nested_factor(Q @ D @ Q.T, Q @ C1 @ Q.T, Q @ C2 @ Q.T))
    torch.testing.assert_close(rotated, Q @ F @ Q.T, atol=tol, rtol=0)


def test_float32_factors_are_judged_by_float32_round_off():
    """Rank-deficient factors computed in float32 are PSD only up to float32 round-off: their
    negative Rayleigh quotients of that size are clamped (not refused), results in float32."""
    g = torch.Generator().manual_seed(11)
    # rows in a 12-dim subspace of 40 dims (as ReLU features): 28 directions that no batch sees,
    # where every Rayleigh quotient is float32 round-off of either sign
    X = torch.randn(30, 12, generator=g) @ torch.randn(12, 40, generator=g)
    D, C1, C2 = X[:14].T @ X[:14], X[14:22].T @ X[14:22], X[22:].T @ X[22:]  # float32 products
    U, lam = nested_factor(D, C1, C2)
    assert U.dtype == lam.dtype == torch.float32 and bool((lam >= 0).all())


def test_bad_inputs_are_refused():
    D = _gram(5, 2, 0)
    with pytest.raises(ValueError, match="differ in shape"):
        nested_factor(D, D, _gram(4, 2, 0))
    with pytest.raises(ValueError, match="choose_share"):
        nested_factor(D, D, D, choose_share=1.5)


def test_nested_directions_are_measured_without_same_batch_bias():
    """Seeded statistics, anisotropic truth Σ. In B's null space the eigenvalue of B̃₁'s top
    direction is unbiased for the truth along its own direction (chosen by B, B̃₁; measured by B̃₂): mean
    relative error within 4 standard errors of 0. With B̃₁ = B̃₂ (chosen and measured by the same
    batch, ``aligned``) the same eigenvalue overestimates it by far more than 4 standard errors."""
    d, m, m1, m2, draws = 16, 4, 4, 4, 400
    scales = torch.logspace(0, -1.5, d, dtype=torch.float64)
    Sigma = torch.diag(scales**2)
    nested, same = [], []
    for s in range(draws):
        D, C1, C2 = _gram(d, m, 3 * s, scales), _gram(d, m1, 3 * s + 1, scales), _gram(d, m2, 3 * s + 2, scales)
        _, N = _null_basis(D)
        for out, (U, lam) in ((nested, nested_factor(D, C1, C2)), (same, nested_factor(D, C1, C1))):
            # B̃₁'s top direction in the null space (chosen by B̃₁, never by the measured values)
            in_null = torch.nonzero((N.T @ U).square().sum(0) > 0.5).flatten()
            j = int(in_null[torch.argmax(((C1 @ U[:, in_null]) * U[:, in_null]).sum(0))])
            truth = U[:, j] @ Sigma @ U[:, j]
            out.append(float((lam[j] - truth) / truth))
    rel, biased = torch.tensor(nested), torch.tensor(same)
    assert abs(float(rel.mean())) < 4 * float(rel.std()) / math.sqrt(draws)
    assert float(biased.mean()) > 4 * float(biased.std()) / math.sqrt(draws)


def _stretch(d: int = 60, null: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B's factor ``V diag(L) Vᵀ`` (float32) with ``null`` zeros, then a stretch of eigenvalues
    spaced at a quarter of its round-off tolerance, then well separated ones; and B̃'s factor
    ``V diag(c) Vᵀ`` with distinct random ``c``, so that its Rayleigh quotients are exactly ``c``."""
    g = torch.Generator().manual_seed(seed)
    V = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    top = torch.linspace(50.0, 100.0, 10, dtype=torch.float64)
    tol = roundoff_tolerance(((V * torch.cat([torch.zeros(d - 10), top])) @ V.T).float())
    stretch = torch.arange(1, d - null - 10 + 1, dtype=torch.float64) * tol / 4
    L = torch.cat([torch.zeros(null, dtype=torch.float64), stretch, top])
    c = 1 + torch.rand(d, generator=g, dtype=torch.float64)
    return L, ((V * L) @ V.T).float(), ((V * c) @ V.T).float()


def _shared_values_are_ties(L: torch.Tensor, lam: torch.Tensor, U: torch.Tensor, D: torch.Tensor, tol: float) -> None:
    """Directions whose completed eigenvalues coincide have B-eigenvalues within ``tol``."""
    rayleigh_B = ((D.double() @ U.double()) * U.double()).sum(0)
    lam = lam.double()
    same = (lam[:, None] - lam[None, :]).abs() <= 1e-6 * lam.abs().max()
    spread = (rayleigh_B[:, None] - rayleigh_B[None, :]).abs()
    assert float(spread[same].max()) <= 1.5 * tol


@pytest.mark.parametrize("rule", ["isotropic", "nested"])
def test_dense_route_does_not_chain_a_stretch_into_the_null_space(rule):
    L, D, C = _stretch()
    tol = roundoff_tolerance(D)
    assert float(L[-11] - L[0]) > 5 * tol  # the stretch is far wider than the tolerance
    U, lam = isotropic_factor(D, C) if rule == "isotropic" else nested_factor(D, C, C)
    _shared_values_are_ties(L, lam, U, D, tol)


def test_rows_route_does_not_chain_a_stretch_into_the_null_space():
    g = torch.Generator().manual_seed(1)
    d, n = 60, 30
    scales = torch.cat([torch.linspace(1e-4, 3e-3, n - 5), torch.linspace(1.0, 2.0, 5)]).double()
    Q = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64)).Q
    Xd = (Q * scales.sqrt()).T.contiguous()  # B's factor Xdᵀ Xd = Q diag(scales) Qᵀ, rank n
    Xm = torch.randn(8, d, generator=g, dtype=torch.float64)
    U, lam = lowrank_debiased_factor(Xd.float(), Xm.float(), torch.float32, null_space="isotropic")
    D = (Xd.T @ Xd).float()
    tol = roundoff_tolerance(D)
    assert float(scales[n - 6] - scales[0]) > 5 * tol
    # only B's eigenvalues within the tolerance of 0 join the implicit null space
    assert U.shape[1] == int((scales > tol).sum())
    _shared_values_are_ties(scales, lam[: U.shape[1]], U, D, tol)

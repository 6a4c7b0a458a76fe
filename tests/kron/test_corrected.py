"""The corrected two-batch estimate of a curvature factor (laplace_debiased.kron.corrected):
its bias against a known truth, its reductions, and its symmetries."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laplace_debiased.kron.corrected import (
    RULES,
    corrected_factor,
    corrected_factor_rows,
    corrected_kron,
    correction_variance,
    same_minus_cross,
    shrinkage_weight,
    stein_weight,
)
from laplace_debiased.curvature.linalg import RowFactor, order_weights, symmetric_eigh64

EPS64 = torch.finfo(torch.float64).eps


def _factor(X: torch.Tensor) -> torch.Tensor:
    return X.T @ X / len(X)


def _truth(spectrum: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A covariance with the given spectrum in a random basis, and its square root."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(spectrum), len(spectrum), generator=g, dtype=torch.float64))
    s = torch.tensor(spectrum, dtype=torch.float64)
    return Q @ torch.diag(s) @ Q.T, Q @ torch.diag(s.sqrt())


def test_corrected_eigenvalues_are_unbiased_where_the_single_batch_is_not():
    """Gaussian samples, separated spectrum: over many draws, the corrected eigenvalues hit the
    true curvature along the pooled eigenvectors (the target), within 4 standard errors, while
    the single batch B ∪ B̃ over-states the top and under-states the bottom by more than 4."""
    F, root = _truth([4.0, 2.0, 1.0, 0.5])
    g = torch.Generator().manual_seed(1)
    m, draws = 64, 2000
    err_corr, err_single = [], []
    for _ in range(draws):
        XB = torch.randn(m, 4, generator=g, dtype=torch.float64) @ root.T
        XM = torch.randn(m, 4, generator=g, dtype=torch.float64) @ root.T
        U, lam, _ = corrected_factor(_factor(XB), _factor(XM), m, m)
        target = ((F @ U) * U).sum(0)
        pooled = torch.linalg.eigvalsh(_factor(torch.cat([XB, XM])))
        err_corr.append(lam - target)
        err_single.append(pooled - target)
    for errs, unbiased in ((err_corr, True), (err_single, False)):
        E = torch.stack(errs)
        z = E.mean(0) / (E.std(0) / math.sqrt(draws))
        if unbiased:
            assert z.abs().max() < 4, z
        else:  # ascending order: bottom under-stated, top over-stated
            assert z[0] < -4 and z[-1] > 4, z


def test_gap_is_zero_for_one_batch_against_itself():
    X = torch.randn(30, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    D = _factor(X)
    gaps = same_minus_cross(D, D.clone())
    # eigh's backward error: n · eps · ‖D‖_F per eigenvalue, the quotient alike
    assert gaps.abs().max() <= 10 * 5 * EPS64 * float(torch.linalg.matrix_norm(D))


def test_same_batch_gives_the_single_batch_eigendecomposition():
    X = torch.randn(30, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    D = _factor(X)
    U, lam, record = corrected_factor(D, D.clone(), 30, 30)
    L, V = torch.linalg.eigh(D)
    tol = 10 * 5 * EPS64 * float(torch.linalg.matrix_norm(D))
    torch.testing.assert_close(lam, L.clamp(min=0), atol=tol, rtol=0)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, D, atol=tol, rtol=0)
    assert record.change <= 1e-12


def test_pooled_basis_is_that_of_the_single_batch_of_both():
    """Unequal sizes: the eigenvectors are those of the factor of B ∪ B̃ (m-weighted mean)."""
    g = torch.Generator().manual_seed(4)
    XB, XM = torch.randn(20, 4, generator=g, dtype=torch.float64), torch.randn(12, 4, generator=g, dtype=torch.float64)
    U, _, _ = corrected_factor(_factor(XB), _factor(XM), 20, 12)
    P = _factor(torch.cat([XB, XM]))
    off = U.T @ P @ U - torch.diag(torch.diagonal(U.T @ P @ U))
    assert off.abs().max() <= 100 * 4 * EPS64 * float(torch.linalg.matrix_norm(P))


@settings(max_examples=30, deadline=None)
@given(d=st.integers(2, 6), mB=st.integers(1, 12), mM=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_symmetric_in_the_two_batches_and_nonnegative(d, mB, mM, seed):
    """Swapping B and B̃ (with their sizes) gives the same matrix; eigenvalues are ≥ 0; the
    matrix is equivariant under a rotation of the feature space."""
    g = torch.Generator().manual_seed(seed)
    XB = torch.randn(mB, d, generator=g, dtype=torch.float64)
    XM = torch.randn(mM, d, generator=g, dtype=torch.float64)
    D, M = _factor(XB), _factor(XM)
    U1, l1, _ = corrected_factor(D, M, mB, mM)
    U2, l2, _ = corrected_factor(M, D, mM, mB)
    assert (l1 >= 0).all()
    K1, K2 = U1 @ torch.diag(l1) @ U1.T, U2 @ torch.diag(l2) @ U2.T
    scale = float(torch.linalg.matrix_norm(D) + torch.linalg.matrix_norm(M))
    # equal up to eigh's backward error, amplified by the pooled spectrum's smallest gap
    # where ties split differently; tied runs are averaged, so a loose multiple suffices
    tol = 1e4 * d * EPS64 * scale
    torch.testing.assert_close(K1, K2, atol=tol, rtol=0)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    U3, l3, _ = corrected_factor(Q @ D @ Q.T, Q @ M @ Q.T, mB, mM)
    torch.testing.assert_close(U3 @ torch.diag(l3) @ U3.T, Q @ K1 @ Q.T, atol=tol, rtol=0)


def test_kron_corrects_each_factor_and_keeps_block_layout():
    g = torch.Generator().manual_seed(5)
    blocks_B = [[_factor(torch.randn(6, 3, generator=g, dtype=torch.float64)),
                 _factor(torch.randn(6, 4, generator=g, dtype=torch.float64))],
                [_factor(torch.randn(6, 3, generator=g, dtype=torch.float64))]]
    blocks_M = [[_factor(torch.randn(6, 3, generator=g, dtype=torch.float64)),
                 _factor(torch.randn(6, 4, generator=g, dtype=torch.float64))],
                [_factor(torch.randn(6, 3, generator=g, dtype=torch.float64))]]
    vecs, vals, recs = corrected_kron(blocks_B, blocks_M, 6, 6)
    assert [len(b) for b in vecs] == [2, 1] and [len(r) for r in recs] == [2, 1]
    for bv, bl, FB, FM in zip(vecs, vals, blocks_B, blocks_M):
        for U, lam, D, M in zip(bv, bl, FB, FM):
            U_ref, lam_ref, _ = corrected_factor(D, M, 6, 6)
            torch.testing.assert_close(U @ torch.diag(lam) @ U.T, U_ref @ torch.diag(lam_ref) @ U_ref.T)
    with pytest.raises(ValueError, match="same parameters"):
        corrected_kron(blocks_B, blocks_M[:1], 6, 6)


def test_refuses_non_finite_and_empty_batches():
    D = torch.eye(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN or Inf"):
        corrected_factor(D * float("nan"), D, 3, 3)
    with pytest.raises(ValueError, match="need samples"):
        corrected_factor(D, D, 0, 3)


def test_float32_factors_use_their_own_round_off_tolerance():
    """Two float32 factors over one 5-dimensional subspace of R^40: along their common null
    space the float32 sums are indefinite at float32 round-off, which must not be refused
    (float64's eps would refuse it) and must not be read as curvature."""
    g = torch.Generator().manual_seed(6)
    W = torch.randn(5, 40, generator=g)
    XB, XM = torch.randn(8, 5, generator=g) @ W, torch.randn(8, 5, generator=g) @ W
    D, M = XB.T @ XB / 8, XM.T @ XM / 8  # float32 sums
    U, lam, _ = corrected_factor(D, M, 8, 8, terms=8)
    assert lam.dtype == torch.float32 and (lam >= 0).all()
    scale = float(torch.linalg.matrix_norm(D.double()) + torch.linalg.matrix_norm(M.double()))
    assert float(lam[:35].max()) <= 100 * 40 * torch.finfo(torch.float32).eps * scale


def test_a_pooled_batch_of_all_data_is_not_corrected():
    """B ∪ B̃ = all N training data: the pooled factor is the full batch, which has no sampling
    bias; the finite-population scaling leaves it as it is. With N → ∞ the weights are m/n."""
    g = torch.Generator().manual_seed(7)
    XB, XM = torch.randn(10, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    U, lam, record = corrected_factor(_factor(XB), _factor(XM), 10, 6, n_data=16)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, _factor(torch.cat([XB, XM])), atol=1e-12, rtol=0)
    assert record.change == 0
    _, lam_inf, _ = corrected_factor(_factor(XB), _factor(XM), 10, 6)
    _, lam_big, _ = corrected_factor(_factor(XB), _factor(XM), 10, 6, n_data=10**12)
    torch.testing.assert_close(lam_big, lam_inf, atol=1e-9, rtol=1e-9)
    with pytest.raises(ValueError, match="n_data"):
        corrected_factor(_factor(XB), _factor(XM), 10, 6, n_data=12)


def _dense_from_implicit(Q: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``Q diag(lam[:r]) Qᵀ + lam[r] (I - QQᵀ)`` (float64)."""
    Q, lam = Q.double(), lam.double()
    r = Q.shape[1]
    out = Q @ torch.diag(lam[:r]) @ Q.T
    if len(lam) > r:
        out = out + lam[r] * (torch.eye(Q.shape[0], dtype=torch.float64) - Q @ Q.T)
    return out


@settings(max_examples=25, deadline=None)
@given(d=st.integers(6, 40), mB=st.integers(1, 12), mM=st.integers(1, 12), seed=st.integers(0, 10_000),
       n_data=st.one_of(st.none(), st.integers(25, 200)), rule=st.sampled_from(RULES))
def test_rows_route_equals_the_dense_corrected_factor(d, mB, mM, seed, n_data, rule):
    """A factor wider than B ∪ B̃'s rows: the corrected factor from the rows (Gram matrices,
    implicit complement) is the dense one, to the round-off of a d × d eigendecomposition, and
    so is the record of what it changed."""
    if mB + mM >= d:
        return
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 2.0, d, dtype=torch.float64)
    XB = torch.randn(mB, d, generator=g, dtype=torch.float64) * scale
    XM = torch.randn(mM, d, generator=g, dtype=torch.float64) * scale
    D, M = XB.T @ XB, XM.T @ XM
    U, lam, rec = corrected_factor(D, M, mB, mM, n_data=n_data, rule=rule)
    routed = corrected_factor_rows(XB, XM, mB, mM, torch.float64, n_data, rule)
    assert routed is not None
    Q, values, rec_rows = routed
    assert Q.shape == (d, mB + mM) and values.shape == (mB + mM + 1,)
    dense = U @ torch.diag(lam) @ U.T
    scale_F = float(torch.linalg.matrix_norm(D + M))
    tol = 1e3 * d * EPS64 * scale_F
    assert torch.allclose(_dense_from_implicit(Q, values), dense, atol=tol, rtol=0)
    assert abs(rec_rows.change - rec.change) <= 1e3 * d * EPS64 * max(1.0, rec.change)
    assert abs(rec_rows.stderr - rec.stderr) <= 1e3 * d * EPS64 * max(1.0, rec.stderr)
    assert abs(rec_rows.kept - rec.kept) <= 1e3 * d * EPS64


@settings(max_examples=25, deadline=None)
@given(d=st.integers(6, 30), narrow=st.integers(1, 5), extra=st.integers(0, 10), seed=st.integers(0, 10_000),
       n_data=st.one_of(st.none(), st.integers(60, 200)), rule=st.sampled_from(RULES), narrow_b=st.booleans())
def test_a_factor_held_as_rows_beside_a_dense_one_equals_the_dense_corrected_factor(
        d, narrow, extra, seed, n_data, rule, narrow_b):
    """One batch narrower than the factor (held as rows, its gaps from its Gram matrix, never formed alone), the
    other at least as wide (dense): the corrected factor and its record are the dense ones, to the round-off of a
    d × d eigendecomposition."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 2.0, d, dtype=torch.float64)
    sizes = (narrow, d + extra) if narrow_b else (d + extra, narrow)
    XB, XM = (torch.randn(m, d, generator=g, dtype=torch.float64) * scale for m in sizes)
    D, M = XB.T @ XB, XM.T @ XM
    U, lam, rec = corrected_factor(D, M, *sizes, n_data=n_data, rule=rule)
    mixed = (RowFactor(XB), M) if narrow_b else (D, RowFactor(XM))
    U_rows, lam_rows, rec_rows = corrected_factor(*mixed, *sizes, n_data=n_data, rule=rule)
    tol = 1e3 * d * EPS64 * float(torch.linalg.matrix_norm(D + M))
    assert torch.allclose((U_rows * lam_rows) @ U_rows.T, (U * lam) @ U.T, atol=tol, rtol=0)
    for field in ("change", "change_b", "change_b_tilde", "stderr", "kept"):
        want = getattr(rec, field)
        assert abs(getattr(rec_rows, field) - want) <= 1e3 * d * EPS64 * max(1.0, want)


def test_kron_takes_the_rows_route_for_wide_factors_only():
    """corrected_kron with rows: a factor wider than its rows comes back as (d, r) with one more
    eigenvalue (the complement), equal to the dense result; a narrower one stays square."""
    g = torch.Generator().manual_seed(5)
    XB, XM = torch.randn(3, 12, generator=g, dtype=torch.float64), torch.randn(4, 12, generator=g, dtype=torch.float64)
    YB, YM = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randn(9, 4, generator=g, dtype=torch.float64)
    direction = [[YB.T @ YB, XB.T @ XB]]
    magnitude = [[YM.T @ YM, XM.T @ XM]]
    vecs, vals, _ = corrected_kron(direction, magnitude, 3, 4, rows=[[None, (XB, XM)]])
    dense_vecs, dense_vals, _ = corrected_kron(direction, magnitude, 3, 4)
    assert vecs[0][0].shape == (4, 4) and vecs[0][1].shape == (12, 7) and vals[0][1].shape == (8,)
    assert torch.equal(vecs[0][0], dense_vecs[0][0])
    dense = dense_vecs[0][1] @ torch.diag(dense_vals[0][1]) @ dense_vecs[0][1].T
    assert torch.allclose(_dense_from_implicit(vecs[0][1], vals[0][1]), dense, atol=1e-10)


@settings(max_examples=50, deadline=None)
@given(k=st.integers(1, 12), seed=st.integers(0, 10_000), scale=st.floats(1e-6, 1e6))
def test_shrinkage_weight_is_a_share_symmetric_and_scale_free(k, seed, scale):
    """w ∈ [0, 1]; swapping the orders leaves it; scaling both shifts leaves it; orders that agree
    keep everything, orders that cancel keep nothing."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(k, generator=g, dtype=torch.float64), torch.randn(k, generator=g, dtype=torch.float64)
    w = shrinkage_weight(a, b)
    assert 0.0 <= w <= 1.0
    assert w == pytest.approx(shrinkage_weight(b, a), abs=4 * k * EPS64)
    assert w == pytest.approx(shrinkage_weight(scale * a, scale * b), abs=16 * k * EPS64)
    assert shrinkage_weight(a, a.clone()) == 1.0
    assert shrinkage_weight(a, -a) == 0.0
    # James–Stein: 1 - Σ(a - b)² / Σ(a + b)², positive part
    assert w == pytest.approx(max(0.0, 1 - float((a - b).square().sum() / (a + b).square().sum())), abs=4 * k * EPS64)


@pytest.mark.parametrize("n_data, m, spectrum", [(400, 100, [4.0, 2.0, 1.0, 0.5]), (120, 30, [4.0, 1.0, 0.25, 0.0625])])
def test_corrected_eigenvalues_are_unbiased_for_disjoint_batches_of_a_finite_training_set(n_data, m, spectrum):
    """B and B̃ drawn together without replacement from a fixed training set of N points, half
    of it in B ∪ B̃: over many draws the corrected eigenvalues hit the full-batch curvature along
    the pooled eigenvectors (``u_Pᵀ F_N u_P``) within 4 standard errors in every direction, while
    the single batch under-states the bottom of the spectrum by more than 4. (B̃ is
    drawn from the N - m points outside B, so ``E[F_B̃ | B] = (N F_N - m F_B) / (N - m)``: an
    order weight that ignores this over-corrects by ``N / (N - m)``, here 4/3.)"""
    g = torch.Generator().manual_seed(8)
    X = torch.randn(n_data, len(spectrum), generator=g, dtype=torch.float64) @ torch.diag(torch.tensor(spectrum).double().sqrt())
    F = _factor(X)
    corrected, single = [], []
    for _ in range(3000):
        perm = torch.randperm(n_data, generator=g)
        D, M = _factor(X[perm[:m]]), _factor(X[perm[m:2 * m]])
        U, lam, _ = corrected_factor(D, M, m, m, n_data=n_data)
        target = ((F @ U) * U).sum(0)
        corrected.append(lam - target)
        single.append((((D + M) / 2 @ U) * U).sum(0) - target)

    def z(errors: list[torch.Tensor]) -> torch.Tensor:
        E = torch.stack(errors)
        return E.mean(0) / (E.std(0) / math.sqrt(len(E)))

    assert z(corrected).abs().max() < 4
    assert z(single)[0] < -4  # the bottom of the spectrum under-stated


def _shrunk_by_hand(D, M, m, n_data=None):
    """The shrunk factor from its definition (module docstring), dense and float64."""
    n = 2 * m
    P = (D + M) / 2
    L, U = torch.linalg.eigh(P)
    weight = 0.5 * (1 if n_data is None else 1 - n / n_data)  # (m / n)(1 - n / N)
    sb, st_ = weight * same_minus_cross(D, M) / 2, weight * same_minus_cross(M, D) / 2
    null = int((L <= 1e-12 * float(L.abs().max())).sum())
    x, e = (sb + st_)[null:], (sb - st_)[null:]
    w = max(0.0, 1 - float(e.square().sum() / x.square().sum()))
    shift = torch.cat([(sb + st_)[:null], w * x])
    return U, (L - shift).clamp(min=0), w


@pytest.mark.parametrize("d, m", [(5, 10), (12, 4)])
def test_shrunk_factor_equals_its_definition(d, m):
    """Narrow (no null space) and wide (B ∪ B̃ of 8 rows in 12 dimensions, null space kept
    corrected in full): eigenvalues L_P - w x on the range, L_P - x on the null space."""
    g = torch.Generator().manual_seed(d)
    scale = torch.linspace(0.3, 3.0, d, dtype=torch.float64)
    XB = torch.randn(m, d, generator=g, dtype=torch.float64) * scale
    XM = torch.randn(m, d, generator=g, dtype=torch.float64) * scale
    D, M = _factor(XB), _factor(XM)
    U, lam, rec = corrected_factor(D, M, m, m, rule="shrunk")
    U_ref, lam_ref, w = _shrunk_by_hand(D, M, m)
    assert 0 < rec.kept < 1 and rec.kept == pytest.approx(w, abs=1e-9)
    tol = 1e3 * d * EPS64 * float(torch.linalg.matrix_norm(D + M))
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, U_ref @ torch.diag(lam_ref) @ U_ref.T, atol=tol, rtol=0)
    _, lam_corr, rec_corr = corrected_factor(D, M, m, m)
    assert rec_corr.kept == 1.0 and not torch.allclose(lam, lam_corr)
    if d > 2 * m:  # the null space keeps the whole correction
        torch.testing.assert_close(lam[:d - 2 * m], lam_corr[:d - 2 * m], atol=tol, rtol=0)


def test_shrunk_with_the_same_batch_is_the_single_batch():
    X = torch.randn(30, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    D = _factor(X)
    U, lam, rec = corrected_factor(D, D.clone(), 30, 30, rule="shrunk")
    L, _ = torch.linalg.eigh(D)
    torch.testing.assert_close(lam, L.clamp(min=0), atol=10 * 5 * EPS64 * float(torch.linalg.matrix_norm(D)), rtol=0)


def _squared_errors(spectrum: list[float], m: int, draws: int) -> dict[str, torch.Tensor]:
    """Per draw, ``‖λ̂ - target‖²`` of the single batch B ∪ B̃, the corrected and the shrunk
    eigenvalues along the pooled eigenvectors (Gaussian samples of a known covariance)."""
    F, root = _truth(spectrum)
    d = len(spectrum)
    g = torch.Generator().manual_seed(1)
    out = {"single": [], "corrected": [], "shrunk": [], "kept": []}
    for _ in range(draws):
        XB = torch.randn(m, d, generator=g, dtype=torch.float64) @ root.T
        XM = torch.randn(m, d, generator=g, dtype=torch.float64) @ root.T
        D, M = _factor(XB), _factor(XM)
        U, corrected, _ = corrected_factor(D, M, m, m)
        _, shrunk, rec = corrected_factor(D, M, m, m, rule="shrunk")
        target = ((F @ U) * U).sum(0)
        single = (((D + M) / 2 @ U) * U).sum(0)
        for key, values in (("single", single), ("corrected", corrected), ("shrunk", shrunk)):
            out[key].append(float((values - target).square().sum()))
        out["kept"].append(rec.kept)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def _paired_z(a: torch.Tensor, b: torch.Tensor) -> float:
    """``mean(a - b)`` in standard errors of the paired difference."""
    diff = a - b
    return float(diff.mean() / (diff.std() / math.sqrt(len(diff))))


def test_shrinkage_keeps_the_correction_where_the_bias_dominates():
    """Flat spectrum, m = d = 8 (each half's bias large against its noise): the shrunk estimate
    keeps most of the correction and is closer to the target than the single batch by far more
    than 4 paired standard errors."""
    errs = _squared_errors([1.0] * 8, 8, 300)
    assert errs["kept"].mean() > 0.5
    assert _paired_z(errs["shrunk"], errs["single"]) < -4


def test_shrinkage_drops_the_correction_where_the_noise_dominates():
    """Separated spectrum, m = 256 per half (a bias of order 1/m against a noise of order
    1/√m, so the correction costs the single batch more than it removes): the shrunk estimate
    keeps little of the correction, is closer to the target than the corrected one (z < -4) and
    gives back at least 90 % of what the corrected one loses against the single batch."""
    errs = _squared_errors([4.0, 2.0, 1.0, 0.5], 256, 1000)
    assert errs["kept"].mean() < 0.1
    assert _paired_z(errs["shrunk"], errs["corrected"]) < -4
    loss_corrected = float((errs["corrected"] - errs["single"]).mean())
    assert loss_corrected > 0
    assert float((errs["shrunk"] - errs["single"]).mean()) < 0.1 * loss_corrected


def _order_statistics(spectrum: list[float], m: int, draws: int) -> dict[str, float]:
    """Over ``draws`` Gaussian draws of two halves of ``m`` samples: ``E Σ e_i²`` (the orders'
    difference), ``Σ Var x_i`` (the correction's own noise) and ``Σ Var λ_{P,i}`` (the noise of the
    pooled eigenvalues, the single batch's), all over the whole spectrum."""
    _, root = _truth(spectrum)
    d = len(spectrum)
    g = torch.Generator().manual_seed(2)
    xs, es, pooled = [], [], []
    for _ in range(draws):
        D = _factor(torch.randn(m, d, generator=g, dtype=torch.float64) @ root.T)
        M = _factor(torch.randn(m, d, generator=g, dtype=torch.float64) @ root.T)
        sb, st_ = same_minus_cross(D, M) / 4, same_minus_cross(M, D) / 4  # order weight m / 2m
        xs.append(sb + st_)
        es.append(sb - st_)
        pooled.append(torch.linalg.eigvalsh((D + M) / 2))
    X, E, P = torch.stack(xs), torch.stack(es), torch.stack(pooled)
    return {"e2": float(E.square().sum(1).mean()), "var_x": float(X.var(0).sum()), "var_pooled": float(P.var(0).sum())}


_EXPONENTIAL = [1.0 / 10 ** (2 * k / 11) for k in range(12)]
_POWER_LAW = [1.0 / (k + 1) ** 2 for k in range(12)]


@pytest.mark.parametrize("spectrum", [_EXPONENTIAL, _POWER_LAW], ids=["exponential", "power-law"])
def test_the_orders_difference_measures_the_single_batch_noise_not_the_corrections(spectrum):
    """To first order in the half difference ``Δ = (F̂_B - F̂_B̃) / 2`` (pooled eigenbasis), each
    order's shift is ``±Δ_ii / 2 + g_i`` with ``g_i`` second order, so ``e_i = Δ_ii``: the same
    variance as the pooled eigenvalue's first-order noise ``(E_P)_ii`` (``Δ`` and ``E_P`` have the
    same covariance for independent halves), while ``x_i = 2 g_i`` has no first-order part.
    Distinct eigenvalues, m ≥ 4 d: ``E Σ e²`` agrees with ``Σ Var λ_P`` within a factor 2 (the
    second-order terms and the Monte-Carlo error of 800 draws, about 7 % per variance, stay far
    inside it), and its ratio to ``Σ Var x`` (first against second order) grows with m: more
    than doubled from m = 48 to 200, where it exceeds 5."""
    small, large = (_order_statistics(spectrum, m, 800) for m in (48, 200))
    for s in (small, large):
        assert 0.5 < s["e2"] / s["var_pooled"] < 2.0
    assert large["e2"] / large["var_x"] > max(5.0, 2 * small["e2"] / small["var_x"])


def _draws(F_root: torch.Tensor, sizes: tuple[int, int], draws: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    d = F_root.shape[0]
    for _ in range(draws):
        XB = torch.randn(sizes[0], d, generator=g, dtype=torch.float64) @ F_root.T
        XM = torch.randn(sizes[1], d, generator=g, dtype=torch.float64) @ F_root.T
        yield _factor(XB), _factor(XM)


def test_stein_keeps_a_large_true_correction_that_shrunk_discards():
    """Spiked spectrum (50, 20, 10, 27 × 0.1), 64 + 64 samples: the bulk's eigenvalues carry a bias
    far above the correction's noise. The ``"shrunk"`` weight falls to ~0 there (it measures the
    single batch's first-order noise, not the correction's), ``"stein"`` keeps most of it, and its
    summed squared relative error against the target ``uᵀFu`` (the same pooled basis for both) is
    smaller in the paired mean by more than 4 standard errors of the paired differences."""
    d = 30
    F, root = _truth([50.0, 20.0, 10.0] + [0.1] * (d - 3))
    diffs, kept = [], {"shrunk": [], "stein": []}
    for D, M in _draws(root, (64, 64), 200, 3):
        err = {}
        for rule in ("shrunk", "stein"):
            U, lam, rec = corrected_factor(D, M, 64, 64, rule=rule)
            target = ((F @ U) * U).sum(0)
            err[rule] = float((((lam - target) / target) ** 2).sum())
            kept[rule].append(rec.kept)
        diffs.append(err["shrunk"] - err["stein"])
    diff = torch.tensor(diffs)
    assert diff.mean() > 4 * diff.std() / math.sqrt(len(diff)), (diff.mean(), diff.std())
    assert sum(kept["stein"]) / 200 > 0.5 > 0.2 > sum(kept["shrunk"]) / 200


@pytest.mark.parametrize("sizes", [(16, 112), (64, 64)])
def test_correction_variance_is_the_variance_of_the_correction_where_its_derivation_holds(sizes):
    """The derivation's setting, exactly: the pooled factor ``diag(4, 2, 1, 0.5)`` and a small
    Gaussian difference ``Δ`` (``Δ_ij ~ ε √(λ_i λ_j) N(0, 1)``, ``ε = 1e-3``), B's factor
    ``F_P + aΔ`` and B̃'s ``F_P - bΔ``. Over 4,000 seeded draws the mean estimated variance of the
    correction, summed over the eigenvalues, equals the variance of the actual corrections (exact
    gaps) within 4 standard errors of that sample variance (``√((μ₄ - σ⁴)/n)``, from the draws) plus
    the neglected higher orders (relative ``O(ε)``). Unequal batches: the first-order term carries the
    variance (dropping it fails); equal ones: it is zero."""
    mb, mm = sizes
    n = mb + mm
    a, b = mm / n, mb / n
    L = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    FP, sigma = torch.diag(L), (L[:, None] * L[None, :]).sqrt() * 1e-3
    g = torch.Generator().manual_seed(6)
    kb, km = order_weights(mb, mm, None)
    xs, Vs, firsts = [], [], []
    for _ in range(4000):
        upper = torch.randn(4, 4, generator=g, dtype=torch.float64).triu()
        delta = (upper + upper.triu(1).T) * sigma
        D, M = FP + a * delta, FP - b * delta
        xs.append(kb * same_minus_cross(D, M) + km * same_minus_cross(M, D))
        Vs.append(correction_variance(delta, L, mb, mm, None, 0.0))
        firsts.append(((mb - mm) / n / 2) ** 2 * delta.diagonal().square())
    X = torch.stack(xs)
    centred = (X - X.mean(0)).square()
    spread = centred.mean(0)  # per eigenvalue
    se = ((centred.square().mean(0) - spread.square()) / len(X)).sqrt()
    V, first = torch.stack(Vs).mean(0), torch.stack(firsts).mean(0)
    assert ((V - spread).abs() <= 4 * se + 1e-2 * spread).all(), (V, spread, se)
    if mb != mm:
        assert ((V - first - spread).abs() > 4 * se).any()
    else:
        assert first.abs().max() == 0.0


def test_stein_leaves_a_rank_deficient_factor_s_null_space_empty_with_unequal_batches():
    """A rank-6 factor of dimension 12, B of 4 samples (below the rank), B̃ of 12 (spans the range):
    the pooled null space is the factor's own. The ``"corrected"`` rule fills it from B's null run
    (which holds range directions B missed); ``"stein"`` takes the smaller of the two orders' null
    gaps, B̃'s, which is zero: the null space stays empty, to round-off."""
    F, root = _truth([1.0, 0.8, 0.6, 0.4, 0.2, 0.1] + [0.0] * 6)
    for D, M in _draws(root, (4, 12), 5, 4):
        _, lam_c, _ = corrected_factor(D, M, 4, 12, rule="corrected")
        _, lam_s, _ = corrected_factor(D, M, 4, 12, rule="stein")
        scale = float(torch.linalg.matrix_norm(D + M))
        assert lam_c[:6].min() > 1e-3 * scale
        assert lam_s[:6].abs().max() < 1e3 * 12 * EPS64 * scale
        assert lam_s[6:].min() > 0


@settings(max_examples=50, deadline=None)
@given(k=st.integers(1, 12), seed=st.integers(0, 10_000), scale=st.floats(1e-6, 1e6))
def test_stein_weight_is_a_scale_free_share(k, seed, scale):
    """``w ∈ [0, 1]``; scaling the factor by ``s`` (``x, L`` by ``s``, ``V`` by ``s²``) leaves it;
    no noise keeps everything; noise as large as the squared correction keeps nothing."""
    g = torch.Generator().manual_seed(seed)
    x, L = torch.randn(k, generator=g, dtype=torch.float64), torch.rand(k, generator=g, dtype=torch.float64) + 0.1
    V = torch.rand(k, generator=g, dtype=torch.float64) * x.square()
    w = stein_weight(x, V, L)
    assert 0.0 <= w <= 1.0
    assert w == pytest.approx(stein_weight(scale * x, scale**2 * V, scale * L), abs=16 * k * EPS64)
    assert stein_weight(x, torch.zeros_like(V), L) == 1.0
    assert stein_weight(x, x.square(), L) == 0.0

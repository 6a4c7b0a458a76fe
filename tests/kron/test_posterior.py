"""K-FAC input factors of a batch narrower than the layer, decomposed through
their rows' Gram matrix with the null space kept implicit, equal the dense route.

Equalities are identities in exact arithmetic; the float64 tolerance 1e-10 sits four orders above the ``d · eps64 · κ`` round-off of these tiny problems
(κ ≤ 1e2: well-conditioned Gaussian rows, δ ≥ 1e-3 relative to ``‖sH‖``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from laplace.utils.matrix import KronDecomposed
from torch import nn

from laplace_debiased.curvature.kfac import factor_rows_of, group_kfac_sums
from laplace_debiased.curvature.completion import isotropic_factor
from laplace_debiased.curvature.linalg import (
    RowFactor,
    debiased_factor,
    degenerate_groups,
    gram_eigenpairs,
    lowrank_debiased_factor,
    roundoff_tolerance,
    row_rank,
)
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.kron.posterior import ImplicitKronDecomposed, complete_basis
from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.posterior.kron_structure import KronStructure
from laplace_debiased.kron.laplace import DebiasedKronLaplace, DebiasedKronLLLaplace
from _models import loader, toy_data

F64 = dict(rtol=1e-10, atol=1e-12)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _dense(Q: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``Q diag(λ[:r]) Qᵀ + λ[r] (I - QQᵀ)`` (the last term only with ``r + 1`` eigenvalues)."""
    Q, lam, r = Q.double(), lam.double(), Q.shape[1]
    M = (Q * lam[:r]) @ Q.T
    if len(lam) > r:
        M = M + lam[r] * (torch.eye(len(Q), dtype=torch.float64) - Q @ Q.T)
    return M


def _isotropic_dense(G: torch.Tensor, C: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference of ``null_space="isotropic"`` (widequal's definition): eigenvectors of ``G``,
    every degenerate group of its eigenvalues (dense tolerance) given the mean Rayleigh quotient
    of ``C`` over the group."""
    L, U = torch.linalg.eigh(G)
    q = ((C @ U) * U).sum(0)
    for g in degenerate_groups(L, roundoff_tolerance(G.to(dtype))):
        q[g] = q[g].mean()
    return (U * q) @ U.T


def _rows(n: int, d: int, seed: int, duplicate: bool = False) -> torch.Tensor:
    X = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if duplicate and n > 1:  # rank n - 1
        X[-1] = X[0]
    return X


# ---------------------------------------------------------------- the factor (pure maths)
def test_gram_eigenpairs_are_the_nonzero_eigenpairs_of_the_factor():
    X = _rows(6, 20, 0, duplicate=True)
    L, E = gram_eigenpairs(X)
    assert L.shape == (5,)  # rank 5: the duplicate row adds nothing
    torch.testing.assert_close(E.T @ E, torch.eye(5, dtype=torch.float64), **F64)
    torch.testing.assert_close(_dense(E, L), X.T @ X, **F64)


@SETTINGS
@given(
    n=st.integers(1, 12),
    m=st.integers(1, 12),
    extra=st.integers(1, 20),
    seed=st.integers(0, 2**16),
    duplicate=st.booleans(),
)
def test_lowrank_factor_equals_dense_route(n, m, extra, seed, duplicate):
    """``Q diag(μ) Qᵀ`` equals :func:`debiased_factor`'s ``U diag(Uᵀ C U) Uᵀ`` (including B's null
    space compressed onto B̃) whenever ``n + m < d``; ``Q`` orthonormal."""
    d = n + m + extra
    Xd, Xm = _rows(n, d, seed, duplicate), _rows(m, d, seed + 1)
    Q, mu = lowrank_debiased_factor(Xd, Xm, torch.float64)
    U, lam = debiased_factor(Xd.T @ Xd, Xm.T @ Xm)
    assert Q.shape[1] <= n + m < d and len(mu) == Q.shape[1] + 1 and mu[-1] == 0
    torch.testing.assert_close(_dense(Q, mu), _dense(U, lam), **F64)
    torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[1], dtype=torch.float64), **F64)
    Q, mu = lowrank_debiased_factor(Xd, Xm, torch.float64, null_space="isotropic")
    assert Q.shape[1] <= n and len(mu) == Q.shape[1] + 1  # B's directions only, ν on the rest
    torch.testing.assert_close(_dense(Q, mu), _isotropic_dense(Xd.T @ Xd, Xm.T @ Xm, torch.float64), **F64)


def test_lowrank_factor_rotates_tied_eigenvalues_like_the_dense_route():
    """B's factor with a repeated nonzero eigenvalue (orthogonal rows of equal norm): the tied
    eigenspace is rotated to B̃'s compression, as :func:`aligned_eigenbasis` does."""
    d = 12
    Xd = 2.0 * torch.eye(d, dtype=torch.float64)[:3]
    Xm = _rows(4, d, 3)
    Q, mu = lowrank_debiased_factor(Xd, Xm, torch.float64)
    U, lam = debiased_factor(Xd.T @ Xd, Xm.T @ Xm)
    torch.testing.assert_close(_dense(Q, mu), _dense(U, lam), **F64)
    Q, mu = lowrank_debiased_factor(Xd, Xm, torch.float64, null_space="isotropic")
    torch.testing.assert_close(_dense(Q, mu), _isotropic_dense(Xd.T @ Xd, Xm.T @ Xm, torch.float64), **F64)


@SETTINGS
@given(n=st.integers(1, 12), extra=st.integers(1, 20), wide=st.integers(-5, 20), seed=st.integers(0, 2**16),
       duplicate=st.booleans())
def test_a_factor_held_as_rows_beside_a_dense_one_equals_dense_route(n, extra, wide, seed, duplicate):
    """B's rows (``n < d``) beside B̃'s dense factor (B̃ from ``d + wide`` rows, rank-deficient below ``d``): the
    same factor as the dense route, aligned and isotropic, with ``Q`` orthonormal and nothing of B formed; and
    the reverse, B dense beside B̃'s rows (``RowFactor``), read through them."""
    d = n + extra
    Xd, Xm = _rows(n, d, seed, duplicate), _rows(max(d + wide, 1), d, seed + 1)
    G, C = Xd.T @ Xd, Xm.T @ Xm
    tol = dict(rtol=1e-10, atol=1e-12 * float(C.abs().max()))
    Q, mu = lowrank_debiased_factor(Xd, None, torch.float64, magnitude=C)
    U, lam = debiased_factor(G, C)
    torch.testing.assert_close(_dense(Q, mu), _dense(U, lam), **tol)
    torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[1], dtype=torch.float64), **F64)
    Q, mu = lowrank_debiased_factor(Xd, None, torch.float64, null_space="isotropic", magnitude=C)
    assert Q.shape[1] <= n
    torch.testing.assert_close(_dense(Q, mu), _dense(*isotropic_factor(G, C)), **tol)
    for rule in (debiased_factor, isotropic_factor):  # the reverse: B̃ narrow, read through its rows
        torch.testing.assert_close(_dense(*rule(C, RowFactor(Xd))), _dense(*rule(C, G)), **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_row_rank_counts_the_factor_eigenvalues_above_round_off(dtype):
    X = _rows(9, 30, 4, duplicate=True)
    X[1] = X[3] + 1e-5 * X[1]  # a direction below float32's resolution of F, above float64's
    F = (X.T @ X).to(dtype)
    dense = int((torch.linalg.eigvalsh(F.double()) > roundoff_tolerance(F)).sum())
    assert row_rank(X, dtype) == dense == (7 if dtype == torch.float32 else 8)


def test_lowrank_factor_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="same d"):
        lowrank_debiased_factor(torch.ones(2, 5), torch.ones(2, 6), torch.float64)
    with pytest.raises(ValueError, match="'aligned' or 'isotropic'"):
        lowrank_debiased_factor(torch.ones(2, 5), torch.ones(2, 5), torch.float64, null_space="zero")


# ---------------------------------------------------------------- the decomposed posterior
def _implicit(seed: int, damping: bool) -> ImplicitKronDecomposed:
    """Blocks: [G (3x3), A (9, r=4)], a bias [G], and [G (2x2), A (5x5) square]."""
    g = torch.Generator().manual_seed(seed)

    def eig(d, r):
        Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q[:, :r]
        return Q, torch.rand(r, generator=g, dtype=torch.float64) * 3

    (QG, lG), (QA, lA), (Qb, lb), (Q1, l1), (Q2, l2) = eig(3, 3), eig(9, 4), eig(3, 3), eig(2, 2), eig(5, 5)
    return ImplicitKronDecomposed([[QG, QA], [Qb], [Q1, Q2]], [[lG, lA], [lb], [l1, l2]], damping=damping)


@pytest.mark.parametrize("damping", [False, True])
@pytest.mark.parametrize("delta", [1e-3, 1.0, [0.5, 2.0, 1e-2]])
def test_implicit_decomposed_equals_completed_basis(damping, delta):
    """logdet, bmm (e = 1, -1/2, -1), inv_square_form and diag with the null space implicit equal
    laplace-torch's ``KronDecomposed`` on the completed bases (null eigenvalues 0)."""
    H = _implicit(0, damping)
    P = H * 1.7 + torch.as_tensor(delta, dtype=torch.float64)
    ref = P.completed()
    assert type(ref) is KronDecomposed and ref.eigenvectors[0][1].shape == (9, 9)
    W = torch.randn(4, 2, 27 + 3 + 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(P.logdet(), ref.logdet(), **F64)
    for e in (1.0, -0.5, -1.0):
        torch.testing.assert_close(P.bmm(W, e), ref.bmm(W, e), **F64)
        torch.testing.assert_close(P.diag(e), ref.diag(e), **F64)
    torch.testing.assert_close(P.inv_square_form(W), ref.inv_square_form(W), **F64)
    cov = P.to_matrix(-1)  # entries up to 1/δ: compare relative to the largest
    torch.testing.assert_close(cov, torch.linalg.inv(ref.to_matrix(1)), rtol=1e-10, atol=1e-10 * float(cov.abs().max()))


@SETTINGS
@given(
    d1=st.integers(1, 6), r1=st.integers(0, 6), d2=st.integers(1, 8), r2=st.integers(0, 8),
    log_delta=st.floats(-4, 2), damping=st.booleans(), seed=st.integers(0, 2**16), null=st.booleans(),
)
def test_implicit_block_properties(d1, r1, d2, r2, log_delta, damping, seed, null):
    """Any block with implicit factors on either side (``r ≤ d``, ``r = 0`` included, null
    eigenvalue 0 or not): the
    posterior covariance and log determinant equal the completed bases', and ``bmm(·, -1)``
    inverts ``bmm(·, 1)``."""
    g = torch.Generator().manual_seed(seed)
    r1, r2 = min(r1, d1), min(r2, d2)
    Qs = [torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q[:, :r] for d, r in ((d1, r1), (d2, r2))]
    # null: a nonzero eigenvalue ν on each complement (r + 1 eigenvalues), else ν = 0 implicit
    ls = [torch.rand(r + (null and r < d), generator=g, dtype=torch.float64) * 2 for d, r in ((d1, r1), (d2, r2))]
    P = ImplicitKronDecomposed([Qs], [ls], damping=damping) + torch.tensor(10.0**log_delta, dtype=torch.float64)
    ref = P.completed()
    W = torch.randn(3, 2, d1 * d2, generator=g, dtype=torch.float64)
    scale = float(ref.to_matrix(-1).abs().max())
    torch.testing.assert_close(P.bmm(W, -1), ref.bmm(W, -1), rtol=1e-10, atol=1e-10 * scale * float(W.abs().max()))
    torch.testing.assert_close(P.logdet(), ref.logdet(), **F64)
    torch.testing.assert_close(P.bmm(P.bmm(W, 1), -1), W, rtol=1e-10, atol=1e-10 * float(W.abs().max()))


@pytest.mark.parametrize("damping", [False, True])
def test_grid_structure_factored_and_dense_jacobians(damping):
    """The implicit grid structure's covariances and variances equal ``KronStructure`` on the
    completed bases, for a factored Jacobian ``g ⊗ a`` and a dense one on the implicit block."""
    H = _implicit(2, damping)
    g = torch.Generator().manual_seed(3)
    n, C = 5, 3

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    jacs = [LayerJacobian(dense=r(n, C, 27)), LayerJacobian(dense=r(n, C, 3)), LayerJacobian(dense=r(n, C, 10))]
    factored = [LayerJacobian(g=r(n, C, 3), a=r(n, 9)), *jacs[1:]]
    implicit, ref = H.grid_structure(0.8, [27, 3, 10]), KronStructure(H.completed(), 0.8, [27, 3, 10])
    grid = [1e-4, 1.0, [1e-2, 3.0, 0.1]]
    for js in (jacs, factored):
        a, b = implicit.rotate(js), ref.rotate(js)
        torch.testing.assert_close(implicit.covariances(a, grid), ref.covariances(b, grid), **F64)
        torch.testing.assert_close(implicit.variances(a, grid, project=True), ref.variances(b, grid, project=True), **F64)


def test_complete_basis_is_orthonormal_and_keeps_the_columns():
    Q = torch.linalg.qr(torch.randn(7, 3, dtype=torch.float64)).Q
    full, lam = complete_basis(Q, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(full.T @ full, torch.eye(7, dtype=torch.float64), **F64)
    torch.testing.assert_close(full[:, :3], Q)
    assert lam.tolist() == [1, 1, 1, 0, 0, 0, 0]


# ---------------------------------------------------------------- fits against the dense route
def _wide_mlp(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 4)).to(dtype)


def _pair(likelihood="classification", dtype=torch.float64, b=8, cls=DebiasedKronLaplace, **options):
    """A debiased fit at 2 × b (wide factors implicit) and the same object decomposed densely."""
    data = toy_data(2 * b, (40,), 4, likelihood, seed=1)
    data = type(data)(*(t.to(dtype) if t.is_floating_point() else t for t in data.tensors))
    la = cls(_wide_mlp(dtype), likelihood, **{"estimator": "paper", **options})
    la.fit(loader(data, b))
    ref = copy.copy(la)
    ref._factor_rows = None
    ref._decompose()
    return la, ref


def _components(la):
    return getattr(la.H, "components", (la.H,))


def test_kept_input_rows_give_the_factor():
    la, _ = _pair(b=8)
    (rows_B, _), kfacs = la._factor_rows, la.H_facs.kfacs
    torch.testing.assert_close(rows_B[0][1].T @ rows_B[0][1], kfacs[0][1], **F64)
    torch.testing.assert_close(rows_B[2][1].T @ rows_B[2][1], kfacs[2][1], **F64)


@pytest.mark.parametrize(
    "likelihood, kw",
    [("classification", {}), ("classification", {"damping": True}), ("classification", {"cross_fit": True}),
     ("classification", {"null_space": "aligned"}), ("regression", {}),
     ("classification", {"estimator": "corrected"}), ("regression", {"estimator": "corrected"})],
)
def test_fit_posterior_and_predictive_equal_dense_route(likelihood, kw):
    """float64: posterior covariance, log determinant, marginal likelihood, laplace-torch's GLM
    predictive and the grid predictive (probit, projected probit, bridge covariances) equal the
    dense route to 1e-10, with 40- and 30-dimensional input factors of rank ≤ 16. The implicit
    factor keeps B's 8 directions (the paper's estimate, "isotropic": one value on the rest), those
    plus the 8 of B̃'s compression onto B's null space ("aligned"), or the 16 of B ∪ B̃ (the
    corrected estimate)."""
    la, ref = _pair(likelihood, **kw)
    # the corrected estimate keeps the 16 directions of B ∪ B̃ (its pooled eigenvectors)
    r = 16 if kw.get("null_space") == "aligned" or kw.get("estimator") == "corrected" else 8
    QG, QA = _components(la)[0].eigenvectors[0]
    assert tuple(QA.shape) == (40, r)
    # the 30-wide output factor: through B's 8 × 3 rows for the isotropic paper estimate (classification)
    assert QG.shape[0] == 30 and QG.shape[1] <= (24 if likelihood == "classification" and r == 8 else 30)
    assert len(_components(la)[0].eigenvalues[0][1]) == r + 1
    assert all(Q.shape[0] == Q.shape[1] for c in _components(ref) for Qs in c.eigenvectors for Q in Qs)
    for obj in (la, ref):
        obj.prior_precision = 1e-2
    cov = ref.posterior_precision.to_matrix(-1)
    scale = dict(rtol=1e-10, atol=1e-10 * float(cov.abs().max()))
    torch.testing.assert_close(la.posterior_precision.to_matrix(-1), cov, **scale)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), **F64)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(la._glm_predictive_distribution(x), ref._glm_predictive_distribution(x), **F64)
    if likelihood == "classification":
        links = ("probit_projected", "probit", "bridge")
        grid = [1e-4, 1e-2, 1.0]
        ours, theirs = GridPredictive(la).grid(x, grid, links=links), GridPredictive(ref).grid(x, grid, links=links)
        for link in links:
            torch.testing.assert_close(ours[link], theirs[link], **F64)


def test_fit_float32_predictive_equals_dense_route_to_round_off():
    """float32 model: the two routes differ by the round-off of the float32 factor sums, a
    relative perturbation of ``H`` of at most ``n · eps32`` (n = 16 summed rows), which moves the
    variances of ``(sH + δ)⁻¹`` by at most ``n · eps32 · s‖H‖/δ`` relative (first order); the
    probit probabilities move by less than the variances."""
    la, ref = _pair(dtype=torch.float32)
    delta = 1.0
    for obj in (la, ref):
        obj.prior_precision = delta
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    H_norm = max(float(l.max()) for ls in ref.H.eigenvalues for l in ls) ** 2
    tol = 16 * torch.finfo(torch.float32).eps * max(H_norm / delta, 1.0)
    (f1, v1), (f2, v2) = la._glm_predictive_distribution(x), ref._glm_predictive_distribution(x)
    torch.testing.assert_close(v1, v2, rtol=tol, atol=tol * float(v2.abs().max()))
    p1 = la(x, pred_type="glm", link_approx="probit")
    p2 = ref(x, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(p1, p2, rtol=tol, atol=tol)


def test_dense_route_where_the_rows_do_not_help():
    """B with at least as many rows as the factor's dimension (40 ≥ 40, 40 ≥ 30), and an online
    second fit (its factors are averages, no rows): square bases, as before."""
    la, _ = _pair(b=40)
    assert all(Q.shape[0] == Q.shape[1] for Qs in la.H.eigenvectors for Q in Qs)
    data = toy_data(16, (40,), 4, "classification", seed=9)
    la2, _ = _pair(b=8)
    la2.fit(loader(data, 8), override=False)
    assert la2._factor_rows is None
    assert all(Q.shape[0] == Q.shape[1] for Qs in la2.H.eigenvectors for Q in Qs)


def test_group_kfac_sums_drops_the_rows_of_a_group_once_it_has_as_many_as_inputs():
    model = _wide_mlp()
    X = torch.randn(35, 40, dtype=torch.float64)
    y = torch.randint(0, 4, (35,))
    sums = [group_kfac_sums(
        model, [model[0], model[2]], X, y, [(0, 5, 0), (5, 35, 1)], 2,
        likelihood="classification", lossfunc=nn.CrossEntropyLoss(reduction="sum"), factor=1.0, keep_rows=keep,
    ) for keep in (True, False)]
    # group 1's 30 rows ≥ 30 inputs of the second layer: its sum; group 0's 5 rows stay rows beside it
    assert sums[0].input[1] is None
    torch.testing.assert_close(sums[0].input_rows[1][1], sums[1].input[1][1], rtol=0, atol=0)
    narrow = factor_rows_of(sums[0].input_rows[1][0])
    assert tuple(narrow.shape) == (5, 30)
    torch.testing.assert_close(narrow.T @ narrow, sums[1].input[1][0], **F64)
    assert sums[0].input[0] is None  # 5 and 30 rows < 40 inputs: rows, no sum
    first = factor_rows_of(sums[0].input_rows[0][1])
    torch.testing.assert_close(first.T @ first, sums[1].input[0][1], **F64)


def test_state_dict_round_trip_keeps_the_implicit_factors():
    la, _ = _pair(cross_fit=True)
    new = DebiasedKronLaplace(la.model, "classification", estimator="paper", cross_fit=True)
    new.load_state_dict(la.state_dict())
    for a, b in zip(_components(new), _components(la)):
        assert [[tuple(Q.shape) for Q in Qs] for Qs in a.eigenvectors] == [
            [tuple(Q.shape) for Q in Qs] for Qs in b.eigenvectors
        ]
    torch.testing.assert_close(new.posterior_precision.to_matrix(-1), la.posterior_precision.to_matrix(-1), **F64)


def test_last_layer_fit_equals_dense_route():
    """Last layer ``Linear(30, 4)`` at 2 × 8: its 30-dimensional input factor is implicit (B's 8
    directions, the isotropic default)."""
    la, ref = _pair(cls=DebiasedKronLLLaplace)
    assert tuple(la.H.eigenvectors[0][1].shape) == (30, 8)
    for obj in (la, ref):
        obj.prior_precision = 1e-2
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(la._glm_predictive_distribution(x), ref._glm_predictive_distribution(x), **F64)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), **F64)


@pytest.mark.parametrize("method", ["marglik", "gridsearch"])
def test_prior_tuning_equals_dense_route(method):
    """laplace-torch's prior tuning (marginal likelihood by gradient steps on log δ, or the grid
    search on a validation loader through the grid predictive) picks the same δ."""
    la, ref = _pair()
    val = loader(toy_data(12, (40,), 4, "classification", seed=3), 6)
    kw = {"n_steps": 30} if method == "marglik" else {"val_loader": val, "grid_size": 9}
    for obj in (la, ref):
        obj.optimize_prior_precision(pred_type="glm", method=method, link_approx="probit", **kw)
    torch.testing.assert_close(la.prior_precision, ref.prior_precision, **F64)


# ---------------------------------------------------------------- output factors through their rows
def _wider_pair(estimator: str, dtype=torch.float64, b: int = 8, **fit_kw):
    """A fit of ``Linear(12, 60) + Tanh + Linear(60, 3)`` at 2 × b: at b = 8 the hidden layer's
    output factor (60 wide, 2 × 8 × 2 = 32 rows) and its bias factor go through their rows, as does
    the output layer's input factor (60 wide, 16 rows); and the same object decomposed densely."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 60), nn.Tanh(), nn.Linear(60, 3)).to(dtype)
    data = toy_data(2 * b, (12,), 3, "classification", seed=1)
    data = type(data)(*(t.to(dtype) if t.is_floating_point() else t for t in data.tensors))
    la = DebiasedKronLaplace(model, "classification", estimator=estimator, **fit_kw)
    la.fit(loader(data, b))
    ref = copy.copy(la)
    ref._factor_rows = None
    ref._decompose()
    return la, ref


def test_kept_output_rows_give_the_factor():
    la, _ = _wider_pair("paper")
    for rows, kron in zip(la._factor_rows, (la.H_facs, la.H_facs_magnitude)):
        for k in (0, 1, 2):  # hidden weight [G, A] (G through rows), hidden bias [G], output weight [G, A]
            for X, F in zip(rows[k], kron.kfacs[k]):
                if X is not None:
                    torch.testing.assert_close(X.T @ X, F, **F64)
        assert rows[0][0] is not None and rows[1][0] is not None and rows[2][0] is None


@pytest.mark.parametrize("estimator, kw", [("paper", {}), ("paper", {"null_space": "aligned"}),
                                           ("corrected", {}), ("shrunk", {})])
def test_output_factors_through_rows_equal_dense_route(estimator, kw):
    """Every estimate: the hidden layer's 60-wide output factor (weight and bias blocks) is stored as
    eigenvectors ``(60, r)`` and a completion, and the posterior covariance, log determinant and
    GLM predictive equal the dense route's to 1e-10 (float64)."""
    la, ref = _wider_pair(estimator, **kw)
    QG, Qb = la.H.eigenvectors[0][0], la.H.eigenvectors[1][0]
    assert QG.shape[0] == 60 and QG.shape[1] < 60 and Qb.shape[1] < 60
    assert all(Q.shape[0] == Q.shape[1] for Qs in ref.H.eigenvectors for Q in Qs)
    for obj in (la, ref):
        obj.prior_precision = 1e-2
    cov = ref.posterior_precision.to_matrix(-1)
    torch.testing.assert_close(la.posterior_precision.to_matrix(-1), cov, rtol=1e-10, atol=1e-10 * float(cov.abs().max()))
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), **F64)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(la._glm_predictive_distribution(x), ref._glm_predictive_distribution(x), **F64)
    grid = [1e-4, 1e-2, 1.0]
    links = ("probit_projected", "bridge")
    ours, theirs = GridPredictive(la).grid(x, grid, links=links), GridPredictive(ref).grid(x, grid, links=links)
    for link in links:
        torch.testing.assert_close(ours[link], theirs[link], **F64)


@pytest.mark.parametrize("damping", [False, True])
@pytest.mark.parametrize("null", [False, True])
def test_grid_structure_with_both_sides_implicit(damping, null):
    """Output-side, input-side and single factors all ``(d, r)``, ``r < d`` (completion ``ν`` or 0):
    covariances and (projected) variances of factored, dense and sums-over-positions Jacobians
    equal ``KronStructure`` on the completed bases; ``C = 4`` classes against an output side of
    ``d = 6`` (four residual columns) and of ``d = 3`` (three)."""
    g = torch.Generator().manual_seed(4)

    def eig(d, r):
        Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q[:, :r]
        return Q, torch.rand(r + (null and r < d), generator=g, dtype=torch.float64) * 3

    blocks = [(eig(6, 2), eig(9, 4)), (eig(6, 3),), (eig(3, 1), eig(5, 2))]
    H = ImplicitKronDecomposed([[b[0] for b in bl] for bl in blocks], [[b[1] for b in bl] for bl in blocks],
                               damping=damping)
    numels = [54, 6, 15]
    n, C, T = 5, 4, 7

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    positions = LayerJacobian(positions=(r(n, C, 6, T), r(n, 9, T)))
    kinds = [
        [LayerJacobian(g=r(n, C, 6), a=r(n, 9)), LayerJacobian(dense=r(n, C, 6)), LayerJacobian(g=r(n, C, 3), a=r(n, 5))],
        [LayerJacobian(dense=positions.full()), LayerJacobian(dense=r(1, C, 6)), LayerJacobian(dense=r(n, C, 15))],
        [positions, LayerJacobian(dense=r(n, C, 6)), LayerJacobian(g=r(1, C, 3), a=r(n, 5))],
    ]
    implicit, ref = H.grid_structure(0.8, numels), KronStructure(H.completed(), 0.8, numels)
    assert type(implicit).__name__ == "ImplicitKronStructure"
    grid = [1e-4, 1.0, [1e-2, 3.0, 0.1]]
    for js in kinds:
        a, b = implicit.rotate(js), ref.rotate(js)
        torch.testing.assert_close(implicit.covariances(a, grid), ref.covariances(b, grid), **F64)
        torch.testing.assert_close(implicit.variances(a, grid), ref.variances(b, grid), **F64)
        torch.testing.assert_close(implicit.variances(a, grid, project=True), ref.variances(b, grid, project=True), **F64)


@pytest.mark.parametrize("estimator", ["paper", "corrected", "shrunk"])
def test_batches_each_narrower_than_the_factor_but_not_together(estimator):
    """2 × 16 samples: the hidden output factor has 32 rows per batch (2 per sample), 64 together, against 60
    columns. The paper's isotropic estimate goes through B's rows (eigenvectors ``(60, r)``); the
    corrected ones decompose the pooled factor densely and take each order's gaps from the Gram
    matrices. Posterior covariance and GLM predictive equal the dense route's (float64)."""
    la, ref = _wider_pair(estimator, b=16)
    QG = la.H.eigenvectors[0][0]
    assert QG.shape[1] < 60 if estimator == "paper" else QG.shape == (60, 60)
    for obj in (la, ref):
        obj.prior_precision = 1e-2
    cov = ref.posterior_precision.to_matrix(-1)
    torch.testing.assert_close(la.posterior_precision.to_matrix(-1), cov, rtol=1e-10, atol=1e-10 * float(cov.abs().max()))
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(la._glm_predictive_distribution(x), ref._glm_predictive_distribution(x), **F64)

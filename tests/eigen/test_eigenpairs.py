"""Marglik of debiased_full / debiased_lowrank from the curvature's eigenpairs, against the dense
formula on tiny float64 models, and against stock FullLaplace when B̃ = B."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from laplace import FullLaplace, Laplace
from laplace.curvature import BackPackGGN
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  registers the structures
from laplace_debiased.eigen.marglik import eigen_functional_covariance, eigen_log_det
from laplace_debiased.eigen.eigenpairs import (
    current_eigenpairs,
    eigenpairs_from_state,
    eigenpairs_state,
    log_det_prior,
)
from tests.curvature.test_eigen import make_batch, tiny_mlp

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps
KEYS = [("all", "debiased_full"), ("last_layer", "debiased_full"), ("all", "debiased_lowrank"),
        ("last_layer", "debiased_lowrank")]


def fitted(key, likelihood="classification", batch_size=10, n=40, **kwargs):
    X, y = make_batch(n, likelihood, 0)
    loader = DataLoader(TensorDataset(X, y), batch_size=batch_size)
    if key[1] == "debiased_lowrank":
        kwargs.setdefault("rank", 6)
    la = Laplace(tiny_mlp(), likelihood, subset_of_weights=key[0], hessian_structure=key[1], **kwargs)
    la.fit(loader)
    return la


def dense_H(la) -> torch.Tensor:
    if isinstance(la.H, tuple):
        U, lam = la.H
        return (U * lam) @ U.T
    return la.H


def dense_marglik(la, prior: torch.Tensor, sigma: torch.Tensor | None = None) -> torch.Tensor:
    """laplace-torch's formula with a dense posterior precision and its LU log-determinant."""
    if sigma is not None:
        la.sigma_noise = sigma
    la.prior_precision = prior
    P = la._H_factor * dense_H(la) + torch.diag(la.prior_precision_diag)
    log_det_ratio = torch.logdet(P) - la.prior_precision_diag.log().sum()
    return la.log_likelihood - 0.5 * (log_det_ratio + la.scatter)


def priors(la) -> dict[str, torch.Tensor]:
    out = {"scalar": torch.tensor([0.37], dtype=torch.float64),
           "diag": torch.linspace(0.05, 3.0, la.n_params, dtype=torch.float64)}
    if la.n_layers and not hasattr(la.model, "last_layer"):
        out["layerwise"] = torch.linspace(0.2, 2.0, la.n_layers, dtype=torch.float64)
    return out


@pytest.mark.parametrize("key", KEYS)
def test_eigenpairs_reconstruct_H(key):
    la = fitted(key)
    Q, h = la.curvature_eigenpairs()
    assert Q.dtype == h.dtype == torch.float64 and (h >= 0).all()
    torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[1], dtype=torch.float64), atol=50 * EPS64, rtol=0)
    H = dense_H(la)
    torch.testing.assert_close((Q * h) @ Q.T, H, atol=100 * EPS64 * H.abs().max(), rtol=0)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("key", KEYS)
def test_marglik_and_gradients_equal_dense_formula(key, likelihood):
    """Value and gradient in the (log) prior precision, and in σ for regression, for every
    prior structure the class supports."""
    noise = {"sigma_noise": 0.8} if likelihood == "regression" else {"temperature": 0.7}
    la = fitted(key, likelihood, **noise)
    for name, prior in priors(la).items():
        log_prior = prior.log().requires_grad_()
        sigma = torch.tensor(0.8, dtype=torch.float64, requires_grad=likelihood == "regression")
        ours = la.log_marginal_likelihood(log_prior.exp(), sigma if sigma.requires_grad else None)
        grads = torch.autograd.grad(ours, [log_prior, sigma] if sigma.requires_grad else [log_prior])
        ref = dense_marglik(la, log_prior.exp(), sigma if sigma.requires_grad else None)
        ref_grads = torch.autograd.grad(ref, [log_prior, sigma] if sigma.requires_grad else [log_prior])
        scale = float(ref.detach().abs()) + la.n_params
        torch.testing.assert_close(ours, ref, atol=1e-11 * scale, rtol=0, msg=name)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-10 * scale, rtol=0, msg=name)


def test_dense_magnitude_route_and_loaded_state_take_a_dense_decomposition():
    """|B̃|·C ≥ P: G_B̃ is dense, the eigenpairs come from one eigendecomposition of H; the same
    after ``load_state_dict`` of a state without eigenpairs."""
    la = fitted(("all", "debiased_full"), batch_size=20)  # 20·3 = 60 columns ≥ P = 51
    prior = torch.tensor([0.5], dtype=torch.float64)
    torch.testing.assert_close(la.log_marginal_likelihood(prior), dense_marglik(la, prior), atol=1e-10, rtol=0)
    state = la.state_dict()
    state["curvature_eigenvectors"] = state["curvature_eigenvalues"] = None
    other = Laplace(tiny_mlp(), "classification", "all", "debiased_full")
    other.load_state_dict(state)
    torch.testing.assert_close(other.log_marginal_likelihood(prior), dense_marglik(la, prior), atol=1e-10, rtol=0)


@pytest.mark.parametrize("structure", ["scalar", "layerwise"])
def test_same_batch_full_marglik_and_tuning_equal_stock_full(structure):
    """B̃ = B: the eigenbasis marglik is stock FullLaplace's to round-off, and marglik tuning
    (same Adam steps) reaches the same prior precision."""
    X, y = make_batch(12, "classification", 0)
    loader = DataLoader(TensorDataset(X, y), batch_size=12)
    model = tiny_mlp()
    # BackPACK's stock GGN is exact to float64 round-off (curvlinops' is only to about 1e-7 here)
    ours = Laplace(model, "classification", "all", "debiased_full", backend=BackPackGGN)
    ours.fit(loader, magnitude_loader=loader)
    stock = FullLaplace(model, "classification", backend=BackPackGGN)
    stock.fit(loader)
    for prior in (0.01, 1.0, 50.0):
        torch.testing.assert_close(ours.log_marginal_likelihood(torch.tensor([prior], dtype=torch.float64)),
                                   stock.log_marginal_likelihood(torch.tensor([prior], dtype=torch.float64)),
                                   atol=1e-10, rtol=1e-12)
    for la in (ours, stock):
        la.optimize_prior_precision(method="marglik", n_steps=60, lr=0.1, prior_structure=structure)
    torch.testing.assert_close(ours.prior_precision, stock.prior_precision, atol=0, rtol=1e-8)


@pytest.mark.parametrize("key", [("all", "debiased_full"), ("all", "debiased_lowrank")])
def test_scalar_marglik_tuning_never_factorises_the_posterior_precision(key, monkeypatch):
    """After the fit, 50 marglik steps with a scalar prior touch no P × P matrix: the posterior
    precision is never formed and no eigendecomposition, determinant or inverse runs."""
    la = fitted(key)
    la.curvature_eigenpairs()

    def refuse(*args, **kwargs):
        raise AssertionError("dense linear algebra in a marglik step")

    for name in ("eigh", "cholesky", "inv", "slogdet", "det", "qr", "svd"):
        monkeypatch.setattr(torch.linalg, name, refuse)
    monkeypatch.setattr(torch, "logdet", refuse)
    monkeypatch.setattr(torch, "inverse", refuse)
    monkeypatch.setattr(type(la), "posterior_precision", property(refuse))
    la.optimize_prior_precision(method="marglik", n_steps=50, lr=0.1)
    assert la.prior_precision.numel() == 1 and torch.isfinite(la.prior_precision).all()


def test_non_scalar_prior_uses_an_r_by_r_cholesky(monkeypatch):
    """A diagonal prior breaks the shared eigenbasis: the log-determinant factorises an
    ``r × r`` matrix (``r`` = rank of H), never ``P × P``."""
    la = fitted(("all", "debiased_lowrank"))
    Q, _ = la.curvature_eigenpairs()
    sizes = []
    cholesky = torch.linalg.cholesky

    def recording(M, *args, **kwargs):
        sizes.append(M.shape[-1])
        return cholesky(M, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky", recording)
    la.log_marginal_likelihood(torch.linspace(0.1, 1.0, la.n_params, dtype=torch.float64))
    assert sizes == [Q.shape[1]] and Q.shape[1] < la.n_params


@settings(max_examples=30, deadline=None)
@given(P=st.integers(2, 12), r_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       log_s=st.floats(-3, 3), diag=st.booleans())
def test_eigen_log_det_is_the_dense_log_det(P, r_frac, seed, log_s, diag):
    g = torch.Generator().manual_seed(seed)
    r = round(r_frac * P)
    Q, _ = torch.linalg.qr(torch.randn(P, P, generator=g, dtype=torch.float64))
    Q = Q[:, :r]
    h = torch.rand(r, generator=g, dtype=torch.float64) * 10
    prior = torch.rand(P if diag else 1, generator=g, dtype=torch.float64) + 0.1
    s = math.exp(log_s)
    dense = s * (Q * h) @ Q.T + torch.diag(prior.expand(P))
    cond = float(torch.linalg.cond(dense))
    torch.testing.assert_close(eigen_log_det(Q, h, s, prior), torch.logdet(dense), atol=100 * P * cond * EPS64, rtol=0)


@pytest.mark.parametrize("r", [3, 8])
def test_eigen_functional_covariance_is_the_dense_one(r):
    g = torch.Generator().manual_seed(r)
    P, n, C = 8, 5, 3
    Q, _ = torch.linalg.qr(torch.randn(P, r, generator=g, dtype=torch.float64))
    h = torch.rand(r, generator=g, dtype=torch.float64) * 5
    J = torch.randn(n, C, P, generator=g, dtype=torch.float64)
    Sigma = torch.linalg.inv((Q * h) @ Q.T + 0.3 * torch.eye(P, dtype=torch.float64))
    torch.testing.assert_close(eigen_functional_covariance(J, Q, h, 0.3), J @ Sigma @ J.transpose(-1, -2),
                               atol=1e-12, rtol=1e-10)


def test_full_glm_predictive_with_scalar_prior_equals_dense_inverse():
    la = fitted(("all", "debiased_full"))
    la.prior_precision = 0.05
    X, _ = make_batch(7, "classification", 3)
    f_mu, f_var = la._glm_predictive_distribution(X)
    Js, _ = la.backend.jacobians(X)
    Sigma = torch.linalg.inv(la._H_factor * la.H + 0.05 * torch.eye(la.n_params, dtype=torch.float64))
    torch.testing.assert_close(f_var, Js @ Sigma @ Js.transpose(-1, -2), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("r", [3, 8])
@pytest.mark.parametrize("h_max", [5.0, 1e12])
def test_float32_eigen_functional_covariance_is_the_dense_one(r, h_max):
    """A float32 result, conditioned (Gram form) or ill-conditioned (explicit residual), is the
    float64 dense one to float32 accuracy relative to the largest variance."""
    from laplace_debiased.eigen.marglik import gram_residual_is_exact

    g = torch.Generator().manual_seed(r)
    P, n, C = 8, 5, 3
    basis, _ = torch.linalg.qr(torch.randn(P, P, generator=g, dtype=torch.float64))
    Q = basis[:, :r]
    h = torch.rand(r, generator=g, dtype=torch.float64) * h_max
    J = torch.randn(n, C, P, generator=g).double()  # float32 values
    delta = torch.tensor(0.3, dtype=torch.float64)
    assert gram_residual_is_exact(h, delta, P, torch.float32) == (h_max < 1e6)
    assert not gram_residual_is_exact(h, delta, P, torch.float64)
    h_full = torch.cat([h, torch.zeros(P - r, dtype=torch.float64)])
    Sigma = (basis / (h_full + delta)) @ basis.T  # the inverse from the full eigenbasis, no solve
    expected = J @ Sigma @ J.transpose(-1, -2)
    got = eigen_functional_covariance(J.float(), Q, h, delta)
    assert got.dtype == torch.float32
    scale = float(expected.diagonal(dim1=-2, dim2=-1).max())
    torch.testing.assert_close(got.double(), expected, atol=4 * EPS32 * scale, rtol=0)


def test_eigenpairs_are_decomposed_once_per_curvature_version():
    Q, h = torch.eye(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    calls = []

    def decompose():
        calls.append(1)
        return Q, h

    first, second = object(), object()
    known = current_eigenpairs(None, first, decompose)
    assert current_eigenpairs(known, first, decompose) is known and calls == [1]
    newer = current_eigenpairs(known, second, decompose)
    assert newer.version is second and calls == [1, 1]
    # the state carries them only while they are those of the current version
    assert eigenpairs_state(known, second) == {"curvature_eigenvectors": None, "curvature_eigenvalues": None}
    state = eigenpairs_state(newer, second)
    assert state["curvature_eigenvectors"] is Q and state["curvature_eigenvalues"] is h
    loaded = eigenpairs_from_state(state, first)
    assert loaded.version is first and loaded.vectors is Q and loaded.values is h
    assert eigenpairs_from_state(eigenpairs_state(None, first), first) is None


def test_log_det_prior_keeps_a_scalar_and_expands_the_rest():
    diagonal = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)

    def unused() -> torch.Tensor:
        raise AssertionError("a scalar prior needs no diagonal")

    assert torch.equal(log_det_prior(0.7, unused), torch.tensor([0.7]))
    assert torch.equal(log_det_prior(torch.tensor([0.7]), unused), torch.tensor([0.7]))
    assert log_det_prior(torch.tensor([0.7, 0.2]), lambda: diagonal) is diagonal

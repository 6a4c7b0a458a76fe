"""debiased_lowrank / debiased_full Laplace against dense explicit matrices on tiny float64 models."""

from __future__ import annotations

import io
import math

import pytest
import torch
from laplace import FullLaplace, Laplace, marglik_training
from laplace.baselaplace import LowRankLaplace
from laplace.curvature import AsdlEF, AsdlGGN, BackPackEF, BackPackGGN, CurvlinopsEF, CurvlinopsGGN
from laplace.lllaplace import FullLLLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  registers the structures
from laplace_debiased.eigen.laplace import (
    DebiasedFullLaplace,
    DebiasedFullLLLaplace,
    DebiasedLowRankLaplace,
    DebiasedLowRankLLLaplace,
)
from tests.curvature.test_eigen import DictMLP, explicit_curvature, make_batch, tiny_mlp

N_PARAMS = {"all": 51, "last_layer": 21}
N_PARAMS_REWARD = {"all": 37, "last_layer": 7}  # RewardMLP
KEYS = {
    ("all", "debiased_lowrank"): DebiasedLowRankLaplace,
    ("last_layer", "debiased_lowrank"): DebiasedLowRankLLLaplace,
    ("all", "debiased_full"): DebiasedFullLaplace,
    ("last_layer", "debiased_full"): DebiasedFullLLLaplace,
}


def data_loader(likelihood: str, n: int = 40, batch_size: int = 10, seed: int = 0) -> DataLoader:
    X, y = make_batch(n, likelihood, seed)
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


def make_la(model, likelihood, subset, structure, **kwargs):
    if structure == "debiased_lowrank":
        kwargs.setdefault("rank", 6)
    return Laplace(model, likelihood, subset_of_weights=subset, hessian_structure=structure, **kwargs)


def reference_parts(model, subset, loader, likelihood, curvature="ggn"):
    """(curvature module, B as module batches, B̃ as module batches, N) for the default split."""
    batches = list(loader)
    if subset == "last_layer":
        module = model[-1]
        batches = [(model[:-1](X).detach(), y) for X, y in batches]
    else:
        module = model
    return module, [batches[0]], [batches[1]], len(loader.dataset)


def dense_precision(la) -> torch.Tensor:
    U, lam = la.H
    return U @ torch.diag(lam * la._H_factor) @ U.T + torch.diag(la.prior_precision_diag)


@pytest.mark.parametrize("key, cls", KEYS.items())
def test_factory_dispatch(key, cls):
    la = make_la(tiny_mlp(), "classification", *key)
    assert type(la) is cls
    assert type(Laplace(tiny_mlp(), "classification", "all", "full")) is FullLaplace
    assert Laplace.__module__ and LowRankLaplace._key == ("all", "lowrank")  # stock keys untouched


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_same_batch_full_equals_laplace_full(subset, likelihood):
    """B̃ = B: debiased_full is laplace-torch's FullLaplace fitted on B."""
    model = tiny_mlp()
    loader = data_loader(likelihood, n=12, batch_size=12)
    ours = make_la(model, likelihood, subset, "debiased_full", prior_precision=0.7)
    ours.fit(loader, magnitude_loader=loader)
    stock_cls = FullLaplace if subset == "all" else FullLLLaplace
    stock = stock_cls(model, likelihood, prior_precision=0.7)
    stock.fit(loader)
    # laplace-torch's curvlinops `full` multiplies by a float32 identity: compare at that accuracy
    torch.testing.assert_close(ours.H, stock.H, atol=1e-6 * float(stock.H.abs().max()), rtol=0)
    torch.testing.assert_close(ours.loss, stock.loss, atol=1e-12, rtol=1e-12)
    assert ours.n_data == stock.n_data == 12
    torch.testing.assert_close(ours.log_marginal_likelihood(), stock.log_marginal_likelihood(), atol=1e-5, rtol=1e-6)
    X = loader.dataset.tensors[0][:5]
    if likelihood == "classification":
        torch.testing.assert_close(ours(X), stock(X), atol=1e-6, rtol=1e-6)
    else:
        for a, b in zip(ours(X), stock(X)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("curvature, backend", [("ggn", CurvlinopsGGN), ("ef", CurvlinopsEF)])
def test_debiased_full_equals_dense_formula(subset, curvature, backend):
    """|B| = 60 ≥ P: G_B is non-degenerate outside the null space that every batch shares
    (softmax shift invariance), so its eigenbasis — and hence H — is unique."""
    model = tiny_mlp()
    loader = data_loader("classification", n=120, batch_size=60)
    la = make_la(model, "classification", subset, "debiased_full", backend=backend)
    la.fit(loader)
    module, B, Bt, N = reference_parts(model, subset, loader, "classification")
    G_B = explicit_curvature(module, B, "classification", curvature) * N / 60
    G_Bt = explicit_curvature(module, Bt, "classification", curvature) * N / 60
    values, U = torch.linalg.eigh(G_B)
    expected = U @ torch.diag(torch.diag(U.T @ G_Bt @ U)) @ U.T
    torch.testing.assert_close(la.H, expected, atol=1e-9, rtol=1e-9)
    r = len(la.direction_eigenvalues)
    torch.testing.assert_close(la.direction_eigenvalues, values.flip(0)[:r], atol=1e-9, rtol=1e-9)
    assert values.flip(0)[r:].abs().max() < 1e-10 * values.max()  # only the shared null space is left out
    assert not torch.allclose(la.H, G_Bt, atol=1e-3)  # directions really come from B


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_debiased_full_with_null_space_uses_compression_there(subset):
    """|B|·C < P: on G_B's null space (no direction chosen by B) H is the compression of G_B̃."""
    model = tiny_mlp()
    loader = data_loader("classification", n=8, batch_size=4)  # rank G_B ≤ 4·2 = 8 < P
    la = make_la(model, "classification", subset, "debiased_full")
    la.fit(loader)
    module, B, Bt, N = reference_parts(model, subset, loader, "classification")
    G_B = explicit_curvature(module, B, "classification") * 2
    G_Bt = explicit_curvature(module, Bt, "classification") * 2
    values, vectors = torch.linalg.eigh(G_B)
    values, vectors = values.flip(0), vectors.flip(1)  # descending, as la.eigenvalues
    U = vectors[:, values > 1e-10 * values.max()]
    assert U.shape[1] == len(la.eigenvalues) < N_PARAMS[subset]
    Pi = torch.eye(len(G_B), dtype=torch.float64) - U @ U.T
    expected = U @ torch.diag(torch.diag(U.T @ G_Bt @ U)) @ U.T + Pi @ G_Bt @ Pi
    torch.testing.assert_close(la.H, expected, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(la.eigenvalues, torch.diag(U.T @ G_Bt @ U), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("method", ["gram", "lanczos"])
@pytest.mark.parametrize("curvature, backend", [("ggn", CurvlinopsGGN), ("ef", CurvlinopsEF)])
def test_debiased_lowrank_matches_dense_top_k_and_rayleigh_quotients(subset, method, curvature, backend):
    model = tiny_mlp()
    loader = data_loader("classification")
    rank = 4
    la = make_la(model, "classification", subset, "debiased_lowrank", rank=rank, method=method, backend=backend,
                 estimator="paper")
    la.fit(loader)
    module, B, Bt, N = reference_parts(model, subset, loader, "classification")
    G_B = explicit_curvature(module, B, "classification", curvature)
    G_Bt = explicit_curvature(module, Bt, "classification", curvature)
    values, vectors = torch.linalg.eigh(G_B)
    values, vectors = values.flip(0)[:rank], vectors.flip(1)[:, :rank]
    U, lam = la.H
    assert U.shape == (N_PARAMS[subset], rank) and la.eigen_method == method
    signs = torch.sign((U * vectors).sum(0))
    torch.testing.assert_close(U * signs, vectors, atol=1e-7, rtol=0)
    torch.testing.assert_close(lam, torch.einsum("pk,pq,qk->k", U, G_Bt, U) * N / 10, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(la.direction_eigenvalues, values * N / 10, atol=1e-9, rtol=1e-9)


def test_same_batch_lowrank_is_plain_top_k():
    model = tiny_mlp()
    loader = data_loader("regression", n=20, batch_size=10)
    la = make_la(model, "regression", "all", "debiased_lowrank", rank=5)
    la.fit(loader, magnitude_loader=loader)
    G = explicit_curvature(model, [next(iter(loader))], "regression") * 2  # N / |B| = 2
    values, vectors = torch.linalg.eigh(G)
    torch.testing.assert_close(la.H[1], values.flip(0)[:5], atol=1e-9, rtol=1e-9)
    U = la.H[0]
    torch.testing.assert_close(U @ torch.diag(la.H[1]) @ U.T, (vectors.flip(1)[:, :5] * values.flip(0)[:5]) @ vectors.flip(1)[:, :5].T, atol=1e-9, rtol=0)


def _top(G: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(G)
    return values.flip(0)[:k], vectors.flip(1)[:, :k]


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("method", ["gram", "lanczos"])
def test_corrected_lowrank_is_pooled_top_k_less_both_orders_gaps(subset, method):
    """``estimator="corrected"`` against the dense formula: B ∪ B̃'s top-k eigenvectors, eigenvalues
    ``λ_P - k_B g_B - k_B̃ g_B̃`` with each order's gaps from its own top-k and the other batch's
    curvature, ``k = (m/n)(1 - n/N)/2`` (here 1/8 for 10 + 10 of N = 40)."""
    model, loader, rank = tiny_mlp(), data_loader("classification"), 4
    la = make_la(model, "classification", subset, "debiased_lowrank", rank=rank, method=method, estimator="corrected")
    la.fit(loader)
    module, B, Bt, N = reference_parts(model, subset, loader, "classification")
    H_B = explicit_curvature(module, B, "classification") * N / 10
    H_Bt = explicit_curvature(module, Bt, "classification") * N / 10
    lam_P, U_P = _top((H_B + H_Bt) / 2, rank)
    gaps = []
    for D, M in ((H_B, H_Bt), (H_Bt, H_B)):
        lam, U = _top(D, rank)
        gaps.append(lam - torch.einsum("pk,pq,qk->k", U, M, U))
    expected = (lam_P - (gaps[0] + gaps[1]) / 8).clamp(min=0)
    assert (gaps[0] + gaps[1]).abs().max() > 1e-3 * lam_P.max()  # the correction is not negligible here
    U, lam = la.H
    torch.testing.assert_close(lam, expected, atol=1e-8 * float(lam_P.max()), rtol=1e-7)
    torch.testing.assert_close(U @ U.T, U_P @ U_P.T, atol=1e-6, rtol=0)
    torch.testing.assert_close(la.direction_eigenvalues, lam_P, atol=1e-8 * float(lam_P.max()), rtol=1e-7)


def test_corrected_lowrank_with_the_same_batch_is_plain_top_k():
    """B̃ = B: no gap to measure, both estimators give the single batch's top-k exactly."""
    model = tiny_mlp()
    loader = data_loader("regression", n=20, batch_size=10)
    out = {}
    for estimator in ("paper", "corrected"):
        la = make_la(model, "regression", "all", "debiased_lowrank", rank=5, estimator=estimator)
        la.fit(loader, magnitude_loader=loader)
        out[estimator] = la.H
    assert all(torch.equal(a, b) for a, b in zip(out["paper"], out["corrected"]))


def test_lowrank_estimator_is_checked_at_construction_and_saved():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="estimator"):
        make_la(model, "classification", "all", "debiased_lowrank", estimator="stein")
    la = make_la(model, "classification", "all", "debiased_lowrank", rank=3)
    la.fit(data_loader("classification"))
    state = la.state_dict()
    assert state["eigen_estimator"] == "corrected"  # the default
    with pytest.raises(ValueError, match="estimator"):
        make_la(model, "classification", "all", "debiased_lowrank", rank=3, estimator="paper").load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "eigen_estimator"}  # saved before the option existed: paper
    with pytest.raises(ValueError, match="estimator"):
        make_la(model, "classification", "all", "debiased_lowrank", rank=3).load_state_dict(older)
    make_la(model, "classification", "all", "debiased_lowrank", rank=3, estimator="paper").load_state_dict(older)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_woodbury_posterior_equals_dense_inverse(subset):
    model = tiny_mlp()
    loader = data_loader("regression")
    la = make_la(model, "regression", subset, "debiased_lowrank", rank=5, sigma_noise=0.8, temperature=1.3)
    la.fit(loader)
    la.prior_precision = torch.linspace(0.5, 2.0, N_PARAMS[subset], dtype=torch.float64)  # diagonal prior
    P = dense_precision(la)
    Sigma = torch.linalg.inv(P)
    X = loader.dataset.tensors[0][:4]
    if subset == "all":
        Js, _ = la.backend.jacobians(X)
    else:
        Js, _ = la.backend.last_layer_jacobians(X)
    torch.testing.assert_close(la.functional_variance(Js), torch.einsum("ncp,pq,nkq->nck", Js, Sigma, Js), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(la.log_det_posterior_precision, torch.logdet(P), atol=1e-9, rtol=1e-10)
    # regression GLM predictive: variance = J Σ Jᵀ + σ² handled by laplace-torch; check the f_var part
    f_mu, f_var = la(X, pred_type="glm")
    torch.testing.assert_close(f_var, torch.einsum("ncp,pq,nkq->nck", Js, Sigma, Js), atol=1e-10, rtol=1e-9)
    # samples: empirical covariance of the Woodbury sampler is Σ (fixed seed, statistical)
    samples = la.sample(20000, generator=torch.Generator().manual_seed(0))
    emp = torch.cov((samples - la.mean).T)
    assert torch.linalg.matrix_norm(emp - Sigma) < 0.05 * torch.linalg.matrix_norm(Sigma)
    assert torch.allclose(samples.mean(0), la.mean, atol=0.05)


def test_all_directions_removed_gives_prior_posterior():
    """No positive re-measured curvature: H has rank 0 and the posterior is the prior (no NaN)."""
    model = tiny_mlp()
    loader = data_loader("classification")
    la = make_la(model, "classification", "all", "debiased_lowrank", rank=3, prior_precision=2.0)
    la.fit(loader)
    U, lam = la.H
    la.H = (U[:, :0], lam[:0])  # what above_relative_floor leaves when every λ̃ ≤ 0
    X = loader.dataset.tensors[0][:3]
    Js, _ = la.backend.jacobians(X)
    torch.testing.assert_close(la.functional_variance(Js), Js @ Js.transpose(1, 2) / 2.0)
    torch.testing.assert_close(la.log_det_posterior_precision, torch.tensor(51 * math.log(2.0), dtype=torch.float64))
    assert torch.isfinite(la.sample(3)).all() and torch.isfinite(la(X)).all()


def test_remeasured_threshold_drops_flat_directions():
    model = tiny_mlp()
    loader = data_loader("classification")
    ref = make_la(model, "classification", "all", "debiased_lowrank", rank=6, remeasured_rtol=0.0,
                  estimator="paper")
    ref.fit(loader)
    cut = make_la(model, "classification", "all", "debiased_lowrank", rank=6, remeasured_rtol=0.3,
                  estimator="paper")
    cut.fit(loader)
    keep = ref.H[1] > 0.3 * ref.H[1].max()
    assert 0 < int(keep.sum()) < 6
    torch.testing.assert_close(cut.H[1], ref.H[1][keep])
    torch.testing.assert_close(cut.H[0], ref.H[0][:, keep])
    torch.testing.assert_close(cut.direction_eigenvalues, ref.direction_eigenvalues[keep])


@pytest.mark.parametrize("key", list(KEYS))
def test_marglik_matches_dense_formula_and_tuning_improves_it(key):
    model = tiny_mlp()
    loader = data_loader("classification")
    la = make_la(model, "classification", *key, prior_precision=1.0)
    la.fit(loader)
    P = dense_precision(la) if "lowrank" in key[1] else la.posterior_precision
    delta = la.mean - la.prior_mean
    # the loss is the summed loss over B ∪ B̃ rescaled to N = 40
    X, y = loader.dataset.tensors
    expected_loss = 2 * nn.functional.cross_entropy(model(X[:20]), y[:20], reduction="sum").detach()
    torch.testing.assert_close(torch.as_tensor(la.loss), expected_loss, atol=1e-10, rtol=1e-10)
    expected = -la.loss - 0.5 * (torch.logdet(P) - la.n_params * math.log(1.0) + delta @ delta)
    before = la.log_marginal_likelihood()
    torch.testing.assert_close(before, expected, atol=1e-9, rtol=1e-10)
    la.optimize_prior_precision(method="marglik", n_steps=30, lr=0.1)
    assert la.log_marginal_likelihood() > before


@pytest.mark.parametrize("key", [("all", "debiased_lowrank"), ("last_layer", "debiased_full")])
def test_gridsearch_picks_best_grid_point(key):
    model = tiny_mlp()
    la = make_la(model, "classification", *key)
    la.fit(data_loader("classification"))
    val = data_loader("classification", n=20, seed=5)
    grid = torch.logspace(-2, 2, 5)
    nll = []
    for prec in grid:
        la.prior_precision = float(prec)
        probs = torch.cat([la(X, link_approx="probit") for X, _ in val])
        y = val.dataset.tensors[1]
        nll.append(float(-probs[torch.arange(len(y)), y].log().mean()))
    la.optimize_prior_precision(method="gridsearch", val_loader=val, log_prior_prec_min=-2, log_prior_prec_max=2, grid_size=5)
    torch.testing.assert_close(la.prior_precision, torch.tensor([float(grid[int(torch.tensor(nll).argmin())])], dtype=torch.float64))


@pytest.mark.parametrize("key", list(KEYS))
def test_state_dict_round_trip_is_exact(key):
    model = tiny_mlp()
    loader = data_loader("classification")
    la = make_la(model, "classification", *key, prior_precision=0.5)
    la.fit(loader)
    state = la.state_dict()
    other = make_la(model, "classification", *key)
    other.load_state_dict(state)
    X = loader.dataset.tensors[0][:5]
    if "lowrank" in key[1]:
        assert all(torch.equal(a, b) for a, b in zip(other.H, la.H))
    else:
        assert torch.equal(other.H, la.H) and torch.equal(other.eigenvalues, la.eigenvalues)
    assert torch.equal(other.direction_eigenvalues, la.direction_eigenvalues)
    assert torch.equal(other(X), la(X)) and torch.equal(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    g1, g2 = (torch.Generator().manual_seed(1) for _ in range(2))
    assert torch.equal(other.sample(4, generator=g1), la.sample(4, generator=g2))


def test_state_dict_with_other_rank_is_refused():
    model = tiny_mlp()
    la = make_la(model, "classification", "all", "debiased_lowrank", rank=3)
    la.fit(data_loader("classification"))
    with pytest.raises(ValueError, match="rank"):
        make_la(model, "classification", "all", "debiased_lowrank", rank=4).load_state_dict(la.state_dict())


def test_lowrank_refuses_online_update_and_bad_settings():
    model = tiny_mlp()
    loader = data_loader("classification")
    la = make_la(model, "classification", "all", "debiased_lowrank")
    with pytest.raises(ValueError, match="override=False"):
        la.fit(loader, override=False)
    for kwargs, match in [(dict(rank=0), "rank"), (dict(method="svd"), "method"), (dict(remeasured_rtol=2.0), "remeasured_rtol")]:
        with pytest.raises(ValueError, match=match):
            make_la(model, "classification", "all", "debiased_lowrank", **kwargs)
    stochastic = make_la(model, "classification", "all", "debiased_lowrank", backend=CurvlinopsGGN, backend_kwargs={"stochastic": True})
    with pytest.raises(ValueError, match="exact GGN"):
        stochastic.fit(loader)


def test_full_online_update_adds_curvature():
    model = tiny_mlp()
    first, second = data_loader("classification", seed=0), data_loader("classification", seed=1)
    la = make_la(model, "classification", "all", "debiased_full")
    la.fit(first)
    H1 = la.H.clone()
    la.fit(second, override=False)
    solo = make_la(model, "classification", "all", "debiased_full")
    solo.fit(second)
    torch.testing.assert_close(la.H, H1 + solo.H)
    assert la.n_data == 80


@pytest.mark.parametrize("key", list(KEYS))
def test_bad_inputs_raise_clear_errors(key):
    model = tiny_mlp()
    X, y = make_batch(40, "classification", 0)
    X_nan = X.clone()
    X_nan[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        make_la(model, "classification", *key).fit(DataLoader(TensorDataset(X_nan, y), batch_size=10))
    overlapping = DataLoader(TensorDataset(X[:10], y[:10]), batch_size=10)
    with pytest.raises(ValueError, match="independent"):
        make_la(model, "classification", *key).fit(DataLoader(TensorDataset(X, y), batch_size=10), magnitude_loader=overlapping)
    with pytest.raises(ValueError, match="dtype"):
        make_la(model, "classification", *key).fit(DataLoader(TensorDataset(X.float(), y), batch_size=10))


@pytest.mark.parametrize("key", list(KEYS))
def test_mapping_batches_equal_tensor_batches(key):
    """Dict inputs (laplace-torch's dict_key_x/dict_key_y) give the tensor-input posterior,
    for all weights and for the last layer, on both eigen routes."""
    X, y = make_batch(20, "classification", 0)
    tensor_loader = DataLoader(TensorDataset(X, y), batch_size=10)
    dict_loader = DataLoader([{"input_ids": x, "labels": t} for x, t in zip(X, y)], batch_size=10)
    methods = ["gram", "lanczos"] if "lowrank" in key[1] else [None]
    for method in methods:
        kwargs = {} if method is None else {"method": method, "rank": 3}
        ref = make_la(tiny_mlp(), "classification", *key, **kwargs)
        ref.fit(tensor_loader)
        la = make_la(DictMLP(), "classification", *key, **kwargs)
        la.fit(dict_loader)
        H, H_ref = (la.H[1], ref.H[1]) if "lowrank" in key[1] else (la.H, ref.H)
        torch.testing.assert_close(H, H_ref, atol=1e-9 * float(H_ref.abs().max()), rtol=0)
        torch.testing.assert_close(la.loss, ref.loss)
        torch.testing.assert_close(la({"input_ids": X[:4]}), ref(X[:4]), atol=1e-7, rtol=1e-7)


BACKENDS = [(CurvlinopsGGN, BackPackGGN), (CurvlinopsGGN, AsdlGGN), (CurvlinopsEF, BackPackEF), (CurvlinopsEF, AsdlEF)]


@pytest.mark.parametrize("reference, backend", BACKENDS)
@pytest.mark.parametrize("key", list(KEYS))
def test_every_stock_backend_gives_the_same_posterior(key, reference, backend):
    """BackPACK's extend used to break the forward-mode re-measurement (functorch
    setup_context error); the curvature depends only on the backend's GGN/EF type."""
    loader = data_loader("classification")
    ref = make_la(tiny_mlp(), "classification", *key, backend=reference)
    ref.fit(loader)
    la = make_la(tiny_mlp(), "classification", *key, backend=backend)
    la.fit(loader)
    H, H_ref = (la.H[1], ref.H[1]) if "lowrank" in key[1] else (la.H, ref.H)
    torch.testing.assert_close(H, H_ref, atol=1e-9 * float(H_ref.abs().max()), rtol=0)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("key", list(KEYS))
def test_backpack_with_dict_inputs_works(key):
    """The eigen structures never call the backend's curvature, so BackPACK needs no tensor inputs."""
    X, y = make_batch(20, "classification", 0)
    loader = DataLoader([{"input_ids": x, "labels": t} for x, t in zip(X, y)], batch_size=10)
    ref = make_la(DictMLP(), "classification", *key)
    ref.fit(loader)
    la = make_la(DictMLP(), "classification", *key, backend=BackPackGGN)
    la.fit(loader)
    H, H_ref = (la.H[1], ref.H[1]) if "lowrank" in key[1] else (la.H, ref.H)
    torch.testing.assert_close(H, H_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_marglik_training_with_backpack_equals_curvlinops(structure):
    results = []
    for backend in (CurvlinopsGGN, BackPackGGN):
        la, model, margliks, _ = marglik_training(
            tiny_mlp(), data_loader("regression"), "regression", hessian_structure=structure,
            backend=backend, n_epochs=2, n_hypersteps=2, optimizer_kwargs={"lr": 1e-2},
        )
        assert type(la).__name__.startswith("Debiased")
        results.append(margliks)
    torch.testing.assert_close(torch.tensor(results[0]), torch.tensor(results[1]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("key", list(KEYS))
def test_state_dict_loads_without_pickle(key):
    """laplace-torch's contract: tensors, numbers and strings only (torch.load weights_only)."""
    model = tiny_mlp()
    la = make_la(model, "classification", *key, prior_precision=0.5)
    la.fit(data_loader("classification"))
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    def leaves(value):
        return [v for item in value for v in leaves(item)] if isinstance(value, (tuple, list)) else [value]

    assert not any(isinstance(value, dict) for value in state.values())  # no eigen_config dict
    assert all(v is None or isinstance(v, (torch.Tensor, int, float, str)) for value in state.values() for v in leaves(value))
    other = make_la(model, "classification", *key)
    other.load_state_dict(state)
    X = data_loader("classification").dataset.tensors[0][:5]
    assert torch.equal(other(X), la(X))
    assert torch.equal(other.log_marginal_likelihood(), la.log_marginal_likelihood())


class RewardMLP(nn.Module):
    """Scalar reward: preference pairs ``(n, 2, 4)`` → logits ``(n, 2)``; single inputs ``(n, 4)`` → ``(n, 1)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()

    def forward(self, x):
        out = self.net(x)
        return out.squeeze(-1) if x.ndim == 3 else out


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_reward_modeling_matches_stock(subset, structure):
    """Classification (Bradley-Terry) curvature at fit, regression at predict; B̃ = B on one
    batch gives stock FullLaplace (lowrank at full rank); the two-batch fit predicts the same shapes."""
    g = torch.Generator().manual_seed(0)
    pairs = TensorDataset(torch.randn(40, 2, 4, dtype=torch.float64, generator=g), torch.randint(0, 2, (40,), generator=g))
    one_batch = DataLoader(pairs, batch_size=40)
    model = RewardMLP()
    stock = Laplace(model, "reward_modeling", subset_of_weights=subset, hessian_structure="full", prior_precision=0.5)
    stock.fit(one_batch)
    kwargs = {"rank": N_PARAMS_REWARD[subset]} if structure == "debiased_lowrank" else {}
    la = Laplace(model, "reward_modeling", subset_of_weights=subset, hessian_structure=structure, prior_precision=0.5, **kwargs)
    la.fit(one_batch, magnitude_loader=one_batch)
    H = la.H[0] @ torch.diag(la.H[1]) @ la.H[0].T if structure == "debiased_lowrank" else la.H
    torch.testing.assert_close(H, stock.H, atol=1e-6 * float(stock.H.abs().max()), rtol=0)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g)
    (mu, var), (mu_ref, var_ref) = la(x), stock(x)
    assert mu.shape == mu_ref.shape == (5, 1) and var.shape == var_ref.shape == (5, 1, 1)
    torch.testing.assert_close(var, var_ref, atol=1e-6, rtol=1e-5)
    two_batch = Laplace(model, "reward_modeling", subset_of_weights=subset, hessian_structure=structure, **kwargs)
    two_batch.fit(DataLoader(pairs, batch_size=20))
    mu2, var2 = two_batch(x)
    assert mu2.shape == (5, 1) and var2.shape == (5, 1, 1) and torch.isfinite(var2).all() and (var2 > 0).all()



@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_multihead_attention_model_fits_and_matches_dense_formula(structure):
    """Its eval fast path has no forward-mode AD (used to raise NotImplementedError)."""
    from tests.curvature.test_eigen import AttentionClassifier

    model = AttentionClassifier().eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 12, dtype=torch.float64, generator=g), torch.randint(0, 3, (16,), generator=g)
    loader = DataLoader(TensorDataset(X, y), batch_size=8)
    la = make_la(model, "classification", "all", structure,
                 **({"estimator": "paper"} if structure == "debiased_lowrank" else {}))  # B̃'s Rayleigh quotients
    la.fit(loader)
    G_Bt = explicit_curvature(model, [(X[8:], y[8:])], "classification") * 2
    if structure == "debiased_lowrank":
        U, lam = la.H
        torch.testing.assert_close(lam, torch.einsum("pk,pq,qk->k", U, G_Bt, U), atol=1e-9, rtol=1e-7)
    else:  # U diag(λ̃) Uᵀ + Π G_B̃ Π with U Uᵀ + Π = I keeps the trace of G_B̃
        torch.testing.assert_close(torch.trace(la.H), torch.trace(G_Bt), atol=1e-8, rtol=1e-8)
    assert torch.isfinite(la(X[:3])).all()


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_log_prob_is_the_dense_gaussian_log_density(subset):
    """``log_prob`` of ``debiased_lowrank`` is that of ``N(θ*, P⁻¹)`` with the dense precision
    ``P = U diag(s λ) Uᵀ + diag(p)`` (float64), normalised or not (``-½ Δᵀ P Δ``)."""
    X, y = make_batch(32, "classification", seed=0)
    la = Laplace(tiny_mlp(), "classification", subset_of_weights=subset, hessian_structure="debiased_lowrank",
                 prior_precision=0.3)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    (U, lam), prior = la.posterior_precision
    P = (U * lam) @ U.T + torch.diag(prior)
    theta = la.mean + torch.randn(4, la.n_params, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dense = torch.distributions.MultivariateNormal(la.mean, precision_matrix=P)
    torch.testing.assert_close(torch.stack([la.log_prob(t) for t in theta]), dense.log_prob(theta), rtol=1e-10, atol=0)
    delta = theta - la.mean
    torch.testing.assert_close(torch.stack([la.log_prob(t, normalized=False) for t in theta]),
                               -0.5 * ((delta @ P) * delta).sum(-1), rtol=1e-10, atol=0)

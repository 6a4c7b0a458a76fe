"""The grid predictive against laplace-torch's own GLM predictive and dense explicit formulas."""

from __future__ import annotations

import math

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.evaluation import predictive
from laplace_debiased.posterior import grams
from laplace_debiased.evaluation.predictive import linearized_logit_samples, sampled_linearized_predictive
from laplace_debiased.posterior.eigen import EigenStructure
from laplace_debiased.posterior.from_laplace import laplace_params
from laplace_debiased.posterior.grams import weighted_grams
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import _func_jacobians, logit_jacobians
from laplace_debiased.posterior.links import apply_link, mc_softmax, probit, probit_projected


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(2 * 16, 5), nn.Tanh(), nn.Linear(5, 4),
    ).double()
    X = torch.randn(30, 1, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (30,))
    return model, X, y


def _fit(structure: str, subset: str):
    model, X, y = _tiny()
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=10))
    return la, X


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", ["kron", "full"])
def test_probit_matches_laplace_torch(structure, subset):
    la, X = _fit(structure, subset)
    if structure == "full":
        # the backend's dense GGN has eigenvalues down to -5e-9·λ_max (not PSD beyond float64
        # round-off); GridPredictive clamps them to 0, so compare on its PSD part
        lam, U = torch.linalg.eigh(la.H)
        la.H = (U * lam.clamp_min(0)) @ U.T
    grid = [1e-3, 0.1, 10.0]
    ours = GridPredictive(la, chunk_size=7).grid(X, grid, links=("probit",))["probit"]
    for g, delta in enumerate(grid):
        la.prior_precision = delta
        ref = la(X, pred_type="glm", link_approx="probit")
        torch.testing.assert_close(ours[g], ref, rtol=1e-9, atol=1e-12)
    # the grid really depends on the prior precision
    assert (ours[0] - ours[-1]).abs().max() > 1e-3


def test_temperature_and_per_layer_prior_match_laplace_torch():
    la, X = _fit("kron", "all")
    la.temperature = 0.5
    delta = torch.linspace(0.01, 1.0, la.n_layers, dtype=torch.float64)
    la.prior_precision = delta
    ref = la(X, pred_type="glm", link_approx="probit")
    ours = GridPredictive(la).grid(X, [delta], links=("probit",))["probit"][0]
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_closed_form_jacobians_equal_torch_func_and_laplace():
    la, X = _fit("kron", "all")
    f, jacs = logit_jacobians(la.model, laplace_params(la), X[:6])
    _, ref = _func_jacobians(la.model, laplace_params(la), X[:6])
    J = torch.cat([j.full().expand(6, -1, -1) for j in jacs], -1)  # output layer: shared (1, C, ·)
    torch.testing.assert_close(J, torch.cat([j.full() for j in ref], -1))
    J_lap, f_lap = la.backend.jacobians(X[:6])
    torch.testing.assert_close(J, J_lap)
    torch.testing.assert_close(f, f_lap)


def test_low_rank_structure_equals_dense_formula():
    la, X = _fit("full", "all")
    H = la.H
    lam, U = torch.linalg.eigh(H)
    k = 5
    struct = EigenStructure(U[:, -k:], lam[-k:], la._H_factor)
    delta = 0.3
    precision = U[:, -k:] @ torch.diag(lam[-k:]) @ U[:, -k:].T + delta * torch.eye(la.n_params, dtype=H.dtype)
    Js, f = la.backend.jacobians(X[:5])
    cov_ref = torch.einsum("ncp,pq,ndq->ncd", Js, torch.linalg.inv(precision), Js)
    _, jacs = logit_jacobians(la.model, laplace_params(la), X[:5])
    cov = struct.covariance(struct.rotate(jacs), delta)
    torch.testing.assert_close(cov, cov_ref)


@pytest.mark.parametrize("buffer", [grams.PAIR_BUFFER, 7])
def test_weighted_grams_equal_explicit_formula(monkeypatch, buffer):
    """Pair-product path (G >= 3, also in pieces over inputs and columns) and the per-point path
    (G <= 2) against ``A diag(w_g) Aᵀ`` written out."""
    monkeypatch.setattr(grams, "PAIR_BUFFER", buffer)
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(5, 4, 9, dtype=torch.float64, generator=gen)
    W = torch.rand(4, 9, dtype=torch.float64, generator=gen)
    ref = torch.einsum("ncp,gp,ndp->gncd", A, W, A)
    torch.testing.assert_close(weighted_grams(A, W), ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(weighted_grams(A, W[:2]), ref[:2], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", ["kron", "kron_damped_per_layer", "full", "low_rank"])
def test_grid_covariances_equal_per_point_covariance(case):
    """``covariances(grid)`` (one pass over the rotated Jacobians) equals ``covariance`` at each
    grid point, which takes the per-point path, to round-off."""
    la, X = _fit("full" if case in ("full", "low_rank") else "kron", "all")
    struct = GridPredictive(la).structure
    grid: list = [1e-3, 0.05, 1.0, 30.0]
    if case == "kron_damped_per_layer":
        struct.damping = True
        grid = [torch.linspace(0.01, 1.0, la.n_layers, dtype=torch.float64) * g for g in grid]
    if case == "low_rank":
        struct = EigenStructure(struct.U[:, -5:], struct.lam[-5:], la._H_factor)
    _, jacs = logit_jacobians(la.model, laplace_params(la), X[:6])
    rotated = struct.rotate(jacs)
    covs = struct.covariances(rotated, grid)
    assert covs.shape == (len(grid), 6, 4, 4)
    ref = torch.stack([struct.covariance(rotated, d) for d in grid])
    torch.testing.assert_close(covs, ref, rtol=1e-12, atol=1e-14)
    assert (covs[0] - covs[-1]).abs().max() > 1e-3 * covs[0].abs().max()


def test_projected_probit_ignores_all_ones_direction():
    torch.manual_seed(1)
    n, C = 6, 5
    f = torch.randn(n, C, dtype=torch.float64)
    A = torch.randn(n, C, C, dtype=torch.float64)
    cov = A @ A.transpose(1, 2)
    ones = torch.ones(C, C, dtype=torch.float64)
    base = probit_projected(f, cov)
    for c, a in [(1.0, 0.0), (1e4, 3.0), (1e8, -2.0)]:
        torch.testing.assert_close(probit_projected(f + a, cov + c * ones), base)
    # laplace-torch's diagonal probit is fooled: a huge all-ones variance makes it near-uniform
    fooled = probit(f, cov + 1e8 * ones)
    assert (fooled - 1.0 / C).abs().max() < 1e-3
    assert (base - 1.0 / C).abs().max() > 0.05


def test_mc_statistically_invariant_to_all_ones_and_matches_probit_roughly():
    torch.manual_seed(2)
    n, C, S = 4, 3, 20000
    f = torch.randn(n, C, dtype=torch.float64) * 2
    A = torch.randn(n, C, C, dtype=torch.float64) * 0.5
    cov = A @ A.transpose(1, 2)
    p1 = mc_softmax(f, cov, S, torch.Generator().manual_seed(0))
    p2 = mc_softmax(f, cov + 1e3 * torch.ones(C, C, dtype=torch.float64), S, torch.Generator().manual_seed(1))
    # standard error of a mean of [0, 1] values is at most 0.5/sqrt(S) = 0.0035
    assert (p1 - p2).abs().max() < 0.015
    # zero covariance: exactly the softmax
    torch.testing.assert_close(mc_softmax(f, 0 * cov, 3), torch.softmax(f, -1))


@pytest.mark.slow
def test_parameter_sampling_logits_have_the_structured_covariance():
    """Eq. 18 path (θ_s ~ posterior, JVPs) vs the rotated-Jacobian covariance Σ(δ)."""
    la, X = _fit("kron", "all")
    delta, S, x = 0.05, 4000, X[:4]
    la.prior_precision = delta
    samples = linearized_logit_samples(la, x, n_samples=S, generator=torch.Generator().manual_seed(0))
    pred = GridPredictive(la)
    f, jacs = logit_jacobians(la.model, laplace_params(la), x)
    rotated = pred.structure.rotate(jacs)
    cov = pred.structure.covariance(rotated, delta)
    centred = samples - f
    emp = torch.einsum("sni,snj->nij", centred, centred) / S
    rel = lambda a, b: float((a - b).norm() / b.norm())
    # Wishart relative error ~ sqrt(2/S) ≈ 0.02; a prior off by 2x is far outside
    assert rel(emp, cov) < 0.08
    assert rel(emp, pred.structure.covariance(rotated, 2 * delta)) > 0.2
    assert (samples.mean(0) - f).abs().max() < 4 * cov.diagonal(dim1=1, dim2=2).sqrt().max() / S**0.5


@pytest.mark.slow
def test_mc_grid_agrees_with_parameter_sampling_eq18():
    la, X = _fit("kron", "all")
    delta, S, x = 0.05, 3000, X[:8]
    la.prior_precision = delta
    grid_mc = GridPredictive(la).grid(
        x, [delta], links=("mc",), n_samples=S, generator=torch.Generator().manual_seed(0)
    )["mc"][0]
    eq18 = sampled_linearized_predictive(la, x, n_samples=S, generator=torch.Generator().manual_seed(1))
    assert (grid_mc - eq18).abs().mean() < 0.015


def test_bad_inputs_get_clear_errors():
    la, X = _fit("kron", "last_layer")
    pred = GridPredictive(la)
    with pytest.raises(ValueError, match="unknown link"):
        pred.grid(X, [1.0], links=("nope",))
    with pytest.raises(ValueError, match="positive"):
        pred.grid(X, [-1.0])
    with pytest.raises(ValueError, match="repeated link"):  # the dict would hold one entry for both
        pred.grid(X, [1.0], links=("probit", "probit"))
    with pytest.raises(ValueError, match="unknown link"):
        apply_link("nope", X.new_zeros(1, 2), X.new_zeros(1, 2, 2))
    assert math.isclose(float(pred(X[:2]).sum()), 2.0)


# ----------------------------------------------------------------- gridsearch through the grid
def _fit_debiased(structure: str, subset: str):
    model, X, y = _tiny()
    kw = {"rank": 6} if structure == "debiased_lowrank" else {}
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure, **kw)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=10))
    gen = torch.Generator().manual_seed(5)
    Xv = torch.randn(25, *X.shape[1:], generator=gen, dtype=X.dtype)
    yv = torch.randint(0, 4, (25,), generator=gen)
    return la, DataLoader(TensorDataset(Xv, yv), batch_size=10)


def _brute_force_scores(la, loss_factory, interval, val_loader, link):
    """laplace-torch's own ``validate`` once per grid point, with a fresh loss each time."""
    from laplace.utils.utils import validate

    scores = []
    for delta in interval:
        la.prior_precision = delta
        scores.append(validate(la, val_loader, loss_factory(), pred_type="glm", link_approx=link))
    return scores


@pytest.mark.parametrize("link", ["probit", "bridge", "bridge_norm"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full", "debiased_lowrank"])
def test_grid_validation_scores_equal_brute_force(structure, subset, link):
    import laplace_debiased  # noqa: F401
    from laplace.utils.metrics import RunningNLLMetric

    la, val = _fit_debiased(structure, subset)
    interval = torch.logspace(-4, 4, 9, dtype=torch.float64)
    ref = _brute_force_scores(la, RunningNLLMetric, interval, val, link)
    ours = predictive.grid_validation_scores(la, RunningNLLMetric(), interval, val, link)
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), rtol=1e-7, atol=1e-10)
    # a callable loss on the concatenated predictions, as laplace-torch's offline path
    def nll(p, y):
        return -p[torch.arange(len(y)), y].log().mean()
    ref_fn = _brute_force_scores(la, lambda: nll, interval, val, link)
    torch.testing.assert_close(torch.tensor(predictive.grid_validation_scores(la, nll, interval, val, link), dtype=torch.float64),
                               torch.tensor(ref_fn, dtype=torch.float64), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full", "debiased_lowrank"])
def test_optimize_prior_precision_gridsearch_uses_one_pass(structure, monkeypatch):
    """Same chosen prior precision as the brute-force loop, and laplace-torch's per-point
    ``validate`` is never called."""
    from laplace.utils.metrics import RunningNLLMetric

    from laplace_debiased.structures import gridsearch

    la, val = _fit_debiased(structure, "all")
    interval = torch.logspace(-4, 4, 13)
    ref = _brute_force_scores(la, RunningNLLMetric, interval, val, "probit")
    calls = []
    monkeypatch.setattr(gridsearch, "validate", lambda *a, **k: calls.append(1))
    la.optimize_prior_precision(
        pred_type="glm", method="gridsearch", val_loader=val, log_prior_prec_min=-4,
        log_prior_prec_max=4, grid_size=13, link_approx="probit",
    )
    assert not calls
    torch.testing.assert_close(la.prior_precision, interval[int(torch.tensor(ref).argmin())].reshape(1).to(la.prior_precision.dtype))
    # the search is not trivial: the scores vary over the grid
    assert max(ref) - min(ref) > 1e-3

"""The grid predictive (:mod:`laplace_debiased.posterior.grid`) against laplace-torch's own GLM
predictive and dense explicit formulas, and the grid search through it.

Property-based tests (hypothesis) of the predictive over structure × subset × link × prior
precision δ ∈ [1e-8, 1e8] (log-uniform) × dtype: the probabilities are finite and normalised,
and a float32 model agrees with the float64 model carrying the same curvature to 1e-3.

The fitted posteriors are built once per (structure, subset) on a tiny overfit MLP
(:func:`tests.posterior.test_variance_precision.overfit_mlp`); hypothesis draws the rest.  Examples are
derandomised so CI is deterministic.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from _models import fit_tiny_conv, tiny_conv_classifier
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.posterior.eigen_structure import EigenStructure
from laplace_debiased.posterior.from_laplace import laplace_params
from laplace_debiased.posterior.grid import GridPredictive, grid_validation_scores
from laplace_debiased.posterior.jacobians import logit_jacobians
from laplace_debiased.posterior.links import apply_link
from tests.posterior.test_variance_precision import _cast_curvature, fit_pair

@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", ["kron", "full"])
def test_probit_matches_laplace_torch(structure, subset):
    la, X = fit_tiny_conv(structure, subset)
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
    la, X = fit_tiny_conv("kron", "all")
    la.temperature = 0.5
    delta = torch.linspace(0.01, 1.0, la.n_layers, dtype=torch.float64)
    la.prior_precision = delta
    ref = la(X, pred_type="glm", link_approx="probit")
    ours = GridPredictive(la).grid(X, [delta], links=("probit",))["probit"][0]
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["kron", "kron_damped_per_layer", "full", "low_rank"])
def test_grid_covariances_equal_per_point_covariance(case):
    """``covariances(grid)`` (one pass over the rotated Jacobians) equals ``covariance`` at each
    grid point, which takes the per-point path, to round-off."""
    la, X = fit_tiny_conv("full" if case in ("full", "low_rank") else "kron", "all")
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


def test_bad_inputs_get_clear_errors():
    la, X = fit_tiny_conv("kron", "last_layer")
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
    model, X, y = tiny_conv_classifier()
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
    ours = grid_validation_scores(la, RunningNLLMetric(), interval, val, link)
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), rtol=1e-7, atol=1e-10)
    # a callable loss on the concatenated predictions, as laplace-torch's offline path
    def nll(p, y):
        return -p[torch.arange(len(y)), y].log().mean()
    ref_fn = _brute_force_scores(la, lambda: nll, interval, val, link)
    torch.testing.assert_close(torch.tensor(grid_validation_scores(la, nll, interval, val, link), dtype=torch.float64),
                               torch.tensor(ref_fn, dtype=torch.float64), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full", "debiased_lowrank"])
def test_optimize_prior_precision_gridsearch_uses_one_pass(structure, monkeypatch):
    """Same chosen prior precision as the brute-force loop, and laplace-torch's per-point
    ``validate`` is never called."""
    from laplace.utils.metrics import RunningNLLMetric

    from laplace_debiased.two_batch import gridsearch

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


# ----------------------------------------------------------------- properties (hypothesis)
STRUCTURES = ("debiased_kron", "debiased_lowrank", "debiased_full")
SUBSETS = ("all", "last_layer")
#: GridPredictive links, plus laplace-torch's own ``la(x, link_approx=...)`` path
LINKS = ("probit", "probit_projected", "bridge", "mc", "la:probit", "la:bridge", "la:mc")

PROPERTY_SETTINGS = settings(
    max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@functools.lru_cache(maxsize=None)
def posteriors(structure: str, subset: str):
    """``{float32: fitted float32 Laplace, float64: float64 model with that curvature}`` and
    held-out float64 inputs."""
    kw = {"rank": 5} if structure == "debiased_lowrank" else {}
    las, X = fit_pair(structure, subset, **kw)
    las[torch.float64].H = _cast_curvature(las[torch.float32].H)
    return las, X[:8]


def predict(la, X: torch.Tensor, link: str, delta: float) -> torch.Tensor:
    X = X.to(la._dtype)
    if link.startswith("la:"):
        la.prior_precision = delta
        return la(X, pred_type="glm", link_approx=link[3:], n_samples=50)
    gen = torch.Generator().manual_seed(0)
    return GridPredictive(la).grid(X, [delta], links=(link,), n_samples=50, generator=gen)[link][0]


@PROPERTY_SETTINGS
@given(
    structure=st.sampled_from(STRUCTURES),
    subset=st.sampled_from(SUBSETS),
    link=st.sampled_from(LINKS),
    log10_delta=st.floats(min_value=-8.0, max_value=8.0),
    dtype=st.sampled_from((torch.float32, torch.float64)),
)
# corners always run: a float32 eigendecomposition / Cholesky at δ = 1e-8
@example(structure="debiased_full", subset="all", link="probit", log10_delta=-8.0, dtype=torch.float32)
@example(structure="debiased_full", subset="last_layer", link="la:probit", log10_delta=-8.0, dtype=torch.float32)
@example(structure="debiased_kron", subset="all", link="la:mc", log10_delta=-8.0, dtype=torch.float32)
def test_probabilities_finite_and_normalised(structure, subset, link, log10_delta, dtype):
    las, X = posteriors(structure, subset)
    p = predict(las[dtype], X, link, 10.0**log10_delta)
    assert p.dtype == dtype
    assert torch.isfinite(p).all()
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(len(p), dtype=dtype), rtol=0, atol=1e-5)


@PROPERTY_SETTINGS
@given(
    structure=st.sampled_from(STRUCTURES),
    subset=st.sampled_from(SUBSETS),
    link=st.sampled_from(tuple(link for link in LINKS if not link.endswith("mc"))),
    log10_delta=st.floats(min_value=-8.0, max_value=8.0),
)
@example(structure="debiased_kron", subset="last_layer", link="probit_projected", log10_delta=-5.0)
@example(structure="debiased_lowrank", subset="all", link="la:probit", log10_delta=-1.0)
def test_float32_agrees_with_float64(structure, subset, link, log10_delta):
    """Deterministic links only: mc draws its samples in the model dtype."""
    las, X = posteriors(structure, subset)
    delta = 10.0**log10_delta
    p32 = predict(las[torch.float32], X, link, delta)
    p64 = predict(las[torch.float64], X, link, delta)
    err = (p32.double() - p64).abs().max()
    assert err < 1e-3, f"max |p32 - p64| = {err:.3g}"


def _grids(la, X, links) -> dict:
    """Every link on a grid of three δ, MC from a generator seeded 0."""
    return GridPredictive(la, chunk_size=8).grid(X, [1e-3, 0.3, 30.0], links=links, n_samples=20,
                                                 generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", ["conv_kron", "conv_full", "tokens_kron"])
def test_pieces_of_a_chunk_give_the_whole_chunks_predictive(case, monkeypatch):
    """A chunk's variances and covariances computed one row at a time (the smallest pieces) equal
    those of the whole chunk, in the grid and in ``covariance``: rows never mix. The float64 results agree to round-off, the returned
    probabilities (the model's float32) to a few units of its last place; the MC draws come from
    the same generator for the whole chunk in both."""
    from laplace_debiased.posterior import grid as grid_module

    if case == "tokens_kron":
        from tests.posterior.test_token_grid import _fit, _tokens

        la, X = _fit("debiased_kron", "all"), _tokens(5, seed=2)[0]
    else:
        la, X = fit_tiny_conv(case.split("_")[1], "all")
    links = ("probit", "probit_projected", "mc", "bridge")
    whole = _grids(la, X[:12], links)
    whole_cov = GridPredictive(la, chunk_size=8).covariance(X[:12], 0.3)[1]
    monkeypatch.setattr(grid_module, "PIECE_BYTES", 1)  # one logit row per piece
    pieces = _grids(la, X[:12], links)
    for link in (*links, "map"):
        torch.testing.assert_close(pieces[link], whole[link], rtol=8 * 2.0**-24, atol=8 * 2.0**-24)
    torch.testing.assert_close(GridPredictive(la, chunk_size=8).covariance(X[:12], 0.3)[1], whole_cov,
                               rtol=1e-12, atol=1e-12 * float(whole_cov.abs().max()))
    assert (whole["probit"][0] - whole["probit"][-1]).abs().max() > 1e-3  # δ matters here

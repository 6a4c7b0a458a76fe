"""Property-based tests (hypothesis) of the predictive over structure × subset × link × prior
precision δ ∈ [1e-8, 1e8] (log-uniform) × dtype: the probabilities are finite and normalised,
and a float32 model agrees with the float64 model carrying the same curvature to 1e-3.

The fitted posteriors are built once per (structure, subset) on a tiny overfit MLP
(:func:`tests.posterior.test_variance_precision.overfit_mlp`); hypothesis draws the rest.  Examples are
derandomised so CI is deterministic.
"""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from laplace_debiased.posterior.grid import GridPredictive
from tests.posterior.test_variance_precision import _cast_curvature, fit_pair

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
# the corners of issue 12 item 6, always run: a float32 eigendecomposition / Cholesky at δ = 1e-8
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

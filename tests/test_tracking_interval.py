"""The bootstrap interval of a maximum over the prior-precision grid
(:func:`laplace_debiased.evaluation.tracking.max_abs_interval`): it contains its point estimate for
any gaps and resamples, and it covers the true maximum at its level in a seeded simulation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from laplace_debiased.evaluation.tracking import max_abs_interval

FLOATS = st.floats(-1e3, 1e3, allow_nan=False, width=64)


@st.composite
def gaps_and_resamples(draw):
    d, g, n = draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 30))
    point = draw(hnp.arrays(np.float64, (d, g), elements=FLOATS))
    boot = draw(hnp.arrays(np.float64, (n, d, g), elements=FLOATS))
    return point, boot, draw(st.floats(0.5, 0.99))


@settings(max_examples=200, deadline=None)
@given(gaps_and_resamples())
def test_interval_contains_its_point_estimate_per_draw_and_over_draws(case):
    point, boot, level = case
    lower, upper = max_abs_interval(point, boot, level)
    est = np.abs(point).max(axis=1)
    assert np.all(lower <= est) and np.all(est <= upper)
    assert lower.mean() <= est.mean() <= upper.mean()
    assert lower.max() <= est.max() <= upper.max()
    assert np.all(lower >= 0)


def test_percentile_interval_of_a_resampled_maximum_excludes_its_estimate_where_this_one_does_not():
    """Ten grid points with the same gap 0.01: a resample's maximum is below 0.01 only when all
    ten resampled gaps are (probability 2⁻¹⁰), so the percentile interval lies above the estimate;
    the band's does not."""
    rng = np.random.default_rng(0)
    point = np.full((1, 10), 0.01)
    boot = point + rng.normal(0.0, 0.005, (200, 1, 10))
    est = np.abs(point).max()
    lo, hi = np.percentile(np.abs(boot).max(axis=2)[:, 0], [2.5, 97.5])
    lower, upper = max_abs_interval(point, boot)
    assert not lo <= est <= hi
    assert lower[0] <= est <= upper[0]


def test_band_covers_the_true_maximum_at_about_its_level():
    """Seeded simulation: 5 grid points of independent normal gaps (true |gaps| 0, .01, ...,
    .04), their means from 100 samples, the bootstrap from those samples; over 200 replications
    the 95 % interval of the max covers the true 0.04 at least 90 % of the time (binomial sd of
    the count at 0.95 is 3 %)."""
    rng = np.random.default_rng(1)
    truth = np.array([0.0, 0.01, -0.02, 0.03, -0.04])
    hits = 0
    for _ in range(200):
        x = truth + rng.normal(0.0, 0.05, (100, 5))
        idx = rng.integers(0, 100, (200, 100))
        boot = x[idx].mean(axis=1)[:, None, :]
        lower, upper = max_abs_interval(x.mean(axis=0)[None], boot)
        hits += int(lower[0] <= 0.04 <= upper[0])
    assert hits >= 180


@pytest.mark.parametrize("shapes", [((3,), (5, 3)), ((2, 3), (5, 3, 2)), ((2, 3), (5, 2, 3, 1))])
def test_wrong_shapes_are_refused(shapes):
    with pytest.raises(ValueError, match="point must be"):
        max_abs_interval(np.zeros(shapes[0]), np.zeros(shapes[1]))

"""The tracking criterion (largest gap to the full-batch LA over the grid) and its report section;
the bootstrap interval of a maximum over the grid (:func:`~laplace_debiased.evaluation.tracking.max_abs_interval`):
it contains its point estimate for any gaps and resamples, and it covers the true maximum at its
level in a seeded simulation."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from laplace_debiased.evaluation.report_page import write_report
from laplace_debiased.evaluation.report_tables import mean_stderr_text
from laplace_debiased.evaluation.tracking import (
    clearly_below,
    curves_from_json,
    curves_to_json,
    gap_curves,
    largest_gap,
    max_abs_interval,
    max_gap_per_draw,
    mean_stderr,
    paired_margin,
    reference_of,
    where_largest,
)

GRID = (1e-4, 1e-2, 1.0, 1e2)
FLOATS = st.floats(-1e3, 1e3, allow_nan=False, width=64)


def _row(method: str, repeat: int, delta: float, nll: float, ece: float = 0.05, eval_set: str = "test",
         link: str = "probit_projected") -> dict:
    return {"method": method, "repeat": repeat, "prior_precision": delta, "eval_set": eval_set, "kind": eval_set,
            "severity": None, "link": link, "full_batch": method.endswith("_full"), "accuracy": 0.9, "nll": nll,
            "ece": ece, "brier": 0.1}


def _curves(full: list[float], draws: dict[str, list[list[float]]]) -> list[dict]:
    rows = [_row("kron_full", 0, d, v) for d, v in zip(GRID, full)]
    for method, per_draw in draws.items():
        rows += [_row(method, r, d, v) for r, vals in enumerate(per_draw) for d, v in zip(GRID, vals)]
    return rows


def test_gap_is_the_largest_relative_difference_over_the_grid_per_draw():
    full = [2.0, 1.0, 0.5, 0.25]
    rows = _curves(full, {"kron_single": [[2.2, 1.0, 0.5, 0.25], [2.0, 1.0, 0.6, 0.25]]})
    # draw 0: |2.2 - 2| / 2 = 0.1; draw 1: |0.6 - 0.5| / 0.5 = 0.2
    assert max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected") == pytest.approx([0.1, 0.2])
    # absolute: 0.2 and 0.1
    assert max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected",
                            relative=False) == pytest.approx([0.2, 0.1])


def test_signed_gaps_per_prior_precision_keep_their_direction():
    full = [2.0, 1.0, 0.5, 0.25]
    rows = _curves(full, {"kron_single": [[2.2, 1.0, 0.4, 0.25]]})
    # (2.2 - 2) / 2 = +0.1 above the reference, (0.4 - 0.5) / 0.5 = -0.2 below it
    curves = gap_curves(rows, "kron_single", "kron_full", "test", "probit_projected")
    assert list(curves) == [0] and list(curves[0]) == list(GRID)
    assert list(curves[0].values()) == pytest.approx([0.1, 0.0, -0.2, 0.0])
    absolute = gap_curves(rows, "kron_single", "kron_full", "test", "probit_projected", relative=False)
    assert list(absolute[0].values()) == pytest.approx([0.2, 0.0, -0.1, 0.0])
    assert max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected") == pytest.approx([0.2])


@settings(max_examples=40, deadline=None)
@given(gaps=hnp.arrays(np.float64, st.tuples(st.integers(1, 6), st.just(len(GRID))), elements=FLOATS))
def test_where_the_largest_gap_lies_counts_each_draw_once_at_its_maximum(gaps):
    curves = {r: dict(zip(GRID, map(float, row))) for r, row in enumerate(gaps)}
    where = where_largest(curves)
    assert sum(where.values()) == len(gaps) and list(where) == sorted(where)
    for delta, count in where.items():
        column = GRID.index(delta)
        at_max = [r for r, row in enumerate(np.abs(gaps)) if row[column] == row.max() and row.argmax() == column]
        assert len(at_max) == count


@settings(max_examples=40, deadline=None)
@given(full=st.lists(st.floats(0.05, 5.0), min_size=4, max_size=4),
       mini=st.lists(st.floats(0.05, 5.0), min_size=4, max_size=4))
def test_largest_gap_of_two_curves_is_the_rows_tracking_error(full, mini):
    rows = _curves(full, {"kron_single": [mini]})
    for relative in (True, False):
        assert largest_gap(mini, full, relative) == pytest.approx(
            max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected", relative=relative)[0])
    with pytest.raises(ValueError, match="equal, non-zero length"):
        largest_gap(mini, full[:-1])


@settings(max_examples=30, deadline=None)
@given(gaps=hnp.arrays(np.float64, st.tuples(st.integers(1, 5), st.just(len(GRID))), elements=FLOATS))
def test_curves_survive_their_json_form(gaps):
    curves = {r: dict(zip(GRID, map(float, row))) for r, row in enumerate(gaps)}
    by_delta = curves_to_json(curves)
    assert list(by_delta) == [repr(d) for d in GRID]
    assert curves_from_json(by_delta) == curves


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=2, max_size=20))
def test_mean_and_standard_error_of_draws(values):
    """``s / √n`` with the ``n − 1`` standard deviation of :mod:`statistics`; NaN for one draw."""
    import statistics

    mean, se = mean_stderr(values)
    assert mean == pytest.approx(statistics.fmean(values), abs=1e-9)
    assert se == pytest.approx(statistics.stdev(values) / len(values) ** 0.5, rel=1e-9, abs=1e-9)
    assert np.isnan(mean_stderr(values[:1])[1])
    assert mean_stderr_text([1.0, 2.0, 3.0], 2) == f"+2.00 ± {1 / 3 ** 0.5:.2f}"


def test_only_rows_of_the_asked_set_link_and_shared_prior_precisions_count():
    rows = _curves([1.0] * 4, {"kron_single": [[1.1] * 4]})
    rows += [_row("kron_single", 0, 1.0, 9.0, eval_set="validation"), _row("kron_single", 0, 1.0, 9.0, link="mc"),
             _row("kron_single", 0, 1e4, 9.0)]  # δ = 1e4: the reference has no row there
    assert max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected") == pytest.approx([0.1])


@settings(max_examples=40, deadline=None)
@given(full=st.lists(st.floats(0.05, 5.0), min_size=4, max_size=4),
       mini=st.lists(st.floats(0.05, 5.0), min_size=4, max_size=4),
       scale=st.floats(0.1, 10.0), seed=st.integers(0, 2**16))
def test_relative_gap_is_invariant_to_units_and_row_order_and_zero_against_itself(full, mini, scale, seed):
    rows = _curves(full, {"kron_single": [mini]})
    gap = max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected")
    scaled = [{**r, "nll": scale * r["nll"]} for r in rows]
    random.Random(seed).shuffle(scaled)
    assert max_gap_per_draw(scaled, "kron_single", "kron_full", "test", "probit_projected") == pytest.approx(gap)
    assert max_gap_per_draw(rows, "kron_full", "kron_full", "test", "probit_projected") == [0.0]
    assert gap[0] == pytest.approx(max(abs(m - f) / f for m, f in zip(mini, full)))


def test_a_method_without_shared_prior_precisions_is_an_error():
    rows = [_row("kron_full", 0, 1.0, 1.0), _row("kron_single", 0, 2.0, 1.0)]
    with pytest.raises(ValueError, match="share no prior precision"):
        max_gap_per_draw(rows, "kron_single", "kron_full", "test", "probit_projected")
    with pytest.raises(ValueError, match="no 'nll' rows of the reference"):
        max_gap_per_draw(rows, "kron_single", "ekfac_full", "test", "probit_projected")


def test_the_reference_is_the_full_batch_method_of_the_same_structure():
    full = ["kron_full", "ekfac_full"]
    assert reference_of("kron_debiased", full) == "kron_full"
    assert reference_of("ekfac_single", full) == "ekfac_full"
    assert reference_of("lowrank_single", full) is None


def _setting(b: int, n: int) -> dict:
    label = {"kron_single": f"single {b}", "kron_debiased": f"debiased {b // 2} + {b // 2}", "kron_full": f"full {n}"}
    samples = {"kron_single": b, "kron_debiased": b, "kron_full": n}
    return {"data": "toy", "n_train": n, "model": "toy", "n_params": 10, "subset": "all",
            "methods": {m: {"label": label[m], "description": label[m], "samples": samples[m]} for m in label}}


@pytest.mark.parametrize("debiased_closer", [True, False])
def test_report_tabulates_the_gaps_and_says_whether_debiasing_helped_at_equal_samples(tmp_path, debiased_closer):
    full = [1.0, 0.8, 0.6, 0.5]
    near, far = [[v * 1.01 for v in full]] * 2, [[v * 1.2 for v in full]] * 2
    draws = {"kron_single": far if debiased_closer else near, "kron_debiased": near if debiased_closer else far}
    rows = _curves(full, draws) + [_row("map", 0, None, 0.9, link="map")]
    text = write_report(rows, tmp_path / "rep", setting=_setting(64, 300)).read_text()
    section = text.split("## Tracking the full batch over the whole grid")[1].split("\n## ")[0]
    single_gap = "20 [20, 20]" if debiased_closer else "1 [1, 1]"
    assert f"| single 64 | 64 | 2 | {single_gap} |" in section
    # the gap is the same at every δ: each draw's largest lies at the first, and the figure is linked
    assert "| 0.0001: 2 |" in section
    assert "](tracking_by_delta.png)" in section and (tmp_path / "rep" / "tracking_by_delta.png").is_file()
    word = "more" if debiased_closer else "less"
    assert f"debiased 32 + 32 tracks the full batch {word} closely than single 64 with the same samples" in section
    # only a debiased LA that loses is explained, with the batch's share of N
    assert ("64 of N = 300 training points (21 %)" in section) is not debiased_closer


def test_report_says_an_order_within_the_spread_over_draws_is_no_order(tmp_path):
    """Three draws whose paired gap differences (-2, +4, -4 %) have a mean (-0.7 %) well inside
    t = 4.30 standard errors (3.5 %): the report names no closer fit and no explanation."""
    full = [1.0, 0.8, 0.6, 0.5]
    draws = {"kron_single": [[v * (1 + g) for v in full] for g in (0.05, 0.02, 0.08)],
             "kron_debiased": [[v * (1 + g) for v in full] for g in (0.03, 0.06, 0.04)]}
    rows = _curves(full, draws) + [_row("map", 0, None, 0.9, link="map")]
    text = write_report(rows, tmp_path / "rep", setting=_setting(64, 300)).read_text()
    section = text.split("## Tracking the full batch over the whole grid")[1].split("\n## ")[0]
    assert ("debiased 32 + 32 against single 64 with the same samples (4.3 % against 5.0 %): which tracks the "
            "full batch more closely is within the spread over draws.") in section
    assert "tracks the full batch more closely than" not in section and "less closely" not in section
    assert "of N = 300" not in section


def test_paired_margin_is_students_t_quantile():
    """The textbook two-sided 95 % values: t(2) = 4.303, t(15) = 2.131, and the normal 1.960 in the limit."""
    assert paired_margin(3) == pytest.approx(4.303, abs=5e-4)
    assert paired_margin(16) == pytest.approx(2.131, abs=5e-4)
    assert paired_margin(10**6) == pytest.approx(1.960, abs=5e-4)
    with pytest.raises(ValueError, match="at least 2 draws"):
        paired_margin(1)


@pytest.mark.parametrize("mean, clear", [(-0.026, True), (-0.023, False), (0.026, False)])
def test_clearly_below_where_the_paired_mean_clears_t_standard_errors(mean, clear):
    """Differences ``mean + 0.01 · (-1, 0, 1)``: standard deviation 0.01, standard error 0.01/√3, so
    the boundary is ``mean = -4.303 · 0.00577 = -0.0248``."""
    b = np.array([0.3, 0.5, 0.7])
    a = b + mean + 0.01 * np.array([-1.0, 0.0, 1.0])
    assert clearly_below(a, b) is clear


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=3, max_size=3))
def test_a_difficulty_shared_by_both_fits_in_a_draw_does_not_blur_the_order(shared):
    """Pairing: adding the same per-draw offset to both fits' values leaves the verdict; a constant
    lead of 0.01 is clear however much the draws differ from each other."""
    b = np.array([0.10, 0.11, 0.12])
    a = b - 0.01 + np.array([0.0, 1e-3, -1e-3])
    assert clearly_below(a, b) and clearly_below(a + shared, b + shared)
    assert not clearly_below(b + shared, a + shared)


def test_clearly_below_needs_paired_draws():
    assert not clearly_below([0.1], [0.2])  # one draw: no spread, no order
    with pytest.raises(ValueError, match="paired draws"):
        clearly_below([0.1, 0.2], [0.2, 0.3, 0.4])


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

"""The prior-precision grid: the rounding rule, checking, the default, extension and the choice."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from laplace_debiased.prior_grid import (
    DEFAULT_PRIOR_PRECISIONS, PriorGrid, choose_prior_precision, round_precision,
)

# positive normal floats well inside the range where one log step beyond an edge stays finite
deltas = st.floats(min_value=1e-20, max_value=1e20, allow_nan=False, allow_infinity=False)
any_float = st.floats(allow_nan=False, allow_infinity=False)
#: no per-example deadline: the machine is shared and nothing here may depend on timing
untimed = settings(deadline=None, max_examples=200)


@untimed
@given(any_float)
def test_rounding_is_idempotent_and_keeps_six_significant_digits(x):
    r = round_precision(x)
    assert round_precision(r) == r
    # the decimal rounding to 6 digits moves a value by at most half a unit in its 6th digit
    assert abs(r - x) <= 0.5e-5 * abs(x) * (1 + 1e-9) + 1e-320


@untimed
@given(st.lists(deltas, min_size=1, max_size=20))
def test_parse_rounds_keeps_order_and_refuses_repeats(values):
    rounded = [round_precision(v) for v in values]
    if len(set(rounded)) < len(rounded):
        with pytest.raises(ValueError, match="repeated prior precision"):
            PriorGrid.parse(values)
        return
    grid = PriorGrid.parse(values)
    assert grid.values == tuple(rounded) and list(grid) == rounded and len(grid) == len(values)
    assert PriorGrid.parse(grid.values) == grid  # parsing a grid again changes nothing


@pytest.mark.parametrize("values, match", [
    ((), "at least one"), ((0.0, 1.0), "positive"), ((-1.0,), "positive"), ((float("nan"),), "positive"),
    ((float("inf"),), "positive"), ((1.0, 1.0), "repeated"), ((1.0, 1.0000000001), "repeated"),
])
def test_bad_grids_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        PriorGrid.parse(values)


def test_the_grid_is_immutable_and_checked_when_built_directly():
    with pytest.raises(AttributeError):
        PriorGrid.default().values = (1.0,)
    with pytest.raises(ValueError, match="repeated"):
        PriorGrid([1.0, 2.0, 1.0])
    assert PriorGrid([1.0, 1 / 3]).values == (1.0, 1 / 3)  # values read back from rows are kept as they are


def test_default_grid_is_the_papers_log_spaced_grid_plus_ten():
    grid = PriorGrid.default()
    assert grid.values == DEFAULT_PRIOR_PRECISIONS and len(grid) == 14
    logs = [math.log10(d) for d in grid.values[:13]]
    assert logs[0] == pytest.approx(-4.0) and logs[-1] == pytest.approx(0.0)
    # rounding to 6 significant digits moves log10 by at most log10(1 + 5e-6)
    assert all(b - a == pytest.approx(1 / 3, abs=5e-6) for a, b in zip(logs, logs[1:]))
    assert grid.values[-1] == 10.0


def _distinct_grid(values: list[float]) -> PriorGrid | None:
    rounded = sorted({round_precision(v) for v in values})
    return PriorGrid(tuple(rounded)) if len(rounded) >= 2 else None


@untimed
@given(st.lists(deltas, min_size=2, max_size=12), st.sampled_from(["low", "high", "both"]))
# found in a fresh clone: the log step above 1e20 (ratio 1.000004) rounds back onto the edge
@example(values=[9.999955e19, 9.999995e19], where="high")
def test_extension_keeps_the_grid_and_adds_one_point_beyond_each_chosen_edge(values, where):
    grid = _distinct_grid(values)
    if grid is None:
        return
    d = sorted(grid.values)
    chosen = {"low": [d[0]], "high": [d[-1]], "both": [d[-1], d[0]]}[where]
    new = grid.extension(chosen)
    grown = grid.union(new)
    assert set(grid.values) <= set(grown.values)
    assert len(grown) == len(grid) + len(new) == len(grid) + (2 if where == "both" else 1)
    assert grown.n_outside(grid) == len(new)
    assert list(new) == sorted(new)
    below, above = [v for v in new if v < d[0]], [v for v in new if v > d[-1]]
    assert len(below) == (where in ("low", "both")) and len(above) == (where in ("high", "both"))
    # each step is the edge's own log spacing, to the rounding: half a unit in the 6th significant
    # digit, or less than one unit where it fell back to the next 6-digit value (a unit is at most
    # 1e-5 of the value, so log moves by at most 1e-5)
    for v, (edge, inner) in [(b, (d[0], d[1])) for b in below] + [(a, (d[-1], d[-2])) for a in above]:
        assert math.log(v) == pytest.approx(2 * math.log(edge) - math.log(inner), abs=1e-5)


@untimed
@given(st.lists(deltas, min_size=1, max_size=12), st.data())
def test_no_extension_without_a_choice_on_an_edge(values, data):
    grid = PriorGrid(tuple(sorted({round_precision(v) for v in values})))
    interior = [v for v in grid.values if not grid.on_edge(v)]
    chosen = data.draw(st.lists(st.sampled_from(interior), max_size=3)) if interior else []
    assert grid.extension(chosen) == ()
    if len(grid) == 1:  # one point has no spacing: never extended
        assert grid.extension(grid.values) == ()


def test_extension_examples_and_a_step_beyond_the_floats():
    grid = PriorGrid.parse([1.0, 10.0, 100.0])
    assert grid.extension([100.0]) == (1000.0,)
    assert grid.extension([1.0, 100.0]) == (0.1, 1000.0)
    assert PriorGrid.parse([1e-3, 1e-2, 1.0]).extension([1e-3]) == (1e-4,)
    with pytest.raises(ValueError, match="fewer orders of magnitude"):
        PriorGrid.parse([1e-300, 1e300]).extension([1e300])
    with pytest.raises(ValueError, match="fewer orders of magnitude"):
        PriorGrid.parse([1e-300, 1e300]).extension([1e-300])


@untimed
@given(st.lists(deltas, min_size=2, max_size=12, unique=True), st.sampled_from(["low", "high", "both"]))
def test_extension_of_unrounded_values_lies_beyond_the_edges_and_is_rounded(values, where):
    """Grids built from values as they are (read back from rows): each new value is strictly
    beyond its edge, however fine the step, and already rounded (rows compare by ``==``)."""
    grid = PriorGrid(tuple(values))
    d = sorted(values)
    chosen = {"low": [d[0]], "high": [d[-1]], "both": [d[-1], d[0]]}[where]
    new = grid.extension(chosen)
    assert len(new) == (2 if where == "both" else 1)
    assert all(round_precision(v) == v for v in new)
    assert (where == "high" or new[0] < d[0]) and (where == "low" or new[-1] > d[-1])


def test_a_step_finer_than_the_rounding_still_leaves_the_grid():
    """A log step that rounds back onto the edge (here 1.000001 above 1, where the 6th significant
    digit is 1e-5) extends by the next 6-digit value beyond it instead of adding nothing."""
    grid = PriorGrid.parse([0.999999, 1.0])
    assert grid.extension([1.0]) == (1.00001,)
    assert grid.extension([0.999999]) == (0.999998,)
    assert len(grid.union(grid.extension([1.0, 0.999999]))) == 4


scores = st.one_of(st.sampled_from([0.0, 1.0, 2.0]), st.just(float("nan")), st.just(float("inf")),
                   st.floats(min_value=-5.0, max_value=5.0))


@untimed
@given(st.dictionaries(deltas.map(round_precision), scores, max_size=10), st.sampled_from(["nll", "log_marglik"]))
def test_choice_is_the_best_finite_score_with_ties_to_the_smallest_delta(by_delta, criterion):
    sign = 1.0 if criterion == "nll" else -1.0
    finite = [(sign * s, d) for d, s in by_delta.items() if math.isfinite(s)]
    expected = min(finite)[1] if finite else None
    assert choose_prior_precision(by_delta, criterion) == expected


def test_choice_examples_and_unknown_criterion():
    assert choose_prior_precision({1.0: 0.2, 0.1: 0.2, 10.0: 0.3}) == 0.1
    assert choose_prior_precision({1.0: 0.2, 0.1: 0.2, 10.0: 0.3}, "log_marglik") == 10.0
    assert choose_prior_precision({1.0: float("nan")}) is None
    with pytest.raises(ValueError, match="criterion"):
        choose_prior_precision({1.0: 0.0}, "accuracy")


@untimed
@given(st.lists(deltas.map(round_precision), min_size=1, max_size=10, unique=True), st.data(),
       st.sampled_from(["nll", "log_marglik"]))
def test_a_grid_chooses_from_scores_in_its_order(values, data, criterion):
    scores_ = data.draw(st.lists(scores, min_size=len(values), max_size=len(values)))
    grid = PriorGrid(tuple(values))
    chosen = grid.choose(scores_, criterion)
    assert chosen == choose_prior_precision(dict(zip(values, scores_)), criterion)
    finite = [s for s in scores_ if math.isfinite(s)]
    if finite and criterion == "nll":  # an ascending grid of finite scores: the first lowest, as argmin
        ascending = sorted(zip(values, scores_))
        firsts = [d for d, s in ascending if math.isfinite(s) and s == min(finite)]
        assert chosen == firsts[0]
    with pytest.raises(ValueError, match="one score per prior precision"):
        grid.choose([*scores_, 0.0], criterion)

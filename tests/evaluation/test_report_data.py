"""report_data: the chosen prior precisions and the grouping of result rows."""

from __future__ import annotations

from laplace_debiased.evaluation.report_data import chosen_prior_precisions, mean_by
from tests.evaluation.test_report_page import report_rows


def test_best_prior_precision_minimises_mean_nll():
    rows = report_rows()
    assert chosen_prior_precisions(rows, "test", "probit_projected") == {"kron": 0.1, "kron full": 0.1}


def test_mean_by_groups_the_metric_by_key_and_skips_missing_values():
    rows = [{"m": "a", "d": 1.0, "nll": 2.0}, {"m": "a", "d": 1.0, "nll": 4.0},
            {"m": "b", "d": 1.0, "nll": None}, {"m": "b", "d": 2.0}]
    assert dict(mean_by(rows, ("m", "d"), "nll")) == {("a", 1.0): [2.0, 4.0]}

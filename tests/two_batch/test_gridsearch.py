"""The grid search of the debiased classes chooses δ by the package's choice rule
(``prior_grid.choose_prior_precision``) on both of its paths: the one-pass grid scores and
laplace-torch's per-point ``validate``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from laplace import Laplace
from torch import nn

import laplace_debiased  # noqa: F401
from laplace_debiased.prior_grid import choose_prior_precision
from laplace_debiased.two_batch import gridsearch
from laplace_debiased.two_batch.gridsearch import lowest_score_point

NAN, INF = math.nan, math.inf
#: prior precisions exact in float32, so that ``la.prior_precision`` reads back as the same key
INTERVAL = torch.tensor([8.0, 2.0, 0.5, 0.125])


def _search(monkeypatch, scores: list[float], one_pass: bool) -> torch.Tensor:
    """``la._gridsearch`` over :data:`INTERVAL` with the score of each point given: from the
    one-pass scores (``one_pass``) or from laplace-torch's per-point ``validate``."""
    la = Laplace(nn.Linear(3, 2), "classification", hessian_structure="debiased_kron")
    by_delta = dict(zip(INTERVAL.tolist(), scores))
    monkeypatch.setattr(gridsearch, "gridsearch_supported", lambda *a: one_pass)
    monkeypatch.setattr(gridsearch, "grid_validation_scores", lambda la, loss, interval, *a: list(scores))
    monkeypatch.setattr(gridsearch, "validate", lambda la, *a, **k: by_delta[float(la.prior_precision)])
    return la._gridsearch(lambda p, y: 0.0, INTERVAL, [], pred_type="glm", link_approx="probit")


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("scores", [
    [0.5, 0.3, 0.4, 0.6],            # one lowest score
    [0.5, NAN, 0.2, 0.2],            # NaN skipped (an argmin would choose it); tie to the smaller δ
    [INF, 0.7, INF, 0.9],            # a failed point (inf) never wins
    [0.2, 0.9, 0.2, NAN],            # a tie far apart in the grid: the smaller δ
])
def test_both_paths_choose_by_the_package_rule(monkeypatch, scores, one_pass):
    chosen = _search(monkeypatch, scores, one_pass)
    expected = choose_prior_precision(dict(zip(INTERVAL.tolist(), scores)), "nll")
    assert float(chosen) == expected
    assert math.isfinite(scores[INTERVAL.tolist().index(expected)])
    assert scores[INTERVAL.tolist().index(expected)] == min(s for s in scores if math.isfinite(s))


@pytest.mark.parametrize("one_pass", [True, False])
def test_no_finite_score_gives_the_first_point_as_laplace_torch(monkeypatch, one_pass):
    assert float(_search(monkeypatch, [NAN, INF, NAN, INF], one_pass)) == 8.0


def test_lowest_score_point_returns_the_element_of_the_interval():
    interval = torch.logspace(-4, 4, 9, dtype=torch.float64)
    point = lowest_score_point(interval, [float(abs(k - 5)) for k in range(9)])
    assert point.dtype == torch.float64 and point.ndim == 0 and float(point) == float(interval[5])


REMINDER = "By default `link_approx` is `probit`"


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full"])
@pytest.mark.parametrize("method", ["gridsearch", "marglik"])
def test_link_approx_reminder_only_when_link_approx_is_left_out(structure, method):
    """laplace-torch reminds on every classification call that ``link_approx`` defaults to probit;
    a call that passes ``link_approx`` has acted on it and is not reminded, one that leaves it out is."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(loader)
    search = {"val_loader": loader, "grid_size": 3} if method == "gridsearch" else {"n_steps": 2}
    reminders = []
    for given in ({"link_approx": "probit"}, {}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            la.optimize_prior_precision(method=method, pred_type="glm", **search, **given)
        reminders.append(sum(REMINDER in str(w.message) for w in caught))
    assert reminders == [0, 1]

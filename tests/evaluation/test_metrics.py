"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from laplace_debiased.evaluation import metrics

P = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4], [0.3, 0.3, 0.4], [0.9, 0.05, 0.05]])
Y = torch.tensor([0, 2, 2, 1])


def test_accuracy_nll_brier_by_hand():
    assert metrics.accuracy(P, Y) == pytest.approx(2 / 4)
    assert metrics.nll(P, Y) == pytest.approx(-(math.log(0.7) + math.log(0.4) + math.log(0.4) + math.log(0.05)) / 4)
    brier = [
        0.3**2 + 0.2**2 + 0.1**2,
        0.1**2 + 0.5**2 + 0.6**2,
        0.3**2 + 0.3**2 + 0.6**2,
        0.9**2 + 0.95**2 + 0.05**2,
    ]
    assert metrics.brier(P, Y) == pytest.approx(sum(brier) / 4, rel=1e-6)


def test_ece_by_hand_and_reliability_bins_agree():
    # confidences 0.7, 0.5, 0.4, 0.9 fall into four different 1/15-wide bins; correct: 1, 0, 1, 0
    expected = (abs(0.7 - 1) + abs(0.5 - 0) + abs(0.4 - 1) + abs(0.9 - 0)) / 4
    assert metrics.ece(P, Y) == pytest.approx(expected, rel=1e-5)
    bins = metrics.reliability_bins(P, Y)
    count = torch.tensor(bins["count"])
    assert count.sum() == 4 and (count > 0).sum() == 4
    conf = torch.tensor(bins["confidence"])
    acc = torch.tensor(bins["accuracy"])
    ok = count > 0
    ece_from_bins = float((count[ok] * (conf[ok] - acc[ok]).abs()).sum() / 4)
    assert ece_from_bins == pytest.approx(expected, rel=1e-5)


def test_normalized_entropy_range_and_values():
    p = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(
        metrics.normalized_entropy(p), torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    )


def test_ood_metrics_by_hand_and_no_sigmoid_squashing():
    C = 100
    sharp = torch.full((3, C), 1e-4)
    sharp[:, 0] = 1 - 1e-4 * (C - 1)
    uniform = torch.full((2, C), 1.0 / C)
    mixed = torch.softmax(torch.randn(2, C, generator=torch.Generator().manual_seed(0)), -1)
    # perfectly separated: in-distribution sharp, OOD uniform
    res = metrics.ood_metrics(sharp, uniform)
    assert res == pytest.approx({"auroc": 1.0, "aupr": 1.0, "fpr95": 0.0})
    # hand-computed ranking: in = [sharp, sharp, uniform], out = [mixed, mixed]
    # entropies: sharp < mixed < uniform, so each OOD beats 2 of 3 in-dist. examples
    res = metrics.ood_metrics(torch.cat([sharp[:2], uniform[:1]]), mixed)
    assert res["auroc"] == pytest.approx(4 / 6)
    assert res["fpr95"] == pytest.approx(1 / 3)  # detect both OOD: only the uniform one is above
    # AP: positives ranked 2nd and 3rd -> (1/2 + 2/3) / 2
    assert res["aupr"] == pytest.approx((1 / 2 + 2 / 3) / 2)


def test_classification_metrics_and_errors():
    out = metrics.classification_metrics(P, Y)
    assert set(out) == {"accuracy", "nll", "ece", "brier", "confidence"}
    assert out["confidence"] == pytest.approx((0.7 + 0.5 + 0.4 + 0.9) / 4)
    with pytest.raises(ValueError, match="NaN"):
        metrics.nll(torch.tensor([[float("nan"), 1.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="shape"):
        metrics.accuracy(P, Y[:2])
    with pytest.raises(ValueError, match="classes"):
        metrics.ood_metrics(P, P[:, :2])


def _random_probs(n: int, C: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, C, generator=g, dtype=dtype)
    return torch.softmax(logits, -1), torch.randint(0, C, (n,), generator=g)


def test_ece_equals_torchmetrics_including_confidence_one():
    """The bins of torchmetrics' multiclass_calibration_error, confidence 1 in its own bin;
    torchmetrics sums in float32, so they agree to float32 round-off of N terms (N u₃₂)."""
    from torchmetrics.functional.classification import multiclass_calibration_error

    P, y = _random_probs(500, 5, 0)
    P[:40] = torch.nn.functional.one_hot(y[:40], 5).float()  # right with confidence exactly 1
    P[40:60] = torch.nn.functional.one_hot((y[40:60] + 1) % 5, 5).float()  # wrong with confidence 1
    want = float(multiclass_calibration_error(P, y, num_classes=5, n_bins=metrics.ECE_BINS, norm="l1"))
    assert metrics.ece(P, y) == pytest.approx(want, abs=len(P) * 2.0**-24)
    assert metrics.reliability_bins(P, y)["count"][-1] >= 60  # confidence 1 in the last diagram bin


@pytest.mark.parametrize("cut", [0, 1, 137, 300])
def test_sums_of_a_split_set_give_the_metrics_of_the_whole(cut):
    """Metrics from the added sums of two parts equal the whole set's to the round-off of
    summing N non-negative float64 terms in another order: 2 N u₆₄ relative (ECE: its bins'
    sums add to at most accuracy + confidence <= 2, so 4 N u₆₄ absolute)."""
    P, y = _random_probs(300, 7, 1, torch.float64)
    whole = metrics.classification_sums(P, y)
    parts = metrics.add_sums([metrics.classification_sums(P[:cut], y[:cut]), metrics.classification_sums(P[cut:], y[cut:])])
    assert parts["count"] == whole["count"] and torch.equal(parts["bin_count"], whole["bin_count"])
    u, n = 2.0**-53, len(P)
    got, want = metrics.metrics_from_sums(parts), metrics.metrics_from_sums(whole)
    assert want == metrics.classification_metrics(P, y)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=2 * n * u, abs=4 * n * u if key == "ece" else 0), key
    # the OOD scores of the parts, concatenated, are the whole set's
    scores = torch.cat([metrics.ood_scores(P[:cut]), metrics.ood_scores(P[cut:])])
    assert torch.equal(scores, metrics.ood_scores(P))


def test_no_rows_give_zero_sums_and_no_metrics():
    sums = metrics.classification_sums(torch.empty(0, 3), torch.empty(0, dtype=torch.long))
    assert all(float(t.abs().sum()) == 0 for t in sums.values())
    with pytest.raises(ValueError, match="empty"):
        metrics.metrics_from_sums(sums)

"""The summary of a bias diagnosis (:mod:`laplace_debiased.diagnostics.summary`) on least squares:
same-batch bias against independent batches, the batch-size ladder, Eq. 5 and Eq. 7."""

from __future__ import annotations

from laplace_debiased.diagnostics.summary import summarize


def test_same_batch_overestimates_independent_batch_does_not(diagnosis):
    s = summarize(diagnosis)
    same = s["eigen"]["curvature_bias_same_batch"]
    other = s["eigen"]["curvature_bias_other_batches"]
    # rank-8 batch matrices of a 24-dimensional problem: the top is inflated far beyond noise
    assert same["q25"] > 0.3
    assert abs(other["median"]) < 0.25 < same["median"]
    # the bias shrinks with the batch size, and the ladder names a batch size for the tolerance
    medians = [r["same_batch"]["median"] for r in s["batch_size_ladder"]]
    assert medians[0] > medians[-1]
    assert s["batch_size_within_tolerance"] is None or s["batch_size_within_tolerance"] > 8
    # Eq. 5 in float64, Eq. 7 on the full data's top eigenvalue
    assert s["eq5_max_relative_residual"] < 1e-12
    assert s["eq7_top_eigenvalue"]["same_batch_mean"] > s["eq7_top_eigenvalue"]["full_data"]

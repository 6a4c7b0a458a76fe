"""Which eigenpairs to keep (:mod:`laplace_debiased.curvature.thresholds`): a floor relative to
the largest eigenvalue, never a non-positive one, the vectors kept with their values."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.curvature.thresholds import EigenPairs, above_relative_floor, threshold_eigenpairs


def test_the_floor_is_relative_to_the_largest_and_excludes_non_positive_values():
    values = torch.tensor([10.0, 1.0, 0.05, 0.0, -1e-9])
    assert above_relative_floor(values, 0.01).tolist() == [True, True, False, False, False]
    assert above_relative_floor(values, 0.0).tolist() == [True, True, True, False, False]
    assert above_relative_floor(100 * values, 0.01).tolist() == above_relative_floor(values, 0.01).tolist()


@pytest.mark.parametrize("values", [torch.zeros(0), torch.tensor([0.0, -1.0]), torch.tensor([-2.0])])
def test_nothing_is_kept_without_a_positive_value(values):
    mask = above_relative_floor(values, 1e-3)
    assert mask.dtype == torch.bool and mask.shape == values.shape and not mask.any()


def test_thresholded_pairs_keep_their_vectors_and_method():
    vectors = torch.linalg.qr(torch.randn(6, 4, generator=torch.Generator().manual_seed(0))).Q
    pairs = EigenPairs(torch.tensor([5.0, 2.0, 1e-4, 0.0]), vectors, "gram")
    kept = threshold_eigenpairs(pairs, 1e-3)
    assert kept.method == "gram" and kept.values.tolist() == [5.0, 2.0]
    assert torch.equal(kept.vectors, vectors[:, :2])
    # the dropped directions change the matrix by at most rtol · max value
    dense = lambda p: (p.vectors * p.values) @ p.vectors.T  # noqa: E731
    assert float(torch.linalg.matrix_norm(dense(pairs) - dense(kept), 2)) <= 1e-3 * 5.0

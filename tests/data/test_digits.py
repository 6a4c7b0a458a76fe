"""The embedded digits (:mod:`laplace_debiased.data.digits`): shapes and range, a seeded split
that is disjoint and complete, and refused split sizes."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.data.digits import digits_splits, load_digits_tensors


def test_tensors_are_scaled_images_and_labels():
    X, y = load_digits_tensors()
    assert X.shape == (1797, 1, 8, 8) and X.dtype == torch.float32 and y.dtype == torch.int64
    assert float(X.min()) == 0.0 and float(X.max()) == 1.0
    assert torch.equal(torch.unique(X * 16), torch.arange(17, dtype=torch.float32))  # raw 0..16
    assert torch.equal(torch.unique(y), torch.arange(10))


def _key(X: torch.Tensor, y: torch.Tensor) -> list[tuple]:
    return sorted((tuple(x.flatten().tolist()), int(t)) for x, t in zip(X, y))


def test_split_sizes_and_the_parts_are_a_partition():
    X, y = load_digits_tensors()
    parts = digits_splits(n_val=97, n_test=200, seed=1)
    assert {k: len(v) for k, v in parts.items()} == {"train": 1500, "val": 97, "test": 200}
    joined = [torch.cat([parts[k].tensors[i] for k in ("train", "val", "test")]) for i in (0, 1)]
    assert _key(*joined) == _key(X, y)  # every image once


def test_the_split_is_seeded():
    a, b, c = digits_splits(seed=0), digits_splits(seed=0), digits_splits(seed=1)
    assert len(a["train"]) == 300
    assert torch.equal(a["test"].tensors[0], b["test"].tensors[0])
    assert not torch.equal(a["test"].tensors[0], c["test"].tensors[0])


@pytest.mark.parametrize("n_val, n_test", [(-1, 10), (10, -1), (797, 1000), (0, 1797)])
def test_splits_that_leave_no_training_data_are_refused(n_val, n_test):
    with pytest.raises(ValueError, match="leave no training data"):
        digits_splits(n_val=n_val, n_test=n_test)

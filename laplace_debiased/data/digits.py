"""The embedded default data set: scikit-learn's 8x8 handwritten digits (1,797 images).

It ships inside the scikit-learn wheel, so the main job runs without any download.  Images are
returned as float32 tensors of shape ``(N, 1, 8, 8)`` scaled to [0, 1] (the raw values are
0..16); labels as int64 of shape ``(N,)``.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as ``(X, y)``: X float32 ``(1797, 1, 8, 8)`` in [0, 1], y int64."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    X = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return X, y


def digits_splits(
    n_val: int = 497, n_test: int = 1000, seed: int = 0
) -> dict[str, TensorDataset]:
    """Deterministic train/val/test split of the digits (seeded permutation).

    Returns a dict with keys ``"train"`` (1,797 - n_val - n_test images: 300 by default),
    ``"val"`` and ``"test"``.  The default training set is small on purpose: the default MAP
    overfits it to near-zero training loss and is overconfident on the 1,000 test images, the
    regime where a Laplace approximation helps (see
    [`laplace_debiased.evaluation.training.DIGITS_CONFIG`][laplace_debiased.evaluation.training.DIGITS_CONFIG]).
    The same seed always gives the same split, so curvature computed over the training set is reproducible.
    """
    X, y = load_digits_tensors()
    if n_val < 0 or n_test < 0 or n_val + n_test >= len(y):
        raise ValueError(f"n_val={n_val} and n_test={n_test} leave no training data (N={len(y)}).")
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, val, train = perm[:n_test], perm[n_test : n_test + n_val], perm[n_test + n_val :]
    return {
        "train": TensorDataset(X[train], y[train]),
        "val": TensorDataset(X[val], y[val]),
        "test": TensorDataset(X[test], y[test]),
    }

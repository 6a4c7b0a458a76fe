"""B and B̃ are disjoint by the sampler's indices, so data with repeated rows fits.

Token windows, categorical features or duplicated images put the same bytes at two dataset
indices. Within one pass of a sampler that draws without replacement, B and B̃ hold different
indices, so equal bytes in both are two samples, not one: the fit warns, naming the rows, and
goes on. A sampler that draws with replacement can put one index in both and is refused.
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from _models import loader, tiny_mlp, toy_data
from laplace_debiased.two_batch.batches import split_batches


def _repeated() -> TensorDataset:
    """24 samples; rows 9 and 13 repeat rows 1 and 2 (B = rows 0-7, B̃ = rows 8-15 in batches of 8)."""
    X, y = toy_data(24, (4,), 3, "classification").tensors
    X, y = X.clone(), y.clone()
    X[9], y[9] = X[1], y[1]
    X[13], y[13] = X[2], y[2]
    return TensorDataset(X, y)


def test_repeated_rows_warn_with_their_positions_and_fit():
    with pytest.warns(UserWarning, match=r"2 row\(s\).*magnitude batch 0 row 1 = direction batch 0 row 1"
                      r".*magnitude batch 0 row 5 = direction batch 0 row 2"):
        la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure="debiased_kron")
        la.fit(loader(_repeated(), 8))
    assert la.n_data == 24 and la.fit_batches[-1].magnitude_size == 8


def test_repeated_rows_split_like_distinct_rows():
    """The selection is by position: repeated rows change nothing about which samples form B, B̃."""
    ds = _repeated()
    with pytest.warns(UserWarning, match="different indices"):
        s = split_batches(loader(ds, 8), n_magnitude_batches=2)
    assert torch.equal(s.magnitude[0][0], ds.tensors[0][8:16])
    assert torch.equal(s.magnitude[1][0], ds.tensors[0][16:24])


def test_sampler_with_replacement_refused():
    ds = toy_data(24, (4,), 3, "classification")
    draws = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, replacement=True, num_samples=24))
    with pytest.raises(ValueError, match=r"replacement.*B and B̃ could share"):
        split_batches(draws)

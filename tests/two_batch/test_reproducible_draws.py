"""``generator=g`` is reproducible with a shuffling loader too.

A ``DataLoader(shuffle=True)`` without a generator of its own shuffles with torch's global RNG.
With ``generator`` the batch selection seeds that RNG from ``generator`` for the loader passes it
makes and restores it afterwards: the same seed gives the same B and B̃ whatever the global RNG
held, and the caller's global RNG stream is left as it was.
"""

from __future__ import annotations

import torch
from laplace import Laplace
from torch.utils.data import DataLoader

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from _models import tiny_mlp, toy_data
from laplace_debiased.two_batch.batches import split_batches

DS = toy_data(40, (4,), 3, "classification")


def _samples(batches) -> list[float]:
    """The samples of a list of batches (the first input coordinate identifies a sample)."""
    return [float(x) for b in batches for x in b[0][:, 0]]


def _split(global_seed: int, **kwargs):
    torch.manual_seed(global_seed)
    shuffling = DataLoader(DS, batch_size=8, shuffle=True)
    return split_batches(shuffling, generator=torch.Generator().manual_seed(0), **kwargs)


def test_same_generator_seed_same_batches_whatever_the_global_rng():
    for kwargs in ({}, {"split": "halves"}, {"n_direction_batches": 2, "n_magnitude_batches": 2}):
        a, b = _split(1, **kwargs), _split(2, **kwargs)
        assert _samples(a.direction) == _samples(b.direction), kwargs
        assert _samples(a.magnitude) == _samples(b.magnitude), kwargs


def test_the_selection_leaves_the_global_rng_as_it_was():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    _ = split_batches(DataLoader(DS, batch_size=8, shuffle=True), generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.rand(3), expected)


def test_fit_with_a_shuffling_loader_is_reproducible():
    """Two fits under different global RNG states give the same posterior precision (float64)."""

    def fit(global_seed: int) -> torch.Tensor:
        la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure="debiased_kron", generator=torch.Generator().manual_seed(0))
        torch.manual_seed(global_seed)  # after tiny_mlp, which seeds the global RNG itself
        la.fit(DataLoader(DS, batch_size=8, shuffle=True))
        return la.posterior_precision.to_matrix()

    torch.testing.assert_close(fit(1), fit(2), rtol=0, atol=0)


def test_the_generator_is_not_advanced_by_the_seeding():
    """The batch positions are ``generator``'s own permutation of the loader's batches, as
    without the seeding: seeded selections of non-shuffling loaders are unchanged."""
    positions = torch.randperm(5, generator=torch.Generator().manual_seed(3)).tolist()
    c = split_batches(DataLoader(DS, batch_size=8), generator=torch.Generator().manual_seed(3)).choice
    assert (c.direction, c.magnitude) == (tuple(positions[:1]), tuple(positions[1:2]))

"""The block-swap benchmark's hybrids (``benchmarks/block_swap.py``): swapping no block gives the
base posterior, swapping every block the other one, and the block kinds partition the blocks."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.block_swap import block_kinds, swapped
from benchmarks.normalisation import kron_fit
from laplace_debiased.posterior.from_laplace import posterior_structure
from laplace_debiased.posterior.jacobians import logit_jacobians
from tests._models import loader, toy_data


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(2 * 4 * 4, 3)).double().eval()


def _covariances(model, structure, X):
    params = list(model.parameters())
    _, jacs = logit_jacobians(model, params, X)
    return structure.covariances(structure.rotate(jacs), torch.tensor([1e-2, 1.0], dtype=torch.float64))


def test_swapping_no_block_or_every_block_gives_either_posterior():
    model = _bn_net()
    data = toy_data(24, (1, 6, 6), 3, "classification")
    one = loader(data, 12)
    single = kron_fit(model, one, magnitude_loader=one)
    paper = kron_fit(model, loader(data, 6), estimator="paper")
    shrunk = kron_fit(model, loader(data, 6), estimator="shrunk")
    kinds = block_kinds(shrunk)
    blocks = set(range(len(shrunk.correction.names)))
    assert set().union(*kinds.values()) == blocks and sum(map(len, kinds.values())) == len(blocks)
    assert all(kinds.values()), kinds  # this net has one block of each kind at least
    X = data.tensors[0][:5].double()
    for base, other in ((single, paper), (paper, single)):
        torch.testing.assert_close(_covariances(model, swapped(base, other, set()), X),
                                   _covariances(model, posterior_structure(base), X))
        torch.testing.assert_close(_covariances(model, swapped(base, other, blocks), X),
                                   _covariances(model, posterior_structure(other), X))
    mixed = _covariances(model, swapped(single, paper, kinds["convolutions"]), X)
    assert not torch.allclose(mixed, _covariances(model, posterior_structure(single), X))

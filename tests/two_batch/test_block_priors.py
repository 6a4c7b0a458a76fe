"""Layerwise marginal-likelihood prior tuning over normalisation blocks: one prior per block.

A normalisation layer's weight and bias share one dense curvature block in ``debiased_kron`` and
``debiased_ekfac``, so they take one prior precision. ``optimize_prior_precision(method="marglik",
prior_structure="layerwise")`` then optimises one log prior precision per curvature block and
gives both tensors of a block its value. Checked: it runs where it raised, the tied values are
equal, and the result is a local maximum of the marginal likelihood over the per-block precisions.
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch import nn

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from _models import loader, toy_data

#: parameter tensors: Linear(4, 3) weight, bias; LayerNorm weight, bias; Linear(3, 3) weight, bias
LN_TENSORS = (2, 3)


def _ln_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Tanh(), nn.Linear(3, 3)).double().eval()


def _fitted(structure: str):
    la = Laplace(_ln_net(), "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(loader(toy_data(48, (4,), 3, "classification"), 16))
    return la


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_layerwise_marglik_ties_the_block_and_maximises(structure):
    la = _fitted(structure)
    start = float(la.log_marginal_likelihood(prior_precision=torch.ones(6, dtype=torch.float64)))
    la.optimize_prior_precision(method="marglik", prior_structure="layerwise", n_steps=400, lr=0.05)
    delta = la.prior_precision
    assert delta.shape == (6,) and delta[LN_TENSORS[0]] == delta[LN_TENSORS[1]]
    assert not torch.all(delta == delta[0])  # the blocks got their own values
    best = float(la.log_marginal_likelihood(prior_precision=delta))
    assert best > start
    # a local maximum over the five per-block values: moving one block's log δ by ±0.1 lowers log Z
    blocks = [[0], [1], list(LN_TENSORS), [4], [5]]
    for block in blocks:
        for step in (-0.1, 0.1):
            moved = delta.clone()
            moved[block] = moved[block] * torch.exp(torch.tensor(step, dtype=torch.float64))
            assert float(la.log_marginal_likelihood(prior_precision=moved)) < best, (block, step)


def test_untied_initial_values_say_what_to_pass():
    la = _fitted("debiased_kron")
    init = torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="same value"):
        la.optimize_prior_precision(method="marglik", prior_structure="layerwise", init_prior_prec=init, n_steps=1)

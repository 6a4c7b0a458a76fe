"""Decompositions whose blocks span several parameter tensors (a normalisation layer's weight and
bias in one dense block): per-tensor prior precisions reach the right blocks."""

import pytest
import torch
from laplace import Laplace
from torch import nn

from tests._models import loader, toy_data
from laplace_debiased.kron.spanned import Spanned


def _fit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    la.fit(loader(toy_data(40, (4,), 3, "classification"), 10))
    return la


def test_per_tensor_prior_precisions_add_to_their_blocks():
    la = _fit()
    assert isinstance(la.H, Spanned) and la.H.spans == [1, 1, 2, 1, 1]
    numels = [p.numel() for p in la.model.parameters()]
    deltas = torch.tensor([1.0, 2.0, 3.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    P = (la.H + deltas).to_matrix()
    H = la.H.to_matrix()
    prior = torch.cat([torch.full((n,), float(d), dtype=torch.float64) for n, d in zip(numels, deltas)])
    assert torch.allclose(P, H + torch.diag(prior), atol=1e-10 * float(H.abs().max()))
    assert isinstance(la.H + deltas, Spanned) and (la.H * 2.0).spans == la.H.spans


def test_a_block_refuses_two_priors_for_its_tensors():
    la = _fit()
    with pytest.raises(ValueError, match="give them the same value"):
        la.H + torch.tensor([1.0, 2.0, 3.0, 3.5, 4.0, 5.0], dtype=torch.float64)

"""The fit-cost benchmark's floor (``benchmarks/fit_cost.py``, ``eigh_extra``): which factors it
times, and that the corrected and shrunk decompositions do two more ``eigh`` per factor than the
paper's, the premise of the floor under their cost ratio."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.fit_cost import dense_factor_pairs
from laplace_debiased.kron.decompose import proportional_blocks
from laplace_debiased.kron.laplace import DebiasedKronLaplace


def _fit(estimator: str) -> DebiasedKronLaplace:
    """A convolution (input factor 28-dimensional, 4 × 36 rows per batch) and two linear layers
    whose input factors (145 and 9 dimensions) are wider than B ∪ B̃'s 8 rows, so both routes occur."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.ReLU(),
                          nn.Linear(8, 3)).eval()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
    la = DebiasedKronLaplace(model, "classification", estimator=estimator)
    with warnings.catch_warnings():  # the corrected estimates leave wide inputs' weights prior-only: the coverage warning
        warnings.simplefilter("ignore", UserWarning)
        la.fit(DataLoader(data, batch_size=4))
    return la


def _eigh_calls(la: DebiasedKronLaplace, monkeypatch: pytest.MonkeyPatch) -> int:
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda A, *a, **k: calls.append(A.shape) or eigh(A, *a, **k))
    la._decompose()
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    return len(calls)


@pytest.mark.parametrize("estimator", ["corrected", "shrunk"])
def test_dense_factors_are_those_decomposed_densely(estimator):
    """A factor is timed exactly when the estimate's eigenvectors of it are square (d, d); a
    factor through the rows has ``(d, r)`` with ``r < d``."""
    la = _fit(estimator)
    dense = {id(D) for D, _ in dense_factor_pairs(la)}
    copies = proportional_blocks(la.H_facs.kfacs, la.H_facs_magnitude.kfacs)  # a bias takes its weight's
    square = {id(D) for k, (F, Q) in enumerate(zip(la.H_facs.kfacs, la.H.eigenvectors)) if k not in copies
              for D, U in zip(F, Q) if U.shape[0] == U.shape[1]}
    assert dense == square
    assert 0 < len(dense) < sum(len(F) for F in la.H_facs.kfacs)  # both routes occur


@pytest.mark.parametrize("estimator", ["corrected", "shrunk"])
def test_two_more_eigh_per_factor_than_the_paper(estimator, monkeypatch):
    """The floor's premise: the estimate's decomposition calls ``eigh`` twice more per factor than
    the paper's on the same factors (B ∪ B̃'s and B̃'s, densely or through the rows), for every factor
    decomposed (a bias proportional to its weight's output factor takes that decomposition)."""
    paper = _fit("paper")
    other = _fit(estimator)
    assert all(torch.equal(A, B) for F, G in zip(paper.H_facs.kfacs, other.H_facs.kfacs) for A, B in zip(F, G))
    copies = proportional_blocks(paper.H_facs.kfacs, paper.H_facs_magnitude.kfacs)
    assert copies  # the biases
    n_factors = sum(len(F) for k, F in enumerate(paper.H_facs.kfacs) if k not in copies)
    assert _eigh_calls(other, monkeypatch) - _eigh_calls(paper, monkeypatch) == 2 * n_factors

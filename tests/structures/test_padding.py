"""Padded token targets (-100, ``CrossEntropyLoss``'s ``ignore_index``) are left out of the fit.

Every language-model batch is padded. Positions whose target is -100 carry no loss term, so they
must carry no curvature and no metric either. The reference: a per-position token model (each
output position sees only its own token), where the padded batch -- the last ``PAD`` positions of
every sequence padded -- must give exactly the posterior of the same batch with those positions
cut off: the same curvature (every structure, dense float64), the same log marginal likelihood
(loss and N) and the same predictive at the kept positions.
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  (registers the debiased structures)

STRUCTURES = ("debiased_kron", "debiased_ekfac", "debiased_full", "debiased_lowrank")
VOCAB, TOKENS, PAD, C = 6, 5, 2, 3
RTOL = 1e-9  # float64 sums of a few hundred products, in different orders


class PerToken(nn.Module):
    """Embedding -> Linear -> tanh -> Linear on every position alone: ``(n, T)`` -> ``(n, T, C)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.hidden, self.head = nn.Embedding(VOCAB, 4), nn.Linear(4, 4), nn.Linear(4, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(x))))


def _tokens(n: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, TOKENS), generator=g), torch.randint(0, C, (n, TOKENS), generator=g)


def _fit(structure: str, X: torch.Tensor, y: torch.Tensor):
    la = Laplace(PerToken().double().eval(), "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    return la


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_padded_batch_fits_as_the_batch_without_the_padded_positions(structure):
    X, y = _tokens()
    padded = y.clone()
    padded[:, -PAD:] = -100
    la_pad = _fit(structure, X, padded)
    la_cut = _fit(structure, X[:, :-PAD], y[:, :-PAD])
    delta = torch.tensor(0.7, dtype=torch.float64)
    torch.testing.assert_close(la_pad.log_marginal_likelihood(prior_precision=delta),
                               la_cut.log_marginal_likelihood(prior_precision=delta), rtol=RTOL, atol=0)
    X_test, _ = _tokens(6, seed=1)
    la_pad.prior_precision = la_cut.prior_precision = 0.7
    p_pad = la_pad(X_test, pred_type="glm", link_approx="probit")
    p_cut = la_cut(X_test[:, :-PAD], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(p_pad[:, :-PAD], p_cut, rtol=RTOL, atol=1e-12)


def test_padded_positions_are_left_out_of_the_predictive_metrics():
    """Grid validation scores (mean NLL over the scored tokens) of a padded validation set equal
    those of the set with the padded positions cut off."""
    from laplace_debiased.posterior.grid import grid_validation_scores

    X, y = _tokens()
    la = _fit("debiased_kron", X[:, :-PAD], y[:, :-PAD])
    X_val, y_val = _tokens(10, seed=2)
    padded = y_val.clone()
    padded[:, -PAD:] = -100

    def nll(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -p.gather(1, t.unsqueeze(1)).log().mean()

    grid = torch.tensor([0.1, 1.0, 10.0], dtype=torch.float64)
    scores = grid_validation_scores(la, nll, grid, DataLoader(TensorDataset(X_val, padded), batch_size=5), "probit")
    cut = DataLoader(TensorDataset(X_val[:, :-PAD], y_val[:, :-PAD]), batch_size=5)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(grid_validation_scores(la, nll, grid, cut, "probit")),
                               rtol=RTOL, atol=0)


def test_backends_that_would_count_padded_positions_are_refused():
    from laplace.curvature import CurvlinopsGGN

    X, y = _tokens()
    y[:, -PAD:] = -100
    la = Laplace(PerToken().double().eval(), "classification", subset_of_weights="all",
                 hessian_structure="debiased_kron", backend=CurvlinopsGGN, backend_kwargs={"stochastic": True})
    with pytest.raises(ValueError, match=r"padded targets \(-100\).*CurvlinopsGGN"):
        la.fit(DataLoader(TensorDataset(X, y), batch_size=8))


def test_labels_outside_the_classes_are_still_refused():
    X, y = _tokens()
    y[0, 0] = -3
    with pytest.raises(ValueError, match=r"range \[0, 3\).*-100 for a padded position"):
        _fit("debiased_kron", X, y)


@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_every_curvature_route_leaves_padded_positions_out(curvature):
    """The dense curvature, the matrix-free product (the Lanczos route of debiased_lowrank) and the
    factor ``V`` (``G = V Vᵀ``, the Gram route) of a padded batch equal the cut batch's."""
    from laplace_debiased.curvature.factors import curvature_factor, dense_curvature
    from laplace_debiased.curvature.lanczos import summed_curvature_product

    model = PerToken().double().eval()
    X, y = _tokens(8)
    padded = y.clone()
    padded[:, -PAD:] = -100
    pad, cut = [(X, padded)], [(X[:, :-PAD], y[:, :-PAD])]
    G = dense_curvature(model, cut, "classification", curvature)
    torch.testing.assert_close(dense_curvature(model, pad, "classification", curvature), G, rtol=RTOL, atol=1e-12)
    V = curvature_factor(model, pad, "classification", curvature)
    torch.testing.assert_close(V @ V.T, G, rtol=RTOL, atol=1e-12)
    v = torch.randn(G.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    product = summed_curvature_product(model, pad, "classification", curvature, C)
    torch.testing.assert_close(product(v), G @ v, rtol=RTOL, atol=1e-12)

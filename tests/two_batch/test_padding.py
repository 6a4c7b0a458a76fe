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


class MLP(nn.Module):
    """A 3-5-3 MLP with ``(n, C)`` outputs (one label per sample)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _fit_loader(model: nn.Module, structure: str, X: torch.Tensor, y: torch.Tensor, batch_size: int):
    la = Laplace(model.double().eval(), "classification", subset_of_weights="all", hessian_structure=structure)
    la.fit(DataLoader(TensorDataset(X, y), batch_size=batch_size))
    return la


def _dense_precision(la) -> torch.Tensor:
    """The dense posterior precision ``H + δ I`` (low rank: ``U diag(λ) Uᵀ + δ I``)."""
    P = la.posterior_precision
    if isinstance(P, tuple):
        (U, lam), prior = P
        return (U * lam) @ U.T + torch.diag(prior.expand(U.shape[0]))
    return P if isinstance(P, torch.Tensor) else P.to_matrix()


def _same_posterior(la_pad, la_cut, X_test: torch.Tensor, X_test_cut: torch.Tensor) -> None:
    """Posterior precision (Frobenius norm) and log marginal likelihood agree to ``1e-12`` relative
    (float64 round-off); the GLM predictive, which inverts the precision (condition number ~1e3
    here), to ``1e-10``. The precision of debiased_full/lowrank to ``RTOL``: it takes B's dense
    eigenvectors, which round-off ``ε ‖H‖`` turns by ``ε ‖H‖ / gap``, and B's spectrum here has
    gaps of ``1e-10 ‖H‖``."""
    la_pad.prior_precision = la_cut.prior_precision = 0.7
    P_pad, P_cut = _dense_precision(la_pad), _dense_precision(la_cut)
    rtol = RTOL if isinstance(la_cut.posterior_precision, tuple) or la_cut._key[1] == "debiased_full" else 1e-12
    assert torch.linalg.matrix_norm(P_pad - P_cut) <= rtol * torch.linalg.matrix_norm(P_cut)
    delta = torch.tensor(0.7, dtype=torch.float64)
    torch.testing.assert_close(la_pad.log_marginal_likelihood(prior_precision=delta),
                               la_cut.log_marginal_likelihood(prior_precision=delta), rtol=1e-12, atol=0)
    p_pad = la_pad(X_test, pred_type="glm", link_approx="probit")
    p_cut = la_cut(X_test_cut, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(p_pad.reshape(p_cut.shape), p_cut, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_padded_sample_fits_as_the_batches_without_it(structure):
    """One label of each 16-sample batch is -100: the fit is that of the 15-sample batches without
    those samples (N = 32 against 30, |B| = 16 against 15: the scale N/|B| is the same), K-FAC's
    input factors included (a mean over the 15 samples that carry a loss term)."""
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(32, 3, generator=g, dtype=torch.float64), torch.randint(0, C, (32,), generator=g)
    padded = y.clone()
    padded[[0, 16]] = -100
    keep = padded != -100
    la_pad = _fit_loader(MLP(), structure, X, padded, 16)
    la_cut = _fit_loader(MLP(), structure, X[keep], y[keep], 15)
    X_test = torch.randn(7, 3, generator=g, dtype=torch.float64)
    _same_posterior(la_pad, la_cut, X_test, X_test)


@pytest.mark.filterwarnings("ignore:.*same input and target bytes")  # 6 token ids: repeated rows
@pytest.mark.parametrize("structure", STRUCTURES)
def test_sequences_of_different_lengths_fit_as_their_kept_tokens(structure):
    """Right-padded sequences of different lengths (one padded throughout) under K-FAC's "expand"
    convention, where every token is a data point: a per-token model's padded fit equals the fit
    of its kept tokens as one-token sequences without padding. Both batches keep 20 tokens, so the
    scale N/|B| is 16/8 in the padded fit and 40/20 in the kept-token fit."""
    X, y = _tokens(16)
    lengths = torch.tensor([5, 3, 0, 2, 4, 1, 5, 0, 4, 4, 2, 3, 5, 1, 1, 0])  # 20 tokens per 8 sequences
    padded = torch.where(torch.arange(TOKENS) < lengths[:, None], y, torch.full_like(y, -100))
    keep = padded != -100
    la_pad = _fit(structure, X, padded)
    la_cut = _fit_loader(PerToken(), structure, X[keep][:, None], y[keep][:, None], 20)
    X_test, _ = _tokens(6, seed=1)
    _same_posterior(la_pad, la_cut, X_test, X_test.reshape(-1, 1))

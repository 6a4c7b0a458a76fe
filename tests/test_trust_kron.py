"""Trust items of debiased K-FAC: frozen parameters, eigenbasis invariance, online fits."""

import pytest
import torch
from laplace import KronLaplace
from laplace.curvature import AsdlGGN, CurvlinopsGGN
from torch.utils.data import TensorDataset

from _models import loader, tiny_mlp, toy_data
from laplace_debiased.structures.kron import DebiasedKronLaplace


def _mlp5(seed=0):
    """Linear(4,5)-Tanh-Linear(5,5)-Tanh-Linear(5,3): 5 hidden units > batch of 3 samples,
    so B's K-FAC factors are rank-deficient (a null eigenspace)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5), torch.nn.Tanh(),
        torch.nn.Linear(5, 3),
    ).double()


def _blocks(kfacs):
    return [[F.clone() for F in block] for block in kfacs]


@pytest.mark.parametrize("backend", [CurvlinopsGGN, AsdlGGN])
@pytest.mark.parametrize(
    "frozen, dropped",
    [(("0.bias",), [1]), (("2.bias",), [3]), (("0.weight", "0.bias"), [0, 1])],
    ids=["first-bias", "last-bias", "whole-layer"],
)
def test_frozen_parameters_are_left_out(backend, frozen, dropped):
    """B̃ = B with frozen parameters: the stock K-FAC of the unfrozen model (identical forward
    pass, so identical factors) without the frozen parameters' blocks."""
    model = tiny_mlp()
    dl = loader(toy_data(8, (4,), 3, "classification"), 8)
    ref = KronLaplace(model, "classification", backend=backend)
    ref.fit(dl)
    want = [F for i, F in enumerate(ref.H_facs.kfacs) if i not in dropped]
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    la = DebiasedKronLaplace(model, "classification", backend=backend)
    la.fit(dl, magnitude_loader=dl)
    assert la.n_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    got = la.H_facs.kfacs
    assert [[F.shape for F in b] for b in got] == [[F.shape for F in b] for b in want]
    for G, W in zip(got, want):
        for g, w in zip(G, W):
            torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
    assert la.H.to_matrix().shape == (la.n_params, la.n_params)
    X = dl.dataset.tensors[0][:3]
    p = la(X, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=p.dtype))


def test_frozen_last_bias_equals_stock_kron():
    """Where stock KronLaplace handles the frozen bias itself (last layer), B̃ = B equals it."""
    model = tiny_mlp()
    model[2].bias.requires_grad_(False)
    dl = loader(toy_data(8, (4,), 3, "classification"), 8)
    la = DebiasedKronLaplace(model, "classification", prior_precision=0.7)
    la.fit(dl, magnitude_loader=dl)
    ref = KronLaplace(model, "classification", prior_precision=0.7)
    ref.fit(dl)
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(
        la.log_marginal_likelihood(), ref.log_marginal_likelihood(), atol=1e-9, rtol=1e-10
    )

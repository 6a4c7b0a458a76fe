"""Trust items of debiased K-FAC: frozen parameters, eigenbasis invariance, online fits."""

import pytest
import torch
from laplace import KronLaplace
from laplace.curvature import AsdlGGN, CurvlinopsGGN

from _models import DictData, DictModel, loader, tiny_mlp, toy_data
from laplace_debiased.kron.laplace import DebiasedKronLaplace


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


def _rank_deficient_fit(**fit_kw):
    """B and B̃ of 2 samples each: every K-FAC factor of the 5-wide layers is rank-deficient."""
    dl = loader(toy_data(4, (4,), 3, "classification", seed=1), 2)
    la = DebiasedKronLaplace(_mlp5(), "classification", prior_precision=1e-3)
    la.fit(dl, **fit_kw)
    return la, dl


def _rel(a, b):
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def test_tiny_factor_perturbation_keeps_posterior_precision():
    """A 1e-15 perturbation of any one of B's factors (most are rank-deficient here, with null
    spaces of dimension up to 3) leaves the posterior precision unchanged to 1e-8."""
    la, _ = _rank_deficient_fit()
    before = la.posterior_precision.to_matrix()
    facs = _blocks(la.H_facs.kfacs)
    assert sum(int(torch.linalg.matrix_rank(F)) < F.shape[0] for b in facs for F in b) >= 6
    g = torch.Generator().manual_seed(0)
    for i, block in enumerate(facs):
        for j, F in enumerate(block):
            E = torch.randn(F.shape, generator=g, dtype=F.dtype)
            la.H_facs.kfacs[i][j] = F + 1e-15 * float(torch.linalg.matrix_norm(F)) * (E + E.T)
            la._decompose()
            assert _rel(la.posterior_precision.to_matrix(), before) < 1e-8, (i, j)
            la.H_facs.kfacs[i][j] = F


def test_online_fit_on_same_loader_triples_precision():
    la, dl = _rank_deficient_fit()
    H1 = la.H.to_matrix()
    loss1 = la.loss
    la.fit(dl, override=False)
    la.fit(dl, override=False)
    assert la.n_data == 3 * len(dl.dataset)
    torch.testing.assert_close(la.H.to_matrix(), 3 * H1, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(la.loss, 3 * loss1)


def test_same_batch_rank_deficient_equals_plain_kron():
    dl = loader(toy_data(2, (4,), 3, "classification", seed=1), 2)
    la = DebiasedKronLaplace(_mlp5(), "classification", prior_precision=0.3)
    la.fit(dl, magnitude_loader=dl)
    ref = KronLaplace(_mlp5(), "classification", prior_precision=0.3)
    ref.fit(dl)
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(
        la.posterior_precision.to_matrix(), ref.posterior_precision.to_matrix(), atol=1e-12, rtol=1e-10
    )




@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_dict_batch_missing_key_raises_key_error(subset):
    from laplace import Laplace

    X, y = toy_data(16, (4,), 3, "classification").tensors
    dl = torch.utils.data.DataLoader(DictData(X, y, key_x="pixels"), batch_size=8)
    la = Laplace(DictModel(), "classification", subset, "debiased_kron")
    with pytest.raises(KeyError, match="input_ids"):
        la.fit(dl)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_backpack_with_dict_inputs_refused_up_front(subset):
    from backpack import extend
    from laplace import Laplace
    from laplace.curvature import BackPackGGN

    X, y = toy_data(16, (4,), 3, "classification").tensors
    dl = torch.utils.data.DataLoader(DictData(X, y), batch_size=8)
    la = Laplace(extend(DictModel()), "classification", subset, "debiased_kron", backend=BackPackGGN)
    with pytest.raises(ValueError, match="BackPACK.*dict.*CurvlinopsGGN"):
        la.fit(dl)

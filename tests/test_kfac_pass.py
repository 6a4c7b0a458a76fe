"""The single forward/backward pass over B ∪ B̃ (curvature.kfac) against one backend call per
batch (laplace-torch's Curvlinops K-FAC), in float64."""

import pytest
import torch
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from torch import nn

from _models import loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.curvature.kfac import group_kfac_sums, loss_hessian_sqrt
from laplace_debiased.structures.kron import DebiasedKronLaplace, DebiasedKronLLLaplace

MODELS = {"mlp": (tiny_mlp, (4,)), "cnn": (tiny_cnn, (1, 5, 5))}


def _fit(cls, model, data, backend, single_pass: bool, monkeypatch, **fit_kw):
    la = cls(model, data[1], backend=backend)
    if not single_pass:  # force one backend call per batch
        monkeypatch.setattr(la, "_single_pass_fisher", lambda: None)
    la.fit(data[0], **fit_kw)
    return la


def _assert_same_fit(a, b):
    for Fa, Fb in zip(
        [*a.H_facs.kfacs, *a.H_facs_magnitude.kfacs], [*b.H_facs.kfacs, *b.H_facs_magnitude.kfacs]
    ):
        assert len(Fa) == len(Fb)
        for x, y in zip(Fa, Fb):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        a.posterior_precision.to_matrix(), b.posterior_precision.to_matrix(), rtol=1e-9, atol=1e-10
    )
    torch.testing.assert_close(torch.as_tensor(a.loss), torch.as_tensor(b.loss), rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend", [CurvlinopsGGN, CurvlinopsEF])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_single_pass_equals_per_batch_backend_calls(arch, likelihood, backend, monkeypatch):
    make, shape = MODELS[arch]
    # B has 24 samples, more than the largest input dimension (18): no degenerate eigenvalue
    data = (loader(toy_data(60, shape, 3, likelihood), 12), likelihood)
    fits = [
        _fit(DebiasedKronLaplace, make(), data, backend, sp, monkeypatch, n_direction_batches=2)
        for sp in (True, False)
    ]
    _assert_same_fit(*fits)


@pytest.mark.parametrize("split", ["halves", "same"])
def test_single_pass_halves_and_reduction(split, monkeypatch):
    """Several passes (split="halves" over 7 batches) and B̃ = B give the per-batch result."""
    data = (loader(toy_data(56, (1, 5, 5), 3, "classification"), 8), "classification")
    kw = {"split": "halves"} if split == "halves" else {"magnitude_loader": data[0]}
    fits = [
        _fit(DebiasedKronLaplace, tiny_cnn(), data, CurvlinopsGGN, sp, monkeypatch, **kw)
        for sp in (True, False)
    ]
    _assert_same_fit(*fits)


def test_single_pass_last_layer_and_frozen_layer(monkeypatch):
    data = (loader(toy_data(32, (4,), 3, "classification"), 8), "classification")
    fits = [
        _fit(DebiasedKronLLLaplace, tiny_mlp(), data, CurvlinopsGGN, sp, monkeypatch)
        for sp in (True, False)
    ]
    _assert_same_fit(*fits)

    def frozen_first():
        model = tiny_mlp()
        model[0].requires_grad_(False)
        return model

    fits = [
        _fit(DebiasedKronLaplace, frozen_first(), data, CurvlinopsGGN, sp, monkeypatch)
        for sp in (True, False)
    ]
    assert len(fits[0].H_facs.kfacs) == 2
    _assert_same_fit(*fits)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_loss_hessian_sqrt_squares_to_loss_hessian(likelihood):
    f = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (5,)) if likelihood == "classification" else torch.randn(5, 4).double()
    loss = nn.CrossEntropyLoss(reduction="sum") if likelihood == "classification" else nn.MSELoss(reduction="sum")
    S = loss_hessian_sqrt(f, likelihood)
    for n in range(5):
        H = torch.autograd.functional.hessian(lambda z: loss(z.unsqueeze(0), y[n : n + 1]), f[n])
        torch.testing.assert_close(S[n] @ S[n].T, H, rtol=1e-12, atol=1e-12)


def test_group_sums_split_rows_and_ignore_uncovered_rows():
    """Groups partition the rows: the sums of two groups add up to one group over all rows;
    rows outside every segment contribute nothing."""
    model = tiny_cnn()
    modules = [model[0], model[3]]
    X, y = toy_data(10, (1, 5, 5), 3, "classification").tensors
    kw = dict(likelihood="classification", lossfunc=nn.CrossEntropyLoss(reduction="sum"), factor=1.0)
    two = group_kfac_sums(model, modules, X, y, [(0, 4, 1), (4, 10, 0)], 2, **kw)
    one = group_kfac_sums(model, modules, X, y, [(0, 10, 0)], 1, **kw)
    part = group_kfac_sums(model, modules, X, y, [(4, 10, 0)], 1, **kw)
    for t2, t1, tp in zip(two.tensors(), one.tensors(), part.tensors()):
        torch.testing.assert_close(t2.sum(0), t1[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(t2[0], tp[0], rtol=1e-12, atol=1e-12)

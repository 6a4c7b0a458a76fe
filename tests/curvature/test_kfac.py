"""The single forward/backward pass over B ∪ B̃ (curvature.kfac) against one backend call per
batch (laplace-torch's Curvlinops K-FAC), in float64."""

import pytest
import torch
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from torch import nn

from _models import loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.curvature.kfac import group_kfac_sums, loss_hessian_sqrt
from laplace_debiased.kron.laplace import DebiasedKronLaplace, DebiasedKronLLLaplace

MODELS = {"mlp": (tiny_mlp, (4,)), "cnn": (tiny_cnn, (1, 5, 5))}


def _fit(cls, model, data, backend, single_pass: bool, monkeypatch, magnitude_loader=None, **options):
    la = cls(model, data[1], backend=backend, **options)
    if not single_pass:  # force one backend call per batch
        monkeypatch.setattr(la, "_single_pass_fisher", lambda: None)
    la.fit(data[0], magnitude_loader=magnitude_loader)
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


def _token_data(n_seq: int, T: int, likelihood: str):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n_seq, T, 4, generator=g, dtype=torch.float64)
    if likelihood == "classification":
        return X, torch.randint(0, 3, (n_seq, T), generator=g)
    return X, torch.randn(n_seq, T, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_token_outputs_equal_flattened_tokens_as_samples(likelihood):
    """(batch, tokens, classes) with every token an output: for a model acting on each token
    separately the fit equals the fit on the tokens flattened into samples (same B, B̃)."""
    T = 3
    X, y = _token_data(30, T, likelihood)
    seq = torch.utils.data.TensorDataset(X, y)
    flat = torch.utils.data.TensorDataset(X.flatten(0, 1), y.flatten(0, 1))
    fits = []
    for data, bs in ((seq, 6), (flat, 6 * T)):
        la = DebiasedKronLaplace(tiny_mlp(), likelihood, n_direction_batches=2)
        la.fit(loader(data, bs))
        fits.append(la)
    _assert_same_fit(*fits)
    assert fits[0].n_outputs == 3


def test_requires_grad_subset_blocks_equal_full_model_blocks():
    """Adapter-only fit (frozen backbone): the blocks of the trainable layer are those the
    all-trainable model has for it; the frozen layers get none."""

    def model(frozen: bool):
        torch.manual_seed(0)
        m = nn.Sequential(
            nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5, bias=False), nn.Tanh(), nn.Linear(5, 3)
        ).double()
        if frozen:
            for i in (0, 4):
                m[i].requires_grad_(False)
        return m

    data = loader(torch.utils.data.TensorDataset(*_token_data(40, 2, "classification")), 10)
    adapter, full = DebiasedKronLaplace(model(True), "classification"), None
    adapter.fit(data)
    full = DebiasedKronLaplace(model(False), "classification")
    full.fit(data)
    assert adapter.n_params == 25 and len(adapter.H_facs.kfacs) == 1
    for mine, ref in ((adapter.H_facs, full.H_facs), (adapter.H_facs_magnitude, full.H_facs_magnitude)):
        for x, y in zip(mine.kfacs[0], ref.kfacs[2]):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.as_tensor(adapter.loss), torch.as_tensor(full.loss))


"""laplace-torch-style behaviour checks on DebiasedKronLaplace / DebiasedKronLLLaplace."""


import pytest
import torch
from laplace import KronLaplace, KronLLLaplace, Laplace
from laplace.utils.matrix import Kron
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import DictData, DictModel, loader, tiny_mlp, toy_data
from laplace_debiased.kron.laplace import DebiasedKronLaplace, DebiasedKronLLLaplace
from laplace_debiased.curvature.linalg import debiased_kron

CLASSES = [DebiasedKronLaplace, DebiasedKronLLLaplace]


def _fitted(cls, likelihood="classification", **kw):
    la = cls(tiny_mlp(), likelihood, **kw)
    la.fit(loader(toy_data(32, (4,), 3, likelihood), 8))
    return la


def test_factory_dispatch_and_kron_untouched():
    m = tiny_mlp()
    assert type(Laplace(m, "classification", hessian_structure="debiased_kron")) is DebiasedKronLLLaplace
    assert type(Laplace(m, "classification", "all", "debiased_kron")) is DebiasedKronLaplace
    assert type(Laplace(m, "classification")) is KronLLLaplace
    assert type(Laplace(m, "classification", "all", "kron")) is KronLaplace
    assert isinstance(Laplace(m, "classification", "all", "debiased_kron"), KronLaplace)
    assert isinstance(Laplace(m, "classification", hessian_structure="debiased_kron"), KronLLLaplace)


@pytest.mark.parametrize("cls", CLASSES)
def test_construction_and_unfitted(cls):
    la = cls(tiny_mlp(), "classification", prior_precision=2.0)
    with pytest.raises(AttributeError):
        la.state_dict()
    if cls is DebiasedKronLaplace:
        assert la.n_params == 27 and la.n_layers == 4


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("link", ["probit", "mc", "bridge", "bridge_norm"])
def test_glm_classification_predictive(cls, link):
    la = _fitted(cls)
    X = toy_data(5, (4,), 3, "classification", seed=7).tensors[0]
    p = la(X, pred_type="glm", link_approx=link, n_samples=50)
    assert p.shape == (5, 3)
    torch.testing.assert_close(p.sum(-1), torch.ones(5, dtype=p.dtype), atol=1e-6, rtol=0)
    assert (p >= 0).all()


@pytest.mark.parametrize("cls", CLASSES)
def test_nn_predictive_and_samples(cls):
    la = _fitted(cls)
    X = toy_data(5, (4,), 3, "classification", seed=7).tensors[0]
    p = la(X, pred_type="nn", link_approx="mc", n_samples=20)
    torch.testing.assert_close(p.sum(-1), torch.ones(5, dtype=p.dtype))
    s = la.sample(n_samples=7, generator=torch.Generator().manual_seed(0))
    assert s.shape == (7, la.n_params)
    fs = la.predictive_samples(X, n_samples=4)
    assert fs.shape == (4, 5, 3)


@pytest.mark.parametrize("cls", CLASSES)
def test_sample_covariance_is_inverse_posterior_precision(cls):
    la = _fitted(cls, prior_precision=3.0)
    s = la.sample(n_samples=20000, generator=torch.Generator().manual_seed(0))
    cov = torch.cov((s - la.mean).T)
    ref = torch.linalg.inv(la.posterior_precision.to_matrix())
    assert torch.allclose(cov, ref, atol=0.05 * ref.diag().max())


@pytest.mark.parametrize("cls", CLASSES)
def test_regression_predictive(cls):
    la = _fitted(cls, "regression", sigma_noise=0.5)
    X = toy_data(5, (4,), 3, "regression", seed=7).tensors[0]
    mu, var = la(X, pred_type="glm")
    assert mu.shape == (5, 3) and var.shape == (5, 3, 3)
    assert (torch.diagonal(var, dim1=1, dim2=2) > 0).all()
    mu, var = la(X, pred_type="nn", link_approx="mc", n_samples=10)
    assert mu.shape == (5, 3) and var.shape == (5, 3)


def test_float32_model():
    ds = toy_data(32, (4,), 3, "classification")
    ds = TensorDataset(ds.tensors[0].float(), ds.tensors[1])
    for cls in CLASSES:
        la = cls(tiny_mlp().float(), "classification")
        la.fit(loader(ds, 8))
        assert la.H.eigenvalues[0][0].dtype == torch.float32
        assert la(ds.tensors[0][:3]).dtype == torch.float32




def test_dict_batches_match_tensor_batches():
    X, y = toy_data(32, (4,), 3, "classification").tensors
    la_d = DebiasedKronLaplace(DictModel(), "classification")
    la_d.fit(DataLoader(DictData(X, y), batch_size=8))
    la_t = DebiasedKronLaplace(tiny_mlp(), "classification")
    la_t.fit(loader(TensorDataset(X, y), 8))
    torch.testing.assert_close(la_d.H.to_matrix(), la_t.H.to_matrix())
    torch.testing.assert_close(la_d.loss, la_t.loss)


def test_online_fit_rebiases_combined_factors():
    """Two online fits equal one fit on the union of their B's and B̃'s."""
    X, y = toy_data(32, (4,), 3, "classification").tensors
    first = loader(TensorDataset(X[:16], y[:16]), 8)  # B1 = 0..7, B̃1 = 8..15
    second = loader(TensorDataset(X[16:], y[16:]), 8)  # B2 = 16..23, B̃2 = 24..31
    la = DebiasedKronLaplace(tiny_mlp(), "classification", estimator="paper")
    la.fit(first)
    la.fit(second, override=False)
    order = torch.cat([torch.arange(0, 8), torch.arange(16, 24), torch.arange(8, 16), torch.arange(24, 32)])
    ref = DebiasedKronLaplace(
        tiny_mlp(), "classification", n_direction_batches=2, n_magnitude_batches=2, estimator="paper"
    )
    ref.fit(loader(TensorDataset(X[order], y[order]), 8))
    assert la.n_data == ref.n_data == 32
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(la.loss, ref.loss)
    vecs, vals = debiased_kron(la.H_facs.kfacs, la.H_facs_magnitude.kfacs)
    torch.testing.assert_close(la.H.eigenvalues, vals)
    with pytest.raises(ValueError, match="override=False"):
        DebiasedKronLLLaplace(tiny_mlp(), "classification").fit(first, override=False)


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_round_trip_is_exact(cls):
    la = _fitted(cls, prior_precision=0.5)
    state = la.state_dict()
    new = cls(tiny_mlp(), "classification")
    new.load_state_dict(state)
    assert torch.equal(new.H.to_matrix(), la.H.to_matrix())
    assert torch.equal(new.posterior_precision.to_matrix(), la.posterior_precision.to_matrix())
    X = toy_data(4, (4,), 3, "classification", seed=5).tensors[0]
    assert torch.equal(new(X), la(X))
    # the stock path (re-decomposing B's factors) would lose the debiased eigenvalues
    stock = Kron(state["H"]).decompose()
    assert not torch.allclose(stock.to_matrix(), la.H.to_matrix())


@pytest.mark.parametrize("cls", CLASSES)
def test_marglik_uses_full_data_loss(cls):
    ds = toy_data(32, (4,), 3, "classification")
    la = cls(tiny_mlp(), "classification", split="halves")
    la.fit(loader(ds, 8))
    with torch.no_grad():
        full = nn.functional.cross_entropy(tiny_mlp()(ds.tensors[0]), ds.tensors[1], reduction="sum")
    torch.testing.assert_close(la.loss, full)
    torch.testing.assert_close(la.log_likelihood, -full)
    before = la.log_marginal_likelihood(torch.tensor([1.0], dtype=torch.float64)).item()
    la.optimize_prior_precision(method="marglik", n_steps=50)
    after = la.log_marginal_likelihood().item()
    assert after > before


def _confident_model():
    m = tiny_mlp()
    with torch.no_grad():
        m[2].weight.mul_(8)  # over-confident MAP: the best prior precision is interior
    return m


def _noisy_teacher_data(n, seed, noise=0.3):
    X = toy_data(n, (4,), 3, "classification", seed=seed).tensors[0]
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        y = _confident_model()(X).argmax(-1)
    flip = torch.rand(n, generator=g) < noise
    y[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)
    return X, y


@pytest.mark.parametrize("cls", CLASSES)
def test_gridsearch_picks_best_validation_nll(cls):
    """Brute force: the chosen grid point has the lowest validation NLL. laplace-torch 0.3
    never resets its running metric and picks 100 here (a running-average artefact)."""
    la = cls(_confident_model(), "classification")
    la.fit(loader(TensorDataset(*_noisy_teacher_data(32, 0)), 8))
    Xv, yv = _noisy_teacher_data(40, 11)
    grid = torch.logspace(-2, 2, 9)
    la.optimize_prior_precision(
        method="gridsearch", val_loader=loader(TensorDataset(Xv, yv), 10), grid_size=9,
        log_prior_prec_min=-2, log_prior_prec_max=2, link_approx="probit",
    )
    chosen = la.prior_precision.item()
    nlls = []
    for prec in grid:
        la.prior_precision = float(prec)
        p = la(Xv, pred_type="glm", link_approx="probit")
        nlls.append(nn.functional.nll_loss(p.log(), yv).item())
    best = int(torch.tensor(nlls).argmin())
    assert 0 < best < len(grid) - 1  # interior optimum: a lagging running metric misses it
    assert chosen == pytest.approx(grid[best].item())


def _sigma_gradient(la, sigma: float = 0.7, h: float = 1e-5) -> tuple[float, float]:
    """``d log p(D) / dσ`` at ``σ`` (prior precision 1) by autograd and by a central difference
    (float64: truncation ``O(h²)`` and round-off ``O(eps · |log p| / h)``, both below ``1e-7``
    relative here)."""
    prior = torch.tensor(1.0, dtype=torch.float64)
    s = torch.tensor(sigma, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(prior, s), s)
    with torch.no_grad():
        up, down = (la.log_marginal_likelihood(prior, torch.tensor(sigma + d, dtype=torch.float64)) for d in (h, -h))
    return float(grad), float((up - down) / (2 * h))


def _regression_fits(stock: bool):
    dl = loader(toy_data(32, (4,), 3, "regression"), 32)
    la = KronLaplace(tiny_mlp(), "regression") if stock else DebiasedKronLaplace(tiny_mlp(), "regression")
    la.fit(dl) if stock else la.fit(dl, magnitude_loader=dl)
    return la


def test_marglik_gradient_in_sigma_agrees_with_a_finite_difference():
    grad, fd = _sigma_gradient(_regression_fits(stock=False))
    assert abs(grad - fd) <= 1e-6 * abs(fd)


@pytest.mark.xfail(strict=True, reason="laplace-torch 0.3: KronDecomposed.__mul__ turns the likelihood factor "
                   "1/σ² into a Python float (pow), so autograd misses log det P's dependence on σ (docs: "
                   "limitations, laplace-torch bugs; autograd 172.98, finite difference 205.00); an XPASS "
                   "means the bug is fixed upstream")
def test_stock_kron_marglik_gradient_in_sigma_agrees_with_a_finite_difference():
    la = _regression_fits(stock=True)
    torch.testing.assert_close(la.log_marginal_likelihood(), _regression_fits(stock=False).log_marginal_likelihood())
    grad, fd = _sigma_gradient(la)
    assert abs(grad - fd) <= 1e-6 * abs(fd)

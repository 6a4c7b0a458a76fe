"""Outputs of shape (batch, tokens, classes), every token an output with its own loss term, for
every debiased structure, in float64.

The identity tested: for a model that acts on each token separately, a fit on ``n`` sequences of
``T`` tokens is the fit on the ``n·T`` tokens flattened into samples with the same B and B̃
(B: the first two loader batches, B̃: the third; ``N/|B|`` is the same in both views), to
round-off: posterior precision, eigenvalues and training loss; and so are the predictives.
"""

import warnings

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import TensorDataset

from _models import loader, tiny_mlp
import laplace_debiased  # noqa: F401  registers the debiased structures

T, N_SEQ, BATCH = 3, 30, 6
STRUCTURES = ["debiased_lowrank", "debiased_full", "debiased_ekfac", "debiased_kron"]
CTOR = {"debiased_lowrank": {"rank": 10, "method": "gram"}}


def _tokens(likelihood: str, n_seq: int = N_SEQ, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n_seq, T, 4, generator=g, dtype=torch.float64)
    if likelihood == "classification":
        return X, torch.randint(0, 3, (n_seq, T), generator=g)
    return X, torch.randn(n_seq, T, 3, generator=g, dtype=torch.float64)


def _fit(structure, subset, model, X, y, batch_size, likelihood="classification", **ctor):
    la = Laplace(model, likelihood, subset_of_weights=subset, hessian_structure=structure,
                 **{**CTOR.get(structure, {}), **ctor}, n_direction_batches=2)  # fmt: skip
    la.fit(loader(TensorDataset(X, y), batch_size))
    return la


def _fit_both(structure, subset, likelihood, make_model=tiny_mlp, **ctor):
    """The fit on (n, T, C) outputs and the fit on the n·T tokens as samples."""
    X, y = _tokens(likelihood)
    seq = _fit(structure, subset, make_model(), X, y, BATCH, likelihood, **ctor)
    flat = _fit(structure, subset, make_model(), X.flatten(0, 1), y.flatten(0, 1), BATCH * T, likelihood, **ctor)
    return seq, flat


def _precision(la) -> torch.Tensor:
    """Dense posterior precision of any of the structures."""
    P = la.posterior_precision
    if isinstance(P, tuple):  # low rank: ((U, s·λ̃), prior diagonal)
        (U, lam), prior = P
        return (U * lam) @ U.T + torch.diag(prior)
    return P if isinstance(P, torch.Tensor) else P.to_matrix()


def _eigenvalues(la) -> list[torch.Tensor]:
    if isinstance(la.H, tuple):
        return [la.H[1], la.direction_eigenvalues]
    if isinstance(la.H, torch.Tensor):
        return [la.eigenvalues, la.direction_eigenvalues]
    values = la.H.eigenvalues
    return [v for block in values for v in (block if isinstance(block, list) else [block])]


def _assert_same(seq, flat):
    assert seq.n_params == flat.n_params and seq.n_data * T == flat.n_data
    torch.testing.assert_close(_precision(seq), _precision(flat), rtol=1e-9, atol=1e-10)
    for a, b in zip(_eigenvalues(seq), _eigenvalues(flat), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.as_tensor(seq.loss), torch.as_tensor(flat.loss), rtol=1e-12, atol=0)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_token_fit_equals_flattened_tokens_as_samples(structure, subset, likelihood):
    seq, flat = _fit_both(structure, subset, likelihood)
    _assert_same(seq, flat)
    assert seq.n_outputs == 3


def test_lowrank_lanczos_route_takes_token_outputs():
    """The matrix-free Lanczos route (curvlinops' GGN of the token rows) gives the Gram route's
    eigenpairs on token outputs."""
    lanczos = _fit_both("debiased_lowrank", "all", "classification", method="lanczos")
    _assert_same(*lanczos)
    gram, _ = _fit_both("debiased_lowrank", "all", "classification")
    torch.testing.assert_close(_precision(lanczos[0]), _precision(gram), rtol=1e-7, atol=1e-8)


def _predictives(la, X, likelihood):
    """GLM probit / mc and NN-sampling predictives; sampling with a fixed generator."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {"glm": la(X, pred_type="glm", link_approx="probit" if likelihood == "classification" else "mc")}
        if likelihood == "classification":
            out["glm_mc"] = la(X, pred_type="glm", link_approx="mc", n_samples=5)
        g = torch.Generator().manual_seed(0)
        out["nn"] = la.predictive_samples(X, pred_type="nn", n_samples=4, generator=g)
        g = torch.Generator().manual_seed(0)
        out["glm_samples"] = la.predictive_samples(X, pred_type="glm", n_samples=4, generator=g)
    return out


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_token_predictive_equals_flattened_tokens(structure, subset, likelihood):
    """la(x) on (n, T, ·) inputs returns (n, T, C) (regression: mean (n, T, C) and covariance
    (n, T, C, C)), the flattened fit's predictive of the n·T tokens reshaped; so do the NN and
    GLM predictive samples, (S, n, T, C)."""
    seq, flat = _fit_both(structure, subset, likelihood)
    X, _ = _tokens(likelihood, n_seq=4, seed=5)
    a, b = _predictives(seq, X, likelihood), _predictives(flat, X.flatten(0, 1), likelihood)
    if likelihood == "classification":
        assert a["glm"].shape == (4, T, 3)
        torch.testing.assert_close(a["glm"].sum(-1), torch.ones(4, T, dtype=torch.float64))
        torch.testing.assert_close(a["glm"], b["glm"].reshape(4, T, 3), rtol=1e-8, atol=1e-10)
        assert a["glm_mc"].shape == (4, T, 3)
    else:
        (mu_a, var_a), (mu_b, var_b) = a["glm"], b["glm"]
        assert mu_a.shape == (4, T, 3) and var_a.shape == (4, T, 3, 3)
        torch.testing.assert_close(mu_a, mu_b.reshape(4, T, 3), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(var_a, var_b.reshape(4, T, 3, 3), rtol=1e-8, atol=1e-10)
    for kind in ("nn", "glm_samples"):
        assert a[kind].shape == (4, 4, T, 3)
        torch.testing.assert_close(a[kind], b[kind].reshape(4, 4, T, 3), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_targets_of_the_wrong_shape_get_a_clear_error(structure, subset):
    X, y = _tokens("classification")
    with pytest.raises(ValueError, match=r"targets .*shape"):
        _fit(structure, subset, tiny_mlp(), X, y[:, 0], BATCH)  # one label per sequence
    with pytest.raises(ValueError, match=r"targets .*shape"):
        _fit(structure, subset, tiny_mlp(), X, y[:, :2], BATCH)  # too few tokens


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-2 update ``up(down(x))``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def adapter_model() -> nn.Module:
    """A frozen per-token backbone with a LoRA adapter on its middle layer (20 trainable weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    model.requires_grad_(False)
    model[2] = LoRALinear(model[2])
    return model.double()


@pytest.mark.parametrize("structure", STRUCTURES)
def test_adapters_on_a_frozen_backbone(structure):
    """Only the parameters with requires_grad are approximated, with token outputs."""
    seq, flat = _fit_both(structure, "all", "classification", make_model=adapter_model)
    assert seq.n_params == 20
    _assert_same(seq, flat)
    X, _ = _tokens("classification", n_seq=4, seed=5)
    a, b = _predictives(seq, X, "classification"), _predictives(flat, X.flatten(0, 1), "classification")
    torch.testing.assert_close(a["glm"], b["glm"].reshape(4, T, 3), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("structure", ["debiased_full", "debiased_ekfac"])
def test_adapter_block_equals_the_block_of_the_all_trainable_model(structure):
    """With B̃ = B the debiased full structure is the GGN, and EKFAC is block-diagonal per layer,
    so the adapter-only posterior is the adapter block of the all-trainable model's."""
    X, y = _tokens("classification")
    data = loader(TensorDataset(X, y), BATCH)
    fits = []
    for frozen in (True, False):
        model = adapter_model()
        if not frozen:
            model.requires_grad_(True)
        full = structure == "debiased_full"
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure,
                     n_direction_batches=2, n_magnitude_batches=2 if full else None)
        la.fit(data, magnitude_loader=data if full else None)
        fits.append(la)
    adapter, full = fits
    offsets, start = {}, 0
    for name, p in full.model.named_parameters():
        offsets[name], start = start, start + p.numel()
    idx = slice(offsets["2.down.weight"], offsets["2.down.weight"] + 20)
    torch.testing.assert_close(_precision(adapter), _precision(full)[idx, idx], rtol=1e-9, atol=1e-10)


def test_ekfac_cross_fit_on_token_outputs():
    """Cross-fitted EKFAC (both components, B's and B̃'s K-FAC from one shared pass)."""
    X, y = _tokens("classification")
    fits = []
    for data, bs in (((X, y), BATCH), ((X.flatten(0, 1), y.flatten(0, 1)), BATCH * T)):
        la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure="debiased_ekfac", n_direction_batches=2, cross_fit=True)
        la.fit(loader(TensorDataset(*data), bs))
        fits.append(la)
    torch.testing.assert_close(_precision(fits[0]), _precision(fits[1]), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_backends_that_do_not_treat_tokens_as_outputs_are_refused(structure):
    """K-FAC by a backend call (here ASDL) does not treat tokens as outputs: a clear error."""
    from laplace.curvature import AsdlGGN

    X, y = _tokens("classification")
    la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure=structure, backend=AsdlGGN)
    with pytest.raises(ValueError, match="every token an output.*CurvlinopsGGN"):
        la.fit(loader(TensorDataset(X, y), BATCH))


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_marginal_likelihood_equals_flattened_tokens(structure, likelihood):
    """The log marginal likelihood counts every token's outputs (regression: the Gaussian
    normaliser over n·T·C values), as the fit on the tokens as samples does."""
    seq, flat = _fit_both(structure, "all", likelihood)
    args = [torch.tensor(0.7, dtype=torch.float64)]
    if likelihood == "regression":
        args.append(torch.tensor(0.3, dtype=torch.float64))
    torch.testing.assert_close(
        seq.log_marginal_likelihood(*args), flat.log_marginal_likelihood(*args), rtol=1e-10, atol=1e-9
    )

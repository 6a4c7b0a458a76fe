"""``la(x)``'s GLM covariance in the curvature's eigenbasis (factored Jacobians, no ``(n, C, P)``
Jacobian) equals laplace-torch's route through the per-example Jacobians, ``la.functional_variance(J)``,
on tiny models of every layer kind.

float64: identities in exact arithmetic, compared at 1e-10 relative to the largest entry (the
round-off of these problems is ``P · eps64 · κ`` with ``P ≤ 10³`` parameters and ``κ ≤ 1/δ · s‖H‖ ≤ 10⁴``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
from laplace_debiased.kron.laplace import DebiasedKronLaplace
from laplace_debiased.two_batch.chunked import auto_chunk_size
from laplace_debiased.two_batch.token_outputs import per_example_jacobians, token_jacobians
from _models import loader, toy_data


class _Tokens(nn.Module):
    """``(n, T, d)`` -> ``(n, T, C)``: every token an output (``Linear`` applied per token)."""

    def __init__(self, d: int = 6, hidden: int = 20, C: int = 3, attention: bool = False):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.att = nn.MultiheadAttention(hidden, 2, batch_first=True) if attention else None
        self.out = nn.Linear(hidden, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.att is not None:
            h = h + self.att(h, h, h, need_weights=False)[0]
        return self.out(h)


def _model(kind: str) -> tuple[nn.Module, tuple[int, ...], bool]:
    """The model, its input shape and whether every token is an output."""
    torch.manual_seed(0)
    if kind == "mlp":  # a 40-wide hidden layer: its output factor (2 × 6 × 3 = 36 rows) through its rows
        return nn.Sequential(nn.Linear(10, 40), nn.Tanh(), nn.Linear(40, 3)).double(), (10,), False
    if kind == "conv":
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 3)).double(), (2, 4, 4), False
    if kind == "norm":
        return nn.Sequential(nn.Linear(10, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3)).double(), (10,), False
    return _Tokens(attention=kind == "attention").double(), (4, 6), True


def _fit(kind: str, cls=DebiasedKronLaplace, dtype=torch.float64, **options):
    model, shape, tokens = _model(kind)
    model = model.to(dtype)
    data = toy_data(12, shape, 3, "classification", seed=1)
    X = data.tensors[0].to(dtype)
    y = torch.randint(0, 3, (12, shape[0]) if tokens else (12,), generator=torch.Generator().manual_seed(2))
    la = cls(model, "classification", **options)
    la.fit(loader(type(data)(X, y), 6))
    la.prior_precision = 0.05
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    return la, x, tokens


def _jacobian_route(la, x, tokens):
    if tokens:
        Js, f, _ = token_jacobians(la.model, la.backend, x, last_layer=False, enable_backprop=False)
    else:
        Js, f = per_example_jacobians(la.model, list(la.params), x)
    return f, la.functional_variance(Js)


@pytest.mark.parametrize("kind", ["mlp", "conv", "norm", "token", "attention"])
@pytest.mark.parametrize("options", [{}, {"estimator": "paper"}, {"estimator": "paper", "cross_fit": True}])
def test_factored_glm_equals_the_jacobian_route(kind, options):
    la, x, tokens = _fit(kind, **options)
    f, var = la._glm_predictive_distribution(x)
    f_ref, var_ref = _jacobian_route(la, x, tokens)
    assert la._factored_cache is not None  # the factored route was taken
    torch.testing.assert_close(f, f_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, var_ref, rtol=1e-10, atol=1e-10 * float(var_ref.abs().max()))


def test_factored_glm_of_ekfac_equals_the_jacobian_route():
    la, x, tokens = _fit("mlp", cls=DebiasedEKFACLaplace)
    _, var = la._glm_predictive_distribution(x)
    _, var_ref = _jacobian_route(la, x, tokens)
    torch.testing.assert_close(var, var_ref, rtol=1e-10, atol=1e-10 * float(var_ref.abs().max()))


def test_the_factored_route_follows_prior_precision_and_refit():
    """The structure is built once per curvature: a new prior precision or a new fit changes Σ."""
    la, x, tokens = _fit("mlp")
    _, v1 = la._glm_predictive_distribution(x)
    la.prior_precision = torch.tensor([0.5, 1.0, 2.0, 4.0])  # one per parameter tensor
    _, v2 = la._glm_predictive_distribution(x)
    _, ref = _jacobian_route(la, x, tokens)
    torch.testing.assert_close(v2, ref, rtol=1e-10, atol=1e-10 * float(ref.abs().max()))
    assert not torch.allclose(v1, v2)


class _MixedTokens(nn.Module):
    """``(n, T, 5)`` -> ``(n, T, 3)``: a ``Linear(5, 6)`` on every token, the tokens mixed by their mean (no
    parameters), a per-token head ``Linear(6, 3)``: every output row reads every position of the first layer."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(torch.tanh(h + h.mean(1, keepdim=True)))


#: per input (4 tokens, 3 classes: 12 output rows and classes), the entries the closed-form Jacobians hold:
#: ``_Tokens``: the first weight's positions g (4 rows, 3, 20, 4) and u (4, 6, 4), cut to each row's own token
#: (g ⊗ a: 4 · 3 · 20 + 4 · 6), its bias 4 · 3 · 20, the head's inputs 4 · 20 and shared identity 3 · 3, its
#: bias 3 · 3; ``_MixedTokens``: the first weight's positions g (4, 3, 6, 4) and u (4, 5, 4), all live, rotated
#: factor by factor and then formed densely (pairs of positions cost more at one prior precision), 4 · 3 · 6 · 5,
#: its bias 4 · 3 · 6, the head 4 · 6 + 3 · 3 and 3 · 3
HELD = {"token": 960 + 96 + 240 + 24 + 240 + 80 + 9 + 9, "mixed": 288 + 80 + 360 + 72 + 24 + 9 + 9}


@pytest.mark.parametrize("kind", ["token", "mixed"])
def test_token_chunk_size_counts_what_the_factored_route_holds(kind):
    """Token outputs on the factored route: the automatic chunk size counts the Jacobian entries one input holds
    per output row and class (``HELD``), not every parameter (203 and 57: fewer than held for the mixed tokens);
    without inputs, every parameter."""
    if kind == "token":
        la, x, _ = _fit("token")
    else:
        torch.manual_seed(0)
        X = torch.randn(12, 4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y = torch.randint(0, 3, (12, 4), generator=torch.Generator().manual_seed(2))
        la = DebiasedKronLaplace(_MixedTokens().double(), "classification")
        la.fit(loader(torch.utils.data.TensorDataset(X, y), 6))
        x = X[:5]
    assert la._factored_applies()
    entries = -(-HELD[kind] // 12)
    assert la._jacobian_entries(x) == entries
    assert la.chunk_size(x) == auto_chunk_size(12, entries, 8)
    assert la.chunk_size() == auto_chunk_size(12, la.n_params, 8)

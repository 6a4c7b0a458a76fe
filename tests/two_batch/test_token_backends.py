"""Token outputs ``(batch, tokens, C)`` with every laplace-torch backend.

laplace-torch's ``lm_example``: frozen self-attention, a trainable ``Linear(D, 1)`` head applied
to every token (outputs ``(B, L, 1)``), dict batches, regression, ``backend=AsdlGGN``. ASDL's
and BackPack's ``jacobians`` loop over ``model.output_size`` and differentiate ``f[:, i]``,
which for token outputs is token ``i``, not output ``i``: they return ``(B, 1, P)`` for the
first token instead of ``(B, L, 1, P)``. The GLM predictive must not depend on that: the identity
tested is ``la(x)`` = per token ``(f_t, J_t P⁻¹ J_tᵀ)`` with ``J_t`` from ``torch.func`` and
``P`` the fitted posterior precision, for every structure that fits; the K-FAC structures
refuse backends whose K-FAC does not treat tokens as outputs.
"""

import warnings

import pytest
import torch
from laplace import Laplace
from laplace.curvature import AsdlEF, AsdlGGN, BackPackEF, BackPackGGN, CurvlinopsEF, CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _models import DictData, loader, tiny_mlp
from tests.two_batch.test_token_outputs import T, _fit_both, _precision, _tokens
import laplace_debiased  # noqa: F401  registers the debiased structures

B, L, D = 4, 6, 8
KEY_X = "input"


class LMModel(nn.Module):
    """laplace-torch's ``lm_example`` model in float64: reads ``x["input"]`` ``(B, L·D)``,
    self-attention over the ``L`` tokens, a ``Linear(D, 1)`` head on every token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(D, num_heads=1)
        self.final_layer = nn.Linear(D, 1)
        self.double()

    def forward(self, x) -> torch.Tensor:
        h = x[KEY_X].view(-1, L, D)
        return self.final_layer(self.attn(h, h, h, need_weights=False)[0])


def _lm_fit(structure: str, backend) -> tuple[Laplace, dict]:
    """The example's fit: attention frozen, head trainable, 100 dict samples in batches of 4."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(100, L, D, generator=g, dtype=torch.float64)
    y = torch.randn(100, L, 1, generator=g, dtype=torch.float64)
    data = DataLoader(DictData(X, y, key_x=KEY_X), batch_size=B, shuffle=False)
    model = LMModel()
    model.attn.requires_grad_(False)
    ctor = {"rank": 9} if structure == "debiased_lowrank" else {}
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure, backend=backend,
                 dict_key_x=KEY_X, dict_key_y="labels", enable_backprop=True, **ctor)  # fmt: skip
    la.fit(data)
    return la, next(iter(data))


def _token_reference(la: Laplace, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``f_t`` ``(B, L, 1)`` and ``J_t P⁻¹ J_tᵀ`` ``(B, L, 1, 1)``, ``J_t`` by ``torch.func``
    over the trainable parameters."""
    params = {k: v.detach() for k, v in la.model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in la.model.named_parameters() if not v.requires_grad}

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(la.model, {**frozen, **p}, (batch,))

    J = torch.cat([j.flatten(start_dim=3) for j in torch.func.jacrev(f)(params).values()], dim=3)
    cov = torch.linalg.inv(_precision(la).detach())
    return f(params).detach(), torch.einsum("ntcp,pq,ntdq->ntcd", J, cov, J)


@pytest.mark.parametrize("backend", [AsdlGGN, CurvlinopsGGN])
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_lm_example_gives_per_token_variances(structure, backend):
    la, batch = _lm_fit(structure, backend)
    mean, var = la(batch, pred_type="glm", joint=False)
    assert mean.shape == (B, L, 1) and var.shape == (B, L, 1, 1)
    f_ref, var_ref = _token_reference(la, batch)
    torch.testing.assert_close(mean.detach(), f_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var.detach(), var_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_lm_example_kfac_structures(structure):
    """K-FAC needs a backend that treats tokens as outputs: AsdlGGN is refused with a clear
    error, CurvlinopsGGN gives per-token variances."""
    with pytest.raises(ValueError, match="every token an output.*CurvlinopsGGN"):
        _lm_fit(structure, AsdlGGN)
    la, batch = _lm_fit(structure, CurvlinopsGGN)
    mean, var = la(batch, pred_type="glm", joint=False)
    f_ref, var_ref = _token_reference(la, batch)
    torch.testing.assert_close(mean.detach(), f_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var.detach(), var_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", [AsdlGGN, AsdlEF, BackPackGGN, BackPackEF, CurvlinopsEF])
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_token_predictive_equals_flattened_tokens_for_every_backend(structure, backend):
    """For a model acting on each token separately, the GLM predictive of the token fit is the
    flattened fit's predictive of the ``n·T`` tokens, with every backend (classification)."""
    seq, flat = _fit_both(structure, "all", "classification", backend=backend)
    X, _ = _tokens("classification", n_seq=4, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = seq(X, pred_type="glm", link_approx="probit")
        b = flat(X.flatten(0, 1), pred_type="glm", link_approx="probit")
    assert a.shape == (4, T, 3)
    torch.testing.assert_close(a, b.reshape(4, T, 3), rtol=1e-8, atol=1e-10)

"""Parameters shared between modules (tied weights) are fitted exactly or refused at ``fit``.

A parameter held by two modules (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) has one
curvature block: the exact GGN with respect to it sums the contributions of both uses.
``debiased_full`` and ``debiased_lowrank`` differentiate the model as a function of its distinct
parameters, so with B̃ = B they equal that exact GGN (checked in float64 against a dense GGN from
``torch.func``). The K-FAC structures give every layer its own block, and a last-layer Laplace holds
the features fixed though the shared parameter moves them too: both are refused at ``fit`` with an
error naming the shared parameter and the structures that take it, never accepted and then failing
at prediction.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from _models import exact_ggn
from laplace_debiased.two_batch.shared_parameters import shared_parameters

STRUCTURES = ("debiased_kron", "debiased_ekfac", "debiased_lowrank", "debiased_full")
KFAC = ("debiased_kron", "debiased_ekfac")
EXACT = ("debiased_lowrank", "debiased_full")
VOCAB, TOKENS = 11, 4


class TiedMLP(nn.Module):
    """Linear(3, 3) - tanh - Linear(3, 3) whose weight is the first layer's (15 distinct parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(3, 3), nn.Linear(3, 3)
        self.lin2.weight = self.lin1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


class TinyLM(nn.Module):
    """A GPT-2 language model with tied input and output embeddings, returning its logits ``(n, T, V)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=TOKENS, n_embd=4, n_layer=1, n_head=2, attn_implementation="eager",
        )
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits


def _mlp_data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _lm_data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (n, TOKENS), generator=g), torch.randint(0, VOCAB, (n, TOKENS), generator=g)


def _lm() -> nn.Module:
    return TinyLM().double().eval()


def _ctor(structure: str, n_params: int) -> dict:
    # a rank that keeps every direction of the curvature's range: low rank equals full
    return {"rank": n_params, "eigval_rtol": 0.0, "remeasured_rtol": 0.0} if structure == "debiased_lowrank" else {}


def _curvature(la) -> torch.Tensor:
    H = la.H
    if isinstance(H, tuple):
        U, lam = H
        return (U * lam) @ U.T
    return H


def test_shared_parameters_names_every_holder_of_a_trainable_parameter():
    assert shared_parameters(TiedMLP()) == [["lin1.weight", "lin2.weight"]]
    assert shared_parameters(_lm()) == [["lm.transformer.wte.weight", "lm.lm_head.weight"]]
    frozen = TiedMLP()
    frozen.lin1.weight.requires_grad_(False)
    assert shared_parameters(frozen) == []
    assert shared_parameters(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


@pytest.mark.parametrize("structure", KFAC)
@pytest.mark.parametrize("model", [TiedMLP, TinyLM], ids=["mlp", "gpt2"])
def test_kfac_structures_refuse_a_shared_parameter_at_fit(structure, model):
    X, y = _mlp_data() if model is TiedMLP else _lm_data()
    la = Laplace(model().double().eval(), "classification", subset_of_weights="all", hessian_structure=structure)
    names = ("lin1.weight", "lin2.weight") if model is TiedMLP else ("lm.transformer.wte.weight", "lm.lm_head.weight")
    with pytest.raises(ValueError, match="shared") as err:
        la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    message = str(err.value)
    assert all(name in message for name in names), message
    assert "debiased_full" in message and "debiased_lowrank" in message, message


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("model", [TiedMLP, TinyLM], ids=["mlp", "gpt2"])
def test_a_last_layer_with_a_shared_parameter_is_refused_at_fit(structure, model):
    X, y = _mlp_data() if model is TiedMLP else _lm_data()
    la = Laplace(model().double().eval(), "classification", subset_of_weights="last_layer", hessian_structure=structure)
    with pytest.raises(ValueError, match="last layer") as err:
        la.fit(DataLoader(TensorDataset(X, y), batch_size=4))
    message = str(err.value)
    held = ("lin2.weight", "lin1.weight") if model is TiedMLP else ("lm.lm_head.weight", "lm.transformer.wte.weight")
    assert all(name in message for name in held), message
    assert "subset_of_weights='all'" in message, message


@pytest.mark.parametrize("structure", EXACT)
def test_exact_structures_equal_the_exact_ggn_of_a_tied_mlp(structure):
    """With B̃ = B (one batch, ``N = |B|``) the curvature is the GGN of the distinct parameters: the
    shared weight's block holds both layers' contributions."""
    X, y = _mlp_data()
    model = TiedMLP().double().eval()
    dl = DataLoader(TensorDataset(X, y), batch_size=len(X))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure, **_ctor(structure, 15))
    la.fit(dl, magnitude_loader=dl)
    G = exact_ggn(model, X, "classification")
    assert la.n_params == 15 and G.shape == (15, 15)
    torch.testing.assert_close(_curvature(la), G, rtol=1e-10, atol=1e-12 * float(G.abs().max()))
    p = la(X)
    torch.testing.assert_close(p.sum(-1), torch.ones(len(X), dtype=p.dtype))


def _token_ggn(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """Dense GGN ``Σ_{n,t} J_ntᵀ (diag(p) - ppᵀ) J_nt`` of the distinct parameters, every token an output."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def logits(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (X,)).flatten(0, 1)  # (n·T, V)

    J = torch.func.jacrev(logits)(params)
    J = torch.cat([j.flatten(start_dim=2) for j in J.values()], dim=2)  # (n·T, V, P)
    prob = torch.softmax(logits(params), dim=-1)
    Lam = torch.diag_embed(prob) - prob.unsqueeze(-1) * prob.unsqueeze(-2)
    return torch.einsum("nop,noq,nqr->pr", J, Lam, J)


@pytest.mark.parametrize("structure", EXACT)
def test_exact_structures_equal_the_exact_ggn_of_gpt2_with_tied_embeddings(structure):
    X, y = _lm_data(3)
    model = _lm()
    n_params = sum(p.numel() for p in model.parameters())
    dl = DataLoader(TensorDataset(X, y), batch_size=len(X))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure,
                 **_ctor(structure, n_params))  # fmt: skip
    la.fit(dl, magnitude_loader=dl)
    G = _token_ggn(model, X)
    assert la.n_params == n_params and G.shape == (n_params, n_params)
    torch.testing.assert_close(_curvature(la), G, rtol=1e-9, atol=1e-10 * float(G.abs().max()))
    p = la(X)
    assert p.shape == (len(X), TOKENS, VOCAB)
    torch.testing.assert_close(p.sum(-1), torch.ones(len(X), TOKENS, dtype=p.dtype))

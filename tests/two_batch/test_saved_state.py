"""``la.state_dict()`` carries everything a prediction needs, and ``load_state_dict`` refuses a
state from another model, structure or subset with an error naming the first difference.

Checked for every structure × subset, with outputs ``(n, C)`` and token outputs ``(n, T, C)``: a
state saved with ``torch.save`` and read back with ``torch.load(weights_only=True)`` into a fresh
object predicts bit-identically; an online fit after loading (laplace-torch's
``test_serialize_override``: ``fit(loader, override=False)``) equals the online fit of the object
that was never saved; ``state_dict()`` before ``fit`` says the approximation is not fitted.
"""

from __future__ import annotations

import io
from collections import OrderedDict

import peft
import pytest
import torch
import transformers
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from _models import tiny_mlp
from laplace_debiased.two_batch.saved_state import check_saved_fit, fit_state

STRUCTURES = ("debiased_kron", "debiased_ekfac", "debiased_lowrank", "debiased_full")
SUBSETS = ("all", "last_layer")
CTOR = {"debiased_lowrank": {"rank": 6}}
T = 3


def _data(tokens: bool, n: int = 24, seed: int = 0, n_in: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, T) if tokens else (n,)
    return torch.randn(*shape, n_in, generator=g, dtype=torch.float64), torch.randint(0, 3, shape, generator=g)


def _la(structure: str, subset: str, model: nn.Module | None = None, likelihood: str = "classification"):
    model = model if model is not None else tiny_mlp()
    return Laplace(model, likelihood, subset_of_weights=subset, hessian_structure=structure,
                   prior_precision=0.5, **CTOR.get(structure, {}))  # fmt: skip


def _fitted(structure: str, subset: str, tokens: bool = False, model: nn.Module | None = None, n_in: int = 4):
    la = _la(structure, subset, model)
    la.fit(DataLoader(TensorDataset(*_data(tokens, n_in=n_in)), batch_size=8))
    return la


def _saved(la) -> dict:
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("tokens", [False, True], ids=["samples", "tokens"])
@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_loaded_state_predicts_bit_identically(structure, subset, tokens):
    la = _fitted(structure, subset, tokens)
    new = _la(structure, subset)
    new.load_state_dict(_saved(la))
    X, _ = _data(tokens, n=5, seed=3)
    assert torch.equal(new(X), la(X))
    assert new(X).shape == ((5, T, 3) if tokens else (5, 3))
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert torch.equal(new(X, link_approx="mc", n_samples=7, generator=g1),
                       la(X, link_approx="mc", n_samples=7, generator=g2))  # fmt: skip
    assert torch.equal(new.log_marginal_likelihood(), la.log_marginal_likelihood())


class LoraLM(nn.Module):
    """A tiny GPT-2 language model (tied embeddings, frozen) with LoRA adapters on the attention
    projection, returning its logits ``(n, T, V)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=11, n_positions=T, n_embd=4, n_layer=1, n_head=2,
                                         attn_implementation="eager")  # fmt: skip
        lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        self.lm = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_loaded_gpt2_lora_language_model_predicts_bit_identically(structure):
    g = torch.Generator().manual_seed(5)
    X, y = torch.randint(0, 11, (16, T), generator=g), torch.randint(0, 11, (16, T), generator=g)
    la = _la(structure, "all", model=LoraLM().double().eval())
    la.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    new = _la(structure, "all", model=LoraLM().double().eval())
    new.load_state_dict(_saved(la))
    assert torch.equal(new(X[:3]), la(X[:3])) and new(X[:3]).shape == (3, T, 11)


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_state_dict_before_fit_says_not_fitted(structure, subset):
    with pytest.raises(AttributeError, match="not fitted"):
        _la(structure, subset).state_dict()


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_state_of_another_model_with_as_many_parameters_is_refused(structure, subset):
    """A 5-4-3 MLP and an 8-3-3 MLP both have 39 parameters; the first shape differs."""
    la = _fitted(structure, subset, model=tiny_mlp(n_in=5, hidden=4), n_in=5)
    other = _la(structure, subset, model=tiny_mlp(n_in=8, hidden=3))
    first = r"0\.weight.*\(4, 5\).*\(3, 8\)" if subset == "all" else r"2\.weight.*\(3, 4\).*\(3, 3\)"
    with pytest.raises(ValueError, match=first):
        other.load_state_dict(_saved(la))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_state_with_other_parameter_names_is_refused(structure):
    la = _fitted(structure, "all")
    torch.manual_seed(0)
    renamed = nn.Sequential(OrderedDict(fc=nn.Linear(4, 3), act=nn.Tanh(), out=nn.Linear(3, 3))).double()
    with pytest.raises(ValueError, match=r"0\.weight.*fc\.weight"):
        _la(structure, "all", model=renamed).load_state_dict(_saved(la))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("saved, loading", [("all", "last_layer"), ("last_layer", "all")])
def test_a_state_of_another_subset_is_refused(structure, saved, loading):
    state = _saved(_fitted(structure, saved))
    with pytest.raises(ValueError, match=rf"subset_of_weights='{saved}'.*'{loading}'"):
        _la(structure, loading).load_state_dict(state)


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("saved", STRUCTURES)
def test_a_state_of_another_structure_is_refused(saved, subset):
    state = _saved(_fitted(saved, subset))
    for loading in STRUCTURES:
        if loading != saved:
            with pytest.raises(ValueError, match=rf"hessian_structure='{saved}'.*'{loading}'"):
                _la(loading, subset).load_state_dict(state)


def test_a_stock_state_is_refused_by_name():
    stock = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure="kron")
    stock.fit(DataLoader(TensorDataset(*_data(False)), batch_size=8))
    with pytest.raises(ValueError, match="KronLaplace"):
        _la("debiased_kron", "all").load_state_dict(_saved(stock))


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_full"])
def test_an_online_fit_after_loading_equals_the_online_fit_without_saving(structure):
    """laplace-torch's ``test_serialize_override`` (regression, two Linear layers, 10 samples in
    batches of 3, tuned prior, σ = 1231): the online fit on the same data doubles the curvature;
    and it is the online fit of the object that was never saved, to the bit."""
    g = torch.Generator().manual_seed(0)
    dl = DataLoader(TensorDataset(torch.randn(10, 3, generator=g, dtype=torch.float64),
                                  torch.randn(10, 2, generator=g, dtype=torch.float64)), batch_size=3)  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 20), nn.Linear(20, 2)).double()
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure)
    la.fit(dl)
    la.optimize_prior_precision()
    la.sigma_noise = 1231
    H_orig = la.H_facs.to_matrix() if structure == "debiased_kron" else la.H.clone()
    la2 = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure)
    la2.load_state_dict(_saved(la))
    la2.fit(dl, override=False)
    H_new = la2.H_facs.to_matrix() if structure == "debiased_kron" else la2.H
    torch.testing.assert_close(H_new, 2 * H_orig, rtol=1e-12, atol=1e-12 * float(H_orig.abs().max()))
    la.fit(dl, override=False)
    assert la2.n_data == la.n_data == 20
    P, P2 = la.posterior_precision, la2.posterior_precision
    assert torch.equal(*(p.to_matrix() if structure == "debiased_kron" else p for p in (P2, P)))


def test_check_saved_fit_names_the_first_difference():
    layout = [("a.weight", (2, 3)), ("a.bias", (2,))]
    state = fit_state("debiased_full", "all", layout, (3,))
    check_saved_fit(state, "debiased_full", "all", lambda: layout)
    with pytest.raises(ValueError, match="hessian_structure='debiased_full'.*'debiased_kron'"):
        check_saved_fit(state, "debiased_kron", "last_layer", lambda: layout)
    with pytest.raises(ValueError, match="subset_of_weights='all'.*'last_layer'"):
        check_saved_fit(state, "debiased_full", "last_layer", lambda: layout)
    with pytest.raises(ValueError, match=r"a\.bias.*\(2,\).*\(3,\)"):
        check_saved_fit(state, "debiased_full", "all", lambda: [("a.weight", (2, 3)), ("a.bias", (3,))])
    with pytest.raises(ValueError, match="b.weight"):
        check_saved_fit(state, "debiased_full", "all", lambda: [*layout, ("b.weight", (1, 2))])
    with pytest.raises(ValueError, match="a.bias"):
        check_saved_fit(state, "debiased_full", "all", lambda: layout[:1])
    with pytest.raises(ValueError, match="KronLaplace"):
        check_saved_fit({"cls_name": "KronLaplace"}, "debiased_kron", "all", lambda: layout)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_state_loads_into_a_fitted_last_layer_object(structure):
    """laplace-torch's loading looks for the last layer again and raises "Last layer is already
    known" on an object that has found it; a loaded state replaces the earlier fit instead."""
    la = _fitted(structure, "last_layer")
    fitted = _fitted(structure, "last_layer")
    fitted.fit(DataLoader(TensorDataset(*_data(False, seed=9)), batch_size=8))
    fitted.load_state_dict(_saved(la))
    X, _ = _data(False, n=5, seed=3)
    assert torch.equal(fitted(X), la(X))

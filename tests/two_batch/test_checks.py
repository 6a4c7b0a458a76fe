"""A classifier that ends in a softmax is refused by the two-batch fit (its outputs would be
treated as logits), for every structure and both weight subsets; logits and log-probabilities fit."""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch import nn

import laplace_debiased  # noqa: F401
from laplace_debiased.two_batch.checks import outputs_are_probabilities
from tests._models import loader, tiny_mlp, toy_data

STRUCTURES = ["debiased_kron", "debiased_ekfac", "debiased_lowrank", "debiased_full"]


def _fit(model: nn.Module, structure: str, subset: str):
    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure,
                 **({"rank": 4} if structure == "debiased_lowrank" else {}))
    la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    return la


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_softmax_head_is_refused(structure, subset):
    with pytest.raises(ValueError, match="ends in a softmax.*remove the final nn.Softmax"):
        _fit(nn.Sequential(*tiny_mlp(), nn.Softmax(dim=-1)), structure, subset)


@pytest.mark.parametrize("head", [nn.Identity(), nn.LogSoftmax(dim=-1)])
def test_logits_and_log_probabilities_fit(head):
    la = _fit(nn.Sequential(*tiny_mlp(), head), "debiased_kron", "all")
    assert la.n_data == 32


def test_probability_rows_are_recognised():
    p = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert outputs_are_probabilities(p) and outputs_are_probabilities(p.float())
    assert outputs_are_probabilities(p.reshape(5, 1, 7))  # token outputs
    assert not outputs_are_probabilities(p.log())
    assert not outputs_are_probabilities(p * 1.01)
    assert not outputs_are_probabilities(p[:, :1] / p[:, :1])  # one output column is not a class vector


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_model_on_the_meta_device_is_refused(structure, subset):
    """A model built on the meta device (``torch.device("meta")``, as for loading large models) has
    no parameter values: the fit says so instead of failing inside an operator."""
    with pytest.raises(ValueError, match=r"meta device.*'(model\.)?0\.weight'.*to_empty.*load"):
        _fit(nn.Sequential(*tiny_mlp()).to("meta"), structure, subset)


class _Wrapped(nn.Module):
    """Returns the logits inside a tuple or a dict, as Hugging Face models do without a wrapper."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net, self.kind = nn.Sequential(*tiny_mlp()), kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor] | dict[str, torch.Tensor]:
        f = self.net(x)
        return (f,) if self.kind == "tuple" else {"logits": f}


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_outputs_other_than_a_tensor_are_refused(structure, subset, kind):
    with pytest.raises(TypeError, match=rf"returns a {kind}.*wrap.*returns the logits"):
        _fit(_Wrapped(kind), structure, subset)

"""Model inputs and targets of the curvature passes (:mod:`laplace_debiased.curvature.inputs`):
sample and row counts, padded samples left out, mapping inputs sliced row-wise, the functional
model equal to the module, and refused likelihoods and models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_debiased.curvature.inputs import (
    count_rows,
    count_samples,
    functional_model,
    loss_factor,
    mapping_rows,
    parameter_count,
    take_rows,
    trainable_parameters,
    unpadded_samples,
)


class TokenModel(nn.Module):
    """``(n, T, d)`` inputs to ``(n, T, C)`` logits."""

    def __init__(self, d: int = 3, C: int = 2) -> None:
        super().__init__()
        self.lin = nn.Linear(d, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_loss_factor_is_laplace_torchs_and_unknown_likelihoods_are_refused():
    assert loss_factor("classification") == 1.0 and loss_factor("regression") == 0.5
    with pytest.raises(ValueError, match="likelihood must be one of"):
        loss_factor("poisson")


def test_samples_and_rows_are_counted_per_token():
    model = TokenModel()
    batches = [(torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.long)),
               (torch.randn(3, 5, 3), torch.zeros(3, 5, dtype=torch.long))]
    assert count_samples(batches) == 5 and count_rows(model, batches) == 25
    flat = [(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))]
    assert count_samples(flat) == count_rows(nn.Linear(3, 2), flat) == 4


def test_padded_samples_are_left_out_and_empty_batches_dropped():
    X = torch.arange(8.0).reshape(4, 2)
    kept = unpadded_samples([(X, torch.tensor([1, -100, 0, -100])), (X[:2], torch.tensor([-100, -100])), (X[:1], torch.tensor([2]))])
    assert len(kept) == 2
    assert torch.equal(kept[0][0], X[[0, 2]]) and kept[0][1].tolist() == [1, 0]
    assert torch.equal(kept[1][0], X[:1])


def test_mapping_inputs_are_sliced_row_wise_and_keep_other_entries():
    X = {"ids": torch.arange(12).reshape(4, 3), "mask": torch.ones(4, 3), "scale": torch.tensor(2.0), "name": "x"}
    assert mapping_rows(X) == 4
    part = take_rows(X, slice(1, 3))
    assert torch.equal(part["ids"], X["ids"][1:3]) and part["mask"].shape == (2, 3)
    assert part["scale"] is X["scale"] and part["name"] == "x" and X["ids"].shape == (4, 3)
    assert torch.equal(take_rows(X["ids"], slice(0, 1)), X["ids"][:1])
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        mapping_rows({"scale": torch.tensor(1.0)})


def test_the_functional_model_is_the_module_and_only_trainable_parameters_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    params = trainable_parameters(model)
    assert list(params) == ["0.weight", "2.weight", "2.bias"] and parameter_count(model) == 12 + 8 + 2
    fn, theta = functional_model(model)
    assert list(theta) == list(params)
    X = torch.randn(5, 3)
    torch.testing.assert_close(fn(theta, X), model(X))
    # a chosen subset: the other parameters are held at their values
    fn_last, theta_last = functional_model(model, [model[2].weight])
    assert list(theta_last) == ["2.weight"]
    torch.testing.assert_close(fn_last(theta_last, X), model(X))
    with pytest.raises(ValueError, match="must be a parameter of the model"):
        functional_model(model, [nn.Parameter(torch.ones(1))])
    shifted = {k: v + 1 for k, v in params.items()}
    assert not torch.allclose(fn(shifted, X), model(X))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        trainable_parameters(model)

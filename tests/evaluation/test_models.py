"""The evaluation models (:mod:`laplace_debiased.evaluation.models`): input and output shapes and
the parameter counts their docstrings state, counted from the layer sizes."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.evaluation.models import MODELS, cifar_cnn, digits_cnn, digits_mlp


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _conv(c_in: int, c_out: int, k: int = 3) -> int:
    return c_out * c_in * k * k + c_out


@pytest.mark.parametrize("name, shape", [("digits_mlp", (5, 1, 8, 8)), ("digits_cnn", (5, 1, 8, 8)),
                                         ("cifar_cnn", (5, 3, 32, 32))])
@pytest.mark.parametrize("n_classes", [10, 7])
def test_each_model_maps_its_inputs_to_one_logit_per_class(name, shape, n_classes):
    torch.manual_seed(0)
    assert MODELS[name](n_classes=n_classes)(torch.randn(shape)).shape == (5, n_classes)


def test_parameter_counts_follow_from_the_layer_sizes():
    assert _count(digits_cnn()) == _conv(1, 8) + _conv(8, 16) + (256 * 32 + 32) + (32 * 10 + 10) == 9802
    assert _count(cifar_cnn()) == _conv(3, 16) + _conv(16, 32) + _conv(32, 64) + (1024 * 32 + 32) + (32 * 10 + 10) == 56714
    assert _count(digits_mlp((64,))) == (64 * 64 + 64) + (64 * 10 + 10)
    assert _count(digits_mlp((20, 5), n_classes=3)) == (64 * 20 + 20) + (20 * 5 + 5) + (5 * 3 + 3)


def test_an_mlp_without_hidden_layers_is_linear():
    model = digits_mlp(hidden=())
    x, y = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(model(x + y) - model(y), model(x) - model(torch.zeros(1, 1, 8, 8)))

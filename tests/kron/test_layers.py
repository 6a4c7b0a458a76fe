"""The layer and block functions of the debiased K-FAC (kron/layers.py): frozen
parameters' blocks are dropped, blocks are named per layer and parameter, and a block list that
misses a trainable parameter is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_debiased.curvature.layer_blocks import curvature_modules, expected_block_shapes
from laplace_debiased.kron.layers import block_names, check_blocks, trainable_blocks


def _mlp_with_frozen_first_bias() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    return model


def _blocks(shapes: list[list[tuple[int, ...]]]) -> list[list[torch.Tensor]]:
    return [[torch.full(shape, float(i)) for shape in block] for i, block in enumerate(shapes)]


def test_the_frozen_bias_block_is_dropped_and_the_rest_kept_in_order():
    model = _mlp_with_frozen_first_bias()
    # laplace-torch's backends: weight and bias block for every layer with a trainable parameter
    kfacs = _blocks([[(4, 4), (3, 3)], [(4, 4)], [(2, 2), (4, 4)], [(2, 2)]])
    kept = trainable_blocks(model, kfacs)
    assert [int(block[0][0, 0]) for block in kept] == [0, 2, 3]
    check_blocks(kept, curvature_modules(model), backend=object())  # the trainable parameters' blocks


def test_blocks_of_another_layout_are_returned_unchanged():
    kfacs = _blocks([[(4, 4), (3, 3)]])
    assert trainable_blocks(_mlp_with_frozen_first_bias(), kfacs) is kfacs


def test_blocks_are_named_by_layer_and_parameter():
    model = _mlp_with_frozen_first_bias()
    assert block_names(model, 3) == [("0", "weight"), ("2", "weight"), ("2", "bias")]
    assert block_names(model, 2) == [("block 0", ""), ("block 1", "")]


def test_a_missing_block_is_refused():
    model = _mlp_with_frozen_first_bias()
    modules = curvature_modules(model)
    shapes = [list(block) for block in expected_block_shapes(modules)]
    assert shapes == [[(4, 4), (3, 3)], [(2, 2), (4, 4)], [(2, 2)]]
    with pytest.raises(ValueError, match="some layer is unsupported by object"):
        check_blocks(_blocks(shapes[:2]), modules, backend=object())

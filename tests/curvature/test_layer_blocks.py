"""Which layers carry curvature blocks, the blocks' shapes and spans, and per-tensor priors."""

import pytest
import torch
from torch import nn

from laplace_debiased.curvature.layer_blocks import (
    block_deltas,
    block_spans,
    curvature_modules,
    expected_block_shapes,
    is_extra,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def test_blocks_follow_the_parameter_tensors():
    model = _model()
    modules = curvature_modules(model)
    assert modules == [model[0], model[1], model[3]]
    shapes = expected_block_shapes(modules)
    # Linear weight [G, A] and bias [G]; LayerNorm weight and bias in one dense 10 x 10 block;
    # bias-free Linear: its weight only
    assert shapes == [[(5, 5), (4, 4)], [(5, 5)], [(10, 10)], [(3, 3), (5, 5)]]
    spans = block_spans(modules)
    assert spans == [1, 1, 2, 1] and sum(spans) == len(list(model.parameters()))
    assert [is_extra(m) for m in modules] == [False, True, False]


def test_frozen_parameters_leave_the_blocks():
    model = _model()
    model[1].bias.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    modules = curvature_modules(model)
    assert expected_block_shapes(modules) == [[(5, 5), (4, 4)], [(5, 5)], [(3, 3), (5, 5)]]
    assert block_spans(modules) == [1, 1, 1]


def test_per_tensor_prior_precisions_map_to_blocks():
    spans = [1, 1, 2, 1]
    deltas = torch.tensor([1.0, 2.0, 3.0, 3.0, 4.0])
    assert block_deltas(deltas, spans).tolist() == [1.0, 2.0, 3.0, 4.0]
    scalar = torch.tensor(0.5)
    assert block_deltas(scalar, spans) is scalar
    per_block = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert block_deltas(per_block, spans) is per_block
    with pytest.raises(ValueError, match="give them the same value"):
        block_deltas(torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0]), spans)

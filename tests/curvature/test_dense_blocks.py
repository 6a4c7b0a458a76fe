"""Dense curvature blocks of normalisation and embedding layers
(:mod:`laplace_debiased.curvature.dense_blocks`): block sizes, the normalised input, per-sample
affine gradients against autograd, embedding token counts, and refused layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_debiased.curvature.dense_blocks import block_dims, embedding_input_sums, norm_sample_grads, normalised_input


def test_block_sizes_of_each_layer_kind():
    assert block_dims(nn.Linear(3, 5)) == (5, 3)
    assert block_dims(nn.Conv2d(2, 4, 3)) == (4, 18)
    assert block_dims(nn.Embedding(7, 4)) == (4, 7)
    assert block_dims(nn.LayerNorm(6)) == (12, None)
    frozen = nn.Linear(3, 5)
    frozen.weight.requires_grad_(False)
    assert block_dims(frozen) == (5, None)


@pytest.mark.parametrize("layer, shape", [(nn.LayerNorm(4), (3, 2, 4)), (nn.GroupNorm(2, 4), (3, 4, 5)),
                                          (nn.BatchNorm1d(4), (3, 4, 5))])
def test_per_sample_affine_gradients_equal_autograd(layer, shape):
    torch.manual_seed(0)
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(0.5, 1.5)
    if isinstance(layer, nn.BatchNorm1d):
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
        layer.eval()
    x = torch.randn(*shape, dtype=torch.float64)
    x_hat = normalised_input(layer, x)
    # the layer is its affine map of x̂
    w, b = layer.weight, layer.bias
    view = (1, -1) + (1,) * (x.ndim - 2) if not isinstance(layer, nn.LayerNorm) else (-1,)
    torch.testing.assert_close(layer(x), x_hat * w.reshape(view) + b.reshape(view))
    g = torch.randn_like(x)
    ours = norm_sample_grads(layer, x_hat, g)
    for n in range(len(x)):
        grads = torch.autograd.grad((layer(x[n : n + 1]) * g[n : n + 1]).sum(), [w, b])
        torch.testing.assert_close(ours[n], torch.cat([gr.reshape(-1) for gr in grads]))


def test_a_batchnorm_in_train_mode_and_other_layers_are_refused():
    with pytest.raises(ValueError, match="call model.eval"):
        normalised_input(nn.BatchNorm1d(3).train(), torch.randn(2, 3))
    with pytest.raises(TypeError, match="not a normalisation layer"):
        normalised_input(nn.Linear(3, 3), torch.randn(2, 3))


def test_embedding_sums_count_tokens_per_group_and_skip_padding():
    emb = nn.Embedding(5, 2, padding_idx=0)
    idx = torch.tensor([[1, 1, 0, 3], [2, 4, 4, 4], [3, 3, 3, 3]])
    out = torch.zeros(2, 5, 5, dtype=torch.float64)
    embedding_input_sums(emb, idx, [(0, 2, 0), (2, 3, 1)], out)
    assert torch.equal(out, torch.diag_embed(out.diagonal(dim1=1, dim2=2)))  # diagonal only
    torch.testing.assert_close(out[0].diagonal(), torch.tensor([0, 2, 1, 1, 3], dtype=torch.float64) / 4)
    torch.testing.assert_close(out[1].diagonal(), torch.tensor([0, 0, 0, 4, 0], dtype=torch.float64) / 4)
    with pytest.raises(ValueError, match="max_norm"):
        embedding_input_sums(nn.Embedding(5, 2, max_norm=1.0), idx, [(0, 1, 0)], out)

"""Self-attention as linear curvature layers (:mod:`laplace_debiased.curvature.attention`): the
re-evaluated forward equals ``nn.MultiheadAttention``'s with its masks and layouts, its parts are
the projections' inputs and outputs, and unsupported attention is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from laplace_debiased.curvature.attention import AttentionProjection, attention_parts, check_attention, is_conv1d


def _attention(batch_first: bool = True, **kw) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw).double().eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "float"])
def test_the_parts_reproduce_the_module_and_are_the_projections(batch_first, masks):
    mha = _attention(batch_first)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    kw = {}
    if masks == "causal":
        kw["attn_mask"] = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    elif masks == "padding":
        kw["key_padding_mask"] = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    elif masks == "float":
        kw["attn_mask"] = torch.randn(5, 5, dtype=torch.float64)
    parts = attention_parts(mha, (x, x, x), kw)
    out, w = mha(x, x, x, **kw)
    torch.testing.assert_close(parts.result[0], out)
    torch.testing.assert_close(parts.result[1], w)
    xb = x if batch_first else x.transpose(0, 1)
    assert torch.equal(parts.inputs, xb)
    torch.testing.assert_close(parts.projections, F.linear(xb, mha.in_proj_weight, mha.in_proj_bias))
    torch.testing.assert_close(parts.output, F.linear(parts.heads, mha.out_proj.weight, mha.out_proj.bias))


def test_unbatched_input_and_per_head_weights():
    mha = _attention()
    x = torch.randn(4, 8, dtype=torch.float64)
    parts = attention_parts(mha, (x, x, x), {"average_attn_weights": False})
    out, w = mha(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(parts.result[0], out)
    torch.testing.assert_close(parts.result[1], w)


def test_cross_attention_and_unsupported_options_are_refused():
    mha = _attention()
    x, y = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="self-attention only"):
        attention_parts(mha, (x, y, y), {})
    check_attention("ok", mha)
    for kw, what in [({"add_bias_kv": True}, "add_bias_kv=True"), ({"add_zero_attn": True}, "add_zero_attn=True"),
                     ({"kdim": 4, "vdim": 4}, "separate q/k/v")]:
        with pytest.raises(ValueError, match=f"layer 'attn'.*{what}"):
            check_attention("attn", nn.MultiheadAttention(8, 2, **kw))


def test_projections_share_the_attention_parameters_and_are_not_callable():
    mha = _attention()
    inp, out = AttentionProjection(mha, "in_proj"), AttentionProjection(mha, "out_proj")
    assert inp.weight is mha.in_proj_weight and inp.bias is mha.in_proj_bias
    assert out.weight is mha.out_proj.weight and list(out.children()) == []
    with pytest.raises(TypeError, match="call the attention"):
        inp(torch.zeros(1, 8))


def test_only_gpt2_conv1d_counts_as_conv1d():
    class Conv1D(nn.Module):  # GPT-2's layer: weight (nx, nf)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3, 4))

    assert is_conv1d(Conv1D()) and not is_conv1d(nn.Conv1d(3, 4, 1)) and not is_conv1d(nn.Linear(3, 4))

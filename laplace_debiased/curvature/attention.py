"""Linear layers hidden inside other modules, as K-FAC layers: ``nn.MultiheadAttention``'s two
projections and ``transformers``' GPT-2 ``Conv1D``.

**Multi-head self-attention** on tokens ``x_t`` (``t = 1..T``, width ``E``, ``h`` heads of width
``d = E/h``) computes

    z_t = W_in x_t + b_in = [q_t; k_t; v_t]              (packed input projection, 3E × E)
    o_t = concat_heads(Σ_s softmax_s(q_t·k_s/√d + mask_ts) v_s)
    y_t = W_out o_t + b_out                              (output projection, E × E)

so both projections are linear layers applied at every token position with one shared weight.
K-FAC treats them like ``nn.Linear`` on ``(n, T, in)`` inputs, with the convention the package's
single-pass K-FAC ([`laplace_debiased.curvature.kfac`][laplace_debiased.curvature.kfac]) uses for every layer:
**"expand"**
(Eschenhagen et al., NeurIPS 2023; curvlinops' ``kfac_approx="expand"``, laplace-torch's
default). The token positions count as extra samples of the layer:

    A = Σ_n (1/T) Σ_t a_nt a_ntᵀ,          G = Σ_n Σ_t Σ_c g_ntc g_ntcᵀ,

with ``a_nt`` the projection's input at ``t`` (``x_t`` for ``W_in``, ``o_t`` for ``W_out``) and
``g_ntc`` the gradient of ``f_n · S_n[:, c]`` w.r.t. its output ``z_t`` or ``y_t``. What this
approximates: the exact GGN block of ``W_in`` is ``Σ_n Σ_c (Σ_t a_nt ⊗ g_ntc)(Σ_t a_nt ⊗
g_ntc)ᵀ``; "expand" drops the cross terms ``t ≠ t'`` of that double sum and then factorises
the remaining sum of Kronecker products. The output gradients ``g_ntc`` are exact: they carry
the attention weights (a query at ``t`` moves every output that attends to ``t``, a key or value
at ``t`` every output attending to it), so ``G`` includes all of attention's mixing of positions
through the Jacobian; only the Kronecker factorisation over positions is approximate. For one
token (``T = 1``) and one sample the block is the exact GGN block. A sequence classifier (one
output per sequence) is the setting where Eschenhagen et al.'s "reduce" variant is exact for
deep linear networks; the package does not implement "reduce".

``nn.MultiheadAttention`` calls ``F.multi_head_attention_forward`` with its weights, so no
module hook sees the projections' inputs and outputs. During the K-FAC pass a forward hook
re-evaluates the attention with [`attention_parts`][laplace_debiased.curvature.attention.attention_parts] (the
formula above, the same masks and dropout) and returns its output instead, which exposes ``x``, ``z``, ``o``
and ``y`` to the hooks. Supported: self-attention (``query``, ``key`` and ``value`` the same tensor) with one
packed input projection, no ``add_bias_kv``, no ``add_zero_attn``
([`check_attention`][laplace_debiased.curvature.attention.check_attention]).

**GPT-2 ``Conv1D``** is a transposed linear layer: ``weight`` ``(nx, nf)``, ``bias`` ``(nf,)``,
``y = x @ weight + bias``. It is recognised by its class name ``"Conv1D"`` with a 2-D
``weight`` ([`is_conv1d`][laplace_debiased.curvature.attention.is_conv1d]; ``transformers`` is never
imported). Its K-FAC block is the ``nn.Linear`` block with the two factors swapped, ``A ⊗ G`` in the order of
``weight.flatten()`` (input index slow), like an embedding.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "AttentionParts",
    "AttentionProjection",
    "attention_parts",
    "check_attention",
    "is_conv1d",
]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a GPT-2-style ``Conv1D``: class name ``"Conv1D"`` (exactly; torch's
    ``nn.Conv1d`` is a different layer) and a 2-D ``weight`` ``(nx, nf)``."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.ndim == 2


def check_attention(name: str, module: nn.MultiheadAttention) -> None:
    """Raise a ``ValueError`` if the K-FAC of
    [`attention_parts`][laplace_debiased.curvature.attention.attention_parts] does not cover ``module``."""
    unsupported = [
        what
        for what, present in (
            ("separate q/k/v projection weights (kdim or vdim differ from embed_dim)", not module._qkv_same_embed_dim),
            ("add_bias_kv=True", module.bias_k is not None or module.bias_v is not None),
            ("add_zero_attn=True", module.add_zero_attn),
        )
        if present
    ]
    if unsupported:
        raise ValueError(
            f"layer '{name}' (MultiheadAttention) has {', '.join(unsupported)}; debiased_kron and "
            "debiased_ekfac cover one packed in_proj_weight and out_proj. Freeze this layer, or "
            "use hessian_structure='debiased_full' or 'debiased_lowrank'."
        )


class AttentionProjection(nn.Module):
    """One projection of an ``nn.MultiheadAttention`` as a linear curvature layer: ``weight``
    ``(d_out, d_in)`` and ``bias`` are the attention's own parameters (``in_proj_weight``,
    ``in_proj_bias`` for ``part="in_proj"``; ``out_proj.weight``, ``out_proj.bias`` for
    ``"out_proj"``). Never called: the K-FAC pass hooks ``attention`` (module docstring)."""

    def __init__(self, attention: nn.MultiheadAttention, part: Literal["in_proj", "out_proj"]) -> None:
        super().__init__()
        if part == "in_proj":
            weight, bias = attention.in_proj_weight, attention.in_proj_bias
        else:
            weight, bias = attention.out_proj.weight, attention.out_proj.bias
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.part = part
        object.__setattr__(self, "attention", attention)  # a reference, not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        raise TypeError("an AttentionProjection stands for part of an nn.MultiheadAttention; call the attention.")


@dataclass
class AttentionParts:
    """One self-attention forward pass, batch first (``n`` samples, ``T`` tokens, width ``E``).

    Attributes:
        inputs: ``(n, T, E)`` the input projection's input ``x``.
        projections: ``(n, T, 3E)`` its output ``z = [q; k; v]`` (in the autograd graph).
        heads: ``(n, T, E)`` the output projection's input ``o`` (concatenated heads).
        output: ``(n, T, E)`` its output ``y`` (in the autograd graph).
        result: what ``nn.MultiheadAttention.forward`` returns: ``y`` in the module's layout and
            the attention weights (or ``None`` when ``need_weights=False``).
    """

    inputs: Tensor
    projections: Tensor
    heads: Tensor
    output: Tensor
    result: tuple[Tensor, Tensor | None]


def _additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | float:
    """A boolean mask (``True`` = not allowed) as ``-inf`` entries, a float mask as it is."""
    if mask is None:
        return 0.0
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
    return mask.to(dtype)


def _scores_mask(call: Mapping[str, Any], n: int, heads: int, T: int, dtype: torch.dtype) -> Tensor | float:
    """``attn_mask`` ``(T, S)`` or ``(n·heads, T, S)`` plus ``key_padding_mask`` ``(n, S)``
    (unbatched: ``(S,)``), additive, broadcastable to ``(n, heads, T, S)``."""
    attn = _additive_mask(call["attn_mask"], dtype)
    if isinstance(attn, Tensor) and attn.ndim == 3:
        attn = attn.reshape(n, heads, T, -1)
    padding = _additive_mask(call["key_padding_mask"], dtype)
    if isinstance(padding, Tensor):
        padding = padding.reshape(n, 1, 1, -1)
    return attn + padding


def attention_parts(module: nn.MultiheadAttention, args: tuple, kwargs: dict[str, Any]) -> AttentionParts:
    """Re-evaluate ``module(*args, **kwargs)`` as the formula of the module docstring, keeping
    its intermediate tensors. Raises a ``ValueError`` for cross-attention (``query``, ``key``,
    ``value`` not the same tensor), whose packed projection acts on three different inputs."""
    call = _SIGNATURE.bind(module, *args, **kwargs)
    call.apply_defaults()
    call = call.arguments
    x = call["query"]
    if not (call["key"] is x and call["value"] is x):
        raise ValueError(
            "debiased_kron/debiased_ekfac cover nn.MultiheadAttention as self-attention only "
            "(query, key and value the same tensor); for cross-attention freeze the layer or use "
            "hessian_structure='debiased_full' or 'debiased_lowrank'."
        )
    batched = x.ndim == 3
    xb = (x if module.batch_first else x.transpose(0, 1)) if batched else x.unsqueeze(0)
    n, T, E = xb.shape
    h = module.num_heads
    z = F.linear(xb, module.in_proj_weight, module.in_proj_bias)
    q, k, v = (t.reshape(n, T, h, E // h).transpose(1, 2) for t in z.chunk(3, dim=-1))
    scores = q @ k.transpose(-2, -1) / math.sqrt(E // h) + _scores_mask(call, n, h, T, z.dtype)
    weights = F.dropout(torch.softmax(scores, dim=-1), module.dropout, module.training)
    o = (weights @ v).transpose(1, 2).reshape(n, T, E)
    y = F.linear(o, module.out_proj.weight, module.out_proj.bias)
    out = (y if module.batch_first else y.transpose(0, 1)) if batched else y.squeeze(0)
    w = None
    if call["need_weights"]:
        w = weights.mean(1) if call["average_attn_weights"] else weights
        w = w if batched else w.squeeze(0)
    return AttentionParts(xb, z, o, y, (out, w))

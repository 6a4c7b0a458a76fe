"""Curvature blocks for the layers K-FAC does not cover: normalisation affines and embeddings.

Both are summed in the same forward/backward passes as the K-FAC factors
([`laplace_debiased.curvature.kfac.group_kfac_sums`][laplace_debiased.curvature.kfac.group_kfac_sums]); this
module holds their maths.

**Normalisation layers** (``BatchNorm1d/2d/3d``, ``LayerNorm``, ``GroupNorm``) in eval mode
compute ``y = γ ∘ x̂ + β`` with ``x̂`` a function of the input alone (running statistics for
BatchNorm, per-sample statistics for LayerNorm/GroupNorm), so samples do not interact and the
per-sample gradient of a scalar ``s_n`` of sample ``n`` w.r.t. the affine parameters is, with
``g_n = ∂s_n/∂y_n``,

    ∂s_n/∂γ = Σ_{positions} g_n ∘ x̂_n,        ∂s_n/∂β = Σ_{positions} g_n

([`norm_sample_grads`][laplace_debiased.curvature.dense_blocks.norm_sample_grads]). With
``s_nc = f_n · S_n[:, c]`` for a square root ``S_n S_nᵀ = Λ_n`` of the loss Hessian, ``v_nc = J_nᵀ S_n[:, c]``
and the **exact dense GGN block** of the layer's ``d`` trainable affine parameters (``d = 2C`` for ``C``
channels) is

    G = Σ_n J_nᵀ Λ_n J_n = Σ_n Σ_c v_nc v_ncᵀ        (d, d),

parameter order ``[weight, bias]`` (``torch.nn.Module.parameters`` order). It is debiased like
a one-factor K-FAC block
([`laplace_debiased.curvature.linalg.debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron]):
eigenvectors ``U`` of ``G_B``, eigenvalues ``diag(Uᵀ G_B̃ U)``.

**Embeddings** (``nn.Embedding``, weight ``(V, D)``) are a linear layer on one-hot inputs:
``out_t = Wᵀ e_{x_t}``. Their K-FAC block (convention "expand", tokens as positions ``t`` as
for ``Linear`` on ``(n, T, in)``) is ``A ⊗ G`` in the order of ``weight.flatten()`` (vocabulary
index slow): ``G = Σ_n Σ_t Σ_c g_ntc g_ntcᵀ`` ``(D, D)`` over the output gradients, and the
input side ``A = Σ_n (1/T) Σ_t e_{x_nt} e_{x_nt}ᵀ`` is **diagonal** with the (per-sample
averaged) token frequencies
([`embedding_input_sums`][laplace_debiased.curvature.dense_blocks.embedding_input_sums]; tokens at
``padding_idx``, whose row gets no gradient, are not counted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from laplace_debiased.curvature.attention import is_conv1d

__all__ = [
    "NORM_LAYERS",
    "block_dims",
    "embedding_input_sums",
    "norm_sample_grads",
    "normalised_input",
]

#: Normalisation layers with an elementwise affine ``γ ∘ x̂ + β`` that get a dense GGN block.
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def _trainable(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [(k, p) for k, p in module.named_parameters(recurse=False) if p.requires_grad]


def block_dims(module: nn.Module) -> tuple[int, int | None]:
    """Sizes ``(d_out, d_in)`` of a module's per-group K-FAC sums (``d_in`` ``None``: no input
    side).  Normalisation: ``(d, None)`` with ``d`` its trainable affine parameters (a dense
    block); ``Embedding`` ``(V, D)``: ``(D, V)``; GPT-2 ``Conv1D`` ``(nx, nf)``: ``(nf, nx)``;
    ``Linear``/``Conv2d`` (and attention projections): ``(d_out, d_in)``; input side only if
    the weight is trainable."""
    if isinstance(module, NORM_LAYERS):
        return sum(p.numel() for _, p in _trainable(module)), None
    if isinstance(module, nn.Embedding):
        return module.weight.shape[1], module.weight.shape[0]
    if is_conv1d(module):
        return module.weight.shape[1], (module.weight.shape[0] if module.weight.requires_grad else None)
    return module.weight.shape[0], (module.weight[0].numel() if module.weight.requires_grad else None)


def normalised_input(module: nn.Module, x: Tensor) -> Tensor:
    """``x̂``: the layer's output without its affine (same shape as ``x``), eval-mode semantics.

    BatchNorm uses its running statistics, so it must track them (``track_running_stats=True``)
    and be in eval mode; otherwise samples interact and per-sample curvature is undefined."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if module.training or module.running_mean is None:
            raise ValueError(
                f"{type(module).__name__} in train mode (or without running statistics) mixes the "
                "samples of a batch; call model.eval() (and keep track_running_stats=True) before "
                "fitting a Laplace approximation."
            )
        return F.batch_norm(x, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, None, None, module.eps)
    raise TypeError(f"not a normalisation layer: {type(module).__name__}")


def norm_sample_grads(module: nn.Module, x_hat: Tensor, g: Tensor) -> Tensor:
    """Per-sample gradients ``(n, d)`` of the module's trainable affine parameters.

    ``x_hat`` ([`normalised_input`][laplace_debiased.curvature.dense_blocks.normalised_input]) and ``g``
    (gradient of a per-sample scalar w.r.t. the layer output) share the output's shape ``(n, ...)``; the
    result concatenates ``Σ g ∘ x̂`` (weight) and ``Σ g`` (bias), summed over every dimension the parameter is
    shared across (BatchNorm/GroupNorm: all but the channel dim 1; LayerNorm: all but the
    trailing ``normalized_shape``), for the trainable ones among ``[weight, bias]``."""
    if isinstance(module, nn.LayerNorm):
        k = len(module.normalized_shape)
        dims = tuple(range(1, g.ndim - k))
    else:
        dims = tuple(range(2, g.ndim))
    parts = []
    for name, _ in _trainable(module):
        t = g * x_hat if name == "weight" else g
        parts.append((t.sum(dims) if dims else t).reshape(len(g), -1))
    return torch.cat(parts, dim=1)


def embedding_input_sums(
    module: nn.Embedding, idx: Tensor, segments: Sequence[tuple[int, int, int]], out: Tensor,
    position_weights: Tensor | None = None,
) -> None:
    """``out[group] += Σ_{n ∈ segment} Σ_t w_nt e_{x_nt} e_{x_nt}ᵀ`` (a diagonal) per
    ``(start, stop, group)``; ``idx`` ``(n, ...)`` token indices, ``T`` the tokens per sample,
    ``out`` ``(n_groups, V, V)``, ``w_nt = position_weights`` ``(n, T)`` (default ``1/T``: padded
    target positions get other weights,
    [`position_weights`][laplace_debiased.curvature.kfac.position_weights]). Tokens at ``padding_idx`` are not
    counted."""
    if module.max_norm is not None:
        raise ValueError(
            "nn.Embedding with max_norm rescales its weight inside forward; its curvature is "
            "not a linear layer's. Use max_norm=None or freeze the embedding."
        )
    flat = idx.reshape(len(idx), -1)
    if position_weights is None:
        weights = torch.full(flat.shape, 1.0 / flat.shape[1], dtype=out.dtype, device=out.device)
    else:
        weights = position_weights.to(dtype=out.dtype, device=out.device).clone()
    if module.padding_idx is not None:
        weights[flat == module.padding_idx] = 0.0
    V = module.num_embeddings
    for start, stop, group in segments:
        counts = torch.bincount(flat[start:stop].reshape(-1), weights[start:stop].reshape(-1), minlength=V)
        out[group].diagonal().add_(counts)

"""Which layers of a network carry curvature blocks, and the blocks each one gets.

``debiased_kron`` and ``debiased_ekfac`` over all weights keep one curvature block per
*layer part* in the order of ``model.parameters()``:

* ``nn.Linear`` / ``nn.Conv2d`` (any ``groups``, with or without bias): a K-FAC block
  ``[G, A]`` for the weight, a one-factor block ``[G]`` for the bias;
* ``nn.Embedding`` ``(V, D)``: a K-FAC block ``[A, G]`` (vocabulary factor first, the order of
  ``weight.flatten()``; ``A`` diagonal);
* ``nn.MultiheadAttention`` (self-attention): its packed input projection (``in_proj_weight``
  ``(3E, E)``, ``in_proj_bias``) and its output projection (``out_proj``) as two linear layers
  over token positions, blocks as for ``nn.Linear``; GPT-2 ``Conv1D`` ``(nx, nf)``: a K-FAC
  block ``[A, G]`` (input factor first, the order of ``weight.flatten()``) and a bias block
  ``[G]`` ([`laplace_debiased.curvature.attention`][laplace_debiased.curvature.attention]);
* normalisation layers (BatchNorm, LayerNorm, GroupNorm): **one** dense block ``[G]`` over all
  their trainable affine parameters (weight and bias together, ``2C``), the exact GGN block
  ([`laplace_debiased.curvature.dense_blocks`][laplace_debiased.curvature.dense_blocks]).

A dense normalisation block spans two parameter tensors, so blocks and parameter tensors no
longer correspond one to one: [`block_spans`][laplace_debiased.curvature.layer_blocks.block_spans] counts the
parameter tensors per block and [`block_deltas`][laplace_debiased.curvature.layer_blocks.block_deltas] maps
per-tensor prior precisions to their blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from laplace_debiased.curvature.attention import AttentionProjection, check_attention, is_conv1d
from laplace_debiased.curvature.dense_blocks import NORM_LAYERS
from laplace_debiased.curvature.linalg import RowFactor

__all__ = [
    "CURVATURE_LAYERS",
    "block_deltas",
    "block_modules",
    "block_spans",
    "curvature_modules",
    "expected_block_shapes",
    "is_extra",
    "module_blocks",
    "named_curvature_modules",
]

#: Layers with curvature blocks (K-FAC, embedding K-FAC, dense normalisation blocks); besides
#: these, ``nn.MultiheadAttention`` (as two
#: [`AttentionProjection`][laplace_debiased.curvature.attention.AttentionProjection] layers) and GPT-2
#: ``Conv1D`` ([`is_conv1d`][laplace_debiased.curvature.attention.is_conv1d]).
CURVATURE_LAYERS = (nn.Linear, nn.Conv2d, nn.Embedding, *NORM_LAYERS)


def _owned(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [(k, p) for k, p in module.named_parameters(recurse=False) if p.requires_grad]


def is_extra(module: nn.Module) -> bool:
    """Whether ``module``'s blocks are the ones stock K-FAC lacks (embedding, normalisation,
    attention projections, GPT-2 ``Conv1D``): they come from the package's own K-FAC pass only,
    and ``debiased_ekfac`` gives them debiased K-FAC eigenvalues."""
    return isinstance(module, (nn.Embedding, AttentionProjection, *NORM_LAYERS)) or is_conv1d(module)


def curvature_modules(root: nn.Module) -> list[nn.Module]:
    """The modules of ``root`` owning trainable parameters, in ``parameters()`` order; an
    ``nn.MultiheadAttention`` stands as its
    [`AttentionProjection`][laplace_debiased.curvature.attention.AttentionProjection] layers (``in_proj``,
    then ``out_proj``, those with trainable parameters).

    Raises a ``ValueError`` naming the first layer that has trainable parameters but no
    curvature block (freeze it, or use a structure built on GGN products)."""
    return [m for _, m in named_curvature_modules(root)]


def named_curvature_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """[`curvature_modules`][laplace_debiased.curvature.layer_blocks.curvature_modules] with their names
    (``"<attention>.in_proj"`` for an attention's input projection)."""
    out, inside = [], set()
    for name, module in root.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.MultiheadAttention):
            inside.add(id(module.out_proj))
            if _owned(module) or _owned(module.out_proj):
                check_attention(name, module)
            projections = [AttentionProjection(module, part) for part in ("in_proj", "out_proj")]
            out.extend((f"{name}.{p.part}", p) for p in projections if _owned(p))
            continue
        if not _owned(module):
            continue
        if not (isinstance(module, CURVATURE_LAYERS) or is_conv1d(module)):
            raise ValueError(
                f"layer '{name}' ({type(module).__name__}) has trainable parameters but the "
                "debiased K-FAC/EKFAC has blocks only for nn.Linear, nn.Conv2d, nn.Embedding, "
                "nn.MultiheadAttention, GPT-2 Conv1D, BatchNorm, LayerNorm and GroupNorm. Freeze "
                "it (p.requires_grad_(False) for its parameters), use "
                "hessian_structure='debiased_full' or 'debiased_lowrank', or "
                "subset_of_weights='last_layer'."
            )
        out.append((name, module))
    return out


def module_blocks(
    module: nn.Module, G: Tensor | RowFactor, A: Tensor | RowFactor | None, m: float
) -> list[list[Tensor | RowFactor]]:
    """The curvature blocks of one module from the sums of ``m`` samples (the weight of the input
    side's mean, [`mean_divisor`][laplace_debiased.curvature.kfac.GroupKfacSums.mean_divisor]), ``G`` (output side)
    and ``A`` (input side), in module-docstring order, with the first factor the sum (to be
    scaled to ``N`` points) and the second the mean: ``[G, A/m]`` for a weight, ``[G]`` for a
    bias or a normalisation layer, ``[A, G/m]`` for an embedding or a ``Conv1D`` weight
    (``A ⊗ G/m = (A/m) ⊗ G``). A side may be held as rows
    ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor], scaled alike)."""
    if isinstance(module, NORM_LAYERS):
        return [[G]]
    if isinstance(module, nn.Embedding):
        return [[A, G / m]]
    if is_conv1d(module):
        blocks = [[A, G / m]] if A is not None else []
    else:
        blocks = [[G, A / m]] if A is not None else []
    if module.bias is not None and module.bias.requires_grad:
        blocks.append([G])
    return blocks


def block_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The module of every block, in block order (one block per trainable parameter tensor,
    one per normalisation layer)."""
    return [m for m in modules for _ in ([0] if isinstance(m, NORM_LAYERS) else _owned(m))]


def block_spans(modules: Sequence[nn.Module]) -> list[int]:
    """Parameter tensors per block, in block order (2 for a normalisation layer with a
    trainable weight and bias, else 1)."""
    return [len(_owned(m)) if isinstance(m, NORM_LAYERS) else 1 for m in block_modules(modules)]


def expected_block_shapes(modules: Sequence[nn.Module]) -> list[list[tuple[int, int]]]:
    """Shapes of every block's factors, for checking a fit against the model."""
    shapes = []
    for m in modules:
        owned = dict(_owned(m))
        if isinstance(m, NORM_LAYERS):
            d = sum(p.numel() for p in owned.values())
            shapes.append([(d, d)])
        elif isinstance(m, nn.Embedding):
            V, D = m.weight.shape
            shapes.append([(V, V), (D, D)])
        elif is_conv1d(m):
            nx, nf = m.weight.shape
            if "weight" in owned:
                shapes.append([(nx, nx), (nf, nf)])
            if "bias" in owned:
                shapes.append([(nf, nf)])
        else:
            d_out = m.weight.shape[0]
            if "weight" in owned:
                shapes.append([(d_out, d_out), (m.weight[0].numel(),) * 2])
            if "bias" in owned:
                shapes.append([(d_out, d_out)])
    return shapes


def block_deltas(deltas: Tensor, spans: Sequence[int]) -> Tensor:
    """Per-tensor prior precisions (one per parameter tensor) -> one per block; a scalar or
    per-block tensor passes through. A block whose tensors have different values raises: the
    block's posterior precision ``G + δ I`` has one ``δ`` for all its tensors."""
    if deltas.ndim == 0 or len(deltas) in (1, len(spans)) or len(deltas) != sum(spans):
        return deltas
    out, start = [], 0
    for span in spans:
        part = deltas[start : start + span]
        if not torch.all(part == part[0]):
            raise ValueError(
                f"prior precisions {part.tolist()} for the parameter tensors {start}..{start + span - 1}, "
                "which share one dense curvature block (a normalisation layer's weight and "
                "bias): give them the same value. optimize_prior_precision(method='marglik', "
                "prior_structure='layerwise') does so itself when init_prior_prec is a scalar."
            )
        out.append(part[0])
        start += span
    return torch.stack(out)

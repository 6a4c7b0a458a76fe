"""Which layers and K-FAC blocks a debiased K-FAC covers: the supported layers (K-FAC, embedding
and dense normalisation blocks,
[`laplace_debiased.curvature.layer_blocks`][laplace_debiased.curvature.layer_blocks]), the blocks of frozen
parameters dropped, refusals for what a backend would get wrong, and which backends the shared K-FAC pass
reproduces.  Plain functions of the layers, the blocks and laplace-torch's backend, called by
[`kron`][laplace_debiased.kron.laplace], [`ekfac`][laplace_debiased.ekfac.laplace] and
[`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace].
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from laplace.curvature.backpack import BackPackInterface
from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.curvature.curvlinops import CurvlinopsEF, CurvlinopsGGN
from torch import nn

from laplace_debiased.curvature.dense_blocks import NORM_LAYERS
from laplace_debiased.curvature.layer_blocks import (
    curvature_modules,
    expected_block_shapes,
    is_extra,
    named_curvature_modules,
)
from laplace_debiased.data.batch import Batch

__all__ = ["block_names", "check_blocks", "check_supported", "single_pass_fisher", "trainable_blocks"]

_KFAC_LAYERS = (nn.Linear, nn.Conv2d)


def block_names(layers: nn.Module, n_blocks: int) -> list[tuple[str, str]]:
    """The names of the ``Kron`` blocks of ``layers``.

    Args:
        layers: The network whose trainable layers form the blocks (laplace-torch's backend model).
        n_blocks: The number of blocks of the fitted ``Kron``.

    Returns:
        ``(layer name, "weight"/"bias")`` per block, in block order (a normalisation layer's one
        dense block: ``"weight+bias"``); ``("block i", "")`` if the layers give another count.
    """
    names = []
    for name, m in named_curvature_modules(layers):
        owned = [k for k, p in m.named_parameters(recurse=False) if p.requires_grad]
        parts = ["+".join(owned)] if isinstance(m, NORM_LAYERS) else owned
        names.extend((name or type(m).__name__, part) for part in parts)
    if len(names) != n_blocks:
        return [(f"block {i}", "") for i in range(n_blocks)]
    return names


def trainable_blocks(layers: nn.Module, kfacs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Drop the blocks of frozen parameters (``requires_grad=False``).

    laplace-torch's Curvlinops and ASDL backends return, for every K-FAC layer with a trainable
    parameter, a weight block and a bias block whenever the layer has a bias, frozen or not (stock
    ``KronLaplace`` then misaligns its blocks).

    Args:
        layers: The network the backend computed the blocks of.
        kfacs: The backend's K-FAC blocks.

    Returns:
        The blocks of trainable parameters; blocks in any other layout unchanged, for
        [`check_blocks`][laplace_debiased.kron.layers.check_blocks] to verify.
    """
    owners = [
        p
        for module in layers.modules()
        if isinstance(module, _KFAC_LAYERS) and any(p.requires_grad for p in module.parameters(recurse=False))
        for p in (module.weight, module.bias)
        if p is not None
    ]
    if len(owners) != len(kfacs):
        return kfacs
    return [block for block, p in zip(kfacs, owners) if p.requires_grad]


def check_supported(
    backend: CurvatureInterface,
    layers: nn.Module,
    batches: list[Batch],
    single_pass_fisher: str | None,
    output_shape: tuple[int, ...],
) -> None:
    """Refuse what the backend would get wrong for these layers and batches.

    Embedding, normalisation, attention and ``Conv1D`` blocks come from the shared K-FAC pass only,
    and a normalisation block is exact only for one output row per sample.

    Args:
        backend: laplace-torch's curvature backend.
        layers: The network (laplace-torch's backend model).
        batches: The direction batches.
        single_pass_fisher: The curvature type of the shared K-FAC pass for this backend, ``None``
            where the backend computes the factors.
        output_shape: The per-sample output shape ``([tokens, ...,] C)``.

    Raises:
        ValueError: Dict batches with BackPACK, BackPACK's Conv2d, a backend without PSD
            curvature, or layers that only the shared pass (with one output row) supports.
    """
    if isinstance(backend, BackPackInterface) and isinstance(batches[0], MutableMapping):
        raise ValueError(
            "BackPACK backends cannot take dict (mapping) inputs: BackPACK extends the "
            "modules of a model that is called with one tensor. Use the default "
            "CurvlinopsGGN backend (or AsdlGGN) for dict batches."
        )
    extra = [m for m in curvature_modules(layers) if is_extra(m)]
    if extra and single_pass_fisher is None:
        raise ValueError(
            f"layers {sorted({type(m).__name__ for m in extra})} get their curvature blocks "
            "from the CurvlinopsGGN (stochastic=False) or CurvlinopsEF backend without "
            f"asdl_fisher_kwargs; got {type(backend).__name__}. Use one of them, or "
            "freeze these layers."
        )
    if len(output_shape) > 1 and any(isinstance(m, NORM_LAYERS) for m in extra):
        raise ValueError(
            f"outputs of shape (batch, {', '.join(map(str, output_shape))}) (every "
            "token an output): the dense normalisation blocks of debiased_kron/debiased_ekfac "
            "need one output row per sample. Use hessian_structure='debiased_full' or "
            "'debiased_lowrank', or freeze the normalisation layers."
        )
    for name, module in layers.named_modules():
        owns = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if isinstance(backend, BackPackInterface) and isinstance(module, nn.Conv2d) and owns:
            raise ValueError(
                f"BackPACK's Conv2d K-FAC (layer '{name}') is mis-scaled by the number of "
                "spatial positions in this laplace-torch version; use the default "
                "CurvlinopsGGN or AsdlGGN backend."
            )
    if not isinstance(backend, (GGNInterface, EFInterface)):
        raise ValueError(
            f"backend {type(backend).__name__} is not a GGN/Fisher/EF backend; the "
            "debiased K-FAC needs positive semi-definite curvature."
        )


def check_blocks(kfacs: list[list[torch.Tensor]], modules: list[nn.Module], backend: CurvatureInterface) -> None:
    """Every trainable parameter tensor must have its own block (none dropped).

    Args:
        kfacs: The K-FAC blocks of one batch set.
        modules: The layers of the blocks, in block order
            ([`curvature_modules`][laplace_debiased.curvature.layer_blocks.curvature_modules]).
        backend: laplace-torch's curvature backend (for the message).

    Raises:
        ValueError: The blocks' shapes are not those the trainable parameters need.
    """
    shapes = [[tuple(F.shape) for F in block] for block in kfacs]
    wanted = [list(block) for block in expected_block_shapes(modules)]
    if shapes != wanted:
        raise ValueError(
            f"the backend returned K-FAC blocks {shapes} but the trainable parameters "
            f"need {wanted}; some layer is unsupported by {type(backend).__name__}."
        )


def single_pass_fisher(backend: CurvatureInterface, asdl_fisher_kwargs: dict) -> str | None:
    """The curvature type of ``backend`` if the shared K-FAC pass
    ([`single_pass_kfacs`][laplace_debiased.kron.passes.single_pass_kfacs]) reproduces it exactly.

    Args:
        backend: laplace-torch's curvature backend.
        asdl_fisher_kwargs: laplace-torch's ``asdl_fisher_kwargs``.

    Returns:
        ``"type2"`` (Curvlinops exact GGN) or ``"empirical"`` (Curvlinops EF) with K-FAC
        "expand"; ``None`` for any other backend or option.
    """
    if set(asdl_fisher_kwargs) - {"kfac_approx"} or asdl_fisher_kwargs.get("kfac_approx", "expand") != "expand":
        return None
    if isinstance(backend, CurvlinopsGGN) and not backend.stochastic:
        return "type2"
    if isinstance(backend, CurvlinopsEF):
        return "empirical"
    return None

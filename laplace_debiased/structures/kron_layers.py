"""Which layers and K-FAC blocks a debiased K-FAC covers (:class:`KronLayersMixin`, a base of
:class:`~laplace_debiased.structures.kron.DebiasedKronLaplace`): the supported layers (K-FAC,
embedding and dense normalisation blocks, :mod:`laplace_debiased.curvature.layer_blocks`), the
blocks of frozen parameters dropped, and refusals for what a backend would get wrong.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from laplace.curvature.backpack import BackPackInterface
from laplace.curvature.curvature import EFInterface, GGNInterface
from torch import nn

from laplace_debiased.data.batch import Batch
from laplace_debiased.curvature.dense_blocks import NORM_LAYERS
from laplace_debiased.curvature.layer_blocks import curvature_modules, expected_block_shapes, is_extra, named_curvature_modules

_KFAC_LAYERS = (nn.Linear, nn.Conv2d)


class KronLayersMixin:
    """The layers and K-FAC blocks of the model that :class:`DebiasedKronLaplace` fits."""

    def _block_names(self) -> list[tuple[str, str]]:
        """``(layer name, "weight"/"bias")`` per ``Kron`` block, in block order (a
        normalisation layer's one dense block: ``"weight+bias"``)."""
        names = []
        for name, m in named_curvature_modules(self._layers()):
            owned = [k for k, p in m.named_parameters(recurse=False) if p.requires_grad]
            parts = ["+".join(owned)] if isinstance(m, NORM_LAYERS) else owned
            names.extend((name or type(m).__name__, part) for part in parts)
        if len(names) != len(self.H_facs.kfacs):
            return [(f"block {i}", "") for i in range(len(self.H_facs.kfacs))]
        return names

    def _kfac_modules(self) -> list[nn.Module]:
        """The layers with trainable parameters, in ``Kron`` block order (K-FAC layers,
        embeddings, normalisation layers: :func:`~laplace_debiased.curvature.layer_blocks.curvature_modules`)."""
        return curvature_modules(self._layers())

    def _trainable_blocks(self, kfacs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Drop the blocks of frozen parameters (``requires_grad=False``).

        laplace-torch's Curvlinops and ASDL backends return, for every K-FAC layer with a
        trainable parameter, a weight block and a bias block whenever the layer has a bias,
        frozen or not (stock ``KronLaplace`` then misaligns its blocks). Blocks in any other
        layout are returned unchanged for :meth:`_check_blocks` to verify.
        """
        owners = [
            p
            for module in self._layers().modules()
            if isinstance(module, _KFAC_LAYERS)
            and any(p.requires_grad for p in module.parameters(recurse=False))
            for p in (module.weight, module.bias)
            if p is not None
        ]
        if len(owners) != len(kfacs):
            return kfacs
        return [block for block, p in zip(kfacs, owners) if p.requires_grad]

    def _layers(self) -> nn.Module:
        return self.backend._model

    def _check_supported(self, batches: list[Batch]) -> None:
        if isinstance(self.backend, BackPackInterface) and isinstance(batches[0], MutableMapping):
            raise ValueError(
                "BackPACK backends cannot take dict (mapping) inputs: BackPACK extends the "
                "modules of a model that is called with one tensor. Use the default "
                "CurvlinopsGGN backend (or AsdlGGN) for dict batches."
            )
        self._check_extra_layers(curvature_modules(self._layers()))
        for name, module in self._layers().named_modules():
            owns = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if (
                isinstance(self.backend, BackPackInterface)
                and isinstance(module, nn.Conv2d)
                and owns
            ):
                raise ValueError(
                    f"BackPACK's Conv2d K-FAC (layer '{name}') is mis-scaled by the number of "
                    "spatial positions in this laplace-torch version; use the default "
                    "CurvlinopsGGN or AsdlGGN backend."
                )
        if not isinstance(self.backend, (GGNInterface, EFInterface)):
            raise ValueError(
                f"backend {type(self.backend).__name__} is not a GGN/Fisher/EF backend; the "
                "debiased K-FAC needs positive semi-definite curvature."
            )

    def _check_extra_layers(self, modules: list[nn.Module]) -> None:
        """Embedding, normalisation, attention and ``Conv1D`` blocks come from the shared K-FAC
        pass only, and a normalisation block is exact only for one output row per sample."""
        extra = [m for m in modules if is_extra(m)]
        if not extra:
            return
        if self._single_pass_fisher() is None:
            raise ValueError(
                f"layers {sorted({type(m).__name__ for m in extra})} get their curvature blocks "
                "from the CurvlinopsGGN (stochastic=False) or CurvlinopsEF backend without "
                f"asdl_fisher_kwargs; got {type(self.backend).__name__}. Use one of them, or "
                "freeze these layers."
            )
        if len(self.fit_output_shape) > 1 and any(isinstance(m, NORM_LAYERS) for m in extra):
            raise ValueError(
                f"outputs of shape (batch, {', '.join(map(str, self.fit_output_shape))}) (every "
                "token an output): the dense normalisation blocks of debiased_kron/debiased_ekfac "
                "need one output row per sample. Use hessian_structure='debiased_full' or "
                "'debiased_lowrank', or freeze the normalisation layers."
            )

    def _check_blocks(self, kfacs: list[list[torch.Tensor]]) -> None:
        """Every trainable parameter tensor must have its own block (none dropped)."""
        shapes = [[tuple(F.shape) for F in block] for block in kfacs]
        wanted = [list(block) for block in expected_block_shapes(self._kfac_modules())]
        if shapes != wanted:
            raise ValueError(
                f"the backend returned K-FAC blocks {shapes} but the trainable parameters "
                f"need {wanted}; some layer is unsupported by {type(self.backend).__name__}."
            )

"""Posterior decompositions and grid structures whose blocks may span several parameter tensors.

A normalisation layer's dense curvature block covers its weight and bias together
([`laplace_debiased.curvature.layer_blocks`][laplace_debiased.curvature.layer_blocks]), so blocks and
parameter tensors do not always correspond one to one: the decomposed curvatures here carry ``spans``
(parameter tensors per block), map per-tensor prior precisions to their blocks, and give the grid predictive a
structure that concatenates the Jacobians of the tensors of a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from laplace_debiased.curvature.layer_blocks import block_deltas
from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.kron.posterior import ImplicitKronStructure
from laplace_debiased.posterior.kron_structure import KronStructure

__all__ = ["Spanned", "SpannedImplicitKronStructure", "SpannedKronStructure", "SpannedStructure"]


class Spanned:
    """Mixin for a decomposed curvature whose blocks may span several parameter tensors
    (``spans``); ``_structure`` is its grid-predictive structure class."""

    spans: list[int]
    _structure: type

    def _with(self, other: Any) -> Any:
        other.__class__ = type(self)
        other.spans = self.spans
        return other

    def __add__(self, deltas: Tensor) -> Any:
        return self._with(super().__add__(block_deltas(deltas, self.spans)))

    def __mul__(self, scalar: Tensor | float) -> Any:
        return self._with(super().__mul__(scalar))

    __radd__ = __add__
    __rmul__ = __mul__

    def grid_structure(self, h_factor: float | Tensor, numels: Sequence[int]) -> Any:
        """The grid predictive's structure
        ([`SpannedStructure`][laplace_debiased.kron.spanned.SpannedStructure]): ``_implicit_structure``
        when a factor keeps its null space implicit (``(d, r)`` eigenvectors, ``r < d``)."""
        implicit = any(Q.shape[0] != Q.shape[1] for Qs in self.eigenvectors for Q in Qs)
        structure = getattr(self, "_implicit_structure", None) if implicit else self._structure
        if structure is None:
            raise NotImplementedError(
                f"{type(self).__name__} has implicit (d, r) eigenvectors but no grid structure for "
                "them; use laplace-torch's predictive (la(x))."
            )
        return structure(self, h_factor, numels, self.spans)


class SpannedStructure:
    """Grid structure over blocks spanning several parameter tensors: the per-tensor
    Jacobians of a block are concatenated (parameter order) before the rotation."""

    def __init__(self, H: Any, h_factor: float | Tensor, numels: Sequence[int], spans: Sequence[int]) -> None:
        if sum(spans) != len(numels):
            raise ValueError(
                f"the curvature's blocks span {sum(spans)} parameter tensors but the Laplace "
                f"object has {len(numels)}; the posterior and the model do not match"
            )
        self.spans = list(spans)
        super().__init__(H, h_factor, [sum(g) for g in self._groups(numels)])

    def _groups(self, items: Sequence[Any]) -> list[list[Any]]:
        out, start = [], 0
        for span in self.spans:
            out.append(list(items[start : start + span]))
            start += span
        return out

    def rotate(self, jacs: Sequence[LayerJacobian]) -> Any:
        merged = [
            g[0] if len(g) == 1 else LayerJacobian(dense=torch.cat([j.full() for j in g], dim=-1))
            for g in self._groups(jacs)
        ]
        return super().rotate(merged)

    def _deltas(self, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        per_block = [
            block_deltas(torch.as_tensor(d, dtype=torch.float64).reshape(-1), self.spans)
            for d in prior_precisions
        ]
        return super()._deltas(per_block)


class SpannedKronStructure(SpannedStructure, KronStructure):
    """[`KronStructure`][laplace_debiased.posterior.kron_structure.KronStructure] over spanning blocks."""


class SpannedImplicitKronStructure(SpannedStructure, ImplicitKronStructure):
    """[`ImplicitKronStructure`][laplace_debiased.kron.posterior.ImplicitKronStructure] over spanning
    blocks: dense normalisation blocks beside K-FAC input factors whose null space is implicit."""

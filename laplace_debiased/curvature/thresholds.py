"""Eigenpairs of a curvature ([`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs]) and which of
them to keep: eigenvalues above a floor relative to the largest, and re-measured directions with positive
curvature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class EigenPairs:
    """Eigenpairs of a symmetric curvature, eigenvalues in descending order.

    The tensors are float64 from this module (``diagnostics.directions.top_eigenpairs`` casts
    them to the model's dtype).

    Attributes:
        values: The eigenvalues, ``(k,)``.
        vectors: The eigenvectors, ``(P, k)`` with orthonormal columns.
        method: The route that computed them (``"gram"``, ``"lanczos"`` or ``"dense"``).
    """

    values: Tensor
    vectors: Tensor
    method: str


def above_relative_floor(values: Tensor, rtol: float) -> Tensor:
    """Boolean mask of ``values > rtol · max(values)`` and ``> 0`` (all False if none is positive):
    the eigenvalues to keep, and the directions to keep after re-measuring their curvatures.

    A direction with curvature ``λ̃`` adds ``λ̃ u uᵀ`` to the precision, so removing one is exact
    for ``λ̃ = 0``, changes the precision by at most ``rtol · max λ̃`` otherwise, and keeps the
    Woodbury inverse ``diag(1/λ̃)`` finite. Negative values can only come from round-off (a
    GGN/EF is PSD) and are removed as well.
    """
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    return values > max(float(values.max()) * rtol, 0.0)


def threshold_eigenpairs(pairs: EigenPairs, rtol: float) -> EigenPairs:
    """Keep eigenpairs with eigenvalue ``> rtol · max(eigenvalues)`` and ``> 0``."""
    keep = above_relative_floor(pairs.values, rtol)
    return EigenPairs(pairs.values[keep], pairs.vectors[:, keep], pairs.method)


"""``la.H`` of the dense eigen-structured classes, built on first read.

laplace-torch's ``FullLaplace`` keeps the dense ``P × P`` curvature ``H``. ``debiased_full``
knows it after the fit as float64 eigenpairs ``H = Q diag(h) Qᵀ``, from which the marginal
likelihood and the scalar-prior predictive are computed; forming the dense matrix costs
``O(P² r)``. ``DebiasedFullLaplace`` stores a
[`PendingCurvature`][laplace_debiased.eigen.lazy.PendingCurvature] in their place and forms
``H`` ([`formed_curvature`][laplace_debiased.eigen.lazy.formed_curvature]) when something reads
``la.H`` (a layer-wise or diagonal prior's posterior scale, ``posterior_precision``, ``state_dict``, a user),
so every laplace-torch path that reads it still works and sees the same value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from laplace_debiased.eigen.decompose import symmetric_outer

__all__ = ["PendingCurvature", "formed_curvature"]


@dataclass(frozen=True)
class PendingCurvature:
    """A curvature ``H = Q diag(h) Qᵀ`` not formed yet.

    Attributes:
        vectors: ``Q``, ``(P, r)`` float64.
        values: ``h``, ``(r,)`` float64.
    """

    vectors: Tensor
    values: Tensor


def formed_curvature(
    stored: Tensor | PendingCurvature | None, device: torch.device, dtype: torch.dtype
) -> Tensor | None:
    """The dense curvature of what ``la.H`` stores.

    Args:
        stored: A dense ``(P, P)`` tensor, a
            [`PendingCurvature`][laplace_debiased.eigen.lazy.PendingCurvature], or ``None``
            (not fitted).
        device: The model's device.
        dtype: The model's dtype.

    Returns:
        ``stored`` itself unless it is pending; a pending curvature formed now
        ([`symmetric_outer`][laplace_debiased.eigen.decompose.symmetric_outer], exactly symmetric), on
        ``device`` in ``dtype``.
    """
    if isinstance(stored, PendingCurvature):
        return symmetric_outer(stored.vectors, stored.values).to(device, dtype)
    return stored

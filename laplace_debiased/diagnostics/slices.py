"""2D slices of quadratic models in the plane of two directions (paper Fig. 1)."""

from __future__ import annotations

import torch
from torch import Tensor

from laplace_debiased.diagnostics.measure import Restriction


def plane_quadratic(restriction: Restriction, a: Tensor, b: Tensor, dims: tuple[int, int] = (0, 1)) -> Tensor:
    """q(θ• + a d_i + b d_j; S) on a grid, from S's restriction to span D.

    ``a`` and ``b`` are coordinate grids of equal shape (e.g. from ``torch.meshgrid``); the value
    is ``q₀ + s_i a + s_j b + ½ (G_ii a² + 2 G_ij a b + G_jj b²)`` with the restriction's value
    q₀, slopes s and Gram matrix G (no further products).
    """
    i, j = dims
    s, G = restriction.slopes, restriction.gram
    return (restriction.value + s[i] * a + s[j] * b
            + 0.5 * (G[i, i] * a**2 + 2 * G[i, j] * a * b + G[j, j] * b**2))


def plane_minimizer(restriction: Restriction, dims: tuple[int, int] = (0, 1)) -> Tensor:
    """Minimiser ``(a*, b*)`` of the 2D slice: ``-G₂⁻¹ s₂`` (the Newton step within the plane)."""
    idx = torch.tensor(dims)
    return -torch.linalg.solve(restriction.gram[idx][:, idx], restriction.slopes[idx])

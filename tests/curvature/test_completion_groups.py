"""The isotropic completion averages only over eigenvalues that are equal up to round-off.

A dense stretch of small, distinct eigenvalues of B's factor (neighbours closer than the
round-off tolerance, the whole stretch far wider) must not be chained into B's null space and
flattened: two of B's directions share a completed eigenvalue only if their eigenvalues differ by
at most the tolerance. Checked on the dense route and on the rows (Gram) route.
"""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.curvature.completion import isotropic_factor, nested_factor
from laplace_debiased.curvature.linalg import lowrank_debiased_factor, roundoff_tolerance, tied_groups


def _stretch(d: int = 60, null: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B's factor ``V diag(L) Vᵀ`` (float32) with ``null`` zeros, then a stretch of eigenvalues
    spaced at a quarter of its round-off tolerance, then well separated ones; and B̃'s factor
    ``V diag(c) Vᵀ`` with distinct random ``c``, so that its Rayleigh quotients are exactly ``c``."""
    g = torch.Generator().manual_seed(seed)
    V = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    top = torch.linspace(50.0, 100.0, 10, dtype=torch.float64)
    tol = roundoff_tolerance(((V * torch.cat([torch.zeros(d - 10), top])) @ V.T).float())
    stretch = torch.arange(1, d - null - 10 + 1, dtype=torch.float64) * tol / 4
    L = torch.cat([torch.zeros(null, dtype=torch.float64), stretch, top])
    c = 1 + torch.rand(d, generator=g, dtype=torch.float64)
    return L, ((V * L) @ V.T).float(), ((V * c) @ V.T).float()


def _shared_values_are_ties(L: torch.Tensor, lam: torch.Tensor, U: torch.Tensor, D: torch.Tensor, tol: float) -> None:
    """Directions whose completed eigenvalues coincide have B-eigenvalues within ``tol``."""
    rayleigh_B = ((D.double() @ U.double()) * U.double()).sum(0)
    lam = lam.double()
    same = (lam[:, None] - lam[None, :]).abs() <= 1e-6 * lam.abs().max()
    spread = (rayleigh_B[:, None] - rayleigh_B[None, :]).abs()
    assert float(spread[same].max()) <= 1.5 * tol


@pytest.mark.parametrize("rule", ["isotropic", "nested"])
def test_dense_route_does_not_chain_a_stretch_into_the_null_space(rule):
    L, D, C = _stretch()
    tol = roundoff_tolerance(D)
    assert float(L[-11] - L[0]) > 5 * tol  # the stretch is far wider than the tolerance
    U, lam = isotropic_factor(D, C) if rule == "isotropic" else nested_factor(D, C, C)
    _shared_values_are_ties(L, lam, U, D, tol)


def test_rows_route_does_not_chain_a_stretch_into_the_null_space():
    g = torch.Generator().manual_seed(1)
    d, n = 60, 30
    scales = torch.cat([torch.linspace(1e-4, 3e-3, n - 5), torch.linspace(1.0, 2.0, 5)]).double()
    Q = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=torch.float64)).Q
    Xd = (Q * scales.sqrt()).T.contiguous()  # B's factor Xdᵀ Xd = Q diag(scales) Qᵀ, rank n
    Xm = torch.randn(8, d, generator=g, dtype=torch.float64)
    U, lam = lowrank_debiased_factor(Xd.float(), Xm.float(), torch.float32, null_space="isotropic")
    D = (Xd.T @ Xd).float()
    tol = roundoff_tolerance(D)
    assert float(scales[n - 6] - scales[0]) > 5 * tol
    # only B's eigenvalues within the tolerance of 0 join the implicit null space
    assert U.shape[1] == int((scales > tol).sum())
    _shared_values_are_ties(scales, lam[: U.shape[1]], U, D, tol)


def test_tied_groups_have_bounded_spread_and_cover_everything():
    values = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.35, 2.0, 2.05, 5.0])
    groups = tied_groups(values, 0.15)
    assert [(g.start, g.stop) for g in groups] == [(0, 2), (2, 5), (5, 7), (7, 8)]
    assert all(float(values[g.stop - 1] - values[g.start]) <= 0.15 for g in groups)

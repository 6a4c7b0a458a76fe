"""The second-order gaps of ``benchmarks/second_order_gaps.py`` against the exact two-batch gaps:
they agree to third order in the halves' difference on a factor with a separated spectrum."""

from __future__ import annotations

import pytest
import torch

from benchmarks.second_order_gaps import second_order_gaps
from laplace_debiased.kron.corrected import same_minus_cross


def _pair(eps: float, m_direction: int, m_magnitude: int, d: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """``D = P + a ε K``, ``M = P - b ε K`` (``a = m_B̃ / n``, ``b = m_B / n``, so that the pooled factor is
    ``P``) with ``P``'s eigenvalues ``1, ..., d`` (spacing 1) in a random basis and ``‖K‖_F = 1``."""
    g = torch.Generator().manual_seed(0)
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    P = Q @ torch.diag(torch.arange(1.0, d + 1, dtype=torch.float64)) @ Q.T
    K = torch.randn(d, d, generator=g, dtype=torch.float64)
    K = (K + K.T) / torch.linalg.matrix_norm(K + K.T)
    n = m_direction + m_magnitude
    return P + m_magnitude / n * eps * K, P - m_direction / n * eps * K


@pytest.mark.parametrize("sizes", [(5, 5), (3, 7)])
def test_second_order_gaps_agree_with_the_exact_ones_to_third_order(sizes):
    """Each order's gap is of first order in ε and its expansion errs at third order, so its relative
    error falls a hundredfold from ε = 1e-2 to 1e-3; in their sum ``x`` the first-order parts cancel
    and the relative error falls tenfold. Below ε ≈ 1e-4 float64 round-off of the exact gaps sets
    the floor."""
    errors = []
    for eps in (1e-2, 1e-3):
        D, M = _pair(eps, *sizes)
        approx_b, approx_t, null = second_order_gaps(D, M, *sizes)
        exact_b, exact_t = same_minus_cross(D, M), same_minus_cross(M, D)
        assert null == 0
        errors.append([float((a - e).norm() / e.norm())
                       for a, e in ((approx_b, exact_b), (approx_t, exact_t), (approx_b + approx_t, exact_b + exact_t))])
    order_b, order_t, x = (later / earlier for earlier, later in zip(*errors))
    assert 0.005 < order_b < 0.02 and 0.005 < order_t < 0.02
    assert 0.05 < x < 0.2

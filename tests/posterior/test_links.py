"""Link approximations (:mod:`laplace_debiased.posterior.links`): the projected probit ignores the
all-ones direction where laplace-torch's probit does not, Monte Carlo is statistically invariant to it."""

from __future__ import annotations

import torch

from laplace_debiased.posterior.links import mc_softmax, probit, probit_projected

def test_projected_probit_ignores_all_ones_direction():
    torch.manual_seed(1)
    n, C = 6, 5
    f = torch.randn(n, C, dtype=torch.float64)
    A = torch.randn(n, C, C, dtype=torch.float64)
    cov = A @ A.transpose(1, 2)
    ones = torch.ones(C, C, dtype=torch.float64)
    base = probit_projected(f, cov)
    for c, a in [(1.0, 0.0), (1e4, 3.0), (1e8, -2.0)]:
        torch.testing.assert_close(probit_projected(f + a, cov + c * ones), base)
    # laplace-torch's diagonal probit is fooled: a huge all-ones variance makes it near-uniform
    fooled = probit(f, cov + 1e8 * ones)
    assert (fooled - 1.0 / C).abs().max() < 1e-3
    assert (base - 1.0 / C).abs().max() > 0.05


def test_mc_statistically_invariant_to_all_ones_and_matches_probit_roughly():
    torch.manual_seed(2)
    n, C, S = 4, 3, 20000
    f = torch.randn(n, C, dtype=torch.float64) * 2
    A = torch.randn(n, C, C, dtype=torch.float64) * 0.5
    cov = A @ A.transpose(1, 2)
    p1 = mc_softmax(f, cov, S, torch.Generator().manual_seed(0))
    p2 = mc_softmax(f, cov + 1e3 * torch.ones(C, C, dtype=torch.float64), S, torch.Generator().manual_seed(1))
    # standard error of a mean of [0, 1] values is at most 0.5/sqrt(S) = 0.0035
    assert (p1 - p2).abs().max() < 0.015
    # zero covariance: exactly the softmax
    torch.testing.assert_close(mc_softmax(f, 0 * cov, 3), torch.softmax(f, -1))

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


def test_mc_samples_with_the_symmetric_square_root_of_the_covariance():
    """With ``Σ = S²`` for a known symmetric positive definite ``S``, the MC predictive is
    ``1/n Σ_s softmax(f + S ε_s)`` with the ``ε`` the generator gives: the symmetric root, which
    no choice of eigenvector signs or basis changes (``V Λ^{1/2} ε`` is another sample)."""
    g = torch.Generator().manual_seed(0)
    n, C, samples = 3, 4, 50
    Q = torch.linalg.qr(torch.randn(n, C, C, generator=g, dtype=torch.float64))[0]
    S = Q @ torch.diag_embed(torch.rand(n, C, generator=g, dtype=torch.float64) + 0.5) @ Q.transpose(1, 2)
    f = torch.randn(n, C, generator=g, dtype=torch.float64)
    got = mc_softmax(f, S @ S, samples, torch.Generator().manual_seed(1))
    eps = torch.randn(samples, n, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = torch.softmax(f + torch.einsum("nij,snj->sni", S, eps), dim=-1).mean(0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

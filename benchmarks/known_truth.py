"""What the known-truth studies of the two-batch estimates share (``estimator_candidates.py``,
``structure_estimates.py``): the test spectra, the scores of an estimate against its truth."""

from __future__ import annotations

from collections.abc import Callable

import torch


def spectra(d: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The five test spectra of dimension ``d`` (float64, a third of ``d`` per cluster / rank ``d/3``)."""
    third = d // 3

    def clusters() -> torch.Tensor:
        g = torch.Generator().manual_seed(123)
        levels = torch.tensor([1.0, 0.1, 0.01], dtype=torch.float64).repeat_interleave(third)
        return levels * (1 + 0.01 * torch.rand(d, generator=g, dtype=torch.float64))

    return {
        "spiked (50, 20, 10, rest 0.1)": lambda: torch.cat([torch.tensor([50.0, 20, 10]), torch.full((d - 3,), 0.1)]).double(),
        "power 1/i^1.5": lambda: 1.0 / torch.arange(1, d + 1, dtype=torch.float64) ** 1.5,
        f"clustered bulk (3 × {third} at 1, 0.1, 0.01, ±1 %)": clusters,
        f"rank {third} of {d} (1/i)": lambda: torch.cat([1.0 / torch.arange(1, third + 1, dtype=torch.float64),
                                                        torch.zeros(d - third, dtype=torch.float64)]),
        "flat": lambda: torch.ones(d, dtype=torch.float64),
    }


def scores(F_hat: torch.Tensor, F: torch.Tensor, tests: torch.Tensor, n: int, deltas: tuple[float, ...]) -> dict[str, float]:
    """Scores of the estimate ``F_hat`` ``(d, d)`` of ``F`` with ``n`` data: ``kl_fwd``, ``kl_rev``
    and ``kl`` (their sum), KL(q̂‖p) and KL(p‖q̂) of the Gaussians with precisions ``n F̂ + δI`` and
    ``n F + δI``, and ``var``, the mean over the rows ``v`` of ``tests`` ``(k, d)`` of
    ``|log vᵀ(n F̂ + δI)⁻¹v - log vᵀ(n F + δI)⁻¹v|``; each the largest over ``deltas``."""
    d = F.shape[0]
    I = torch.eye(d, dtype=torch.float64)
    fwd, rev, both, var = [], [], [], []
    for delta in deltas:
        P1, P0 = n * F_hat + delta * I, n * F + delta * I
        C1, C0 = torch.linalg.inv(P1), torch.linalg.inv(P0)
        ld = torch.logdet(P1) - torch.logdet(P0)
        f = 0.5 * float(torch.trace(P0 @ C1) - d + ld)
        r = 0.5 * float(torch.trace(P1 @ C0) - d - ld)
        fwd.append(f), rev.append(r), both.append(f + r)
        s1, s0 = ((tests @ C1) * tests).sum(1), ((tests @ C0) * tests).sum(1)
        var.append(float((s1.log() - s0.log()).abs().mean()))
    return {"kl": max(both), "kl_fwd": max(fwd), "kl_rev": max(rev), "var": max(var)}


"""Candidate two-batch estimates of one curvature factor on synthetic Gaussian data, at equal samples.

    OMP_NUM_THREADS=1 python benchmarks/estimator_candidates.py

Writes ``results/estimator_candidates.{json,md}``. A factor ``F`` (d = 60) with a given spectrum in a
random basis; B and B̃ of m Gaussian samples each. Candidates, all from the same 2m samples:

* ``single``: the eigendecomposition of the pooled factor of B ∪ B̃ (a single batch of 2m);
* ``paper``: B's eigenvectors, B̃'s Rayleigh quotients (Tatzel et al.);
* ``corrected``: :func:`laplace_debiased.kron.corrected.corrected_factor` (pooled eigenvectors,
  eigenvalues less the bias the two orders measure);
* ``shrunk``: ``corrected_factor(..., shrink=True)``, the package's default: the corrected shift on
  the pooled range scaled by the positive-part James–Stein weight ``max(0, 1 - Σ e_i² / Σ x_i²)``
  (``x`` the shift, ``e`` the two orders' difference), the pooled null space corrected in full;
* ``relative``: the shrunk estimate with its weight taken over relative errors,
  ``max(0, 1 - Σ (e_i/λ_i)² / Σ (x_i/λ_i)²)`` on the pooled range (``λ`` the pooled eigenvalues): the
  second-order KL of the Gaussians as δ → 0 weights each eigenvalue's error by ``1/λ_i²``, where the
  default's Frobenius weight lets the largest eigenvalues' noise decide (a candidate, not adopted:
  patched into the default, it was not closer to the full batch on the digits main job);
* ``midpoint``: half the corrected shift (targets the true eigenvalues, not the curvature along
  the pooled eigenvectors);
* ``downward``: only the downward part of the shift (never raises a curvature).

Score: the largest over δ ∈ {1e-2, 1, 1e2, 1e4} of the KL divergence between the Gaussian with
precision N·F̂ + δI and the one with N·F + δI (N = 10,000), in both directions; mean over 10 draws.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from laplace_debiased.kron.corrected import corrected_factor, same_minus_cross, shrinkage_weight
from laplace_debiased.curvature.linalg import frobenius_tolerance, remeasure_eigenvalues, symmetric_eigh64

HERE = Path(__file__).resolve().parent
D, N, DRAWS, DELTAS = 60, 10_000, 10, (1e-2, 1.0, 1e2, 1e4)
SPECTRA = {
    "power 1/i^1.5": lambda: 1.0 / torch.arange(1, D + 1, dtype=torch.float64) ** 1.5,
    "flat": lambda: torch.ones(D, dtype=torch.float64),
    "spiked (50, 20, 10, rest 0.1)": lambda: torch.cat([torch.tensor([50.0, 20, 10]), torch.full((D - 3,), 0.1)]).double(),
    "exponential exp(-i/5)": lambda: torch.exp(-torch.arange(D, dtype=torch.float64) / 5),
    "rank 20 of 60": lambda: torch.cat([1.0 / torch.arange(1, 21, dtype=torch.float64), torch.zeros(D - 20, dtype=torch.float64)]),
}


def candidates(XB: torch.Tensor, XM: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each candidate's factor estimate ``(D, D)`` from the rows of B and B̃ (m each)."""
    m = len(XB)
    Db, Dm = XB.T @ XB / m, XM.T @ XM / m
    pooled = (Db + Dm) / 2
    L, U = symmetric_eigh64(pooled)
    cb = same_minus_cross(Db, Dm) / 2  # each order's estimate of the shift, m/n = 1/2
    ct = same_minus_cross(Dm, Db) / 2
    c = (cb + ct) / 2
    Ub = symmetric_eigh64(Db)[1]
    paper = remeasure_eigenvalues(Ub, Dm)
    Uc, lc, _ = corrected_factor(Db, Dm, m, m)
    Us, ls, _ = corrected_factor(Db, Dm, m, m, shrink=True)
    rng = L > frobenius_tolerance(D, torch.float64, float(torch.linalg.matrix_norm(pooled)))
    relative = torch.ones_like(L)  # the pooled null space keeps the whole correction
    relative[rng] = shrinkage_weight(cb[rng] / L[rng], ct[rng] / L[rng])

    def mat(V: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        return V @ torch.diag(lam.clamp(min=0)) @ V.T

    return {"single": mat(U, L), "paper": mat(Ub, paper), "corrected": mat(Uc, lc),
            "shrunk": mat(Us, ls), "relative": mat(U, L - relative * c), "midpoint": mat(U, L - c / 2),
            "downward": mat(U, L - c.clamp(min=0))}


def kls(F_hat: torch.Tensor, F: torch.Tensor) -> tuple[float, float]:
    """Max over δ of KL(q̂‖p) and KL(p‖q̂), precisions N F̂ + δI (q̂) and N F + δI (p)."""
    I = torch.eye(D, dtype=torch.float64)
    fwd, rev = [], []
    for delta in DELTAS:
        P1, P0 = N * F_hat + delta * I, N * F + delta * I
        ld = torch.logdet(P1) - torch.logdet(P0)
        fwd.append(0.5 * float(torch.trace(P0 @ torch.linalg.inv(P1)) - D + ld))
        rev.append(0.5 * float(torch.trace(P1 @ torch.linalg.inv(P0)) - D - ld))
    return max(fwd), max(rev)


def main() -> int:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    results = {}
    for name, spectrum in SPECTRA.items():
        s = spectrum()
        F, root = Q @ torch.diag(s) @ Q.T, Q @ torch.diag(s.sqrt())
        for m in (8, 32, 128, 512):
            sums: dict[str, list[float]] = {}
            for _ in range(DRAWS):
                XB = torch.randn(m, D, generator=g, dtype=torch.float64) @ root.T
                XM = torch.randn(m, D, generator=g, dtype=torch.float64) @ root.T
                for k, F_hat in candidates(XB, XM).items():
                    f, r = kls(F_hat, F)
                    sums.setdefault(k, [0.0, 0.0])
                    sums[k][0] += f / DRAWS
                    sums[k][1] += r / DRAWS
            results[f"{name} | {m}"] = sums
    (HERE / "results" / "estimator_candidates.json").write_text(json.dumps(results, indent=1) + "\n")
    names = list(next(iter(results.values())))
    lines = ["# Candidate two-batch estimates of a factor, synthetic Gaussian data", "",
             "Written by `OMP_NUM_THREADS=1 python benchmarks/estimator_candidates.py` (module docstring: the "
             "candidates and the score). Cells: max over δ of KL(q̂‖p) / KL(p‖q̂), mean over 10 draws; smaller "
             "is better. m: samples in each of B and B̃ (every candidate uses the same 2m).", "",
             "| spectrum | m | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for key, sums in results.items():
        spec, m = key.split(" | ")
        lines.append(f"| {spec} | {m} | " + " | ".join(f"{sums[k][0]:.3g} / {sums[k][1]:.3g}" for k in names) + " |")
    (HERE / "results" / "estimator_candidates.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

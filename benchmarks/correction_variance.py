"""Is the ``"stein"`` weight's variance of the correction calibrated? Known truth, three sampling laws.

    OMP_NUM_THREADS=1 python benchmarks/correction_variance.py [--draws 400] [--seed 0]

Writes ``results/correction_variance.{json,md}``. The ``"stein"`` weight of ``debiased_kron``
(``laplace_debiased.kron.corrected``) is ``max(0, 1 - Σ a_i V̂_i / Σ a_i x_i²)``: it is a
minimum-MSE weight only as far as ``Σ a_i V̂_i`` estimates ``Σ a_i Var x_i`` (``x`` the correction
of the pooled eigenvalues, ``a_i = 1/λ_i²``). ``V̂`` is a Gaussian plug-in from the two batches'
difference ``Δ`` (``correction_variance``). Two resampling estimates need no such law:

* ``jackknife``: delete-a-group jackknife over ``g = 8`` groups, group ``k`` removed from B and from
  B̃ together, ``V_J = (g - 1)/g Σ_k (x_(k) - x̄)²`` per eigenvalue position (``g`` more corrections);
* ``split-half``: the correction of each half of B with a half of B̃, ``(x¹ - x²)² / 2`` scaled by
  1/4 to the full sizes (the second-order noise of ``x`` falls like ``1/m²``; the first-order part of
  unequal splits like ``1/m``, so the scaling under-states that part by 2).

Per cell (spectrum, split, law) and ``--draws`` independent draws of B and B̃ (rows drawn from the
law with covariance ``F``, d = 60, ``m > d`` only: on the range the positions are those of the
full spectrum): the Monte Carlo variance ``Var x_i`` over the draws at each sorted position, and each
estimate's mean over the draws. Reported: ``Σ a_i E[estimate_i] / Σ a_i Var x_i`` with ``a_i =
1/λ_i²`` of the truth (1 = calibrated; below 1 the weight keeps too much of the correction, above 1
too little), with the standard error of the numerator's mean over draws. Laws: Gaussian; Student's t
with 5 degrees of freedom (scaled to covariance ``F``); and a Gaussian scale mixture whose squared
scale is exponential (``x = s z``, ``s² ~ Exp(1)``: kurtosis 6 per coordinate, like a K-FAC row whose
size varies from sample to sample).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from laplace_debiased.curvature.linalg import frobenius_tolerance, order_weights, symmetric_eigh64
from laplace_debiased.kron.corrected import correction_variance, same_minus_cross

HERE = Path(__file__).resolve().parent
D, GROUPS = 60, 8
SPLITS = ((64, 64), (32, 96), (256, 256), (128, 384))
SPECTRA = {
    "spiked (50, 20, 10, rest 0.1)": lambda: torch.cat([torch.tensor([50.0, 20, 10]), torch.full((D - 3,), 0.1)]).double(),
    "power 1/i^1.5": lambda: 1.0 / torch.arange(1, D + 1, dtype=torch.float64) ** 1.5,
    "two levels (30 at 1, 30 at 0.1)": lambda: torch.tensor([1.0] * 30 + [0.1] * 30, dtype=torch.float64),
}
LAWS = ("gaussian", "student-t 5", "scale mixture")
ESTIMATES = ("plug-in", "jackknife", "split-half")


def rows(law: str, m: int, root: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``(m, D)`` rows with covariance ``root @ root.T``."""
    z = torch.randn(m, D, generator=g, dtype=torch.float64)
    if law == "student-t 5":  # z / sqrt(chi2_5 / 5) has covariance 5/3 I
        chi2 = torch.randn(m, 5, generator=g, dtype=torch.float64).square().sum(1, keepdim=True)
        z = z / (chi2 / 5).sqrt() * math.sqrt(3 / 5)
    elif law == "scale mixture":  # s² ~ Exp(1): E s² = 1
        z = z * (-torch.rand(m, 1, generator=g, dtype=torch.float64).log()).sqrt()
    return z @ root.T


def correction(XB: torch.Tensor, XM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, V̂)`` ``(D,)`` each: the size-weighted correction of the pooled eigenvalues (ascending)
    and its plug-in variance."""
    mb, mm = len(XB), len(XM)
    Db, Dm = XB.T @ XB / mb, XM.T @ XM / mm
    pooled = (mb * Db + mm * Dm) / (mb + mm)
    L, U = symmetric_eigh64(pooled)
    kb, km = order_weights(mb, mm, None)
    x = kb * same_minus_cross(Db, Dm) + km * same_minus_cross(Dm, Db)
    tol = frobenius_tolerance(D, torch.float64, float(torch.linalg.matrix_norm(pooled)))
    return x, correction_variance(U.T @ (Db - Dm) @ U, L, mb, mm, None, tol)


def estimates(XB: torch.Tensor, XM: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, plug_in = correction(XB, XM)
    gb, gm = torch.arange(len(XB)) % GROUPS, torch.arange(len(XM)) % GROUPS
    leave_out = torch.stack([correction(XB[gb != k], XM[gm != k])[0] for k in range(GROUPS)])
    jack = (GROUPS - 1) / GROUPS * (leave_out - leave_out.mean(0)).square().sum(0)
    x1 = correction(XB[::2], XM[::2])[0]
    x2 = correction(XB[1::2], XM[1::2])[0]
    return x, {"plug-in": plug_in, "jackknife": jack, "split-half": (x1 - x2).square() / 2 / 4}


def cell(spectrum: torch.Tensor, split: tuple[int, int], law: str, draws: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
    root = Q * spectrum.sqrt()
    xs, est = [], {e: [] for e in ESTIMATES}
    for _ in range(draws):
        x, e = estimates(rows(law, split[0], root, g), rows(law, split[1], root, g))
        xs.append(x)
        for name in ESTIMATES:
            est[name].append(e[name])
    X = torch.stack(xs)
    a = 1 / spectrum.sort().values.square()
    truth = float((a * X.var(0)).sum())
    out = {"true": truth}
    for name in ESTIMATES:
        per_draw = torch.stack(est[name]) @ a
        out[name] = {"ratio": float(per_draw.mean()) / truth, "se": float(per_draw.std() / math.sqrt(draws)) / truth}
    return out


def markdown(res: dict, command: str) -> str:
    lines = ["# Calibration of the correction's variance (known truth)", "",
             f"Written by `{command}` (module docstring: the estimates and the laws). d = {D}, "
             f"{res['draws']} draws per cell. Each entry: Σ a_i E[estimate_i] / Σ a_i Var x_i (a_i = 1/λ_i², "
             "1 = calibrated; below 1 the `stein` weight keeps too much of the correction) ± the standard error of "
             "the numerator's mean over draws; the Monte Carlo variance in the denominator has its own relative "
             f"error, about √(2/{res['draws'] - 1}) per position and less in the sum.", "",
             "| spectrum | split | law | " + " | ".join(ESTIMATES) + " |", "|---|---|---|" + "---|" * len(ESTIMATES)]
    for r in res["cells"]:
        vals = " | ".join(f"{r[e]['ratio']:.2f} ± {r[e]['se']:.2f}" for e in ESTIMATES)
        lines.append(f"| {r['spectrum']} | {r['split'][0]}+{r['split'][1]} | {r['law']} | {vals} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    cells = []
    for i, (name, make) in enumerate(SPECTRA.items()):
        for j, split in enumerate(SPLITS):
            for k, law in enumerate(LAWS):
                r = cell(make(), split, law, a.draws, a.seed + 1000 * i + 100 * j + k)
                cells.append({"spectrum": name, "split": list(split), "law": law, **r})
                print(name, split, law, {e: round(r[e]["ratio"], 3) for e in ESTIMATES}, flush=True)
    res = {"draws": a.draws, "seed": a.seed, "d": D, "groups": GROUPS, "cells": cells}
    command = "OMP_NUM_THREADS=1 python benchmarks/correction_variance.py" + (
        f" --draws {a.draws}" if a.draws != 400 else "") + (f" --seed {a.seed}" if a.seed else "")
    out = HERE / "results"
    (out / "correction_variance.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "correction_variance.md").write_text(markdown(res, command))


if __name__ == "__main__":
    main()

"""The two-batch estimates of a dense curvature of the GGN's shape against a known truth (synthetic
Gaussian data): do ``"corrected"``, ``"stein"`` or ``"shrunk"`` improve ``debiased_full`` and
``debiased_lowrank`` over their present estimate (B's eigenvectors, B̃'s Rayleigh quotients)?

    OMP_NUM_THREADS=1 python benchmarks/structure_estimates.py [--draws 20] [--seed 0]

Writes ``results/structure_estimates.{json,md}``. A PSD matrix ``G`` (P = 120) with a given spectrum
in a random basis; every sample contributes ``C = 4`` rows (as a GGN sample contributes one row per
output), the rows of one sample correlated (a shared component, correlation 1/2), each row
``~ N(0, G)``; a batch's estimate is the mean over its samples of ``Σ_c x_c x_cᵀ / C``. B and B̃ hold
equal (``n/2 + n/2``) or unequal (``n/4 + 3n/4``) shares of ``n`` = 16 … 256 samples, so that B's rows
``m · C`` run from below P (``m·C < P``, the GGN of a network's mini-batch: rank-deficient) to above.
Spectra: those of ``benchmarks/estimator_candidates.py`` at P = 120 (spiked, power law, clustered bulk,
rank-deficient, flat).

Candidates for ``debiased_full``, all from the same ``n`` samples:

* ``single``: the pooled matrix of B ∪ B̃ (one batch of ``n``);
* ``paper``: ``debiased_full``'s present estimate, ``U diag(λ̃) Uᵀ + Π G_B̃ Π``
  (:func:`laplace_debiased.eigen.decompose.decompose_debiased_full`: B's range eigenvectors, B̃'s
  Rayleigh quotients, B̃'s compression on B's null space);
* ``corrected``, ``shrunk``, ``stein``: :func:`laplace_debiased.kron.corrected.corrected_factor` with that
  rule, on the dense matrices (the maths of the module docstring holds for any PSD matrix estimated
  from independent samples; nothing in it is specific to a Kronecker factor).

Candidates for ``debiased_lowrank`` (rank ``k = 10``, ``k < P``; the posterior precision is
``N · Û diag(λ̂) Ûᵀ + δI``):

* ``lr-single``: the top-``k`` eigenpairs of the pooled matrix;
* ``lr-paper``: ``debiased_lowrank``'s estimate, B's top-``k`` eigenvectors with B̃'s Rayleigh
  quotients (those ``≤ 0`` dropped);
* ``lr-corrected``: the pooled top-``k`` eigenvectors, their eigenvalues less the correction the two
  orders' top-``k`` gaps measure (``λ_{B,i} - u_{B,i}ᵀ G_B̃ u_{B,i}`` and the same with B̃ choosing,
  matched by position, the order weights of ``corrected``), clamped at 0. Only top-``k`` eigenpairs of
  B, B̃ and B ∪ B̃ and the other batch's curvature along them are needed. The ``stein`` weight is not
  computable from these: its variance sums ``Δ_ij⁴ / (λ_i - λ_j)²`` over every ``j``.

Scores (each the mean over draws, ± its standard error in the JSON), ``N = 10,000``:

* ``kl``: the largest over δ ∈ {1e-2, 1, 1e2, 1e4} of KL(q̂‖p) + KL(p‖q̂), q̂ and p the Gaussians with
  precisions ``N Ĝ + δI`` and ``N G + δI``; ``kl_fwd``, ``kl_rev`` each direction alone;
* ``var``: the largest over δ of the mean over 32 fixed random test vectors ``v`` of
  ``|log(vᵀ(N Ĝ + δI)⁻¹v) - log(vᵀ(N G + δI)⁻¹v)|`` (the error of the predictive variance).

The low-rank candidates are scored against the same structure fitted on the truth, ``G_k`` (the
truth's top-``k`` eigenpairs) in place of ``G``: against ``G`` itself every rank-``k`` estimate's
scores are dominated by the spectrum beyond ``k`` that all of them leave out.

The table's head: per structure, each candidate's worst case over the cells of its mean KL over the
present estimate's (``paper``, ``lr-paper``) and over the single batch's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.known_truth import scores, spectra  # noqa: E402
from laplace_debiased.evaluation.tracking import mean_stderr  # noqa: E402

from laplace_debiased.curvature.eigen import dense_range_eigenpairs, dense_top_eigenpairs
from laplace_debiased.curvature.linalg import remeasure_eigenvalues
from laplace_debiased.eigen.decompose import decompose_debiased_full
from laplace_debiased.curvature.linalg import order_weights
from laplace_debiased.kron.corrected import corrected_factor

HERE = Path(__file__).resolve().parent
P, C, K, N = 120, 4, 10, 10_000
DELTAS, TOTALS = (1e-2, 1.0, 1e2, 1e4), (16, 32, 64, 256)
FULL = ("single", "paper", "corrected", "shrunk", "stein")
LOWRANK = ("lr-single", "lr-paper", "lr-corrected")
CANDIDATES = FULL + LOWRANK


SPECTRA = spectra(P)


def batch_matrix(samples: int, root: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The estimate ``(P, P)`` of ``G = root rootᵀ`` from ``samples`` samples of ``C`` rows each
    (module docstring)."""
    shared = torch.randn(samples, 1, P, generator=g, dtype=torch.float64)
    own = torch.randn(samples, C, P, generator=g, dtype=torch.float64)
    X = ((shared + own) / math.sqrt(2)) @ root.T
    X = X.reshape(samples * C, P)
    return X.T @ X / (samples * C)


def _dense(U: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    return (U * lam.clamp(min=0)) @ U.T


def lowrank_corrected(GB: torch.Tensor, GM: torch.Tensor, mb: int, mm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lr-corrected`` (module docstring) from top-``K`` eigenpairs only: ``(U (P, K), λ̂ (K,))``."""
    n = mb + mm
    pooled = dense_top_eigenpairs((mb * GB + mm * GM) / n, K)
    gaps = []
    for D, M in ((GB, GM), (GM, GB)):
        top = dense_top_eigenpairs(D, K)
        gaps.append(top.values - remeasure_eigenvalues(top.vectors, M))
    kb, km = order_weights(mb, mm, None)
    return pooled.vectors, (pooled.values - kb * gaps[0] - km * gaps[1]).clamp(min=0)


def candidates(GB: torch.Tensor, GM: torch.Tensor, mb: int, mm: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Each candidate's estimate ``(P, P)`` and the weights kept by ``shrunk`` and ``stein``."""
    n = mb + mm
    out = {"single": (mb * GB + mm * GM) / n}
    out["paper"] = decompose_debiased_full(dense_range_eigenpairs(GB), GM, 1.0).dense
    kept = {}
    for rule in ("corrected", "shrunk", "stein"):
        U, lam, record = corrected_factor(GB, GM, mb, mm, rule=rule)
        out[rule] = _dense(U, lam)
        kept[rule] = record.kept
    top = dense_top_eigenpairs(out["single"], K)
    out["lr-single"] = _dense(top.vectors, top.values)
    top = dense_top_eigenpairs(GB, K)
    out["lr-paper"] = _dense(top.vectors, remeasure_eigenvalues(top.vectors, GM))
    out["lr-corrected"] = _dense(*lowrank_corrected(GB, GM, mb, mm))
    return out, kept


def run(draws: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(P, P, generator=g, dtype=torch.float64))
    tests = torch.randn(32, P, generator=g, dtype=torch.float64)
    results = {}
    for name, spectrum in SPECTRA.items():
        s = spectrum()
        G, root = Q @ torch.diag(s) @ Q.T, Q @ torch.diag(s.sqrt())
        top = dense_top_eigenpairs(G, K)
        G_k = _dense(top.vectors, top.values)
        for n in TOTALS:
            for mb, mm in ((n // 2, n // 2), (n // 4, 3 * n // 4)):
                per: dict[str, dict[str, list[float]]] = {c: {} for c in CANDIDATES}
                kept: dict[str, list[float]] = {}
                for _ in range(draws):
                    GB, GM = batch_matrix(mb, root, g), batch_matrix(mm, root, g)
                    ests, w = candidates(GB, GM, mb, mm)
                    for key, value in w.items():
                        kept.setdefault(key, []).append(value)
                    for c, G_hat in ests.items():
                        for key, value in scores(G_hat, G_k if c in LOWRANK else G, tests, N, DELTAS).items():
                            per[c].setdefault(key, []).append(value)
                cell = {c: {key: mean_stderr(v) for key, v in sc.items()} for c, sc in per.items()}
                cell["kept"] = {key: mean_stderr(v)[0] for key, v in kept.items()}
                results[f"{name} | {mb}+{mm}"] = cell
                print(f"{name} {mb}+{mm} done", flush=True)
    return results


def worst_case(results: dict, group: tuple[str, ...], against: str, metric: str = "kl") -> dict[str, float]:
    """Per candidate of ``group``: the largest over cells of its mean ``metric`` over ``against``'s."""
    return {c: max(cell[c][metric][0] / cell[against][metric][0] for cell in results.values()) for c in group}


def wins(results: dict, group: tuple[str, ...], against: str, metric: str = "kl") -> dict[str, int]:
    """Per candidate: the cells where its mean ``metric`` lies below ``against``'s by more than two
    standard errors of the two means (combined)."""
    out = {}
    for c in group:
        out[c] = sum(1 for cell in results.values()
                     if cell[against][metric][0] - cell[c][metric][0]
                     > 2 * math.hypot(cell[against][metric][1], cell[c][metric][1]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run(args.draws, args.seed)
    heads = {}
    for group, present, single in ((FULL, "paper", "single"), (LOWRANK, "lr-paper", "lr-single")):
        for metric in ("kl", "var"):
            for ref in (present, single):
                heads[f"{metric} over {ref}"] = worst_case(results, group, ref, metric)
                heads[f"{metric} better than {ref} (cells)"] = wins(results, group, ref, metric)
    (HERE / "results" / "structure_estimates.json").write_text(
        json.dumps({"draws": args.draws, "seed": args.seed, "P": P, "C": C, "k": K, "cells": results,
                    "worst_case": heads}, indent=1) + "\n")
    cmd = "OMP_NUM_THREADS=1 python benchmarks/structure_estimates.py" + (
        "" if (args.draws, args.seed) == (20, 0) else f" --draws {args.draws} --seed {args.seed}")
    lines = ["# Two-batch estimates of a dense curvature of the GGN's shape against a known truth", "",
             f"Written by `{cmd}` (module docstring: the spectra, the candidates and the scores). P = {P}, "
             f"C = {C} rows per sample, {args.draws} draws per cell; `m_B+m_B̃` the samples of B and B̃ (B's rows: "
             f"{C} m_B; every candidate uses the same n = m_B + m_B̃ samples). `paper` is `debiased_full`'s present "
             f"estimate, `lr-*` the rank-{K} estimates of `debiased_lowrank`. Smaller is better.", "",
             f"## Worst case over the {len(results)} cells (mean over the reference's mean) and the cells "
             "where a candidate is better than the reference by more than 2 s.e.", "",
             "| score | " + " | ".join(CANDIDATES) + " |", "|---|" + "---|" * len(CANDIDATES)]
    for key, row in heads.items():
        fmt = (lambda v: f"{v:d}") if "cells" in key else (lambda v: f"{v:.3g}")
        lines.append(f"| {key} | " + " | ".join(fmt(row[c]) if c in row else "" for c in CANDIDATES) + " |")
    for metric, title in (("kl", "KL(q̂‖p) + KL(p‖q̂), largest over δ"),
                          ("var", "mean |log predictive variance error|, largest over δ")):
        lines += ["", f"## {title}", "",
                  "| spectrum | split | " + " | ".join(CANDIDATES) + " | w shrunk | w stein |",
                  "|---|---|" + "---|" * (len(CANDIDATES) + 2)]
        for key, cell in results.items():
            spec, split = key.split(" | ")
            vals = []
            for group in (FULL, LOWRANK):
                best = min(cell[c][metric][0] for c in group)
                vals += [(f"**{cell[c][metric][0]:.3g}**" if cell[c][metric][0] == best else f"{cell[c][metric][0]:.3g}")
                         for c in group]
            lines.append(f"| {spec} | {split} | " + " | ".join(vals)
                         + f" | {cell['kept']['shrunk']:.2f} | {cell['kept']['stein']:.2f} |")
    lines += ["", "Bold: the best of each structure's candidates in the row. Directions apart (`kl_fwd`, `kl_rev`) "
              "and standard errors: `structure_estimates.json`."]
    (HERE / "results" / "structure_estimates.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

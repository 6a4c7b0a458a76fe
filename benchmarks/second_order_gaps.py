"""Can second-order perturbation theory in the pooled basis replace the shrunk fit's two extra eigendecompositions?

    OMP_NUM_THREADS=1 python -m benchmarks.second_order_gaps [--batch-sizes 32 64 128 256] [--draws 8]

The corrected and shrunk estimates (:mod:`laplace_debiased.kron.corrected`) decompose every
factor three times in float64: the pooled factor ``P`` of B ∪ B̃ for its eigenvectors, and B's
``D`` and B̃'s ``M`` for the two orders' gaps ``g_{B,i} = λ_i(D) - u_iᵀ M u_i`` and
``g_{B̃,i} = λ_i(M) - v_iᵀ D v_i``. The paper's fit decomposes once, so on a model whose
decompositions dominate the fit (ALL-CNN-C at small b) the shrunk fit costs more than the target of
1.1× the paper's. The module docstring of ``corrected`` writes the gaps to second order in the
pooled basis; with ``K = D - M``, ``K' = U_Pᵀ K U_P``, the pooled eigenvalues ``L`` and
``a = m_B̃ / n``, ``b = m_B / n`` (``D = P + a K``, ``M = P - b K``; exactly ``g_{B,i} = u_iᵀ K u_i``
and ``g_{B̃,i} = -v_iᵀ K v_i``):

.. math::

    g_{B,i} ≈ K'_{ii} + 2a S_i, \\qquad g_{B̃,i} ≈ -K'_{ii} + 2b S_i, \\qquad
    S_i = \\sum_{j ≠ i} K'^2_{ij} / (L_i - L_j),

one eigendecomposition and two matrix products per factor. This benchmark measures whether that
is accurate enough on real factors: the digits main job's trained model and training set, its 12
factors of dimension at least 8, and ``--draws`` seeded pairs of disjoint halves of ``b / 2``
images each. Per factor it compares, on the pooled range (the pooled null space left out),
the bias estimate ``x = g_B + g_B̃`` and the shrinkage weight ``w = max(0, 1 - Σ e² / Σ x²)``
(``e = g_B - g_B̃``; :func:`~laplace_debiased.kron.corrected.shrinkage_weight`) computed
exactly and to second order. Pairs closer than the pooled factor's round-off tolerance are left
out of ``S_i`` (the null space's ties). Writes ``results/second_order_gaps.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from benchmarks.normalisation import single_fit
from laplace_debiased.kron.corrected import same_minus_cross, shrinkage_weight
from laplace_debiased.curvature.linalg import frobenius_tolerance, symmetric_eigh64
from laplace_debiased.evaluation.options import DEFAULTS
from laplace_debiased.evaluation.training import default_digits_model

HERE = Path(__file__).resolve().parent
MIN_DIMENSION = 8


def second_order_gaps(direction: torch.Tensor, magnitude: torch.Tensor, m_direction: int, m_magnitude: int
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The two orders' gaps to second order in the pooled eigenbasis (module docstring).

    Args:
        direction: ``(d, d)`` PSD factor ``D`` of B.
        magnitude: ``(d, d)`` PSD factor ``M`` of B̃, on ``D``'s scale.
        m_direction: samples in B.
        m_magnitude: samples in B̃.

    Returns:
        ``(g_B, g_B̃, null)``: ``(d,)`` float64 gaps in ascending order of the pooled eigenvalues, and
        the size of the pooled null space (its first entries).
    """
    n = m_direction + m_magnitude
    D, M = direction.double(), magnitude.double()
    P = (m_direction * D + m_magnitude * M) / n
    L, U = symmetric_eigh64(P)
    K = U.T @ (D - M) @ U
    tol = frobenius_tolerance(L.numel(), direction.dtype, float(torch.linalg.matrix_norm(P)))
    spacing = L[:, None] - L[None, :]
    S = torch.where(spacing.abs() > tol, K.square() / torch.where(spacing.abs() > tol, spacing, 1.0), 0.0).sum(1)
    first = K.diagonal()
    null = int((L <= tol).sum())
    return first + 2 * m_magnitude / n * S, -first + 2 * m_direction / n * S, null


def compare(direction: torch.Tensor, magnitude: torch.Tensor, m: int) -> dict[str, float]:
    """Exact (:func:`~laplace_debiased.kron.corrected.same_minus_cross`, matched by sorted
    position) against second-order gaps of two halves of ``m`` samples each, on the pooled range:
    the relative error of ``x = g_B + g_B̃`` and both shrinkage weights."""
    approx_b, approx_t, null = second_order_gaps(direction, magnitude, m, m)
    exact_b, exact_t = same_minus_cross(direction, magnitude, m)[null:], same_minus_cross(magnitude, direction, m)[null:]
    approx_b, approx_t = approx_b[null:], approx_t[null:]
    x_exact, x_approx = exact_b + exact_t, approx_b + approx_t
    scale = float(x_exact.norm())
    return {"x_relative_error": float((x_approx - x_exact).norm()) / scale if scale > 0 else 0.0,
            "w_exact": shrinkage_weight(exact_b, exact_t), "w_second_order": shrinkage_weight(approx_b, approx_t)}


def measure(model: torch.nn.Module, train: Dataset, sizes: list[int], draws: int, seed: int) -> list[dict]:
    """One row per b, draw, block and factor of dimension at least :data:`MIN_DIMENSION`."""
    rows = []
    for b in sizes:
        if b > len(train):
            raise ValueError(f"b = {b} exceeds the {len(train)} training images; choose batch sizes up to {len(train)}.")
        for r in range(draws):
            perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 7919 + r))
            pair = [single_fit(model, train, half.numpy()).H_facs.kfacs for half in (perm[:b // 2], perm[b // 2:b])]
            for block, (fd, fm) in enumerate(zip(*pair)):
                for factor, (D, M) in enumerate(zip(fd, fm)):
                    if D.shape[0] >= MIN_DIMENSION:
                        rows.append({"b": b, "draw": r, "block": block, "factor": factor, "dimension": D.shape[0],
                                     **compare(D, M, b // 2)})
    return rows


def summarise(rows: list[dict], sizes: list[int]) -> list[dict]:
    """Per b: the median and largest relative error of ``x``, the mean ``|w_exact - w_second_order|``
    and the share of factors whose weights differ by more than 0.1."""
    out = []
    for b in sizes:
        mine = [r for r in rows if r["b"] == b]
        errors = [r["x_relative_error"] for r in mine]
        dw = [abs(r["w_exact"] - r["w_second_order"]) for r in mine]
        out.append({"b": b, "factors": len(mine), "x_error_median": statistics.median(errors),
                    "x_error_max": max(errors), "w_difference_mean": statistics.fmean(dw),
                    "w_differs_share": sum(d > 0.1 for d in dw) / len(dw)})
    return out


def markdown(summary: list[dict], command: str, meta: dict) -> str:
    lines = ["# Second-order gaps in the pooled basis against the exact two-batch gaps (`benchmarks/second_order_gaps.py`)",
             "", f"Digits main job's model and training set ({meta['n_train']} images), {meta['draws']} draws of two "
             f"disjoint halves per b, the factors of dimension ≥ {MIN_DIMENSION}; {meta['wall_s']:.0f} s.", "",
             f"Command: `{command}`", "",
             "| b | factors × draws | relative error of the bias estimate x, median | largest "
             "| mean \\|w exact − w second order\\| | weights differing by > 0.1 [%] |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s['b']} | {s['factors']} | {s['x_error_median']:.2f} | {s['x_error_max']:.2f} "
              f"| {s['w_difference_mean']:.2f} | {100 * s['w_differs_share']:.0f} |" for s in summary]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, splits = default_digits_model(seed=DEFAULTS["seed"], log=None)
    rows = measure(model, splits["train"], args.batch_sizes, args.draws, DEFAULTS["seed"])
    summary = summarise(rows, args.batch_sizes)
    meta = {"wall_s": time.perf_counter() - start, "n_train": len(splits["train"]), "draws": args.draws,
            "threads": args.threads}
    command = (f"OMP_NUM_THREADS={args.threads} python -m benchmarks.second_order_gaps --batch-sizes "
               f"{' '.join(map(str, args.batch_sizes))} --draws {args.draws} --threads {args.threads}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "second_order_gaps.json").write_text(
        json.dumps({"meta": meta, "command": command, "summary": summary, "rows": rows}, indent=1) + "\n")
    (HERE / "results" / "second_order_gaps.md").write_text(markdown(summary, command, meta))
    print(markdown(summary, command, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

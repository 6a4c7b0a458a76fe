"""Headline numbers of a [`BiasDiagnosis`][laplace_debiased.diagnostics.bias.BiasDiagnosis] (JSON-ready).

Relative biases are ``(estimate - full) / |full|`` per direction; summaries are median and
quartiles over directions and source batches (and, for independent batches, over all of them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from laplace_debiased.diagnostics.bias import BiasDiagnosis, LadderRow, batch_size_for_tolerance
from laplace_debiased.diagnostics.directional import quartiles, relative_bias
from laplace_debiased.diagnostics.overlap import mean_row_mass


def _ladder_summary(rows: list[LadderRow]) -> list[dict[str, Any]]:
    """Per batch size: quartiles of the same-batch and independent-batch relative biases."""
    out = []
    for size in sorted({r.batch_size for r in rows}):
        sel = [r for r in rows if r.batch_size == size]
        same = torch.cat([relative_bias(r.same, r.full) for r in sel])
        indep = torch.cat([relative_bias(r.independent, r.full) for r in sel])
        row = {"batch_size": size, "n_sources": len(sel), "same_batch": quartiles(same),
               "independent_batch": quartiles(indep)}
        if sel[0].full_ggn is not None:
            row["approximation_vs_exact_full"] = quartiles(torch.cat([relative_bias(r.full, r.full_ggn) for r in sel]))
            row["same_batch_vs_exact_full"] = quartiles(torch.cat([relative_bias(r.same, r.full_ggn) for r in sel]))
        out.append(row)
    return out


def _cat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.flatten() for t in tensors])


def summarize(d: BiasDiagnosis) -> dict[str, Any]:
    """Everything the Markdown summary states, as plain numbers."""
    cfg = d.config
    eig, cg = d.eigen, d.cg
    top1 = torch.stack([s.batches[s.source].curvatures[0] / s.full.curvatures[0] for s in eig])
    ladder = _ladder_summary(d.ladder)
    sizes = [r["batch_size"] for r in ladder]
    medians = [r["same_batch"]["median"] for r in ladder]
    needed, extrapolated = batch_size_for_tolerance(sizes, medians, cfg.tolerance)
    indep = quartiles(_cat([s.curvature_bias_others() for s in eig]))
    cg_steps = [s.step_sizes() for s in cg]
    summary: dict[str, Any] = {
        "batch_size": cfg.batch_size,
        "curvature": cfg.curvature,
        "beta": cfg.beta,
        "n_params": d.n_params,
        "n_data": d.n_data,
        "n_left_out": d.n_left_out,
        "n_batches": len(eig[0].batches),
        "n_sources": len(eig),
        "top_k": eig[0].directions.shape[1],
        "tolerance": cfg.tolerance,
        "eigen": {
            "curvature_bias_same_batch": quartiles(_cat([s.curvature_bias_same() for s in eig])),
            "curvature_bias_other_batches": indep,
            "slope_bias_same_batch": quartiles(_cat([s.slope_bias_same() for s in eig])),
            "top1_overestimation_factor": quartiles(top1),
        },
        "cg": {
            "curvature_bias_same_batch": quartiles(_cat([s.curvature_bias_same() for s in cg])),
            "curvature_bias_other_batches": quartiles(_cat([s.curvature_bias_others() for s in cg])),
            "step_size_ratio_same_to_full": quartiles(_cat([per[s.source] / full for s, (per, full) in zip(cg, cg_steps)])),
            "step_size_ratio_other_to_full": quartiles(_cat([per[s.others()] / full for s, (per, full) in zip(cg, cg_steps)])),
        },
        "eq5_max_relative_residual": d.eq5_residual(),
        "batch_size_ladder": ladder,
        "kfac_ladder": _ladder_summary(d.kfac_ladder) if d.kfac_ladder else [],
        "batch_size_within_tolerance": needed,
        "batch_size_extrapolated": extrapolated,
        "debiased_within_tolerance": abs(indep["median"]) <= cfg.tolerance,
        "products": {stage: {str(n): c for n, c in counts.items()} for stage, counts in d.products.items()},
        "products_total": {str(n): c for n, c in sorted(d.total_products().items())},
        "example_products_total": sum(n * c for n, c in d.total_products().items()),
    }
    chain = d.eq7_chain()
    if chain is not None:
        summary["eq7_top_eigenvalue"] = {"same_batch_mean": chain.same_batch, "full_data": chain.full_data,
                                         "full_data_along_batch_top": chain.cross, "holds": chain.holds()}
        summary["full_top_eigenvalues"] = d.full_eigenvalues.tolist()
    if d.overlap_between_batches is not None:
        summary["overlap_between_batches"] = mean_row_mass(d.overlap_between_batches)
    if d.overlap_with_full is not None:
        summary["overlap_with_full"] = mean_row_mass(d.overlap_with_full)
    return summary


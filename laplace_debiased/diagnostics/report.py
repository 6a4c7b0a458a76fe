"""The bias report: plots in the style of the paper's Figs. 1-4 and 17, JSON and Markdown.

``write_report(diagnosis, out_dir)`` writes

* ``slice.png`` (Fig. 1): the same-batch, independent-batch and full-data quadratics in the
  plane of the batch's top-2 eigenvectors;
* ``eigen.png`` (Fig. 2): curvatures and slopes along the top-k eigenvectors on the same batch,
  the other batches and the full data, and the relative biases (median, quartiles);
* ``overlap.png`` (Fig. 3): Ω between two batches' eigenvectors and with the full data's;
* ``cg.png`` (Fig. 4): curvatures and update magnitudes τ_p along CG directions;
* ``batch_sizes.png`` (Fig. 17): relative bias of the top-k curvatures vs batch size, for the
  chosen curvature and K-FAC;
* ``bias.json`` (all numbers) and ``README.md`` (the summary in words, with the plots).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from laplace_debiased.diagnostics.bias import BiasDiagnosis, LadderRow
from laplace_debiased.diagnostics.measure import DirectionStudy
from laplace_debiased.diagnostics.slices import plane_minimizer, plane_quadratic
from laplace_debiased.diagnostics.summary import summarize

SAME, OTHER, FULL = "tab:red", "tab:blue", "black"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _spread(ax, x, values, color, label):
    """Median line with an interquartile band of ``values (n, K)`` over the first axis."""
    q = torch.quantile(values.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64), dim=0)
    ax.fill_between(x, q[0], q[2], color=color, alpha=0.25, lw=0)
    ax.plot(x, q[1], "o-", color=color, ms=3, label=label)


def plot_slice(study: DirectionStudy, path: Path) -> None:
    """Fig. 1: contours of q(·; B), q(·; B̃) and q(·; D) in the top-2 eigenvector plane of B."""
    plt = _plt()
    same, other, full = study.batches[study.source], study.batches[study.others()[0]], study.full
    centers = torch.stack([plane_minimizer(r) for r in (same, other, full)])
    lam = torch.linalg.eigvalsh(full.gram[:2, :2]).clamp_min(1e-12)
    radius = float(max(centers.abs().max() * 1.5, 3.0 / lam[0].sqrt()))
    grid = torch.linspace(-radius, radius, 201, dtype=full.gram.dtype)
    a, b = torch.meshgrid(grid, grid, indexing="xy")
    surfaces = {name: plane_quadratic(r, a, b) for name, r in (("same", same), ("other", other), ("full", full))}
    q_full = surfaces["full"]
    levels = torch.quantile(q_full.flatten()[::7], torch.tensor([0.02, 0.08, 0.2, 0.4, 0.65], dtype=q_full.dtype))
    levels = sorted(set(float(v) for v in levels))
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    for (name, color, style, label) in (("full", FULL, "-", "full data D"), ("same", SAME, "-", "same batch B"),
                                        ("other", OTHER, ":", "independent batch B̃")):
        ax.contour(a, b, surfaces[name], levels=levels, colors=color, linestyles=style, linewidths=1.2)
        ax.plot([], [], color=color, ls=style, label=label)
    for c, color in zip(centers, (SAME, OTHER, FULL)):
        ax.plot(float(c[0]), float(c[1]), "x", color=color, ms=8)
    ax.plot(0, 0, "k.", ms=6)
    ax.set(xlabel="u₁ (top eigenvector of B)", ylabel="u₂", xlim=(-radius, radius), ylim=(-radius, radius),
           title="Quadratic models in the top-2 plane of B")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_directional(studies: list[DirectionStudy], path: Path, what: str) -> None:
    """Figs. 2/4: curvatures, slopes (or CG step sizes) and relative curvature biases per direction."""
    plt = _plt()
    s0 = studies[0]
    K = s0.directions.shape[1]
    x = list(range(1, K + 1))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    _spread(ax, x, s0.curvatures()[s0.others()], OTHER, "other batches")
    ax.plot(x, s0.batches[s0.source].curvatures, "o-", color=SAME, ms=3, label="same batch B")
    ax.plot(x, s0.full.curvatures, "s--", color=FULL, ms=3, label="full data D")
    ax.set(yscale="log", xlabel=f"{what} index", ylabel="curvature ∂²_d q", title="Directional curvatures")
    ax.legend(fontsize=8)
    ax = axes[1]
    if s0.kind == "cg":
        per, full = s0.step_sizes()
        _spread(ax, x, per[s0.others()].abs(), OTHER, "other batches")
        ax.plot(x, per[s0.source].abs(), "o-", color=SAME, ms=3, label="same batch B")
        ax.plot(x, full.abs(), "s--", color=FULL, ms=3, label="full data D")
        ax.set(yscale="log", xlabel="CG iteration p", ylabel="|τ_p|", title="CG update magnitudes")
    else:
        _spread(ax, x, s0.slopes()[s0.others()].abs(), OTHER, "other batches")
        ax.plot(x, s0.batches[s0.source].slopes.abs(), "o-", color=SAME, ms=3, label="same batch B")
        ax.plot(x, s0.full.slopes.abs(), "s--", color=FULL, ms=3, label="full data D")
        ax.set(yscale="log", xlabel=f"{what} index", ylabel="|∂_d q|", title="Directional slopes (magnitude)")
    ax.legend(fontsize=8)
    ax = axes[2]
    _spread(ax, x, torch.stack([s.curvature_bias_same() for s in studies]), SAME, f"same batch ({len(studies)} batches)")
    _spread(ax, x, torch.cat([s.curvature_bias_others() for s in studies]), OTHER, "independent batches")
    ax.axhline(0, color=FULL, lw=0.8)
    ax.set(xlabel=f"{what} index", ylabel="(estimate − full) / full", title="Relative curvature bias")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overlap(d: BiasDiagnosis, path: Path) -> None:
    """Fig. 3: Ω between two batches' top-k eigenvectors and with the full data's."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    mats = [(m, t, o) for m, t, o in ((d.overlap_between_batches, "batch B vs batch B̃", "B̃"),
                                      (d.overlap_with_full, "batch B vs full data D", "D")) if m is not None]
    fig, axes = plt.subplots(1, max(len(mats), 1), figsize=(4.8 * max(len(mats), 1), 4.2), squeeze=False)
    for ax, (m, title, other) in zip(axes[0], mats):
        k, l = m.shape  # eigenvectors numbered from 1 by descending curvature, as in eigen.png
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", extent=(0.5, l + 0.5, k + 0.5, 0.5))
        ax.set(title=f"Ω = (uᵢᵀũⱼ)²: {title}", xlabel=f"eigenvector j of {other}", ylabel="eigenvector i of B")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, fraction=0.046, label="overlap Ω_ij (1: the same direction)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ladder_curves(ax, rows: list[LadderRow], label: str, color: str) -> None:
    sizes = sorted({r.batch_size for r in rows})
    for key, style, name in (("same", "o-", "same batch"), ("independent", "s:", "independent batch")):
        vals = [torch.cat([(getattr(r, key) - r.full) / r.full.abs() for r in rows if r.batch_size == s]) for s in sizes]
        q = [torch.quantile(v.double(), torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)) for v in vals]
        ax.plot(sizes, [float(v[1]) for v in q], style, color=color, ms=4, label=f"{label}: {name}")
        if key == "same":
            ax.fill_between(sizes, [float(v[0]) for v in q], [float(v[2]) for v in q], color=color, alpha=0.2, lw=0)


def plot_batch_sizes(d: BiasDiagnosis, path: Path) -> None:
    """Fig. 17: median relative bias of the top-k curvatures vs batch size (exact and K-FAC)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.8, 4))
    _ladder_curves(ax, d.ladder, d.config.curvature.upper(), SAME)
    if d.kfac_ladder:
        _ladder_curves(ax, d.kfac_ladder, "K-FAC", "tab:green")
    tol = d.config.tolerance
    ax.axhspan(-tol, tol, color="grey", alpha=0.15, label=f"±{tol:g} tolerance")
    ax.axhline(0, color=FULL, lw=0.8)
    ax.set(xscale="log", xlabel="batch size", ylabel="relative bias of top-k curvatures",
           title="Bias vs batch size (median, quartiles)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f} %"


def markdown_summary(s: dict[str, Any], plan: dict[str, str] | None = None) -> str:
    """The report's Markdown: what was measured, how biased, and what would fix it."""
    lines = [*_verdict_lines(s), *_finding_lines(s), *_ladder_lines(s), *_cost_lines(s, plan)]
    lines += ["", "## Plots", "", "![slice](slice.png)", "", "![eigenvectors](eigen.png)", "", "![overlap](overlap.png)",
              "", "![cg](cg.png)", "", "![batch sizes](batch_sizes.png)", ""]
    return "\n".join(lines)


def _verdict_lines(s: dict[str, Any]) -> list[str]:
    """Title, what was measured, and the verdict on the same-batch and independent-batch bias."""
    e = s["eigen"]
    b, tol = s["batch_size"], s["tolerance"]
    same = e["curvature_bias_same_batch"]
    other = e["curvature_bias_other_batches"]
    lines = [
        "# Mini-batch quadratic bias report",
        "",
        f"Model with {s['n_params']:,} parameters, {s['curvature'].upper()} curvature + β = {s['beta']:g}, "
        f"data set of {s['n_data']:,} points split into {s['n_batches']} batches of {b}"
        + (f" ({s['n_left_out']} left-over points not used)" if s["n_left_out"] else "") + ". "
        f"Directions from {s['n_sources']} batches: top-{s['top_k']} eigenvectors (Lanczos) and CG directions.",
        "",
        "## Verdict",
        "",
        f"* **At batch size {b} the top-{s['top_k']} curvature subspace is "
        f"{'over' if same['median'] >= 0 else 'under'}-estimated by a median of "
        f"{100 * abs(same['median']):.0f} %** (quartiles {_pct(same['q25'])} … {_pct(same['q75'])}) relative to the full data "
        f"set; along the single top eigenvector the same-batch curvature is "
        f"{e['top1_overestimation_factor']['median']:.2f}× the full-data one (median over batches).",
        f"* Measured on an **independent batch** of the same size (two-batch debiasing), the median relative "
        f"error is {_pct(other['median'])} (quartiles {_pct(other['q25'])} … {_pct(other['q75'])}): "
        + ("**within** " if s["debiased_within_tolerance"] else "**not within** ")
        + f"the tolerance of ±{100 * tol:.0f} %.",
    ]
    return lines


def _finding_lines(s: dict[str, Any]) -> list[str]:
    """The batch size that would do, CG directions, slopes, overlaps and the Eq. 5 / Eq. 7 checks."""
    e, c = s["eigen"], s["cg"]
    b, tol = s["batch_size"], s["tolerance"]
    lines: list[str] = []
    need, extra = s["batch_size_within_tolerance"], s["batch_size_extrapolated"]
    if need is None:
        lines.append("* The same-batch bias does not shrink with the batch size in the measured range; use "
                     "two-batch debiasing rather than a larger batch.")
    elif need == b and not extra:
        lines.append(f"* The same-batch bias is already within ±{100 * tol:.0f} % at batch size {b}.")
    else:
        how = "extrapolated from a power-law fit" if extra else "measured"
        lines.append(f"* To bring the same-batch bias within ±{100 * tol:.0f} % without debiasing, a batch size of "
                     f"about **{need:,}** is needed ({how}).")
    lines += [
        f"* CG directions: same-batch curvature bias {_pct(c['curvature_bias_same_batch']['median'])} (median); "
        f"same-batch CG steps are {c['step_size_ratio_same_to_full']['median']:.2f}× the full-data step sizes "
        f"along them, independent batches {c['step_size_ratio_other_to_full']['median']:.2f}×.",
        f"* Slopes along the eigenvectors: same-batch magnitude bias {_pct(e['slope_bias_same_batch']['median'])} (median).",
    ]
    if "overlap_between_batches" in s:
        lines.append(f"* Eigenspace overlap between two batches: {s['overlap_between_batches']:.2f}"
                     + (f"; with the full data: {s['overlap_with_full']:.2f}" if "overlap_with_full" in s else "")
                     + " (1 = same subspace).")
    if "eq7_top_eigenvalue" in s:
        q = s["eq7_top_eigenvalue"]
        lines.append(f"* Eq. 7: mean same-batch λ_max = {q['same_batch_mean']:.4g} ≥ full-data λ_max = "
                     f"{q['full_data']:.4g} ≥ full-data curvature along the batches' top eigenvector = "
                     f"{q['full_data_along_batch_top']:.4g}: {'holds' if q['holds'] else 'does not hold on these batches'}.")
    if s["eq5_max_relative_residual"] is not None:
        lines.append(f"* Eq. 5 check (average over the partition = full data): max relative deviation "
                     f"{s['eq5_max_relative_residual']:.1e}.")
    return lines


def _ladder_lines(s: dict[str, Any]) -> list[str]:
    """The bias-vs-batch-size tables (exact curvature, then K-FAC)."""
    lines: list[str] = []
    lines += ["", "## Bias vs batch size", "",
              "Relative bias of the top-k curvatures of a batch of each size (one independent batch per direction batch, so this column is noisy with few direction batches, see `--sources`; the verdict above uses all other batches).",
              "", "| batch size | same batch (median) | quartiles | independent batch (median) |",
              "|---:|---:|---:|---:|"]
    for r in s["batch_size_ladder"]:
        lines.append(f"| {r['batch_size']} | {_pct(r['same_batch']['median'])} | {_pct(r['same_batch']['q25'])} … "
                     f"{_pct(r['same_batch']['q75'])} | {_pct(r['independent_batch']['median'])} |")
    if s["kfac_ladder"]:
        lines += ["", "K-FAC (top-k eigenvectors of the batch's K-FAC; bias w.r.t. the full-data K-FAC, and of the "
                  "full-data K-FAC w.r.t. the exact curvature along them):", "",
                  "| batch size | same batch | independent batch | full K-FAC vs exact |", "|---:|---:|---:|---:|"]
        for r in s["kfac_ladder"]:
            lines.append(f"| {r['batch_size']} | {_pct(r['same_batch']['median'])} | "
                         f"{_pct(r['independent_batch']['median'])} | {_pct(r['approximation_vs_exact_full']['median'])} |")
    return lines


def _cost_lines(s: dict[str, Any], plan: dict[str, str] | None) -> list[str]:
    """The planned and the measured curvature-vector products."""
    lines: list[str] = []
    lines += ["", "## Cost", ""]
    if plan:
        lines += ["Planned (stated before the run):", ""] + [f"* {k}: {v}" for k, v in plan.items()] + [""]
    lines.append("Curvature-vector products done, by data-set size: "
                 + ", ".join(f"{c:,} on {n} points" for n, c in s["products_total"].items())
                 + f" ({s['example_products_total']:,} example-vector products in all).")
    return lines


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def diagnosis_numbers(d: BiasDiagnosis) -> dict[str, Any]:
    """All per-direction numbers of the diagnosis (the JSON's ``details``)."""
    def study(s: DirectionStudy) -> dict[str, Any]:
        out = {"source": s.source, "curvatures": s.curvatures(), "slopes": s.slopes(),
               "full_curvatures": s.full.curvatures, "full_slopes": s.full.slopes, "eq5_residual": s.eq5_residual}
        if s.kind == "cg":
            per, full = s.step_sizes()
            out.update(step_sizes=per, full_step_sizes=full)
        return out

    def rows(rs: list[LadderRow]) -> list[dict[str, Any]]:
        return [{"batch_size": r.batch_size, "source": r.source, "same": r.same, "independent": r.independent,
                 "full": r.full, "full_exact": r.full_ggn} for r in rs]

    return {"eigen": [study(s) for s in d.eigen], "cg": [study(s) for s in d.cg],
            "overlap_between_batches": d.overlap_between_batches, "overlap_with_full": d.overlap_with_full,
            "full_top_eigenvalues": d.full_eigenvalues, "batch_size_ladder": rows(d.ladder),
            "kfac_ladder": rows(d.kfac_ladder)}


def write_report(d: BiasDiagnosis, out_dir: str | Path, plan: dict[str, str] | None = None) -> dict[str, Any]:
    """Write plots, ``bias.json`` and ``README.md`` to ``out_dir``; return the summary numbers."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(d)
    plot_slice(d.eigen[0], out / "slice.png")
    plot_directional(d.eigen, out / "eigen.png", "eigenvector")
    plot_overlap(d, out / "overlap.png")
    plot_directional(d.cg, out / "cg.png", "CG direction")
    plot_batch_sizes(d, out / "batch_sizes.png")
    payload = {"summary": s, "plan": plan, "config": d.config.__dict__, "details": diagnosis_numbers(d)}
    tmp = out / "bias.json.part"
    tmp.write_text(json.dumps(_jsonable(payload), indent=1))
    tmp.replace(out / "bias.json")
    (out / "README.md").write_text(markdown_summary(s, plan))
    return s

"""The figures of a calibration report (matplotlib, Agg backend, headless).

Each comes with the heading and paragraph that introduce it:

* Figure-6 style: accuracy / NLL / ECE on the test set vs δ, one line per method (mean over
  repeats, min-max band), MAP as a horizontal line, full-batch methods as markers; one figure per
  link approximation;
* where on the grid each mini-batch LA errs: its signed test-NLL gap to the full batch vs δ (mean
  over draws, ±1 standard-error band), one panel per batch size;
* the batch-size table's gaps against b;
* link comparison: test NLL vs δ per link approximation, one panel per method;
* reliability diagrams at each method's chosen δ;
* shift-detection AUROC vs corruption severity (when corrupted evaluation sets were swept).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from laplace_debiased.evaluation.report_data import (LINK_LABELS, BatchFit, ReportContext, ReportDoc, TrackedFit,
                                                     batch_of, fit_name, mean_by, several_structures)


#: panels per row of the link comparison (``links.png``); more methods wrap onto further rows
LINK_PANELS_PER_ROW = 4


def _save(fig, ctx: ReportContext, doc: ReportDoc, name: str, alt: str, tight: bool = True) -> None:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(ctx.out_dir / name, dpi=110)
    plt.close(fig)
    doc.img(name, alt)


_FIG6_AXES = (("accuracy", 100.0, "test accuracy (%)"), ("nll", 1.0, "test NLL (nats)"),
              ("ece", 100.0, "test ECE (%)"))


def _chosen_lines(ax, ctx: ReportContext, chosen: dict[str, float]) -> None:
    """One dotted vertical per distinct chosen δ, labelled with the methods that chose it (so
    lines that would sit on top of each other are one line with one legend entry)."""
    by_delta: dict[float, list[str]] = defaultdict(list)
    for m, d in chosen.items():
        by_delta[d].append(m)
    for d, ms in sorted(by_delta.items()):
        who = "all methods" if len(ms) == len(ctx.methods) > 1 else ", ".join(ctx.label(m) for m in ms)
        ax.axvline(d, color=ctx.colors[ms[0]] if len(ms) == 1 else "0.35", ls=":", lw=1.5,
                   label=f"chosen δ = {d:.3g} ({who})")


def _figure6_panel(ax, ctx: ReportContext, sub: list[dict], metric: str, scale: float) -> None:
    for m in ctx.methods:
        vals = mean_by([r for r in sub if r["method"] == m], ("prior_precision",), metric)
        if not vals:
            continue
        xs = sorted(k[0] for k in vals)
        mean = [scale * np.mean(vals[(x,)]) for x in xs]
        if m in ctx.full_batch:
            ax.plot(xs, mean, "o", color=ctx.colors[m], label=ctx.label(m), markersize=5, zorder=3)
        else:
            ax.plot(xs, mean, "-", color=ctx.colors[m], label=ctx.label(m))
            ax.fill_between(xs, [scale * min(vals[(x,)]) for x in xs],
                            [scale * max(vals[(x,)]) for x in xs], color=ctx.colors[m], alpha=0.2)
    mr = ctx.map_rows.get(ctx.test_set)
    if mr is not None and metric in mr:
        ax.axhline(scale * mr[metric], color="k", ls="--", lw=1, label="MAP")


def figure6(ctx: ReportContext, doc: ReportDoc) -> None:
    """Figure-6 tracking curves: accuracy / NLL / ECE on the test set vs prior precision, one
    figure per link; mean over repeats with a min-max band, full-batch methods as markers, the
    MAP as a dashed line and the chosen δ as dotted verticals."""
    import matplotlib.pyplot as plt

    doc.h("Metrics vs prior precision (Figure 6)")
    doc.p("How closely each mini-batch LA (lines; bands span the draws) tracks the full-batch LA "
          "(markers) over the whole grid. Dotted verticals: the chosen δ, one line per distinct value "
          "with the methods that chose it in the legend. Where curves coincide (large δ, where the "
          "prior dominates) they are drawn on top of each other.")
    for link in ctx.links:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), layout="constrained")
        sub = [r for r in ctx.lap if r["eval_set"] == ctx.test_set and r["link"] == link]
        for ax, (metric, scale, label) in zip(axes, _FIG6_AXES):
            _figure6_panel(ax, ctx, sub, metric, scale)
            _chosen_lines(ax, ctx, ctx.chosen(link))
            ax.set_xscale("log")
            ax.set_xlabel("prior precision δ")
            ax.set_ylabel(label)
        handles, labels = axes[1].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=9)
        fig.suptitle(f"{ctx.test_set}: {LINK_LABELS[link]}")
        _save(fig, ctx, doc, f"fig6_{link}.png", f"metrics vs prior precision, {link}", tight=False)


def signed_gap_figure(panels: dict[str, dict[str, dict[int, dict[float, float]]]], title: str,
                      colors: dict[str, str] | None = None):
    """A matplotlib figure of signed gap curves, one panel per key of ``panels`` (side by side, shared
    y axis): per label its [`gap_curves`][laplace_debiased.evaluation.tracking.gap_curves] output
    (fractions) as the mean over draws in percent against δ (log axis), with a ±1 standard-error band
    from two draws on, and a zero line. ``colors``: label -> matplotlib colour (default: the cycle)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 1, 4.2), sharey=True, squeeze=False)
    for ax, (panel, curves_by_label) in zip(axes[0], panels.items()):
        for label, curves in curves_by_label.items():
            deltas = sorted(set.intersection(*(set(c) for c in curves.values())))
            gaps = 100 * np.array([[c[d] for d in deltas] for c in curves.values()])  # (draws, δ)
            mean = gaps.mean(0)
            line, = ax.plot(deltas, mean, marker="o", markersize=3, label=f"{label} ({len(gaps)} draws)",
                            **({"color": colors[label]} if colors else {}))
            if len(gaps) > 1:
                se = gaps.std(0, ddof=1) / np.sqrt(len(gaps))
                ax.fill_between(deltas, mean - se, mean + se, color=line.get_color(), alpha=0.2)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("prior precision δ")
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("test NLL − full batch's (% of full batch's)")
    fig.suptitle(title, fontsize=10)
    return fig


def save_signed_gap_figure(panels: dict[str, dict[str, dict[int, dict[float, float]]]], title: str, path: Path,
                           colors: dict[str, str] | None = None, dpi: int = 120) -> None:
    """[`signed_gap_figure`][laplace_debiased.evaluation.report_figures.signed_gap_figure] written to ``path`` (PNG,
    ``dpi``) without a display (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = signed_gap_figure(panels, title, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def tracking_figure(ctx: ReportContext, doc: ReportDoc, rows: list[TrackedFit]) -> None:
    """[`signed_gap_figure`][laplace_debiased.evaluation.report_figures.signed_gap_figure] of the tracking rows, one
    panel per batch size (ascending, unknown last)."""
    sizes = sorted({batch_of(ctx, t.method) for t in rows}, key=lambda b: (b is None, b or 0))
    panels = {f"b = {b}" if b is not None else "mini-batch fits":
              {ctx.label(t.method): t.curves for t in rows if batch_of(ctx, t.method) == b} for b in sizes}
    n = ctx.setting.get("n_train")
    fig = signed_gap_figure(panels, f"{ctx.test_set}: signed test-NLL gap to the full batch"
                            f"{f' (N = {n:,})' if n else ''}, {LINK_LABELS[ctx.main_link]}; mean ± 1 s.e. over draws",
                            {ctx.label(t.method): ctx.colors[t.method] for t in rows})
    doc.p("Where on the grid each fit errs: the signed gap (positive: a higher test NLL than the full "
          "batch's), mean over draws with a band of ±1 standard error. A gap that every draw shares is a "
          "bias (at small δ, that of the flattest directions' curvature); a band wide against its mean is "
          "the draws' noise.")
    _save(fig, ctx, doc, "tracking_by_delta.png", "signed relative test-NLL gap to the full batch against δ")


def batch_size_figure(ctx: ReportContext, doc: ReportDoc, fits: list[BatchFit]) -> None:
    """The gaps of the batch-size table against b: mean over draws, bars from min to max."""
    import matplotlib.pyplot as plt

    sizes = sorted({f.b for f in fits})
    lines = list(dict.fromkeys(f.record.name for f in fits))
    several_kinds = several_structures(fits)
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, name in enumerate(lines):
        mine = [f for f in fits if f.record.name == name]
        shift = 2 ** (0.04 * (i - (len(lines) - 1) / 2))  # apart on the log axis, so that bars stay visible
        xs = [f.b * shift for f in mine]
        mean = np.array([100 * np.mean(f.gaps) for f in mine])
        lo = mean - [100 * min(f.gaps) for f in mine]
        hi = np.array([100 * max(f.gaps) for f in mine]) - mean
        draws = sorted({len(f.gaps) for f in mine})
        label = fit_name(mine[0], several_kinds) + f" ({'/'.join(map(str, draws))} draws per b)"
        ax.errorbar(xs, mean, yerr=[lo, hi], marker="oDs^v"[i % 5], capsize=4, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_xlabel("batch size b (training points per fit)")
    ax.set_ylabel("largest test-NLL gap to the full batch over δ (%)")
    ax.set_ylim(bottom=0)
    n = ctx.setting.get("n_train")
    ax.set_title("How closely each mini-batch LA tracks the full batch" + (f" (N = {n:,})" if n else "")
                 + "\n(mean over draws; bars: min to max)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save(fig, ctx, doc, "batch_size.png", "largest relative test-NLL gap to the full batch against the batch size")


def link_figure(ctx: ReportContext, doc: ReportDoc) -> None:
    """Test NLL vs prior precision per link approximation: one panel per method."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if len(ctx.links) < 2:
        return
    doc.h("Link approximations compared")
    doc.p("laplace-torch's diagonal probit is fooled by the softmax-invariant all-ones logit "
          "direction: with a large function-space variance along it, every logit is shrunk and "
          "the predictive tends to uniform (NLL → log C at small prior precision). The projected "
          "probit removes that direction first; MC sampling is unaffected by it. One panel per "
          "method, so that no method's curves hide another's.")
    styles = {"probit_projected": "-", "mc": ":", "probit": "--"}
    cols = min(len(ctx.methods), LINK_PANELS_PER_ROW)
    rows = math.ceil(len(ctx.methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows + 0.8), sharey=True,
                             squeeze=False, layout="constrained")
    for ax in axes.flat[len(ctx.methods):]:
        ax.set_visible(False)
    for ax, m in zip(axes.flat, ctx.methods):
        for link in ctx.links:
            vals = mean_by([r for r in ctx.lap if r["method"] == m and r["link"] == link
                             and r["eval_set"] == ctx.test_set], ("prior_precision",), "nll")
            xs = sorted(k[0] for k in vals)
            ax.plot(xs, [np.mean(vals[(x,)]) for x in xs], styles[link], color=ctx.colors[m], lw=1.8,
                    marker="o" if m in ctx.full_batch else None, ms=4)
        if ctx.test_set in ctx.map_rows:
            ax.axhline(ctx.map_rows[ctx.test_set]["nll"], color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("prior precision δ")
        ax.set_title(ctx.label(m), fontsize=10)
    for row in axes:
        row[0].set_ylabel("test NLL (nats), mean over draws")
    proxies = [Line2D([], [], color="0.3", ls=styles[link], lw=1.8, label=LINK_LABELS[link]) for link in ctx.links]
    proxies.append(Line2D([], [], color="k", lw=0.8, label="MAP"))
    fig.legend(handles=proxies, loc="outside lower center", ncol=len(proxies), fontsize=9)
    fig.suptitle(f"Test NLL per link approximation (evaluation set '{ctx.test_set}'; colour: method)")
    _save(fig, ctx, doc, "links.png", "test NLL per link approximation, one panel per method", tight=False)


def _pct(values: list[float]) -> float:
    return 100.0 * float(np.mean(values)) if values else float("nan")


def _reliability_panel(ax, ax_count, rel: dict, label: str, color: str, map_rel: dict | None) -> None:
    edges = np.array(rel["edges"])
    width = np.diff(edges)
    as_array = lambda key, r: np.array([np.nan if a is None else a for a in r[key]], dtype=float)
    ax.bar(edges[:-1], np.nan_to_num(as_array("accuracy", rel)), width=width, align="edge",
           color=color, edgecolor="k", lw=0.5, alpha=0.6, label=label)
    ax_count.bar(edges[:-1], as_array("count", rel), width=width, align="edge", color=color,
                 edgecolor="k", lw=0.5, alpha=0.6, label=label)
    if map_rel is not None:
        centres = edges[:-1] + width / 2
        ax.plot(centres, as_array("accuracy", map_rel), "ks--", ms=3, lw=1, label="MAP")
        ax_count.step(edges, np.append(as_array("count", map_rel), 0), "k--", where="post", lw=1, label="MAP")
    ax.plot([0, 1], [0, 1], ":", color="grey", lw=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax_count.set_yscale("symlog", linthresh=1)
    ax_count.set_xlim(0, 1)
    ax_count.set_xlabel("confidence (top-class probability)")


def reliability_figure(ctx: ReportContext, doc: ReportDoc) -> None:
    """Reliability diagrams with bin counts: one panel per method at its chosen δ, MAP overlaid."""
    import matplotlib.pyplot as plt

    best = ctx.chosen(ctx.main_link)
    map_row = ctx.map_rows.get(ctx.test_set)
    map_rel = map_row.get("reliability") if map_row else None
    panels = []
    for m in ctx.methods:
        row = next((r for r in ctx.lap if m in best and r["method"] == m and r["link"] == ctx.main_link
                    and r["prior_precision"] == best[m] and r["eval_set"] == ctx.test_set
                    and r["repeat"] == 0 and "reliability" in r), None)
        if row is not None:
            panels.append((m, best[m], row))
    if not panels:
        return
    doc.h("Reliability diagrams")
    doc.p(f"Test set, {LINK_LABELS[ctx.main_link]}, each method at its chosen δ ({ctx.choice_note}). "
          "The bars are one draw (the first batch draw, repeat 0); each panel's title gives that draw's "
          "ECE and the mean over all draws, which is what the tables report. Top: accuracy per "
          "confidence bin (MAP as black squares; the dotted diagonal is perfect calibration). Bottom: "
          "how many test points fall in each bin (symmetric log scale; MAP dashed). Bins with few "
          "points carry little weight in the ECE.")
    fig, axes = plt.subplots(2, len(panels), figsize=(3.8 * len(panels), 5.6), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.3]}, sharex="col")
    for j, (m, delta, row) in enumerate(panels):
        _reliability_panel(axes[0][j], axes[1][j], row["reliability"], f"LA, δ = {delta:.3g}",
                           ctx.colors[m], map_rel)
        n = ctx.n_repeats(m)
        mean = _pct(ctx.at(m, delta, ctx.test_set, "ece"))
        ece = f"ECE {100 * row['ece']:.2f} %" + (f" (draw 1 of {n}; mean {mean:.2f} %)" if n > 1 else "")
        map_ece = f"\nMAP ECE {100 * map_row['ece']:.2f} %" if map_row else ""
        axes[0][j].set_title(f"{ctx.label(m)}\n{ece}{map_ece}", fontsize=9)
        axes[0][j].legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("accuracy in bin")
    axes[1][0].set_ylabel("points in bin")
    _save(fig, ctx, doc, "reliability.png", "reliability diagrams with bin counts")


def _severity_points(ctx: ReportContext, m: str, delta: float | None, severities: list[int]) -> tuple[list, list]:
    """Mean AUROC (%) per corruption severity (averaged over the sets of that severity)."""
    xs, ys = [], []
    for sev in severities:
        sets = {r["eval_set"] for r in ctx.rows if r.get("kind") == "corrupted" and r.get("severity") == sev}
        vals = [v for es in sorted(sets) for v in ctx.at(m, delta, es, "auroc")]
        if vals:
            xs.append(sev)
            ys.append(_pct(vals))
    return xs, ys


def auroc_severity_figure(ctx: ReportContext, doc: ReportDoc) -> None:
    """AUROC of detecting shifted inputs vs corruption severity, with the OOD set as last point."""
    import matplotlib.pyplot as plt

    severities = sorted({int(r["severity"]) for r in ctx.rows if r.get("kind") == "corrupted"
                         and r.get("severity") is not None and "auroc" in r})
    if not severities:
        return
    best = ctx.chosen(ctx.main_link)
    ood_x = severities[-1] + 1
    named = ctx.setting.get("severity_ticks", {})
    ticks = {sev: f"{sev}\n{named[str(sev)]}" if str(sev) in named else str(sev)
             for sev in range(severities[0], severities[-1] + 1)}
    if ctx.ood_set is not None:
        ticks[ood_x] = "OOD:\n" + re.sub(r"\s*\(OOD\)$", "", ctx.ood_set)
    corruption = ctx.setting.get("corruption", "corruption")
    doc.h("Shift detection vs corruption severity")
    doc.p(f"AUROC (%) of telling shifted from clean test inputs by the normalised predictive entropy, "
          f"per severity of the {corruption} and for the OOD set; each method at its chosen δ "
          f"({ctx.choice_note}; δ in the legend). The methods' points are set slightly apart "
          "horizontally so that lines with equal values stay visible.")
    shown = ["map", *[m for m in ctx.methods if m in best]]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, m in enumerate(shown):
        delta = None if m == "map" else best[m]
        dx = 0.06 * (i - (len(shown) - 1) / 2)
        xs, ys = _severity_points(ctx, m, delta, severities)
        style = dict(color="k" if m == "map" else ctx.colors[m], marker="s" if m == "map" else "oD^v<>p"[(i - 1) % 7], ms=5)
        label = "MAP" if m == "map" else f"{ctx.label(m)} (δ = {delta:.3g})"
        ax.plot([x + dx for x in xs], ys, "--" if m == "map" else "-", label=label, **style)
        if ctx.ood_set is not None and ctx.at(m, delta, ctx.ood_set, "auroc"):
            ax.plot([ood_x + dx], [_pct(ctx.at(m, delta, ctx.ood_set, "auroc"))], ls="none", **style)
    if ctx.ood_set is not None:
        ax.axvline(ood_x - 0.5, color="grey", lw=0.8)
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set_xlabel(f"{corruption} severity" + ("; right of the line: the OOD set" if ctx.ood_set else ""))
    ax.set_ylabel("AUROC (%), mean over draws")
    ax.set_title("Telling shifted from clean test inputs (predictive entropy)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save(fig, ctx, doc, "auroc_severity.png", "AUROC vs severity")

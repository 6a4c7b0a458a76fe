"""Sweep results -> calibration report folder (``report.md``, ``report.html``, PNG figures).

Figures (matplotlib, Agg backend, headless):

* Figure-6 style: accuracy / NLL / ECE on the test set vs prior precision, one line per method
  (mean over repeats, min-max band), MAP as a horizontal line, full-batch methods as markers;
  one figure per link approximation;
* link comparison: test NLL vs prior precision with the projected probit vs laplace-torch's
  diagonal probit (and MC when swept);
* reliability diagrams at each method's best prior precision;
* OOD AUROC vs corruption severity (when corrupted evaluation sets were swept).

The table lists each method's best prior precision (lowest mean test NLL over repeats with the
report's main link: an oracle choice on the test set, as in the paper's Figure 6) and its metrics.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from laplace_debiased.evaluation.sweep import load_rows

LINK_PREFERENCE = ("probit_projected", "mc", "probit")
LINK_LABELS = {
    "probit_projected": "projected probit (logit-difference subspace)",
    "mc": "Monte-Carlo (linearized sampling)",
    "probit": "laplace-torch diagonal probit",
}
METRICS = ("accuracy", "nll", "ece", "brier")


def _mean_by(rows: list[dict], key_fields: Sequence[str], metric: str) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if metric in r and r[metric] is not None:
            out[tuple(r[k] for k in key_fields)].append(float(r[metric]))
    return out


class _Doc:
    """Blocks rendered to both Markdown and HTML."""

    def __init__(self) -> None:
        self.blocks: list[tuple[str, object]] = []

    def h(self, text: str, level: int = 2) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.blocks.append(("table", (header, rows)))

    def img(self, path: str, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def markdown(self) -> str:
        out = []
        for kind, val in self.blocks:
            if kind == "h":
                out.append("#" * val[0] + " " + val[1])
            elif kind == "p":
                out.append(val)
            elif kind == "table":
                header, rows = val
                out.append("\n".join(
                    ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                    + ["| " + " | ".join(r) + " |" for r in rows]
                ))
            else:
                out.append(f"![{val[1]}]({val[0]})")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
               "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
               "table{border-collapse:collapse}td,th{border:1px solid #999;padding:3px 8px}"
               "img{max-width:100%}</style></head><body>"]
        for kind, val in self.blocks:
            if kind == "h":
                out.append(f"<h{val[0]}>{html.escape(val[1])}</h{val[0]}>")
            elif kind == "p":
                out.append(f"<p>{html.escape(val)}</p>")
            elif kind == "table":
                header, rows = val
                out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in header) + "</tr>"
                           + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
                           + "</table>")
            else:
                out.append(f"<img src='{html.escape(val[0])}' alt='{html.escape(val[1])}'>")
        return "\n".join(out) + "\n</body></html>\n"


def _fmt(values: list[float]) -> str:
    if not values:
        return "–"
    m = float(np.mean(values))
    if len(values) == 1:
        return f"{m:.4g}"
    return f"{m:.4g} [{min(values):.3g}, {max(values):.3g}]"


def chosen_prior_precisions(rows: list[dict], eval_set: str, link: str, criterion: str = "nll") -> dict[str, float]:
    """Per Laplace method: the prior precision chosen on ``eval_set`` with ``link``.

    ``criterion="nll"``: lowest NLL (mean over repeats); ``"log_marglik"``: highest log marginal
    likelihood (mean over repeats; methods without one are left out).
    """
    if criterion not in ("nll", "log_marglik"):
        raise ValueError(f"criterion must be 'nll' or 'log_marglik', got {criterion!r}")
    sign = 1.0 if criterion == "nll" else -1.0
    vals = _mean_by([r for r in rows if r["eval_set"] == eval_set and r["link"] == link and r["method"] != "map"],
                    ("method", "prior_precision"), criterion)
    best: dict[str, tuple[float, float]] = {}
    for (method, delta), v in sorted(vals.items(), key=lambda kv: kv[0][1]):
        m = sign * float(np.mean(v))
        if math.isfinite(m) and (method not in best or m < best[method][1]):
            best[method] = (delta, m)
    return {k: v[0] for k, v in best.items()}


@dataclass
class _Context:
    """What every report step reads: the rows and their derived groupings."""

    rows: list[dict]
    out_dir: Path
    test_set: str
    links: list[str]
    lap: list[dict]  # rows of the Laplace methods (not MAP)
    methods: list[str]
    full_batch: set[str]
    map_rows: dict[str, dict]  # eval set -> MAP row
    colors: dict[str, str]
    val_set: str | None  # the validation set the prior precision is chosen on (None: test, an oracle)
    ood_set: str | None  # the first out-of-distribution set

    @property
    def main_link(self) -> str:
        return self.links[0]

    def chosen(self, link: str, criterion: str = "nll") -> dict[str, float]:
        """Each method's prior precision chosen on the validation set (on test if there is none)."""
        return chosen_prior_precisions(self.rows, self.val_set or self.test_set, link, criterion)

    @property
    def choice_note(self) -> str:
        return (f"δ chosen per method by the lowest mean NLL on the validation set '{self.val_set}'"
                if self.val_set else
                "δ chosen per method by the lowest mean test NLL (an oracle: these results have no "
                "validation set)")

    def at(self, method: str, delta: float | None, eval_set: str, metric: str, link: str | None = None) -> list[float]:
        """``metric`` over repeats for ``method`` at ``delta`` (MAP: ``method="map"``)."""
        link = "map" if method == "map" else (link or self.main_link)
        return [float(r[metric]) for r in self.rows if r["method"] == method and r["eval_set"] == eval_set
                and r["link"] == link and r["prior_precision"] == delta and r.get(metric) is not None]


def _context(results: str | Path | list[dict], out_dir: str | Path) -> _Context:
    """Load and group the rows; refuse results with nothing to report."""
    rows = load_rows(results) if isinstance(results, (str, Path)) else list(results)
    if not rows:
        raise ValueError("no sweep results to report; run `laplace-debiased sweep` first")
    tests = [r["eval_set"] for r in rows if r.get("kind") == "test"]
    if not tests:
        raise ValueError("the results contain no in-distribution ('test') evaluation set")
    links = [l for l in LINK_PREFERENCE if any(r["link"] == l for r in rows)]
    if not links:
        raise ValueError("the results contain only MAP rows; sweep at least one Laplace method")
    lap = [r for r in rows if r["method"] != "map"]
    methods = list(dict.fromkeys(r["method"] for r in lap))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return _Context(
        rows=rows, out_dir=out_dir, test_set=tests[0], links=links, lap=lap, methods=methods,
        full_batch={r["method"] for r in lap if r.get("full_batch")},
        map_rows={r["eval_set"]: r for r in rows if r["method"] == "map"},
        colors={m: f"C{i}" for i, m in enumerate(methods)},
        val_set=next((r["eval_set"] for r in rows if r.get("kind") == "validation"), None),
        ood_set=next((r["eval_set"] for r in rows if r.get("kind") == "ood"), None),
    )


def _save(fig, ctx: _Context, doc: _Doc, name: str, alt: str, tight: bool = True) -> None:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(ctx.out_dir / name, dpi=110)
    plt.close(fig)
    doc.img(name, alt)


def _summary(ctx: _Context, doc: _Doc, title: str) -> None:
    doc.h(title, 1)
    n_rep = {m: len({r["repeat"] for r in ctx.lap if r["method"] == m}) for m in ctx.methods}
    doc.p(f"Test set: {ctx.test_set}. Methods (repeats): "
          + ", ".join(f"{m} ({n_rep[m]})" for m in ctx.methods)
          + f". Main link approximation: {LINK_LABELS[ctx.main_link]}.")


_FIG6_AXES = (("accuracy", 100.0, "test accuracy (%)"), ("nll", 1.0, "test NLL (nats)"),
              ("ece", 100.0, "test ECE (%)"))


def _figure6(ctx: _Context, doc: _Doc) -> None:
    """Figure-6 tracking curves: accuracy / NLL / ECE on the test set vs prior precision, one
    figure per link; mean over repeats with a min-max band, full-batch methods as markers, the
    MAP as a dashed line and each method's chosen δ as a dotted vertical line."""
    import matplotlib.pyplot as plt

    doc.h("Metrics vs prior precision (Figure 6)")
    doc.p("How closely each mini-batch LA tracks the full-batch LA (markers) over the whole grid; "
          "bands span the repeats (batch draws). Dotted verticals: each method's chosen δ.")
    for link in ctx.links:
        chosen = ctx.chosen(link)
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        sub = [r for r in ctx.lap if r["eval_set"] == ctx.test_set and r["link"] == link]
        for ax, (metric, scale, label) in zip(axes, _FIG6_AXES):
            for m in ctx.methods:
                vals = _mean_by([r for r in sub if r["method"] == m], ("prior_precision",), metric)
                if not vals:
                    continue
                xs = sorted(k[0] for k in vals)
                mean = [scale * np.mean(vals[(x,)]) for x in xs]
                if m in ctx.full_batch:
                    ax.plot(xs, mean, "o", color=ctx.colors[m], label=m, markersize=5)
                else:
                    ax.plot(xs, mean, "-", color=ctx.colors[m], label=m)
                    ax.fill_between(xs, [scale * min(vals[(x,)]) for x in xs],
                                    [scale * max(vals[(x,)]) for x in xs], color=ctx.colors[m], alpha=0.2)
                if m in chosen:
                    ax.axvline(chosen[m], color=ctx.colors[m], ls=":", lw=1)
            mr = ctx.map_rows.get(ctx.test_set)
            if mr is not None and metric in mr:
                ax.axhline(scale * mr[metric], color="k", ls="--", lw=1, label="MAP")
            ax.set_xscale("log")
            ax.set_xlabel("prior precision δ")
            ax.set_ylabel(label)
        handles, labels = axes[1].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=9)
        fig.suptitle(f"{ctx.test_set}: {LINK_LABELS[link]}")
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        _save(fig, ctx, doc, f"fig6_{link}.png", f"metrics vs prior precision, {link}", tight=False)


def _link_comparison(ctx: _Context, doc: _Doc) -> None:
    """Test NLL vs prior precision for every link approximation."""
    import matplotlib.pyplot as plt

    if len(ctx.links) < 2:
        return
    doc.h("Link approximations compared")
    doc.p("laplace-torch's diagonal probit is fooled by the softmax-invariant all-ones logit "
          "direction: with a large function-space variance along it, every logit is shrunk and "
          "the predictive tends to uniform (NLL → log C at small prior precision). The projected "
          "probit removes that direction first; MC sampling is unaffected by it.")
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"probit_projected": "-", "mc": ":", "probit": "--"}
    for m in ctx.methods:
        for link in ctx.links:
            vals = _mean_by([r for r in ctx.lap if r["method"] == m and r["link"] == link
                             and r["eval_set"] == ctx.test_set], ("prior_precision",), "nll")
            xs = sorted(k[0] for k in vals)
            ax.plot(xs, [np.mean(vals[(x,)]) for x in xs], styles[link], color=ctx.colors[m],
                    marker="o" if m in ctx.full_batch else None, label=f"{m}, {link}")
    if ctx.test_set in ctx.map_rows:
        ax.axhline(ctx.map_rows[ctx.test_set]["nll"], color="k", ls="--", lw=1, label="MAP")
    ax.set_xscale("log")
    ax.set_xlabel("prior precision")
    ax.set_ylabel("test NLL")
    ax.legend(fontsize=6)
    _save(fig, ctx, doc, "links.png", "NLL per link approximation")


def _pct(values: list[float]) -> float:
    return 100.0 * float(np.mean(values)) if values else float("nan")


def _gain_row(ctx: _Context, label: str, method: str, delta: float | None) -> list[str]:
    """Table cells: test NLL, ECE and OOD AUROC at ``delta``, each with its change from the MAP."""
    cells = [label, "–" if delta is None else f"{delta:.3g}"]
    for metric, scale, unit in (("nll", 1.0, ""), ("ece", 100.0, " pt"), ("auroc", 100.0, " pt")):
        es = ctx.ood_set if metric == "auroc" else ctx.test_set
        if es is None:
            continue
        vals = ctx.at(method, delta, es, metric)
        ref = ctx.at("map", None, es, metric)
        if not vals:
            cells.append("–")
            continue
        v = scale * float(np.mean(vals))
        text = f"{v:.4f}" if metric == "nll" else f"{v:.2f}"
        if method != "map" and ref:
            diff = v - scale * float(np.mean(ref))
            text += f" ({diff:+.4f})" if metric == "nll" else f" ({diff:+.2f}{unit})"
        cells.append(text)
    return cells


def _headline(ctx: _Context, doc: _Doc) -> None:
    """The opening table: MAP vs each LA at its validation-chosen δ (and its marglik δ)."""
    doc.h("MAP vs LA at the chosen δ")
    by_nll = ctx.chosen(ctx.main_link)
    by_ml = (chosen_prior_precisions(ctx.rows, ctx.val_set, ctx.main_link, "log_marglik")
             if ctx.val_set else {})
    header = ["method", "δ", "test NLL (nats; Δ vs MAP)", "test ECE (%; Δ in pt)"]
    if ctx.ood_set is not None:
        header.append(f"AUROC {ctx.ood_set} (%; Δ in pt)")
    table = [_gain_row(ctx, "MAP", "map", None)]
    for m in ctx.methods:
        if m in by_nll:
            table.append(_gain_row(ctx, f"{m}, δ by val. NLL" if ctx.val_set else m, m, by_nll[m]))
        if m in by_ml:
            table.append(_gain_row(ctx, f"{m}, δ by marglik", m, by_ml[m]))
    doc.p(f"{ctx.choice_note}; 'marglik': the highest mean log marginal likelihood of laplace-torch "
          f"(where the structure has one). Link: {LINK_LABELS[ctx.main_link]}. Mean over repeats. "
          "Lower NLL and ECE and higher AUROC are better; ECE and AUROC are in percent and their "
          "changes in percentage points (pt). The AUROC scores telling OOD from clean test inputs "
          "by the normalised predictive entropy.")
    doc.table(header, table)
    grid_of = {m: sorted({r["prior_precision"] for r in ctx.lap if r["method"] == m}) for m in ctx.methods}
    edge = [m for m, d in by_nll.items() if d in (grid_of[m][0], grid_of[m][-1])]
    if edge:
        doc.p(f"Chosen δ on a grid edge (the optimum may lie beyond the grid): {', '.join(edge)}.")
    doc.p(_verdict(ctx, by_nll))


def _verdict(ctx: _Context, chosen: dict[str, float]) -> str:
    """One sentence per method: on which metrics the LA beats the MAP at the chosen δ."""
    parts = []
    for m, d in chosen.items():
        wins, losses = [], []
        for metric, es, better in (("NLL", ctx.test_set, -1), ("ECE", ctx.test_set, -1),
                                   ("OOD AUROC", ctx.ood_set, 1)):
            if es is None:
                continue
            la, ref = ctx.at(m, d, es, metric.split()[-1].lower()), ctx.at("map", None, es, metric.split()[-1].lower())
            if la and ref:
                (wins if better * (np.mean(la) - np.mean(ref)) > 0 else losses).append(metric)
        parts.append(f"{m} beats the MAP on {', '.join(wins) or 'nothing'}"
                     + (f" and not on {', '.join(losses)}" if losses else ""))
    return "At the chosen δ: " + "; ".join(parts) + "." if parts else ""


def _best_table(ctx: _Context, doc: _Doc) -> None:
    """Per link: each method's chosen prior precision and its test metrics."""
    eval_sets = list(dict.fromkeys(r["eval_set"] for r in ctx.rows))
    shift_sets = [e for e in eval_sets if any(r["eval_set"] == e and "auroc" in r for r in ctx.rows)]
    doc.h("Chosen prior precision per method and link")
    for link in ctx.links:
        best = ctx.chosen(link)
        grid_of = {m: [r["prior_precision"] for r in ctx.lap if r["method"] == m] for m in ctx.methods}
        header = ["method", "prior precision", *METRICS] + [f"AUROC {e}" for e in shift_sets]
        table = []
        mr = ctx.map_rows.get(ctx.test_set)
        if mr is not None:
            table.append(["MAP", "–", *[_fmt([mr[k]]) for k in METRICS]]
                         + [_fmt([ctx.map_rows[e]["auroc"]]) if e in ctx.map_rows and "auroc" in ctx.map_rows[e]
                            else "–" for e in shift_sets])
        for m in ctx.methods:
            if m not in best:
                continue
            edge = best[m] in (min(grid_of[m]), max(grid_of[m]))
            table.append([m, f"{best[m]:.3g}" + (" (grid edge)" if edge else ""),
                          *[_fmt(ctx.at(m, best[m], ctx.test_set, k, link)) for k in METRICS]]
                         + [_fmt(ctx.at(m, best[m], e, "auroc", link)) for e in shift_sets])
        doc.p(f"Link: {LINK_LABELS[link]}. Test metrics (accuracy, ECE, AUROC as fractions), mean over "
              f"repeats [min, max]; {ctx.choice_note}.")
        doc.table(header, table)


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


def _reliability(ctx: _Context, doc: _Doc) -> None:
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
    doc.p(f"Test set, {LINK_LABELS[ctx.main_link]}, repeat 0, each method at its chosen δ ({ctx.choice_note}). "
          "Top: accuracy per confidence bin (bars; MAP as black squares; the dotted diagonal is perfect "
          "calibration). Bottom: how many test points fall in each bin (symmetric log scale; MAP dashed). "
          "Bins with few points carry little weight in the ECE.")
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 5.2), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.3]}, sharex="col")
    for j, (m, delta, row) in enumerate(panels):
        _reliability_panel(axes[0][j], axes[1][j], row["reliability"], f"LA, δ = {delta:.3g}",
                           ctx.colors[m], map_rel)
        map_ece = f", MAP {100 * map_row['ece']:.2f} %" if map_row else ""
        axes[0][j].set_title(f"{m}\nECE {100 * row['ece']:.2f} %{map_ece}", fontsize=9)
        axes[0][j].legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("accuracy in bin")
    axes[1][0].set_ylabel("points in bin")
    _save(fig, ctx, doc, "reliability.png", "reliability diagrams with bin counts")


def _auroc_severity(ctx: _Context, doc: _Doc) -> None:
    """AUROC of detecting shifted inputs vs corruption severity, with the OOD set as last point."""
    import matplotlib.pyplot as plt

    severities = sorted({int(r["severity"]) for r in ctx.rows if r.get("kind") == "corrupted"
                         and r.get("severity") is not None and "auroc" in r})
    if not severities:
        return
    best = ctx.chosen(ctx.main_link)
    ood_x = severities[-1] + 1
    ticks = {sev: str(sev) for sev in range(severities[0], severities[-1] + 1)}
    if ctx.ood_set is not None:
        ticks[ood_x] = f"OOD:\n{ctx.ood_set}"
    doc.h("Shift detection vs corruption severity")
    doc.p("AUROC (%) of telling shifted from clean test inputs by the normalised predictive entropy, "
          f"per integer corruption severity and for the OOD set; each method at its chosen δ "
          f"({ctx.choice_note}; δ in the legend).")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in ["map", *ctx.methods]:
        if m != "map" and m not in best:
            continue
        delta = None if m == "map" else best[m]
        xs, ys = [], []
        for sev in severities:
            sets = {r["eval_set"] for r in ctx.rows if r.get("kind") == "corrupted" and r.get("severity") == sev}
            vals = [v for es in sorted(sets) for v in ctx.at(m, delta, es, "auroc")]
            if vals:
                xs.append(sev)
                ys.append(_pct(vals))
        color = "k" if m == "map" else ctx.colors[m]
        label = "MAP" if m == "map" else f"{m} (δ = {delta:.3g})"
        if xs:
            ax.plot(xs, ys, "--s" if m == "map" else "-o", color=color, label=label, ms=5)
        if ctx.ood_set is not None and ctx.at(m, delta, ctx.ood_set, "auroc"):
            ax.plot([ood_x], [_pct(ctx.at(m, delta, ctx.ood_set, "auroc"))], "s" if m == "map" else "o",
                    color=color, ms=6, label=None if xs else label)
    if ctx.ood_set is not None:
        ax.axvline(ood_x - 0.5, color="grey", lw=0.8)
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set_xlabel("corruption severity")
    ax.set_ylabel("AUROC (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save(fig, ctx, doc, "auroc_severity.png", "AUROC vs severity")


def _coverage(ctx: _Context, doc: _Doc) -> None:
    """What each debiased K-FAC fit's curvature covers (first repeat; issue 23): per layer and
    factor the ranks B, B̃ and B ∪ B̃ reach, exact zeros, and the share of weights left with
    only the prior (variance 1/δ, which rules the predictive at small δ)."""
    fits = {}
    for r in ctx.rows:
        if r.get("coverage") and r["method"] not in fits:
            fits[r["method"]] = r["coverage"]
    if not fits:
        return
    doc.h("Curvature coverage")
    doc.p("Per layer and K-FAC factor of each debiased fit (first repeat): the numerical rank of the "
          "factor on B, on B̃ and on B ∪ B̃, the debiased eigenvalues that are zero, those set by the "
          "isotropic completion of B's null space (B̃'s mean curvature there), and the share of the "
          "block's weights whose only curvature is the prior. See docs/wide-layers.md.")
    for method, rows in fits.items():
        doc.p(f"**{method}**")
        doc.table(["layer", "parameter", "factor", "dim.", "rank B", "rank B̃", "rank B ∪ B̃", "zero",
                   "completed", "prior-only weights [%]"],
                  [[str(c["layer"]), c["parameter"], c["factor"], str(c["dimension"]), str(c["rank_B"]),
                    str(c["rank_B~"]), str(c["rank_B∪B~"]), str(c["zero_eigenvalues"]), str(c["completed"]),
                    f"{100 * c['prior_only_share']:.1f}"] for c in rows])


def write_report(results: str | Path | list[dict], out_dir: str | Path, title: str = "Calibration report") -> Path:
    """Write ``report.md``, ``report.html`` and figures into ``out_dir``; returns the Markdown path.

    ``results`` (a results file or its rows) is only read.
    """
    import matplotlib

    matplotlib.use("Agg")
    ctx = _context(results, out_dir)
    doc = _Doc()
    _summary(ctx, doc, title)
    for step in (_headline, _figure6, _link_comparison, _best_table, _reliability, _auroc_severity):
        step(ctx, doc)
    _coverage(ctx, doc)
    md = ctx.out_dir / "report.md"
    md.write_text(doc.markdown())
    (ctx.out_dir / "report.html").write_text(doc.html(title))
    return md

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

    @property
    def main_link(self) -> str:
        return self.links[0]


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
    )


def _save(fig, ctx: _Context, doc: _Doc, name: str, alt: str) -> None:
    import matplotlib.pyplot as plt

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


def _figure6(ctx: _Context, doc: _Doc) -> None:
    """Accuracy / NLL / ECE on the test set vs prior precision, one figure per link."""
    import matplotlib.pyplot as plt

    doc.h("Metrics vs prior precision")
    for link in ctx.links:
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        sub = [r for r in ctx.lap if r["eval_set"] == ctx.test_set and r["link"] == link]
        for ax, metric in zip(axes, ("accuracy", "nll", "ece")):
            for m in ctx.methods:
                vals = _mean_by([r for r in sub if r["method"] == m], ("prior_precision",), metric)
                if not vals:
                    continue
                xs = sorted(k[0] for k in vals)
                mean = [np.mean(vals[(x,)]) for x in xs]
                if m in ctx.full_batch:
                    ax.plot(xs, mean, "o", color=ctx.colors[m], label=m, markersize=5)
                else:
                    ax.plot(xs, mean, "-", color=ctx.colors[m], label=m)
                    ax.fill_between(xs, [min(vals[(x,)]) for x in xs], [max(vals[(x,)]) for x in xs],
                                    color=ctx.colors[m], alpha=0.2)
            mr = ctx.map_rows.get(ctx.test_set)
            if mr is not None and metric in mr:
                ax.axhline(mr[metric], color="k", ls="--", lw=1, label="MAP")
            ax.set_xscale("log")
            ax.set_xlabel("prior precision")
            ax.set_title(metric.upper() if metric != "accuracy" else "accuracy")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{ctx.test_set}: {LINK_LABELS[link]}")
        _save(fig, ctx, doc, f"fig6_{link}.png", f"metrics vs prior precision, {link}")


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


def _best_table(ctx: _Context, doc: _Doc) -> None:
    """Per link: each method's best prior precision and its metrics."""
    eval_sets = list(dict.fromkeys(r["eval_set"] for r in ctx.rows))
    shift_sets = [e for e in eval_sets if any(r["eval_set"] == e and "auroc" in r for r in ctx.rows)]
    doc.h("Best prior precision per method")
    for link in ctx.links:
        best = chosen_prior_precisions(ctx.rows, ctx.test_set, link)
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
            sel = [r for r in ctx.lap if r["method"] == m and r["link"] == link and r["prior_precision"] == best[m]]
            at = lambda e, k: [r[k] for r in sel if r["eval_set"] == e and k in r]
            edge = best[m] in (min(grid_of[m]), max(grid_of[m]))
            table.append([m, f"{best[m]:.3g}" + (" (grid edge)" if edge else ""),
                          *[_fmt(at(ctx.test_set, k)) for k in METRICS]]
                         + [_fmt(at(e, "auroc")) for e in shift_sets])
        doc.p(f"Link: {LINK_LABELS[link]}. Mean over repeats [min, max]; prior precision chosen by "
              "test NLL (oracle, as in Figure 6).")
        doc.table(header, table)


def _reliability(ctx: _Context, doc: _Doc) -> None:
    """Reliability diagrams: MAP and each method at its best prior precision (repeat 0)."""
    import matplotlib.pyplot as plt

    best = chosen_prior_precisions(ctx.rows, ctx.test_set, ctx.main_link)
    panels = [("MAP", ctx.map_rows.get(ctx.test_set))] + [
        (f"{m} (δ={best[m]:.3g})", next((r for r in ctx.lap if r["method"] == m and r["link"] == ctx.main_link
                                         and r["prior_precision"] == best[m] and r["eval_set"] == ctx.test_set
                                         and r["repeat"] == 0), None)) for m in ctx.methods if m in best]
    panels = [(t, r) for t, r in panels if r is not None and "reliability" in r]
    if not panels:
        return
    doc.h("Reliability diagrams")
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.3), squeeze=False)
    for ax, (t, r) in zip(axes[0], panels):
        rel = r["reliability"]
        edges = np.array(rel["edges"])
        acc = np.array([np.nan if a is None else a for a in rel["accuracy"]], dtype=float)
        ax.bar(edges[:-1], np.nan_to_num(acc), width=np.diff(edges), align="edge", edgecolor="k", alpha=0.7)
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set_title(f"{t}\nECE {r['ece']:.3f}", fontsize=8)
        ax.set_xlabel("confidence")
    axes[0][0].set_ylabel("accuracy")
    _save(fig, ctx, doc, "reliability.png", "reliability diagrams")


def _auroc_severity(ctx: _Context, doc: _Doc) -> None:
    """AUROC of detecting corrupted inputs vs corruption severity."""
    import matplotlib.pyplot as plt

    corrupted = [r for r in ctx.rows if r.get("kind") == "corrupted" and "auroc" in r]
    if not corrupted:
        return
    best = chosen_prior_precisions(ctx.rows, ctx.test_set, ctx.main_link)
    doc.h("OOD detection vs corruption severity")
    doc.p("AUROC of telling corrupted from clean test inputs by normalised predictive entropy.")
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ["map", *ctx.methods]:
        sel = [r for r in corrupted if r["method"] == m and (m == "map" or (
            r["link"] == ctx.main_link and r["prior_precision"] == best.get(m)))]
        vals = _mean_by(sel, ("severity",), "auroc")
        xs = sorted(k[0] for k in vals if k[0] is not None)
        if xs:
            ax.plot(xs, [np.mean(vals[(x,)]) for x in xs], "--" if m == "map" else "-o",
                    color="k" if m == "map" else ctx.colors[m], label="MAP" if m == "map" else m)
    ax.set_xlabel("severity")
    ax.set_ylabel("AUROC")
    ax.legend(fontsize=7)
    _save(fig, ctx, doc, "auroc_severity.png", "AUROC vs severity")


def write_report(results: str | Path | list[dict], out_dir: str | Path, title: str = "Calibration report") -> Path:
    """Write ``report.md``, ``report.html`` and figures into ``out_dir``; returns the Markdown path.

    ``results`` (a results file or its rows) is only read.
    """
    import matplotlib

    matplotlib.use("Agg")
    ctx = _context(results, out_dir)
    doc = _Doc()
    _summary(ctx, doc, title)
    for step in (_figure6, _link_comparison, _best_table, _reliability, _auroc_severity):
        step(ctx, doc)
    md = ctx.out_dir / "report.md"
    md.write_text(doc.markdown())
    (ctx.out_dir / "report.html").write_text(doc.html(title))
    return md

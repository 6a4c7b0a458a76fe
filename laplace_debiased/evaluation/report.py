"""Sweep results -> calibration report folder (``report.md``, ``report.html``, PNG figures).

Sections: the setting (data, N, model, each method and evaluation set in words, read from the
main job's ``setting.json``), MAP vs LA at the chosen prior precision δ (with the marginal
likelihood's choice marked and its measured cost stated), NLL and ECE under shift, and figures
(matplotlib, Agg backend, headless):

* Figure-6 style: accuracy / NLL / ECE on the test set vs δ, and a table of each mini-batch
  LA's largest gap to its full-batch reference over the grid (:mod:`.tracking`), one line per method (mean over
  repeats, min-max band), MAP as a horizontal line, full-batch methods as markers; one figure per
  link approximation;
* where on the grid each mini-batch LA errs: its signed test-NLL gap to the full batch vs δ (mean
  over draws, ±1 standard-error band), one panel per batch size, and per method the δ at which
  each draw's gap is largest;
* link comparison: test NLL vs δ per link approximation, one panel per method;
* reliability diagrams at each method's chosen δ;
* shift-detection AUROC vs corruption severity (when corrupted evaluation sets were swept).

δ is chosen per method by the lowest mean NLL on the validation set; results without one fall
back to the test set, and the report says that this is an oracle choice.  Units: NLL in nats,
accuracy, ECE and AUROC in percent (changes in percentage points).
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from laplace_debiased.prior_grid import PriorGrid, check_criterion, choose_prior_precision
from laplace_debiased.evaluation.options import method_key, split_method_key
from laplace_debiased.evaluation.sweep import load_rows
from laplace_debiased.evaluation.tracking import (gap_curves, largest_gaps, max_gap_per_draw, mean_stderr, reference_of,
                                                  where_largest)

#: file next to ``results.jsonl`` with the run's setting in words (written by the main job)
SETTING_NAME = "setting.json"
LINK_PREFERENCE = ("probit_projected", "mc", "probit")
LINK_LABELS = {
    "probit_projected": "projected probit (logit-difference subspace)",
    "mc": "Monte-Carlo (linearized sampling)",
    "probit": "laplace-torch diagonal probit",
}
METRICS = ("accuracy", "nll", "ece", "brier")
#: panels per row of the link comparison (``links.png``); more methods wrap onto further rows
LINK_PANELS_PER_ROW = 4


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
               "table{border-collapse:collapse;margin:0.8em 0}td,th{border:1px solid #999;padding:3px 8px}th{background:#eee}"
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
    likelihood (mean over repeats; methods without one are left out).  The rule, ties included,
    is :func:`~laplace_debiased.prior_grid.choose_prior_precision`.
    """
    check_criterion(criterion)
    vals = _mean_by([r for r in rows if r["eval_set"] == eval_set and r["link"] == link and r["method"] != "map"],
                    ("method", "prior_precision"), criterion)
    means = [(method, delta, float(np.mean(v))) for (method, delta), v in sorted(vals.items(), key=lambda kv: kv[0][1])]
    scores: dict[str, dict[float, float]] = {}
    for method, delta, mean in means:
        scores.setdefault(method, {})[delta] = mean
    # methods in the order their first finite score appears along the grid (the tables' order)
    order = dict.fromkeys(method for method, _, mean in means if math.isfinite(mean))
    return {m: choose_prior_precision(scores[m], criterion) for m in order}


@dataclass
class _Context:
    """What every report step reads: the rows, their derived groupings and the run's setting."""

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
    setting: dict  # the pipeline's setting.json ({} when the results come without one)

    @property
    def main_link(self) -> str:
        return self.links[0]

    def label(self, method: str) -> str:
        """The method in words (its key when the setting does not name it)."""
        return "MAP" if method == "map" else self.setting.get("methods", {}).get(method, {}).get("label", method)

    def chosen(self, link: str, criterion: str = "nll") -> dict[str, float]:
        """Each method's prior precision chosen on the validation set (on test if there is none)."""
        return chosen_prior_precisions(self.rows, self.val_set or self.test_set, link, criterion)

    def grid(self, method: str) -> PriorGrid:
        """The prior precisions of ``method``'s rows."""
        return PriorGrid(tuple(sorted({r["prior_precision"] for r in self.lap if r["method"] == method})))

    def n_repeats(self, method: str) -> int:
        return len({r["repeat"] for r in self.lap if r["method"] == method})

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


def _read_setting(results: str | Path | list[dict], setting: dict | None) -> dict:
    """``setting``, else the ``setting.json`` next to a results file, else ``{}``."""
    if setting is not None or not isinstance(results, (str, Path)):
        return dict(setting or {})
    path = Path(results).with_name(SETTING_NAME)
    return json.loads(path.read_text()) if path.is_file() else {}


def _context(results: str | Path | list[dict], out_dir: str | Path, setting: dict | None = None) -> _Context:
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
        setting=_read_setting(results, setting),
    )


def _save(fig, ctx: _Context, doc: _Doc, name: str, alt: str, tight: bool = True) -> None:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(ctx.out_dir / name, dpi=110)
    plt.close(fig)
    doc.img(name, alt)


def _summary(ctx: _Context, doc: _Doc, title: str) -> None:
    """The title and the setting: data, N, model, the methods and the evaluation sets in words."""
    doc.h(title, 1)
    doc.h("Setting")
    st = ctx.setting
    if st:
        weights = "all weights" if st.get("subset") == "all" else "the last layer's weights"
        doc.p(f"Data: {st['data']}, N = {st['n_train']:,} training points. Model: {st['model']} "
              f"({st['n_params']:,} parameters), trained to a MAP estimate; every Laplace approximation "
              f"(LA) covers {weights}.")
    else:
        doc.p(f"These results come without a {SETTING_NAME} (the main job writes one next to "
              "results.jsonl), so the data, N and batch sizes are not known here; methods and "
              "evaluation sets appear under their recorded names.")
    described = st.get("methods", {})
    doc.table(["method", "what it is", "draws", "key"],
              [[ctx.label(m), described.get(m, {}).get("description", "–"), str(ctx.n_repeats(m)), m]
               for m in ctx.methods])
    sets = list(dict.fromkeys(r["eval_set"] for r in ctx.rows))
    doc.table(["evaluation set", "what it is"], [[e, st.get("eval_sets", {}).get(e, "–")] for e in sets])
    doc.p(f"Main link approximation: {LINK_LABELS[ctx.main_link]}; {ctx.choice_note}. Units: NLL in "
          "nats, accuracy, ECE and AUROC in percent, their changes in percentage points (pt); the "
          "Brier score is a fraction.")


_FIG6_AXES = (("accuracy", 100.0, "test accuracy (%)"), ("nll", 1.0, "test NLL (nats)"),
              ("ece", 100.0, "test ECE (%)"))


def _chosen_lines(ax, ctx: _Context, chosen: dict[str, float]) -> None:
    """One dotted vertical per distinct chosen δ, labelled with the methods that chose it (so
    lines that would sit on top of each other are one line with one legend entry)."""
    by_delta: dict[float, list[str]] = defaultdict(list)
    for m, d in chosen.items():
        by_delta[d].append(m)
    for d, ms in sorted(by_delta.items()):
        who = "all methods" if len(ms) == len(ctx.methods) > 1 else ", ".join(ctx.label(m) for m in ms)
        ax.axvline(d, color=ctx.colors[ms[0]] if len(ms) == 1 else "0.35", ls=":", lw=1.5,
                   label=f"chosen δ = {d:.3g} ({who})")


def _figure6_panel(ax, ctx: _Context, sub: list[dict], metric: str, scale: float) -> None:
    for m in ctx.methods:
        vals = _mean_by([r for r in sub if r["method"] == m], ("prior_precision",), metric)
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


def _figure6(ctx: _Context, doc: _Doc) -> None:
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


@dataclass
class _Tracked:
    """One mini-batch method against the full-batch LA of its structure, on the test set."""

    method: str
    reference: str
    curves: dict[int, dict[float, float]]  # per draw: δ -> signed relative test-NLL gap (a fraction)
    ece: list[float]  # per draw: the largest absolute ECE gap over δ (a fraction)

    @property
    def nll(self) -> list[float]:
        """Per draw: the largest relative test-NLL gap over δ (a fraction)."""
        return largest_gaps(self.curves)


def _tracking_rows(ctx: _Context) -> list[_Tracked]:
    """Each mini-batch method with a full-batch reference: its signed NLL gaps per draw and δ, and
    its largest ECE gaps, on the test set over the whole grid."""
    out = []
    for m in ctx.methods:
        ref = None if m in ctx.full_batch else reference_of(m, sorted(ctx.full_batch))
        if ref is not None:
            out.append(_Tracked(m, ref, gap_curves(ctx.lap, m, ref, ctx.test_set, ctx.main_link, "nll"),
                                max_gap_per_draw(ctx.lap, m, ref, ctx.test_set, ctx.main_link, "ece", False)))
    return out


def _samples(ctx: _Context, method: str) -> int | None:
    return ctx.setting.get("methods", {}).get(method, {}).get("samples")


def _tracking_verdict(ctx: _Context, nll_gap: dict[str, float]) -> str:
    """Whether each debiased method tracks its reference more closely than the single batch of
    its structure with the same number of samples, and what that depends on."""
    sentences, explained = [], set()
    two_batch = tuple(f"_{role}" for role in _FIT_ROLES if role != "single")
    for deb in (m for m in nll_gap if split_method_key(m)[0].endswith(two_batch)):
        base, size = split_method_key(deb)
        single = method_key(base.rsplit("_", 1)[0] + "_single", size)
        if single not in nll_gap or _samples(ctx, deb) != _samples(ctx, single):
            continue
        closer = nll_gap[deb] < nll_gap[single]
        sentences.append(f"{ctx.label(deb)} tracks the full batch {'more' if closer else 'less'} closely "
                         f"than {ctx.label(single)} with the same samples ({100 * nll_gap[deb]:.1f} % against "
                         f"{100 * nll_gap[single]:.1f} %).")
        b, n = _samples(ctx, single), ctx.setting.get("n_train")
        if not closer and b and n and b not in explained:
            explained.add(b)
            sentences.append(f"Here one batch is {b} of N = {n:,} training points ({100 * b / n:.0f} %): a single "
                             "batch that large carries little bias, while B chooses the directions from half "
                             "its samples. Debiasing is for b ≪ N (the paper: 1,024 of 40,000 images); see the "
                             "CIFAR-10 results in the documentation's benchmarks page.")
    return " ".join(sentences)


def _tracking(ctx: _Context, doc: _Doc) -> None:
    """The Figure-6 criterion as a table: per mini-batch method the largest gap to its
    full-batch reference over the whole grid, per draw, where on the grid it lies, whether
    debiasing helped, and a figure of the signed gaps over δ."""
    rows = _tracking_rows(ctx)
    if not rows:
        return
    doc.h("Tracking the full batch over the whole grid")
    doc.p(f"Per draw, the largest gap over all prior precisions between a mini-batch LA and the "
          f"full-batch LA of its structure on the test set ({LINK_LABELS[ctx.main_link]}): test NLL "
          "relative to the full batch (%), ECE in percentage points. Mean over draws [min, max]; last "
          "column: the δ at which each draw's NLL gap is largest (δ: draws).")
    doc.table(["method", "samples", "draws", "max rel. NLL gap (%)", "max ECE gap (pt)", "at δ (draws)"],
              [[ctx.label(t.method), f"{_samples(ctx, t.method) or '–'}", str(len(t.curves)),
                _fmt([100 * g for g in t.nll]), _fmt([100 * g for g in t.ece]),
                ", ".join(f"{d:.3g}: {k}" for d, k in where_largest(t.curves).items())] for t in rows])
    verdict = _tracking_verdict(ctx, {t.method: float(np.mean(t.nll)) for t in rows})
    if verdict:
        doc.p(verdict)
    _tracking_figure(ctx, doc, rows)


def mean_stderr_text(values, digits: int = 2) -> str:
    """``+mean ± standard error`` of per-draw values (:func:`~laplace_debiased.evaluation.tracking.mean_stderr`),
    ``digits`` decimals, the mean signed."""
    mean, se = mean_stderr(values)
    return f"{mean:+.{digits}f} ± {se:.{digits}f}"


def signed_gap_figure(panels: dict[str, dict[str, dict[int, dict[float, float]]]], title: str,
                      colors: dict[str, str] | None = None):
    """A matplotlib figure of signed gap curves, one panel per key of ``panels`` (side by side, shared
    y axis): per label its :func:`~laplace_debiased.evaluation.tracking.gap_curves` output
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
    """:func:`signed_gap_figure` written to ``path`` (PNG, ``dpi``) without a display (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = signed_gap_figure(panels, title, colors)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _tracking_figure(ctx: _Context, doc: _Doc, rows: list[_Tracked]) -> None:
    """:func:`signed_gap_figure` of the tracking rows, one panel per batch size (ascending, unknown last)."""
    sizes = sorted({_batch_of(ctx, t.method) for t in rows}, key=lambda b: (b is None, b or 0))
    panels = {f"b = {b}" if b is not None else "mini-batch fits":
              {ctx.label(t.method): t.curves for t in rows if _batch_of(ctx, t.method) == b} for b in sizes}
    n = ctx.setting.get("n_train")
    fig = signed_gap_figure(panels, f"{ctx.test_set}: signed test-NLL gap to the full batch"
                            f"{f' (N = {n:,})' if n else ''}, {LINK_LABELS[ctx.main_link]}; mean ± 1 s.e. over draws",
                            {ctx.label(t.method): ctx.colors[t.method] for t in rows})
    doc.p("Where on the grid each fit errs: the signed gap (positive: a higher test NLL than the full "
          "batch's), mean over draws with a band of ±1 standard error. A gap that every draw shares is a "
          "bias (at small δ, that of the flattest directions' curvature); a band wide against its mean is "
          "the draws' noise.")
    _save(fig, ctx, doc, "tracking_by_delta.png", "signed relative test-NLL gap to the full batch against δ")


#: the mini-batch fits of the batch-size section, by the method's suffix, in table order
_FIT_ROLES = ("single", "debiased", "corrected", "shrunk", "stein")
_STRUCTURE_NAMES = {"kron": "K-FAC", "ekfac": "EKFAC", "lowrank": "low-rank"}


@dataclass
class _BatchFit:
    """One mini-batch method at one batch size, against the full batch of its structure."""

    method: str  # the rows' name (``kron_single@b32``)
    kind: str  # the structure (``kron``)
    role: str  # one of ``_FIT_ROLES``
    b: int
    reference: str
    gaps: list[float]  # per draw: the largest relative test-NLL gap over δ (a fraction)


def _batch_of(ctx: _Context, method: str) -> int | None:
    """The batch size of ``method``: from its name, its rows' ``batch_size`` or the setting."""
    b = split_method_key(method)[1]
    if b is None:
        b = next((r["batch_size"] for r in ctx.lap if r["method"] == method and r.get("batch_size")), None)
    if b is None:
        b = ctx.setting.get("methods", {}).get(method, {}).get("batch_size")
    return None if b is None else int(b)


def _batch_fits(ctx: _Context) -> list[_BatchFit]:
    """The single, paper (``*_debiased``), corrected and shrunk fits with a batch size and a full-batch
    reference, ordered by structure, b and role."""
    fits = []
    for m in ctx.methods:
        kind, _, role = split_method_key(m)[0].partition("_")
        ref = None if m in ctx.full_batch else reference_of(m, sorted(ctx.full_batch))
        b = _batch_of(ctx, m)
        if role in _FIT_ROLES and ref is not None and b is not None:
            gaps = max_gap_per_draw(ctx.lap, m, ref, ctx.test_set, ctx.main_link, "nll", True)
            if gaps:
                fits.append(_BatchFit(m, kind, role, b, ref, gaps))
    kinds = list(dict.fromkeys(f.kind for f in fits))
    return sorted(fits, key=lambda f: (kinds.index(f.kind), f.b, _FIT_ROLES.index(f.role)))


def _fit_name(fit: _BatchFit, several_kinds: bool) -> str:
    """The fit in a few words: "single batch", "paper's split", "corrected split", "shrunk split" (with the
    structure first when the results hold several)."""
    name = {"single": "single batch", "debiased": "paper's split" if fit.kind == "kron" else "debiased split",
            "corrected": "corrected split", "shrunk": "shrunk split (default)", "stein": "James-Stein split"}[fit.role]
    return f"{_STRUCTURE_NAMES.get(fit.kind, fit.kind)} {name}" if several_kinds else name


def _range(values: list[float]) -> str:
    """``[min, max]`` of fractions, in percent."""
    return f"[{100 * min(values):.2f}, {100 * max(values):.2f}] %"


def _batch_verdict(fits: list[_BatchFit], several_kinds: bool, n_train: int | None) -> str:
    """Per structure and b: which fit tracked the full batch best (lowest mean largest gap),
    whether its range over draws lies below the others' (the difference exceeds the spread over
    draws) or overlaps them; then at which b a two-batch fit, and at which the single batch, was best."""
    sentences, outcome = [], defaultdict(list)
    for key in dict.fromkeys((f.kind, f.b) for f in fits):
        group = sorted((f for f in fits if (f.kind, f.b) == key), key=lambda f: float(np.mean(f.gaps)))
        best, others = group[0], group[1:]
        single = next((o for o in others if o.role == "single"), None)
        if best.role == "single":
            outcome["single"].append(best.b)
        elif single is not None and len(single.gaps) > 1 and max(best.gaps) < min(single.gaps):
            outcome["helped"].append(best.b)
        else:
            outcome["unclear"].append(best.b)
        text = (f"At b = {best.b}, the {_fit_name(best, several_kinds)} tracked the full batch best: its largest test-NLL gap is "
                f"{100 * np.mean(best.gaps):.2f} % on average over {len(best.gaps)} "
                f"draw{'s' if len(best.gaps) > 1 else ''}")
        if not others:
            sentences.append(text + ".")
            continue
        text += ", against " + ", ".join(f"{100 * np.mean(o.gaps):.2f} % for the {_fit_name(o, several_kinds)}"
                                         for o in others) + "."
        if len(best.gaps) < 2 or any(len(o.gaps) < 2 for o in others):
            text += " With a single draw the spread over draws is unknown, so this order may be chance."
        else:
            below = [o for o in others if max(best.gaps) < min(o.gaps)]
            overlap = [o for o in others if o not in below]
            parts = []
            if below:
                parts.append(f"its range over draws {_range(best.gaps)} lies below that of "
                             + " and ".join(f"the {_fit_name(o, several_kinds)} {_range(o.gaps)}" for o in below)
                             + ", a difference that exceeds the spread over draws")
            if overlap:
                parts.append(("it" if below else f"its range over draws {_range(best.gaps)}") + " overlaps that of "
                             + " and ".join(f"the {_fit_name(o, several_kinds)} {_range(o.gaps)}" for o in overlap)
                             + ", a difference within the spread over draws")
            joined = "; ".join(parts)
            text += f" {joined[0].upper()}{joined[1:]}."
        sentences.append(text)

    def share(sizes: list[int]) -> str:
        return " and ".join(f"{b} ({100 * b / n_train:.0f} % of N = {n_train:,})" if n_train else str(b)
                            for b in sorted(set(sizes)))

    parts = []
    if outcome["helped"]:
        parts.append(f"debiasing helped at b = {share(outcome['helped'])}")
    if outcome["unclear"]:
        parts.append(f"a two-batch fit was closest at b = {share(outcome['unclear'])}, but not beyond the single "
                     "batch's spread over draws")
    if outcome["single"]:
        parts.append(f"the single batch was closest at b = {share(outcome['single'])}, where a single batch "
                     "is already close and a split into halves costs more than the bias it removes")
    sentences.append("So " + "; ".join(parts) + ".")
    return " ".join(sentences)


def _batch_sizes(ctx: _Context, doc: _Doc) -> None:
    """Where debiasing helps: per batch size b, each mini-batch fit's largest relative test-NLL
    gap to the full batch over the δ grid and its test NLL at the chosen δ, a figure of the gaps
    against b, and sentences generated from them.  Only for results with two or more b."""
    fits = _batch_fits(ctx)
    if len({f.b for f in fits}) < 2:
        return
    several_kinds = len({f.kind for f in fits}) > 1
    chosen = ctx.chosen(ctx.main_link)
    doc.h("Batch size: where debiasing helps")
    n = ctx.setting.get("n_train")
    doc.p(f"Each mini-batch LA at each batch size b (training points per fit: one batch of b, or two of b/2) "
          f"against the full-batch LA of its structure{f' (all N = {n:,} training points)' if n else ''}, on the "
          f"test set ({LINK_LABELS[ctx.main_link]}). Gap: per draw, the largest test-NLL difference to the full "
          "batch over all prior precisions δ, relative to the full batch's NLL (%); mean over draws [min, max]. "
          f"Test NLL in nats at the chosen δ ({ctx.choice_note}); mean over draws [min, max].")

    def nll_at(m: str) -> list[str]:
        d = chosen.get(m)
        return ["–", "–"] if d is None else [f"{d:.3g}", _fmt(ctx.at(m, d, ctx.test_set, "nll"))]

    table = []
    for kind in dict.fromkeys(f.kind for f in fits):
        for f in (f for f in fits if f.kind == kind):
            table.append([str(f.b), ctx.label(f.method), str(len(f.gaps)), _fmt([100 * g for g in f.gaps]),
                          *nll_at(f.method)])
        ref = next(f.reference for f in fits if f.kind == kind)
        table.append([f"all ({n:,})" if n else "all", ctx.label(ref), str(ctx.n_repeats(ref)), "0 (the reference)",
                      *nll_at(ref)])
    doc.table(["b (training points per fit)", "fit", "draws", "max rel. test-NLL gap to the full batch (%)",
               "chosen δ", "test NLL at chosen δ (nats)"], table)
    _batch_figure(ctx, doc, fits, several_kinds)
    doc.p(_batch_verdict(fits, several_kinds, n))


def _batch_figure(ctx: _Context, doc: _Doc, fits: list[_BatchFit], several_kinds: bool) -> None:
    """The gaps of the batch-size table against b: mean over draws, bars from min to max."""
    import matplotlib.pyplot as plt

    sizes = sorted({f.b for f in fits})
    lines = list(dict.fromkeys((f.kind, f.role) for f in fits))
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, (kind, role) in enumerate(lines):
        mine = [f for f in fits if (f.kind, f.role) == (kind, role)]
        shift = 2 ** (0.04 * (i - (len(lines) - 1) / 2))  # apart on the log axis, so that bars stay visible
        xs = [f.b * shift for f in mine]
        mean = np.array([100 * np.mean(f.gaps) for f in mine])
        lo = mean - [100 * min(f.gaps) for f in mine]
        hi = np.array([100 * max(f.gaps) for f in mine]) - mean
        draws = sorted({len(f.gaps) for f in mine})
        label = _fit_name(mine[0], several_kinds) + f" ({'/'.join(map(str, draws))} draws per b)"
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


def _link_comparison(ctx: _Context, doc: _Doc) -> None:
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
            vals = _mean_by([r for r in ctx.lap if r["method"] == m and r["link"] == link
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


#: (metric, scale, decimals, unit of the change) of the headline and shift tables
_CELL = {"nll": (1.0, 4, ""), "ece": (100.0, 2, " pt"), "auroc": (100.0, 2, " pt"),
         "accuracy": (100.0, 2, " pt"), "brier": (1.0, 4, "")}


def _cell(ctx: _Context, method: str, delta: float | None, eval_set: str, metric: str) -> str:
    """Mean over repeats at ``delta`` and, for an LA, its change from the MAP."""
    scale, dec, unit = _CELL[metric]
    vals, ref = ctx.at(method, delta, eval_set, metric), ctx.at("map", None, eval_set, metric)
    if not vals:
        return "–"
    v = scale * float(np.mean(vals))
    text = f"{v:.{dec}f}"
    if method != "map" and ref:
        text += f" ({v - scale * float(np.mean(ref)):+.{dec}f}{unit})"
    return text


def _gain_row(ctx: _Context, label: str, method: str, delta: float | None) -> list[str]:
    """Table cells: test NLL, ECE and OOD AUROC at ``delta``, each with its change from the MAP."""
    cells = [label, "–" if delta is None else f"{delta:.3g}"]
    cells += [_cell(ctx, method, delta, ctx.test_set, "nll"), _cell(ctx, method, delta, ctx.test_set, "ece")]
    if ctx.ood_set is not None:
        cells.append(_cell(ctx, method, delta, ctx.ood_set, "auroc"))
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
            table.append(_gain_row(ctx, f"{ctx.label(m)}, δ by val. NLL" if ctx.val_set else ctx.label(m),
                                   m, by_nll[m]))
        if m in by_ml:
            table.append(_gain_row(ctx, f"⚠ {ctx.label(m)}, δ by marglik", m, by_ml[m]))
    doc.p(f"{ctx.choice_note}; '⚠ … marglik': δ of the highest mean log marginal likelihood of "
          f"laplace-torch (where the structure has one), shown for comparison. Link: "
          f"{LINK_LABELS[ctx.main_link]}. Mean over draws. Lower NLL and ECE and higher AUROC are "
          "better. AUROC: how well the normalised predictive entropy tells the OOD inputs from the "
          "clean test inputs (50 % is chance).")
    doc.table(header, table)
    edge = [ctx.label(m) for m, d in by_nll.items() if ctx.grid(m).on_edge(d)]
    if edge:
        doc.p(f"Chosen δ on a grid edge (the optimum may lie beyond the grid): {', '.join(edge)}.")
    doc.p(_verdict(ctx, by_nll, "validation NLL" if ctx.val_set else "test NLL (oracle)"))
    if by_ml:
        doc.p("⚠ " + _verdict(ctx, by_ml, "marginal likelihood") + _marglik_warning(ctx, by_ml))


def _marglik_warning(ctx: _Context, by_ml: dict[str, float]) -> str:
    """The measured cost of choosing δ by the marginal likelihood, where the LA loses to the MAP."""
    ref = ctx.at("map", None, ctx.test_set, "nll")
    worse = {m: float(np.mean(ctx.at(m, d, ctx.test_set, "nll"))) for m, d in by_ml.items()
             if ref and ctx.at(m, d, ctx.test_set, "nll")
             and np.mean(ctx.at(m, d, ctx.test_set, "nll")) > np.mean(ref)}
    if not worse:
        return ""
    who = "every LA" if len(worse) == len(by_ml) > 1 else ", ".join(ctx.label(m) for m in worse)
    deltas = ", ".join(sorted({f"{by_ml[m]:.3g}" for m in worse}))
    return (f" Warning: with δ from the marginal likelihood (δ = {deltas}) {who} is worse than the MAP "
            f"network in test NLL here ({min(worse.values()):.3f}–{max(worse.values()):.3f} nats against "
            f"the MAP's {np.mean(ref):.3f}). Choose δ by validation NLL.")


def _verdict(ctx: _Context, chosen: dict[str, float], how: str) -> str:
    """One sentence per method: on which metrics the LA beats the MAP at the chosen δ."""
    parts = []
    for m, d in chosen.items():
        wins, losses = [], []
        for name, metric, es, better in (("NLL", "nll", ctx.test_set, -1), ("ECE", "ece", ctx.test_set, -1),
                                         ("OOD AUROC", "auroc", ctx.ood_set, 1)):
            if es is None:
                continue
            la, ref = ctx.at(m, d, es, metric), ctx.at("map", None, es, metric)
            if la and ref:
                (wins if better * (np.mean(la) - np.mean(ref)) > 0 else losses).append(name)
        parts.append(f"{ctx.label(m)} beats the MAP on {', '.join(wins) or 'nothing'}"
                     + (f" and not on {', '.join(losses)}" if losses else ""))
    return f"At the δ chosen by {how}: " + "; ".join(parts) + "." if parts else ""


def _shift_tables(ctx: _Context, doc: _Doc) -> None:
    """NLL and ECE on every labelled evaluation set (clean and corrupted) at the chosen δ."""
    sets = [e for e in dict.fromkeys(r["eval_set"] for r in ctx.rows
                                     if r.get("kind") in ("test", "corrupted")) if e in ctx.map_rows]
    if len(sets) < 2:
        return
    chosen = ctx.chosen(ctx.main_link)
    doc.h("NLL and ECE under shift")
    doc.p(f"Each method at its chosen δ ({ctx.choice_note}), {LINK_LABELS[ctx.main_link]}, mean over "
          "draws, change from the MAP in brackets. The evaluation sets are described under Setting.")
    for metric, unit in (("nll", "NLL (nats)"), ("ece", "ECE (%; Δ in pt)")):
        rows = [["MAP", "–", *[_cell(ctx, "map", None, e, metric) for e in sets]]]
        rows += [[ctx.label(m), f"{chosen[m]:.3g}", *[_cell(ctx, m, chosen[m], e, metric) for e in sets]]
                 for m in ctx.methods if m in chosen]
        doc.table([f"{unit}", "δ", *sets], rows)


_BEST_COLUMNS = (("accuracy", "accuracy (%)"), ("nll", "NLL (nats)"), ("ece", "ECE (%)"), ("brier", "Brier"))


def _best_table(ctx: _Context, doc: _Doc) -> None:
    """Per link: each method's chosen prior precision and its test metrics."""
    shift_sets = [e for e in dict.fromkeys(r["eval_set"] for r in ctx.rows)
                  if any(r["eval_set"] == e and "auroc" in r for r in ctx.rows)]
    doc.h("Chosen prior precision per method and link")
    for link in ctx.links:
        best = ctx.chosen(link)
        header = ["method", "δ", *(f"test {h}" for _, h in _BEST_COLUMNS)] + [f"AUROC {e} (%)" for e in shift_sets]
        scale = {"accuracy": 100.0, "ece": 100.0, "auroc": 100.0}
        pct = lambda vals, k: [scale.get(k, 1.0) * v for v in vals]  # noqa: E731
        table = []
        if ctx.test_set in ctx.map_rows:
            table.append(["MAP", "–", *[_fmt(pct(ctx.at("map", None, ctx.test_set, k), k)) for k, _ in _BEST_COLUMNS]]
                         + [_fmt(pct(ctx.at("map", None, e, "auroc"), "auroc")) for e in shift_sets])
        for m in ctx.methods:
            if m not in best:
                continue
            edge = ctx.grid(m).on_edge(best[m])
            table.append([ctx.label(m), f"{best[m]:.3g}" + (" (grid edge)" if edge else ""),
                          *[_fmt(pct(ctx.at(m, best[m], ctx.test_set, k, link), k)) for k, _ in _BEST_COLUMNS]]
                         + [_fmt(pct(ctx.at(m, best[m], e, "auroc", link), "auroc")) for e in shift_sets])
        doc.p(f"Link: {LINK_LABELS[link]}. Mean over draws [min, max]; {ctx.choice_note}.")
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


def _severity_points(ctx: _Context, m: str, delta: float | None, severities: list[int]) -> tuple[list, list]:
    """Mean AUROC (%) per corruption severity (averaged over the sets of that severity)."""
    xs, ys = [], []
    for sev in severities:
        sets = {r["eval_set"] for r in ctx.rows if r.get("kind") == "corrupted" and r.get("severity") == sev}
        vals = [v for es in sorted(sets) for v in ctx.at(m, delta, es, "auroc")]
        if vals:
            xs.append(sev)
            ys.append(_pct(vals))
    return xs, ys


def _auroc_severity(ctx: _Context, doc: _Doc) -> None:
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


def _first_records(ctx: _Context, key: str) -> dict[str, list[dict]]:
    """Per method, the per-factor records a sweep stored under ``key`` with its first fit."""
    fits: dict[str, list[dict]] = {}
    for r in ctx.rows:
        if r.get(key) and r["method"] not in fits:
            fits[r["method"]] = r[key]
    return fits


def _coverage(ctx: _Context, doc: _Doc) -> None:
    """What each debiased K-FAC fit's curvature covers (first repeat): per layer and
    factor the ranks B, B̃ and B ∪ B̃ reach, exact zeros, and the share of weights left with
    only the prior (variance 1/δ, which rules the predictive at small δ)."""
    fits = _first_records(ctx, "coverage")
    if not fits:
        return
    doc.h("Curvature coverage")
    doc.p("Per layer and K-FAC factor of each debiased fit (first repeat): the numerical rank of the "
          "factor on B, on B̃ and on B ∪ B̃, the debiased eigenvalues that are zero, those set by the "
          "isotropic completion of B's null space (B̃'s mean curvature there), the share of the "
          "block's weights whose only curvature is the prior, and the part of it that more samples would "
          "cover (the rest is the curvature's own, e.g. dead units: the full-batch fit has it too). "
          "See docs/wide-layers.md.")
    for method, rows in fits.items():
        doc.p(f"**{method}**")
        doc.table(["layer", "parameter", "factor", "dim.", "rank B", "rank B̃", "rank B ∪ B̃", "zero",
                   "completed", "prior-only weights [%]", "of which sample-limited [%]"],
                  [[str(c["layer"]), c["parameter"], c["factor"], str(c["dimension"]), str(c["rank_B"]),
                    str(c["rank_B~"]), str(c["rank_B∪B~"]), str(c["zero_eigenvalues"]), str(c["completed"]),
                    f"{100 * c['prior_only_share']:.1f}",
                    f"{100 * c['sample_limited_share']:.1f}" if "sample_limited_share" in c else "–"]
                   for c in rows])


def _correction(ctx: _Context, doc: _Doc) -> None:
    """What each corrected or shrunk K-FAC fit changed (first repeat): per layer and factor, how far
    the correction moved the spectrum of the single batch B ∪ B̃, with the standard error from the
    two orders of the batches and the share of the correction kept on the range."""
    fits = _first_records(ctx, "correction")
    if not fits:
        return
    doc.h("What the corrected estimate changed")
    doc.p("Per layer and K-FAC factor of each corrected or shrunk fit (first repeat): the relative change "
          "‖λ̂ − λ‖ / ‖λ‖ of the eigenvalues λ of the single batch B ∪ B̃ (the same samples) that the "
          "regression-to-the-mean correction made, its standard error from the two orders of B and "
          "B̃, and the share of the correction kept on the range of B ∪ B̃ (100 % for the corrected fit; "
          "the shrunk fit keeps less where the two orders disagree, 0 % where they disagree as much as "
          "they correct: the single batch there). Directions B ∪ B̃ does not reach keep the whole correction.")
    for method, rows in fits.items():
        doc.p(f"**{method}**")
        doc.table(["layer", "parameter", "factor", "change [%]", "± s.e. [%]", "kept [%]"],
                  [[str(c["layer"]), c["parameter"], c["factor"], f"{100 * c['change']:.1f}",
                    f"{100 * c['stderr']:.1f}", f"{100 * c.get('kept', 1.0):.0f}"] for c in rows])


def write_report(results: str | Path | list[dict], out_dir: str | Path, title: str = "Calibration report",
                 setting: dict | None = None) -> Path:
    """Write ``report.md``, ``report.html`` and figures into ``out_dir``.

    Args:
        results: A results file or its rows; only read.
        out_dir: The folder the report is written into.
        title: The report's title.
        setting: The run's setting in words
            (:func:`laplace_debiased.evaluation.pipeline.describe_setting`); by default the
            ``setting.json`` next to a results file, if there is one.

    Returns:
        The path of ``report.md``.
    """
    import matplotlib

    matplotlib.use("Agg")
    ctx = _context(results, out_dir, setting)
    doc = _Doc()
    _summary(ctx, doc, title)
    for step in (_headline, _batch_sizes, _shift_tables, _figure6, _tracking, _link_comparison, _best_table, _reliability, _auroc_severity):
        step(ctx, doc)
    _coverage(ctx, doc)
    _correction(ctx, doc)
    md = ctx.out_dir / "report.md"
    md.write_text(doc.markdown())
    (ctx.out_dir / "report.html").write_text(doc.html(title))
    return md

"""What a calibration report reads and writes into: the result rows grouped
([`ReportContext`][laplace_debiased.evaluation.report_data.ReportContext]), the prior precision each
method chooses, the mini-batch fits against their full-batch references, and the document
([`ReportDoc`][laplace_debiased.evaluation.report_data.ReportDoc]) that the tables and figures fill.

δ is chosen per method by the lowest mean NLL on the validation set; results without one fall back
to the test set (an oracle choice, and the report says so). A method's structure, batch rule and
role come from the table of methods ([`lookup`][laplace_debiased.evaluation.methods.lookup]);
rows of a method the table does not hold are reported under their recorded names.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from laplace_debiased.evaluation import methods as method_table
from laplace_debiased.evaluation.methods import STRUCTURE_NAMES, Method, lookup
from laplace_debiased.evaluation.options import split_method_key
from laplace_debiased.evaluation.sweep import load_rows
from laplace_debiased.evaluation.tracking import gap_curves, largest_gaps, max_gap_per_draw, reference_of
from laplace_debiased.prior_grid import PriorGrid, check_criterion, choose_prior_precision


#: file next to ``results.jsonl`` with the run's setting in words (written by the main job)
SETTING_NAME = "setting.json"


LINK_PREFERENCE = ("probit_projected", "mc", "probit")


LINK_LABELS = {
    "probit_projected": "projected probit (logit-difference subspace)",
    "mc": "Monte-Carlo (linearized sampling)",
    "probit": "laplace-torch diagonal probit",
}


METRICS = ("accuracy", "nll", "ece", "brier")


def mean_by(rows: list[dict], key_fields: Sequence[str], metric: str) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if metric in r and r[metric] is not None:
            out[tuple(r[k] for k in key_fields)].append(float(r[metric]))
    return out


class ReportDoc:
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


def spread_text(values: list[float]) -> str:
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
    is [`choose_prior_precision`][laplace_debiased.prior_grid.choose_prior_precision].
    """
    check_criterion(criterion)
    vals = mean_by([r for r in rows if r["eval_set"] == eval_set and r["link"] == link and r["method"] != "map"],
                    ("method", "prior_precision"), criterion)
    means = [(method, delta, float(np.mean(v))) for (method, delta), v in sorted(vals.items(), key=lambda kv: kv[0][1])]
    scores: dict[str, dict[float, float]] = {}
    for method, delta, mean in means:
        scores.setdefault(method, {})[delta] = mean
    # methods in the order their first finite score appears along the grid (the tables' order)
    order = dict.fromkeys(method for method, _, mean in means if math.isfinite(mean))
    return {m: choose_prior_precision(scores[m], criterion) for m in order}


@dataclass
class ReportContext:
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


def read_results(results: str | Path | list[dict], out_dir: str | Path, setting: dict | None = None) -> ReportContext:
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
    return ReportContext(
        rows=rows, out_dir=out_dir, test_set=tests[0], links=links, lap=lap, methods=methods,
        full_batch={r["method"] for r in lap if r.get("full_batch")},
        map_rows={r["eval_set"]: r for r in rows if r["method"] == "map"},
        colors={m: f"C{i}" for i, m in enumerate(methods)},
        val_set=next((r["eval_set"] for r in rows if r.get("kind") == "validation"), None),
        ood_set=next((r["eval_set"] for r in rows if r.get("kind") == "ood"), None),
        setting=_read_setting(results, setting),
    )


@dataclass
class TrackedFit:
    """One mini-batch method against the full-batch LA of its structure, on the test set."""

    method: str
    reference: str
    curves: dict[int, dict[float, float]]  # per draw: δ -> signed relative test-NLL gap (a fraction)
    ece: list[float]  # per draw: the largest absolute ECE gap over δ (a fraction)

    @property
    def nll(self) -> list[float]:
        """Per draw: the largest relative test-NLL gap over δ (a fraction)."""
        return largest_gaps(self.curves)


def reference(ctx: ReportContext, method: str) -> str | None:
    """The full-batch method of ``method``'s structure in the results: for a method of the table
    ([`lookup`][laplace_debiased.evaluation.methods.lookup]) the one full-batch method of the same
    structure, else [`reference_of`][laplace_debiased.evaluation.tracking.reference_of]; ``None``
    for a full-batch method or without exactly one."""
    if method in ctx.full_batch:
        return None
    record = lookup(method)
    if record is None:
        return reference_of(method, sorted(ctx.full_batch))
    matches = [f for f in sorted(ctx.full_batch) if (other := lookup(f)) is not None and other.full_batch
               and other.structure == record.structure]
    return matches[0] if len(matches) == 1 else None


def tracking_rows(ctx: ReportContext) -> list[TrackedFit]:
    """Each mini-batch method with a full-batch reference: its signed NLL gaps per draw and δ, and
    its largest ECE gaps, on the test set over the whole grid."""
    out = []
    for m in ctx.methods:
        ref = reference(ctx, m)
        if ref is not None:
            out.append(TrackedFit(m, ref, gap_curves(ctx.lap, m, ref, ctx.test_set, ctx.main_link, "nll"),
                                  max_gap_per_draw(ctx.lap, m, ref, ctx.test_set, ctx.main_link, "ece", False)))
    return out


@dataclass
class BatchFit:
    """One mini-batch method of the table at one batch size, against the full batch of its structure."""

    method: str  # the rows' name (``kron_single@b32``)
    record: Method  # its entry in the table of methods
    b: int
    reference: str
    gaps: list[float]  # per draw: the largest relative test-NLL gap over δ (a fraction)

    @property
    def single(self) -> bool:
        """Whether it is a single-batch fit (B̃ = B)."""
        return self.record.batches == "single"


def batch_of(ctx: ReportContext, method: str) -> int | None:
    """The batch size of ``method``: from its name, its rows' ``batch_size`` or the setting."""
    b = split_method_key(method)[1]
    if b is None:
        b = next((r["batch_size"] for r in ctx.lap if r["method"] == method and r.get("batch_size")), None)
    if b is None:
        b = ctx.setting.get("methods", {}).get(method, {}).get("batch_size")
    return None if b is None else int(b)


def batch_fits(ctx: ReportContext) -> list[BatchFit]:
    """The mini-batch fits of the table with a batch size and a full-batch reference, ordered by
    structure, b and the table's order."""
    fits = []
    for m in ctx.methods:
        record, ref, b = lookup(m), reference(ctx, m), batch_of(ctx, m)
        if record is not None and ref is not None and b is not None:
            gaps = max_gap_per_draw(ctx.lap, m, ref, ctx.test_set, ctx.main_link, "nll", True)
            if gaps:
                fits.append(BatchFit(m, record, b, ref, gaps))
    structures = list(dict.fromkeys(f.record.structure for f in fits))
    order = list(method_table.METHODS)
    return sorted(fits, key=lambda f: (structures.index(f.record.structure), f.b, order.index(f.record.name)))


def several_structures(fits: list[BatchFit]) -> bool:
    """Whether the fits belong to more than one structure (then their names say which)."""
    return len({f.record.structure for f in fits}) > 1


def fit_name(fit: BatchFit, several_kinds: bool) -> str:
    """The fit in a few words, its role in the table ("single batch", "paper's split", ...), with the
    structure first when the results hold several."""
    return f"{STRUCTURE_NAMES[fit.record.structure]} {fit.record.role}" if several_kinds else fit.record.role

"""Sweep results -> calibration report folder (``report.md``, ``report.html``, PNG figures).

The page: the setting (data, N, model, each method and evaluation set in words, read from the main
job's ``setting.json``), then the tables
([`laplace_debiased.evaluation.report_tables`][laplace_debiased.evaluation.report_tables]) and figures
([`laplace_debiased.evaluation.report_figures`][laplace_debiased.evaluation.report_figures]) in the
order a reader needs them, rendered to Markdown and HTML.
"""

from __future__ import annotations

from pathlib import Path

from laplace_debiased.evaluation.report_data import ReportContext, ReportDoc, read_results
from laplace_debiased.evaluation.report_figures import (auroc_severity_figure, batch_size_figure, figure6, link_figure,
                                                        reliability_figure, tracking_figure)
from laplace_debiased.evaluation.report_tables import (batch_size_table, batch_verdict, chosen_tables,
                                                       correction_tables, coverage_tables, headline_table,
                                                       setting_tables, shift_tables, tracking_table)


def write_report(results: str | Path | list[dict], out_dir: str | Path, title: str = "Calibration report",
                 setting: dict | None = None) -> Path:
    """Write ``report.md``, ``report.html`` and figures into ``out_dir``.

    Args:
        results: A results file or its rows; only read.
        out_dir: The folder the report is written into.
        title: The report's title.
        setting: The run's setting in words
            ([`laplace_debiased.evaluation.pipeline.describe_setting`][laplace_debiased.evaluation.pipeline.describe_setting]);
            by default the ``setting.json`` next to a results file, if there is one.

    Returns:
        The path of ``report.md``.
    """
    import matplotlib

    matplotlib.use("Agg")
    ctx = read_results(results, out_dir, setting)
    doc = ReportDoc()
    setting_tables(ctx, doc, title)
    for section in (headline_table, _batch_sizes, shift_tables, figure6, _tracking, link_figure, chosen_tables,
                    reliability_figure, auroc_severity_figure, coverage_tables, correction_tables):
        section(ctx, doc)
    md = ctx.out_dir / "report.md"
    md.write_text(doc.markdown())
    (ctx.out_dir / "report.html").write_text(doc.html(title))
    return md


def _batch_sizes(ctx: ReportContext, doc: ReportDoc) -> None:
    """The batch-size table, the figure of its gaps against b, and the sentences that read them."""
    fits = batch_size_table(ctx, doc)
    if fits:
        batch_size_figure(ctx, doc, fits)
        doc.p(batch_verdict(fits, ctx.setting.get("n_train")))


def _tracking(ctx: ReportContext, doc: ReportDoc) -> None:
    """The tracking table and the figure of the signed gaps over δ."""
    rows = tracking_table(ctx, doc)
    if rows:
        tracking_figure(ctx, doc, rows)

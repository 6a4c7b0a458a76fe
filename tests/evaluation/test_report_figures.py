"""report_figures: the signed-gap figure is labelled for people and draws what it is given."""

from __future__ import annotations

import numpy as np

from laplace_debiased.evaluation.report_figures import save_signed_gap_figure, signed_gap_figure


def _panels():
    curves = {0: {1e-2: 0.10, 1.0: 0.02}, 1: {1e-2: 0.30, 1.0: 0.04}}  # two draws, fractions
    return {"b = 32": {"single batch": curves}}


def test_signed_gap_figure_plots_the_mean_over_draws_in_percent_with_labelled_axes():
    import matplotlib

    matplotlib.use("Agg")
    fig = signed_gap_figure(_panels(), "title")
    ax = fig.axes[0]
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_ydata(), [20.0, 3.0])  # mean of 10 % and 30 %, of 2 % and 4 %
    assert ax.get_xscale() == "log" and "δ" in ax.get_xlabel() and "%" in ax.get_ylabel()
    assert ax.get_legend().get_texts()[0].get_text() == "single batch (2 draws)"


def test_save_signed_gap_figure_writes_a_png(tmp_path):
    path = tmp_path / "gaps.png"
    save_signed_gap_figure(_panels(), "title", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

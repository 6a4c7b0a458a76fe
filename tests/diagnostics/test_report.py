"""The rendered bias report (:mod:`laplace_debiased.diagnostics.report`): figures, README, JSON."""

from __future__ import annotations

import json

import pytest

from laplace_debiased.diagnostics.report import write_report


def test_report_renders(diagnosis, tmp_path):
    s = write_report(diagnosis, tmp_path, plan={"eigenvectors": "planned"})
    for name in ("slice.png", "eigen.png", "overlap.png", "cg.png", "batch_sizes.png", "README.md", "bias.json"):
        assert (tmp_path / name).stat().st_size > 0
    payload = json.loads((tmp_path / "bias.json").read_text())
    assert payload["summary"]["eigen"]["curvature_bias_same_batch"]["median"] == pytest.approx(
        s["eigen"]["curvature_bias_same_batch"]["median"])
    assert len(payload["details"]["eigen"][0]["curvatures"]) == 160 // 8
    text = (tmp_path / "README.md").read_text()
    median = s["eigen"]["curvature_bias_same_batch"]["median"]
    word = "over" if median >= 0 else "under"  # a negative median used to read "over-estimated by -10 %"
    assert f"{word}-estimated by a median of {100 * abs(median):.0f} %" in text and "Planned" in text

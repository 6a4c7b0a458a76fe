"""``benchmarks/digits_coverage.py`` on the quick start's fit: the null group it rebuilds from B's
spectrum is the fit's own implicit null space, and its figures keep the relations the coverage
record and the data impose (Weyl's inequality at the union's tolerance, dead units and
always-zero features as exact zeros of the factors)."""

from __future__ import annotations

from benchmarks.digits_coverage import figures
from laplace_debiased.evaluation.training import default_digits_model


def test_digits_coverage_figures_keep_their_relations(digits_cache, monkeypatch):
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(digits_cache))
    model, splits = default_digits_model(log=None)
    f = figures(model, splits["train"])
    group = f["null_group"]
    assert group["size"] == group["fit_implicit_null_dimension"]
    assert group["exact_zeros"] + group["nonzero_inside"] == group["size"]
    assert group["nonzero_max"] <= group["tolerance_B"] * group["nonzero_inside"]  # a tied run's reach
    for side in ("output", "input"):
        ranks = {name: r["rank_coverage_record"] for name, r in f[side].items()}
        assert ranks["B∪B~"] >= max(ranks["B"], ranks["B~"])
        assert ranks["B∪B~"] <= ranks["B"] + ranks["B~"]
    assert f["input_rank_float64_all"] <= 256 - f["zero_features"]
    assert f["coverage"]["full"]["output_zeros"] >= f["dead_units"]

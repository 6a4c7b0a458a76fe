"""The digits benchmark's summary (``benchmarks/digits_estimators.py``) on hand-made sweep rows: the
signed gaps per δ are the ones whose largest absolute value per draw the headline table reports,
and the per-δ table and figure are written from them."""

from __future__ import annotations

import numpy as np

from benchmarks.digits_estimators import METHODS, by_delta_markdown, plot, summarise

GRID = (1e-4, 1.0, 1e2)
FULL = (2.0, 1.0, 0.5)


def _rows(rng: np.random.Generator, draws: int) -> list[dict]:
    def row(method: str, repeat: int, delta: float, nll: float, eval_set: str = "test") -> dict:
        return {"method": method, "repeat": repeat, "prior_precision": delta, "eval_set": eval_set, "kind": eval_set,
                "severity": None, "link": "probit_projected", "nll": nll, "ece": 0.05, "log_marglik": -nll}

    rows = [row("kron_full", 0, d, f) for d, f in zip(GRID, FULL)]
    for m in METHODS:
        for r in range(draws):
            rows += [row(m, r, d, f * (1 + rng.normal(0, 0.05))) for d, f in zip(GRID, FULL)]
    return rows


def test_signed_gaps_per_delta_are_what_the_headline_maximum_is_taken_over(tmp_path):
    rows = _rows(np.random.default_rng(0), draws=4)
    summary = summarise(rows)
    for m in METHODS:
        by_delta = np.array(list(summary[m]["signed_nll_gap_by_delta"].values()))  # (δ, draws)
        assert [float(k) for k in summary[m]["signed_nll_gap_by_delta"]] == list(GRID)
        np.testing.assert_allclose(np.abs(by_delta).max(0), summary[m]["nll_gap_per_draw"], rtol=1e-12)
        # the sign is kept: method minus reference, relative to the reference
        first = next(r["nll"] for r in rows if r["method"] == m and r["repeat"] == 0 and r["prior_precision"] == GRID[0])
        assert by_delta[0, 0] == (first - FULL[0]) / FULL[0]
    table = by_delta_markdown({64: summary})
    assert table.count("\n| ") == len(GRID) + 1  # header and one row per δ
    # where each draw's largest gap lies: the counts add up to the draws
    for line in (l for l in table.splitlines() if l.startswith("- b = 64")):
        assert sum(int(part.split(": ")[1]) for part in line.split(": ", 1)[1].split(", ")) == 4
    plot({64: summary, 128: summary}, tmp_path / "gaps.png")
    assert (tmp_path / "gaps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The pre-registered evaluation's summary (``benchmarks/protocol_summary.py``) on hand-made gaps:
the paired differences, the margins and the decision criterion of ``benchmarks/PROTOCOL.md``."""

from __future__ import annotations

import numpy as np

from benchmarks.protocol_summary import CANDIDATES, cell, decide


def _curves(levels: dict[str, float], rng: np.random.Generator, draws: int = 16) -> dict:
    """Per candidate and draw, gaps over three δ whose largest absolute value is ``level`` (a
    fraction) plus a draw effect shared by all candidates (paired) and a little own noise."""
    shared = rng.normal(0, 0.02, draws)
    out = {}
    for c in CANDIDATES:
        own = rng.normal(0, 0.001, draws)
        out[c] = {k: {1e-2: -0.001, 1.0: levels[c] + shared[k] + own[k], 1e2: 0.0} for k in range(draws)}
    return out


def test_paired_differences_margins_and_decision():
    rng = np.random.default_rng(0)
    levels = {"single": 0.30, "paper": 0.20, "corrected": 0.10, "shrunk": 0.25, "stein": 0.12}
    c = cell(_curves(levels, rng))
    assert c["draws"] == 16 and c["single_outside_floor"]
    # D in points: the shared draw effect cancels, so D ≈ the level difference with a small s.e.
    for r in CANDIDATES[1:]:
        assert abs(c["D"][r]["mean"] - 100 * (levels[r] - levels["single"])) < 0.5
        assert c["D"][r]["se"] < 0.1 and c["D"][r]["worse"] == 0 and c["D"][r]["meets"]
    # the per-δ paired difference at δ = 1 is the same difference, at 1e-2 zero
    assert abs(c["per_delta"]["corrected"]["1.0"][0] + 20.0) < 0.5 and c["per_delta"]["corrected"]["0.01"][0] == 0.0
    d = decide({"s": {32: c}})
    assert d["winner"] == "corrected" and d["default"] == "corrected"


def test_a_candidate_worse_than_the_single_batch_beyond_the_margin_is_not_eligible():
    rng = np.random.default_rng(1)
    levels = {"single": 0.01, "paper": 0.05, "corrected": 0.012, "shrunk": 0.011, "stein": 0.0105}
    c = cell(_curves(levels, rng))
    assert not c["single_outside_floor"]  # 1 point: inside the floor, non-inferiority suffices
    assert not c["D"]["paper"]["meets"] and c["D"]["stein"]["meets"]
    d = decide({"s": {32: c}})
    assert "paper" not in d["eligible"]
    # shrunk and stein differ by 0.05 pt, within twice the s.e. of their paired difference: no switch
    assert d["default"] == "shrunk"

"""The pre-registered evaluation's summary (``benchmarks/protocol_summary.py``) on hand-made gaps:
the paired differences, the margins and the decision criterion of ``benchmarks/PROTOCOL.md``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.protocol_summary import (CANDIDATES, REGISTRATIONS, SIZES, cell, decide, decide_v2, markdown,
                                        per_draw_files, summarise)


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


def test_second_registration_floor_is_the_paper_split_being_detectably_closer():
    rng = np.random.default_rng(2)
    # the paper's split is no closer than the single batch: inside the measured floor, so
    # non-inferiority suffices although the single batch's gap (10 pt) is far above the fixed floor
    levels = {"single": 0.10, "paper": 0.105, "corrected": 0.102, "shrunk": 0.101, "stein": 0.1005}
    c = cell(_curves(levels, rng), t=1.729)
    assert c["single_outside_floor"] and not c["single_outside_floor_v2"]
    assert c["D"]["stein"]["meets_v2"] and not c["D"]["stein"]["meets"]
    # the paper's split 3 pt closer: outside the floor, so a candidate no better than single fails
    levels = {"single": 0.10, "paper": 0.07, "corrected": 0.06, "shrunk": 0.10, "stein": 0.065}
    c = cell(_curves(levels, rng), t=1.729)
    assert c["single_outside_floor_v2"]
    assert not c["D"]["shrunk"]["meets_v2"] and c["D"]["shrunk"]["non_inferior"]
    assert c["D"]["corrected"]["meets_v2"] and c["D"]["stein"]["meets_v2"]  # 0.5 pt from the best: within


def test_second_registration_asks_for_the_best_within_the_margin_and_falls_back_on_regret():
    rng = np.random.default_rng(3)
    # cell one: corrected best, stein 2.5 pt behind; cell two: stein best, corrected 2 pt behind; shrunk
    # 4 pt behind in both; none better than single is needed (the paper is further than single)
    one = cell(_curves({"single": 0.20, "paper": 0.21, "corrected": 0.10, "shrunk": 0.14, "stein": 0.125}, rng), t=1.729)
    two = cell(_curves({"single": 0.20, "paper": 0.21, "corrected": 0.12, "shrunk": 0.14, "stein": 0.10}, rng), t=1.729)
    assert not one["D"]["stein"]["near_best"] and one["D"]["corrected"]["near_best"]
    assert not two["D"]["corrected"]["near_best"] and two["D"]["stein"]["near_best"]
    d = decide_v2({"s": {32: one, 64: two}})
    assert d["eligible"] == []
    # regret: corrected 2 pt, stein 2.5, shrunk 4, paper 11 (each ± a few hundredths)
    assert abs(d["R"]["corrected"] - 2.0) < 0.3 and abs(d["R"]["stein"] - 2.5) < 0.3 and abs(d["R"]["shrunk"] - 4.0) < 0.3
    assert d["default"] == "corrected"
    # with stein within the margin in both cells it is eligible and wins on the worst-case loss W
    three = cell(_curves({"single": 0.20, "paper": 0.21, "corrected": 0.10, "shrunk": 0.14, "stein": 0.105}, rng),
                 t=1.729)
    d = decide_v2({"s": {32: three, 64: two}})
    assert d["eligible"] == ["stein"] and d["default"] == "stein"


def test_second_registration_keeps_the_default_when_nothing_is_non_inferior():
    rng = np.random.default_rng(4)
    c = cell(_curves({"single": 0.05, "paper": 0.10, "corrected": 0.08, "shrunk": 0.09, "stein": 0.07}, rng), t=1.729)
    d = decide_v2({"s": {32: c}})
    assert d["eligible"] == [] and d["default"] == "shrunk" and "non-inferior" in d["why"]


def test_each_registration_uses_the_t_quantile_of_its_draws():
    """u(x) = mean + t s.e. with t the one-sided 95 % quantile at draws − 1 degrees of freedom."""
    from scipy import stats

    for reg in REGISTRATIONS.values():
        assert abs(reg.t - stats.t.ppf(0.95, reg.draws - 1)) < 5e-4, reg


def test_third_registration_report_names_its_protocol_and_command():
    rng = np.random.default_rng(5)
    reg = REGISTRATIONS[3]
    c = cell(_curves({"single": 0.05, "paper": 0.04, "corrected": 0.03, "shrunk": 0.035, "stein": 0.03}, rng,
                     draws=reg.draws), t=reg.t)
    text = markdown({"s": {32: c}}, {"s": True}, decide_v2({"s": {32: c}}), reg)
    assert text.startswith("# Third pre-registered evaluation") and "PROTOCOL_V3.md" in text
    assert "--registration 3" in text and f"u(x) = mean + {reg.t} s.e." in text


def _write_draws(root, sizes, seeds, levels: dict[str, float]) -> None:
    """Per-draw JSON files in the format of ``digits_mlp_estimators.py`` / ``cifar_cnn_estimators.py``:
    the full batch's NLL 1 at two δ, each candidate's ``1 + level`` at the second (a relative gap of
    ``level``) plus a draw effect shared by the candidates."""
    for b in sizes:
        for s in seeds:
            shared = 0.001 * (s % 7)
            record = {"b": b, "seed": s, "deltas": [0.01, 1.0], "full": [1.0, 1.0],
                      "nll": {c: [1.0, 1.0 + level + shared] for c, level in levels.items()}, "kept": {}}
            (root / f"b{b}").mkdir(parents=True, exist_ok=True)
            (root / f"b{b}" / f"seed{s}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("which", [0, 1], ids=["cifar_cnn", "resnet20"])
def test_third_registration_reads_a_later_setting_and_decides_on_it_once_every_draw_has_finished(tmp_path, which):
    """Settings 3 and 4 (PROTOCOL_V3_CIFAR.md, PROTOCOL_V3_RESNET.md) enter the third registration's
    decision only when all their batch sizes have the registered draws; before, they are reported as
    unfinished."""
    reg = REGISTRATIONS[3]
    later = reg.later[which]
    good = {"single": 0.10, "paper": 0.02, "corrected": 0.01, "shrunk": 0.015, "stein": 0.012}
    _write_draws(tmp_path / reg.mlp, SIZES, range(reg.draws), good)
    # on the later setting the corrected estimate is 5 points worse than the single batch
    bad = {"single": 0.01, "paper": 0.02, "corrected": 0.06, "shrunk": 0.012, "stein": 0.011}
    _write_draws(tmp_path / later.cache, later.sizes, range(reg.draws - 1), bad)
    out = summarise(reg, tmp_path)
    assert set(out["cells"][later.name]) == set(later.sizes) and not out["finished"][later.name]
    assert out["decision"]["default"] == "corrected"  # decided on setting 2 alone
    assert later.protocol in markdown(out["cells"], out["finished"], out["decision"], reg)
    _write_draws(tmp_path / later.cache, later.sizes, [reg.draws - 1], bad)
    out = summarise(reg, tmp_path)
    b = later.sizes[0]
    assert out["finished"][later.name] and out["cells"][later.name][b]["draws"] == reg.draws
    assert not out["cells"][later.name][b]["D"]["corrected"]["non_inferior"]
    assert out["decision"]["default"] != "corrected"


def test_a_later_setting_is_measured_against_its_one_reference(tmp_path):
    """Where a cache has ``full.json``, every draw's M is against it, not against the draw's copy."""
    _write_draws(tmp_path, (512,), range(3), {"single": 0.10, "paper": 0.02, "corrected": 0.01, "shrunk": 0.0,
                                              "stein": 0.01})
    before = per_draw_files(tmp_path, (512,))
    (tmp_path / "full.json").write_text(json.dumps({"deltas": [0.01, 1.0], "nll": [1.0, 2.0]}))
    after = per_draw_files(tmp_path, (512,))
    for c, draws in before[512].items():
        for s, gaps in draws.items():
            # NLL 1 + level + shared at δ = 1: against 1 the gap is level + shared, against 2 it is
            # (1 + level + shared - 2) / 2
            assert after[512][c][s][1.0] == pytest.approx((gaps[1.0] - 1.0) / 2)
            assert after[512][c][s][0.01] == gaps[0.01] == 0.0
    (tmp_path / "full.json").write_text(json.dumps({"deltas": [0.1, 1.0], "nll": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="prior precisions differ"):
        per_draw_files(tmp_path, (512,))

"""The pre-registered evaluation's summary and decision (``benchmarks/PROTOCOL.md``).

    python benchmarks/protocol_summary.py [--cache ~/.cache/laplace-debiased-study] [--draws 16]

Reads what has finished from the two caches (``digits-cnn/b<b>/results.jsonl`` of the main job,
``digits-mlp/b<b>/seed<s>.json`` of ``digits_mlp_estimators.py``), and writes
``results/protocol.{json,md}``: per setting, b and candidate the metric M (largest relative
test-NLL gap to the full batch over δ, points), its paired difference D to the single batch
(mean ± s.e., draws worse), the margins' verdicts, the paired per-δ differences, and the decision
by PROTOCOL.md's criterion over the finished settings (a setting is finished when every b has all
its draws for every candidate).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from laplace_debiased.evaluation.sweep import load_rows
from laplace_debiased.evaluation.tracking import gap_curves, mean_stderr

HERE = Path(__file__).resolve().parent
CANDIDATES = ("single", "paper", "corrected", "shrunk", "stein")
CNN_METHODS = {"single": "kron_single", "paper": "kron_debiased", "corrected": "kron_corrected",
               "shrunk": "kron_shrunk", "stein": "kron_stein"}
SIZES = (32, 64, 128)
T15 = 1.753  # one-sided 95 % t quantile, 15 degrees of freedom
MARGIN, FLOOR = 1.0, 2.0  # points


def digits_cnn(root: Path) -> dict[int, dict[str, dict[int, dict[float, float]]]]:
    """``{b: {candidate: {draw: {δ: signed relative gap}}}}`` of setting 1."""
    out = {}
    for b in SIZES:
        path = root / f"b{b}" / "results.jsonl"
        if not path.exists():
            continue
        rows = load_rows(path)
        try:
            out[b] = {c: gap_curves(rows, m, "kron_full", "test", "probit_projected", "nll")
                      for c, m in CNN_METHODS.items()}
        except ValueError:  # the reference or a candidate has no rows yet
            continue
    return out


def digits_mlp(root: Path) -> dict[int, dict[str, dict[int, dict[float, float]]]]:
    """The same for setting 2, from its per-draw JSON files."""
    out: dict = {}
    for b in SIZES:
        for path in sorted((root / f"b{b}").glob("seed*.json")):
            r = json.loads(path.read_text())
            full = r["full"]
            for c in CANDIDATES:
                out.setdefault(b, {}).setdefault(c, {})[r["seed"]] = {
                    d: (v - f) / abs(f) for d, v, f in zip(r["deltas"], r["nll"][c], full)}
    return out


def cell(curves: dict[str, dict[int, dict[float, float]]]) -> dict:
    """The metrics of one (setting, b) from its candidates' curves (draws paired by key)."""
    draws = sorted(set.intersection(*(set(curves[c]) for c in CANDIDATES)))
    M = {c: 100 * np.array([max(abs(g) for g in curves[c][k].values()) for k in draws]) for c in CANDIDATES}
    out = {"draws": len(draws), "M": {c: mean_stderr(M[c]) for c in CANDIDATES}, "D": {}, "per_delta": {}}
    single_mean, single_se = out["M"]["single"]
    outside = single_mean - 2 * single_se > FLOOR
    out["single_outside_floor"] = bool(outside)
    for c in CANDIDATES[1:]:
        D = M[c] - M["single"]
        mean, se = mean_stderr(D)
        upper = mean + T15 * se
        out["D"][c] = {"mean": mean, "se": se, "worse": int((D > 0).sum()), "upper": upper,
                       "non_inferior": bool(upper < MARGIN), "better": bool(upper < 0),
                       "meets": bool(upper < MARGIN and (upper < 0 or not outside))}
        deltas = sorted(set.intersection(*(set(curves[c][k]) & set(curves["single"][k]) for k in draws)))
        out["per_delta"][c] = {str(d): mean_stderr(100 * np.array([curves[c][k][d] - curves["single"][k][d]
                                                                 for k in draws])) for d in deltas}
    out["M_raw"] = {c: M[c].tolist() for c in CANDIDATES}
    best = min(CANDIDATES[1:], key=lambda c: out["M"][c][0])
    out["best"] = best
    out["vs_best"] = {c: mean_stderr(M[c] - M[best]) for c in CANDIDATES[1:]}
    return out


def decide(cells: dict[str, dict[int, dict]]) -> dict:
    """PROTOCOL.md's criterion over the given (finished) cells."""
    flat = [(s, b, c) for s, bs in cells.items() for b, c in bs.items()]
    if not flat:
        return {"eligible": [], "W": {}, "default": "shrunk", "why": "no finished setting"}
    rules = CANDIDATES[1:]
    eligible = [r for r in rules if all(c["D"][r]["meets"] for _, _, c in flat)]
    W = {r: max(c["D"][r]["mean"] for _, _, c in flat) for r in rules}
    if not eligible:
        return {"eligible": [], "W": W, "default": "shrunk", "why": "no candidate is eligible; the default stays"}
    winner = min(eligible, key=W.get)
    if winner == "shrunk":
        return {"eligible": eligible, "W": W, "winner": winner, "default": "shrunk", "why": "shrunk wins"}
    if "shrunk" not in eligible:
        return {"eligible": eligible, "W": W, "winner": winner, "default": winner, "why": "shrunk is not eligible"}
    s, b, c = max(flat, key=lambda t: t[2]["D"]["shrunk"]["mean"])
    diff = np.array(c["M_raw"]["shrunk"]) - np.array(c["M_raw"][winner])
    se = float(diff.std(ddof=1) / math.sqrt(len(diff)))
    gain = W["shrunk"] - W[winner]
    switch = gain > 2 * se
    return {"eligible": eligible, "W": W, "winner": winner, "default": winner if switch else "shrunk",
            "why": f"W(shrunk) − W({winner}) = {gain:.2f} pt against 2 s.e. = {2 * se:.2f} pt (at {s}, b = {b})"}


def markdown(cells: dict, finished: dict[str, bool], decision: dict, draws: int) -> str:
    lines = ["# Pre-registered evaluation of the two-batch K-FAC estimates (benchmarks/PROTOCOL.md)", "",
             "Written by `python benchmarks/protocol_summary.py` from the caches of the commands in "
             "PROTOCOL.md. M: largest relative test-NLL gap to full-batch K-FAC over δ (points, mean ± s.e. "
             "over draws). D: M − M(single) on the same draw (mean ± s.e.; worse: draws with D > 0). "
             f"Margins: non-inferior if mean(D) + {T15} s.e. < {MARGIN} pt; where the single batch lies "
             f"outside the noise floor (mean − 2 s.e. > {FLOOR} pt) also better (upper bound < 0).", ""]
    for setting, bs in cells.items():
        state = "finished" if finished[setting] else f"**not finished** (fewer than {draws} draws in some cell; not in the decision)"
        lines += [f"## {setting} ({state})", "",
                  "| b | draws | single M | " + " | ".join(f"{c}: M / D (worse) / meets" for c in CANDIDATES[1:]) + " |",
                  "|---|---|---|" + "---|" * (len(CANDIDATES) - 1)]
        for b, c in sorted(bs.items()):
            m = c["M"]
            cells_text = [f"{m[r][0]:.2f} ± {m[r][1]:.2f} / {c['D'][r]['mean']:+.2f} ± {c['D'][r]['se']:.2f} "
                          f"({c['D'][r]['worse']} of {c['draws']}) / {'yes' if c['D'][r]['meets'] else 'no'}"
                          for r in CANDIDATES[1:]]
            lines.append(f"| {b} | {c['draws']} | {m['single'][0]:.2f} ± {m['single'][1]:.2f}"
                         f"{' (outside floor)' if c['single_outside_floor'] else ''} | " + " | ".join(cells_text) + " |")
        lines += ["", "Paired difference to the cell's best two-batch candidate (lowest mean M), M − M(best) "
                  "(points, mean ± s.e.):", "",
                  "| b | best | " + " | ".join(CANDIDATES[1:]) + " |", "|---|---|" + "---|" * (len(CANDIDATES) - 1)]
        for b, c in sorted(bs.items()):
            lines.append(f"| {b} | {c['best']} | " + " | ".join(
                f"{c['vs_best'][r][0]:+.2f} ± {c['vs_best'][r][1]:.2f}" for r in CANDIDATES[1:]) + " |")
        lines.append("")
    lines += ["## Decision (finished settings only)", "",
              f"- eligible: {', '.join(decision['eligible']) or 'none'}",
              "- worst-case paired loss W (pt): " + ", ".join(f"{k} {v:+.2f}" for k, v in decision["W"].items()),
              f"- default: **{decision['default']}** ({decision['why']})", "",
              "Per-δ paired differences (candidate − single, signed gaps, points): `protocol.json`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/laplace-debiased-study"))
    parser.add_argument("--draws", type=int, default=16)
    args = parser.parse_args(argv)
    root = args.cache.expanduser()
    raw = {"digits CNN (setting 1)": digits_cnn(root / "digits-cnn"),
           "digits MLP (setting 2)": digits_mlp(root / "digits-mlp")}
    cells = {s: {b: cell(curves) for b, curves in bs.items()} for s, bs in raw.items() if bs}
    finished = {s: set(bs) == set(SIZES) and all(c["draws"] >= args.draws for c in bs.values())
                for s, bs in cells.items()}
    decision = decide({s: bs for s, bs in cells.items() if finished[s]})
    (HERE / "results" / "protocol.json").write_text(json.dumps(
        {"cells": {s: {str(b): c for b, c in bs.items()} for s, bs in cells.items()}, "finished": finished,
         "decision": decision}, indent=1) + "\n")
    text = markdown(cells, finished, decision, args.draws)
    (HERE / "results" / "protocol.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The pre-registered evaluations' summaries and decisions (``benchmarks/PROTOCOL.md``, the
second registration ``benchmarks/PROTOCOL_V2.md`` and the third ``benchmarks/PROTOCOL_V3.md``).

    python benchmarks/protocol_summary.py [--registration 1|2|3] [--cache ~/.cache/laplace-debiased-study]

Reads what has finished from the registration's caches (``<cnn>/b<b>/results.jsonl`` of the
main job, ``<mlp>/b<b>/seed<s>.json`` of ``digits_mlp_estimators.py`` and, for the third, its later
settings' ``<cache>/b<b>/seed<s>.json`` of ``cifar_cnn_estimators.py`` (``PROTOCOL_V3_CIFAR.md``) and
``resnet20_estimators.py`` (``PROTOCOL_V3_RESNET.md``); :data:`REGISTRATIONS`), and
writes ``results/<stem>.{json,md}``: per setting, b and candidate the metric M (largest relative
test-NLL gap to the full batch over δ, points), its paired difference D to the single batch
(mean ± s.e., draws worse), the margins' verdicts, the paired per-δ differences, and the decision
by the registration's criterion over the finished settings (a setting is finished when every b has
all its draws for every candidate). The second and third registrations share margins and
criterion; their reports also give the first one's margins on their run.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Later:
    """A setting that a registration named and a later protocol file ran: its name in the report, its
    cache (under ``--cache``, one JSON per draw and b), its batch sizes and that protocol."""

    name: str
    cache: str
    sizes: tuple[int, ...]
    protocol: str


@dataclass(frozen=True)
class Registration:
    """One pre-registered run: its protocol, the caches of settings 1 and 2 (under ``--cache``), the
    settings it named that later protocol files ran, draws per cell, the one-sided 95 % t quantile at
    ``draws - 1`` degrees of freedom, and the results' file stem."""

    number: int
    protocol: str
    cnn: str
    mlp: str
    draws: int
    t: float
    stem: str
    later: tuple[Later, ...] = ()


REGISTRATIONS = {1: Registration(1, "PROTOCOL.md", "digits-cnn", "digits-mlp", 16, T15, "protocol"),
                 2: Registration(2, "PROTOCOL_V2.md", "v2-digits-cnn", "v2-digits-mlp", 20, 1.729, "protocol_v2"),
                 3: Registration(3, "PROTOCOL_V3.md", "v3-digits-cnn", "v3-digits-mlp", 64, 1.669, "protocol_v3",
                                 (Later("cifar_cnn (setting 3)", "v3-cifar-cnn", (512, 1280, 2304), "PROTOCOL_V3_CIFAR.md"),
                                  Later("ResNet-20 (setting 4)", "v3-resnet20", (512,), "PROTOCOL_V3_RESNET.md")))}
ORDINALS = {2: "Second", 3: "Third"}


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


def per_draw_files(root: Path, sizes: tuple[int, ...] = SIZES) -> dict[int, dict[str, dict[int, dict[float, float]]]]:
    """The same for setting 2 (or a later one, at ``sizes``), from its per-draw JSON files. The
    reference is the setting's ``full.json`` where the cache has one (written once by the drivers of
    the later settings), else each draw's copy of it (setting 2)."""
    reference = root / "full.json"
    shared = json.loads(reference.read_text()) if reference.exists() else None
    out: dict = {}
    for b in sizes:
        for path in sorted((root / f"b{b}").glob("seed*.json")):
            r = json.loads(path.read_text())
            if shared is not None and shared["deltas"] != r["deltas"]:
                raise ValueError(f"{path}: its prior precisions differ from those of {reference}.")
            full = r["full"] if shared is None else shared["nll"]
            for c in CANDIDATES:
                out.setdefault(b, {}).setdefault(c, {})[r["seed"]] = {
                    d: (v - f) / abs(f) for d, v, f in zip(r["deltas"], r["nll"][c], full)}
    return out


def cell(curves: dict[str, dict[int, dict[float, float]]], t: float = T15) -> dict:
    """The metrics of one (setting, b) from its candidates' curves (draws paired by key), with the
    upper bounds ``mean + t · s.e.``.

    ``meets``: the first registration's margins (non-inferior; better where the single batch's mean
    less 2 s.e. exceeds the fixed floor). ``meets_v2``: the second's (non-inferior; better where
    the paper's bias-free split is detectably closer than the single batch,
    ``single_outside_floor_v2``; within the margin of the cell's best candidate, ``near_best``)."""
    draws = sorted(set.intersection(*(set(curves[c]) for c in CANDIDATES)))
    M = {c: 100 * np.array([max(abs(g) for g in curves[c][k].values()) for k in draws]) for c in CANDIDATES}
    out = {"draws": len(draws), "M": {c: mean_stderr(M[c]) for c in CANDIDATES}, "D": {}, "per_delta": {}}
    single_mean, single_se = out["M"]["single"]
    outside = single_mean - 2 * single_se > FLOOR
    out["single_outside_floor"] = bool(outside)
    for c in CANDIDATES[1:]:
        D = M[c] - M["single"]
        mean, se = mean_stderr(D)
        upper = mean + t * se
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
    outside_v2 = out["D"]["paper"]["better"]
    out["single_outside_floor_v2"] = bool(outside_v2)
    for c in CANDIDATES[1:]:
        D = out["D"][c]
        near = out["vs_best"][c][0] + t * out["vs_best"][c][1] < MARGIN
        D["near_best"] = bool(near)
        D["meets_v2"] = bool(D["non_inferior"] and (D["better"] or not outside_v2) and near)
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


def decide_v2(cells: dict[str, dict[int, dict]]) -> dict:
    """PROTOCOL_V2.md's criterion over the given (finished) cells: :func:`decide`'s rule among the
    candidates meeting every second-registration margin; if none does, the smallest worst-case
    regret to the cell's best, ``R``, among those non-inferior everywhere; else ``"shrunk"`` stays."""
    flat = [c for bs in cells.values() for c in bs.values()]
    if not flat:
        return {"eligible": [], "W": {}, "R": {}, "default": "shrunk", "why": "no finished setting"}
    rules = CANDIDATES[1:]
    R = {r: max(c["vs_best"][r][0] for c in flat) for r in rules}
    eligible = [r for r in rules if all(c["D"][r]["meets_v2"] for c in flat)]
    if eligible:
        as_v1 = {s: {b: {**c, "D": {r: {**d, "meets": d["meets_v2"]} for r, d in c["D"].items()}}
                     for b, c in bs.items()} for s, bs in cells.items()}
        return {**decide(as_v1), "R": R}
    W = {r: max(c["D"][r]["mean"] for c in flat) for r in rules}
    fallback = [r for r in rules if all(c["D"][r]["non_inferior"] for c in flat)]
    if not fallback:
        return {"eligible": [], "W": W, "R": R, "default": "shrunk",
                "why": "no candidate is non-inferior in every cell; the default stays"}
    winner = min(fallback, key=R.get)
    return {"eligible": [], "W": W, "R": R, "non_inferior": fallback, "winner": winner, "default": winner,
            "why": "no candidate met every margin; the smallest worst-case regret to the best among the "
                   f"candidates non-inferior in every cell ({', '.join(fallback)})"}


def _setting_lines(setting: str, bs: dict[int, dict], state: str, second: bool) -> list[str]:
    """One setting's two tables: M and D with the margins' verdict (the second registration's when
    ``second``), and the paired difference to each cell's best candidate."""
    meets, floor = ("meets_v2", "single_outside_floor_v2") if second else ("meets", "single_outside_floor")
    lines = [f"## {setting} ({state})", "",
             "| b | draws | single M | " + " | ".join(f"{c}: M / D (worse) / meets" for c in CANDIDATES[1:]) + " |",
             "|---|---|---|" + "---|" * (len(CANDIDATES) - 1)]
    for b, c in sorted(bs.items()):
        m = c["M"]
        cells_text = [f"{m[r][0]:.2f} ± {m[r][1]:.2f} / {c['D'][r]['mean']:+.2f} ± {c['D'][r]['se']:.2f} "
                      f"({c['D'][r]['worse']} of {c['draws']}) / {'yes' if c['D'][r][meets] else 'no'}"
                      for r in CANDIDATES[1:]]
        lines.append(f"| {b} | {c['draws']} | {m['single'][0]:.2f} ± {m['single'][1]:.2f}"
                     f"{' (outside floor)' if c[floor] else ''} | " + " | ".join(cells_text) + " |")
    lines += ["", "Paired difference to the cell's best two-batch candidate (lowest mean M), M − M(best) "
              "(points, mean ± s.e." + ("; within the margin of the best: yes / no" if second else "") + "):", "",
              "| b | best | " + " | ".join(CANDIDATES[1:]) + " |", "|---|---|" + "---|" * (len(CANDIDATES) - 1)]
    for b, c in sorted(bs.items()):
        lines.append(f"| {b} | {c['best']} | " + " | ".join(
            f"{c['vs_best'][r][0]:+.2f} ± {c['vs_best'][r][1]:.2f}"
            + ((" / yes" if c["D"][r]["near_best"] else " / no") if second else "") for r in CANDIDATES[1:]) + " |")
    return lines + [""]


def markdown(cells: dict, finished: dict[str, bool], decision: dict, reg: Registration,
             first_decision: dict | None = None) -> str:
    """The report of registration ``reg``; for the second and third, ``first_decision`` is the first
    registration's criterion applied to this run (reported, not deciding)."""
    second = reg.number >= 2
    commands_too = "".join(f" and {later.protocol}" for later in reg.later if later.name in cells)
    if second:
        head = [f"# {ORDINALS[reg.number]} pre-registered evaluation of the two-batch K-FAC estimates "
                f"(benchmarks/{reg.protocol})", "",
                f"Written by `python benchmarks/protocol_summary.py --registration {reg.number}` from the caches of "
                f"the commands in {reg.protocol}{commands_too}. M: largest relative test-NLL gap to full-batch K-FAC over δ (points, mean ± s.e. "
                "over draws). D: M − M(single) on the same draw (mean ± s.e.; worse: draws with D > 0). "
                f"u(x) = mean + {reg.t} s.e. Margins: non-inferior if u(D) < {MARGIN} pt; where the single batch "
                "lies outside the noise floor (the paper's bias-free split detectably closer: u(M_paper − M_single) "
                f"< 0) also better (u(D) < 0); within the margin of the cell's best, u(M − M_best) < {MARGIN} pt.", ""]
    else:
        head = ["# Pre-registered evaluation of the two-batch K-FAC estimates (benchmarks/PROTOCOL.md)", "",
                "Written by `python benchmarks/protocol_summary.py` from the caches of the commands in "
                "PROTOCOL.md. M: largest relative test-NLL gap to full-batch K-FAC over δ (points, mean ± s.e. "
                "over draws). D: M − M(single) on the same draw (mean ± s.e.; worse: draws with D > 0). "
                f"Margins: non-inferior if mean(D) + {T15} s.e. < {MARGIN} pt; where the single batch lies "
                f"outside the noise floor (mean − 2 s.e. > {FLOOR} pt) also better (upper bound < 0).", ""]
    lines = head
    for setting, bs in cells.items():
        state = "finished" if finished[setting] else (f"**not finished** (fewer than {reg.draws} draws in some cell; "
                                                      "not in the decision)")
        lines += _setting_lines(setting, bs, state, second)
    lines += ["## Decision (finished settings only)", "",
              f"- eligible: {', '.join(decision['eligible']) or 'none'}",
              "- worst-case paired loss W (pt): " + ", ".join(f"{k} {v:+.2f}" for k, v in decision["W"].items())]
    if second:
        lines.append("- worst-case regret to the best R (pt): " + ", ".join(f"{k} {v:+.2f}" for k, v in decision["R"].items()))
    lines += [f"- default: **{decision['default']}** ({decision['why']})", ""]
    if first_decision is not None:
        lines += ["The first registration's margins and criterion on this run (reported, not deciding): eligible "
                  f"{', '.join(first_decision['eligible']) or 'none'}; default **{first_decision['default']}** "
                  f"({first_decision['why']}).", ""]
    lines.append(f"Per-δ paired differences (candidate − single, signed gaps, points): `{reg.stem}.json`.")
    return "\n".join(lines) + "\n"


def summarise(reg: Registration, root: Path) -> dict:
    """Registration ``reg``'s cells from the caches under ``root``, which settings have finished
    (every b of the setting with ``reg.draws`` draws for every candidate), and the decision over
    the finished ones (with the first registration's, reported, for the later ones)."""
    raw = {"digits CNN (setting 1)": (digits_cnn(root / reg.cnn), SIZES),
           "digits MLP (setting 2)": (per_draw_files(root / reg.mlp), SIZES)}
    for later in reg.later:
        raw[later.name] = (per_draw_files(root / later.cache, later.sizes), later.sizes)
    cells = {s: {b: cell(curves, reg.t) for b, curves in bs.items()} for s, (bs, _) in raw.items() if bs}
    finished = {s: set(bs) == set(raw[s][1]) and all(c["draws"] >= reg.draws for c in bs.values())
                for s, bs in cells.items()}
    done = {s: bs for s, bs in cells.items() if finished[s]}
    first = decide(done)
    decision, first_decision = (decide_v2(done), first) if reg.number >= 2 else (first, None)
    return {"cells": cells, "finished": finished, "decision": decision, "first_decision": first_decision}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registration", type=int, choices=sorted(REGISTRATIONS), default=1)
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/laplace-debiased-study"))
    args = parser.parse_args(argv)
    reg = REGISTRATIONS[args.registration]
    out = summarise(reg, args.cache.expanduser())
    cells, finished, decision, first_decision = out["cells"], out["finished"], out["decision"], out["first_decision"]
    record = {"cells": {s: {str(b): c for b, c in bs.items()} for s, bs in cells.items()}, "finished": finished,
              "decision": decision}
    if first_decision is not None:
        record["first_registration_decision"] = first_decision
    (HERE / "results" / f"{reg.stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(cells, finished, decision, reg, first_decision)
    (HERE / "results" / f"{reg.stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

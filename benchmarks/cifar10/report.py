"""The Markdown report of a benchmark run (``results.md``): every number from ``results.json``."""

from __future__ import annotations

import numpy as np

from .config import BASE_GRID, grid_index
from .evaluate import CORRUPTED

#: (family, position in the family) of each method: single batch, debiased, corrected, shrunk, stein, full batch
_ORDER = {"kron": (0, 0), "debiased_kron": (0, 1), "corrected_kron": (0, 2), "shrunk_kron": (0, 3), "stein_kron": (0, 4),
          "kron-full": (0, 5),
          "lowrank_ll": (1, 0), "debiased_lowrank_ll": (1, 1), "lowrank_ll-full": (1, 5)}


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _ci(d: dict, which: str) -> str:
    lo, hi = d[f"{which}_ci"]
    return f"{_pct(d[which])} [{_pct(lo)}, {_pct(hi)}]"


def markdown(meta: dict, methods: dict, summary: dict, res: dict, tgt: list[dict]) -> str:
    cfg = meta["config"]
    # per family, by sample count, single batch next to debiased; full batch last
    order = sorted(methods, key=lambda n: (_ORDER[methods[n]["method"]][0], methods[n]["b"] or np.inf,
                                           _ORDER[methods[n]["method"]][1]))
    mt, mtr = meta["map_test"], meta["map_train"]
    grid = meta["grid"]
    L = [f"# CIFAR-10 Laplace benchmark ({'quick' if cfg['quick'] else 'full'} mode)", "",
         f"**MAP** `{cfg['model']}` ({meta['n_params']:,} parameters) trained {meta['train_epochs']} epochs on "
         f"{meta['n_train']:,} training images: train NLL {mtr['nll']:.4f}, ECE {_pct(mtr['ece'])} pt, "
         f"acc. {_pct(mtr['accuracy'])} %; test (all {meta['n_test_all']:,} images) NLL {mt['nll']:.4f}, "
         f"ECE {_pct(mt['ece'])} pt, acc. {_pct(mt['accuracy'])} %.", "",
         f"**Evaluation:** {meta['set_sizes']}; MC linearized predictive, {cfg['mc_samples']} samples; "
         f"{cfg['repeats']} batch draws per mini-batch method; {cfg['n_boot']} paired bootstrap resamples of "
         f"the test images. Grid: {len(grid)} prior precisions {grid[0]:.3g} ... {grid[-1]:.3g} (the paper's "
         f"{len(BASE_GRID)} plus {len(grid) - len(BASE_GRID)} added until every validation optimum was interior"
         f"{'' if meta['grid_interior'] else ' -- limit reached, see (c)'}). {meta['device']}. "
         f"Wall time {meta['wall_seconds'] / 60:.0f} min.", ""]
    for grid_name, key in (("the paper's grid (1e-4 ... 1, 10)", "tracking_paper_grid"),
                           ("the whole evaluated grid", "tracking_full_grid")):
        tr = summary[key]
        L += [f"## (a) Tracking error on the test set over {grid_name}", "",
              "Per draw the maximum over the grid of the gap to the method's full-batch reference (K-FAC rows: "
              "full-batch K-FAC; last-layer low-rank rows: the rank-k LA of the full-data last-layer GGN); "
              "mean and worst over draws with 95 % paired bootstrap intervals (a simultaneous band of the signed "
              "gaps over grid points and draws, carried through the maximum). NLL gaps relative in %, ECE and "
              "accuracy gaps absolute in percentage points. Noise floor: the same gaps between two MC seeds of "
              "the full-batch K-FAC LA.", "",
              "| method | rel. NLL gap mean [%] | worst draw [%] | ECE gap mean [pt] | worst [pt] | acc. gap mean [pt] | worst [pt] |",
              "|---|---|---|---|---|---|---|"]
        for n in order + ["noise_floor"]:
            if n not in tr:
                continue
            t = tr[n]
            label = "MC noise floor (full-batch K-FAC, 2 seeds)" if n == "noise_floor" else methods[n]["label"]
            L.append(f"| {label} | " + " | ".join(f"{_ci(t[m], 'mean')} | {_ci(t[m], 'worst')}"
                                                    for m in ("nll_rel", "ece", "accuracy")) + " |")
        L.append("")
    L += ["### Tracking on the corrupted sets (max rel. NLL gap over the paper's grid, mean over draws, %)", "",
          "| method | " + " | ".join(f"severity {s[1:]}" for s in CORRUPTED) + " |", "|---|" + "---|" * len(CORRUPTED)]
    mask = [grid_index(grid, d) for d in BASE_GRID]
    for n in order:
        e = methods[n]
        if e["reference"] is None:
            continue
        cells = []
        for s in CORRUPTED:
            ref = np.array(res[e["reference"]][s]["nll"])[mask]
            gaps = [np.max(np.abs(np.array(res[k][s]["nll"])[mask] - ref) / ref) for k in e["keys"]]
            cells.append(_pct(float(np.mean(gaps))))
        L.append(f"| {e['label']} | " + " | ".join(cells) + " |")
    L += ["", "## (b) At the validation-chosen prior precision (test metrics; mean over draws)", "",
          "Chosen on the validation images by NLL (`val_nll`) or by the Laplace marginal likelihood of the training "
          "data (`marglik`), never on test. Steps: grid steps from the full-batch reference's choice (per draw).", "",
          "| method | criterion | δ (per draw) | steps from full batch | test NLL | test ECE [pt] | test acc. [%] | "
          "NLL sev. 3 | NLL sev. 5 | AUROC sev. 5 | AUROC OOD |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    m = res["map"]
    L.append(f"| MAP | - | - | - | {m['test']['nll']:.4f} | {_pct(m['test']['ece'])} | {_pct(m['test']['accuracy'])} | "
             f"{m['c3']['nll']:.4f} | {m['c5']['nll']:.4f} | {m['c5']['auroc']:.4f} | {m['ood']['auroc']:.4f} |")
    for n in order:
        e = methods[n]
        for crit in ("val_nll", "marglik"):
            sels = [summary["selected"][k].get(crit) for k in e["keys"]]
            if not all(sels):
                continue
            ref = summary["selected"].get(e["reference"] or "", {}).get(crit)
            steps = "-" if ref is None else str([abs(s["index"] - ref["index"]) for s in sels])
            at = lambda s, met: np.mean([res[k][s][met][sel["index"]] for k, sel in zip(e["keys"], sels)])  # noqa: E731
            flag = "" if all(s["interior"] for s in sels) else " (edge)"
            deltas = ", ".join(f"{s['prior_precision']:.3g}" for s in sels)
            L.append(f"| {e['label']} | {crit} | {deltas}{flag} | {steps} | "
                     f"{at('test', 'nll'):.4f} | {_pct(at('test', 'ece'))} | {_pct(at('test', 'accuracy'))} | "
                     f"{at('c3', 'nll'):.4f} | {at('c5', 'nll'):.4f} | {at('c5', 'auroc'):.4f} | {at('ood', 'auroc'):.4f} |")
    L += ["", "## (c) Fit cost (same run; single-batch and debiased fits of a draw back to back, after an "
          "untimed warm-up fit of each)", "",
          "| method | fit time [s] (mean) | debiased / single (median of pairs) | peak RSS increase [MiB] (mean) |",
          "|---|---|---|---|"]
    for n in order:
        e = methods[n]
        ratio = e.get("time_ratio_vs_single")
        L.append(f"| {e['label']} | {e['seconds_mean']:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | {e['peak_mib_mean']:.1f} |")
    if meta["fits_loaded_from_cache"]:
        L += ["", f"Fits loaded from the cache (times from the run that fitted them): {len(meta['fits_loaded_from_cache'])}."]
    L += _coverage(methods, order)
    L += ["", "## Targets (the equal-sample targets on the whole evaluated grid)", "", "| target | measured | met |", "|---|---|---|"]
    for t in tgt:
        verdict = "met" if t["met"] else "**missed**"
        L.append(f"| {t['target']} | {t['measured']} | {verdict} |")
    L += ["", "Figures: " + ", ".join(f"[`{p}`]({p})" for p in meta["figures"]), ""]
    return "\n".join(L)


def _coverage(methods: dict, order: list[str]) -> list[str]:
    """The K-FAC weight factors' dimension and numerical rank: full batch, and per debiased row
    (first draw) the ranks of B, B̃ and B ∪ B̃, the debiased eigenvalues that are zero, and the
    share of the block's weights whose only curvature is the prior."""
    full = next((m["coverage"] for m in methods.values() if m["method"] == "kron-full" and m.get("coverage")), None)
    debs = [n for n in order if methods[n]["method"] == "debiased_kron" and methods[n].get("coverage")]
    if full is None or not debs:
        return []
    L = ["", "## (d) Curvature coverage of the K-FAC weight factors (first draw)", "",
         "Numerical ranks (eigenvalues above round-off). Debiased cells: rank B / rank B̃ / rank B ∪ B̃, "
         "then the debiased eigenvalues that are zero; last columns: the share of the block's weights whose "
         "only curvature is the prior (variance 1/δ).", "",
         "| layer | factor | dim. | full-batch rank | " + " | ".join(methods[n]["label"] for n in debs)
         + " | " + " | ".join(f"prior-only [%], {methods[n]['b']:,} samples" for n in debs) + " |",
         "|---|---|---|---|" + "---|" * (2 * len(debs))]
    key = lambda r: (r["layer"], r["parameter"], r["factor"])  # noqa: E731
    rows = {n: {key(r): r for r in methods[n]["coverage"]} for n in debs}
    for f in full:
        if f["parameter"] != "weight":
            continue
        cells = [rows[n].get(key(f)) for n in debs]
        L.append(f"| {f['layer']} | {f['factor']} | {f['dimension']} | {f['rank']} | " + " | ".join(
            "-" if c is None else f"{c['rank_B']} / {c['rank_B~']} / {c['rank_B∪B~']}, {c['zero_eigenvalues']} zero"
            for c in cells) + " | " + " | ".join("-" if c is None else f"{100 * c['prior_only_share']:.1f}" for c in cells) + " |")
    return L

"""From predictive probabilities to the benchmark's numbers: metric curves, prior selection on
validation data, tracking error with paired bootstrap intervals and the MC noise floor, targets.

Conventions: NLL is the mean negative log-likelihood (nats); ECE has 15 equal-width confidence
bins (l1, as ``laplace_debiased.evaluation.metrics.ece``); relative NLL gaps are
``|NLL_method - NLL_full| / NLL_full``; ECE and accuracy gaps are absolute, reported in
percentage points.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from laplace_debiased.evaluation import metrics as M
from laplace_debiased.evaluation.tracking import max_abs_interval
from laplace_debiased.prior_grid import PriorGrid

from .config import WIDE_GRID, grid_index
from .fits import Fit

N_BINS = M.ECE_BINS
CORRUPTED = ("c1", "c2", "c3", "c4", "c5")


# ---------------------------------------------------------------------------------------------
# Per-image statistics and metrics that can be bootstrapped
# ---------------------------------------------------------------------------------------------
def per_image(P: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``P`` ``(G, N, C)`` -> ``logp`` (log-probability of the label), ``conf`` (top-class
    probability), ``correct`` and ``bin`` (ECE bin of ``conf``), each ``(G, N)``."""
    logp = P.gather(2, y[None, :, None].expand(P.shape[0], -1, 1)).squeeze(2).double().clamp_min(1e-12).log()
    conf, pred = P.max(-1)
    edges = torch.linspace(0, 1, N_BINS + 1, dtype=torch.float64)[1:-1]
    return {"logp": logp, "conf": conf.double(), "correct": (pred == y).double(),
            "bin": torch.bucketize(conf.double(), edges, right=True).clamp(0, N_BINS - 1)}


def stats(pi: dict[str, torch.Tensor], idx: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """NLL, ECE and accuracy ``(G,)`` of :func:`per_image` output, on the images ``idx``
    (a bootstrap resample; all images if None)."""
    if idx is not None:
        pi = {k: v[:, idx] for k, v in pi.items()}
    G, N = pi["conf"].shape
    count = torch.zeros(G, N_BINS, dtype=torch.float64).scatter_add_(1, pi["bin"], torch.ones_like(pi["conf"]))
    conf = torch.zeros(G, N_BINS, dtype=torch.float64).scatter_add_(1, pi["bin"], pi["conf"])
    acc = torch.zeros(G, N_BINS, dtype=torch.float64).scatter_add_(1, pi["bin"], pi["correct"])
    return {"nll": (-pi["logp"].mean(1)).numpy(), "ece": ((conf - acc).abs().sum(1) / N).numpy(),
            "accuracy": pi["correct"].mean(1).numpy()}


def curves(probs: dict, maps: dict, sets: dict) -> dict:
    """``res[probs_key][set][metric]`` ``(G,)`` lists and ``res["map"][set][metric]``; AUROC of
    each corrupted set and of the OOD set against the test set (predictive entropy; the first
    ``len(set)`` test images, the clean copies of the corrupted ones)."""
    res: dict = defaultdict(dict)
    for s, (_, y) in sets.items():
        for key, P in probs[s].items():
            r = {k: v.tolist() for k, v in stats(per_image(P, y)).items()} if s != "ood" else {}
            if s != "test" and s != "val":
                n = len(y)
                r["auroc"] = [M.ood_metrics(probs["test"][key][g][:n], P[g])["auroc"] for g in range(len(P))]
            res[key][s] = r
        res["map"][s] = M.classification_metrics(maps[s], y) if s != "ood" else {}
        if s not in ("test", "val"):
            res["map"][s]["auroc"] = M.ood_metrics(maps["test"][: len(y)], maps[s])["auroc"]
    return dict(res)


# ---------------------------------------------------------------------------------------------
# Prior selection on validation data
# ---------------------------------------------------------------------------------------------
def marglik_on(grid: list[float], fit: Fit) -> list[float] | None:
    if fit.log_marglik is None:
        return None
    return [fit.log_marglik[grid_index(WIDE_GRID, d)] for d in grid]


def select(res_fit: dict, fit: Fit, grid: list[float]) -> dict:
    """δ chosen by validation NLL and by the marginal likelihood: index, value, whether interior."""
    out = {}
    choices = PriorGrid(tuple(grid))
    g = grid.index(choices.choose(res_fit["val"]["nll"]))
    out["val_nll"] = {"index": g, "prior_precision": grid[g], "interior": 0 < g < len(grid) - 1}
    ml = marglik_on(grid, fit)
    if ml is not None and np.all(np.isfinite(ml)):
        g = grid.index(choices.choose(ml, "log_marglik"))
        out["marglik"] = {"index": g, "prior_precision": grid[g], "interior": 0 < g < len(grid) - 1}
    return out


def extension_needed(val_nll: dict[str, list[float]], fits: list[Fit], grid: list[float]) -> tuple[bool, bool]:
    """Whether some method's validation optimum (by NLL or marglik) sits on the lower / upper
    edge of ``grid``: ``val_nll[fit.key]`` are the validation NLLs on ``grid``."""
    low = high = False
    choices = PriorGrid(tuple(grid))
    for fit in fits:
        idx = [grid.index(choices.choose(val_nll[fit.key]))]
        ml = marglik_on(grid, fit)
        if ml is not None and np.all(np.isfinite(ml)):
            idx.append(grid.index(choices.choose(ml, "log_marglik")))
        low |= 0 in idx
        high |= len(grid) - 1 in idx
    return low, high


# ---------------------------------------------------------------------------------------------
# Tracking error vs the full-batch LA, with paired bootstrap and the MC noise floor
# ---------------------------------------------------------------------------------------------
def _signed_gaps(m: dict, ref: dict, grid_mask: np.ndarray) -> dict[str, np.ndarray]:
    """Signed gaps at the grid points ``grid_mask``: relative NLL ``(NLL_m - NLL_ref) / NLL_ref``,
    ECE and accuracy ``m - ref``; each ``(G,)``. Their absolute maximum is the tracking error."""
    return {"nll_rel": ((m["nll"] - ref["nll"]) / ref["nll"])[grid_mask],
            "ece": (m["ece"] - ref["ece"])[grid_mask],
            "accuracy": (m["accuracy"] - ref["accuracy"])[grid_mask]}


def tracking(probs: dict, sets: dict, groups: dict[str, list[Fit]], full_key: str, ref_of: dict[str, str],
             grid_mask: np.ndarray, n_boot: int, seed: int, set_name: str = "test") -> dict:
    """Per method: per-draw max gap over the grid, its mean and worst over draws, and 95 %
    bootstrap intervals of both (test images resampled with replacement, the same resample for
    the method and its reference; a simultaneous band of the signed gaps over grid points and
    draws carried through the maximum, :func:`~laplace_debiased.evaluation.tracking.max_abs_interval`,
    since percentiles of a resampled maximum can exclude its point estimate); ``"noise_floor"``:
    the same gaps between two MC streams of the full-batch K-FAC LA. ``ref_of[name]``: the probs
    key of each method's reference."""
    y = sets[set_name][1]
    P = probs[set_name]
    pis = {k: per_image(v, y) for k, v in P.items()}
    gen = torch.Generator().manual_seed(seed)
    boots = [torch.randint(0, len(y), (len(y),), generator=gen) for _ in range(n_boot)]
    point = {k: stats(v) for k, v in pis.items()}
    boot = {k: [stats(v, i) for i in boots] for k, v in pis.items()}

    def summarise(draw_keys: list[str], ref: str) -> dict:
        signed = [_signed_gaps(point[k], point[ref], grid_mask) for k in draw_keys]
        per_draw = [{m: float(np.max(np.abs(v))) for m, v in d.items()} for d in signed]
        row: dict = {"per_draw": per_draw}
        for metric in ("nll_rel", "ece", "accuracy"):
            vals = [d[metric] for d in per_draw]
            bm = np.array([[_signed_gaps(boot[k][b], boot[ref][b], grid_mask)[metric] for k in draw_keys]
                           for b in range(n_boot)])  # (n_boot, draws, grid points)
            lower, upper = max_abs_interval(np.array([d[metric] for d in signed]), bm)
            row[metric] = {"mean": float(np.mean(vals)), "worst": float(np.max(vals)),
                           "mean_ci": [float(lower.mean()), float(upper.mean())],
                           "worst_ci": [float(lower.max()), float(upper.max())]}
        return row

    out = {name: summarise([f.key for f in fits], ref_of[name]) for name, fits in groups.items()}
    out["noise_floor"] = summarise([f"{full_key}@mc1"], full_key)
    return out


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------
def targets(summary: dict, res: dict, groups: dict[str, list[Fit]], full_key: str, target_b: int) -> list[dict]:
    """The benchmark's targets, each with ``met`` True or False."""
    out: list[dict] = []
    tr = summary["tracking_paper_grid"]
    floor = tr["noise_floor"]
    name = f"debiased_kron-{target_b}"
    if name in tr:
        for metric, tol, unit in (("nll_rel", 0.01, "%"), ("ece", 0.01, " pt")):
            m, f = tr[name][metric], floor[metric]["mean"]
            out.append({"target": f"debiased K-FAC 2x{target_b // 2}: max {'rel. NLL' if metric == 'nll_rel' else 'ECE'} "
                                  f"gap over the grid <= {100 * tol:g}{unit} beyond the MC noise floor",
                        "measured": f"{100 * m['mean']:.2f}{unit} (95 % CI {100 * m['mean_ci'][0]:.2f}-{100 * m['mean_ci'][1]:.2f}; "
                                    f"worst draw {100 * m['worst']:.2f}{unit}); noise floor {100 * f:.2f}{unit}",
                        "met": bool(m["mean"] <= tol + f)})
    map_ = res["map"]
    for name, fits in groups.items():
        for crit in ("val_nll", "marglik"):
            sels = [summary["selected"][f.key].get(crit) for f in fits]
            if not all(sels):
                continue
            def at(s, metric, f_key_sel):
                return float(np.mean([res[f.key][s][metric][sel["index"]] for f, sel in f_key_sel]))
            pairs = list(zip(fits, sels))
            checks = {"test NLL": (at("test", "nll", pairs), map_["test"]["nll"]),
                      "test ECE": (at("test", "ece", pairs), map_["test"]["ece"])}
            for s in ("c3", "c4", "c5"):
                checks[f"{s} NLL"] = (at(s, "nll", pairs), map_[s]["nll"])
            beaten = {k: v[0] < v[1] for k, v in checks.items()}
            out.append({"target": f"{fits[0].extra.get('label', name)} at its {crit}-chosen δ beats the MAP on test NLL, "
                                  "test ECE and corrupted NLL at severity 3-5",
                        "measured": "; ".join(f"{k} {100 * v[0]:.2f} pt vs {100 * v[1]:.2f} pt" if "ECE" in k
                                              else f"{k} {v[0]:.4f} vs {v[1]:.4f}" for k, v in checks.items())
                                    + " (LA vs MAP)",
                        "met": all(beaten.values())})
    for family, full in (("kron", full_key), ("lowrank_ll", "lowrank_ll-full#None")):
        if full not in summary["selected"]:
            continue
        for b in sorted({f.b for fits in groups.values() for f in fits if f.method == family}):
            deb, single = groups.get(f"debiased_{family}-{b}"), groups.get(f"{family}-{b}")
            if not deb or not single:
                continue
            for crit in ("val_nll", "marglik"):
                ref = summary["selected"][full].get(crit)
                if ref is None:
                    continue
                dist = lambda fits: [abs(summary["selected"][f.key][crit]["index"] - ref["index"]) for f in fits]  # noqa: E731
                d_deb, d_single = dist(deb), dist(single)
                out.append({"target": f"{family} {crit}: {deb[0].extra.get('label', 'debiased')} δ within one grid step "
                                      f"of the full-batch choice ({ref['prior_precision']:.3g}) in every draw, "
                                      f"{single[0].extra.get('label', f'single-batch b={b}')} not",
                            "measured": f"grid steps from the full-batch choice: debiased {d_deb}, single-batch {d_single}",
                            "met": bool(max(d_deb) <= 1 and min(d_single) > 1)})
    return out



def equal_sample_targets(tracking: dict, methods: dict, full_seconds: float) -> list[dict]:
    """The equal-sample targets for every debiased K-FAC row, on ``tracking`` (one grid's
    :func:`tracking`): within 1 % relative NLL and 1 pt ECE of full batch beyond the MC noise
    floor; a smaller mean gap than the single batch of the same samples (NLL and ECE); a fit
    costing at most 1/10 of the full-batch fit (``full_seconds``)."""
    out: list[dict] = []
    floor = tracking["noise_floor"]
    fmt = lambda t, unit: f"{100 * t['mean']:.2f}{unit} [{100 * t['mean_ci'][0]:.2f}, {100 * t['mean_ci'][1]:.2f}]"  # noqa: E731
    for name, e in methods.items():
        single = name.replace("debiased_", "", 1)
        if e["method"] != "debiased_kron" or name not in tracking or single not in tracking:
            continue
        deb, ref = tracking[name], tracking[single]
        for metric, unit in (("nll_rel", "%"), ("ece", " pt")):
            what = "rel. NLL" if metric == "nll_rel" else "ECE"
            out.append({"target": f"{e['label']}: max {what} gap to full batch over the whole grid <= 1{unit} "
                                  "beyond the MC noise floor",
                        "measured": f"{fmt(deb[metric], unit)}; noise floor {100 * floor[metric]['mean']:.2f}{unit}",
                        "met": bool(deb[metric]["mean"] <= 0.01 + floor[metric]["mean"])})
            out.append({"target": f"{e['label']}: smaller max {what} gap over the whole grid than "
                                  f"{methods[single]['label']} (the same {e['b']:,} samples)",
                        "measured": f"{fmt(deb[metric], unit)} vs {fmt(ref[metric], unit)}",
                        "met": bool(deb[metric]["mean"] < ref[metric]["mean"])})
        out.append({"target": f"{e['label']}: fit costs <= 1/10 of the full-batch fit",
                    "measured": f"{e['seconds_mean']:.2f} s vs {full_seconds:.2f} s "
                                f"({e['seconds_mean'] / full_seconds:.3f})",
                    "met": bool(e["seconds_mean"] <= full_seconds / 10)})
    return out

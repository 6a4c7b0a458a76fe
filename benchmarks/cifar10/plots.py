"""Figures of the benchmark (PNG): metric vs prior precision (paper Fig. 6), reliability diagrams
with bin counts at the chosen δ, AUROC vs corruption severity (and the OOD set).

``python -m benchmarks.cifar10.plots DIR`` redraws the Fig. 6 tracking figures of a finished run
from its ``DIR/results.json`` (the curves of every fit are stored there), without refitting."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from laplace_debiased.evaluation import metrics as M

COLORS = {"kron": "tab:red", "debiased_kron": "tab:blue", "corrected_kron": "tab:green", "shrunk_kron": "tab:purple",
          "stein_kron": "tab:brown", "kron-full": "black",
          "lowrank_ll": "tab:orange", "debiased_lowrank_ll": "tab:green", "lowrank_ll-full": "tab:purple"}
#: several batch sizes of one method: one colour map, lighter and dotted for smaller b
SHADES = {"kron": "Reds", "debiased_kron": "Blues", "corrected_kron": "Greens", "shrunk_kron": "Purples", "stein_kron": "YlOrBr",
          "lowrank_ll": "Oranges", "debiased_lowrank_ll": "Greens"}
STYLES = (":", "--", "-")
YLABELS = {"nll": "NLL (nats per image)", "ece": "ECE (fraction)", "accuracy": "accuracy (fraction)",
           "auroc": "AUROC (entropy score)"}
FAMILIES = {"kron": ("kron", "debiased_kron", "corrected_kron", "shrunk_kron", "stein_kron", "kron-full"),
            "lowrank_ll": ("lowrank_ll", "debiased_lowrank_ll", "lowrank_ll-full")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "legend.fontsize": 9})
    return plt


def _line_styles(plt, fits: list) -> dict:
    """Colour and line style per mini-batch group: the method's colour when it has one batch
    size, else shades of its colour map and dotted/dashed/solid from the smallest b up."""
    out = {}
    for method in dict.fromkeys(f.method for f in fits):
        members = sorted((f for f in fits if f.method == method), key=lambda f: f.b or 0)
        for i, f in enumerate(members):
            name = f.name
            if len(members) == 1:
                out[name] = (COLORS[method], "-")
            else:
                shade = plt.get_cmap(SHADES[method])(0.45 + 0.5 * i / (len(members) - 1))
                out[name] = (shade, STYLES[max(0, len(STYLES) - len(members) + i)] if len(members) <= 3 else "-")
    return out


def tracking_figures(groups: dict, fulls: dict, res: dict, grid: list[float], out: Path) -> list[str]:
    """Per family: test NLL / ECE / accuracy, severity-3 and -5 NLL and OOD AUROC against δ;
    mini-batch methods as mean with min/max band over draws, full batch as markers (its second
    MC stream as open markers: the noise floor), MAP dashed."""
    plt = _plt()
    panels = [("test", "nll"), ("test", "ece"), ("test", "accuracy"), ("c3", "nll"), ("c5", "nll"), ("ood", "auroc")]
    paths = []
    for fam, members in FAMILIES.items():
        names = sorted((n for n, fits in groups.items() if fits[0].method in members),
                       key=lambda n: (members.index(groups[n][0].method), groups[n][0].b or 0))
        full = fulls.get(f"{fam}-full")
        if not names or full is None:
            continue
        fig, axes = plt.subplots(2, 3, figsize=(14, 8))
        styles = _line_styles(plt, [groups[n][0] for n in names])
        for ax, (s, m) in zip(axes.flat, panels):
            for n in names:
                fits = groups[n]
                Y = np.array([res[f.key][s][m] for f in fits])
                c, ls = styles[n]
                ax.plot(grid, Y.mean(0), color=c, ls=ls, label=fits[0].extra["label"])
                ax.fill_between(grid, Y.min(0), Y.max(0), color=c, alpha=0.15)
            ax.plot(grid, res[full.key][s][m], "x", color=COLORS[full.method], ms=7, label=full.extra["label"])
            if f"{full.key}@mc1" in res:
                ax.plot(grid, res[f"{full.key}@mc1"][s][m], "o", mfc="none", color="gray", ms=7,
                        label="full batch, 2nd MC seed")
            ax.axhline(res["map"][s][m], color="gray", ls="--", label="MAP")
            ax.set_xscale("log")
            if m == "nll":
                ax.set_yscale("log")
            ax.set_xlabel("prior precision δ")
            ax.set_ylabel(YLABELS[m])
            where = {"test": "test", "ood": "OOD (scrambled) vs test"}.get(s, f"corrupted, severity {s[1:]}")
            ax.set_title(f"{m.upper() if m != 'accuracy' else m} — {where}")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), frameon=False)
        fig.suptitle(f"CIFAR-10: {fam} Laplace vs prior precision (mean and min/max over draws)")
        fig.tight_layout(rect=(0, 0.06, 1, 0.97))
        p = out / f"fig6_{fam}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p.name)
    return paths


def reliability_figure(chosen: dict, map_probs, y, out: Path) -> str:
    """One panel per method at its validation-chosen δ (first draw), MAP overlaid; below each
    panel the number of test images per confidence bin.  ``chosen[label] = (probs (N, C), δ)``."""
    plt = _plt()
    n = len(chosen)
    cols = 3
    rows = -(-n // cols)
    height = 5.2 * rows
    fig = plt.figure(figsize=(4.6 * cols, height))
    # the top margin in inches, not a fraction: room for the title whatever the number of rows
    gs = fig.add_gridspec(2 * rows, cols, height_ratios=[3, 1] * rows, hspace=0.65, wspace=0.3, top=1 - 0.8 / height)
    ref = M.reliability_bins(map_probs, y)
    centers = (np.array(ref["edges"][:-1]) + np.array(ref["edges"][1:])) / 2
    width = 1 / len(centers)
    for i, (label, (P, delta)) in enumerate(chosen.items()):
        r, c = divmod(i, cols)
        ax, axc = fig.add_subplot(gs[2 * r, c]), fig.add_subplot(gs[2 * r + 1, c])
        rb = M.reliability_bins(P, y)
        ax.plot([0, 1], [0, 1], color="lightgray", lw=1)
        ax.plot(ref["confidence"], ref["accuracy"], "s--", color="gray", ms=4,
                label=f"MAP (ECE {100 * M.ece(map_probs, y):.1f} pt)")
        ax.plot(rb["confidence"], rb["accuracy"], "o-", color="tab:blue", ms=4,
                label=f"LA, δ={delta:.3g} (ECE {100 * M.ece(P, y):.1f} pt)")
        ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy", title=label)
        ax.legend(loc="upper left")
        axc.bar(centers - width / 4, ref["count"], width / 2, color="gray", label="MAP")
        axc.bar(centers + width / 4, rb["count"], width / 2, color="tab:blue", label="LA")
        axc.set(xlim=(0, 1), yscale="log", xlabel="confidence (top-class probability)", ylabel="images")
        axc.yaxis.set_minor_formatter("")  # decades only: minor labels overlap
    fig.suptitle(f"Reliability on the CIFAR-10 test set ({len(y):,} images, 15 bins)")
    p = out / "reliability.png"
    fig.savefig(p, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return p.name


def auroc_figure(rows: dict, map_row: list[float], out: Path) -> str:
    """AUROC (test vs shifted set, predictive entropy) against corruption severity 1-5 and the
    OOD set; ``rows[label] = AUROCs`` at the method's chosen δ (δ in the label)."""
    plt = _plt()
    x = np.arange(1, 7)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, vals in rows.items():
        ax.plot(x, vals, "o-", label=label)
    ax.plot(x, map_row, "s--", color="gray", label="MAP")
    ax.set_xticks(x, ["1", "2", "3", "4", "5", "OOD\n(scrambled)"])
    ax.set(xlabel="corruption severity", ylabel="AUROC vs clean test (entropy)",
           title="Detecting shifted inputs, each LA at its validation-NLL-chosen δ")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "auroc_severity.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p.name


def replot_tracking(folder: Path) -> list[str]:
    """Redraw ``fig6_*.png`` in ``folder`` from its ``results.json``."""
    run = json.loads((folder / "results.json").read_text())
    groups, fulls = {}, {}
    for name, entry in run["methods"].items():
        fits = [SimpleNamespace(name=name, method=entry["method"], b=entry["b"], key=key,
                                extra={"label": entry["label"]}) for key in entry["keys"]]
        if entry["method"].endswith("-full"):
            fulls[entry["method"]] = fits[0]
        else:
            groups[name] = fits
    return tracking_figures(groups, fulls, run["curves"], run["meta"]["grid"], folder)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["benchmarks/results"]:
        print(arg, replot_tracking(Path(arg)))

"""Single batch, the paper's debiased split and the corrected estimate at equal samples on the
main job's embedded digits (N = 300), for several batch sizes.

    OMP_NUM_THREADS=1 python benchmarks/digits_estimators.py [--batch-sizes 32 64 128] [--repeats 3] [--out DIR]
        [--seed S] [--links probit_projected ...] [--name digits_estimators]

Runs the main job (``python -m laplace_debiased``) once per batch size b with the methods
kron_single (b samples), kron_debiased, kron_corrected (the default), kron_shrunk and kron_stein
(two halves of b/2) and kron_full, ``--repeats`` draws
each (default 3; ``--seed`` seeds the MAP and the draws, default 0), into ``DIR/b<b>/``, then writes
``results/<name>.{json,md,png}`` (default name ``digits_estimators``): per method and b
the largest relative test-NLL gap and ECE gap to the full batch over the whole δ grid (projected
probit), mean and range over the draws, and per two-batch method its paired difference to the
single batch (the same draws: mean ± standard error, and in how many draws it was worse); then
the signed gap at each δ (a table for the single batch and the default, and
``results/digits_estimators.png`` for every method), which shows where on the grid each errs. The
probit predictive is deterministic, so there is no MC noise floor; the spread over draws is the noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from laplace_debiased.evaluation.report_figures import save_signed_gap_figure
from laplace_debiased.evaluation.report_tables import mean_stderr_text
from laplace_debiased.evaluation.sweep import load_rows
from laplace_debiased.evaluation.tracking import (curves_from_json, curves_to_json, gap_curves, max_gap_per_draw,
                                                  where_largest)

HERE = Path(__file__).resolve().parent
METHODS = ("kron_single", "kron_debiased", "kron_corrected", "kron_shrunk", "kron_stein")
LABELS = {"kron_single": "single batch b", "kron_debiased": "paper 2 × b/2",
          "kron_corrected": "corrected 2 × b/2 (default)", "kron_shrunk": "shrunk 2 × b/2", "kron_stein": "stein 2 × b/2"}
LINK = "probit_projected"


def run_main_job(b: int, out: Path, repeats: int, seed: int = 0, links: list[str] | None = None) -> None:
    """The main job at batch size ``b`` with ``repeats`` draws per method into ``out`` (resumes an
    interrupted run there), seeded by ``seed``, with the main job's default links or ``links``."""
    cmd = [sys.executable, "-m", "laplace_debiased", "--out", str(out), "--threads", "1", "--quiet",
           "--batch-size", str(b), "--repeats", str(repeats), "--seed", str(seed), "--methods", *METHODS, "kron_full"]
    if links:
        cmd += ["--links", *links]
    subprocess.run(cmd, check=True)


def marglik_test_nll(rows: list[dict], method: str) -> list[float]:
    """Per draw of ``method``: the test NLL at the δ of the highest log marginal likelihood."""
    marglik: dict[int, dict[float, float]] = {}
    test: dict[int, dict[float, float]] = {}
    for r in rows:
        if r["method"] != method or r.get("link") != LINK or r["prior_precision"] is None:
            continue
        if r.get("log_marglik") is not None:
            marglik.setdefault(r["repeat"], {})[r["prior_precision"]] = r["log_marglik"]
        if r["eval_set"] == "test":
            test.setdefault(r["repeat"], {})[r["prior_precision"]] = r["nll"]
    return [test[rep][max(ml, key=ml.get)] for rep, ml in sorted(marglik.items())]


def summarise(rows: list[dict]) -> dict[str, dict]:
    """Per method: NLL and ECE gaps per draw to kron_full over the grid on the test set, and the
    test NLL at the marglik-chosen δ per draw."""
    out = {}
    for m in METHODS:
        nll = max_gap_per_draw(rows, m, "kron_full", "test", LINK, "nll")
        ece = max_gap_per_draw(rows, m, "kron_full", "test", LINK, "ece", relative=False)
        by_delta = curves_to_json(gap_curves(rows, m, "kron_full", "test", LINK, "nll"))
        out[m] = {"nll_gap_per_draw": nll, "ece_gap_per_draw": ece, "marglik_test_nll_per_draw": marglik_test_nll(rows, m),
                  "signed_nll_gap_by_delta": by_delta}
    return out


def markdown(results: dict[int, dict], repeats: int, command: str | None = None, figure: str = "digits_estimators.png") -> str:
    command = command or f"OMP_NUM_THREADS=1 python benchmarks/digits_estimators.py --repeats {repeats}"
    lines = ["# Digits: single batch, paper, corrected, shrunk and stein estimates at equal samples", "",
             f"Written by `{command}` (the main "
             f"job on the embedded digits, N = 300, digits_cnn, {repeats} draws per method, projected probit). Largest gap to the "
             "full-batch K-FAC LA over the whole δ grid on the 1,000 test images: test NLL relative to the full "
             "batch (%), ECE in points; mean over draws [min, max]. No MC noise: the probit is deterministic. "
             "Paired: each draw's NLL gap less the single batch's on the same draw (every method at a b "
             "reads the same seeded samples), mean ± standard error over the draws. Last column: the test NLL "
             "(nats) at the δ of the highest log marginal likelihood, mean over draws, and its paired "
             "difference to the single batch's.", "",
             "| b | method | max rel. NLL gap (%) | max ECE gap (pt) | NLL gap − single's, paired (pt) "
             "| draws worse than single | test NLL at the marglik δ (− single's) |", "|---|---|---|---|---|---|---|"]
    for b, res in sorted(results.items()):
        single = 100 * np.array(res["kron_single"]["nll_gap_per_draw"])
        single_ml = np.array(res["kron_single"]["marglik_test_nll_per_draw"])
        for m in METHODS:
            nll, ece = (100 * np.array(res[m][k]) for k in ("nll_gap_per_draw", "ece_gap_per_draw"))
            ml = np.array(res[m]["marglik_test_nll_per_draw"])
            paired = worse = "–"
            ml_text = f"{ml.mean():.3f}"
            if m != "kron_single":
                paired, worse = mean_stderr_text(nll - single, 2), f"{int((nll > single).sum())} of {len(nll)}"
                ml_text += f" ({mean_stderr_text(ml - single_ml, 3)})"
            lines.append(f"| {b} | {LABELS[m]} | {nll.mean():.2f} [{nll.min():.2f}, {nll.max():.2f}] | "
                         f"{ece.mean():.2f} [{ece.min():.2f}, {ece.max():.2f}] | {paired} | {worse} | {ml_text} |")
    return "\n".join(lines) + "\n" + by_delta_markdown(results, figure)


def by_delta_markdown(results: dict[int, dict], figure: str = "digits_estimators.png") -> str:
    """The signed relative test-NLL gap of the single batch and the default at each δ of the grid,
    per b: mean ± standard error over the draws (%)."""
    sizes = sorted(results)
    lines = ["", "## Where on the δ grid the gaps lie", "",
             "Signed relative test-NLL gap to the full batch (%) at each prior precision δ, mean ± standard error "
             "over the draws (positive: a higher NLL than the full batch's). The table above reports, per draw, the "
             f"largest absolute value of these over the grid. Figure: [{figure}]({figure}).", "",
             "| δ | " + " | ".join(f"b = {b}: single | b = {b}: corrected (default)" for b in sizes) + " |",
             "|---|" + "---|---|" * len(sizes)]
    for key in results[sizes[0]]["kron_single"]["signed_nll_gap_by_delta"]:
        cells = [mean_stderr_text(100 * np.array(results[b][m]["signed_nll_gap_by_delta"][key]), 2)
                 for b in sizes for m in ("kron_single", "kron_corrected")]
        lines.append(f"| {float(key):.3g} | " + " | ".join(cells) + " |")
    lines += ["", "The δ at which each draw's gap is largest (δ: draws):", ""]
    for b in sizes:
        for m in ("kron_single", "kron_corrected"):
            curves = curves_from_json(results[b][m]["signed_nll_gap_by_delta"])
            lines.append(f"- b = {b}, {LABELS[m]}: " + ", ".join(f"{d:.3g}: {k}" for d, k in where_largest(curves).items()))
    return "\n".join(lines) + "\n"


def plot(results: dict[int, dict], path: Path) -> None:
    """Per b one panel: each method's mean signed relative test-NLL gap over δ, ± one standard error
    (:func:`~laplace_debiased.evaluation.report_figures.signed_gap_figure`)."""
    panels = {f"b = {b} samples": {LABELS[m]: curves_from_json(results[b][m]["signed_nll_gap_by_delta"]) for m in METHODS}
              for b in sorted(results)}
    save_signed_gap_figure(panels, "Digits (N = 300), projected probit: signed test-NLL gap to full-batch K-FAC, "
                                   "mean ± 1 s.e. over draws", path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3, help="batch draws per method and b")
    parser.add_argument("--out", type=Path, default=Path("digits-estimators-output"),
                        help="where the main job's runs go (kept, so an interrupted run resumes)")
    parser.add_argument("--seed", type=int, default=0, help="the main job's --seed (MAP and batch draws)")
    parser.add_argument("--links", nargs="+", default=None, help="the main job's --links (default: its own)")
    parser.add_argument("--name", default="digits_estimators", help="stem of the result files in results/")
    args = parser.parse_args(argv)
    results = {}
    for b in args.batch_sizes:
        run_main_job(b, args.out.expanduser() / f"b{b}", args.repeats, args.seed, args.links)
        results[b] = summarise(load_rows(args.out.expanduser() / f"b{b}" / "results.jsonl"))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")
    command = "OMP_NUM_THREADS=1 python benchmarks/digits_estimators.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (HERE / "results" / f"{args.name}.md").write_text(markdown(results, args.repeats, command, f"{args.name}.png"))
    plot(results, HERE / "results" / f"{args.name}.png")
    print(markdown(results, args.repeats, command, f"{args.name}.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

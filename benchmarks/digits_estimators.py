"""Single batch, the paper's debiased split and the corrected estimate at equal samples on the
main job's embedded digits (N = 300), for several batch sizes.

    OMP_NUM_THREADS=1 python benchmarks/digits_estimators.py [--batch-sizes 32 64 128] [--repeats 3] [--out DIR]

Runs the main job (``python -m laplace_debiased``) once per batch size b with the methods
kron_single (b samples), kron_debiased and kron_corrected (two halves of b/2) and kron_full, ``--repeats`` draws
each (default 3), into ``DIR/b<b>/``, then writes ``results/digits_estimators.{json,md}``: per method and b
the largest relative test-NLL gap and ECE gap to the full batch over the whole δ grid (projected
probit), mean and range over the draws, and the test NLL at the validation-chosen δ. The probit
predictive is deterministic, so there is no MC noise floor; the range over draws is the noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from laplace_debiased.evaluation.sweep import load_rows
from laplace_debiased.evaluation.tracking import max_gap_per_draw

HERE = Path(__file__).resolve().parent
METHODS = ("kron_single", "kron_debiased", "kron_corrected")
LABELS = {"kron_single": "single batch b", "kron_debiased": "paper 2 × b/2", "kron_corrected": "corrected 2 × b/2"}
LINK = "probit_projected"


def run_main_job(b: int, out: Path, repeats: int) -> None:
    """The main job at batch size ``b`` with ``repeats`` draws per method into ``out`` (resumes an
    interrupted run there)."""
    cmd = [sys.executable, "-m", "laplace_debiased", "--out", str(out), "--threads", "1", "--quiet",
           "--batch-size", str(b), "--repeats", str(repeats), "--methods", *METHODS, "kron_full"]
    subprocess.run(cmd, check=True)


def summarise(rows: list[dict]) -> dict[str, dict]:
    """Per method: NLL and ECE gaps per draw to kron_full over the grid on the test set."""
    out = {}
    for m in METHODS:
        nll = max_gap_per_draw(rows, m, "kron_full", "test", LINK, "nll")
        ece = max_gap_per_draw(rows, m, "kron_full", "test", LINK, "ece", relative=False)
        out[m] = {"nll_gap_per_draw": nll, "ece_gap_per_draw": ece}
    return out


def markdown(results: dict[int, dict], repeats: int) -> str:
    lines = ["# Digits: single batch, paper and corrected estimates at equal samples", "",
             f"Written by `OMP_NUM_THREADS=1 python benchmarks/digits_estimators.py --repeats {repeats}` (the main "
             f"job on the embedded digits, N = 300, digits_cnn, {repeats} draws per method, projected probit). Largest gap to the "
             "full-batch K-FAC LA over the whole δ grid on the 1,000 test images: test NLL relative to the full "
             "batch (%), ECE in points; mean over draws [min, max]. No MC noise: the probit is deterministic.", "",
             "| b | method | max rel. NLL gap (%) | max ECE gap (pt) |", "|---|---|---|---|"]
    for b, res in sorted(results.items()):
        for m in METHODS:
            nll, ece = (100 * np.array(res[m][k]) for k in ("nll_gap_per_draw", "ece_gap_per_draw"))
            lines.append(f"| {b} | {LABELS[m]} | {nll.mean():.2f} [{nll.min():.2f}, {nll.max():.2f}] | "
                         f"{ece.mean():.2f} [{ece.min():.2f}, {ece.max():.2f}] |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3, help="batch draws per method and b")
    parser.add_argument("--out", type=Path, default=Path("digits-estimators-output"),
                        help="where the main job's runs go (kept, so an interrupted run resumes)")
    args = parser.parse_args(argv)
    results = {}
    for b in args.batch_sizes:
        run_main_job(b, args.out / f"b{b}", args.repeats)
        results[b] = summarise(load_rows(args.out / f"b{b}" / "results.jsonl"))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "digits_estimators.json").write_text(json.dumps(results, indent=1) + "\n")
    (HERE / "results" / "digits_estimators.md").write_text(markdown(results, args.repeats))
    print(markdown(results, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``laplace-debiased report RESULTS``: sweep results (JSON lines) -> Markdown + HTML report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "turn sweep results into a calibration report (Markdown + HTML)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``report`` command."""
    parser.add_argument("results", type=Path,
                        help="results.jsonl of a sweep, or the sweep's output folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="report folder (default: 'report' next to the results file)")
    parser.add_argument("--title", default="Calibration report", help="report title")


def run(args: argparse.Namespace) -> int:
    """Write the report and print its path; exit status 2 on missing or bad results."""
    from laplace_debiased.evaluation.report_page import write_report

    path = args.results / "results.jsonl" if args.results.is_dir() else args.results
    if not path.is_file():
        print(f"laplace-debiased: error: no results file {path}; run `laplace-debiased sweep` first",
              file=sys.stderr)
        return 2
    out = args.out if args.out is not None else path.parent / "report"
    try:
        md = write_report(path, out, title=args.title)
    except (ValueError, FileNotFoundError) as err:
        print(f"laplace-debiased: error: {err}", file=sys.stderr)
        return 2
    print(f"report: {md} (and {md.with_suffix('.html')})")
    return 0

"""``laplace-debiased sweep``: fit the approximations and run the (resumable) prior-precision
sweep, writing ``OUT/results.jsonl``; ``laplace-debiased report`` turns it into a report."""

from __future__ import annotations

import argparse

from laplace_debiased.commands.main import run_pipeline_command
from laplace_debiased.evaluation.options import add_pipeline_arguments

HELP = "prior-precision sweep of fitted Laplace approximations, resumable"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Pipeline flags (see [`laplace_debiased.evaluation.pipeline`][laplace_debiased.evaluation.pipeline])."""
    add_pipeline_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the sweep (no report); exit status 2 on bad options or an output folder held by another run."""
    status, paths = run_pipeline_command(args, report=False)
    if paths is not None:
        print(f"results: {paths['results']}")
    return status

"""``laplace-debiased sweep``: fit the approximations and run the (resumable) prior-precision
sweep, writing ``OUT/results.jsonl``; ``laplace-debiased report`` turns it into a report."""

from __future__ import annotations

import argparse
import sys

from laplace_debiased.evaluation.options import add_pipeline_arguments, resolve_options

HELP = "prior-precision sweep of fitted Laplace approximations, resumable"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Pipeline flags (see :mod:`laplace_debiased.evaluation.pipeline`)."""
    add_pipeline_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the sweep (no report); exit status 2 on bad options or an output folder held by another run."""
    from laplace_debiased.evaluation.pipeline import run_pipeline
    from laplace_debiased.evaluation.sweep import OutputLockedError
    from laplace_debiased.structures.distributed import PeerRankError, rank_world

    try:
        paths = run_pipeline(resolve_options(args), report=False)
    except (ValueError, FileNotFoundError, OutputLockedError, PeerRankError) as err:
        print(f"laplace-debiased: error: {err}", file=sys.stderr)
        return 2
    if rank_world()[0] != 0:  # under torchrun rank 0 reports the paths
        return 0
    print(f"results: {paths['results']}")
    return 0

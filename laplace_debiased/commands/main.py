"""``laplace-debiased [main]``: the whole pipeline (train or load a model, fit, sweep, report).

With no options it runs on the embedded scikit-learn 8x8 digits in a few minutes on 2 CPU cores
and prints where the report is.  Rerunning resumes an interrupted sweep.  Under
``torchrun --nproc-per-node W -m laplace_debiased ...`` the ranks share the work and rank 0 writes
(:mod:`laplace_debiased.evaluation.pipeline`).
"""

from __future__ import annotations

import argparse
import sys

from laplace_debiased.evaluation.options import add_pipeline_arguments, resolve_options

HELP = "run the whole pipeline (train or load a model, fit, sweep, report)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Pipeline flags (see :mod:`laplace_debiased.evaluation.pipeline`)."""
    add_pipeline_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the pipeline; exit status 2 on bad options or an output folder held by another run."""
    from laplace_debiased.evaluation.pipeline import run_pipeline
    from laplace_debiased.evaluation.sweep import OutputLockedError
    from laplace_debiased.structures.distributed import PeerRankError, rank_world

    try:
        opts = resolve_options(args)
        paths = run_pipeline(opts, report=True)
    except (ValueError, FileNotFoundError, OutputLockedError, PeerRankError) as err:
        print(f"laplace-debiased: error: {err}", file=sys.stderr)
        return 2
    if rank_world()[0] != 0:  # under torchrun rank 0 reports the paths
        return 0
    print(f"results: {paths['results']}")
    print(f"report:  {paths['report']} (and {paths['report'].with_suffix('.html')})")
    return 0

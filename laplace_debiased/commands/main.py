"""``laplace-debiased [main]``: the whole pipeline (train or load a model, fit, sweep, report).

With no options it runs on the embedded scikit-learn 8x8 digits in a few minutes on 2 CPU cores
and prints where the report is.  Rerunning resumes an interrupted sweep.  Under
``torchrun --nproc-per-node W -m laplace_debiased ...`` the ranks share the work and rank 0 writes
([`laplace_debiased.evaluation.pipeline`][laplace_debiased.evaluation.pipeline]).
"""

from __future__ import annotations

import argparse
import sys

from laplace_debiased.evaluation.options import add_pipeline_arguments, resolve_options

HELP = "run the whole pipeline (train or load a model, fit, sweep, report)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Pipeline flags (see [`laplace_debiased.evaluation.pipeline`][laplace_debiased.evaluation.pipeline])."""
    add_pipeline_arguments(parser)


def run_pipeline_command(args: argparse.Namespace, report: bool) -> tuple[int, dict | None]:
    """``run_pipeline`` with the commands' error handling: ``(2, None)`` after printing a bad
    option or an output folder held by another run, ``(0, None)`` on ranks other than 0 (under
    torchrun rank 0 reports the paths), else ``(0, paths)``."""
    from laplace_debiased.evaluation.pipeline import run_pipeline
    from laplace_debiased.evaluation.sweep import OutputLockedError
    from laplace_debiased.parallel.distributed import PeerRankError, rank_world

    try:
        paths = run_pipeline(resolve_options(args), report=report)
    except (ValueError, FileNotFoundError, OutputLockedError, PeerRankError) as err:
        print(f"laplace-debiased: error: {err}", file=sys.stderr)
        return 2, None
    return (0, paths) if rank_world()[0] == 0 else (0, None)


def run(args: argparse.Namespace) -> int:
    """Run the pipeline; exit status 2 on bad options or an output folder held by another run."""
    status, paths = run_pipeline_command(args, report=True)
    if paths is not None:
        print(f"results: {paths['results']}")
        print(f"report:  {paths['report']} (and {paths['report'].with_suffix('.html')})")
    return status

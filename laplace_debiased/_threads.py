"""How many CPU threads torch may use: ``--threads``, else ``$OMP_NUM_THREADS``, else the cores.

torch's default on Linux is one intra-op thread per core.  On a machine that other processes
keep busy, threads that wait for a core they do not get stall every parallel kernel (each
matrix product waits for its slowest thread), so a job can run several times slower than with
fewer threads.  ``--threads`` sets the number explicitly; the default respects
``OMP_NUM_THREADS`` as OpenMP programs do, and otherwise uses the cores this process may run on.
"""

from __future__ import annotations

import argparse
import os


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` if it is a positive integer, else :func:`available_cores`."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return available_cores()


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` (default shown in ``--help``: this machine's value)."""
    parser.add_argument("--threads", type=positive_int, default=default_threads(),
                        help="CPU threads for torch (default: $OMP_NUM_THREADS if set, else the cores); "
                             "on a machine shared with other jobs, fewer threads than cores is faster")


def apply_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` (intra-op); call before any work starts."""
    import torch

    torch.set_num_threads(n)

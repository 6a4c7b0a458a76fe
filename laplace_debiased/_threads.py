"""How many CPU threads torch may use, and how its OpenMP threads wait.

torch's CPU wheel runs its intra-op pool on GNU OpenMP (libgomp, ``torch.__config__.parallel_info()``).
By default libgomp's idle workers spin (busy-poll) for a while before they sleep.  On a machine
that other processes keep busy, a spinning worker burns the core another worker (or another job)
needs, and every parallel kernel waits for its slowest thread, so a job can run several times
slower than its idle time.  ``set_openmp_defaults`` therefore sets
``OMP_WAIT_POLICY=PASSIVE`` (idle workers sleep at once) unless the variable is already set;
libgomp reads it when torch is first imported, so the CLI calls it before that (the CLI imports
torch lazily).  The thread count (``default_threads``) is ``$OMP_NUM_THREADS`` if set, else
the cores this process may run on; ``--threads N`` overrides it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping

#: OpenMP settings that ``set_openmp_defaults`` puts in the environment when absent
OPENMP_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _omp_num_threads() -> int | None:
    """``$OMP_NUM_THREADS`` if it is a positive integer, else ``None``."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else None


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` if it is a positive integer, else ``available_cores``."""
    return _omp_num_threads() or available_cores()


def set_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put ``OPENMP_DEFAULTS`` into ``environ`` where absent; return those it set.

    Takes effect only if called before torch is first imported in this process.
    """
    added = {key: value for key, value in OPENMP_DEFAULTS.items() if key not in environ}
    environ.update(added)
    return added


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
    """``--threads N``; ``--help`` shows the default once, with where it comes from."""
    source = "the cores this process may use" if _omp_num_threads() is None else "$OMP_NUM_THREADS"
    parser.add_argument("--threads", type=positive_int, default=default_threads(),
                        help=f"CPU threads for torch (default: %(default)s, from {source})")


def apply_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` (intra-op); call before any work starts."""
    import torch

    torch.set_num_threads(n)

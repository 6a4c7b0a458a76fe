"""Progress bars for long steps (MAP training, fits, sweeps, diagnose): tqdm with an ETA.

Bars go to stderr, so stdout stays clean for results, and only when stderr is a terminal: a log
file or a CI run gets no carriage-return noise.  ``quiet=True`` (the CLI's ``--quiet``) turns
them off everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def progress_enabled(quiet: bool = False) -> bool:
    """Whether to draw bars: not ``quiet`` and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return not quiet and bool(isatty and isatty())


def progress_bar(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None,
                 quiet: bool = False, unit: str = "it", **kwargs: Any):
    """A ``tqdm`` bar on stderr with elapsed time and ETA, disabled by :func:`progress_enabled`.

    Use it as ``for x in progress_bar(xs, desc="fit"):`` or as a manual bar (``total=``, then
    ``update``/``close``).  Extra keyword arguments go to ``tqdm``.
    """
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not progress_enabled(quiet), **kwargs)

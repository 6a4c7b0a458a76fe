"""Progress bars for long steps (MAP training, fits, sweeps, diagnose): tqdm with an ETA.

Bars go to stderr, so stdout stays clean for results, and only when stderr is a terminal: a log
file or a CI run gets no carriage-return noise.  ``quiet=True`` (the CLI's ``--quiet``) turns
them off everywhere.

Every command that computes spells the switch the same way, ``--quiet``
(``add_quiet_argument``); ``diagnose`` also accepts ``--no-progress``, with a deprecation
warning.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: what ``--quiet`` does, the same words in every command's ``--help``
QUIET_HELP = "no progress bars and no log lines (results and paths are still printed)"


class _DeprecatedSwitch(argparse.Action):
    """A hidden deprecated spelling of a ``store_true`` switch: sets it and says which name to use."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, True)


def add_quiet_argument(parser: argparse.ArgumentParser, default: Any = False,
                       deprecated: Sequence[str] = ()) -> None:
    """``--quiet`` (``QUIET_HELP``), plus hidden ``deprecated`` spellings that warn when used.

    ``default=argparse.SUPPRESS`` leaves the default to the caller (a config file may set it).
    """
    parser.add_argument("--quiet", action="store_true", default=default, help=QUIET_HELP)
    for name in deprecated:
        parser.add_argument(name, action=_DeprecatedSwitch, dest="quiet", new="--quiet", default=default)


def progress_enabled(quiet: bool = False) -> bool:
    """Whether to draw bars: not ``quiet`` and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return not quiet and bool(isatty and isatty())


def progress_bar(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None,
                 quiet: bool = False, unit: str = "it", **kwargs: Any):
    """A ``tqdm`` bar on stderr with elapsed time and ETA, disabled by ``progress_enabled``.

    Use it as ``for x in progress_bar(xs, desc="fit"):`` or as a manual bar (``total=``, then
    ``update``/``close``).  Extra keyword arguments go to ``tqdm``.
    """
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not progress_enabled(quiet), **kwargs)

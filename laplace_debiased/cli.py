"""Command-line interface: ``laplace-debiased <command> [options]``.

Every command lives in its own module ``laplace_debiased.commands.<name>`` that exposes

* ``HELP: str`` -- one line for the command overview,
* ``add_arguments(parser: argparse.ArgumentParser) -> None``,
* ``run(args: argparse.Namespace) -> int`` -- the exit status.

Modules are imported only when their command runs, so ``--help`` stays fast.  With no command
at all the main job runs (``laplace-debiased`` == ``laplace-debiased main``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, str] = {
    "main": "run the whole pipeline (train or load a model, fit, sweep, report)",
    "sweep": "prior-precision sweep of fitted Laplace approximations, resumable",
    "report": "turn sweep results into a calibration report (Markdown + HTML)",
    "diagnose": "measure how biased mini-batch quadratics are (bias report)",
}


def _overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``laplace-debiased`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: laplace-debiased [command] [options]\n\n" + _overview())
        print("\nWith no command, 'main' runs. 'laplace-debiased COMMAND --help' for options.")
        return 0
    if argv and argv[0] in ("-V", "--version"):
        from laplace_debiased import __version__

        print(__version__)
        return 0
    name = "main" if not argv or argv[0].startswith("-") else argv.pop(0)
    if name not in COMMANDS:
        print(f"laplace-debiased: unknown command {name!r}\n\n{_overview()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"laplace_debiased.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"laplace-debiased {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)) or 0)

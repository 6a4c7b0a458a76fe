"""Command-line interface: ``laplace-debiased <command> [options]``.

Every command lives in its own module ``laplace_debiased.commands.<name>`` that exposes

* ``HELP: str`` -- one line for the command overview,
* ``add_arguments(parser: argparse.ArgumentParser) -> None``,
* ``run(args: argparse.Namespace) -> int`` -- the exit status.

Only the chosen command's module is imported, and command modules import torch only inside
``run``, so ``--help`` stays well under a second.  With no command at all the main job runs
(``laplace-debiased`` == ``laplace-debiased main``).  The CLI adds ``--threads`` to the commands
that compute (``laplace_debiased._threads``) and applies it, with OpenMP's passive wait policy
unless ``OMP_WAIT_POLICY`` is set, before the command imports torch.

Launched by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the commands in
[`DISTRIBUTED`][laplace_debiased.cli.DISTRIBUTED] run under a gloo process group that the CLI initialises from
torchrun's variables and destroys at the end
([`laplace_debiased.evaluation.pipeline`][laplace_debiased.evaluation.pipeline] says who does what); the
others refuse. A rank whose command fails prints its error (an unexpected one as a traceback, exit status 1)
and waits, at most [`PEER_REPORT_TIMEOUT`][laplace_debiased.cli.PEER_REPORT_TIMEOUT], for the other ranks to
report theirs before it exits.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

from laplace_debiased._threads import add_threads_argument, apply_threads, set_openmp_defaults

COMMANDS: dict[str, str] = {
    "main": "run the whole pipeline (train or load a model, fit, sweep, report)",
    "sweep": "prior-precision sweep of fitted Laplace approximations, resumable",
    "report": "turn sweep results into a calibration report (Markdown + HTML)",
    "diagnose": "measure how biased mini-batch quadratics are (bias report)",
}
#: commands that run torch work and so take ``--threads``
THREADED = ("main", "sweep", "diagnose")
#: commands that run under ``torchrun`` (one process group over all ranks)
DISTRIBUTED = ("main", "sweep")
#: how long a rank waits in a collective: rank 0 trains the MAP model while the others wait
DIST_TIMEOUT = timedelta(hours=24)
#: how long a failed rank waits, at most, for the other ranks to report their errors
PEER_REPORT_TIMEOUT = timedelta(minutes=5)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each option's default (not ``None``/``False``: the help says what those mean), and
    the command's docstring as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


#: a mkdocstrings cross-reference, ``[`title`][a.b.title]``: group 1 is the title
_CROSS_REFERENCE = re.compile(r"\[`([^`\]]+)`\]\[[\w.]+\]")


def plain_text(doc: str) -> str:
    """A docstring as a terminal shows it: a cross-reference ``[`b`][a.b]`` -> ``b``,
    ````code```` -> ``code``."""
    return _CROSS_REFERENCE.sub(r"\1", doc).replace("``", "")


def build_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The parser of command ``name`` and its module (imported here, which must stay cheap)."""
    module = importlib.import_module(f"laplace_debiased.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"laplace-debiased {name}", description=plain_text(module.__doc__),
                                     formatter_class=_HelpFormatter)
    module.add_arguments(parser)
    if name in THREADED:
        add_threads_argument(parser)
    return parser, module


def _overview() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def _launched_world() -> int:
    """The number of processes ``torchrun`` started (``$WORLD_SIZE``; 1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def _process_group() -> Iterator[None]:
    """A gloo process group from torchrun's environment while the command runs (nothing if
    there is one already, or a single process)."""
    if _launched_world() <= 1:  # torch stays unimported until the command imports it
        yield
        return
    import torch.distributed as dist
    # The functions of torch.distributed.nn take ``group=group.WORLD`` as a default, evaluated at
    # import. Imported after the group begins (torchmetrics imports it, through transformers and
    # torch._dynamo), they would hold the group past ``destroy_process_group``: its gloo threads
    # would then run into interpreter exit, whose teardown of them can abort the process
    # ("terminate called without an active exception"). Imported first, their default is None.
    import torch.distributed.nn  # noqa: F401

    owned = not dist.is_initialized()
    if owned:
        from laplace_debiased.parallel.rank_failures import announce

        dist.init_process_group("gloo", timeout=DIST_TIMEOUT)
        announce()  # so that a rank killed before its first collective can be named
    try:
        yield
    finally:
        if owned and dist.is_initialized():  # a failed distributed fit destroys it itself
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``laplace-debiased`` console script.

    A command whose standard output has lost its reader by the time it ends (``laplace-debiased
    --help | head -5``, the reader gone before the rest was read) ends quietly with status 1, as a
    tool cut off by its reader does: no traceback, and no "Exception ignored" from the
    interpreter's last flush. This holds also where argparse's help, which ignores its own failed
    writes, exits. A command's own failure keeps its status, and a broken pipe that is not
    standard output's propagates."""
    try:
        try:
            status = _dispatch(argv)
        finally:  # a failed flush here, not at interpreter exit, where it cannot be caught
            sys.stdout.flush()
    except BrokenPipeError:
        if _stdout_reader_gone() is False:  # unknown (no poll): a raised broken pipe is stdout's
            raise
        return _cut_off()
    except SystemExit as stop:  # argparse: --help (0) or a usage error (2)
        if stop.code in (None, 0) and _stdout_reader_gone():
            return _cut_off()
        raise
    return _cut_off() if status == 0 and _stdout_reader_gone() else status


def _cut_off() -> int:
    """Point standard output at the null device, so that nothing is left to flush into the
    closed pipe at exit; the status of a command cut off by its reader (1)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


def _stdout_reader_gone() -> bool | None:
    """Whether standard output is a pipe whose reading end is closed (``poll`` reports an error
    on it); ``None`` where ``poll`` does not exist (Windows) and nothing tells. A standard output
    without a file descriptor (replaced in-process) has no reader to lose: ``False``."""
    import io
    import select

    if not hasattr(select, "poll"):
        return None
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, io.UnsupportedOperation):
        return False
    poller = select.poll()
    poller.register(descriptor, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _dispatch(argv: Sequence[str] | None) -> int:
    """Run the command that ``argv`` names (``sys.argv[1:]`` when None); the exit status."""
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
    parser, module = build_parser(name)
    args = parser.parse_args(argv)
    if _launched_world() > 1 and name not in DISTRIBUTED:
        print(f"laplace-debiased: error: {name!r} runs in one process; launch it without torchrun "
              f"(commands that run under torchrun: {', '.join(DISTRIBUTED)})", file=sys.stderr)
        return 2
    if name in THREADED:
        set_openmp_defaults()  # before torch is imported: libgomp reads it once, at load
        apply_threads(args.threads)
        del args.threads
    if name not in DISTRIBUTED:
        return int(module.run(args) or 0)
    with _process_group():
        status = _run_rank(module, args)
        if status == 0 and _launched_world() > 1:
            _wait_for_every_rank()
        return status


def _wait_for_every_rank() -> None:
    """Under a process group, return once every rank has finished its command (a barrier), so
    that no rank destroys the group while a peer may still be in a collective with it. A peer
    that already ended has nothing left to send: its error is ignored here."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except RuntimeError:  # a peer gone: its own status tells the launcher
            pass


def _run_rank(module: object, args: argparse.Namespace) -> int:
    """Run a command on one rank; if it fails here, print why (an unexpected error as its
    traceback, exit status 1) and wait for the other ranks to report their own errors (or to be
    gone; at most [`PEER_REPORT_TIMEOUT`][laplace_debiased.cli.PEER_REPORT_TIMEOUT]) before exiting, so that a
    launcher stopping the rest when one rank exits cannot cut their messages."""
    try:
        status = int(module.run(args) or 0)
    except Exception:  # noqa: BLE001 - reported here, as the interpreter would, then waited on
        traceback.print_exc()
        status = 1
    if status and _launched_world() > 1:  # one process: torch may still be unimported here
        import torch.distributed as dist

        if dist.is_initialized():
            from laplace_debiased.parallel.rank_failures import wait_for_peers

            wait_for_peers(PEER_REPORT_TIMEOUT.total_seconds())
    return status

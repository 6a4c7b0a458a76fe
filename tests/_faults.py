"""A reducer that fails on purpose: the fault injection of the rank-failure tests.

:class:`FaultyReducer` is the package's :class:`~laplace_debiased.parallel.reducer.ProcessGroupReducer`
except that on rank ``rank`` its ``count``-th ``sum_`` (a K-FAC fit makes one: its factor sums)
raises a ``RuntimeError`` ("injected fault") or kills the process with ``SIGKILL``.
``python tests/_faults.py RANK:ACTION:COUNT ARGS...`` runs the command line with it installed
(under ``torchrun``, one per rank).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from laplace_debiased.parallel.reducer import ProcessGroupReducer, use_reducer


class FaultyReducer(ProcessGroupReducer):
    """Fails at the ``count``-th ``sum_`` on rank ``rank`` (the global rank, ``$RANK`` before a
    group exists) with ``action`` ``"raise"`` or ``"kill"``."""

    def __init__(self, rank: int, action: str, count: int = 1) -> None:
        if action not in ("raise", "kill"):
            raise ValueError(f"action must be 'raise' or 'kill', got {action!r}")
        self.failing_rank, self.action, self.count, self.calls = rank, action, count, 0

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        global_rank = dist.get_rank() if initialised else int(os.environ.get("RANK", "0"))
        if global_rank == self.failing_rank:
            self.calls += 1
            if self.calls == self.count:
                if self.action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at sum {self.count} on rank {global_rank}")
        super().sum_(tensors)


if __name__ == "__main__":
    from laplace_debiased.cli import main

    rank, action, count = sys.argv[1].split(":")
    with use_reducer(FaultyReducer(int(rank), action, int(count))):
        raise SystemExit(main(sys.argv[2:]))

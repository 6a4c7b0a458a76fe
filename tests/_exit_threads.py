"""The command line, then a check that no ``torch.distributed`` backend thread outlives it.

``python tests/_exit_threads.py ARGS...`` runs ``laplace-debiased ARGS...`` (under ``torchrun``,
one per rank) and then lists this process's threads (Linux ``/proc``): a gloo thread still running
means that something still holds the destroyed process group, which is then torn down at
interpreter exit, where it can abort the process. It exits with status 3 and names the threads then.
"""

from __future__ import annotations

import os
import sys

from laplace_debiased.cli import main


def backend_threads() -> list[str]:
    """The names of this process's threads that belong to a gloo process group."""
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n)


if __name__ == "__main__":
    status = main(sys.argv[1:])
    left = backend_threads()
    if left:
        print(f"process group threads outlive the command: {left}", file=sys.stderr, flush=True)
        status = status or 3
    raise SystemExit(status)

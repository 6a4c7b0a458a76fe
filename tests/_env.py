"""Environment of the child Python processes that tests start."""

from __future__ import annotations

import os
from pathlib import Path


def pythonpath(root: Path) -> str:
    """``root`` first, then the caller's ``PYTHONPATH`` (packages installed with ``pip --target``
    are found only through it)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)

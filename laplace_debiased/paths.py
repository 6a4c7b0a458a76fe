"""Where laplace-debiased keeps its files (the bottom layer: no torch, no other package module).

``default_cache_dir``: trained models, generated evaluation sets, benchmark caches;
``default_data_root``: the clean data sets.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$LAPLACE_DEBIASED_CACHE`` if set, else ``~/.cache/laplace-debiased``."""
    return Path(os.environ.get("LAPLACE_DEBIASED_CACHE", Path.home() / ".cache" / "laplace-debiased"))


def default_data_root() -> Path:
    """``$LAPLACE_DEBIASED_DATA`` if set, else ``<cache dir>/data``."""
    env = os.environ.get("LAPLACE_DEBIASED_DATA")
    return Path(env) if env else default_cache_dir() / "data"

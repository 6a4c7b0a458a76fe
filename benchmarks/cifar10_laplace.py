"""Headline CIFAR-10 benchmark: thin entry point of the package ``benchmarks/cifar10/``.

    python benchmarks/cifar10_laplace.py [options]   # same as: python -m benchmarks.cifar10 [options]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cifar10.__main__ import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

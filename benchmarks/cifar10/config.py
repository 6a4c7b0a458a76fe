"""What determines the benchmark's numbers: the run configuration and the prior-precision grid."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

#: The paper's grid: 13 log-spaced prior precisions from 1e-4 to 1, plus 10.
BASE_GRID: tuple[float, ...] = tuple(float(v) for v in np.logspace(-4, 0, 13)) + (10.0,)
#: Extension steps: below the grid by the paper's spacing (10^(1/3)), above it by a decade (as 1 -> 10).
STEP_DOWN = 10 ** (1 / 3)
STEP_UP = 10.0
#: How far the grid may be extended (and where the marginal likelihood is evaluated).
N_DOWN_MAX, N_UP_MAX = 12, 5


def extended_grid(n_down: int, n_up: int) -> list[float]:
    """``BASE_GRID`` with ``n_down`` points added below (factor 10^(-1/3) each) and ``n_up``
    above (factor 10 each), ascending."""
    below = [BASE_GRID[0] / STEP_DOWN**k for k in range(n_down, 0, -1)]
    above = [BASE_GRID[-1] * STEP_UP**k for k in range(1, n_up + 1)]
    return below + list(BASE_GRID) + above


#: Every prior precision the grid can reach; the marginal likelihood is evaluated on all of them.
WIDE_GRID: list[float] = extended_grid(N_DOWN_MAX, N_UP_MAX)


def grid_index(grid: list[float], delta: float) -> int:
    """Position of ``delta`` in ``grid`` (exact match up to round-off)."""
    return int(np.argmin([abs(np.log10(g) - np.log10(delta)) for g in grid]))


@dataclass
class Config:
    """Everything that determines the numbers (hashed into the cache keys)."""

    quick: bool = False
    model: str = "cifar_cnn"  # or "allcnnc" (the paper's GPU setting)
    n_train: int = 10000  # MAP training subset (first n of the seeded 45k split)
    epochs: int = 60  # converged: near-zero training loss on the 10k subset
    batch_sizes: tuple[int, ...] = (512,)  # single-batch b; debiased runs at 2 x b/2
    #: per b: debiased K-FAC at b/2 + k x b/2 for each k (k = 1: the paper's 2 x b/2), each next
    #: to single-batch K-FAC of the same (1 + k) b/2 samples (the draws are nested prefixes)
    magnitude_batches: tuple[int, ...] = (1, 4, 8)
    null_space: str = "isotropic"  # DebiasedKronLaplace(null_space=...), the package default
    #: the debiased K-FAC rows, by estimator=...: "paper" always, "corrected", "shrunk" and "stein" next to it
    estimators: tuple[str, ...] = ("paper", "corrected", "shrunk", "stein")
    repeats: int = 5
    lowrank_batch_sizes: tuple[int, ...] = (512,)
    lowrank_rank: int = 50  # last-layer low-rank LA (330 parameters)
    full_batch_size: int = 500
    n_val: int = 2000
    n_test: int = 10000
    n_corrupt: int = 1000
    n_ood: int = 1000
    mc_samples: int = 100
    chunk_size: int = 64
    n_boot: int = 200
    seed: int = 0

    @classmethod
    def allcnnc_config(cls) -> Config:
        """The paper's ALL-CNN-C CIFAR-10 setting (GPU, Appendix B.6): 40k training images, 350
        epochs of SGD, single batches of 64, 256 and 1024 (debiased 2 x 32, 2 x 128, 2 x 512),
        5 draws; full test set and full corrupted sets; no last-layer rows (ALL-CNN-C has no
        final Linear)."""
        return cls(model="allcnnc", n_train=40000, epochs=350, batch_sizes=(64, 256, 1024), magnitude_batches=(1,), repeats=5,
                   lowrank_batch_sizes=(), n_val=5000, n_test=10000, n_corrupt=10000, n_ood=10000,
                   chunk_size=64)

    @classmethod
    def quick_config(cls) -> Config:
        """Minutes on real data, seconds on a tiny synthetic set: exercises every step."""
        return cls(quick=True, n_train=1000, epochs=3, batch_sizes=(64,), magnitude_batches=(1, 2), repeats=2,
                   lowrank_batch_sizes=(64,),
                   lowrank_rank=10, n_val=200, n_test=300, n_corrupt=100, n_ood=100, mc_samples=20, n_boot=20)

    def key(self, *fields: str) -> str:
        d = asdict(self)
        d = {k: d[k] for k in fields} if fields else d
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

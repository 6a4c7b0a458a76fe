"""The inequalities behind the bias (paper Sec. 3, Eq. 7), evaluated on a partition.

Let D be split into equal batches B_1..B_M, so that H_D = mean_m H_{B_m} (Eq. 5), and let
u^{(m)} be the top eigenvector of H_{B_m} (the direction batch m finds most curved).  Because the
largest eigenvalue is a maximum over unit vectors (a convex function of the matrix),

    mean_m λ_max(H_{B_m})  ≥  λ_max(H_D)  ≥  mean_m u^{(m)ᵀ} H_D u^{(m)}:

the same-batch curvature along the top direction over-estimates the full-data top curvature,
which in turn bounds the full-data curvature along the directions the batches chose.  The same
holds for the sum of the top-k eigenvalues (Ky Fan) and, with the roles of max and min swapped,
the smallest eigenvalue is under-estimated.  For the first CG direction d = -g_B/‖g_B‖ the
same argument for the norm gives mean_m ‖g_{B_m}‖ ≥ ‖g_D‖ ≥ mean_m |d^{(m)ᵀ} g_D|.
These are deterministic on any partition; over random batches they hold in expectation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Chain:
    """The three sides of ``same ≥ full ≥ cross`` (each a float)."""

    same_batch: float  # mean over batches of the batch's own value
    full_data: float  # the full-data optimum
    cross: float  # mean over batches of the full-data value along the batch's choice

    def holds(self, rtol: float = 1e-10) -> bool:
        """Whether ``same ≥ full ≥ cross`` up to a relative tolerance."""
        tol = rtol * max(abs(self.same_batch), abs(self.full_data), abs(self.cross), 1e-300)
        return self.same_batch >= self.full_data - tol and self.full_data >= self.cross - tol


def top_k_chain(batch_matrices: Tensor, k: int = 1) -> Chain:
    """Eq. 7 for the sum of the top-k eigenvalues from dense symmetric ``(M, P, P)`` matrices.

    ``batch_matrices[m]`` is the curvature (with β) on batch m of an equal-size partition; the
    full-data matrix is their mean.  Meant for small constructed examples (dense eigh).
    """
    full = batch_matrices.mean(0)
    evals, evecs = torch.linalg.eigh(batch_matrices)  # ascending
    same = evals[:, -k:].sum(-1)
    top_dirs = evecs[..., -k:]  # (M, P, k)
    cross = torch.einsum("mpk,pq,mqk->m", top_dirs, full, top_dirs)
    return Chain(float(same.mean()), float(torch.linalg.eigvalsh(full)[-k:].sum()), float(cross.mean()))



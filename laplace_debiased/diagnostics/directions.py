"""Direction sets chosen on a batch B: top-k eigenvectors (Lanczos) and CG directions.

Both take a symmetric operator ``v ↦ (H_B + βI) v`` on flat vectors (e.g. a
:class:`laplace_debiased.operators.CurvatureOperator`, which also counts products) and return
unit-norm directions as the columns of a ``(P, K)`` matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh
from torch import Tensor

Operator = Callable[[Tensor], Tensor]

DENSE_LIMIT = 64
"""Operators of at most this dimension (or with k ≥ dim - 1) are formed densely instead."""


@dataclass(frozen=True)
class EigenDirections:
    """Top-k eigenpairs, largest first: ``values (K,)``, ``vectors (P, K)`` orthonormal."""

    values: Tensor
    vectors: Tensor


def top_eigenpairs(
    operator: Operator,
    dim: int,
    k: int,
    *,
    dtype: torch.dtype = torch.float64,
    tol: float = 1e-8,
    seed: int = 0,
    max_iterations: int | None = None,
) -> EigenDirections:
    """Top-k eigenpairs of a symmetric operator by implicitly restarted Lanczos in float64.

    ``operator`` maps ``(P,)`` to ``(P,)`` and ``(P, K)`` to ``(P, K)`` in ``dtype`` (the model's
    dtype; Lanczos itself runs in float64 via ARPACK).  The start vector is drawn from ``seed``, so results are
    reproducible.  Small problems are solved densely with ``dim`` products (one ``(P, P)`` block).  Eigenvector signs
    are fixed so that each vector's largest-magnitude entry is positive.
    """
    if not 1 <= k <= dim:
        raise ValueError(f"k must be between 1 and the number of parameters ({dim}), got {k}")
    if dim <= DENSE_LIMIT or k >= dim - 1:
        A = operator(torch.eye(dim, dtype=dtype)).double()
        values, vectors = torch.linalg.eigh(0.5 * (A + A.T))
        values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k]
    else:

        def matvec(x: np.ndarray) -> np.ndarray:
            v = torch.from_numpy(np.ascontiguousarray(x.reshape(-1))).to(dtype)
            return operator(v).double().numpy()

        linop = LinearOperator((dim, dim), matvec=matvec, dtype=np.float64)
        v0 = np.random.default_rng(seed).standard_normal(dim)
        try:
            vals, vecs = eigsh(linop, k=k, which="LA", v0=v0, tol=tol, maxiter=max_iterations)
        except ArpackNoConvergence as err:
            raise RuntimeError(
                f"Lanczos did not converge to {k} eigenpairs ({len(err.eigenvalues)} converged); "
                "ask for fewer directions (--top-k) or loosen the tolerance"
            ) from err
        order = np.argsort(vals)[::-1]
        values = torch.from_numpy(vals[order].copy())
        vectors = torch.from_numpy(vecs[:, order].copy())
    idx = vectors.abs().argmax(0)
    signs = torch.sign(vectors[idx, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return EigenDirections(values.to(dtype), (vectors * signs).to(dtype))

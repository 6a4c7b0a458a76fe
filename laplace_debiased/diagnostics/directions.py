"""Direction sets chosen on a batch B: top-k eigenvectors of an operator.

Takes a symmetric operator ``v ↦ (H_B + βI) v`` on flat vectors (e.g. a
[`laplace_debiased.curvature.operators.CurvatureOperator`][laplace_debiased.curvature.operators.CurvatureOperator],
which also counts products) and returns unit-norm directions as the columns of a ``(P, K)`` matrix. The
eigensolvers are [`lanczos_top_k`][laplace_debiased.curvature.lanczos.lanczos_top_k] and
[`eigh_descending`][laplace_debiased.curvature.eigen.eigh_descending]; this module adds the choice between
them and a sign convention.
"""

from __future__ import annotations

from collections.abc import Callable
import torch
from torch import Tensor

from laplace_debiased.curvature.eigen import eigh_descending
from laplace_debiased.curvature.lanczos import lanczos_top_k
from laplace_debiased.curvature.thresholds import EigenPairs

Operator = Callable[[Tensor], Tensor]

DENSE_LIMIT = 64
"""Operators of at most this dimension (or with k ≥ dim - 1) are formed densely instead."""


def top_eigenpairs(
    operator: Operator,
    dim: int,
    k: int,
    *,
    dtype: torch.dtype = torch.float64,
    tol: float = 1e-8,
    seed: int = 0,
    max_iterations: int | None = None,
) -> EigenPairs:
    """Top-k eigenpairs of a symmetric operator, largest first, in ``dtype``.

    ``operator`` maps ``(P,)`` to ``(P,)`` and ``(P, K)`` to ``(P, K)`` in ``dtype`` (the model's
    dtype). Large problems use
    [`laplace_debiased.curvature.lanczos.lanczos_top_k`][laplace_debiased.curvature.lanczos.lanczos_top_k]
    (float64 Lanczos, start vector drawn from ``seed``, so results are reproducible); small ones
    (``dim ≤ DENSE_LIMIT`` or ``k ≥ dim − 1``) are solved densely with ``dim`` products (one ``(P, P)``
    block). Eigenvector signs are fixed so that each vector's largest-magnitude entry is positive. Returns
    [`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs] (``values (K,)``, ``vectors (P, K)``
    orthonormal, ``method`` ``"dense"`` or ``"lanczos"``) cast to ``dtype``.
    """
    if not 1 <= k <= dim:
        raise ValueError(f"k must be between 1 and the number of parameters ({dim}), got {k}")
    if dim <= DENSE_LIMIT or k >= dim - 1:
        pairs = eigh_descending(operator(torch.eye(dim, dtype=dtype)))
        pairs = EigenPairs(pairs.values[:k], pairs.vectors[:, :k], pairs.method)
    else:
        pairs = lanczos_top_k(operator, dim, k, tol=tol, seed=seed, dtype=dtype, max_iterations=max_iterations)
    vectors = pairs.vectors
    idx = vectors.abs().argmax(0)
    signs = torch.sign(vectors[idx, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return EigenPairs(pairs.values.to(dtype), (vectors * signs).to(dtype), pairs.method)

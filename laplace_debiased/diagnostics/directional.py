"""Directional slopes and curvatures of quadratic models, and how biased they are.

Conventions (paper Sec. 2): the quadratic model of the regularised **mean** loss on a data set S
at the expansion point θ• is

    q(θ; S) = L_S(θ•) + g_Sᵀ(θ - θ•) + ½ (θ - θ•)ᵀ (H_S + βI) (θ - θ•),   g_S = ∇L_S(θ•) + βθ•,

with L_S the average loss over S and H_S the average curvature (GGN, Hessian or empirical
Fisher).  Along a unit direction d it has slope ∂_d q(θ•; S) = dᵀ g_S and curvature
∂²_d q(θ•; S) = dᵀ (H_S + βI) d.  Every function here takes tensors and returns tensors; the
direction sets are matrices ``D`` of shape ``(P, K)`` whose columns are the directions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def directional_slopes(directions: Tensor, gradient: Tensor) -> Tensor:
    """Slopes ``dₖᵀ g`` of shape ``(K,)`` for ``directions (P, K)`` and ``gradient (P,)``."""
    _check_directions(directions, gradient.shape[-1] if gradient.ndim else 0)
    return directions.T @ gradient


def directional_curvatures(directions: Tensor, curvature_times_directions: Tensor) -> Tensor:
    """Curvatures ``dₖᵀ (H d)ₖ`` of shape ``(K,)`` from ``D (P, K)`` and ``H D (P, K)``."""
    if directions.shape != curvature_times_directions.shape:
        raise ValueError(
            f"directions {tuple(directions.shape)} and curvature products "
            f"{tuple(curvature_times_directions.shape)} must have the same shape (P, K)"
        )
    return (directions * curvature_times_directions).sum(0)


def relative_bias(estimate: Tensor, reference: Tensor) -> Tensor:
    """``(estimate - reference) / |reference|`` elementwise (broadcasting).

    A value of ``+9`` means the estimate is ten times the reference.  Reference values of exactly
    zero give ``inf``/``nan``; callers that can hit them should say so.
    """
    return (estimate - reference) / reference.abs()


def partition_average(per_batch: Tensor, batch_sizes: Tensor | None = None) -> Tensor:
    """Average of per-batch values ``(M, ...)`` over a partition, weighted by batch size.

    For mean losses, the full-data value of any quantity that is linear in the loss (loss,
    gradient, curvature, and so slopes and curvatures along *fixed* directions) is this weighted
    average over any partition of the data set (paper Eq. 5); with equal batches it is the plain
    mean over the first axis.
    """
    if batch_sizes is None:
        return per_batch.mean(0)
    w = batch_sizes.to(per_batch.dtype) / batch_sizes.sum()
    return torch.tensordot(w, per_batch, dims=1)


def quartiles(values: Tensor) -> dict[str, float]:
    """Median, 25 % and 75 % quantiles, mean, min and max of a tensor (NaNs dropped)."""
    v = values.detach().flatten().double()
    v = v[~torch.isnan(v)]
    if v.numel() == 0:
        return {k: float("nan") for k in ("median", "q25", "q75", "mean", "min", "max")}
    q = torch.quantile(v, torch.tensor([0.25, 0.5, 0.75], dtype=v.dtype))
    return {
        "median": float(q[1]),
        "q25": float(q[0]),
        "q75": float(q[2]),
        "mean": float(v.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
    }


def cg_step_sizes(initial_slopes: Tensor, gram: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """CG update magnitudes that data set S assigns along another batch's CG directions (Fig. 4).

    CG on batch B produced unit directions ``d_1..d_K``.  Moving along them from θ• with the
    step sizes S prefers is debiased CG with B̃ = S
    ([`laplace_debiased.optim.cg.debiased_cg`][laplace_debiased.optim.cg.debiased_cg]):

        τ_p(S) = -s_p / c_p,   s_p = d_pᵀ ∇q(θ_p(S); S) = d_pᵀ g_S + Σ_{i<p} τ_i(S) d_pᵀ H_S d_i,
        c_p = d_pᵀ (H_S + βI) d_p,

    i.e. the forward substitution ``tril(G) τ = -s⁰`` with the Gram matrix
    ``gram = Dᵀ (H_S + βI) D`` ``(K, K)`` and ``initial_slopes = s⁰ = Dᵀ g_S`` ``(K,)``.  With
    S = B (whose Gram matrix is diagonal by conjugacy) this reproduces CG's own step sizes.
    Returns ``(slopes s, curvatures c, step_sizes τ)``, each ``(K,)``.
    """
    K = initial_slopes.shape[0]
    if gram.shape != (K, K):
        raise ValueError(f"gram must be ({K}, {K}) to match {K} slopes, got {tuple(gram.shape)}")
    lower = torch.tril(gram)
    steps = torch.linalg.solve_triangular(lower, -initial_slopes.unsqueeze(-1), upper=False)
    steps = steps.squeeze(-1)
    curvatures = torch.diagonal(gram)
    return -curvatures * steps, curvatures, steps


def _check_directions(directions: Tensor, dim: int) -> None:
    if directions.ndim != 2:
        raise ValueError(f"directions must be a (P, K) matrix, got shape {tuple(directions.shape)}")
    if directions.shape[0] != dim:
        raise ValueError(f"directions have {directions.shape[0]} rows but the vectors have {dim} entries")

"""Where the curvature of a trained network sits: per-sample GGN traces and how a batch samples them.

On a converged classifier most training points have a near-one-hot softmax, and their GGN
``Jᵀ Λ J`` (Λ = diag(p) − ppᵀ) nearly vanishes; the curvature then sits in the few points the
network still finds hard.  A mini-batch sees few of them, and no estimator built from two batches
can measure curvature that neither batch contains.  These functions quantify that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["softmax_ggn_traces", "top_shares", "batch_coverage"]


def softmax_ggn_traces(gram: Tensor, probs: Tensor) -> Tensor:
    """``tr(J_nᵀ Λ_n J_n)`` per sample: the trace of sample ``n``'s GGN of the summed softmax
    cross-entropy, Λ_n = diag(p_n) − p_n p_nᵀ, from the logit Gram matrices ``G_n = J_n J_nᵀ``.

    The trace is computed as ``½ Σ_{c,d} p_c p_d ‖J_c − J_d‖²`` with
    ``‖J_c − J_d‖² = G_cc + G_dd − 2 G_cd`` (equal to ``Σ_c p_c G_cc − pᵀ G p`` for Σ p = 1, but
    non-negative term by term: no cancellation for the near-one-hot ``p`` of a converged
    network).  ``p`` is renormalised in float64.

    Args:
        gram: The logit Gram matrices, ``(n, C, C)`` (summed over parameter blocks, e.g.
            [`gram`][laplace_debiased.posterior.jacobians.LayerJacobian.gram]).
        probs: The softmax outputs, ``(n, C)``.

    Returns:
        The traces, ``(n,)`` in float64.
    """
    if gram.ndim != 3 or gram.shape[1:] != (probs.shape[-1],) * 2 or probs.shape[0] != gram.shape[0]:
        raise ValueError(f"need gram (n, C, C) and probs (n, C), got {tuple(gram.shape)} and {tuple(probs.shape)}")
    G = gram.double()
    p = probs.double() / probs.double().sum(-1, keepdim=True)
    sq = G.diagonal(dim1=1, dim2=2)
    dist = (sq[:, :, None] + sq[:, None, :] - 2 * G).clamp_min(0)  # ‖J_c − J_d‖², round-off clamped
    return 0.5 * torch.einsum("nc,nd,ncd->n", p, p, dist)


def top_shares(values: Tensor, fractions: Sequence[float]) -> dict[float, float]:
    """Share of ``values.sum()`` held by the largest ``ceil(f·n)`` entries, for each fraction ``f``
    (``values`` ``(n,)``, non-negative)."""
    if (values < 0).any():
        raise ValueError("values must be non-negative")
    ordered = values.double().sort(descending=True).values
    total = float(ordered.sum())
    return {f: float(ordered[: math.ceil(f * len(ordered))].sum()) / total for f in fractions}


def batch_coverage(n_top: int, n_data: int, batch_size: int) -> dict[str, float]:
    """How a batch of ``batch_size`` drawn without replacement from ``n_data`` points samples a
    set of ``n_top`` of them: the expected number it contains, ``b·k/N``, and the probability it
    contains none, ``C(N−k, b) / C(N, b)`` (hypergeometric)."""
    if not 0 <= n_top <= n_data or not 0 < batch_size <= n_data:
        raise ValueError(f"need 0 ≤ n_top ≤ n_data and 0 < batch_size ≤ n_data, got {n_top}, {n_data}, {batch_size}")
    log_none = (math.lgamma(n_data - n_top + 1) - math.lgamma(n_data - n_top - batch_size + 1)
                - math.lgamma(n_data + 1) + math.lgamma(n_data - batch_size + 1)) if n_data - n_top >= batch_size else -math.inf
    return {"expected": batch_size * n_top / n_data, "p_none": math.exp(log_none)}

"""Weighted Gram matrices of (rotated) Jacobians shared by the posterior structures, and the
prior-precision check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace_debiased.posterior.jacobians import LayerJacobian


def as_prior(delta: float | Tensor, n_blocks: int, dtype: torch.dtype) -> Tensor:
    """One prior precision per block, checked.

    Args:
        delta: a scalar or ``(n_blocks,)`` prior precision (one per parameter tensor).
        n_blocks: number of parameter tensors.
        dtype: dtype of the result.

    Returns:
        ``(n_blocks,)`` prior precisions (a scalar broadcast to every block).

    Raises:
        ValueError: for a number of values other than 1 or ``n_blocks``, or a value ``<= 0``.
    """
    d = torch.as_tensor(delta, dtype=dtype).reshape(-1)
    if len(d) not in (1, n_blocks):
        raise ValueError(
            f"prior precision must be a scalar or one value per parameter tensor ({n_blocks}), "
            f"got {len(d)} values"
        )
    if (d <= 0).any():
        raise ValueError(f"prior precision must be positive, got {d.tolist()}")
    return d.expand(n_blocks)


#: Elements of the pair-product buffer in [`weighted_grams`][laplace_debiased.posterior.grams.weighted_grams]
#: (2**22 float32 = 16 MiB).
PAIR_BUFFER = 2**22


def weighted_grams(A: Tensor, W: Tensor) -> Tensor:
    """``A diag(w_g) Aᵀ`` for every row ``w_g`` of ``W``: A ``(n, C, p)``, W ``(G, p)`` ->
    ``(G, n, C, C)``.

    For ``G ≥ 3`` ``A`` is read once for the whole grid: the upper-triangle entries are one matrix
    product of the pair products ``A_c ∘ A_d`` (``c ≤ d``) with ``Wᵀ``, computed in pieces of at
    most [`PAIR_BUFFER`][laplace_debiased.posterior.grams.PAIR_BUFFER] elements (inputs × pairs × columns);
    about 3x faster than one batched matrix product per grid point at 14 points.  For ``G ≤ 2`` forming the
    pairs costs more than it saves, so it is one batched matrix product ``(A ∘ w_g) Aᵀ`` per grid point.
    """
    if len(W) < 3:
        return torch.stack([(A * w) @ A.transpose(1, 2) for w in W])
    n, C, p = A.shape
    iu, ju = torch.triu_indices(C, C, device=A.device)
    n_pairs = len(iu)
    cols = max(1, min(p, PAIR_BUFFER // n_pairs))
    rows = max(1, PAIR_BUFFER // (n_pairs * cols))
    upper = A.new_zeros(n, n_pairs, len(W))
    for r in range(0, n, rows):
        for c in range(0, p, cols):
            Ar = A[r : r + rows, :, c : c + cols]
            upper[r : r + rows] += (Ar[:, iu] * Ar[:, ju]) @ W[:, c : c + cols].T
    upper = upper.permute(2, 0, 1)
    out = A.new_zeros(len(W), n, C, C)
    out[:, :, iu, ju] = upper
    out[:, :, ju, iu] = upper
    return out


def jacobian_float64(jac: LayerJacobian) -> LayerJacobian:
    """``jac`` in float64.

    Args:
        jac: a layer's logit Jacobian, factored (``g``, ``a``) or dense.

    Returns:
        The factored Jacobian with both factors in float64, or the dense Jacobian
        ``(n, C, numel)`` in float64 (a sum over positions summed in float64).
    """
    if jac.positions is not None:
        return LayerJacobian(dense=LayerJacobian(positions=tuple(t.double() for t in jac.positions)).full())
    if jac.g is None:
        return LayerJacobian(dense=jac.full().double())
    return LayerJacobian(g=jac.g.double(), a=jac.a.double())


def residual_gram(jac: LayerJacobian, JU: Tensor, U_b: Tensor) -> Tensor:
    """``R Rᵀ`` of the residual ``R = J - (JU) U_bᵀ`` of one parameter tensor.

    ``R`` is formed in column pieces of at most [`PAIR_BUFFER`][laplace_debiased.posterior.grams.PAIR_BUFFER]
    elements (a factored ``Linear`` Jacobian a few weight rows at a time), never the whole ``(n, C, numel)``
    Jacobian.

    Args:
        jac: the parameter tensor's Jacobian ``J`` (``(n, C, numel)`` dense, or factored).
        JU: ``(n, C, k)`` Jacobian of all parameters times the eigenbasis.
        U_b: ``(numel, k)`` rows of the eigenbasis ``U`` that belong to this parameter tensor.

    Returns:
        ``(n, C, C)``: ``R Rᵀ`` per input.
    """
    n, C = JU.shape[:2]
    if jac.dense is not None:
        step = max(1, PAIR_BUFFER // (n * C))
        pieces = ((jac.dense[..., c : c + step], slice(c, c + step)) for c in range(0, jac.dense.shape[-1], step))
    else:
        width = jac.a.shape[-1]
        rows = max(1, PAIR_BUFFER // (n * C * width))
        pieces = (
            ((jac.g[..., o : o + rows, None] * jac.a[:, None, None, :]).flatten(2), slice(o * width, (o + rows) * width))
            for o in range(0, jac.g.shape[-1], rows)
        )
    gram = JU.new_zeros(n, C, C)
    for J_piece, cols in pieces:
        R = J_piece - JU @ U_b[cols].T
        gram += R @ R.transpose(1, 2)
    return gram

"""Eigenspace overlaps between batches (paper Fig. 3): Ω_ij = (u_iᵀ ũ_j)²."""

from __future__ import annotations

from torch import Tensor


def overlap_matrix(U: Tensor, V: Tensor) -> Tensor:
    """``Ω`` of shape ``(K, L)`` with ``Ω_ij = (u_iᵀ v_j)²`` for ``U (P, K)``, ``V (P, L)``.

    For orthonormal columns each row sums to at most 1 (the squared norm of the projection of
    u_i onto span V) and to exactly 1 when V is a complete orthonormal basis.
    """
    if U.ndim != 2 or V.ndim != 2 or U.shape[0] != V.shape[0]:
        raise ValueError(f"U and V must be (P, K) and (P, L) matrices, got {tuple(U.shape)}, {tuple(V.shape)}")
    return (U.T @ V).square()


def mean_row_mass(omega: Tensor) -> float:
    """Mean row sum of an overlap matrix ``Ω (K, L)``: ``‖UᵀV‖_F² / K`` ∈ [0, 1] for orthonormal
    columns, the mean fraction of each u_i that lies in span V (1: span U ⊆ span V; about L/P for
    random subspaces of R^P)."""
    return float(omega.sum() / omega.shape[0])

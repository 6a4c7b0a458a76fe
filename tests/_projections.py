"""EKFAC blocks over the eigenprojections of their factors, formed densely (tiny models only): a
factor ``Q`` ``(d, r)`` has the projections ``q_i q_iᵀ`` and, for ``r < d``, its complement
``I - QQᵀ``; a block is ``Σ_ab Λ_ab P_a ⊗ P_b``."""

from __future__ import annotations

import torch
from torch import nn


def _projectors(Q: torch.Tensor) -> list[torch.Tensor]:
    """The eigenprojections of one factor: ``q_i q_iᵀ``, and the complement ``I - QQᵀ`` if ``r < d``."""
    P = [torch.outer(q, q) for q in Q.T]
    if Q.shape[1] < Q.shape[0]:
        P.append(torch.eye(len(Q), dtype=Q.dtype) - Q @ Q.T)
    return P


def _pairs(Qs: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(index into Λ, P_a ⊗ P_b)`` over the eigenprojections of a block's factors."""
    if len(Qs) == 1:
        return [((a,), P) for a, P in enumerate(_projectors(Qs[0]))]
    PG, PA = _projectors(Qs[0]), _projectors(Qs[1])
    return [((a, b), torch.kron(Pa, Pb)) for a, Pa in enumerate(PG) for b, Pb in enumerate(PA)]


def block_from_projectors(Qs: list[torch.Tensor], lam: torch.Tensor, delta: float = 0.0) -> torch.Tensor:
    """``Σ_ab (Λ_ab + δ) P_a ⊗ P_b`` formed densely."""
    return sum((lam[idx] + delta) * P for idx, P in _pairs(Qs))


def projection(Qs: list[torch.Tensor], C: torch.Tensor) -> torch.Tensor:
    """Coefficients ``⟨C, P⟩ / ⟨P, P⟩`` of the Frobenius projection of ``C`` onto the ``P_a ⊗ P_b``
    (mutually orthogonal projectors), in ``Λ``'s shape."""
    out = torch.zeros([Q.shape[1] + (Q.shape[1] < Q.shape[0]) for Q in Qs], dtype=C.dtype)
    for idx, P in _pairs(Qs):
        out[idx] = (C * P).sum() / P.trace()
    return out


def parameter_blocks(M: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    """The diagonal blocks of ``M`` ``(P, P)``, one per parameter tensor of ``model``."""
    bounds = torch.tensor([0] + [p.numel() for p in model.parameters()]).cumsum(0).tolist()
    return [M[a:b, a:b] for a, b in zip(bounds, bounds[1:])]

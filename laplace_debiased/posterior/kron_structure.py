"""``KronStructure``: the Kronecker-factored posterior ``s·H + δ`` of a ``KronDecomposed`` ``H``,
rotated once, covariances and variances for a whole grid of prior precisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from laplace_debiased.posterior.grams import as_prior, jacobian_float64, weighted_grams
from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.posterior.links import project_classes


class KronStructure:
    """Posterior ``s·H + δ`` for a ``KronDecomposed`` ``H`` (one block per parameter tensor).

    ``eigenvectors[k]`` is ``[Q_G, Q_A]`` (output-side factor first, as laplace-torch orders
    ``weight.flatten()``) or ``[Q]`` for a one-factor block (biases).  With ``damping=True`` the
    block eigenvalues are ``(√s λ_G + √δ) ⊗ (√s λ_A + √δ)`` (laplace-torch's documented damping;
    note laplace-torch 0.3 itself drops the flag when it scales ``H``).  Everything is held and
    computed in float64 (round-off negative factor eigenvalues clamped to 0); rotated Jacobians, covariances and variances are float64.
    """

    def __init__(self, H, h_factor: float | Tensor, numels: Sequence[int]) -> None:
        self.Qs = [[q.double() for q in qs] for qs in H.eigenvectors]
        self.ls = [[l.double().clamp_min(0.0) for l in ls] for ls in H.eigenvalues]
        self.damping = bool(getattr(H, "damping", False))
        self.s = float(h_factor)
        sizes = [math.prod(len(l) for l in ls) for ls in self.ls]
        if list(sizes) != list(numels):
            raise ValueError(
                f"K-FAC blocks have sizes {sizes} but the Laplace parameters have {list(numels)}; "
                "the posterior and the model do not match"
            )

    def rotate(self, jacs: Sequence[LayerJacobian]) -> list[tuple[str, Tensor, Tensor | None]]:
        """Prior-independent work: Jacobians (float64) in the eigenbasis of each block. A
        Jacobian that is a sum over positions (``Conv2d``) is rotated factor by factor where
        that is cheaper ([`rotate_positions`][laplace_debiased.posterior.kron_structure.rotate_positions])."""
        out = []
        for jac, Qs in zip(jacs, self.Qs):
            if len(Qs) == 2 and jac.positions is not None and positions_cheaper(jac.positions):
                out.append(("dense", rotate_positions(*jac.positions, Qs[0], Qs[1]), None))
                continue
            jac = jacobian_float64(jac)
            if len(Qs) == 2 and jac.dense is None:
                out.append(("factored", rows_times(jac.g, Qs[0]), rows_times(jac.a, Qs[1]).square()))
            elif len(Qs) == 2:
                n, C, _ = jac.dense.shape
                J = jac.dense.reshape(n, C, len(Qs[0]), len(Qs[1]))
                out.append(("dense", (Qs[0].T @ J @ Qs[1]).flatten(2), None))
            else:
                out.append(("dense", jac.full() @ Qs[0], None))
        return out

    def _inverse_eigenvalues(self, k: int, delta: Tensor) -> Tensor:
        ls = self.ls[k]
        if len(ls) == 1:
            return 1.0 / (self.s * ls[0] + delta)
        if self.damping:
            r, sd = math.sqrt(self.s), delta.sqrt()
            return 1.0 / torch.outer(r * ls[0] + sd, r * ls[1] + sd)
        return 1.0 / (self.s * torch.outer(ls[0], ls[1]) + delta)

    def _weights(self, k: int, deltas: Tensor) -> Tensor:
        """``(G, numel_k)`` inverse posterior eigenvalues of block ``k`` for every grid point."""
        return torch.stack([self._inverse_eigenvalues(k, d).reshape(-1) for d in deltas[:, k]])

    def _deltas(self, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        return torch.stack([as_prior(d, len(self.ls), torch.float64) for d in prior_precisions])

    def covariances(self, rotated, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        """``Σ(δ_g) = Σ_k J̃_k diag(1/(s λ_k + δ_gk)) J̃_kᵀ`` for every prior precision of a grid,
        shape ``(G, n, C, C)``, float64; each rotated Jacobian is read once for the whole grid."""
        deltas = self._deltas(prior_precisions)  # (G, K)
        cov = rotated[0][1].new_zeros(len(deltas), *self._shape(rotated), rotated[0][1].shape[1])
        for k, (kind, A, B) in enumerate(rotated):
            W = self._weights(k, deltas)
            if kind == "factored":  # Σ_ab g̃_ca g̃_da ã_b² w_gab
                BW = B @ W.reshape(len(W), A.shape[-1], B.shape[-1]).transpose(1, 2)  # (G, n, a)
                cov += (A * BW.unsqueeze(2)) @ A.transpose(1, 2)
            else:
                cov += weighted_grams(A, W)
        return cov

    @staticmethod
    def _shape(rotated) -> tuple[int, int]:
        """``(n, C)`` of a chunk (a shared block has leading size 1; ``ã²`` never is)."""
        n = max(t.shape[0] for _, A, B in rotated for t in (A, B) if t is not None)
        return n, rotated[0][1].shape[1]

    def covariance(self, rotated, delta: float | Tensor) -> Tensor:
        """``Σ(δ)`` of shape ``(n, C, C)``:
        [`covariances`][laplace_debiased.posterior.kron_structure.KronStructure.covariances] at one prior precision."""
        return self.covariances(rotated, [delta])[0]

    def variances(self, rotated, prior_precisions: Sequence[float | Tensor], project: bool = False) -> Tensor:
        """``diag Σ(δ_g)`` (or ``diag ΠΣ(δ_g)Π`` with ``project=True``), shape ``(G, n, C)``,
        float64, without forming ``Σ``: ``Σ_k (ΠJ̃_k)² w_gk`` (squares of the projected rotated
        Jacobian, so no cancellation); memory ``O(n C p)`` instead of ``O(G n C²)``."""
        deltas = self._deltas(prior_precisions)
        var = rotated[0][1].new_zeros(len(deltas), *self._shape(rotated))
        for k, (kind, A, B) in enumerate(rotated):
            W = self._weights(k, deltas)
            A2 = (project_classes(A) if project else A).square()
            if kind == "factored":
                BW = B @ W.reshape(len(W), A.shape[-1], B.shape[-1]).transpose(1, 2)  # (G, n, a)
                var += (A2 @ BW.permute(1, 2, 0)).permute(2, 0, 1)
            else:
                var += (A2 @ W.T).permute(2, 0, 1)
        return var


def rows_times(X: Tensor, M: Tensor) -> Tensor:
    """``X @ M`` for ``X`` (..., d) and ``M`` (d, k) as one matrix product over all rows of ``X``
    (a strided ``X`` would otherwise be multiplied one leading index at a time, reading ``M`` each
    time)."""
    return (X.reshape(-1, X.shape[-1]) @ M).reshape(*X.shape[:-1], M.shape[-1])


def positions_cheaper(positions: tuple[Tensor, Tensor]) -> bool:
    """Whether [`rotate_positions`][laplace_debiased.posterior.kron_structure.rotate_positions] costs fewer
    multiply-adds than rotating the dense
    Jacobian: ``T k² + C T o² + C o T k`` against ``C o k (o + k)`` per input (``o`` outputs,
    ``k`` unfolded inputs, ``T`` positions, ``C`` classes)."""
    g, u = positions
    C, o, T = g.shape[-3:]
    k = u.shape[-2]
    return T * k * k + C * T * o * o + C * o * T * k < C * o * k * (o + k)


def rotate_positions(g: Tensor, u: Tensor, Q_G: Tensor, Q_A: Tensor) -> Tensor:
    """``Q_Gᵀ J Q_A`` (flattened, ``(n, C, o·k)``, float64) of ``J[n, c] = Σ_t g[n, c, :, t]
    u[n, :, t]ᵀ`` (``g`` ``(n, C, o, T)``, ``u`` ``(n, k, T)``) as ``Σ_t (Q_Gᵀ g_t)(Q_Aᵀ u_t)ᵀ``:
    the factors are rotated before the sum over positions."""
    n, C, o, T = g.shape
    g_rot = (Q_G.T @ g.double()).reshape(n, C * o, T)
    u_rot = (Q_A.T @ u.double()).transpose(1, 2)  # (n, T, k)
    return torch.bmm(g_rot, u_rot).reshape(n, C, -1)  # one (C·o × T)(T × k) product per input

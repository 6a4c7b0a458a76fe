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
        """Prior-independent work: Jacobians (float64) in the eigenbasis of each block. A sum over
        positions (``Conv2d``, a ``Linear`` on tokens) loses its positions whose output gradient is
        zero for a row ([`live_positions`][laplace_debiased.posterior.kron_structure.live_positions]);
        one position left is the factored ``g ⊗ a``, more are rotated factor by factor and kept as
        ``("positions", Q_Gᵀ g, Q_Aᵀ u)`` where that is cheaper than rotating the dense Jacobian
        ([`positions_cheaper`][laplace_debiased.posterior.kron_structure.positions_cheaper])."""
        out = []
        for jac, Qs in zip(jacs, self.Qs):
            if len(Qs) == 2 and jac.positions is not None:
                jac = live_positions(jac)
                if jac.positions is not None and positions_cheaper(jac.positions):
                    out.append(("positions", *rotated_factors(*jac.positions, Qs[0], Qs[1])))
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
            return (self.s * ls[0]).add_(delta).reciprocal_()
        if self.damping:
            r, sd = math.sqrt(self.s), delta.sqrt()
            return torch.outer(r * ls[0] + sd, r * ls[1] + sd).reciprocal_()
        return torch.outer(self.s * ls[0], ls[1]).add_(delta).reciprocal_()  # in place: one pass each

    def _weights(self, k: int, deltas: Tensor) -> Tensor:
        """``(G, numel_k)`` inverse posterior eigenvalues of block ``k`` for every grid point."""
        return torch.stack([self._inverse_eigenvalues(k, d).reshape(-1) for d in deltas[:, k]])

    def _deltas(self, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        return torch.stack([as_prior(d, len(self.ls), torch.float64) for d in prior_precisions])

    def covariances(self, rotated, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        """``Σ(δ_g) = Σ_k J̃_k diag(1/(s λ_k + δ_gk)) J̃_kᵀ`` for every prior precision of a grid,
        shape ``(G, n, C, C)``, float64; each rotated Jacobian is read once for the whole grid.
        A block kept as rotated positions is summed over pairs of positions or formed densely,
        whichever costs fewer multiply-adds for this grid
        ([`pairs_cheaper`][laplace_debiased.posterior.kron_structure.pairs_cheaper])."""
        deltas = self._deltas(prior_precisions)  # (G, K)
        cov = rotated[0][1].new_zeros(len(deltas), *self._shape(rotated), rotated[0][1].shape[1])
        for k, (kind, A, B) in enumerate(rotated):
            W = self._weights(k, deltas)
            if kind == "positions" and pairs_cheaper(A, B, len(W), covariance=True):
                cov += pair_covariances(A, B, W)
                continue
            if kind == "positions":
                kind, A = "dense", positions_sum(A, B)
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
        Jacobian, so no cancellation); memory ``O(n C p)`` instead of ``O(G n C²)``. Rotated
        positions as in [`covariances`][laplace_debiased.posterior.kron_structure.KronStructure.covariances]
        (``Π`` applied to ``Q_Gᵀ g``, the Jacobian being linear in it)."""
        deltas = self._deltas(prior_precisions)
        var = rotated[0][1].new_zeros(len(deltas), *self._shape(rotated))
        for k, (kind, A, B) in enumerate(rotated):
            W = self._weights(k, deltas)
            if kind == "positions":  # Π acts on the classes of Q_Gᵀ g, before the sum over positions
                G = project_classes(A) if project else A
                if pairs_cheaper(A, B, len(W), covariance=False):
                    var += pair_covariances(G, B, W, diagonal=True)
                else:
                    var += (positions_sum(G, B).square_() @ W.T).permute(2, 0, 1)
                continue
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


def held_entries(jac: LayerJacobian) -> int:
    """Entries the factored GLM covariance of a K-FAC posterior holds for the Jacobian ``jac`` of one
    block over its rows: the Jacobian as built (``g`` and ``a``, ``dense``, or a sum over positions' ``g``
    and ``u``); for a sum over positions also its live positions
    ([`live_positions`][laplace_debiased.posterior.kron_structure.live_positions], where cut) and the dense
    rotated Jacobian ``(n, C, o·k)`` where [`KronStructure.rotate`][laplace_debiased.posterior.kron_structure.KronStructure.rotate]
    or the covariance at one prior precision forms it
    ([`positions_cheaper`][laplace_debiased.posterior.kron_structure.positions_cheaper],
    [`pairs_cheaper`][laplace_debiased.posterior.kron_structure.pairs_cheaper]; ``o·k`` eigenvectors at most)."""
    held = sum(t.numel() for t in (jac.g, jac.a, jac.dense) if t is not None)
    if jac.positions is None:
        return held
    held += sum(t.numel() for t in jac.positions)
    live = live_positions(jac)
    if live is not jac:
        held += sum(t.numel() for t in (live.g, live.a, *(live.positions or ())) if t is not None)
    if live.positions is None:
        return held
    g, u = live.positions
    if positions_cheaper(live.positions) and pairs_cheaper(g.transpose(-1, -2), u.transpose(-1, -2), 1, True):
        return held
    n, C, o, _ = g.shape
    return held + n * C * o * u.shape[-2]


def live_positions(jac: LayerJacobian) -> LayerJacobian:
    """``jac`` (a sum over positions) without the positions whose output gradient is zero for a
    row: the positions of each row are reordered, those with a nonzero ``g[n, :, :, t]`` first,
    and cut to the most any row keeps (the cut terms are exactly zero). A ``Linear`` applied to
    every token before a per-token head keeps one position per row, its own token: then the
    factored ``g ⊗ a`` of that position.

    Args:
        jac: a Jacobian with ``positions = (g (n, C, o, T), u (n, k, T))``.

    Returns:
        The same Jacobian, ``positions`` over ``m ≤ T`` positions, or factored (``m = 1``).
    """
    g, u = jac.positions
    live = g.ne(0).flatten(1, 2).any(1)  # (n, T)
    m = max(int(live.sum(1).max()), 1)
    if m == g.shape[-1] > 1:
        return jac
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :m]  # live positions first
    g = g.gather(-1, order[:, None, None, :].expand(*g.shape[:-1], m))
    u = u.gather(-1, order[:, None, :].expand(*u.shape[:-1], m))
    if m == 1:
        return LayerJacobian(g=g[..., 0], a=u[..., 0])
    return LayerJacobian(positions=(g, u))


def positions_cheaper(positions: tuple[Tensor, Tensor]) -> bool:
    """Whether rotating a sum over positions factor by factor
    ([`rotated_factors`][laplace_debiased.posterior.kron_structure.rotated_factors], then at most
    [`positions_sum`][laplace_debiased.posterior.kron_structure.positions_sum]) costs fewer
    multiply-adds per input than forming and rotating the dense Jacobian:
    ``T k² + C T o² + C o T k`` against ``C o k (T + o + k)`` (``o`` outputs, ``k`` unfolded
    inputs, ``T`` positions, ``C`` classes)."""
    g, u = positions
    C, o, T = g.shape[-3:]
    k = u.shape[-2]
    return T * k * k + C * T * o * o + C * o * T * k < C * o * k * (T + o + k)


def rotated_factors(g: Tensor, u: Tensor, Q_G: Tensor, Q_A: Tensor) -> tuple[Tensor, Tensor]:
    """The factors of ``J[n, c] = Σ_t g[n, c, :, t] u[n, :, t]ᵀ`` (``g`` ``(n, C, o, T)``, ``u``
    ``(n, k, T)``) in the eigenbasis, float64: ``Q_Gᵀ g`` as ``(n, C, T, e_G)`` and ``Q_Aᵀ u`` as
    ``(n, T, e_A)`` (``Q_G`` ``(o, e_G)``, ``Q_A`` ``(k, e_A)``)."""
    return rows_times(g.double().transpose(-1, -2), Q_G), rows_times(u.double().transpose(-1, -2), Q_A)


def positions_sum(G: Tensor, A: Tensor) -> Tensor:
    """The rotated Jacobian ``Σ_t G[n, c, t] ⊗ A[n, t]`` of rotated factors ``G`` ``(n, C, T, e_G)``
    and ``A`` ``(n, T, e_A)``, flattened ``(n, C, e_G·e_A)``: one ``(C·e_G × T)(T × e_A)`` product
    per input."""
    n, C, T, e = G.shape
    return torch.bmm(G.permute(0, 1, 3, 2).reshape(n, C * e, T), A).reshape(n, C, -1)


def pairs_cheaper(G: Tensor, A: Tensor, grid: int, covariance: bool) -> bool:
    """Whether summing over pairs of positions is cheaper than the dense rotated Jacobian.

    Compares the multiply-adds per input of
    [`pair_covariances`][laplace_debiased.posterior.kron_structure.pair_covariances] and of forming
    the rotated Jacobian ([`positions_sum`][laplace_debiased.posterior.kron_structure.positions_sum])
    and weighting it, for ``grid`` prior precisions, ``e = e_G e_A`` eigenvalues and ``T`` positions:

    * pairs: ``grid · (T(T+1)/2 · e + C T² e_G + C² T e_G)`` (covariances) or
      ``grid · (T(T+1)/2 · e + C T² e_G + C T e_G)`` (variances);
    * dense: ``C T e + grid · C(C+1)/2 · e`` (covariances) or ``C T e + grid · C e`` (variances).

    Args:
        G: ``(n, C, T, e_G)`` rotated output gradients.
        A: ``(n, T, e_A)`` rotated inputs.
        grid: the number of prior precisions.
        covariance: count for the covariance (``True``) or its diagonal (``False``).
    """
    C, T, e_G = G.shape[-3:]
    e = e_G * A.shape[-1]
    classes = C * C if covariance else C
    pairs = grid * (T * (T + 1) // 2 * e + C * T * T * e_G + classes * T * e_G)
    dense = C * T * e + grid * (C * (C + 1) // 2 if covariance else C) * e
    return pairs < dense


def pair_covariances(G: Tensor, A: Tensor, W: Tensor, diagonal: bool = False) -> Tensor:
    """``Σ_{t,t'} Σ_ij G[n,c,t,i] G[n,c',t',i] A[n,t,j] A[n,t',j] W[g, ij]``: the weighted Gram
    matrices of ``J̃ = Σ_t G_t ⊗ A_t`` over pairs of positions, without forming ``J̃``.

    Per prior precision ``B[n, (t,t'), i] = Σ_j W[g, ij] A[n,t,j] A[n,t',j]`` for the pairs
    ``t ≤ t'`` (symmetric), then ``H[n,c,t',i] = Σ_t G[n,c,t,i] B[n,(t,t'),i]`` and the covariance
    ``H G ᵀ`` (or its diagonal ``Σ H ∘ G``).

    Args:
        G: ``(n, C, T, e_G)`` rotated output gradients.
        A: ``(n, T, e_A)`` rotated inputs.
        W: ``(grid, e_G·e_A)`` weights (inverse posterior eigenvalues).
        diagonal: return only the diagonal.

    Returns:
        ``(grid, n, C, C)``, or ``(grid, n, C)`` with ``diagonal=True``.
    """
    n, T, e_A = A.shape
    e_G = G.shape[-1]
    it, jt = torch.triu_indices(T, T, device=A.device)
    P = A[:, it] * A[:, jt]  # (n, pairs, e_A)
    out = []
    for w in W.reshape(len(W), e_G, e_A):
        half = P @ w.T  # (n, pairs, e_G)
        B = half.new_empty(n, T, T, e_G)
        B[:, it, jt] = half
        B[:, jt, it] = half
        H = torch.einsum("ncti,ntsi->ncsi", G, B)
        if diagonal:
            out.append((H * G).sum((-2, -1)))
        else:
            out.append(H.flatten(2) @ G.flatten(2).transpose(1, 2))
    return torch.stack(out)

"""Decomposed K-FAC whose factors may keep their null space implicit.

A K-FAC factor of a batch narrower than the layer (``d`` inputs, ``n < d`` rows) has rank
``≤ n``.
[`laplace_debiased.curvature.linalg.lowrank_debiased_factor`][laplace_debiased.curvature.linalg.lowrank_debiased_factor]
returns its debiased eigenpairs as ``Q`` (d, r) orthonormal and ``λ`` (r + 1,): ``λ[:r]`` along ``Q`` and
``ν = λ[r]`` on the whole complement ``N = I - QQᵀ`` (0 for B's null space compressed onto B̃, the "aligned"
treatment; a mean Rayleigh quotient for the "isotropic" one).
[`ImplicitKronDecomposed`][laplace_debiased.kron.posterior.ImplicitKronDecomposed] is laplace-torch's
``KronDecomposed`` for such factors, never forming a ``d × d`` basis except in ``to_matrix``:

* a factor is ``Σ_k λ_k q_k q_kᵀ + ν N``: the *extended* spectrum ``[λ_1, ..., λ_r, ν]`` with
  multiplicities ``[1, ..., 1, d - r]`` (``r`` eigenvalues only: ``ν = 0``; ``Q`` square: no
  null space, laplace-torch's layout);
* a block ``F_1 ⊗ F_2`` plus prior ``δ`` has, on ``range(P_a ⊗ P_b)`` for the eigenprojections
  ``P_a`` of ``F_1`` and ``P_b`` of ``F_2`` (the ``q q ᵀ`` and ``N``), the eigenvalue
  ``g(l_a, l_b) = l_a l_b + δ`` (laplace-torch's ``damping=True``: ``(l_a + √δ)(l_b + √δ)``).
  On the null space of ``F_2`` that is ``l_a ν + δ`` (``δ`` for ``ν = 0``; damped
  ``(l_a + √δ)(ν + √δ)``), exactly what the dense route gives those eigenvalues;
* so ``(F + δ)^e W = Σ_ab g(l_a, l_b)^e P_a W P_b`` with ``W`` (d_1, d_2) the block of a
  parameter vector, ``log det = Σ_ab mult_a mult_b log g(l_a, l_b)`` and
  ``diag = Σ_ab g^e diag(P_a) ⊗ diag(P_b)`` (``diag N = 1 - Σ_k q_k²``).

With every factor square (``r = d``) each method reduces to laplace-torch's. ``+`` and ``*``
keep ``damping`` (laplace-torch 0.3 drops it in both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from laplace.utils.matrix import KronDecomposed
from laplace.utils.utils import _is_valid_scalar
from torch import Tensor

from laplace_debiased.curvature.completion import extended_spectrum
from laplace_debiased.posterior.grams import jacobian_float64
from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.posterior.kron_structure import KronStructure, live_positions, rows_times

__all__ = ["ImplicitKronDecomposed", "ImplicitKronStructure", "apply_one", "apply_two", "complete_basis", "diag_weights"]


def complete_basis(Q: Tensor, eigenvalues: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q_full (d, d), [λ_1, ..., λ_r, ν, ..., ν])``: ``Q`` (d, r) completed to an orthonormal
    basis by a complete QR (``O(d² r)``; the complement's basis is arbitrary), the null
    eigenvalue ``ν`` (module docstring) repeated ``d - r`` times."""
    r, d = Q.shape[1], Q.shape[0]
    if r == d:
        return Q, eigenvalues
    ext, _ = extended_spectrum(Q, eigenvalues)
    full = torch.linalg.qr(Q.double(), mode="complete").Q
    full = torch.cat([Q.double(), full[:, r:]], dim=1).to(Q.dtype)
    return full, torch.cat([ext[:r], ext[r:].expand(d - r)])


def _block_eigenvalues(ls: Sequence[Tensor], delta: Tensor, damping: bool) -> Tensor:
    """``g(l_a, l_b)`` of module docstring on the extended spectra, ``(a,)`` or ``(a, b)``."""
    if len(ls) == 1:
        return ls[0] + delta
    if damping:
        return torch.outer(ls[0] + delta.sqrt(), ls[1] + delta.sqrt())
    return torch.outer(ls[0], ls[1]) + delta


def apply_one(W: Tensor, Q: Tensor, f: Tensor) -> Tensor:
    """``Σ_a f_a P_a`` applied to the rows of ``W`` (m, d) for one factor (extended ``f``)."""
    r = Q.shape[1]
    WQ = W @ Q
    out = (WQ * f[:r]) @ Q.T
    if len(f) > r:
        out = out + f[r] * (W - WQ @ Q.T)
    return out


def apply_two(W: Tensor, Q1: Tensor, Q2: Tensor, F: Tensor) -> Tensor:
    """``Σ_ab F_ab P_a W P_b`` for ``W`` (m, d_1, d_2), extended ``F`` (module docstring)."""
    r1, r2 = Q1.shape[1], Q2.shape[1]
    WQ2 = W @ Q2
    A = Q1.T @ WQ2
    left = Q1 @ (F[:r1, :r2] * A)
    if F.shape[0] > r1:
        left = left + (WQ2 - Q1 @ A) * F[r1, :r2]
    out = left @ Q2.T
    if F.shape[1] > r2:
        WN2 = W - WQ2 @ Q2.T
        Cn = Q1.T @ WN2
        out = out + Q1 @ (F[:r1, r2:] * Cn)
        if F.shape[0] > r1:
            out = out + F[r1, r2] * (WN2 - Q1 @ Cn)
    return out


def diag_weights(Q: Tensor) -> Tensor:
    """``(d, r[+1])``: ``diag(q_k q_kᵀ) = q_k²`` and, with a null space, ``diag N``."""
    Q2 = Q.square()
    if Q.shape[1] == Q.shape[0]:
        return Q2
    return torch.cat([Q2, (1.0 - Q2.sum(1, keepdim=True)).clamp_min(0.0)], dim=1)


class ImplicitKronDecomposed(KronDecomposed):
    """laplace-torch ``KronDecomposed`` whose eigenvector matrices may be ``(d, r)``, ``r ≤ d``,
    with ``r`` or ``r + 1`` eigenvalues, the last then the factor's eigenvalue on the whole
    complement (else 0; module docstring). All of laplace-torch's uses
    (``logdet``, ``bmm``, ``inv_square_form``, ``diag``; ``to_matrix`` completes the bases) and
    the grid predictive
    ([`grid_structure`][laplace_debiased.kron.posterior.ImplicitKronDecomposed.grid_structure]) keep
    the null space implicit."""

    def __add__(self, deltas: Tensor) -> ImplicitKronDecomposed:
        self._check_deltas(deltas)
        return type(self)(self.eigenvectors, self.eigenvalues, self.deltas + deltas, damping=self.damping)

    def __mul__(self, scalar: Tensor | float) -> ImplicitKronDecomposed:
        if not _is_valid_scalar(scalar):
            raise ValueError("Invalid argument, can only multiply Kron with scalar.")
        eigenvalues = [[pow(scalar, 1 / len(ls)) * l for l in ls] for ls in self.eigenvalues]
        return type(self)(self.eigenvectors, eigenvalues, self.deltas, damping=self.damping)

    __radd__ = __add__
    __rmul__ = __mul__

    def _blocks(self):
        """Per block: eigenvectors, extended spectra, multiplicities and the prior."""
        for Qs, ls, delta in zip(self.eigenvectors, self.eigenvalues, self.deltas):
            ext = [extended_spectrum(Q, l) for Q, l in zip(Qs, ls)]
            yield Qs, [e[0] for e in ext], [e[1] for e in ext], delta

    def logdet(self) -> Tensor:
        total = 0
        for _, ls, mults, delta in self._blocks():
            mult = mults[0] if len(ls) == 1 else torch.outer(mults[0], mults[1])
            total = total + (mult * torch.log(_block_eigenvalues(ls, delta, self.damping))).sum()
        return total

    def _bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        B, K, P = W.shape
        W = W.reshape(B * K, P)
        out, start = [], 0
        for Qs, ls, _, delta in self._blocks():
            F = torch.pow(_block_eigenvalues(ls, delta, self.damping), exponent)
            sizes = [Q.shape[0] for Q in Qs]
            Wp = W[:, start : start + math.prod(sizes)]
            if len(Qs) == 1:
                out.append(apply_one(Wp, Qs[0], F))
            else:
                out.append(apply_two(Wp.reshape(-1, *sizes), *Qs, F).flatten(1))
            start += math.prod(sizes)
        return torch.cat(out, dim=1).reshape(B, K, P)

    def diag(self, exponent: float = 1) -> Tensor:
        diags = []
        for Qs, ls, _, delta in self._blocks():
            F = torch.pow(_block_eigenvalues(ls, delta, self.damping), exponent)
            E = [diag_weights(Q) for Q in Qs]
            diags.append(E[0] @ F if len(Qs) == 1 else (E[0] @ F @ E[1].T).flatten())
        return torch.cat(diags)

    def completed(self) -> KronDecomposed:
        """laplace-torch's ``KronDecomposed`` of the same matrix, every basis completed
        ([`complete_basis`][laplace_debiased.kron.posterior.complete_basis], ``O(d² r)`` per implicit
        factor)."""
        blocks = [[complete_basis(Q, l) for Q, l in zip(Qs, ls)] for Qs, ls in zip(self.eigenvectors, self.eigenvalues)]
        return KronDecomposed(
            [[b[0] for b in bl] for bl in blocks], [[b[1] for b in bl] for bl in blocks], self.deltas, damping=self.damping
        )

    def to_matrix(self, exponent: float = 1) -> Tensor:
        return self.completed().to_matrix(exponent)

    def grid_structure(self, h_factor: float | Tensor, numels: Sequence[int]) -> KronStructure:
        """The grid predictive's structure:
        [`ImplicitKronStructure`][laplace_debiased.kron.posterior.ImplicitKronStructure] if a factor
        is implicit, else [`KronStructure`][laplace_debiased.posterior.kron_structure.KronStructure]."""
        if all(Q.shape[0] == Q.shape[1] for Qs in self.eigenvectors for Q in Qs):
            return KronStructure(self, h_factor, numels)
        return ImplicitKronStructure(self, h_factor, numels)


class ImplicitKronStructure(KronStructure):
    """[`KronStructure`][laplace_debiased.posterior.kron_structure.KronStructure] of an
    [`ImplicitKronDecomposed`][laplace_debiased.kron.posterior.ImplicitKronDecomposed], every factor ``Q`` (d, r) with its complement ``N = I - QQᵀ``
    kept implicit (one more eigenvalue ``ν``, module docstring); nothing of size ``d × d`` is formed.

    A Jacobian is rotated into columns that each belong to one eigenprojection of each factor; a
    complement contributes several columns sharing its weight ``1/(s l_a ν + δ)`` (damped
    ``1/((√s l_a + √δ)(√s ν + √δ))``), so the covariance's cross terms stay exact:

    * factored ``g ⊗ a`` (a ``Linear`` weight): output side ``[Q_Gᵀ g_c, L_c]`` with ``L Lᵀ = R Rᵀ``
      the Gram matrix of the residuals ``R = N_G g`` over the ``C`` classes (``C`` columns, from a
      QR of ``Rᵀ``, no cancellation); input side ``[(Q_Aᵀ a)², ‖N_A a‖²]``. Cost ``O(C d r)`` per
      input;
    * a sum over positions ``Σ_t g_t u_tᵀ`` (``Conv2d``, a ``Linear`` on tokens), after
      [`live_positions`][laplace_debiased.posterior.kron_structure.live_positions] (one position
      left: factored as above): rotated factors ``[Q_Gᵀ g_ct, L_ct]`` and ``[Q_Aᵀ u_t, L_t]``, each
      ``L`` compressing the residuals over all ``(c, t)`` (``min(C T, o)`` columns), resp. all
      ``t`` (``min(T, k)`` columns), as above; the cross terms ``Σ_{i ∈ N} G_cti G_c't'i`` are then
      exact for every pair of positions, whatever the other factor's column;
    * dense ``J``: ``[Q_1ᵀ J, N_1 J]`` on each side (``d`` complement columns per side); a single
      factor as the output side above.
    """

    def __init__(self, H: ImplicitKronDecomposed, h_factor: float | Tensor, numels: Sequence[int]) -> None:
        self.Qs, self.ls = [], []
        shared: dict[int, Tensor] = {}  # a bias shares its weight's output-side eigenvectors
        for Qs, ls in zip(H.eigenvectors, H.eigenvalues):
            for Q in Qs:
                if id(Q) not in shared:
                    shared[id(Q)] = Q.double()
            self.Qs.append([shared[id(Q)] for Q in Qs])
            self.ls.append([extended_spectrum(Q, l)[0].double().clamp_min(0.0) for Q, l in zip(Qs, ls)])
        self.damping = bool(getattr(H, "damping", False))
        self.s = float(h_factor)
        self._maps: list[list[Tensor]] = [[] for _ in self.Qs]
        sizes = [math.prod(Q.shape[0] for Q in Qs) for Qs in self.Qs]
        if sizes != list(numels):
            raise ValueError(
                f"K-FAC blocks have sizes {sizes} but the Laplace parameters have {list(numels)}; "
                "the posterior and the model do not match"
            )

    def rotate(self, jacs: Sequence[LayerJacobian]) -> list[tuple[str, Tensor, Tensor | None]]:
        """Prior-independent work: the Jacobians (float64) in the columns of the class docstring. An
        output side shared by two blocks (a ``Linear`` weight's ``g`` is its bias's Jacobian, the
        eigenvectors the same) is rotated once."""
        out = []
        sides: dict[tuple[int, int], Tensor] = {}

        def compressed(X: Tensor, source: Tensor | None, Q: Tensor) -> Tensor:
            if source is None:
                return _compressed_side(X, Q)
            key = (id(source), id(Q))
            if key not in sides:
                sides[key] = _compressed_side(X, Q)
            return sides[key]

        for k, (jac, Qs) in enumerate(zip(jacs, self.Qs)):
            if len(Qs) == 2 and jac.positions is not None:
                jac = live_positions(jac)
            if len(Qs) == 2 and jac.positions is not None:
                g, u = jac.positions
                n, C, o, T = g.shape
                g_rot = _compressed_side(g.double().transpose(-1, -2).reshape(n, C * T, o), Qs[0])
                u_rot = _compressed_side(u.double().transpose(-1, -2), Qs[1])  # (n, T, e_A)
                out.append(("positions", g_rot.reshape(n, C, T, -1), u_rot))
                self._maps[k] = [
                    _column_map(Qs[0], g_rot.shape[-1] - Qs[0].shape[1]),
                    _column_map(Qs[1], u_rot.shape[-1] - Qs[1].shape[1]),
                ]
                continue
            source = jac.g if jac.g is not None else jac.dense
            jac = jacobian_float64(jac)
            if len(Qs) == 2 and jac.dense is None:
                QG, QA = Qs
                A = compressed(jac.g, source, QG)
                aQ = rows_times(jac.a, QA)
                B = aQ.square()
                if QA.shape[1] < QA.shape[0]:
                    B = torch.cat([B, (jac.a - rows_times(aQ, QA.T)).square().sum(-1, keepdim=True)], dim=-1)
                out.append(("factored", A, B))
                self._maps[k] = [_column_map(QG, A.shape[-1] - QG.shape[1]), _column_map(QA, 1)]
            elif len(Qs) == 2:
                n, C, _ = jac.dense.shape
                (Q1, Q2), (d1, d2) = Qs, (Qs[0].shape[0], Qs[1].shape[0])
                J = _sides(jac.dense.reshape(n, C, d1, d2).transpose(-1, -2), Q1)  # (n, C, d2, e1)
                J = _sides(J.transpose(-1, -2), Q2)  # (n, C, e1, e2)
                out.append(("dense", J.flatten(2), None))
                self._maps[k] = [_column_map(Q1, d1), _column_map(Q2, d2)]
            else:
                J = compressed(jac.full(), source, Qs[0])
                out.append(("dense", J, None))
                self._maps[k] = [_column_map(Qs[0], J.shape[-1] - Qs[0].shape[1])]
        return out

    def _inverse_eigenvalues(self, k: int, delta: Tensor) -> Tensor:
        w = super()._inverse_eigenvalues(k, delta)
        maps = self._maps[k]
        if len(maps) == 1:
            return w[maps[0]]
        return w[maps[0]][:, maps[1]] if maps else w


def _sides(X: Tensor, Q: Tensor) -> Tensor:
    """``[X Q, X N]`` along the last axis of ``X`` (..., d) for ``Q`` (d, r): ``(..., r [+ d])``."""
    XQ = rows_times(X, Q)
    if Q.shape[1] == Q.shape[0]:
        return XQ
    return torch.cat([XQ, X - rows_times(XQ, Q.T)], dim=-1)


def _compressed_side(X: Tensor, Q: Tensor) -> Tensor:
    """``[X Q, L]`` for ``X`` (n, m, d): ``L`` (n, m, min(m, d)) with ``L Lᵀ = R Rᵀ`` for the residuals
    ``R = X N`` (``Lᵀ`` the triangular factor of a QR of ``Rᵀ``); only ``X Q`` when ``Q`` is square."""
    XQ = rows_times(X, Q)
    if Q.shape[1] == Q.shape[0]:
        return XQ
    R = X - rows_times(XQ, Q.T)
    L = torch.linalg.qr(R.transpose(-1, -2), mode="r").R.transpose(-1, -2)  # (n, C, min(C, d))
    return torch.cat([XQ, L], dim=-1)


def _column_map(Q: Tensor, complement_columns: int) -> Tensor:
    """The eigenvalue (index into the extended spectrum) of each rotated column of one factor:
    ``0, ..., r - 1`` and, with a complement, ``r`` repeated ``complement_columns`` times."""
    r, d = Q.shape[1], Q.shape[0]
    cols = torch.arange(r, device=Q.device)
    if r == d:
        return cols
    return torch.cat([cols, cols.new_full((complement_columns,), r)])

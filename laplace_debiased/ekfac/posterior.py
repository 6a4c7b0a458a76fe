"""The debiased EKFAC posterior: per parameter block ``Q diag(vec Λ + δ) Qᵀ`` with ``Q = Q_G ⊗ Q_A``
(laplace-torch's ``KronDecomposed`` interface), and its grid structure.

A factor with fewer rows than its width keeps its complement ``N = I - QQᵀ`` implicit (``Q``
``(d, r)``, one more row or column of ``Λ``: [`laplace_debiased.ekfac.passes`][laplace_debiased.ekfac.passes]).
Each block is then ``Σ_ab (Λ_ab + δ) P_a ⊗ P_b`` over the eigenprojections ``P_a`` of each factor
(``q q ᵀ`` and ``N``, multiplicities ``1`` and ``d - r``), applied as
[`ImplicitKronDecomposed`][laplace_debiased.kron.posterior.ImplicitKronDecomposed] applies its
blocks, with ``Λ`` in place of the outer product of the factors' spectra; nothing of size ``d × d``
is formed except in ``to_matrix``.

``EKFACDecomposed`` is the ``la.H`` of a ``debiased_ekfac`` fit, ``SpannedEKFACDecomposed`` the same
where a block spans several parameter tensors; ``EKFACStructure`` / ``SpannedEKFACStructure`` rotate
Jacobians once into their eigenbasis for the grid predictive
([`laplace_debiased.posterior.grid`][laplace_debiased.posterior.grid]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from laplace.utils.utils import _is_valid_scalar
from torch import Tensor

from laplace_debiased.ekfac.passes import ekfac_to_dense, extended_shape, implicit
from laplace_debiased.kron.posterior import ImplicitKronStructure, apply_one, apply_two, diag_weights
from laplace_debiased.posterior.kron_structure import KronStructure
from laplace_debiased.kron.spanned import Spanned, SpannedStructure

__all__ = [
    "EKFACDecomposed",
    "EKFACStructure",
    "ImplicitEKFACStructure",
    "SpannedEKFACDecomposed",
    "SpannedEKFACStructure",
    "SpannedImplicitEKFACStructure",
]


def multiplicities(Q: Tensor) -> Tensor:
    """``(r [+1],)``: ones, and ``d - r`` for an implicit complement (module docstring)."""
    ones = torch.ones(Q.shape[1], dtype=Q.dtype, device=Q.device)
    return torch.cat([ones, ones.new_full((1,), Q.shape[0] - Q.shape[1])]) if implicit(Q) else ones


class EKFACDecomposed:
    """Block-diagonal ``Q diag(vec Λ + δ) Qᵀ`` per parameter block (``Q = Q_G ⊗ Q_A`` or ``Q_G``).

    Same interface as laplace-torch's ``KronDecomposed`` (``+`` adds prior precisions, scalar or
    one per block; ``*`` scales the curvature; ``logdet``, ``bmm``, ``inv_square_form``, ``diag``,
    ``to_matrix``), but the eigenvalues ``Λ`` of a weight block are a full ``(d_out, d_in)``
    array instead of an outer product.  Powers are evaluated in float64 and cast back.

    Args:
        eigenvectors: Per block ``[Q_G (d_out, d_out), Q_A (d_in, d_in)]`` or ``[Q (d, d)]``,
            orthonormal; a factor ``(d, r)``, ``r < d``, with its complement implicit (module
            docstring).
        eigenvalues: Per block ``Λ`` of shape ``(d_out, d_in)`` or ``(d,)``; per implicit factor
            one more row or column ([`extended_shape`][laplace_debiased.ekfac.passes.extended_shape]).
        deltas: The added prior precisions, a scalar or one per block (default 0).

    Raises:
        ValueError: Blocks of eigenvectors and eigenvalues that do not match, or ``deltas`` of
            another shape.
    """

    def __init__(
        self,
        eigenvectors: Sequence[Sequence[Tensor]],
        eigenvalues: Sequence[Tensor],
        deltas: Tensor | None = None,
    ) -> None:
        if len(eigenvectors) != len(eigenvalues):
            raise ValueError(
                f"{len(eigenvectors)} eigenvector blocks but {len(eigenvalues)} eigenvalue blocks."
            )
        for i, (Qs, lam) in enumerate(zip(eigenvectors, eigenvalues)):
            shape = extended_shape(Qs)
            if tuple(lam.shape) != shape:
                raise ValueError(
                    f"block {i}: eigenvalues of shape {tuple(lam.shape)} do not match the "
                    f"eigenbasis {shape}."
                )
        self.eigenvectors = [list(Qs) for Qs in eigenvectors]
        self.eigenvalues = list(eigenvalues)
        ref = self.eigenvectors[0][0]
        if deltas is None:
            deltas = torch.zeros(len(self), device=ref.device, dtype=ref.dtype)
        self._check_deltas(deltas)
        self.deltas = deltas * torch.ones(len(self), device=ref.device, dtype=ref.dtype)

    def __len__(self) -> int:
        return len(self.eigenvalues)

    def _check_deltas(self, deltas: Tensor) -> None:
        if not isinstance(deltas, Tensor):
            raise ValueError("Can only add a torch.Tensor (prior precision) to EKFACDecomposed.")
        if not (deltas.ndim == 0 or (deltas.ndim == 1 and len(deltas) in (1, len(self)))):
            raise ValueError(
                f"prior precision of shape {tuple(deltas.shape)}: give a scalar or one value "
                f"per parameter block ({len(self)})."
            )

    def detach(self) -> EKFACDecomposed:
        self.deltas = self.deltas.detach()
        return self

    def __add__(self, deltas: Tensor) -> EKFACDecomposed:
        self._check_deltas(deltas)
        return EKFACDecomposed(self.eigenvectors, self.eigenvalues, self.deltas + deltas)

    def __mul__(self, scalar: Tensor | float) -> EKFACDecomposed:
        if not _is_valid_scalar(scalar):
            raise ValueError("Invalid argument, can only multiply EKFACDecomposed with a scalar.")
        return EKFACDecomposed(
            self.eigenvectors, [scalar * lam for lam in self.eigenvalues], self.deltas
        )

    __radd__ = __add__
    __rmul__ = __mul__

    def _powered(self, k: int, exponent: float) -> Tensor:
        """``(Λ_k + δ_k)^exponent`` in the shape of ``Λ_k`` (float64 inside)."""
        lam = self.eigenvalues[k]
        return torch.pow(lam.double() + self.deltas[k].double(), exponent).to(lam.dtype)

    def logdet(self) -> Tensor:
        """``log det`` of the whole block-diagonal matrix (with the added ``deltas``; a complement
        entry counted with its multiplicity)."""
        total = 0
        for Qs, lam, d in zip(self.eigenvectors, self.eigenvalues, self.deltas):
            mult = multiplicities(Qs[0].double())
            if len(Qs) == 2:
                mult = torch.outer(mult, multiplicities(Qs[1].double()))
            total = total + (mult * torch.log(lam.double() + d.double())).sum()
        return total.to(self.eigenvalues[0].dtype)

    def _bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        """``self^exponent @ W`` for ``W`` of shape ``(batch, classes, params)``."""
        B, K, P = W.shape
        W = W.reshape(B * K, P)
        out, start = [], 0
        for k, Qs in enumerate(self.eigenvectors):
            power = self._powered(k, exponent)
            sizes = [Q.shape[0] for Q in Qs]
            p = math.prod(sizes)
            Wk = W[:, start : start + p]
            if len(Qs) == 2:
                Wk = apply_two(Wk.reshape(B * K, *sizes), *Qs, power)
            else:
                Wk = apply_one(Wk, Qs[0], power)
            out.append(Wk.reshape(B * K, p))
            start += p
        if start != P:
            raise ValueError(f"W has {P} parameters but the blocks have {start}.")
        return torch.cat(out, dim=1).reshape(B, K, P)

    def bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        """``self^exponent`` applied to ``W`` (laplace-torch's ``KronDecomposed.bmm`` convention).

        Args:
            W: ``(params,)``, ``(batch, params)`` or ``(batch, classes, params)``.
            exponent: The power of the matrix (``-1``: its inverse).

        Returns:
            ``W`` times ``self^exponent``, with size-1 dimensions squeezed for 1-D and 2-D ``W``.

        Raises:
            ValueError: ``W`` of another number of dimensions or parameters.
        """
        if W.ndim == 1:
            return self._bmm(W[None, None], exponent).squeeze()
        if W.ndim == 2:
            return self._bmm(W.unsqueeze(1), exponent).squeeze()
        if W.ndim == 3:
            return self._bmm(W, exponent)
        raise ValueError(f"Invalid shape for W: {tuple(W.shape)}")

    def inv_square_form(self, W: Tensor) -> Tensor:
        """``W self⁻¹ Wᵀ``.

        Args:
            W: ``(batch, classes, params)``.

        Returns:
            ``(batch, classes, classes)``.
        """
        return torch.bmm(W, self._bmm(W, exponent=-1).transpose(1, 2))

    def diag(self, exponent: float = 1) -> Tensor:
        """Diagonal of ``self^exponent``.

        Args:
            exponent: The power of the matrix.

        Returns:
            ``(params,)``.
        """
        diags = []
        for k, Qs in enumerate(self.eigenvectors):
            power = self._powered(k, exponent)
            E = [diag_weights(Q) for Q in Qs]
            diags.append((E[0] @ power @ E[1].T).flatten() if len(Qs) == 2 else E[0] @ power)
        return torch.cat(diags)

    def to_matrix(self, exponent: float = 1) -> Tensor:
        """Dense ``self^exponent`` ``(params, params)`` (tests and tiny models only).

        Args:
            exponent: The power of the matrix.
        """
        return ekfac_to_dense(
            self.eigenvectors,
            [self._powered(k, 1.0) for k in range(len(self))],
            exponent=exponent,
        )

    def grid_structure(self, h_factor: float | Tensor, numels: Sequence[int]) -> EKFACStructure:
        """The [`GridPredictive`][laplace_debiased.posterior.grid.GridPredictive] structure.

        Args:
            h_factor: The curvature scale ``s`` (laplace-torch's ``_H_factor``).
            numels: The sizes of the Laplace object's parameter tensors.

        Returns:
            An [`EKFACStructure`][laplace_debiased.ekfac.posterior.EKFACStructure] of this curvature without
            its ``deltas``, an [`ImplicitEKFACStructure`][laplace_debiased.ekfac.posterior.ImplicitEKFACStructure]
            where a factor's complement is implicit.
        """
        if any(implicit(Q) for Qs in self.eigenvectors for Q in Qs):
            return ImplicitEKFACStructure(self, h_factor, numels)
        return EKFACStructure(self, h_factor, numels)


def _check_block_sizes(sizes: list[int], numels: Sequence[int]) -> None:
    """Refuse a posterior whose block sizes are not the Laplace parameters' ``numels``."""
    if sizes != list(numels):
        raise ValueError(
            f"EKFAC blocks have sizes {sizes} but the Laplace parameters have "
            f"{list(numels)}; the posterior and the model do not match"
        )


class EKFACStructure(KronStructure):
    """[`GridPredictive`][laplace_debiased.posterior.grid.GridPredictive] structure of an
    [`EKFACDecomposed`][laplace_debiased.ekfac.posterior.EKFACDecomposed] curvature: same eigenbasis rotation
    as K-FAC, eigenvalues per basis direction, ``Σ(δ) = Σ_k J̃_k diag(1 / (s vec Λ_k + δ_k)) J̃_kᵀ``.  Held
    and computed in float64 like [`KronStructure`][laplace_debiased.posterior.kron_structure.KronStructure] (round-off
    negative eigenvalues clamped to 0).

    Args:
        H: The curvature.
        h_factor: The curvature scale ``s``.
        numels: The sizes of the parameter tensors, one per block.

    Raises:
        ValueError: Block sizes other than ``numels``.
    """

    def __init__(self, H: EKFACDecomposed, h_factor: float | Tensor, numels: Sequence[int]) -> None:
        self.Qs = [[q.double() for q in qs] for qs in H.eigenvectors]
        self.ls = [lam.double().clamp_min(0.0) for lam in H.eigenvalues]
        self.damping = False
        self.s = float(h_factor)
        sizes = [lam.numel() for lam in self.ls]
        _check_block_sizes(sizes, numels)

    def _inverse_eigenvalues(self, k: int, delta: Tensor) -> Tensor:
        return 1.0 / (self.s * self.ls[k] + delta)


class ImplicitEKFACStructure(ImplicitKronStructure, EKFACStructure):
    """[`EKFACStructure`][laplace_debiased.ekfac.posterior.EKFACStructure] of an
    [`EKFACDecomposed`][laplace_debiased.ekfac.posterior.EKFACDecomposed] with implicit complements:
    Jacobians rotated as [`ImplicitKronStructure`][laplace_debiased.kron.posterior.ImplicitKronStructure]
    rotates them (a complement's columns sharing its weight), the weight of the columns of
    ``(P_a, P_b)`` being ``1 / (s Λ_ab + δ)``. Nothing of size ``d × d`` is formed for a ``Linear``
    weight's ``g ⊗ a`` Jacobian (``O(C d r)`` per input).

    Args:
        H: The curvature.
        h_factor: The curvature scale ``s``.
        numels: The sizes of the parameter tensors, one per block.

    Raises:
        ValueError: Block sizes other than ``numels``.
    """

    def __init__(self, H: EKFACDecomposed, h_factor: float | Tensor, numels: Sequence[int]) -> None:
        shared: dict[int, Tensor] = {}  # a bias shares its weight's output-side eigenvectors
        self.Qs = []
        for Qs in H.eigenvectors:
            for Q in Qs:
                if id(Q) not in shared:
                    shared[id(Q)] = Q.double()
            self.Qs.append([shared[id(Q)] for Q in Qs])
        self.ls = [lam.double().clamp_min(0.0) for lam in H.eigenvalues]
        self.damping = False
        self.s = float(h_factor)
        self._maps: list[list[Tensor]] = [[] for _ in self.Qs]
        sizes = [math.prod(Q.shape[0] for Q in Qs) for Qs in self.Qs]
        _check_block_sizes(sizes, numels)


class SpannedEKFACStructure(SpannedStructure, EKFACStructure):
    """[`EKFACStructure`][laplace_debiased.ekfac.posterior.EKFACStructure] over blocks spanning several
    parameter tensors."""


class SpannedImplicitEKFACStructure(SpannedStructure, ImplicitEKFACStructure):
    """[`ImplicitEKFACStructure`][laplace_debiased.ekfac.posterior.ImplicitEKFACStructure] over blocks
    spanning several parameter tensors."""


class SpannedEKFACDecomposed(Spanned, EKFACDecomposed):
    """[`EKFACDecomposed`][laplace_debiased.ekfac.posterior.EKFACDecomposed] whose blocks may span several
    parameter tensors (a normalisation layer's dense block;
    [`laplace_debiased.curvature.layer_blocks`][laplace_debiased.curvature.layer_blocks])."""

    _structure = SpannedEKFACStructure
    _implicit_structure = SpannedImplicitEKFACStructure

    def __init__(self, eigenvectors, eigenvalues, spans: Sequence[int], deltas: Tensor | None = None) -> None:
        super().__init__(eigenvectors, eigenvalues, deltas)
        self.spans = list(spans)

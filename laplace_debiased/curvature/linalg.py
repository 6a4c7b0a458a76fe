"""Pure linear algebra of two-batch debiasing (tensors in, tensors out, float64 inside).

Conventions:

* A curvature matrix ``C`` is symmetric positive semi-definite (GGN, Fisher, empirical
  Fisher); shape ``(n, n)``.
* ``U`` has orthonormal columns, shape ``(n, k)``, ``k <= n``; column ``U[:, i]`` is a
  direction chosen on the *direction* batch B.
* The debiased curvature along ``U[:, i]`` is the Rayleigh quotient of the *magnitude*
  batch B̃'s matrix, ``U[:, i]ᵀ C_B̃ U[:, i]`` (Tatzel et al., ICLR 2025, Sec. 4.2).
* K-FAC blocks follow laplace-torch's ``Kron`` layout: a weight block is a pair
  ``[G, A]`` with ``G`` the output-side factor ``(d_out, d_out)`` and ``A`` the input-side
  factor ``(d_in, d_in)``, so the block is ``kron(G, A)`` for the row-major flattened
  weight ``(d_out, d_in)``; a bias (or any single-factor) block is ``[G]``. Scaling
  (summed loss, rescaled to ``N`` data points) is left to the caller: every function here
  is linear in the magnitude matrix and invariant to the scale of the direction matrix.

* Degenerate eigenspaces: eigenvalues of a factor ``F`` closer than
  [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] ``(F)``
  (``10 · n · eps(F.dtype) · ‖F‖_F``) are indistinguishable at the precision ``F`` was computed in, so
  ``eigh`` may return any basis of their span (the null space of a rank-deficient factor, exactly repeated
  eigenvalues). Inside each such space the basis is fixed by the magnitude factor
  ([`aligned_eigenbasis`][laplace_debiased.curvature.linalg.aligned_eigenbasis]), which makes every debiased
  factor a function of the two matrices, not of ``eigh``'s choice.

All computations run in float64; results are cast back to the dtype of the inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "remeasure_eigenvalues",
    "clamp_roundoff_negatives",
    "order_weight",
    "order_weights",
    "roundoff_tolerance",
    "symmetric_eigh64",
    "degenerate_groups",
    "tied_groups",
    "aligned_eigenbasis",
    "debiased_factor",
    "debiased_kron",
    "gram_eigenpairs",
    "lowrank_debiased_factor",
    "through_rows",
    "check_factor",
    "compress",
    "compress_diagonal",
    "FactorRows",
    "RowFactor",
    "dense_factor",
    "factor_rows",
    "gram_spectrum",
    "row_rank",
    "eigenvalues_above",
]



class FactorRows(tuple):
    """The rows ``(direction_rows (n, d), magnitude_rows (m, d))`` of a factor pair, ``F = XᵀX``,
    with the Gram matrix of both stacked, ``[Xd; Xm][Xd; Xm]ᵀ`` ``(n + m, n + m)`` (float64),
    formed block by block where first needed (``O(d (n + m)²)`` in all) and shared by every
    decomposition and rank count through the rows: B's, B̃'s and their cross Gram matrices."""

    def __new__(cls, direction: torch.Tensor, magnitude: torch.Tensor) -> FactorRows:
        return super().__new__(cls, (direction, magnitude))

    @functools.cached_property
    def _blocks(self) -> dict[tuple[int, int], torch.Tensor]:
        return {}

    @functools.cached_property
    def double(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both row matrices in float64 (converted once)."""
        return self[0].double(), self[1].double()

    def block(self, i: int, j: int) -> torch.Tensor:
        """``X_i X_jᵀ`` (float64) for ``i, j`` in ``0`` (B) and ``1`` (B̃)."""
        if (i, j) not in self._blocks:
            if (j, i) in self._blocks:
                self._blocks[i, j] = self._blocks[j, i].T
            else:
                self._blocks[i, j] = self.double[i] @ self.double[j].T
        return self._blocks[i, j]

    @property
    def gram(self) -> torch.Tensor:
        """``[Xd; Xm][Xd; Xm]ᵀ`` in float64."""
        return torch.cat([torch.cat([self.block(0, 0), self.block(0, 1)], 1),
                          torch.cat([self.block(1, 0), self.block(1, 1)], 1)])


class RowFactor:
    """A PSD factor ``F = XᵀX`` ``(d, d)`` held as its rows ``X`` ``(n, d)`` (fewer than ``d``), so
    that nothing of size ``d × d`` is formed unless a consumer asks for it
    ([`dense`][laplace_debiased.curvature.linalg.RowFactor.dense]).

    It offers what the K-FAC code reads of a factor: ``shape``, ``dtype``, ``device``, scaling by a
    non-negative number (``F * s`` and ``F / s`` scale the rows by ``√s``), the Frobenius norm and the
    trace (from the Gram matrix ``XXᵀ``: ``‖XᵀX‖_F = ‖XXᵀ‖_F``, ``tr XᵀX = ‖X‖_F²``) and finiteness.
    """

    def __init__(self, rows: torch.Tensor) -> None:
        if rows.ndim != 2:
            raise ValueError(f"the rows of a factor must be (n, d), got shape {tuple(rows.shape)}.")
        self.rows = rows

    @property
    def shape(self) -> torch.Size:
        """``(d, d)``."""
        return torch.Size((self.rows.shape[1], self.rows.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows (that of the dense factor)."""
        return self.rows.dtype

    @property
    def device(self) -> torch.device:
        """The device of the rows."""
        return self.rows.device

    def __mul__(self, s: float) -> RowFactor:
        if s < 0:
            raise ValueError(f"a PSD factor held as rows can only be scaled by s >= 0, got {s}.")
        return RowFactor(self.rows * s**0.5)

    __rmul__ = __mul__

    def __truediv__(self, s: float) -> RowFactor:
        return self * (1.0 / s)

    def dense(self) -> torch.Tensor:
        """``XᵀX`` ``(d, d)`` in the rows' dtype, formed on each call."""
        return self.rows.T @ self.rows

    def frobenius(self) -> float:
        """``‖XᵀX‖_F = ‖XXᵀ‖_F`` in float64."""
        X = self.rows.double()
        return float(torch.linalg.matrix_norm(X @ X.T))

    def trace(self) -> float:
        """``tr XᵀX = ‖X‖_F²`` in float64."""
        return float(self.rows.double().square().sum())

    def isfinite(self) -> bool:
        """Whether every row entry (so every entry of ``XᵀX``) is finite."""
        return bool(torch.isfinite(self.rows).all())


def dense_factor(F: torch.Tensor | RowFactor) -> torch.Tensor:
    """``F`` as a ``(d, d)`` tensor: itself, or formed from its rows
    ([`RowFactor.dense`][laplace_debiased.curvature.linalg.RowFactor.dense])."""
    return F.dense() if isinstance(F, RowFactor) else F


def factor_rows(rows: Sequence[torch.Tensor]) -> FactorRows:
    """``rows`` as [`FactorRows`][laplace_debiased.curvature.linalg.FactorRows] (itself when it is one, keeping its Gram matrix)."""
    return rows if isinstance(rows, FactorRows) else FactorRows(*rows)

#: ``(direction, magnitude) -> (U, lam)``: the debiased decomposition of one dense factor
FactorRule = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

# Negative Rayleigh quotients of a PSD matrix are round-off if they are at most
# ROUNDOFF_FACTOR * n * eps(dtype of C) * ||C||_F in magnitude.
ROUNDOFF_FACTOR = 10.0


def check_square(M: torch.Tensor, name: str) -> None:
    """Check that ``M`` is a square matrix with finite entries.

    Args:
        M: the matrix, expected ``(n, n)``.
        name: its name in the error message.

    Raises:
        ValueError: if ``M`` is not two-dimensional and square, or holds a NaN or an Inf.
    """
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(M.shape)}.")
    if not torch.isfinite(M).all():
        raise ValueError(
            f"{name} contains NaN or Inf; the curvature of this batch is not finite. "
            "Check the inputs and the model output on that batch."
        )


def check_factor(F: torch.Tensor | RowFactor, name: str) -> None:
    """[`check_square`][laplace_debiased.curvature.linalg.check_square] of a factor, or for one held as rows
    ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]) that its rows are finite."""
    if not isinstance(F, RowFactor):
        check_square(F, name)
    elif not F.isfinite():
        raise ValueError(
            f"{name} contains NaN or Inf; the curvature of this batch is not finite. "
            "Check the inputs and the model output on that batch."
        )


def compress(F: torch.Tensor | RowFactor, V: torch.Tensor) -> torch.Tensor:
    """``Vᵀ F V`` ``(k, k)`` (float64, symmetric) of a PSD factor ``F`` ``(d, d)`` on the columns of ``V``
    ``(d, k)``: from the symmetric part of a dense ``F``, or ``(X V)ᵀ(X V)`` for one held as rows ``F = XᵀX``
    ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor], never formed)."""
    V64 = V.double()
    if isinstance(F, RowFactor):
        Y = F.rows.double() @ V64
        return Y.T @ Y
    F64 = F.double()
    return V64.T @ (0.5 * (F64 + F64.T)) @ V64


def roundoff_tolerance(C: torch.Tensor | RowFactor, terms: int = 0) -> float:
    """Largest negative Rayleigh quotient of a PSD ``C`` (n, n) attributable to round-off (``C``
    dense or held as rows, [`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]).

    ``ROUNDOFF_FACTOR · n · eps · ‖C‖_F + terms · eps · tr(C)``, with ``eps = 2u`` (``u`` the
    unit round-off) of the precision ``C`` was *computed* in (a float32 factor is only PSD up to
    float32 round-off).

    The first term is the eigensolver's backward error. The second bounds the error of
    *summing* ``C = Σ_k v_k v_kᵀ`` from ``m = terms`` rank-one terms in that precision, whatever
    the order: each entry ``C_ij = Σ_k v_ki v_kj`` is a sum of ``m`` products, so its error is at
    most ``γ_m Σ_k |v_ki v_kj| ≤ γ_m √(C_ii C_jj)`` (Cauchy–Schwarz; ``γ_m = m u / (1 - m u) ≤
    2 m u = m · eps`` while ``m u ≤ ½``; Higham, *Accuracy and Stability of Numerical
    Algorithms*, §3.1), so every Rayleigh quotient moves by at most ``‖E‖_2 ≤ ‖E‖_F ≤ γ_m tr(C)``:
    the factor's scale ``tr(C)`` times ``m`` times ``eps``. A K-FAC factor counts a term per
    sample, per position (a convolution's output pixels, a token) and, on the output side, per
    loss-Hessian column ([`terms`][laplace_debiased.curvature.kfac.GroupKfacSums.terms]): the output
    factor of a 1×1 convolution over 32×32 positions to 10 classes sums ``10,240`` per sample,
    and along its exact null direction (the softmax's) the float32 sum of 256 samples is negative
    beyond a tolerance counting only the samples. Counts of ranks and degenerate groups use
    ``terms = 0``.
    """
    if isinstance(C, RowFactor):
        return frobenius_tolerance(C.shape[0], C.dtype, C.frobenius()) + terms * torch.finfo(C.dtype).eps * C.trace()
    C64 = C.double()
    return frobenius_tolerance(C.shape[0], C.dtype, float(torch.linalg.matrix_norm(C64))) + (
        terms * torch.finfo(C.dtype).eps * float(C64.diagonal().abs().sum())
    )


def frobenius_tolerance(n: int, dtype: torch.dtype, frobenius: float) -> float:
    """``ROUNDOFF_FACTOR * n * eps(dtype) * (frobenius + tiny(dtype))``
    ([`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).

    The ``tiny`` term (the smallest normal number) covers the absolute error ``eps · tiny`` of each
    operation under gradual underflow (Higham, *Accuracy and Stability of Numerical Algorithms*,
    §2.1): a factor whose entries lie below ``tiny`` is not counted as of higher rank than its rows.
    """
    finfo = torch.finfo(dtype)
    return ROUNDOFF_FACTOR * n * finfo.eps * (frobenius + finfo.tiny)


def clamp_roundoff_negatives(
    values: torch.Tensor, tolerance: float, name: str = "curvature"
) -> torch.Tensor:
    """Set entries in ``[-tolerance, 0)`` to 0; raise on entries below ``-tolerance``.

    Args:
        values: eigenvalues / Rayleigh quotients ``(k,)`` of a matrix that must be PSD.
        tolerance: non-negative round-off tolerance, e.g. from
            [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance].
        name: what the values belong to (used in the error message).

    Raises:
        ValueError: if an entry is more negative than round-off allows: the matrix is not PSD (e.g. a
            Hessian instead of a GGN/Fisher) and a debiased Laplace precision built from it would not be
            a valid Gaussian.
    """
    if not torch.isfinite(values).all():
        raise ValueError(f"{name}: eigenvalues contain NaN or Inf.")
    worst = float(values.min()) if values.numel() else 0.0
    if worst < -tolerance:
        raise ValueError(
            f"{name}: Rayleigh quotient {worst:.3e} is negative beyond round-off "
            f"(tolerance {tolerance:.3e}); the magnitude curvature is not positive "
            "semi-definite. Use a GGN, Fisher or empirical-Fisher backend."
        )
    return values.clamp(min=0.0)


def remeasure_eigenvalues(
    U: torch.Tensor, C: torch.Tensor | RowFactor, terms: int = 0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Debiased eigenvalues ``diag(Uᵀ C U)``: curvature of ``C`` along the columns of ``U``.

    Args:
        U: ``(n, k)`` orthonormal directions (e.g. eigenvectors of batch B's curvature).
        C: ``(n, n)`` PSD curvature of the independent batch B̃, same scale convention as wanted for the
            output, or held as rows ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]: ``‖X u‖²``,
            never formed).
        terms: rank-one terms summed into ``C`` (samples × positions × loss-Hessian columns):
            widen the round-off tolerance of the negativity check ([`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).
        dtype: the dtype of the result (computed in float64 either way); default ``C.dtype``.

    Returns:
        ``(k,)`` non-negative values ``U[:, i]ᵀ C U[:, i]`` in ``dtype``; round-off negatives are clamped
            to 0, larger negatives raise ``ValueError``.
    """
    check_factor(C, "magnitude curvature")
    if U.ndim != 2 or U.shape[0] != C.shape[0]:
        raise ValueError(
            f"directions U {tuple(U.shape)} do not match curvature C {tuple(C.shape)}."
        )
    values = compress_diagonal(C, U)
    values = clamp_roundoff_negatives(values, roundoff_tolerance(C, terms), "remeasured curvature")
    return values.to(dtype or C.dtype)


def symmetric_eigh64(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L (..., n), V (..., n, n))`` of the symmetric part ½(M + Mᵀ) of ``M`` (..., n, n), in
    float64, ascending order, ``½(M + Mᵀ) = V diag(L) Vᵀ``: the one eigendecomposition of the
    package (curvature factors, variance formulas, square roots of covariances)."""
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"symmetric_eigh64 needs square matrices (..., n, n), got shape {tuple(M.shape)}.")
    M64 = M.double()
    return torch.linalg.eigh(0.5 * (M64 + M64.mT))


def degenerate_groups(eigenvalues: torch.Tensor, tolerance: float) -> list[slice]:
    """Runs of ascending ``eigenvalues`` ``(n,)`` whose neighbours differ by at most ``tolerance``.

    Returns slices covering ``0..n`` in order; a run of length > 1 is a (numerically)
    degenerate eigenspace. Neighbours are chained, so a run's spread may exceed ``tolerance``.
    """
    groups: list[slice] = []
    start = 0
    gaps = (eigenvalues[1:] - eigenvalues[:-1]).tolist()
    for i, gap in enumerate(gaps):
        if gap > tolerance:
            groups.append(slice(start, i + 1))
            start = i + 1
    if eigenvalues.numel():
        groups.append(slice(start, eigenvalues.numel()))
    return groups


def tied_groups(eigenvalues: torch.Tensor, tolerance: float) -> list[slice]:
    """Runs of ascending ``eigenvalues`` ``(n,)`` within ``tolerance`` of the run's smallest.

    Returns slices covering ``0..n`` in order. Unlike
    [`degenerate_groups`][laplace_debiased.curvature.linalg.degenerate_groups], runs do not
    chain: each run's spread is at most ``tolerance``, so a dense stretch of small but distinct
    eigenvalues is not merged with B's null space. The isotropic completion averages over these
    runs ([`laplace_debiased.curvature.completion`][laplace_debiased.curvature.completion]).
    """
    groups: list[slice] = []
    start = 0
    values = eigenvalues.tolist()
    for i in range(1, len(values)):
        if values[i] - values[start] > tolerance:
            groups.append(slice(start, i))
            start = i
    if values:
        groups.append(slice(start, len(values)))
    return groups


def aligned_eigenbasis(direction: torch.Tensor, magnitude: torch.Tensor | RowFactor) -> torch.Tensor:
    """Eigenvectors ``(n, n)`` (float64) of ``direction``, unique up to signs and ties in B̃.

    Eigenvectors of ``direction`` (B's factor, ascending eigenvalues); inside each degenerate
    eigenspace ([`degenerate_groups`][laplace_debiased.curvature.linalg.degenerate_groups] with
    [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] of ``direction``) they are
    rotated to the eigenvectors of ``magnitude`` (B̃'s factor) compressed onto that space, so
    ``U diag(diag(Uᵀ magnitude U)) Uᵀ`` equals ``P magnitude P`` on each such space ``P`` (basis-free, as
    ``debiased_full`` treats B's null space). With ``magnitude == direction`` the rotation is a no-op up to
    round-off. ``magnitude`` may be held as rows ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor],
    compressed through them).
    """
    check_square(direction, "direction curvature")
    check_factor(magnitude, "magnitude curvature")
    L, V = symmetric_eigh64(direction)
    for group in degenerate_groups(L, roundoff_tolerance(direction)):
        if group.stop - group.start > 1:
            Vg = V[:, group]
            _, W = symmetric_eigh64(compress(magnitude, Vg))
            V[:, group] = Vg @ W
    return V


def debiased_factor(
    direction: torch.Tensor, magnitude: torch.Tensor | RowFactor, terms: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debias one symmetric factor: eigenvectors of ``direction``, eigenvalues from
    ``magnitude``.

    Args:
        direction: ``(n, n)`` PSD factor of batch B (only its eigenvectors are used).
        magnitude: ``(n, n)`` PSD factor of batch B̃ (same position in the same layer), or held as rows
            ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]).
        terms: rank-one terms summed into ``magnitude`` (its round-off tolerance, [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).

    Returns:
        ``(U, lam)``: ``U (n, n)`` eigenvectors of ``direction``
            ([`aligned_eigenbasis`][laplace_debiased.curvature.linalg.aligned_eigenbasis], in
            ``direction.dtype``); ``lam (n,)`` = ``diag(Uᵀ magnitude U)``, so that ``U diag(lam) Uᵀ`` is the
            debiased factor. With ``magnitude == direction`` this is the ordinary eigendecomposition.
    """
    if direction.shape != magnitude.shape:
        raise ValueError(
            f"direction factor {tuple(direction.shape)} and magnitude factor "
            f"{tuple(magnitude.shape)} differ in shape."
        )
    U = aligned_eigenbasis(direction, magnitude)
    return U.to(direction.dtype), remeasure_eigenvalues(U, magnitude, terms)


def debiased_kron(
    direction_kfacs: Sequence[Sequence[torch.Tensor]],
    magnitude_kfacs: Sequence[Sequence[torch.Tensor]],
    rows: Sequence[Sequence[FactorRows | None]] | None = None,
    factor: FactorRule | None = None,
    *,
    null_space: str = "aligned",
    terms: Sequence[Sequence[int]] | None = None,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Debiased eigendecomposition of a layer-wise K-FAC approximation.

    For a weight block with factors ``[G, A]`` on B and ``[D, C]`` on B̃ the debiased
    block is ``(U_G diag(U_Gᵀ D U_G) U_Gᵀ) ⊗ (U_A diag(U_Aᵀ C U_A) U_Aᵀ)``; by the
    mixed-product rule its eigenvalues ``outer(diag(U_GᵀDU_G), diag(U_AᵀCU_A))`` are
    exactly ``uᵀ (D ⊗ C) u`` for the eigenvectors ``u = u_G ⊗ u_A`` of ``G ⊗ A``.
    Single-factor (bias) blocks ``[G]`` / ``[D]`` are debiased the same way.

    Args:
        direction_kfacs: B's factors, one entry per parameter block in laplace-torch ``Kron.kfacs``
            order; each block is a list of one or two square factors (tensors, or
            [`RowFactor`][laplace_debiased.curvature.linalg.RowFactor] where held as rows).
        magnitude_kfacs: B̃'s factors, in the same layout.
        rows: ``None``, or per block and factor a pair ``(direction_rows, magnitude_rows)``: the rows of
            B's and B̃'s factor (``F = XᵀX``, same scaling as the dense factors) where known: a factor
            with rows and ``n + m < d`` is decomposed through them ([`lowrank_debiased_factor`][laplace_debiased.curvature.linalg.lowrank_debiased_factor] with
            ``null_space``, ``O(d (n + m)²)``), its eigenvectors ``(d, r)`` with one more eigenvalue,
            that of their complement (the implicit null space); every other factor densely (``factor``).
        factor: ``(direction, magnitude, terms) -> (U, lam)`` for one dense factor; default
            [`debiased_factor`][laplace_debiased.curvature.linalg.debiased_factor] (the isotropic null-space treatment is
            [`laplace_debiased.curvature.completion.isotropic_factor`][laplace_debiased.curvature.completion.isotropic_factor]). It must treat B's null space
            as ``null_space`` does, so that both routes give the same factor.
        null_space: ``"aligned"`` or ``"isotropic"``, the null-space treatment of the rows route
            ([`lowrank_debiased_factor`][laplace_debiased.curvature.linalg.lowrank_debiased_factor]).
        terms: per block and factor, the rank-one terms summed into B̃'s factor (its round-off
            tolerance, [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]); ``None``: 0.

    Returns:
        ``(eigenvectors, eigenvalues)``, lists of lists: ready for
            ``laplace.utils.matrix.KronDecomposed(eigenvectors, eigenvalues)`` when every eigenvector
            matrix is square, else for
            [`laplace_debiased.kron.posterior.ImplicitKronDecomposed`][laplace_debiased.kron.posterior.ImplicitKronDecomposed].

    Raises:
        ValueError: if the two factor lists do not describe the same blocks (no layer is dropped).
    """
    if len(direction_kfacs) != len(magnitude_kfacs):
        raise ValueError(
            f"B has {len(direction_kfacs)} K-FAC blocks but B̃ has "
            f"{len(magnitude_kfacs)}; both must come from the same parameters."
        )
    eigenvectors: list[list[torch.Tensor]] = []
    eigenvalues: list[list[torch.Tensor]] = []
    for i, (F_dir, F_mag) in enumerate(zip(direction_kfacs, magnitude_kfacs)):
        block_rows = rows[i] if rows is not None else [None] * len(F_dir)
        block_terms = terms[i] if terms is not None else [0] * len(F_dir)
        pairs = _debiased_block(i, F_dir, F_mag, block_rows, factor or debiased_factor, null_space, block_terms)
        eigenvectors.append([p[0] for p in pairs])
        eigenvalues.append([p[1] for p in pairs])
    return eigenvectors, eigenvalues


def _debiased_block(
    i: int,
    F_dir: Sequence[torch.Tensor],
    F_mag: Sequence[torch.Tensor],
    rows: Sequence[FactorRows | None],
    factor: FactorRule,
    null_space: str,
    terms: Sequence[int],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(U, lam)`` per factor of block ``i`` (``_debiased_factor_route``); errors name
    the block and factor."""
    if len(F_dir) != len(F_mag) or len(F_dir) not in (1, 2):
        raise ValueError(
            f"K-FAC block {i}: B has {len(F_dir)} factors, B̃ has {len(F_mag)}; "
            "expected the same number, 1 or 2."
        )
    pairs = []
    for j, (Hd, Hm, r, t) in enumerate(zip(F_dir, F_mag, rows, terms)):
        try:
            pairs.append(_debiased_factor_route(Hd, Hm, r, factor, null_space, t))
        except ValueError as err:
            raise ValueError(f"K-FAC block {i}, factor {j}: {err}") from err
    return pairs


def _debiased_factor_route(
    direction: torch.Tensor | RowFactor,
    magnitude: torch.Tensor | RowFactor,
    rows: FactorRows | None,
    factor: FactorRule,
    null_space: str,
    terms: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[`lowrank_debiased_factor`][laplace_debiased.curvature.linalg.lowrank_debiased_factor] (with ``null_space``) where
    [`through_rows`][laplace_debiased.curvature.linalg.through_rows], or, for ``null_space="isotropic"`` (which reads B̃
    only through its Rayleigh quotients and its mass on B's null space), where B alone has fewer rows than the
    dimension; the same with B̃'s dense factor where only B is held as rows
    ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor], narrower than B̃); else ``factor`` on B's
    dense matrix and B̃'s (``terms``: those summed into ``magnitude``), read through its rows where only B̃
    is held as rows, formed from the rows here where both are."""
    d = direction.shape[0]
    if through_rows(rows, d) or (null_space == "isotropic" and rows is not None and len(rows[0]) < d):
        return lowrank_debiased_factor(*rows, dtype=direction.dtype, null_space=null_space, rows=factor_rows(rows))
    if isinstance(direction, RowFactor) and not isinstance(magnitude, RowFactor):
        return lowrank_debiased_factor(direction.rows, None, direction.dtype, null_space, magnitude=magnitude)
    D = dense_factor(direction)
    if magnitude is direction:
        return factor(D, D, terms)
    return factor(D, dense_factor(magnitude) if isinstance(direction, RowFactor) else magnitude, terms)


def through_rows(rows: FactorRows | None, dimension: int) -> bool:
    """Whether a factor pair of ``dimension`` is decomposed through its rows' Gram matrices
    (``O(d (n + m)²)``, no ``d × d`` decomposition): its rows are known and B ∪ B̃ has fewer of
    them, ``n + m < d``, than the dimension; B̃ = B (the same rows) counts them once, ``n < d``."""
    if rows is None:
        return False
    return len(rows[0]) + (0 if rows[1] is rows[0] else len(rows[1])) < dimension


# --------------------------------------------------------------------------------------------
# The same debiased factor from the rows of a batch narrower than the layer (no d × d eigh)
# --------------------------------------------------------------------------------------------
def gram_spectrum(K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L (k,), V (n, k))``: the eigenpairs of a Gram matrix ``K = XXᵀ`` (n, n) that
    [`gram_eigenpairs`][laplace_debiased.curvature.linalg.gram_eigenpairs] keeps (``L > n · eps · λ_max``), float64, ascending."""
    L, V = symmetric_eigh64(K)
    floor = K.shape[0] * torch.finfo(torch.float64).eps * float(L[-1]) if L.numel() else 0.0
    keep = L > floor
    return L[keep], V[:, keep]


def gram_eigenpairs(X: torch.Tensor, K: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of ``F = XᵀX`` (d, d) outside its null space, from its rows ``X`` (n, d).

    ViViT (Dangel et al. 2022, App. A.1–A.2): ``F`` and the Gram matrix ``K = XXᵀ`` (n, n) share
    their nonzero eigenvalues ``λ_k``, ``F`` has ``d - rank`` zeros more, and for
    ``K ẽ_k = λ_k ẽ_k`` the vectors ``e_k = Xᵀ ẽ_k / √λ_k`` are orthonormal eigenvectors of ``F``.
    Cost ``O(d n²)`` instead of ``O(d³)``. Kept: the ``λ_k`` above ``n · eps · λ_max`` (below it
    the Gram eigenvectors are round-off); the ``e_k`` are re-orthonormalised (one Cholesky QR pass,
    ``E R⁻¹`` with ``RᵀR = EᵀE``, ``2 d k²`` flops; a QR where ``EᵀE`` is not numerically positive
    definite) so that ``I - EEᵀ`` is a projector to ``eps`` whatever ``λ_max / λ_k`` (Cholesky QR
    loses orthogonality like ``eps · κ(E)²``; the computed ``e_k`` are orthonormal to about
    ``√(eps / n)``, so ``κ(E) ≈ 1`` and one pass suffices).

    ``K``: the Gram matrix ``XXᵀ`` in float64 where already formed ([`FactorRows`][laplace_debiased.curvature.linalg.FactorRows]).
    Returns ``(L (k,) ascending, E (d, k))`` in float64.
    """
    X64 = X.double()
    L, V = gram_spectrum(X64 @ X64.T if K is None else K)
    E = (X64.T @ V).div_(L.sqrt())
    R, info = torch.linalg.cholesky_ex(E.T @ E, upper=True)
    if int(info) != 0:
        return L, torch.linalg.qr(E).Q
    return L, torch.linalg.solve_triangular(R, E, upper=True, left=False)


def row_rank(X: torch.Tensor, dtype: torch.dtype, tolerance: float | None = None, K: torch.Tensor | None = None) -> int:
    """Number of eigenvalues of ``F = XᵀX`` above ``tolerance`` (default
    [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] ``(F)``, ``F`` held in ``dtype``), from the Gram matrix ``XXᵀ``
    (same nonzero spectrum, ``O(d n²)``; ``K``: that Gram matrix where already formed)."""
    K = X.double() @ X.double().T if K is None else K
    tol = frobenius_tolerance(X.shape[1], dtype, float(torch.linalg.matrix_norm(K))) if tolerance is None else tolerance
    return eigenvalues_above(K, tol)


def eigenvalues_above(S: torch.Tensor, threshold: float) -> int:
    """Number of eigenvalues of the symmetric ``S`` ``(d, d)`` above ``threshold``, without its
    eigenvalues: spectrum slicing by Sylvester's law of inertia.

    The Bunch–Kaufman factorisation ``S - threshold · I = L D Lᵀ`` (``D`` block diagonal with
    ``1 × 1`` and ``2 × 2`` blocks; LAPACK ``sytrf``, ``d³/3`` flops against the ``4d³/3`` of a
    tridiagonal reduction) is a congruence, so ``D`` has as many positive eigenvalues as
    ``S - threshold · I``. The count is exact for a matrix within the factorisation's backward
    error of ``S`` (``‖E‖ ≤ p(d) ρ eps₆₄ ‖S‖``, ``ρ`` the growth factor; Higham, *Accuracy and
    Stability of Numerical Algorithms*, Thm. 11.3), i.e. up to eigenvalues that far from the
    threshold, which the round-off tolerances here (float32-relative) exceed by orders of magnitude.
    Computed in float64 by LAPACK on the host (torch marks its cuSOLVER path experimental; a
    count needs no more than the signs of ``D``).
    """
    if S.shape[0] == 0:
        return 0
    S64 = S.detach().double().cpu()
    S64 = (S64 + S64.T).mul_(0.5)  # a new tensor: the in-place steps leave S alone
    S64.diagonal().sub_(threshold)
    LD, pivots, _ = torch.linalg.ldl_factor_ex(S64)
    diag, two = LD.diagonal(), pivots < 0  # a 2 × 2 block takes two rows with negative pivots
    rows = torch.arange(len(two))
    run_start = torch.where(two & ~torch.cat([two.new_zeros(1), two[:-1]]), rows, -1).cummax(0).values
    first = torch.nonzero(two & ((rows - run_start) % 2 == 0)).squeeze(1)  # the first row of each block
    a, b, c = diag[first], LD.diagonal(-1)[first], diag[first + 1]
    det, trace = a * c - b * b, a + c
    pairs = torch.where(det < 0, 1, torch.where(trace > 0, 2 - (det == 0).long(), 0))
    return int((diag[~two] > 0).sum()) + int(pairs.sum())


def _ritz(V: torch.Tensor, M: torch.Tensor | RowFactor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rayleigh–Ritz of ``M`` (B̃'s factor, dense float64 or held as rows) on the span of the orthonormal
    ``V`` (d, k): ``(V W, μ)`` with ``Vᵀ M V = W diag(μ) Wᵀ`` ([`compress`][laplace_debiased.curvature.linalg.compress]),
    so ``diag((VW)ᵀ M (VW)) = μ`` (float64)."""
    mu, W = symmetric_eigh64(compress(M, V))
    return V @ W, mu.clamp_min(0.0)


def _null_group_eigenpairs(V: torch.Tensor, M: torch.Tensor | RowFactor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of ``P M P`` (``P = I - VVᵀ``, ``M`` B̃'s factor) in float64 outside its null space: the
    compression of B̃'s factor onto the complement of ``V`` (d, k), from the Gram matrix of ``Xm P`` for
    ``M = XmᵀXm`` held as rows ([`gram_eigenpairs`][laplace_debiased.curvature.linalg.gram_eigenpairs]), else from
    ``P M P`` itself, re-orthogonalised against ``V`` and Ritz-refined. Kept: at most ``d - k`` (the complement's
    dimension) of the largest eigenvalues, those above ``d · eps · ‖M‖_F`` (below it, B̃'s curvature on the
    complement is round-off of ``M``: with B̃ = B, ``Xm P`` is round-off and its Gram eigenvectors are not in the
    complement)."""
    d, k = V.shape
    if isinstance(M, RowFactor):
        Xm = M.rows
        L, W = gram_eigenpairs(Xm - (Xm @ V) @ V.T)
        norm = M.frobenius()
    else:
        MV = M @ V
        L, W = symmetric_eigh64(M - MV @ V.T - V @ MV.T + V @ (V.T @ MV) @ V.T)
        norm = float(torch.linalg.matrix_norm(M))
    keep = (L > d * torch.finfo(torch.float64).eps * norm).nonzero().squeeze(1)[-(d - k):] if d > k else []
    W = W[:, keep]
    W = torch.linalg.qr(W - V @ (V.T @ W)).Q
    return _ritz(W, M)


def lowrank_debiased_factor(
    direction_rows: torch.Tensor,
    magnitude_rows: torch.Tensor | None,
    dtype: torch.dtype,
    null_space: str = "aligned",
    rows: FactorRows | None = None,
    *,
    magnitude: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The debiased factor of ``G = XdᵀXd`` and ``C = XmᵀXm`` from their rows, without a
    ``d × d`` matrix of B: ``(Q (d, r), λ)``, ``Q`` orthonormal, the factor being
    ``Q diag(λ[:r]) Qᵀ + λ[r] (I - QQᵀ)`` (``λ`` has ``r + 1`` entries, the last the eigenvalue
    of the implicit null space, when ``r < d``; ``r`` entries when ``r = d``).

    ``direction_rows`` (n, d) and ``magnitude_rows`` (m, d) are the factors' rows (with the
    caller's scaling); ``dtype`` is the dtype the dense factors would have (it sets the
    degeneracy tolerance of [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance], with
    ``‖G‖_F = ‖XdXdᵀ‖_F``). B's spectrum is the Gram eigenvalues
    ([`gram_eigenpairs`][laplace_debiased.curvature.linalg.gram_eigenpairs]) plus ``d - k`` zeros, grouped by
    [`degenerate_groups`][laplace_debiased.curvature.linalg.degenerate_groups] as in the dense route; the
    group holding the zeros (with every eigenvalue chained to it) is B's null group, of dimension ``d - r_B``.
    A B̃ with as many rows as ``d`` comes as its dense factor ``magnitude`` ``(d, d)`` instead of
    ``magnitude_rows`` (``None``): B is still read through its rows alone.

    * ``null_space="aligned"`` ([`debiased_factor`][laplace_debiased.curvature.linalg.debiased_factor], to
      round-off): tied nonzero groups are rotated to B̃'s compression (``_ritz``); the null group carries the
      nonzero eigenpairs of B̃'s factor compressed onto it (``_null_group_eigenpairs``), 0 on the rest.
    * ``null_space="isotropic"``: every group of
      [`tied_groups`][laplace_debiased.curvature.linalg.tied_groups] (spread at most the tolerance, not
      chained) gets the mean Rayleigh quotient of B̃ over it, ``tr(PCP)/dim P``; on the null group
      ``tr(C (I - QQᵀ)) / (d - r_B)`` (``‖Xm (I - QQᵀ)‖_F²`` from the rows).

    ``rows``: the same rows as [`FactorRows`][laplace_debiased.curvature.linalg.FactorRows] whose Gram matrix is shared (formed here otherwise).
    Cost ``O(d (n + m)²)`` (with a dense B̃: ``O(d² n)``, and for ``"aligned"`` one ``d × d`` eigendecomposition of
    B̃ compressed onto B's null space); results in ``dtype``. With B̃ = B (the same rows) the result is B's
    eigendecomposition: the null group carries no eigenpairs (``_null_group_eigenpairs``).
    """
    if (magnitude_rows is None) == (magnitude is None):
        raise ValueError("give B̃ either as its rows (magnitude_rows) or as its dense factor (magnitude), not both.")
    width = magnitude_rows.shape[1:] if magnitude is None else magnitude.shape[:1]
    if direction_rows.ndim != 2 or direction_rows.shape[1:] != width:
        raise ValueError(
            f"direction rows {tuple(direction_rows.shape)} and magnitude "
            f"{tuple((magnitude_rows if magnitude is None else magnitude).shape)} must be (n, d) and (m, d) "
            "(or (d, d)) with the same d."
        )
    if null_space not in ("aligned", "isotropic"):
        raise ValueError(f"null_space must be 'aligned' or 'isotropic', got {null_space!r}.")
    d = direction_rows.shape[1]
    if magnitude is None:
        Xd, Xm = rows.double if rows is not None else (direction_rows.double(), magnitude_rows.double())
        M: torch.Tensor | RowFactor = RowFactor(Xm)
    else:
        Xd, M = direction_rows.double(), magnitude.double()
        M = 0.5 * (M + M.T)
    Kd = rows.block(0, 0) if rows is not None else Xd @ Xd.T
    L, E = gram_eigenpairs(Xd, Kd)
    tol = frobenius_tolerance(d, dtype, float(torch.linalg.matrix_norm(Kd)))
    zeros = d - L.numel()
    shift = min(zeros, 1)  # a single 0 stands for the d - k zeros; L[i] sits at i + shift
    grouping = tied_groups if null_space == "isotropic" else degenerate_groups
    groups = grouping(torch.cat([L.new_zeros(shift), L]), tol)
    first = groups[0].stop - shift if shift else 0  # B's directions outside its null group
    Q = E[:, first:].clone()
    mu = compress_diagonal(M, Q)
    for g in groups[shift:]:
        tied = slice(g.start - shift - first, g.stop - shift - first)
        if tied.stop - tied.start > 1 and null_space == "isotropic":
            mu[tied] = mu[tied].mean()
        elif tied.stop - tied.start > 1:
            Q[:, tied], mu[tied] = _ritz(Q[:, tied], M)
    mus = [mu]
    null_value = L.new_zeros(1)
    if shift and null_space == "aligned":
        W, mu_w = _null_group_eigenpairs(Q, M)
        Q, mus = torch.cat([Q, W], dim=1), [*mus, mu_w]
    elif shift and isinstance(M, RowFactor):
        null_value += (M.rows - (M.rows @ Q) @ Q.T).square().sum() / (d - Q.shape[1])
    elif shift:
        null_value += (M.diagonal().sum() - compress_diagonal(M, Q).sum()) / (d - Q.shape[1])
    lam = torch.cat([*mus, *([null_value] if Q.shape[1] < d else [])])
    return Q.to(dtype), lam.to(dtype)


def compress_diagonal(F: torch.Tensor | RowFactor, V: torch.Tensor) -> torch.Tensor:
    """``diag(Vᵀ F V)`` ``(k,)`` (float64) of a PSD factor ``F`` ``(d, d)``, dense (its symmetric part) or
    held as rows (``‖X v‖²``), for the columns ``v`` of ``V`` ``(d, k)``: B̃'s Rayleigh quotients, without the
    ``(k, k)`` compression."""
    V64 = V.double()
    if isinstance(F, RowFactor):
        return (F.rows.double() @ V64).square().sum(0)
    F64 = F.double()
    return ((0.5 * (F64 + F64.T) @ V64) * V64).sum(0)


def order_weight(m: int, n: int, n_data: int | None) -> float:
    """``(m / n)(1 - n / N)``: the bias of the pooled batch of ``n`` over the gap measured by the
    order whose batch of ``m`` chooses, all drawn without replacement from ``N = n_data`` (``m / n``
    for ``n_data=None``, an infinite population; the derivation:
    [`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected]).

    Raises:
        ValueError: ``n > n_data``.
    """
    if n_data is None:
        return m / n
    if n > n_data:
        raise ValueError(f"B ∪ B̃ has {n} samples but the data only {n_data}; pass the training-set size as n_data.")
    return m / n * (1 - n / n_data)


def order_weights(m_direction: int, m_magnitude: int, n_data: int | None) -> tuple[float, float]:
    """The factors ``(k_B, k_B̃)`` of the two orders' gaps in the correction ``x = k_B g_B + k_B̃ g_B̃``:
    ``(m / n)(1 - n / N) / 2`` for the order whose batch of ``m`` chooses
    ([`order_weight`][laplace_debiased.curvature.linalg.order_weight])."""
    n = m_direction + m_magnitude
    return order_weight(m_direction, n, n_data) / 2, order_weight(m_magnitude, n, n_data) / 2

"""Pure linear algebra of two-batch debiasing (tensors in, tensors out, float64 inside).

Conventions
-----------
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
  :func:`roundoff_tolerance` ``(F)`` (``10 · n · eps(F.dtype) · ‖F‖_F``) are indistinguishable
  at the precision ``F`` was computed in, so ``eigh`` may return any basis of their span (the
  null space of a rank-deficient factor, exactly repeated eigenvalues). Inside each such space
  the basis is fixed by the magnitude factor (:func:`aligned_eigenbasis`), which makes every
  debiased factor a function of the two matrices, not of ``eigh``'s choice.

All computations run in float64; results are cast back to the dtype of the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = [
    "remeasure_eigenvalues",
    "clamp_roundoff_negatives",
    "roundoff_tolerance",
    "symmetric_eigh64",
    "eigh_float64",
    "degenerate_groups",
    "aligned_eigenbasis",
    "debiased_factor",
    "debiased_kron",
]

# Negative Rayleigh quotients of a PSD matrix are round-off if they are at most
# ROUNDOFF_FACTOR * n * eps(dtype of C) * ||C||_F in magnitude.
ROUNDOFF_FACTOR = 10.0


def _check_square(M: torch.Tensor, name: str) -> None:
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(M.shape)}.")
    if not torch.isfinite(M).all():
        raise ValueError(
            f"{name} contains NaN or Inf; the curvature of this batch is not finite. "
            "Check the inputs and the model output on that batch."
        )


def roundoff_tolerance(C: torch.Tensor) -> float:
    """Largest negative Rayleigh quotient of a PSD ``C`` (n, n) attributable to round-off.

    ``ROUNDOFF_FACTOR * n * eps(C.dtype) * ||C||_F``, using the precision ``C`` was
    *computed* in (a float32 factor is only PSD up to float32 round-off).
    """
    n = C.shape[0]
    eps = torch.finfo(C.dtype).eps
    return ROUNDOFF_FACTOR * n * eps * float(torch.linalg.matrix_norm(C.double()))


def clamp_roundoff_negatives(
    values: torch.Tensor, tolerance: float, name: str = "curvature"
) -> torch.Tensor:
    """Set entries in ``[-tolerance, 0)`` to 0; raise on entries below ``-tolerance``.

    Parameters
    ----------
    values : torch.Tensor
        eigenvalues / Rayleigh quotients ``(k,)`` of a matrix that must be PSD.
    tolerance : float
        non-negative round-off tolerance, e.g. from :func:`roundoff_tolerance`.
    name : str
        what the values belong to (used in the error message).

    Raises
    ------
    ValueError
        if an entry is more negative than round-off allows: the matrix is not PSD
        (e.g. a Hessian instead of a GGN/Fisher) and a debiased Laplace precision built
        from it would not be a valid Gaussian.
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


def remeasure_eigenvalues(U: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Debiased eigenvalues ``diag(Uᵀ C U)``: curvature of ``C`` along the columns of ``U``.

    Parameters
    ----------
    U : torch.Tensor
        ``(n, k)`` orthonormal directions (e.g. eigenvectors of batch B's curvature).
    C : torch.Tensor
        ``(n, n)`` PSD curvature of the independent batch B̃, same scale convention as
        wanted for the output.

    Returns
    -------
    torch.Tensor
        ``(k,)`` non-negative values ``U[:, i]ᵀ C U[:, i]`` in ``C.dtype``; round-off
        negatives are clamped to 0, larger negatives raise ``ValueError``.
    """
    _check_square(C, "magnitude curvature")
    if U.ndim != 2 or U.shape[0] != C.shape[0]:
        raise ValueError(
            f"directions U {tuple(U.shape)} do not match curvature C {tuple(C.shape)}."
        )
    U64, C64 = U.double(), C.double()
    C64 = 0.5 * (C64 + C64.T)
    values = ((C64 @ U64) * U64).sum(dim=0)
    values = clamp_roundoff_negatives(values, roundoff_tolerance(C), "remeasured curvature")
    return values.to(C.dtype)


def symmetric_eigh64(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L (..., n), V (..., n, n))`` of the symmetric part ½(M + Mᵀ) of ``M`` (..., n, n), in
    float64, ascending order, ``½(M + Mᵀ) = V diag(L) Vᵀ``: the one eigendecomposition of the
    package (curvature factors, variance formulas, square roots of covariances)."""
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"symmetric_eigh64 needs square matrices (..., n, n), got shape {tuple(M.shape)}.")
    M64 = M.double()
    return torch.linalg.eigh(0.5 * (M64 + M64.mT))


#: Old name of :func:`symmetric_eigh64` (which returns float64).
eigh_float64 = symmetric_eigh64


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


def aligned_eigenbasis(direction: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Eigenvectors ``(n, n)`` (float64) of ``direction``, unique up to signs and ties in B̃.

    Eigenvectors of ``direction`` (B's factor, ascending eigenvalues); inside each degenerate
    eigenspace (:func:`degenerate_groups` with :func:`roundoff_tolerance` of ``direction``) they
    are rotated to the eigenvectors of ``magnitude`` (B̃'s factor) compressed onto that space,
    so ``U diag(diag(Uᵀ magnitude U)) Uᵀ`` equals ``P magnitude P`` on each such space ``P``
    (basis-free, as ``debiased_full`` treats B's null space). With ``magnitude == direction``
    the rotation is a no-op up to round-off.
    """
    _check_square(direction, "direction curvature")
    _check_square(magnitude, "magnitude curvature")
    L, V = symmetric_eigh64(direction)
    M64 = magnitude.double()
    M64 = 0.5 * (M64 + M64.T)
    for group in degenerate_groups(L, roundoff_tolerance(direction)):
        if group.stop - group.start > 1:
            Vg = V[:, group]
            _, W = symmetric_eigh64(Vg.T @ M64 @ Vg)
            V[:, group] = Vg @ W
    return V


def debiased_factor(
    direction: torch.Tensor, magnitude: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debias one symmetric factor: eigenvectors of ``direction``, eigenvalues from
    ``magnitude``.

    Parameters
    ----------
    direction : torch.Tensor
        ``(n, n)`` PSD factor of batch B (only its eigenvectors are used).
    magnitude : torch.Tensor
        ``(n, n)`` PSD factor of batch B̃ (same position in the same layer).

    Returns
    -------
    (U, lam) : tuple[torch.Tensor, torch.Tensor]
        ``U (n, n)`` eigenvectors of ``direction`` (:func:`aligned_eigenbasis`, in
        ``direction.dtype``); ``lam (n,)`` = ``diag(Uᵀ magnitude U)``,
        so that ``U diag(lam) Uᵀ`` is the debiased factor. With
        ``magnitude == direction`` this is the ordinary eigendecomposition.
    """
    if direction.shape != magnitude.shape:
        raise ValueError(
            f"direction factor {tuple(direction.shape)} and magnitude factor "
            f"{tuple(magnitude.shape)} differ in shape."
        )
    U = aligned_eigenbasis(direction, magnitude)
    return U.to(direction.dtype), remeasure_eigenvalues(U, magnitude)


def debiased_kron(
    direction_kfacs: Sequence[Sequence[torch.Tensor]],
    magnitude_kfacs: Sequence[Sequence[torch.Tensor]],
    factor: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Debiased eigendecomposition of a layer-wise K-FAC approximation.

    For a weight block with factors ``[G, A]`` on B and ``[D, C]`` on B̃ the debiased
    block is ``(U_G diag(U_Gᵀ D U_G) U_Gᵀ) ⊗ (U_A diag(U_Aᵀ C U_A) U_Aᵀ)``; by the
    mixed-product rule its eigenvalues ``outer(diag(U_GᵀDU_G), diag(U_AᵀCU_A))`` are
    exactly ``uᵀ (D ⊗ C) u`` for the eigenvectors ``u = u_G ⊗ u_A`` of ``G ⊗ A``.
    Single-factor (bias) blocks ``[G]`` / ``[D]`` are debiased the same way.

    Parameters
    ----------
    direction_kfacs, magnitude_kfacs : sequence of blocks
        one entry per parameter block in laplace-torch ``Kron.kfacs`` order; each block is
        a list of one or two dense square factors.
    factor : callable, optional
        ``(direction, magnitude) -> (U, lam)`` for one factor; default :func:`debiased_factor`
        (the isotropic null-space treatment is
        :func:`laplace_debiased.curvature.completion.isotropic_factor`).

    Returns
    -------
    (eigenvectors, eigenvalues) : lists of lists
        ready for ``laplace.utils.matrix.KronDecomposed(eigenvectors, eigenvalues)``.

    Raises
    ------
    ValueError
        if the two factor lists do not describe the same blocks (no layer is dropped).
    """
    if len(direction_kfacs) != len(magnitude_kfacs):
        raise ValueError(
            f"B has {len(direction_kfacs)} K-FAC blocks but B̃ has "
            f"{len(magnitude_kfacs)}; both must come from the same parameters."
        )
    eigenvectors: list[list[torch.Tensor]] = []
    eigenvalues: list[list[torch.Tensor]] = []
    for i, (F_dir, F_mag) in enumerate(zip(direction_kfacs, magnitude_kfacs)):
        if len(F_dir) != len(F_mag) or len(F_dir) not in (1, 2):
            raise ValueError(
                f"K-FAC block {i}: B has {len(F_dir)} factors, B̃ has {len(F_mag)}; "
                "expected the same number, 1 or 2."
            )
        Us, lams = [], []
        for j, (Hd, Hm) in enumerate(zip(F_dir, F_mag)):
            try:
                U, lam = (factor or debiased_factor)(Hd, Hm)
            except ValueError as err:
                raise ValueError(f"K-FAC block {i}, factor {j}: {err}") from err
            Us.append(U)
            lams.append(lam)
        eigenvectors.append(Us)
        eigenvalues.append(lams)
    return eigenvectors, eigenvalues

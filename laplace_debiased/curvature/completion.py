"""Debiased factors whose direction batch B does not see every direction (wide layers).

A K-FAC factor of batch B (``(d, d)``, e.g. the input factor ``A`` of ``Linear(1024, 32)``) has
rank at most ``|B|`` (times the spatial positions of a convolution). Its eigenvalues are exactly
degenerate on its null space ``P`` (dimension ``d - rank``): ``eigh`` returns an arbitrary basis
of it. Which directions inside ``P`` get which magnitude then has to be decided without B.

``null_space="aligned"`` (:func:`laplace_debiased.curvature.linalg.debiased_factor`) rotates the
basis of ``P`` to the eigenvectors of B̃'s factor compressed onto ``P`` and measures them on B̃:
there the directions are chosen *and* measured by the same batch, which brings back the
same-batch bias the two-batch estimator removes (largest curvatures overestimated, smallest
underestimated; exactly zero wherever B̃ does not reach either, so those weights keep the prior
variance ``1/δ``).

``null_space="isotropic"`` (:func:`isotropic_factor`, this module) gives every direction of a
degenerate eigenspace ``P`` of B (dimension ``k``) the same eigenvalue, the mean Rayleigh quotient
of B̃ over any orthonormal basis ``V_P`` of ``P``::

    c_P = tr(V_Pᵀ C V_P) / k,

which does not depend on the basis and is unbiased for ``tr(V_Pᵀ E[C] V_P) / k`` because ``P`` is
chosen by B alone. The factor is ``Σ_i λ_i u_i u_iᵀ + Σ_P c_P P`` with ``λ_i = u_iᵀ C u_i``
on B's non-degenerate eigenvectors: the curvature B̃ measures on the space B does not see is
kept (no exact zeros unless B̃ has no curvature there either), but spread evenly over it.
With ``C`` equal to B's factor the null space gets ``c_P = 0`` and the result is the ordinary
eigendecomposition (the B̃ = B reduction).

All computations in float64; results cast back to the inputs' dtype.
"""

from __future__ import annotations

import torch

from laplace_debiased.curvature.linalg import (
    _check_square,
    degenerate_groups,
    remeasure_eigenvalues,
    roundoff_tolerance,
    symmetric_eigh64,
)

__all__ = ["NULL_SPACE_MODES", "group_means", "isotropic_factor", "debiased_factor_mode"]

#: treatments of B's degenerate eigenspaces (its null space above all)
NULL_SPACE_MODES = ("isotropic", "aligned")


def group_means(values: torch.Tensor, groups: list[slice]) -> torch.Tensor:
    """``values`` ``(n,)`` with every entry of each slice in ``groups`` replaced by the slice's
    mean (float64 inside, ``values.dtype`` out)."""
    out = values.double().clone()
    for g in groups:
        if g.stop - g.start > 1:
            out[g] = out[g].mean()
    return out.to(values.dtype)


def isotropic_factor(
    direction: torch.Tensor, magnitude: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debias one factor with isotropic degenerate eigenspaces (module docstring).

    Parameters
    ----------
    direction : torch.Tensor
        ``(n, n)`` PSD factor of B (only its eigenvectors and their degeneracy are used).
    magnitude : torch.Tensor
        ``(n, n)`` PSD factor of B̃, same layer and position.

    Returns
    -------
    (U, lam)
        ``U (n, n)`` orthonormal eigenvectors of ``direction`` (ascending eigenvalues; inside a
        degenerate eigenspace whatever basis ``eigh`` returns: the factor ``U diag(lam) Uᵀ`` does
        not depend on it, since ``lam`` is constant there) and ``lam (n,)`` the Rayleigh
        quotients ``diag(Uᵀ magnitude U)`` averaged over each degenerate eigenspace of
        ``direction``. One float64 ``eigh`` of ``direction``; nothing of ``magnitude`` is
        decomposed.
    """
    if direction.shape != magnitude.shape:
        raise ValueError(
            f"direction factor {tuple(direction.shape)} and magnitude factor "
            f"{tuple(magnitude.shape)} differ in shape."
        )
    _check_square(direction, "direction curvature")
    L, U = symmetric_eigh64(direction)
    lam = remeasure_eigenvalues(U, magnitude)
    return U.to(direction.dtype), group_means(lam, degenerate_groups(L, roundoff_tolerance(direction)))


def debiased_factor_mode(
    direction: torch.Tensor, magnitude: torch.Tensor, null_space: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`isotropic_factor` (``null_space="isotropic"``) or
    :func:`~laplace_debiased.curvature.linalg.debiased_factor` (``"aligned"``)."""
    from laplace_debiased.curvature.linalg import debiased_factor

    if null_space == "isotropic":
        return isotropic_factor(direction, magnitude)
    if null_space == "aligned":
        return debiased_factor(direction, magnitude)
    raise ValueError(f"null_space must be one of {NULL_SPACE_MODES}, got {null_space!r}.")

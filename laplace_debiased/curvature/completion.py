"""Debiased factors whose direction batch B does not see every direction (wide layers).

A K-FAC factor of batch B (``(d, d)``, e.g. the input factor ``A`` of ``Linear(1024, 32)``) has
rank at most ``|B|`` (times the spatial positions of a convolution). Its eigenvalues are exactly
degenerate on its null space ``P`` (dimension ``d - rank``): ``eigh`` returns an arbitrary basis
of it. Which directions inside ``P`` get which magnitude then has to be decided without B.

``null_space="aligned"``
([`laplace_debiased.curvature.linalg.debiased_factor`][laplace_debiased.curvature.linalg.debiased_factor])
rotates the basis of ``P`` to the eigenvectors of B̃'s factor compressed onto ``P`` and measures them on B̃:
there the directions are chosen *and* measured by the same batch, which brings back the
same-batch bias the two-batch estimator removes (largest curvatures overestimated, smallest
underestimated; exactly zero wherever B̃ does not reach either, so those weights keep the prior
variance ``1/δ``).

``null_space="isotropic"`` ([`isotropic_factor`][laplace_debiased.curvature.completion.isotropic_factor], this
module) gives every direction of a degenerate eigenspace ``P`` of B (dimension ``k``; a run of eigenvalues
within the round-off tolerance of its smallest,
[`tied_groups`][laplace_debiased.curvature.linalg.tied_groups], so a dense stretch of small but distinct
eigenvalues is not chained into the null space) the same eigenvalue, the mean Rayleigh quotient of B̃ over any
orthonormal basis ``V_P`` of ``P``::

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
    RowFactor,
    check_square,
    clamp_roundoff_negatives,
    remeasure_eigenvalues,
    roundoff_tolerance,
    symmetric_eigh64,
    tied_groups,
)

__all__ = ["NULL_SPACE_MODES", "debiased_factor_mode", "extended_spectrum", "group_means", "isotropic_factor", "nested_factor"]

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
    direction: torch.Tensor, magnitude: torch.Tensor | RowFactor, terms: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debias one factor with isotropic degenerate eigenspaces (module docstring).

    Args:
        direction: ``(n, n)`` PSD factor of B (only its eigenvectors and their degeneracy are used).
        magnitude: ``(n, n)`` PSD factor of B̃, same layer and position, or held as rows
            ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor], read through them).
        terms: rank-one terms summed into ``magnitude`` (its round-off tolerance,
            [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).

    Returns:
        ``(U, lam)``: ``U (n, n)`` orthonormal eigenvectors of ``direction`` (ascending eigenvalues;
            inside a degenerate eigenspace whatever basis ``eigh`` returns: the factor ``U diag(lam) Uᵀ``
            does not depend on it, since ``lam`` is constant there) and ``lam (n,)`` the Rayleigh
            quotients ``diag(Uᵀ magnitude U)`` averaged over each degenerate eigenspace of ``direction``.
            One float64 ``eigh`` of ``direction``; nothing of ``magnitude`` is decomposed.
    """
    if direction.shape != magnitude.shape:
        raise ValueError(
            f"direction factor {tuple(direction.shape)} and magnitude factor "
            f"{tuple(magnitude.shape)} differ in shape."
        )
    check_square(direction, "direction curvature")
    L, U = symmetric_eigh64(direction)
    lam = remeasure_eigenvalues(U, magnitude, terms)
    return U.to(direction.dtype), group_means(lam, tied_groups(L, roundoff_tolerance(direction)))


def _null_group(L: torch.Tensor, groups: list[slice], tolerance: float) -> slice | None:
    """The group of ascending eigenvalues ``L`` holding B's null space (eigenvalues within
    ``tolerance`` of 0), if it has more than one direction."""
    g = groups[0] if groups else None
    return g if g is not None and g.stop - g.start > 1 and float(L[0]) <= tolerance else None


def nested_factor(
    direction: torch.Tensor, choose: torch.Tensor, measure: torch.Tensor, choose_share: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debias one factor whose B̃ is split in two, with nested directions in B's null space.

    B's eigenvectors ``u_i`` outside its null space keep the Rayleigh quotients of all of B̃,
    ``M = choose_share · choose + (1 − choose_share) · measure``; its other degenerate eigenspaces
    get their mean ([`isotropic_factor`][laplace_debiased.curvature.completion.isotropic_factor]). Inside B's
    null space ``P`` (basis ``V_P``, ``k`` directions) the first part B̃₁ chooses and the second B̃₂ measures:
    the eigenvectors of
    ``V_Pᵀ choose V_P`` with the Rayleigh quotients of ``V_Pᵀ measure V_P``, averaged over its
    degenerate groups, so B̃₂'s mean curvature on what B̃₁ does not see either.
    Every direction is chosen by data independent of the data measuring it, so each eigenvalue is
    unbiased for the expected curvature along its direction; the anisotropy of ``P`` that B̃₁
    sees is kept, where the isotropic completion spreads B̃'s curvature evenly over ``P``.

    Identities (tested): the trace over ``P`` is ``tr(V_Pᵀ measure V_P)``; with ``choose ==
    measure`` the null space is B̃'s own eigenbasis, measured by it (``null_space="aligned"``);
    with ``choose == measure == direction`` the result is the ordinary eigendecomposition.

    Args:
        direction: ``(n, n)`` PSD factor of B.
        choose: ``(n, n)`` PSD factor of B̃₁ (same layer and scaling as ``direction``).
        measure: ``(n, n)`` PSD factor of B̃₂ (same layer and scaling as ``direction``).
        choose_share: B̃₁'s share of B̃'s samples (weights ``M``).

    Returns:
        ``(U, lam)``: ``U (n, n)`` orthonormal, ``lam (n,)``, in ``direction.dtype``; float64 inside.
    """
    if not direction.shape == choose.shape == measure.shape:
        raise ValueError(f"factors differ in shape: B {tuple(direction.shape)}, B̃₁ {tuple(choose.shape)}, "
                         f"B̃₂ {tuple(measure.shape)}.")
    if not 0.0 <= choose_share <= 1.0:
        raise ValueError(f"choose_share must lie in [0, 1], got {choose_share}.")
    check_square(direction, "direction curvature")
    L, U = symmetric_eigh64(direction)
    tol = roundoff_tolerance(direction)
    groups = tied_groups(L, tol)
    # held in the factors' dtype: its round-off tolerance is that of the precision it was computed in
    magnitude = (choose_share * choose.double() + (1.0 - choose_share) * measure.double()).to(choose.dtype)
    lam = group_means(remeasure_eigenvalues(U, magnitude), groups).double()
    null = _null_group(L, groups, tol)
    if null is not None:
        U[:, null], lam[null] = _nested_null_space(U[:, null], choose, measure)
    return U.to(direction.dtype), lam.to(direction.dtype)


def _nested_null_space(V: torch.Tensor, choose: torch.Tensor, measure: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(V Y, μ)`` for B's null-space basis ``V`` ``(n, k)`` (float64): ``Y`` the eigenvectors of
    ``Vᵀ choose V``, ``μ`` the Rayleigh quotients of ``Vᵀ measure V`` along them, averaged over
    each degenerate group of ``Vᵀ choose V``. Tolerances are those of the full factors (the
    compressions' own norms may be round-off)."""
    L1, Y = symmetric_eigh64(V.T @ choose.double() @ V)
    S2 = V.T @ measure.double() @ V
    mu = clamp_roundoff_negatives(((0.5 * (S2 + S2.T) @ Y) * Y).sum(0), roundoff_tolerance(measure),
                                  "remeasured curvature")
    return V @ Y, group_means(mu, tied_groups(L1, roundoff_tolerance(choose)))


def debiased_factor_mode(
    direction: torch.Tensor, magnitude: torch.Tensor | RowFactor, null_space: str, terms: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Debias one factor with the treatment of B's null space that ``null_space`` names.

    Args:
        direction: B's ``(n, n)`` PSD factor.
        magnitude: B̃'s ``(n, n)`` PSD factor, same layer and position (or held as rows).
        null_space: ``"isotropic"`` ([`isotropic_factor`][laplace_debiased.curvature.completion.isotropic_factor]) or ``"aligned"``
            ([`debiased_factor`][laplace_debiased.curvature.linalg.debiased_factor]).
        terms: The rank-one terms summed into ``magnitude`` (its round-off tolerance).

    Returns:
        ``(U, lam)`` as the chosen function returns them.

    Raises:
        ValueError: For another ``null_space``.
    """
    from laplace_debiased.curvature.linalg import debiased_factor

    if null_space == "isotropic":
        return isotropic_factor(direction, magnitude, terms)
    if null_space == "aligned":
        return debiased_factor(direction, magnitude, terms)
    raise ValueError(f"null_space must be one of {NULL_SPACE_MODES}, got {null_space!r}.")


def extended_spectrum(Q: torch.Tensor, eigenvalues: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Extended spectrum ``[λ_1, ..., λ_r, ν]`` and multiplicities ``[1, ..., 1, d - r]`` of a
    factor (no extra entry when ``Q`` is square): ``Q`` ``(d, r)`` holds the
    eigenvectors, the last entry ``ν`` is the eigenvalue on their complement (0 when not given)."""
    r, null = Q.shape[1], Q.shape[0] - Q.shape[1]
    if len(eigenvalues) not in (r, r + 1) or (not null and len(eigenvalues) != r):
        raise ValueError(
            f"eigenvectors {tuple(Q.shape)} need {r} eigenvalues"
            + (f" (or {r + 1}, the last on their complement)" if null else "")
            + f"; got {len(eigenvalues)}."
        )
    ones = torch.ones(r, dtype=eigenvalues.dtype, device=eigenvalues.device)
    if not null:
        return eigenvalues, ones
    ext = eigenvalues if len(eigenvalues) == r + 1 else torch.cat([eigenvalues, eigenvalues.new_zeros(1)])
    return ext, torch.cat([ones, ones.new_full((1,), null)])

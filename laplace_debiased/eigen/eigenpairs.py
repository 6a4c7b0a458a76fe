"""Marginal likelihood of the eigen-structured classes from the curvature's eigenpairs, as
functions that ``DebiasedLowRank(LL)Laplace`` and ``DebiasedFull(LL)Laplace`` call.

laplace-torch's ``log_marginal_likelihood`` is ``log_likelihood − ½ (log det P − log det P₀ +
scatter)`` with ``P = s·H + P₀`` (``s = 1/σ²/T``) and the MAP's prior term ``scatter =
(θ* − μ₀)ᵀ P₀ (θ* − μ₀)``; only ``log det P`` depends on the curvature.  The classes compute it
from float64 eigenpairs ``H = Q diag(h) Qᵀ``
([`laplace_debiased.eigen.marglik.eigen_log_det`][laplace_debiased.eigen.marglik.eigen_log_det]) that
they keep per version of ``la.H``
([`KnownEigenpairs`][laplace_debiased.eigen.eigenpairs.KnownEigenpairs], decomposed at most once per
fit), so that every evaluation, its gradient in the prior precision and ``σ``, and every step of
``optimize_prior_precision(method="marglik")`` or ``marglik_training`` cost ``O(r)`` for a scalar
prior: no new factorisation per step.  A layer-wise or diagonal prior breaks the shared
eigenbasis: then ``O(P r²)`` per step (the rank-``r`` determinant lemma), the dense ``O(P³)``
when ``H`` has full rank ``r = P``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["KnownEigenpairs", "current_eigenpairs", "eigenpairs_from_state", "eigenpairs_state", "log_det_prior"]


@dataclass(frozen=True)
class KnownEigenpairs:
    """Float64 eigenpairs ``H = Q diag(h) Qᵀ`` of one version of ``la.H``.

    Attributes:
        version: The object that identifies the curvature they decompose (it changes whenever
            ``la.H`` is assigned).
        vectors: ``Q``, ``(P, r)`` with orthonormal columns.
        values: ``h``, ``(r,)``, ``≥ 0``.
    """

    version: object
    vectors: Tensor
    values: Tensor


def current_eigenpairs(
    known: KnownEigenpairs | None, version: object, decompose: Callable[[], tuple[Tensor, Tensor]]
) -> KnownEigenpairs:
    """The eigenpairs of the current curvature.

    Args:
        known: The eigenpairs kept so far (``None``: none).
        version: The current curvature's version.
        decompose: Gives float64 ``(Q, h)`` of the current curvature.

    Returns:
        ``known`` if it is of ``version``, else ``decompose()``'s eigenpairs of it.
    """
    if known is None or known.version is not version:
        return KnownEigenpairs(version, *decompose())
    return known


def eigenpairs_state(known: KnownEigenpairs | None, version: object) -> dict[str, Tensor | None]:
    """The ``state_dict`` entries of the kept eigenpairs, so a loaded object computes exactly what
    the saved one did.

    Args:
        known: The eigenpairs kept so far.
        version: The current curvature's version.

    Returns:
        ``"curvature_eigenvectors"`` and ``"curvature_eigenvalues"``: those of ``known`` if it is
        of ``version``, else ``None``.
    """
    current = known is not None and known.version is version
    return {
        "curvature_eigenvectors": known.vectors if current else None,
        "curvature_eigenvalues": known.values if current else None,
    }


def eigenpairs_from_state(state_dict: dict[str, Any], version: object) -> KnownEigenpairs | None:
    """The eigenpairs [`eigenpairs_state`][laplace_debiased.eigen.eigenpairs.eigenpairs_state] saved.

    Args:
        state_dict: A loaded ``state_dict``.
        version: The version of the curvature loaded with it.

    Returns:
        The saved eigenpairs as those of ``version``, or ``None`` if none were saved.
    """
    if state_dict.get("curvature_eigenvectors") is None:
        return None
    return KnownEigenpairs(version, state_dict["curvature_eigenvectors"], state_dict["curvature_eigenvalues"])


def log_det_prior(prior_precision: Tensor | float, diagonal: Callable[[], Tensor]) -> Tensor:
    """The prior precision as [`eigen_log_det`][laplace_debiased.eigen.marglik.eigen_log_det] takes it.

    Args:
        prior_precision: laplace-torch's ``prior_precision``.
        diagonal: Gives laplace-torch's ``prior_precision_diag`` ``(P,)``.

    Returns:
        ``(1,)`` for a scalar prior precision (it shares the curvature's eigenbasis), else the
        ``(P,)`` diagonal.
    """
    prior = torch.as_tensor(prior_precision)
    if prior.numel() == 1:
        return prior.reshape(1)
    return diagonal()

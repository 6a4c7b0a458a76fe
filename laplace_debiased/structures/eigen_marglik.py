"""Marginal likelihood of the eigen-structured classes from the curvature's eigenpairs
(:class:`EigenMarglikMixin`, a base of ``DebiasedLowRank(LL)Laplace`` and ``DebiasedFull(LL)Laplace``).

laplace-torch's ``log_marginal_likelihood`` is ``log_likelihood − ½ (log det P − log det P₀ +
scatter)`` with ``P = s·H + P₀`` (``s = 1/σ²/T``) and the MAP's prior term ``scatter =
(θ* − μ₀)ᵀ P₀ (θ* − μ₀)``; only ``log det P`` depends on the curvature.  The mixin computes it from
float64 eigenpairs ``H = Q diag(h) Qᵀ`` (:func:`laplace_debiased.posterior.marglik.eigen_log_det`)
that the class decomposes once per fit, so that every evaluation, its gradient in the prior
precision and ``σ``, and every step of ``optimize_prior_precision(method="marglik")`` or
``marglik_training`` cost ``O(r)`` for a scalar prior: no new factorisation per step.  A
layer-wise or diagonal prior breaks the shared eigenbasis: then ``O(P r²)`` per step (the rank-``r``
determinant lemma), the dense ``O(P³)`` when ``H`` has full rank ``r = P``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from laplace_debiased.posterior.marglik import eigen_log_det

__all__ = ["EigenMarglikMixin"]


class EigenMarglikMixin:
    """``log_det_posterior_precision`` from :meth:`curvature_eigenpairs` (listed before the
    laplace-torch base, whose dense or ``K × K`` log-determinant it replaces)."""

    def curvature_eigenpairs(self) -> tuple[Tensor, Tensor]:
        """``(Q (P, r), h (r,))`` float64 with orthonormal ``Q``, ``h ≥ 0`` and ``H = Q diag(h) Qᵀ``
        (``la.H``, unscaled by ``_H_factor``): those the fit kept (:meth:`_remember_eigenpairs`),
        else :meth:`_decompose_curvature` once for the current ``la.H`` object."""
        self._check_H_init()
        cached = getattr(self, "_eigenpairs_of_H", None)
        if cached is None or cached[0] is not self._curvature_version():
            self._remember_eigenpairs(*self._decompose_curvature())
            cached = self._eigenpairs_of_H
        return cached[1], cached[2]

    def _remember_eigenpairs(self, Q: Tensor, h: Tensor) -> None:
        """Keep ``(Q, h)`` as the eigenpairs of the current ``la.H`` (a new ``H`` object, as every
        fit and ``load_state_dict`` sets, invalidates them)."""
        self._eigenpairs_of_H = (self._curvature_version(), Q, h)

    def _curvature_version(self) -> object:
        """An object that changes whenever ``la.H`` is assigned: here ``la.H`` itself."""
        return self.H

    def state_dict(self) -> dict[str, Any]:
        """The base's state plus the eigenpairs the fit kept for ``H`` (``None`` if none), so a
        loaded object computes exactly what the saved one did."""
        state = super().state_dict()
        cached = getattr(self, "_eigenpairs_of_H", None)
        known = cached is not None and cached[0] is self._curvature_version()
        state["curvature_eigenvectors"] = cached[1] if known else None
        state["curvature_eigenvalues"] = cached[2] if known else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("curvature_eigenvectors") is not None:
            self._remember_eigenpairs(state_dict["curvature_eigenvectors"], state_dict["curvature_eigenvalues"])

    def _decompose_curvature(self) -> tuple[Tensor, Tensor]:
        """Float64 ``(Q, h)`` of ``la.H`` (see :meth:`curvature_eigenpairs`)."""
        raise NotImplementedError

    def _prior_for_log_det(self) -> Tensor:
        """``(1,)`` for a scalar prior precision (it shares the eigenbasis), else the ``(P,)``
        ``prior_precision_diag``."""
        prior = torch.as_tensor(self.prior_precision)
        if prior.numel() == 1:
            return prior.reshape(1)
        return self.prior_precision_diag

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det(s·H + P₀)`` in the model dtype, computed in float64 from the eigenpairs."""
        self._check_H_init()
        Q, h = self.curvature_eigenpairs()
        return eigen_log_det(Q, h, self._H_factor, self._prior_for_log_det()).to(self._dtype)

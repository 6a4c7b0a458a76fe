"""``la.H`` of the dense eigen-structured classes built on first read (:class:`LazyDenseCurvatureMixin`).

laplace-torch's ``FullLaplace`` keeps the dense ``P × P`` curvature ``H``. ``debiased_full``
knows it after the fit as float64 eigenpairs ``H = Q diag(h) Qᵀ``, from which the marginal
likelihood and the scalar-prior predictive are computed; forming the dense matrix costs
``O(P² r)``. The mixin keeps the eigenpairs and forms ``H`` when something reads ``la.H`` (a
layer-wise or diagonal prior's posterior scale, ``posterior_precision``, ``state_dict``, a user),
so every laplace-torch path that reads it still works and sees the same value.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["LazyDenseCurvatureMixin", "symmetric_outer"]


def symmetric_outer(Q: Tensor, h: Tensor) -> Tensor:
    """``Q diag(h) Qᵀ`` ``(P, P)`` for ``Q`` ``(P, r)`` and ``h`` ``(r,)``, made exactly symmetric
    (the average with its transpose), in the dtype of ``Q``."""
    H = (Q * h) @ Q.T
    return 0.5 * (H + H.T)


class LazyDenseCurvatureMixin:
    """``H`` as a property over either a stored tensor or pending float64 eigenpairs (listed
    before the laplace-torch base, whose ``self.H = ...`` assignments go through the setter).

    Every assignment gives the curvature a new :meth:`_curvature_version`; forming the pending
    matrix on read does not (it is the same curvature)."""

    @property
    def H(self) -> Tensor | None:
        """The dense curvature ``(P, P)`` in the model dtype (formed now if still pending)."""
        state = self.__dict__
        if "_H_stored" not in state:
            raise AttributeError("H")  # laplace-torch's __init__ tests hasattr(self, "H")
        pending = state["_H_pending"]
        if pending is not None:
            state["_H_stored"] = symmetric_outer(*pending).to(self._device, self._dtype)
            state["_H_pending"] = None
        return state["_H_stored"]

    @H.setter
    def H(self, value: Tensor | None) -> None:
        self.__dict__.update(_H_stored=value, _H_pending=None, _H_version=object())

    def _set_H_from_eigenpairs(self, Q: Tensor, h: Tensor) -> None:
        """Make ``H = Q diag(h) Qᵀ`` (``Q`` ``(P, r)``, ``h`` ``(r,)``, float64), formed on first read."""
        self.H = None
        self.__dict__["_H_pending"] = (Q, h)

    def _curvature_version(self) -> object:
        """A token that changes whenever ``H`` is assigned."""
        return self.__dict__.get("_H_version")

    def _check_H_init(self) -> None:
        if self.__dict__.get("_H_stored") is None and self.__dict__.get("_H_pending") is None:
            raise AttributeError("Laplace not fitted. Run fit() first.")

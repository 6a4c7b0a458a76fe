"""Which posterior structure a fitted laplace-torch object has (``KronStructure`` or
``EigenStructure``) and which parameters it is over.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from torch import Tensor, nn

from laplace_debiased.posterior.eigen_structure import EigenStructure
from laplace_debiased.posterior.kron_structure import KronStructure

if TYPE_CHECKING:
    from laplace.baselaplace import ParametricLaplace


def laplace_params(la) -> list[Tensor]:
    """The parameters a laplace-torch object's posterior is over (last layer for LL variants)."""
    last = getattr(getattr(la, "model", None), "last_layer", None)
    if last is not None and la.n_params == sum(p.numel() for p in last.parameters()):
        return list(last.parameters())
    return list(la.params)


def predictive_parts(la) -> tuple[nn.Module, list[Tensor]]:
    """The network and the parameters of ``la``'s posterior
    ([`laplace_params`][laplace_debiased.posterior.from_laplace.laplace_params]) as objects that pickle, for
    evaluating the posterior in another process.

    Over all weights: ``la.model`` and its parameters. Last layer: a copy of the network inside
    laplace-torch's ``FeatureExtractor`` without the extractor's feature hook (a local function,
    which does not pickle, and which the predictive does not need) and that copy's last-layer
    parameters; ``la`` is left as it was."""
    from laplace.utils.feature_extractor import FeatureExtractor

    params = laplace_params(la)
    if not isinstance(la.model, FeatureExtractor):
        return la.model, params
    model, params = copy.deepcopy((la.model.model, params))
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__qualname__", "").startswith("FeatureExtractor."):
                del module._forward_hooks[key]
    return model, params


def curvature_kind(la: ParametricLaplace) -> str | None:
    """The kind of curvature a fitted laplace-torch object holds in ``la.H`` (cheap: no
    decomposition).

    Args:
        la: a fitted laplace-torch ``ParametricLaplace``.

    Returns:
        ``"own"`` (a curvature with a ``grid_structure`` method), ``"kron"``
        (``KronDecomposed``), ``"dense"`` (a ``(P, P)`` tensor) or ``"low_rank"`` (a pair
        ``(U, λ)``) for the curvatures
        [`posterior_structure`][laplace_debiased.posterior.from_laplace.posterior_structure] reads, else
        ``None``.
    """
    from laplace.utils.matrix import KronDecomposed

    H = getattr(la, "H", None)
    if callable(getattr(H, "grid_structure", None)):
        return "own"
    if isinstance(H, KronDecomposed):
        return "kron"
    if isinstance(H, Tensor) and H.ndim == 2 and H.shape[0] == H.shape[1] == la.n_params:
        return "dense"
    if isinstance(H, (tuple, list)) and len(H) == 2 and isinstance(H[0], Tensor) and H[0].ndim == 2:
        return "low_rank"
    return None



def posterior_structure(la) -> KronStructure | EigenStructure:
    """Read the curvature ``la.H`` of a fitted laplace-torch ``ParametricLaplace``.

    ``KronDecomposed`` -> [`KronStructure`][laplace_debiased.posterior.kron_structure.KronStructure]; a dense ``(P, P)``
    tensor -> [`EigenStructure`][laplace_debiased.posterior.eigen_structure.EigenStructure] (full; from
    ``la.curvature_eigenpairs()`` ``(Q, h)`` where the object has them, low rank when ``H`` has rank ``< P``);
    a pair ``(U, λ)`` -> [`EigenStructure`][laplace_debiased.posterior.eigen_structure.EigenStructure] (low rank).
    """
    kind, H, s = curvature_kind(la), getattr(la, "H", None), la._H_factor
    if kind == "own":  # a curvature that knows its basis (debiased EKFAC)
        return H.grid_structure(s, [p.numel() for p in laplace_params(la)])
    if kind == "kron":
        return KronStructure(H, s, [p.numel() for p in laplace_params(la)])
    if kind == "dense" and callable(getattr(la, "curvature_eigenpairs", None)):
        return EigenStructure(*la.curvature_eigenpairs(), s)  # kept by the fit: no P × P eigh
    if kind == "dense":
        return EigenStructure.from_dense(H, s)
    if kind == "low_rank":
        return EigenStructure(H[0], H[1], s)
    raise TypeError(
        f"no eigenbasis for curvature of type {type(H).__name__} (fit the Laplace object first; "
        "for other structures use sampled_linearized_predictive)"
    )

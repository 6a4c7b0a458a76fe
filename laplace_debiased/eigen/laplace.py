"""Debiased eigen-structured Laplace: ``debiased_lowrank`` and ``debiased_full``.

The eigenvectors ``U`` of the GGN (or empirical Fisher) of the direction batch B are kept; the
eigenvalues are re-measured on the independent magnitude batch B̃ as ``λ̃_i = u_iᵀ G_B̃ u_i``
(Tatzel et al., ICLR 2025). Both curvatures are scaled like laplace-torch scales a fit over a
loader of ``N`` samples: ``N / |S|`` times the summed-loss curvature of batch set ``S``. With
``magnitude_loader=train_loader`` (B̃ = B) both classes reduce to their single-batch versions
(top-k eigenpairs of ``G_B``, resp. ``G_B`` itself).

- ``DebiasedLowRankLaplace`` (``("all", "debiased_lowrank")``) and
  ``DebiasedLowRankLLLaplace`` (``("last_layer", "debiased_lowrank")``): ``H = (U, λ̃)`` with
  laplace-torch's ``LowRankLaplace`` posterior ``P = U diag(λ̃/σ²/T) Uᵀ + diag(p₀)`` (Woodbury
  functional variance, samples, log-determinant). Directions whose re-measured curvature is
  ``≤ remeasured_rtol · max λ̃`` (including ``λ̃ ≤ 0``) are removed: their contribution
  ``λ̃ u uᵀ`` to the precision is (close to) zero and ``diag(1/λ̃)`` in the Woodbury inverse stays
  finite. ``la.H[0].shape[1]`` is the rank finally used. ``estimator="corrected"`` takes the top
  eigenvectors of B ∪ B̃ instead, their eigenvalues less the bias both orders of B and B̃ measure
  ([`corrected_lowrank`][laplace_debiased.eigen.decompose.corrected_lowrank]).
- ``DebiasedFullLaplace`` (``("all", "debiased_full")``) and ``DebiasedFullLLLaplace``
  (``("last_layer", "debiased_full")``): eigendecomposition of the dense ``G_B``,
  ``H = U diag(diag(Uᵀ G_B̃ U)) Uᵀ`` (round-off negatives clamped to 0) on the range of ``G_B``
  plus the compression of ``G_B̃`` onto ``G_B``'s null space (where eigenvectors are not
  determined by B, so a per-direction diagonal would depend on an arbitrary basis), then
  laplace-torch's ``FullLaplace`` posterior. For the last layer the dense curvature comes from
  features ⊗ output curvature (no per-parameter autograd).

Fit semantics (B/B̃ selection, rescaled loss, bad-input errors, grid-search fix) are those of
[`laplace_debiased.two_batch.base.TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace].
Backends: any exact GGN backend (``CurvlinopsGGN``, the default, ``AsdlGGN``, ``BackPackGGN``) or
empirical-Fisher backend (``CurvlinopsEF``, ``AsdlEF``, ``BackPackEF``); the curvature is computed by
[`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen] from the backend's *type* only, so
every such backend gives the same result (the backend's loss function scales the training loss). Inputs may be
tensors or mappings (a dict or a Hugging Face ``BatchEncoding`` that the model consumes whole,
with laplace-torch's ``dict_key_x``/``dict_key_y``), for all weights and for the last layer;
the weights are the parameters with ``requires_grad`` (e.g. LoRA adapters on a frozen
backbone). Outputs may be ``(n, tokens, C)``, every token an output with its own loss term
(targets ``(n, tokens)`` or ``(n, tokens, C)``; last layer: features ``(n, tokens, D)``), as in
[`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen]. ``likelihood="reward_modeling"`` fits
with the classification curvature (Bradley-Terry preference pairs) and predicts as regression, as
laplace-torch does.

Under an initialised ``torch.distributed`` group
([`laplace_debiased.parallel.distributed`][laplace_debiased.parallel.distributed]) every rank computes the
dense curvature of its rows of every batch of B (and, for ``debiased_full``, of B̃; for ``debiased_lowrank``
B̃'s directional curvatures), the shares are added with ``all_reduce``, and rank 0 decomposes (float64) and
broadcasts, so every rank holds the identical posterior. ``debiased_lowrank`` then takes the dense route on
the ``P × P`` sum, or (``method="lanczos"``, or ``"auto"`` above 1 GiB) Lanczos on rank 0 with every product
``G_B v`` summed over the ranks. The computations are those of
[`laplace_debiased.eigen.decompose`][laplace_debiased.eigen.decompose], through the reducer of
[`current_reducer`][laplace_debiased.parallel.reducer.current_reducer].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from laplace.baselaplace import FullLaplace, LowRankLaplace
from laplace.curvature.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.lllaplace import FullLLLaplace, LLLaplace
from torch import Tensor, nn

from laplace_debiased.eigen.decompose import (
    LOWRANK_ESTIMATORS,
    CurvatureSource,
    debiased_full,
    debiased_lowrank,
    symmetric_outer,
)
from laplace_debiased.curvature import eigen, inputs
from laplace_debiased.curvature.linalg import symmetric_eigh64
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.parallel.distributed import local_shards
from laplace_debiased.parallel.reducer import Reducer, current_reducer
from laplace_debiased.posterior.eigen_structure import orthonormal_eigenpairs
from laplace_debiased.eigen.posterior import dense_posterior_scale, lowrank_functional_covariance
from laplace_debiased.eigen.marglik import eigen_functional_covariance, eigen_log_det
from laplace_debiased.eigen.eigenpairs import (
    KnownEigenpairs,
    current_eigenpairs,
    eigenpairs_from_state,
    eigenpairs_state,
    log_det_prior,
)
from laplace_debiased.eigen.lazy import PendingCurvature, formed_curvature
from laplace_debiased.two_batch.base import TwoBatchLaplace

__all__ = [
    "DebiasedFullLaplace",
    "DebiasedFullLLLaplace",
    "DebiasedLowRankLaplace",
    "DebiasedLowRankLLLaplace",
    "EigenConfig",
    "EigenFitInputs",
    "curvature_type",
    "eigen_fit_inputs",
    "module_batches",
]


@dataclass(frozen=True)
class EigenConfig:
    """The construction settings of ``debiased_lowrank`` that shape ``H``.

    Attributes:
        rank: Number ``k`` of top eigenvectors of ``G_B``.
        method: Route to the eigenpairs, one of ``eigen.METHODS``
            ([`laplace_debiased.curvature.eigen.top_eigenpairs`][laplace_debiased.curvature.eigen.top_eigenpairs]).
        eigval_rtol: Directions with B-eigenvalue ``≤ eigval_rtol · λ_max(G_B)`` are not selected
            (those B does not see; also guards against round-off null-space vectors).
        remeasured_rtol: Directions with ``λ̃ ≤ remeasured_rtol · max λ̃`` (or ``≤ 0``) are removed.
        estimator: ``"corrected"`` (the default: the top eigenvectors of B ∪ B̃, eigenvalues less the
            bias both orders measure;
            [`corrected_lowrank`][laplace_debiased.eigen.decompose.corrected_lowrank]) or ``"paper"``
            (B's eigenvectors, B̃'s Rayleigh quotients).

    Raises:
        ValueError: ``rank`` is not a positive int, ``method`` or ``estimator`` unknown, or a tolerance
            outside ``[0, 1)``.
    """

    rank: int = 50
    method: eigen.Method = "auto"
    eigval_rtol: float = 1e-6
    remeasured_rtol: float = 1e-8
    estimator: str = "corrected"

    def __post_init__(self) -> None:
        if self.estimator not in LOWRANK_ESTIMATORS:
            raise ValueError(f"debiased_lowrank offers estimator in {LOWRANK_ESTIMATORS}, got {self.estimator!r}.")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"rank must be a positive int, got {self.rank!r}.")
        if self.method not in eigen.METHODS:
            raise ValueError(f"method must be one of {eigen.METHODS}, got {self.method!r}.")
        for name, value in (("eigval_rtol", self.eigval_rtol), ("remeasured_rtol", self.remeasured_rtol)):
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}.")

    def state(self) -> dict[str, int | float | str]:
        """The settings under their ``state_dict`` keys (numbers and strings only)."""
        return {
            "eigen_rank": self.rank,
            "eigen_requested_method": self.method,
            "eigen_eigval_rtol": self.eigval_rtol,
            "eigen_remeasured_rtol": self.remeasured_rtol,
            "eigen_estimator": self.estimator,
        }

    def check_state(self, state_dict: dict[str, Any]) -> None:
        """Refuse a ``state_dict`` saved with other settings.

        Args:
            state_dict: A loaded ``state_dict``
                ([`state`][laplace_debiased.eigen.laplace.EigenConfig.state]'s entries).

        Raises:
            ValueError: The saved settings differ from these.
        """
        saved = {key: state_dict.get(key) for key in self.state()}
        saved["eigen_estimator"] = state_dict.get("eigen_estimator", "paper")  # saved before the option existed
        if saved != self.state():
            raise ValueError(
                f"checkpoint was fitted with {saved} but this object has {self.state()}; "
                "construct it with the same rank/method/tolerances/estimator."
            )


def curvature_type(backend: CurvatureInterface) -> inputs.Curvature:
    """The curvature a backend stands for in
    [`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen].

    Args:
        backend: laplace-torch's curvature backend.

    Returns:
        ``"ef"`` for an empirical-Fisher backend, ``"ggn"`` for an exact GGN backend.

    Raises:
        ValueError: Any other backend (stochastic GGN, Hessian): the curvature must be PSD.
    """
    if isinstance(backend, EFInterface):
        return "ef"
    if isinstance(backend, GGNInterface) and not getattr(backend, "stochastic", False):
        return "ggn"
    raise ValueError(
        f"backend {type(backend).__name__} is not an exact GGN or empirical-Fisher backend; "
        "debiased eigen structures need positive semi-definite curvature. Use the default "
        "CurvlinopsGGN or CurvlinopsEF."
    )


class _PairHead(nn.Module):
    """A reward model's last layer on preference-pair features ``(n, 2, D)``: its outputs
    ``(n, 2, 1)`` flattened to the pair logits ``(n, 2)`` that the Bradley-Terry (classification)
    curvature needs; 2-D features pass through unchanged. Same parameters as ``layer``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer(x)
        return out.flatten(1) if x.ndim == 3 else out


def _pair_features(features: Tensor, n: int) -> Tensor:
    """A reward model's last-layer features of ``n`` preference pairs as ``(n, 2, D)``: a model
    that flattens each pair to two rows gives ``(2n, D)``, sample-major (the layout of
    ``x.reshape(-1, d)`` on ``(n, 2, d)``); features ``(n, 2, D)`` pass unchanged."""
    if features.ndim == 2 and features.shape[0] == 2 * n:
        return features.reshape(n, 2, features.shape[-1])
    return features


@torch.no_grad()
def module_batches(
    model: nn.Module, batches: list[Batch], *, last_layer: bool, dict_key_x: str, dict_key_y: str
) -> list[inputs.Batch]:
    """``(input of the curvature module, y)`` per batch.

    Args:
        model: The network, or laplace-torch's ``FeatureExtractor`` for a last layer.
        batches: Loader batches.
        last_layer: Whether the curvature module is the last layer (its inputs are features).
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        The batches' inputs (last layer: features ``(n, D)``, or ``(n, tokens, D)`` for token
        outputs, each token an output) and targets.
    """
    out = []
    for b in batches:
        X, y = batch_inputs_targets(b, dict_key_x, dict_key_y)
        if last_layer:
            _, X = model.forward_with_features(X)
        out.append((X, y))
    return out


@dataclass(frozen=True)
class EigenFitInputs:
    """What [`laplace_debiased.eigen.decompose`][laplace_debiased.eigen.decompose] computes a two-batch
    fit from.

    Attributes:
        source: The curvature module, likelihood, curvature type and output width.
        direction: This rank's rows of B as inputs of the module.
        magnitude: This rank's rows of B̃; ``None`` for B̃ = B.
        sizes: The samples of B and B̃ over all ranks.
    """

    source: CurvatureSource
    direction: list[inputs.Batch]
    magnitude: list[inputs.Batch] | None
    sizes: tuple[int, int]


def eigen_fit_inputs(
    model: nn.Module,
    backend: CurvatureInterface,
    direction_batches: list[Batch],
    magnitude_batches: list[Batch],
    *,
    likelihood: str,
    n_outputs: int,
    last_layer: bool,
    dict_key_x: str,
    dict_key_y: str,
    reducer: Reducer,
) -> EigenFitInputs:
    """The inputs of a debiased eigen fit of a laplace-torch object.

    Args:
        model: laplace-torch's ``la.model`` (a ``FeatureExtractor`` for a last layer).
        backend: laplace-torch's curvature backend
            ([`curvature_type`][laplace_debiased.eigen.laplace.curvature_type]).
        direction_batches: B.
        magnitude_batches: B̃ (the same list object for B̃ = B).
        likelihood: laplace-torch's likelihood; ``"reward_modeling"`` fits as classification.
        n_outputs: ``C``.
        last_layer: Whether the curvature is over the last layer only.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.
        reducer: The ranks' collectives (this rank keeps its shard of every batch).

    Returns:
        The [`EigenFitInputs`][laplace_debiased.eigen.laplace.EigenFitInputs].

    Raises:
        ValueError: The backend is not an exact GGN or empirical-Fisher backend.
    """
    kind = curvature_type(backend)
    module = model
    if last_layer:
        module = _PairHead(model.last_layer) if likelihood == "reward_modeling" else model.last_layer
    fit_likelihood = "classification" if likelihood == "reward_modeling" else likelihood
    keys = {"dict_key_x": dict_key_x, "dict_key_y": dict_key_y}

    def local(batches: list[Batch]) -> list[inputs.Batch]:
        shards = local_shards(batches, **keys, rank=reducer.rank, world=reducer.world)
        out = module_batches(model, shards, last_layer=last_layer, **keys)
        if last_layer and likelihood == "reward_modeling":  # pairs flattened to 2n feature rows
            out = [(_pair_features(X, len(y)), y) for X, y in out]
        return out

    same = magnitude_batches is direction_batches
    return EigenFitInputs(
        CurvatureSource(module, fit_likelihood, kind, n_outputs),
        local(direction_batches),
        None if same else local(magnitude_batches),
        tuple(sum(batch_size(b, **keys) for b in batches) for batches in (direction_batches, magnitude_batches)),
    )


class DebiasedLowRankLaplace(TwoBatchLaplace, LowRankLaplace):
    """Two-batch debiased low-rank Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_lowrank")``).

    Args:
        model: The network, as for laplace-torch's ``ParametricLaplace``.
        likelihood: laplace-torch's likelihood.
        rank: Number ``k`` of top eigenvectors of ``G_B``.
        method: Route to B's eigenpairs ([`EigenConfig`][laplace_debiased.eigen.laplace.EigenConfig],
            which holds the five settings as ``eigen_config``).
        eigval_rtol: Floor on B's eigenvalues, relative to the largest
            ([`EigenConfig`][laplace_debiased.eigen.laplace.EigenConfig]).
        remeasured_rtol: Floor on the re-measured ``λ̃``, relative to the largest
            ([`EigenConfig`][laplace_debiased.eigen.laplace.EigenConfig]).
        estimator: ``"corrected"`` (the default: the top eigenvectors of B ∪ B̃ with the bias both
            orders measure removed;
            [`corrected_lowrank`][laplace_debiased.eigen.decompose.corrected_lowrank]) or ``"paper"``
            (B's eigenvectors, B̃'s Rayleigh quotients); checked here.
        **kwargs: The batch options
            ([`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace]) and
            laplace-torch's ``ParametricLaplace`` arguments.

    After ``fit``: ``H = (U (P, r), λ̃ (r,))`` in the model dtype with ``r ≤ rank``;
    ``direction_eigenvalues`` (``(r,)``) are B's own (biased) eigenvalues of the kept directions
    (``"corrected"``: those of B ∪ B̃), scaled to ``n_data``, for diagnostics; ``eigen_method`` is the
    route used.

    Raises:
        ValueError: A setting out of range ([`EigenConfig`][laplace_debiased.eigen.laplace.EigenConfig]).
    """

    _key = ("all", "debiased_lowrank")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        *,
        rank: int = 50,
        method: eigen.Method = "auto",
        eigval_rtol: float = 1e-6,
        remeasured_rtol: float = 1e-8,
        estimator: str = "corrected",
        **kwargs: Any,
    ) -> None:
        self.eigen_config = EigenConfig(rank, method, eigval_rtol, remeasured_rtol, estimator)
        self.direction_eigenvalues: Tensor | None = None
        self.eigen_method: str | None = None
        super().__init__(model, likelihood, **kwargs)

    def _laplace_init(self, model: nn.Module, likelihood: str, *args: Any, **kwargs: Any) -> None:
        """``ParametricLaplace.__init__``: ``LowRankLaplace.__init__`` (laplace-torch 0.3,
        ``baselaplace.py``, ``LowRankLaplace.__init__``) only raises ``ImportError`` without the old
        ``asdfghjkl`` package and then calls it with its arguments; only its own backend needs that
        package, and the curvature here comes from
        [`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen]."""
        super(LowRankLaplace, self).__init__(model, likelihood, *args, **kwargs)

    def _check_override(self, override: bool) -> None:
        if not override:
            raise ValueError(
                "debiased_lowrank cannot be updated (override=False): the eigenpairs of a "
                "sum are not the union of eigenpairs. Refit on all data instead."
            )

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> Tensor:
        """B's top eigenvectors and B̃'s Rayleigh quotients, or the corrected estimate
        ([`debiased_lowrank`][laplace_debiased.eigen.decompose.debiased_lowrank])."""
        reducer = current_reducer()
        fit = eigen_fit_inputs(
            self.model, self.backend, direction_batches, magnitude_batches, likelihood=self.likelihood,
            n_outputs=self.n_outputs, last_layer=isinstance(self, LLLaplace), dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y, reducer=reducer,
        )
        result = debiased_lowrank(
            fit.source, fit.direction, fit.magnitude, sizes=fit.sizes, n_data=N, **asdict(self.eigen_config),
            reducer=reducer,
        )
        self.direction_eigenvalues = result.direction_eigenvalues.to(self._dtype)
        self.eigen_method = result.method
        self.H = (result.vectors.to(self._device, self._dtype), result.eigenvalues.to(self._device, self._dtype))
        return self._summed_loss(self._distinct(direction_batches, magnitude_batches))

    def curvature_eigenpairs(self) -> tuple[Tensor, Tensor]:
        """``(Q (P, r), h (r,))`` float64, ``H = Q diag(h) Qᵀ`` (unscaled by ``_H_factor``): ``H``
        re-orthonormalised
        ([`orthonormal_eigenpairs`][laplace_debiased.posterior.eigen_structure.orthonormal_eigenpairs], ``O(P r²)``)
        once per ``H`` object."""
        self._check_H_init()
        known = current_eigenpairs(getattr(self, "_known_eigenpairs", None), self.H, lambda: orthonormal_eigenpairs(*self.H))
        self._known_eigenpairs = known
        return known.vectors, known.values

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det(s·H + P₀)`` in the model dtype, float64 from
        [`curvature_eigenpairs`][laplace_debiased.eigen.laplace.DebiasedLowRankLaplace.curvature_eigenpairs]."""
        Q, h = self.curvature_eigenpairs()
        prior = log_det_prior(self.prior_precision, lambda: self.prior_precision_diag)
        return eigen_log_det(Q, h, self._H_factor, prior).to(self._dtype)

    def square_norm(self, value: Tensor) -> Tensor:
        """``Δᵀ P Δ`` for ``Δ = value - θ*`` and ``P = s·Q diag(h) Qᵀ + diag(p)``, float64 in the
        eigenbasis of [`curvature_eigenpairs`][laplace_debiased.eigen.laplace.DebiasedLowRankLaplace.curvature_eigenpairs] (``s Σ_i h_i (q_iᵀΔ)² + Σ_j p_j Δ_j²``), in the
        model dtype; with [`log_det_posterior_precision`][laplace_debiased.eigen.laplace.DebiasedLowRankLaplace.log_det_posterior_precision] it gives laplace-torch's ``log_prob``,
        the log density of ``N(θ*, P⁻¹)``."""
        Q, h = self.curvature_eigenpairs()
        delta = (value - self.mean).double()
        along = (delta @ Q).square() @ h * self._H_factor
        return (along + (self.prior_precision_diag.double() * delta.square()).sum(-1)).to(self._dtype)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` ``(n, C, C)`` for ``Js`` ``(n, C, P)``, in float64 without laplace-torch's
        "prior term minus low-rank correction" cancellation
        ([`laplace_debiased.eigen.posterior.lowrank_functional_covariance`][laplace_debiased.eigen.posterior.lowrank_functional_covariance])."""
        (U, lam), prior = self.posterior_precision
        return lowrank_functional_covariance(Js, U, lam, prior)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``(n·C, n·C)`` covariance; its diagonal blocks are
        [`functional_variance`][laplace_debiased.eigen.laplace.DebiasedLowRankLaplace.functional_variance]."""
        n, C, P = Js.shape
        return self.functional_variance(Js.reshape(1, n * C, P))[0]

    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state, the kept eigenpairs and the eigen settings as flat entries:
        tensors, numbers and strings only, so ``torch.load(..., weights_only=True)`` reads it."""
        known = getattr(self, "_known_eigenpairs", None)
        return {
            **super().state_dict(), **eigenpairs_state(known, self.H), "direction_eigenvalues": self.direction_eigenvalues,
            "eigen_method": self.eigen_method, **self.eigen_config.state(),
        }

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """The checks of every structure, then the [`EigenConfig`][laplace_debiased.eigen.laplace.EigenConfig] settings."""
        super()._check_loadable(state_dict)
        self.eigen_config.check_state(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved fit (refused if saved with other [`EigenConfig`][laplace_debiased.eigen.laplace.EigenConfig] settings)."""
        super().load_state_dict(state_dict)
        self._known_eigenpairs = eigenpairs_from_state(state_dict, self.H)
        self.direction_eigenvalues = state_dict["direction_eigenvalues"]
        self.eigen_method = state_dict["eigen_method"]


class DebiasedLowRankLLLaplace(DebiasedLowRankLaplace, LLLaplace):
    """Last-layer two-batch debiased low-rank Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_lowrank")``): [`DebiasedLowRankLaplace`][laplace_debiased.eigen.laplace.DebiasedLowRankLaplace] on the last
    ``nn.Linear``, fed with its input features (laplace-torch's ``FeatureExtractor``)."""

    _key = ("last_layer", "debiased_lowrank")


class DebiasedFullLaplace(TwoBatchLaplace, FullLaplace):
    """Two-batch debiased full Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_full")``), for small models.

    After ``fit``: ``H = U diag(λ̃) Uᵀ + Π G_B̃ Π`` (dense ``P × P``, model dtype;
    [`laplace_debiased.curvature.eigen.eigenbasis_debiased_curvature`][laplace_debiased.curvature.eigen.eigenbasis_debiased_curvature])
    with ``U`` the eigenvectors of ``G_B`` with non-zero eigenvalue, ``λ̃ = diag(Uᵀ G_B̃ U)`` and ``Π`` the
    projector onto ``G_B``'s null space (empty when ``|B|·C ≥ P`` up to the null space all batches share,
    where ``G_B̃ = 0`` too; then ``H = U diag(λ̃) Uᵀ`` over a full eigenbasis). The range of ``G_B``
    comes from ``VᵀV`` when ``|B|·C < P``, and when ``|B̃|·C < P`` the null-space part from the
    factor of ``G_B̃``
    ([`laplace_debiased.curvature.eigen.factored_null_space_compression`][laplace_debiased.curvature.eigen.factored_null_space_compression]),
    so the cost is that of ``min(P, |B|·C)`` and ``|B̃|·C`` eigenproblems plus a few ``P × P`` products; the
    resulting eigenpairs of ``H`` are kept
    ([`curvature_eigenpairs`][laplace_debiased.eigen.laplace.DebiasedFullLaplace.curvature_eigenpairs])
    for the marginal likelihood and the scalar-prior predictive, and where they are known the dense ``H`` is
    formed only when read ([`lazy_curvature`][laplace_debiased.eigen.lazy]).
    ``direction_eigenvalues`` and ``eigenvalues`` hold B's non-zero eigenvalues and their ``λ̃`` (descending
    in B's order, scaled to ``n_data``). ``override=False`` adds the new debiased ``H`` to the previous one,
    as ``FullLaplace`` adds curvature.
    """

    _key = ("all", "debiased_full")

    @property
    def H(self) -> Tensor | None:
        """The dense curvature ``(P, P)`` in the model dtype
        ([`formed_curvature`][laplace_debiased.eigen.lazy.formed_curvature] on first read)."""
        self._H_stored = formed_curvature(self._H_stored, self._device, self._dtype)  # before any: AttributeError
        return self._H_stored

    @H.setter
    def H(self, value: Tensor | PendingCurvature | None) -> None:
        """Every assignment is a new curvature (a new ``_H_version``); forming a pending one is not."""
        self._H_stored, self._H_version = value, object()

    def _check_H_init(self) -> None:
        if getattr(self, "_H_stored", None) is None:
            raise AttributeError("Laplace not fitted. Run fit() first.")

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> Tensor:
        """Debiased dense curvature and its float64 eigenpairs
        ([`debiased_full`][laplace_debiased.eigen.decompose.debiased_full]), added to ``H``: a first fit
        keeps the eigenpairs (re-orthonormalised) and leaves ``H`` pending; a later one (``override=False``)
        and a fit over several ranks (no eigenpairs) add densely."""
        reducer = current_reducer()
        fit = eigen_fit_inputs(
            self.model, self.backend, direction_batches, magnitude_batches, likelihood=self.likelihood,
            n_outputs=self.n_outputs, last_layer=isinstance(self, LLLaplace), dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y, reducer=reducer,
        )
        result = debiased_full(fit.source, fit.direction, fit.magnitude, sizes=fit.sizes, n_data=N, reducer=reducer)
        if self.n_data == 0 and result.eigenpairs is not None:
            self.H = PendingCurvature(*result.eigenpairs)
            self._known_eigenpairs = KnownEigenpairs(self._H_version, *orthonormal_eigenpairs(*result.eigenpairs))
        else:
            H = result.dense if result.dense is not None else symmetric_outer(*result.eigenpairs)
            self.H = self.H + H.to(self._device, self._dtype)
        self.direction_eigenvalues = result.direction_eigenvalues.to(self._dtype)
        self.eigenvalues = result.eigenvalues.to(self._dtype)
        self._posterior_scale = None
        return self._summed_loss(self._distinct(direction_batches, magnitude_batches))

    def curvature_eigenpairs(self) -> tuple[Tensor, Tensor]:
        """``(Q (P, r), h (r,))`` float64, ``H = Q diag(h) Qᵀ`` (unscaled by ``_H_factor``): those
        the fit kept, else a float64 eigendecomposition of the dense ``H`` (``O(P³)``, once per
        assignment of ``H``: distributed and ``override=False`` fits, a state without them)."""
        self._check_H_init()
        known = current_eigenpairs(getattr(self, "_known_eigenpairs", None), self._H_version, self._decomposed)
        self._known_eigenpairs = known
        return known.vectors, known.values

    def _decomposed(self) -> tuple[Tensor, Tensor]:
        h, Q = symmetric_eigh64(self.H)
        return Q, h.clamp_min(0.0)

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det(s·H + P₀)`` in the model dtype, float64 from
        [`curvature_eigenpairs`][laplace_debiased.eigen.laplace.DebiasedFullLaplace.curvature_eigenpairs]."""
        Q, h = self.curvature_eigenpairs()
        prior = log_det_prior(self.prior_precision, lambda: self.prior_precision_diag)
        return eigen_log_det(Q, h, self._H_factor, prior).to(self._dtype)

    def _compute_scale(self) -> None:
        """Posterior scale from a float64 eigendecomposition (laplace-torch's Cholesky fails or
        turns non-finite in float32 at small prior precision); the float64 scale is kept for
        [`functional_variance`][laplace_debiased.eigen.laplace.DebiasedFullLaplace.functional_variance]
        ([`laplace_debiased.eigen.posterior.dense_posterior_scale`][laplace_debiased.eigen.posterior.dense_posterior_scale])."""
        self._check_H_init()
        self._posterior_scale64 = dense_posterior_scale(self.H, self._H_factor, self.prior_precision_diag)
        self._posterior_scale = self._posterior_scale64.to(self._dtype)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` ``(n, C, C)`` in ``Js.dtype``, float64 inside. A scalar prior ``δ`` shares
        the curvature's eigenbasis
        ([`eigen_functional_covariance`][laplace_debiased.eigen.marglik.eigen_functional_covariance], no
        factorisation per ``δ``); another prior uses the float64 scale ``S Sᵀ = P⁻¹``."""
        prior = log_det_prior(self.prior_precision, lambda: self.prior_precision_diag)
        if prior.numel() == 1:
            Q, h = self.curvature_eigenpairs()
            return eigen_functional_covariance(Js, Q, float(self._H_factor) * h, prior[0].detach())
        if self._posterior_scale is None:
            self._compute_scale()
        JS = Js.double() @ self._posterior_scale64
        return (JS @ JS.transpose(-1, -2)).to(Js.dtype)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``(n·C, n·C)`` covariance; its diagonal blocks are
        [`functional_variance`][laplace_debiased.eigen.laplace.DebiasedFullLaplace.functional_variance]."""
        n, C, P = Js.shape
        return self.functional_variance(Js.reshape(1, n * C, P))[0]

    def _reset_fit_state(self) -> None:
        super()._reset_fit_state()
        self.direction_eigenvalues = self.eigenvalues = None

    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state (the dense ``H``), the kept eigenpairs and B's and B̃'s eigenvalues."""
        known = getattr(self, "_known_eigenpairs", None)
        return {
            **super().state_dict(), **eigenpairs_state(known, self._H_version),
            "direction_eigenvalues": self.direction_eigenvalues, "eigenvalues": self.eigenvalues,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved fit (its eigenpairs where it kept them)."""
        super().load_state_dict(state_dict)
        self._known_eigenpairs = eigenpairs_from_state(state_dict, self._H_version)
        self.direction_eigenvalues, self.eigenvalues = state_dict["direction_eigenvalues"], state_dict["eigenvalues"]
        self._posterior_scale = None


class DebiasedFullLLLaplace(DebiasedFullLaplace, FullLLLaplace):
    """Last-layer two-batch debiased full Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_full")``); the dense last-layer curvature is built from
    features ⊗ output curvature, fast for a last layer of a few thousand weights."""

    _key = ("last_layer", "debiased_full")

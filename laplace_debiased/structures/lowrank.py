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
  finite. ``la.H[0].shape[1]`` is the rank finally used.
- ``DebiasedFullLaplace`` (``("all", "debiased_full")``) and ``DebiasedFullLLLaplace``
  (``("last_layer", "debiased_full")``): eigendecomposition of the dense ``G_B``,
  ``H = U diag(diag(Uᵀ G_B̃ U)) Uᵀ`` (round-off negatives clamped to 0) on the range of ``G_B``
  plus the compression of ``G_B̃`` onto ``G_B``'s null space (where eigenvectors are not
  determined by B, so a per-direction diagonal would depend on an arbitrary basis), then
  laplace-torch's ``FullLaplace`` posterior. For the last layer the dense curvature comes from
  features ⊗ output curvature (no per-parameter autograd).

Fit semantics (B/B̃ selection, rescaled loss, bad-input errors, grid-search fix) are those of
:class:`laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`. Backends: any exact GGN
backend (``CurvlinopsGGN``, the default, ``AsdlGGN``, ``BackPackGGN``) or empirical-Fisher
backend (``CurvlinopsEF``, ``AsdlEF``, ``BackPackEF``); the curvature is computed by
:mod:`laplace_debiased.curvature.eigen` from the backend's *type* only, so every such backend
gives the same result (the backend's loss function scales the training loss). Inputs may be
tensors or mappings (a dict or a Hugging Face ``BatchEncoding`` that the model consumes whole,
with laplace-torch's ``dict_key_x``/``dict_key_y``), for all weights and for the last layer;
the weights are the parameters with ``requires_grad`` (e.g. LoRA adapters on a frozen
backbone). Outputs may be ``(n, tokens, C)``, every token an output with its own loss term
(targets ``(n, tokens)`` or ``(n, tokens, C)``; last layer: features ``(n, tokens, D)``), as in
:mod:`laplace_debiased.curvature.eigen`. ``likelihood="reward_modeling"`` fits with the classification curvature (Bradley-Terry
preference pairs) and predicts as regression, as laplace-torch does.

Under an initialised ``torch.distributed`` group (:mod:`laplace_debiased.parallel.distributed`)
every rank computes the dense curvature of its rows of every batch of B (and, for
``debiased_full``, of B̃; for ``debiased_lowrank`` B̃'s directional curvatures), the shares are
added with ``all_reduce``, and rank 0 decomposes (float64) and broadcasts, so every rank holds
the identical posterior. ``debiased_lowrank`` then takes the dense route on the ``P × P`` sum,
or (``method="lanczos"``, or ``"auto"`` above 1 GiB) Lanczos on rank 0 with every product
``G_B v`` summed over the ranks. The computations are those of
:mod:`laplace_debiased.computers.lowrank`, through the reducer of
:func:`~laplace_debiased.parallel.reducer.current_reducer`.
"""

from __future__ import annotations

from typing import Any

import torch
from laplace.baselaplace import FullLaplace, LowRankLaplace
from laplace.curvature.curvature import EFInterface, GGNInterface
from laplace.lllaplace import FullLLLaplace, LLLaplace
from torch import Tensor, nn
from torch.utils.data import DataLoader

from laplace_debiased.curvature import eigen
from laplace_debiased.structures.two_batch import TwoBatchLaplace
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.computers.lowrank import CurvatureSource, debiased_full, debiased_lowrank
from laplace_debiased.parallel.distributed import local_shards
from laplace_debiased.parallel.reducer import Reducer, current_reducer
from laplace_debiased.curvature.linalg import symmetric_eigh64
from laplace_debiased.posterior.eigen import orthonormal_eigenpairs
from laplace_debiased.posterior.lowrank import dense_posterior_scale, lowrank_functional_covariance
from laplace_debiased.posterior.marglik import eigen_functional_covariance
from laplace_debiased.structures.eigen_marglik import EigenMarglikMixin
from laplace_debiased.structures.lazy_curvature import LazyDenseCurvatureMixin, symmetric_outer

__all__ = [
    "DebiasedLowRankLaplace",
    "DebiasedLowRankLLLaplace",
    "DebiasedFullLaplace",
    "DebiasedFullLLLaplace",
]


class _EigenCurvatureMixin:
    """Turns the Laplace object's model and batches into inputs of :mod:`laplace_debiased.curvature.eigen`."""

    def _curvature_type(self) -> eigen.Curvature:
        backend = self.backend
        if isinstance(backend, EFInterface):
            return "ef"
        if isinstance(backend, GGNInterface) and not getattr(backend, "stochastic", False):
            return "ggn"
        raise ValueError(
            f"backend {type(backend).__name__} is not an exact GGN or empirical-Fisher backend; "
            "debiased eigen structures need positive semi-definite curvature. Use the default "
            "CurvlinopsGGN or CurvlinopsEF."
        )

    @property
    def _fit_likelihood(self) -> str:
        """Likelihood of the fit curvature: reward modelling fits as classification."""
        return "classification" if self.likelihood == "reward_modeling" else self.likelihood

    def _curvature_module(self) -> nn.Module:
        if not isinstance(self, LLLaplace):
            return self.model
        if self.likelihood == "reward_modeling":
            return _PairHead(self.model.last_layer)
        return self.model.last_layer

    def _n_samples(self, batches: list[Batch]) -> int:
        return sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in batches)

    def _curvature_source(self) -> CurvatureSource:
        """The curvature module, likelihood, curvature type and output width of this fit."""
        return CurvatureSource(self._curvature_module(), self._fit_likelihood, self._curvature_type(), self.n_outputs)

    def _local_batches(self, batches: list[Batch], reducer: Reducer) -> list[eigen.Batch]:
        """This rank's rows of ``batches`` as inputs of the curvature module (all rows in one process)."""
        shards = local_shards(batches, self.dict_key_x, self.dict_key_y, rank=reducer.rank, world=reducer.world)
        return self._module_batches(shards)

    @torch.no_grad()
    def _module_batches(self, batches: list[Batch]) -> list[eigen.Batch]:
        """``(input of the curvature module, y)`` per batch: features for a last layer
        (``(n, tokens, D)`` for token outputs)."""
        out = []
        for b in batches:
            X, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            if isinstance(self, LLLaplace):
                # features (n, D), or (n, tokens, D) for token outputs (each token an output)
                _, X = self.model.forward_with_features(X)
            out.append((X, y))
        return out


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


class DebiasedLowRankLaplace(_EigenCurvatureMixin, EigenMarglikMixin, TwoBatchLaplace, LowRankLaplace):
    """Two-batch debiased low-rank Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_lowrank")``).

    Parameters (besides those of laplace-torch's ``ParametricLaplace``)
    ----------
    rank : int, default=50
        number ``k`` of top eigenvectors of ``G_B``.
    method : {"auto", "gram", "lanczos"}, default="auto"
        route to the eigenpairs (:func:`laplace_debiased.curvature.eigen.top_eigenpairs`).
    eigval_rtol : float, default=1e-6
        directions with B-eigenvalue ``≤ eigval_rtol · λ_max(G_B)`` are not selected
        (those B does not see; also guards against round-off null-space vectors).
    remeasured_rtol : float, default=1e-8
        directions with ``λ̃ ≤ remeasured_rtol · max λ̃`` (or ``≤ 0``) are removed.

    After ``fit``: ``H = (U (P, r), λ̃ (r,))`` in the model dtype with ``r ≤ rank``;
    ``direction_eigenvalues`` (``(r,)``) are B's own (biased) eigenvalues of the kept directions,
    scaled to ``n_data``, for diagnostics; ``eigen_method`` is the route used.
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
        **kwargs: Any,
    ) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}.")
        if method not in eigen.METHODS:
            raise ValueError(f"method must be one of {eigen.METHODS}, got {method!r}.")
        for name, value in (("eigval_rtol", eigval_rtol), ("remeasured_rtol", remeasured_rtol)):
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}.")
        self.rank, self.method = rank, method
        self.eigval_rtol, self.remeasured_rtol = eigval_rtol, remeasured_rtol
        self.direction_eigenvalues: Tensor | None = None
        self.eigen_method: str | None = None
        # Skip LowRankLaplace.__init__: it insists on the old `asdfghjkl` package, which only
        # its own backend needs; the curvature here comes from laplace_debiased.curvature.eigen.
        super(LowRankLaplace, self).__init__(model, likelihood, **kwargs)

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        *,
        magnitude_loader: DataLoader | None = None,
        n_direction_batches: int | None = None,
        n_magnitude_batches: int | None = None,
        split: str = "batches",
        generator: torch.Generator | None = None,
    ) -> None:
        """Two-batch fit (the arguments of :meth:`TwoBatchLaplaceMixin.fit`); ``override=False``
        is refused because an eigen-representation cannot be updated additively."""
        if not override:
            raise ValueError(
                "debiased_lowrank cannot be updated (override=False): the eigenpairs of a "
                "sum are not the union of eigenpairs. Refit on all data instead."
            )
        super().fit(
            train_loader, override=override, progress_bar=progress_bar, magnitude_loader=magnitude_loader,
            n_direction_batches=n_direction_batches, n_magnitude_batches=n_magnitude_batches, split=split,
            generator=generator,
        )

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> Tensor:
        """B's top eigenvectors and B̃'s Rayleigh quotients (:func:`~laplace_debiased.computers.lowrank.debiased_lowrank`)."""
        reducer = current_reducer()
        same = magnitude_batches is direction_batches
        result = debiased_lowrank(
            self._curvature_source(), self._local_batches(direction_batches, reducer),
            None if same else self._local_batches(magnitude_batches, reducer),
            sizes=(self._n_samples(direction_batches), self._n_samples(magnitude_batches)), n_data=N,
            rank=self.rank, method=self.method, eigval_rtol=self.eigval_rtol, remeasured_rtol=self.remeasured_rtol,
            reducer=reducer,
        )
        self.direction_eigenvalues = result.direction_eigenvalues.to(self._dtype)
        self.eigen_method = result.method
        self.H = (result.vectors.to(self._device, self._dtype), result.eigenvalues.to(self._device, self._dtype))
        return self._summed_loss(self._distinct(direction_batches, magnitude_batches))

    def _decompose_curvature(self) -> tuple[Tensor, Tensor]:
        """``H = (U, λ̃)`` re-orthonormalised in float64 (:func:`orthonormal_eigenpairs`), ``O(P r²)``."""
        return orthonormal_eigenpairs(*self.H)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` ``(n, C, C)`` for ``Js`` ``(n, C, P)``, in float64 without laplace-torch's
        "prior term minus low-rank correction" cancellation
        (:func:`laplace_debiased.posterior.lowrank.lowrank_functional_covariance`)."""
        (U, lam), prior = self.posterior_precision
        return lowrank_functional_covariance(Js, U, lam, prior)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``(n·C, n·C)`` covariance; its diagonal blocks are :meth:`functional_variance`."""
        n, C, P = Js.shape
        return self.functional_variance(Js.reshape(1, n * C, P))[0]

    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state plus the eigen settings as flat entries: tensors, numbers and
        strings only, so ``torch.load(..., weights_only=True)`` reads it."""
        state = super().state_dict()
        state["direction_eigenvalues"] = self.direction_eigenvalues
        state["eigen_method"] = self.eigen_method
        state.update(self._eigen_config())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {key: state_dict.get(key) for key in self._eigen_config()}
        if saved != self._eigen_config():
            raise ValueError(
                f"checkpoint was fitted with {saved} but this object has {self._eigen_config()}; "
                "construct it with the same rank/method/tolerances."
            )
        super().load_state_dict(state_dict)
        self.direction_eigenvalues = state_dict["direction_eigenvalues"]
        self.eigen_method = state_dict["eigen_method"]

    def _eigen_config(self) -> dict[str, int | float | str]:
        """The construction settings that shape ``H``, under their ``state_dict`` keys."""
        return {
            "eigen_rank": self.rank,
            "eigen_requested_method": self.method,
            "eigen_eigval_rtol": self.eigval_rtol,
            "eigen_remeasured_rtol": self.remeasured_rtol,
        }


class DebiasedLowRankLLLaplace(DebiasedLowRankLaplace, LLLaplace):
    """Last-layer two-batch debiased low-rank Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_lowrank")``): :class:`DebiasedLowRankLaplace` on the last
    ``nn.Linear``, fed with its input features (laplace-torch's ``FeatureExtractor``)."""

    _key = ("last_layer", "debiased_lowrank")


class DebiasedFullLaplace(_EigenCurvatureMixin, LazyDenseCurvatureMixin, EigenMarglikMixin, TwoBatchLaplace, FullLaplace):
    """Two-batch debiased full Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_full")``), for small models.

    After ``fit``: ``H = U diag(λ̃) Uᵀ + Π G_B̃ Π`` (dense ``P × P``, model dtype;
    :func:`laplace_debiased.curvature.eigen.eigenbasis_debiased_curvature`) with ``U`` the eigenvectors of
    ``G_B`` with non-zero eigenvalue, ``λ̃ = diag(Uᵀ G_B̃ U)`` and ``Π`` the projector onto ``G_B``'s
    null space (empty when ``|B|·C ≥ P`` up to the null space all batches share, where
    ``G_B̃ = 0`` too; then ``H = U diag(λ̃) Uᵀ`` over a full eigenbasis). The range of ``G_B``
    comes from ``VᵀV`` when ``|B|·C < P``, and when ``|B̃|·C < P`` the null-space part from the
    factor of ``G_B̃`` (:func:`laplace_debiased.curvature.eigen.factored_null_space_compression`),
    so the cost is that of ``min(P, |B|·C)`` and ``|B̃|·C`` eigenproblems plus a few ``P × P``
    products; the resulting eigenpairs of ``H`` are kept (:meth:`curvature_eigenpairs`) for the
    marginal likelihood and the scalar-prior predictive, and where they are known the dense ``H``
    is formed only when read (:class:`~laplace_debiased.structures.lazy_curvature.LazyDenseCurvatureMixin`). ``direction_eigenvalues`` and ``eigenvalues``
    hold B's non-zero eigenvalues and their ``λ̃`` (descending in B's order, scaled to
    ``n_data``). ``override=False`` adds the new debiased ``H`` to the previous one, as
    ``FullLaplace`` adds curvature.
    """

    _key = ("all", "debiased_full")

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> Tensor:
        """Debiased dense curvature and its float64 eigenpairs
        (:func:`~laplace_debiased.computers.lowrank.debiased_full`); over several ranks the dense
        ``H`` (its eigenpairs are then decomposed from ``H`` when first needed)."""
        reducer = current_reducer()
        same = magnitude_batches is direction_batches
        result = debiased_full(
            self._curvature_source(), self._local_batches(direction_batches, reducer),
            None if same else self._local_batches(magnitude_batches, reducer),
            sizes=(self._n_samples(direction_batches), self._n_samples(magnitude_batches)), n_data=N, reducer=reducer,
        )
        self._add_curvature(result.dense, result.eigenpairs)
        self.direction_eigenvalues = result.direction_eigenvalues.to(self._dtype)
        self.eigenvalues = result.eigenvalues.to(self._dtype)
        self._posterior_scale = None
        return self._summed_loss(self._distinct(direction_batches, magnitude_batches))

    def _add_curvature(self, H: Tensor | None, Q_h: tuple[Tensor, Tensor] | None) -> None:
        """Add this fit's curvature, the dense float64 ``H`` or (``H is None``) its eigenpairs
        ``Q_h``, to ``la.H``. A first fit keeps the eigenpairs (re-orthonormalised) and leaves
        ``la.H`` to be formed from them when read; a later one (``override=False``) adds densely."""
        if self.n_data == 0 and Q_h is not None:
            self._set_H_from_eigenpairs(*Q_h)
            self._remember_eigenpairs(*orthonormal_eigenpairs(*Q_h))
            return
        if H is None:
            H = symmetric_outer(*Q_h)
        self.H = self.H + H.to(self._device, self._dtype)

    def _decompose_curvature(self) -> tuple[Tensor, Tensor]:
        """Float64 eigendecomposition of the dense ``H`` (``O(P³)``, once): for fits whose
        eigenpairs are not known from the fit (distributed, ``override=False``, loaded state)."""
        h, Q = symmetric_eigh64(self.H)
        return Q, h.clamp_min(0.0)

    def _compute_scale(self) -> None:
        """Posterior scale from a float64 eigendecomposition (laplace-torch's Cholesky fails or
        turns non-finite in float32 at small prior precision); the float64 scale is kept for
        :meth:`functional_variance` (:func:`laplace_debiased.posterior.lowrank.dense_posterior_scale`)."""
        self._check_H_init()
        self._posterior_scale64 = dense_posterior_scale(self.H, self._H_factor, self.prior_precision_diag)
        self._posterior_scale = self._posterior_scale64.to(self._dtype)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J P⁻¹ Jᵀ`` ``(n, C, C)`` in ``Js.dtype``, float64 inside. A scalar prior ``δ`` shares
        the curvature's eigenbasis (:func:`~laplace_debiased.posterior.marglik.eigen_functional_covariance`,
        no factorisation per ``δ``); another prior uses the float64 scale ``S Sᵀ = P⁻¹``."""
        prior = self._prior_for_log_det()
        if prior.numel() == 1:
            Q, h = self.curvature_eigenpairs()
            return eigen_functional_covariance(Js, Q, float(self._H_factor) * h, prior[0].detach())
        if self._posterior_scale is None:
            self._compute_scale()
        JS = Js.double() @ self._posterior_scale64
        return (JS @ JS.transpose(-1, -2)).to(Js.dtype)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """Joint ``(n·C, n·C)`` covariance; its diagonal blocks are :meth:`functional_variance`."""
        n, C, P = Js.shape
        return self.functional_variance(Js.reshape(1, n * C, P))[0]

    def _reset_fit_state(self) -> None:
        super()._reset_fit_state()
        self.direction_eigenvalues: Tensor | None = None
        self.eigenvalues: Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["direction_eigenvalues"] = self.direction_eigenvalues
        state["eigenvalues"] = self.eigenvalues
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.direction_eigenvalues = state_dict["direction_eigenvalues"]
        self.eigenvalues = state_dict["eigenvalues"]
        self._posterior_scale = None


class DebiasedFullLLLaplace(DebiasedFullLaplace, FullLLLaplace):
    """Last-layer two-batch debiased full Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_full")``); the dense last-layer curvature is built from
    features ⊗ output curvature, fast for a last layer of a few thousand weights."""

    _key = ("last_layer", "debiased_full")

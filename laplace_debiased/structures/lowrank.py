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
``G_B v`` summed over the ranks.
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
from laplace_debiased.parallel.distributed import (
    all_reduce_sum_,
    broadcast_computed,
    is_distributed,
    local_shards,
    rank_world,
    run_with_reduced_operator,
)
from laplace_debiased.curvature.linalg import remeasure_eigenvalues
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

    def _summed_over_ranks(self, fn: Any, module: nn.Module, batches: list[Batch]) -> Tensor:
        """``fn(module, this rank's shards of batches)`` (a float64 sum over samples, such as
        :func:`~laplace_debiased.curvature.eigen.dense_curvature`) added over the ranks with
        one ``all_reduce``: the value of ``fn`` on all of ``batches``, on every rank. Without
        a process group: ``fn(module, batches)``."""
        rank, world = rank_world()
        shards = local_shards(batches, self.dict_key_x, self.dict_key_y, rank=rank, world=world)
        total = fn(module, self._module_batches(shards))
        all_reduce_sum_([total])
        return total

    def _dense_curvature(self, module: nn.Module, batches: list[Batch], curvature: eigen.Curvature) -> Tensor:
        """Dense ``G`` (float64 ``P × P``, summed loss, not rescaled) of ``batches``; under a
        process group each rank computes its rows' share and the shares are all-reduced."""
        return self._summed_over_ranks(
            lambda m, data: eigen.dense_curvature(m, data, self._fit_likelihood, curvature), module, batches
        )

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
        curvature = self._curvature_type()
        module = self._curvature_module()
        pairs = self._direction_pairs(module, direction_batches, curvature)
        scale_B = N / self._n_samples(direction_batches)
        if magnitude_batches is direction_batches:  # B̃ = B: plain low-rank Laplace on B
            remeasured = pairs.values * scale_B
        else:
            remeasured = self._summed_over_ranks(
                lambda m, data: eigen.directional_curvatures(
                    m, data, pairs.vectors, self._fit_likelihood, curvature
                ),
                module,
                magnitude_batches,
            ) * (N / self._n_samples(magnitude_batches))
        keep = eigen.above_relative_floor(remeasured, self.remeasured_rtol)
        self.direction_eigenvalues = (pairs.values[keep] * scale_B).to(self._dtype)
        self.eigen_method = pairs.method
        self.H = (
            pairs.vectors[:, keep].to(self._device, self._dtype),
            remeasured[keep].to(self._device, self._dtype),
        )
        return self._summed_loss(self._distinct(direction_batches, magnitude_batches))

    def _direction_pairs(self, module: nn.Module, batches: list[Batch], curvature: eigen.Curvature) -> eigen.EigenPairs:
        """Top-``rank`` eigenpairs of ``G_B`` (not rescaled). Under a process group either the
        dense route on the all-reduced ``G_B``, decomposed on rank 0 and broadcast, or
        (``method="lanczos"``, or ``"auto"`` when the dense ``G_B`` would exceed 1 GiB) Lanczos
        on rank 0 with every product ``G_B v`` summed over the ranks' rows."""
        if not is_distributed():
            return eigen.top_eigenpairs(
                module, self._module_batches(batches), self._fit_likelihood, self.rank, curvature,
                self.method, self.eigval_rtol,
            )
        n_params = eigen.parameter_count(module)
        dense_fits = 8 * n_params**2 <= _MAX_DISTRIBUTED_DENSE_BYTES
        if self.method == "lanczos" or (self.method == "auto" and not dense_fits):
            return self._distributed_lanczos_pairs(module, batches, curvature, n_params)
        if not dense_fits:
            raise ValueError(
                f"a distributed debiased_lowrank fit with method='gram' all-reduces the dense "
                f"{n_params} x {n_params} curvature of B, over 1 GiB here; use method='lanczos' "
                "(or 'auto')."
            )
        G_B = self._dense_curvature(module, batches, curvature)
        values, vectors = broadcast_computed(
            lambda: _pair_tensors(eigen.dense_top_eigenpairs(G_B, self.rank, self.eigval_rtol)), self._device
        )
        return eigen.EigenPairs(values, vectors, "dense")

    def _distributed_lanczos_pairs(
        self, module: nn.Module, batches: list[Batch], curvature: eigen.Curvature, n_params: int
    ) -> eigen.EigenPairs:
        """Lanczos (:func:`~laplace_debiased.curvature.eigen.lanczos_top_k`) on rank 0 over
        ``v ↦ G_B v``, each product summed over the ranks' rows
        (:func:`~laplace_debiased.parallel.distributed.run_with_reduced_operator`); the
        eigenpairs are broadcast."""
        rank, world = rank_world()
        product = eigen.summed_curvature_product(
            module, self._module_batches(local_shards(batches, self.dict_key_x, self.dict_key_y, rank=rank, world=world)),
            self._fit_likelihood, curvature, self.n_outputs,
        )
        first = next(iter(eigen.trainable_parameters(module).values()))
        k = min(self.rank, n_params)

        def lanczos(operator: Any) -> tuple[Tensor, Tensor]:
            pairs = eigen.lanczos_top_k(operator, n_params, k, dtype=first.dtype, device=first.device)
            return _pair_tensors(eigen.threshold_eigenpairs(pairs, self.eigval_rtol))

        values, vectors = run_with_reduced_operator(product, lanczos, n_params, first.dtype, first.device)
        return eigen.EigenPairs(values, vectors, "lanczos")

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


_MAX_DISTRIBUTED_DENSE_BYTES = 2**30
"""Largest dense float64 ``G_B`` a distributed ``debiased_lowrank`` fit all-reduces."""


def _pair_tensors(pairs: eigen.EigenPairs) -> tuple[Tensor, Tensor]:
    return pairs.values, pairs.vectors


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
        """Debiased dense curvature (:func:`_debiased_full`) and its float64 eigenpairs. Under a
        process group every rank computes the dense curvature of its rows of B and B̃, the shares
        are all-reduced, and rank 0 decomposes and broadcasts the result (the eigenpairs are then
        decomposed from ``H`` when first needed)."""
        curvature = self._curvature_type()
        module = self._curvature_module()
        scale_B = N / self._n_samples(direction_batches)
        scale_mag = N / self._n_samples(magnitude_batches)
        if is_distributed():
            G_mag = None
            if magnitude_batches is not direction_batches:  # B̃ = B: H = G_B (FullLaplace on B)
                G_mag = self._dense_curvature(module, magnitude_batches, curvature) * scale_mag
            G_B = self._dense_curvature(module, direction_batches, curvature)
            values, lam, H = broadcast_computed(
                lambda: _dense_debiased_full(eigen.dense_range_eigenpairs(G_B), G_mag, scale_B), self._device
            )
            self.H = self.H + H.to(self._device, self._dtype)
        else:
            pairs = eigen.range_eigenpairs(
                module, self._module_batches(direction_batches), self._fit_likelihood, curvature
            )
            G_mag = self._magnitude_curvature(module, direction_batches, magnitude_batches, curvature, scale_mag)
            values, lam, H, Q_h = _debiased_full(pairs, G_mag, scale_B)
            self._add_curvature(H, Q_h)
        self.direction_eigenvalues = values.to(self._dtype)
        self.eigenvalues = lam.to(self._dtype)
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

    def _magnitude_curvature(
        self, module: nn.Module, direction_batches: list[Batch], magnitude_batches: list[Batch],
        curvature: eigen.Curvature, scale: float,
    ) -> Tensor | None:
        """``G_B̃`` times ``scale``: ``None`` for B̃ = B, the factor ``√scale · V`` (``P × M``,
        ``G_B̃ = V Vᵀ``) when ``M < P``, else the dense ``P × P`` matrix."""
        if magnitude_batches is direction_batches:
            return None
        batches = self._module_batches(magnitude_batches)
        if eigen.factor_columns(module, batches, curvature) < eigen.parameter_count(module):
            V = eigen.curvature_factor(module, batches, self._fit_likelihood, curvature)
            return V.double() * scale**0.5
        return self._dense_curvature(module, magnitude_batches, curvature) * scale

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


def _debiased_full(
    pairs: eigen.EigenPairs, G_magnitude: Tensor | None, scale_B: float
) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
    """B's range eigenvalues ``(r,)``, their re-measured ``λ̃`` ``(r,)``, and the debiased
    curvature (:func:`~laplace_debiased.curvature.eigen.eigenbasis_debiased_curvature`), all
    float64: either as eigenpairs ``([U, N] (P, r'), [λ̃, μ] (r',))`` (not yet
    re-orthonormalised; the dense matrix is then ``None``) or, where the route does not give
    them, as the symmetric dense ``(P, P)`` matrix (the eigenpairs are then ``None``). ``pairs``
    (range of ``G_B``) are scaled by ``scale_B``; ``G_magnitude`` is ``G_B̃`` already scaled:
    ``None`` for B̃ = B (``H = G_B``), a factor ``(P, M)`` with ``M < P`` (``G_B̃ = V Vᵀ``;
    :func:`~laplace_debiased.curvature.eigen.factored_null_space_compression`), or the dense
    ``(P, P)`` matrix."""
    U = pairs.vectors.double()
    values = pairs.values.double() * scale_B
    if G_magnitude is None:
        return values, values, None, (U, values)
    G = G_magnitude.double()
    if G.shape[0] != G.shape[1]:  # a factor: H = U diag(λ̃) Uᵀ + N diag(μ) Nᵀ
        lam, null = eigen.factored_null_space_compression(U, G)
        return values, lam, None, (torch.cat([U, null.vectors], dim=1), torch.cat([lam, null.values]))
    lam = remeasure_eigenvalues(U, G).double()
    H = eigen.eigenbasis_debiased_curvature(U, lam, G)
    return values, lam, 0.5 * (H + H.T), None


def _dense_debiased_full(
    pairs: eigen.EigenPairs, G_magnitude: Tensor | None, scale_B: float
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_debiased_full` with the curvature always as the dense ``(P, P)`` matrix."""
    values, lam, H, Q_h = _debiased_full(pairs, G_magnitude, scale_B)
    return values, lam, symmetric_outer(*Q_h) if H is None else H


class DebiasedFullLLLaplace(DebiasedFullLaplace, FullLLLaplace):
    """Last-layer two-batch debiased full Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_full")``); the dense last-layer curvature is built from
    features ⊗ output curvature, fast for a last layer of a few thousand weights."""

    _key = ("last_layer", "debiased_full")

"""The adapter base of all two-batch (debiased) Laplace classes: the shared ``fit`` and the
laplace-torch overrides every structure shares.

A class using :class:`TwoBatchLaplace` lists it *before* its laplace-torch base
(``class X(TwoBatchLaplace, KronLaplace)``) and implements the hook

``_fit_two_batch(direction_batches, magnitude_batches, N) -> Tensor``

which computes the curvature of the direction batches B and the magnitude batches B̃,
each scaled to ``N`` data points exactly like a laplace-torch fit over a loader of ``N``
samples (summed loss; see :mod:`laplace_debiased.computers.batches` for how B and B̃ are chosen),
sets ``self.H`` and returns the summed loss over the distinct batches of B ∪ B̃
(:meth:`_distinct`), unscaled: backends that evaluate it with the curvature return theirs,
the others call :meth:`_summed_loss`, so no batch is forwarded twice for the loss.  When the hook runs, ``self.n_data`` still holds the number of data
points of earlier fits (0 unless ``override=False``), so online fits can combine them.
Subclasses that keep extra state per fit extend :meth:`_reset_fit_state`.

After ``fit``: ``self.mean`` (MAP parameters), ``self.n_outputs``, ``self.fit_batches``
(which batches formed B and B̃, and how they were chosen), ``self.n_data += N`` and
``self.loss += N / n_used * (summed loss over the n_used distinct samples of B ∪ B̃)``, an
unbiased estimate of the summed training loss, so that ``log_likelihood``,
``log_marginal_likelihood`` and marglik prior tuning are on the full-data scale.

The overrides are thin: each calls the plain functions of a sibling module, the input checks
of :mod:`.fit_checks`, ``n_magnitude_batches="auto"`` of :mod:`.auto_magnitude`, the predictive
over chunks of the inputs of :mod:`.chunked`, the GLM predictive of token outputs and per-example
Jacobians of :mod:`.token_outputs`, the mixture samples of a cross-fitted ``H`` of
:mod:`.cross_fit`, the grid search of :mod:`.gridsearch` and the per-block layerwise marglik of
:mod:`.block_priors`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torchmetrics
from laplace.lllaplace import LLLaplace
from laplace.utils.enums import LinkApprox, PredType, PriorStructure, TuningMethod
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader

from laplace_debiased.computers.batches import BatchChoice, BatchSplit, check_targets, split_batches
from laplace_debiased.curvature.kfac import output_rows, padded_rows
from laplace_debiased.curvature.layer_blocks import curvature_modules
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.parallel.distributed import check_same_fit_inputs, fail_together, local_shards
from laplace_debiased.parallel.reducer import Reducer, current_reducer
from laplace_debiased.posterior.from_laplace import curvature_kind, laplace_params, posterior_structure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import closed_form, logit_rows
from laplace_debiased.posterior.links import normal_samples
from laplace_debiased.structures.auto_magnitude import auto_magnitude_rule, sample_output_shape
from laplace_debiased.structures.block_priors import block_marglik, prior_spans
from laplace_debiased.structures.chunked import Output, checked_chunk_size, chunked
from laplace_debiased.structures.cross_fit import CrossFitDecomposed, mixture_samples
from laplace_debiased.structures.fit_checks import (
    check_batch_dtypes,
    check_model_mode,
    check_outputs_are_logits,
    check_override,
    check_padded_targets_supported,
    check_trainable,
)
from laplace_debiased.structures.gridsearch import grid_search, regression_grid_loss
from laplace_debiased.structures.kron_layers import single_pass_fisher
from laplace_debiased.structures.token_outputs import (
    per_example_jacobians,
    token_jacobians,
    token_regression_normaliser,
    token_shaped,
)

if TYPE_CHECKING:
    from laplace_debiased.computers.auto_magnitude import AutoMagnitude

__all__ = ["TwoBatchLaplace", "distinct_batches", "map_estimate", "summed_loss"]

logger = logging.getLogger(__name__)



def distinct_batches(direction_batches: list[Batch], magnitude_batches: list[Batch]) -> list[Batch]:
    """The batches of B ∪ B̃, each once.

    Args:
        direction_batches: The batches of B.
        magnitude_batches: The batches of B̃ (the same list object for B̃ = B).

    Returns:
        B's batches, then B̃'s unless B̃ is B.
    """
    if magnitude_batches is direction_batches:
        return list(direction_batches)
    return [*direction_batches, *magnitude_batches]


def map_estimate(params: Iterable[torch.Tensor], enable_backprop: bool) -> torch.Tensor:
    """The parameters being approximated as one vector (the posterior mean).

    Args:
        params: The parameter tensors of the approximation, in order.
        enable_backprop: laplace-torch's ``enable_backprop`` (``False``: detached).

    Returns:
        The vector ``(P,)``.

    Raises:
        ValueError: A parameter is NaN or Inf.
    """
    mean = parameters_to_vector(params)
    if not enable_backprop:
        mean = mean.detach()
    if not torch.isfinite(mean).all():
        raise ValueError("the model parameters (the MAP estimate) contain NaN or Inf.")
    return mean


@torch.no_grad()
def summed_loss(
    model: nn.Module, backend: Any, batches: list[Batch], *, dict_key_x: str, dict_key_y: str, reducer: Reducer,
    device: torch.device, dtype: torch.dtype,
) -> torch.Tensor:
    """laplace-torch's loss ``sum over batches of factor * lossfunc(model(X), y)``.

    Each token is its own loss term for outputs ``(n, tokens, C)`` (:func:`output_rows`).  Under a
    process group each rank forwards its rows only and the sums are added by ``reducer``.

    Args:
        model: The network.
        backend: laplace-torch's curvature backend (its ``lossfunc`` and ``factor``).
        batches: Loader batches.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.
        reducer: Sums over the ranks (:func:`~laplace_debiased.parallel.reducer.current_reducer`).
        device: Device of the result.
        dtype: dtype of the result.

    Returns:
        The summed loss, a scalar, the same on every rank.
    """
    total = torch.zeros((), device=device, dtype=dtype)
    for b in local_shards(batches, dict_key_x, dict_key_y, rank=reducer.rank, world=reducer.world):
        X, y = batch_inputs_targets(b, dict_key_x, dict_key_y)
        total = total + backend.factor * backend.lossfunc(*output_rows(model(X), y))
    reducer.sum_([total])
    return total


def has_padded_targets(
    batches: list[Batch], output_shape: tuple[int, ...], likelihood: str, dict_key_x: str, dict_key_y: str
) -> bool:
    """Check every batch's targets against the output shape and tell whether any is padded.

    Args:
        batches: Loader batches.
        output_shape: The per-sample output shape ``([tokens, ...,] C)``.
        likelihood: laplace-torch's likelihood.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        Whether any target row is padded (-100).

    Raises:
        ValueError: Targets that do not fit ``output_shape``
            (:func:`~laplace_debiased.computers.batches.check_targets`).
    """
    padded = False
    for i, b in enumerate(batches):
        _, y = batch_inputs_targets(b, dict_key_x, dict_key_y)
        check_targets(y, output_shape, likelihood, f"fit batch {i}")
        padded = padded or bool(padded_rows(y).any())
    return padded


class TwoBatchLaplace:
    """The adapter base of laplace-torch ``ParametricLaplace`` subclasses: the two-batch ``fit``
    (B picks directions, B̃ measures magnitudes), the predictive over chunks of inputs and token
    outputs, and the prior-precision tuning (module docstring).

    Structures whose curvature is laplace-torch's K-FAC blocks (``debiased_kron``,
    ``debiased_ekfac``) set ``_kfac_blocks``; it turns on ``n_magnitude_batches="auto"``
    (:mod:`.auto_magnitude`), the shared K-FAC pass's check of padded targets and per-block
    layerwise priors (:mod:`.block_priors`).

    Attributes:
        predictive_chunk_size: Inputs per chunk of the predictive; ``None`` (default) picks
            :func:`~laplace_debiased.structures.chunked.auto_chunk_size` from the fit.
    """

    predictive_chunk_size: int | None = None
    _kfac_blocks: bool = False

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        *,
        magnitude_loader: DataLoader | None = None,
        n_direction_batches: int | None = None,
        n_magnitude_batches: int | Literal["auto"] | None = None,
        split: str = "batches",
        generator: torch.Generator | None = None,
    ) -> None:
        """Fit the debiased Laplace approximation at the current (MAP) parameters.

        Under a ``torch.distributed`` group (collective: every rank calls ``fit``) the ranks
        refuse to fit if their models or selected B and B̃ differ
        (:func:`~laplace_debiased.parallel.distributed.check_same_fit_inputs`); an error on one
        rank ends the fit on every rank (:func:`~laplace_debiased.parallel.distributed.fail_together`).

        Args:
            train_loader: Training data; ``N = len(train_loader.dataset)``. B = its first
                ``n_direction_batches`` batches, B̃ = the next ``n_magnitude_batches`` (a random draw
                with a shuffling loader); a one-batch loader is split into two disjoint halves by a
                seeded permutation. The choice is logged (INFO, logger ``laplace_debiased``) and
                recorded in ``self.fit_batches``, one
                :class:`~laplace_debiased.computers.batches.BatchChoice` per fit since the last
                ``override=True``.
            override: ``False`` accumulates onto a previous fit (online: both batch sets
                combined, debiased again).
            progress_bar: Unused (laplace-torch compatibility; few batches are touched).
            magnitude_loader: Take B̃ from this loader; ``magnitude_loader=train_loader`` selects
                B̃ = B, which reduces every debiased structure to its plain single-batch version.
            n_direction_batches: Loader batches in B (default 1).
            n_magnitude_batches: Loader batches in B̃ (default 1). ``"auto"`` (debiased_kron/ekfac
                over all weights): B̃ gets the smallest ``k >= 1`` batches with
                ``R_f + k · R_f / |B| >= d_f`` for every K-FAC factor ``f`` of dimension ``d_f``
                wider than the rows ``R_f`` B gives it (more after a short batch), at most
                ``AUTO_MAGNITUDE_CAP = 8``; ``k``, why, and any factor B ∪ B̃ still misses (a
                warning) are in ``fit_batches[-1].auto``
                (:mod:`~laplace_debiased.computers.auto_magnitude`).
            split: ``"batches"`` (default), or ``"halves"``: all batches, first half B, second
                half B̃ ("debiased full-batch").
            generator: Draw the batches at random; one seed, one B and B̃, with a shuffling
                loader too.

        Raises:
            ValueError: Inputs the fit would get silently wrong (:mod:`.fit_checks`).
        """
        del progress_bar
        with fail_together(f"{type(self).__name__}.fit"):
            check_override(isinstance(self, LLLaplace), override)
            check_model_mode(self.model)
            batches = split_batches(
                train_loader, n_direction_batches=n_direction_batches, n_magnitude_batches=n_magnitude_batches,
                magnitude_loader=magnitude_loader, split=split, generator=generator,
                magnitude_rule=self._magnitude_rule(n_magnitude_batches),
                dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y, device=self._device,
            )
            self._fit_split(batches, override)

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> torch.Tensor:
        """The structure's hook (module docstring): set ``self.H``, return the summed loss of B ∪ B̃."""
        raise NotImplementedError

    def _magnitude_rule(self, n_magnitude_batches: object) -> Callable[[list[Batch]], AutoMagnitude] | None:
        """``None`` unless ``n_magnitude_batches="auto"``, then
        :func:`~laplace_debiased.structures.auto_magnitude.auto_magnitude_rule` (K-FAC blocks only);
        another string raises."""
        if not isinstance(n_magnitude_batches, str):
            return None
        if n_magnitude_batches != "auto":
            raise ValueError(f"n_magnitude_batches must be a positive integer or 'auto', got {n_magnitude_batches!r}.")
        if not self._kfac_blocks:
            raise ValueError(
                f"n_magnitude_batches='auto' counts the rows B gives each K-FAC factor, and {type(self).__name__} "
                "has no K-FAC factors. Pass an integer n_magnitude_batches (default 1), or use "
                "hessian_structure='debiased_kron' or 'debiased_ekfac' with subset_of_weights='all'."
            )
        return auto_magnitude_rule(
            self.model, lambda: self.backend, last_layer=isinstance(self, LLLaplace), owner=type(self).__name__,
            likelihood=self.likelihood, dtype=self._dtype, asdl_fisher_kwargs=self._asdl_fisher_kwargs,
            dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y,
        )

    def _single_pass_fisher(self) -> str | None:
        """:func:`~laplace_debiased.structures.kron_layers.single_pass_fisher` of the backend (K-FAC
        blocks only; ``None`` otherwise)."""
        return single_pass_fisher(self.backend, self._asdl_fisher_kwargs) if self._kfac_blocks else None

    def _fit_split(self, batches: BatchSplit, override: bool) -> None:
        """:meth:`fit` on the selected B and B̃: the inputs checked, the curvature fitted, and this
        fit's loss (rescaled to ``N``), ``N`` and batch choice added to the totals."""
        check_same_fit_inputs(self.model, batches.direction, batches.magnitude)
        logger.info("%s fit: %s", type(self).__name__, batches.choice.describe())
        if batches.choice.auto is not None and batches.choice.auto.short is not None:
            logger.warning("%s fit: %s", type(self).__name__, batches.choice.auto.describe())
        used = self._distinct(batches.direction, batches.magnitude)
        self._prepare_fit(batches.direction[0], used, override)
        last_layer = isinstance(self, LLLaplace)
        self.mean = map_estimate(self.model.last_layer.parameters() if last_layer else self.params, self.enable_backprop)
        loss = self._fit_two_batch(batches.direction, batches.magnitude, batches.n_data)
        if not torch.isfinite(loss):
            raise ValueError("the training loss on the fit batches is NaN or Inf.")
        n_used = sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in used)
        self.loss = self.loss + batches.n_data / n_used * loss
        self.n_data += batches.n_data
        self.fit_batches = (*getattr(self, "fit_batches", ()), batches.choice)

    def _prepare_fit(self, first: Batch, used: list[Batch], override: bool) -> None:
        """The checks before a fit (:mod:`.fit_checks`), eval mode, the last layer (last-layer
        classes, first fit), earlier fits forgotten when ``override``, and the output shape."""
        keys = (self.dict_key_x, self.dict_key_y)
        last_layer = isinstance(self, LLLaplace)
        check_batch_dtypes(used, self._dtype, self.likelihood, *keys)
        self.model.eval()
        X, _ = batch_inputs_targets(first, *keys)
        check_outputs_are_logits(self.model.model if last_layer else self.model, X, self.likelihood)
        if last_layer and self.model.last_layer is None:
            self._setup_last_layer(first)
        check_trainable(self.model.last_layer.parameters() if last_layer else self.model.parameters(), last_layer)
        if override:
            self._reset_fit_state()
        self.fit_output_shape = sample_output_shape(self.model, first, *keys)
        if has_padded_targets(used, self.fit_output_shape, self.likelihood, *keys) and self._kfac_blocks:
            check_padded_targets_supported(self._single_pass_fisher(), self.backend, self._asdl_fisher_kwargs)
        self.n_outputs = self.fit_output_shape[-1] if self.fit_output_shape else 1
        setattr(self.model, "output_size", self.n_outputs)

    @staticmethod
    def _distinct(direction_batches: list[Batch], magnitude_batches: list[Batch]) -> list[Batch]:
        """:func:`distinct_batches`."""
        return distinct_batches(direction_batches, magnitude_batches)

    def _summed_loss(self, batches: list[Batch]) -> torch.Tensor:
        """:func:`summed_loss` of ``batches`` under the current reducer."""
        return summed_loss(
            self.model, self.backend, batches, dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y,
            reducer=current_reducer(), device=self._device, dtype=self._dtype,
        )

    def _reset_fit_state(self) -> None:
        """Forget earlier fits (``override=True``); structures with more state per fit extend this."""
        self._init_H()
        self.loss = 0.0
        self.n_data = 0
        self.fit_batches: tuple[BatchChoice, ...] = ()
        self._factored_cache = None

    @torch.no_grad()
    def _setup_last_layer(self, batch: Batch) -> None:
        """Find the last layer on the first batch, as ``LLLaplace.fit`` does."""
        self.data = batch
        self._find_last_layer(batch)
        self.n_params = sum(p.numel() for p in self.model.last_layer.parameters())
        self.n_layers = len(list(self.model.last_layer.parameters()))
        self.prior_precision = self._prior_precision
        self.prior_mean = self._prior_mean
        self._init_H()

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> torch.Tensor:
        """Posterior samples ``(n_samples, n_params)``; a cross-fitted ``H``
        (:class:`~laplace_debiased.structures.cross_fit.CrossFitDecomposed`): exact mixture samples."""
        if not isinstance(self.H, CrossFitDecomposed):
            return super().sample(n_samples, generator)
        return mixture_samples(
            self.posterior_precision, self.mean, n_samples, generator, device=self._device, dtype=self._dtype
        )

    # ------------------------------------------------------------------ predictive
    def __call__(
        self,
        x: Any,
        pred_type: PredType | str = PredType.GLM,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: Any,
    ) -> Output:
        """laplace-torch's ``la(x, ...)`` (same arguments), over chunks of ``x``
        (:mod:`.chunked`); the joint predictive (``joint=True``) in one piece."""

        def predict(chunk: Any) -> Output:
            return super(TwoBatchLaplace, self).__call__(
                chunk, pred_type, joint, link_approx, n_samples, diagonal_output, generator, fitting, **model_kwargs
            )

        return predict(x) if joint else self._chunked(predict, x, generator, dim=0)

    def predictive_samples(
        self,
        x: Any,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``predictive_samples`` ``(S, n, ...)``, over chunks of ``x``."""
        parent = super().predictive_samples
        return self._chunked(lambda c: parent(c, pred_type, n_samples, diagonal_output, generator), x, generator, dim=1)

    def functional_samples(
        self,
        x: Any,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``functional_samples`` ``(S, n, ...)``, over chunks of ``x``."""
        parent = super().functional_samples
        return self._chunked(lambda c: parent(c, pred_type, n_samples, diagonal_output, generator), x, generator, dim=1)

    def chunk_size(self) -> int:
        """Inputs per chunk: ``predictive_chunk_size``, or
        :func:`~laplace_debiased.structures.chunked.auto_chunk_size` where it is ``None`` (of the
        Jacobian entries the predictive holds, :meth:`_jacobian_entries`)."""
        outputs = math.prod(getattr(self, "fit_output_shape", (self.n_outputs or 1,)))
        return checked_chunk_size(self.predictive_chunk_size, outputs, self._jacobian_entries(), self._dtype)

    def _chunked(self, predict: Callable[[Any], Output], x: Any, generator: torch.Generator | None, dim: int) -> Output:
        """:func:`~laplace_debiased.structures.chunked.chunked` at :meth:`chunk_size`."""
        return chunked(
            predict, x, self.chunk_size(), dict_key_x=self.dict_key_x, generator=generator, device=self._device, dim=dim
        )

    def _has_token_outputs(self) -> bool:
        return len(getattr(self, "fit_output_shape", ())) > 1

    @property
    def log_likelihood(self) -> torch.Tensor:
        """laplace-torch's log likelihood; for token outputs in regression its Gaussian normaliser
        counts all ``n_data · tokens · C`` outputs
        (:func:`~laplace_debiased.structures.token_outputs.token_regression_normaliser`)."""
        ll = super().log_likelihood
        if self.likelihood == "regression" and self._has_token_outputs():
            sigma = torch.as_tensor(self.sigma_noise, device=self._device, dtype=self._dtype)
            ll = ll + token_regression_normaliser(
                math.prod(self.fit_output_shape[:-1]), self.n_data, self.n_outputs, sigma
            )
        return ll

    @torch.enable_grad()
    def _glm_predictive_distribution(
        self, X: Any, joint: bool = False, diagonal_output: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """laplace-torch's GLM predictive ``(f, J P⁻¹ Jᵀ)``: for a K-FAC-type curvature in its
        eigenbasis from factored per-layer Jacobians (:meth:`_factored_predictive`, float64 inside);
        else from per-example Jacobians for a tensor input over all weights without
        ``enable_backprop``; for token outputs over the token rows: ``f`` ``(n·tokens, C)``,
        covariance ``(n·tokens, C, C)`` (``joint``: flat mean and ``(n·tokens·C)²`` covariance, from
        the Jacobians; ``diagonal_output``: ``(n·tokens, C)``)."""
        self._glm_token_shape = None
        last_layer = isinstance(self, LLLaplace)
        factored = None if joint else self._factored_predictive(X)
        if factored is not None:
            f, f_var = factored.covariance(X, self.prior_precision.detach())
            if self._has_token_outputs():
                self._glm_token_shape = tuple(f.shape[:-1])
            f_mu, f_var = logit_rows(f).detach(), f_var.to(f.dtype)
            return f_mu, torch.diagonal(f_var, dim1=-2, dim2=-1) if diagonal_output else f_var
        if self._has_token_outputs():
            Js, f_mu, self._glm_token_shape = token_jacobians(
                self.model, self.backend, X, last_layer=last_layer, enable_backprop=self.enable_backprop
            )
        elif isinstance(X, torch.Tensor) and not last_layer and not self.enable_backprop:
            Js, f_mu = per_example_jacobians(self.model, self.params, X)
        else:
            return super()._glm_predictive_distribution(X, joint, diagonal_output)
        if joint:
            f_mu, f_var = f_mu.flatten(), self.functional_covariance(Js)
        else:
            f_var = self.functional_variance(Js)
            if diagonal_output:
                f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        if not self.enable_backprop:
            f_mu, f_var = f_mu.detach(), f_var.detach()
        return f_mu, f_var

    def _factored_predictive(self, X: Any) -> GridPredictive | None:
        """The GLM covariance in the curvature's eigenbasis
        (:meth:`~laplace_debiased.posterior.grid.GridPredictive.covariance`: a ``Linear`` layer's
        Jacobian kept as ``g ⊗ a``, a convolution's as a sum over positions, no ``(n, C, P)``
        Jacobian), for a K-FAC-type curvature over all weights, a tensor input, a prior precision
        per network or per parameter tensor and no ``enable_backprop``; ``None`` elsewhere. Built
        once per curvature and likelihood factor."""
        if not isinstance(X, torch.Tensor) or not self._factored_applies():
            return None
        s = float(self._H_factor)
        cached = getattr(self, "_factored_cache", None)
        if cached is None or cached[0] is not self.H or cached[1] != s:
            structure = posterior_structure(self)
            self._factored_cache = (self.H, s, GridPredictive.from_parts(self.model, laplace_params(self), structure))
        return self._factored_cache[2]

    def _factored_applies(self) -> bool:
        """Whether :meth:`_factored_predictive` serves tensor inputs (its conditions but the input's)."""
        if not self._kfac_blocks or self.enable_backprop or isinstance(self, LLLaplace):
            return False  # (the dense structures' curvature is not read: it may be formed lazily)
        return curvature_kind(self) in ("own", "kron") and self.prior_precision.numel() in (1, self.n_layers)

    def _jacobian_entries(self) -> int:
        """Jacobian entries per output that the GLM predictive holds for one input: on the factored
        route (:meth:`_factored_predictive`, closed-form Jacobians, no token outputs) ``d_out + d_in``
        for a ``Linear`` weight (``g ⊗ a``), else every parameter."""
        params = laplace_params(self)
        if self._has_token_outputs() or not self._factored_applies() or not closed_form(self.model, params):
            return self.n_params
        return sum(p.shape[0] + p.shape[1] if p.ndim == 2 else p.numel() for p in params)

    def _glm_functional_samples(
        self,
        f_mu: torch.Tensor,
        f_var: torch.Tensor,
        n_samples: int,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's GLM functional samples (``link_approx="mc"``) from a float64 square root
        of ``f_var`` (:func:`~laplace_debiased.posterior.links.normal_samples`; laplace-torch's
        float32 Cholesky fails at small prior precision). Token outputs: ``(S, n, tokens, C)``."""
        if diagonal_output:
            f_var = torch.diagonal(f_var, dim1=1, dim2=2)
        samples = normal_samples(f_mu, f_var, n_samples, generator)
        return token_shaped(samples, getattr(self, "_glm_token_shape", None), leading=1)

    def _glm_forward_call(
        self,
        x: Any,
        likelihood: str,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """laplace-torch's GLM ``la(x)``; token outputs come back as ``(n, tokens, C)``
        (regression: ``(n, tokens, C)`` and ``(n, tokens, C[, C])``; ``joint`` stays flat)."""
        out = super()._glm_forward_call(x, likelihood, joint, link_approx, n_samples, diagonal_output)
        if joint and likelihood == "regression":
            return out
        shape = getattr(self, "_glm_token_shape", None)
        if isinstance(out, tuple):
            return tuple(token_shaped(t, shape) for t in out)
        return token_shaped(out, shape)

    # ------------------------------------------------------------------ prior precision
    def optimize_prior_precision(
        self,
        pred_type: PredType | str = PredType.GLM,
        method: TuningMethod | str = TuningMethod.MARGLIK,
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: float | torch.Tensor = 1.0,
        prior_structure: PriorStructure | str = PriorStructure.SCALAR,
        val_loader: DataLoader | None = None,
        loss: torchmetrics.Metric | Callable[[torch.Tensor], torch.Tensor | float] | None = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        log_prior_prec_base: float = 10.0,
    ) -> None:
        """laplace-torch's ``optimize_prior_precision`` (same arguments), with two changes.

        ``method="marglik"`` with ``prior_structure="layerwise"`` on a curvature whose blocks span
        several parameter tensors optimises one value per block
        (:func:`~laplace_debiased.structures.block_priors.block_marglik`); ``init_prior_prec`` is
        then a scalar, one value per block, or one per tensor with equal values within each block.
        ``method="gridsearch"`` with ``likelihood="regression"`` scores by
        :func:`~laplace_debiased.structures.gridsearch.regression_grid_loss` (default: the Gaussian
        predictive NLL with ``self.sigma_noise``; an MSE ``loss`` with ``pred_type="glm"`` raises
        ``ValueError``).
        """
        spans = [1]
        if method == "marglik" and prior_structure == "layerwise":
            blocks = self._kfac_blocks and not isinstance(self, LLLaplace)
            spans = prior_spans(curvature_modules(self.backend._model) if blocks else None, self.n_layers)
        if any(span > 1 for span in spans):
            self.prior_precision = block_marglik(
                lambda delta: self.log_marginal_likelihood(prior_precision=delta), spans, init_prior_prec,
                n_steps, lr, device=self._device, dtype=self._dtype,
            )
            return
        if method == "gridsearch" and self.likelihood == "regression":
            loss = regression_grid_loss(loss, pred_type, self.sigma_noise, self._device)
        super().optimize_prior_precision(
            pred_type, method, n_steps, lr, init_prior_prec, prior_structure, val_loader, loss,
            log_prior_prec_min, log_prior_prec_max, grid_size, link_approx, n_samples, verbose, progress_bar,
            log_prior_prec_base,
        )

    def _gridsearch(
        self,
        loss: torchmetrics.Metric | Callable[[torch.Tensor], torch.Tensor | float],
        interval: torch.Tensor,
        val_loader: DataLoader,
        pred_type: PredType | str,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        progress_bar: bool = False,
    ) -> torch.Tensor:
        """laplace-torch's grid search hook: :func:`~laplace_debiased.structures.gridsearch.grid_search`."""
        return grid_search(self, loss, interval, val_loader, pred_type, link_approx, n_samples, progress_bar)

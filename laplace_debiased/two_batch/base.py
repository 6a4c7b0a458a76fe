"""The adapter base of all two-batch (debiased) Laplace classes: the shared ``fit`` and the
laplace-torch overrides every structure shares.

A class using [`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace] lists it *before* its
laplace-torch base (``class X(TwoBatchLaplace, KronLaplace)``) and implements the hook

``_fit_two_batch(direction_batches, magnitude_batches, N) -> Tensor``

which computes the curvature of the direction batches B and the magnitude batches B̃,
each scaled to ``N`` data points exactly like a laplace-torch fit over a loader of ``N``
samples (summed loss; see [`laplace_debiased.two_batch.batches`][laplace_debiased.two_batch.batches] for how B
and B̃ are chosen), sets ``self.H`` and returns the summed loss over the distinct batches of B ∪ B̃
(``_distinct``), unscaled: backends that evaluate it with the curvature return theirs,
the others call ``_summed_loss``, so no batch is forwarded twice for the loss.  When the hook runs,
``self.n_data`` still holds the number of data points of earlier fits (0 unless ``override=False``), so online
fits can combine them. Subclasses that keep extra state per fit extend ``_reset_fit_state``.

A structure's options are constructor keywords, checked at construction (the batch choice here,
[`BatchOptions`][laplace_debiased.two_batch.base.BatchOptions]; a structure's own in its
constructor, listed in ``_options`` and set again by its ``_update_options``), so laplace-torch's
``Laplace(...)`` factory passes them. ``fit`` keeps laplace-torch's signature plus
``magnitude_loader``; an option passed to ``fit`` is deprecated and sets it as the constructor would.

After ``fit``: ``self.mean`` (MAP parameters), ``self.n_outputs``, ``self.fit_batches``
(which batches formed B and B̃, and how they were chosen), ``self.n_data += N`` and
``self.loss += N / n_used * (summed loss over the n_used distinct samples of B ∪ B̃)``, an
unbiased estimate of the summed training loss, so that ``log_likelihood``,
``log_marginal_likelihood`` and marglik prior tuning are on the full-data scale.

The overrides are thin: each calls the plain functions of a sibling module, the input checks
of [`fit_checks`][laplace_debiased.two_batch.checks] and [`shared_parameters`][laplace_debiased.two_batch.shared_parameters], the saved state of [`saved_state`][laplace_debiased.two_batch.saved_state],
``n_magnitude_batches="auto"`` of [`auto_magnitude`][laplace_debiased.two_batch.auto_magnitude], the predictive
over chunks of the inputs of [`chunked`][laplace_debiased.two_batch.chunked], the GLM predictive of token outputs and per-example
Jacobians of [`token_outputs`][laplace_debiased.two_batch.token_outputs], the mixture samples of a cross-fitted ``H`` of
[`cross_fit`][laplace_debiased.two_batch.cross_fit], the grid search of [`gridsearch`][laplace_debiased.two_batch.gridsearch] and the per-block layerwise marglik of
[`block_priors`][laplace_debiased.two_batch.block_priors].
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torchmetrics
from laplace.lllaplace import LLLaplace
from laplace.utils.enums import LinkApprox, PredType
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader

from laplace_debiased.two_batch.batches import BatchChoice, BatchSplit, check_targets, split_batches
from laplace_debiased.curvature.kfac import output_rows, padded_rows
from laplace_debiased.curvature.layer_blocks import curvature_modules
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.parallel.distributed import check_same_fit_inputs, fail_together, local_shards
from laplace_debiased.parallel.reducer import Reducer, current_reducer
from laplace_debiased.posterior.from_laplace import curvature_kind, laplace_params, posterior_structure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import closed_form, logit_jacobians, logit_rows
from laplace_debiased.posterior.kron_structure import held_entries
from laplace_debiased.posterior.links import normal_samples
from laplace_debiased.two_batch.auto_magnitude import auto_magnitude_rule, sample_output_shape
from laplace_debiased.two_batch.block_priors import block_marglik, prior_spans
from laplace_debiased.two_batch.chunked import Output, checked_chunk_size, chunked
from laplace_debiased.two_batch.cross_fit import CrossFitDecomposed, mixture_log_prob, mixture_samples
from laplace_debiased.two_batch.checks import (
    check_batch_dtypes,
    check_materialised,
    check_model_mode,
    check_outputs_are_logits,
    check_override,
    check_padded_targets_supported,
    check_trainable,
)
from laplace_debiased.two_batch.gridsearch import grid_search, regression_grid_loss
from laplace_debiased.two_batch.saved_state import Layout, check_saved_fit, fit_state
from laplace_debiased.two_batch.shared_parameters import check_shared_parameters
from laplace_debiased.two_batch.token_outputs import (
    per_example_jacobians,
    token_jacobians,
    token_regression_normaliser,
    token_shaped,
)

if TYPE_CHECKING:
    from laplace_debiased.two_batch.magnitude_rule import AutoMagnitude

__all__ = ["BatchOptions", "TwoBatchLaplace", "distinct_batches", "map_estimate", "summed_loss"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class BatchOptions:
    """How a fit chooses B and B̃: the constructor options of every two-batch class, as
    [`split_batches`][laplace_debiased.two_batch.batches.split_batches] takes them.

    Raises:
        ValueError: A batch count that is not a positive int (nor ``"auto"`` for B̃), an unknown
            ``split``, or ``split="halves"`` with a batch count.
        TypeError: ``generator`` is not a ``torch.Generator``.
    """

    n_direction_batches: int | None = None
    n_magnitude_batches: int | Literal["auto"] | None = None
    split: Literal["batches", "halves"] = "batches"
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        for name in ("n_direction_batches", "n_magnitude_batches"):
            value = getattr(self, name)
            if value is None or (name == "n_magnitude_batches" and value == "auto"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                auto = " or 'auto'" if name == "n_magnitude_batches" else ""
                raise ValueError(f"{name} must be a positive integer{auto}, got {value!r}.")
        if self.split not in ("batches", "halves"):
            raise ValueError(f"split must be 'batches' or 'halves', got {self.split!r}.")
        if self.split == "halves" and (self.n_direction_batches, self.n_magnitude_batches) != (None, None):
            raise ValueError("split='halves' uses all batches; do not pass n_*_batches.")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(self.generator).__name__}.")


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

    Each token is its own loss term for outputs ``(n, tokens, C)``
    ([`output_rows`][laplace_debiased.curvature.kfac.output_rows]).  Under a process group each rank forwards
    its rows only and the sums are added by ``reducer``.

    Args:
        model: The network.
        backend: laplace-torch's curvature backend (its ``lossfunc`` and ``factor``).
        batches: Loader batches.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.
        reducer: Sums over the ranks ([`current_reducer`][laplace_debiased.parallel.reducer.current_reducer]).
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
            ([`check_targets`][laplace_debiased.two_batch.batches.check_targets]).
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
    ([`auto_magnitude`][laplace_debiased.two_batch.auto_magnitude]), the shared K-FAC pass's check of padded
    targets and per-block layerwise priors ([`block_priors`][laplace_debiased.two_batch.block_priors]).

    Attributes:
        predictive_chunk_size: Inputs per chunk of the predictive; ``None`` (default) picks
            [`auto_chunk_size`][laplace_debiased.two_batch.chunked.auto_chunk_size] from the fit.
    """

    predictive_chunk_size: int | None = None
    _kfac_blocks: bool = False
    _call_generator: torch.Generator | None = None
    #: the constructor options an old ``fit`` keyword may still set (deprecated)
    _options: tuple[str, ...] = ("n_direction_batches", "n_magnitude_batches", "split", "generator")
    #: old ``fit`` keywords that have no effect on this structure (deprecated)
    _ignored_fit_options: tuple[str, ...] = ()

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        *args: Any,
        n_direction_batches: int | None = None,
        n_magnitude_batches: int | Literal["auto"] | None = None,
        split: Literal["batches", "halves"] = "batches",
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        """laplace-torch's constructor, plus how each fit chooses B and B̃
        ([`split_batches`][laplace_debiased.two_batch.batches.split_batches]).

        Args:
            model: The network, as for laplace-torch.
            likelihood: laplace-torch's likelihood.
            *args: laplace-torch's positional arguments.
            n_direction_batches: Loader batches in B (default 1).
            n_magnitude_batches: Loader batches in B̃ (default 1), or ``"auto"`` (``debiased_kron`` and
                ``debiased_ekfac`` over all weights): the fewest that cover every K-FAC factor, at most
                ``AUTO_MAGNITUDE_CAP``, recorded in ``fit_batches[-1].auto``
                ([`auto_magnitude`][laplace_debiased.two_batch.magnitude_rule]).
            split: ``"batches"``, or ``"halves"``: every batch, half to B and half to B̃ (without
                ``n_*_batches``).
            generator: Draw the batches at random; one seed, one B and B̃, with a shuffling loader too.
            **kwargs: laplace-torch's keyword arguments.

        Raises:
            ValueError: An option out of range, or ``"auto"`` without K-FAC factors.
            TypeError: ``generator`` is not a ``torch.Generator``.
        """
        self._batch_options = self._checked_batch_options(
            BatchOptions(n_direction_batches, n_magnitude_batches, split, generator)
        )
        self._laplace_init(model, likelihood, *args, **kwargs)

    def _laplace_init(self, model: nn.Module, likelihood: str, *args: Any, **kwargs: Any) -> None:
        """The laplace-torch base's constructor."""
        super().__init__(model, likelihood, *args, **kwargs)

    def _checked_batch_options(self, options: BatchOptions) -> BatchOptions:
        """``options``, refused if ``"auto"`` and this structure has no K-FAC factors."""
        if options.n_magnitude_batches == "auto" and not self._kfac_blocks:
            raise ValueError(
                f"n_magnitude_batches='auto' counts the rows B gives each K-FAC factor, and {type(self).__name__} "
                "has no K-FAC factors. Pass an integer n_magnitude_batches (default 1), or use "
                "hessian_structure='debiased_kron' or 'debiased_ekfac' with subset_of_weights='all'."
            )
        return options

    def _update_options(self, options: dict[str, Any]) -> None:
        """Set constructor options (checked as by the constructor); subclasses take theirs first."""
        if options:
            self._batch_options = self._checked_batch_options(replace(self._batch_options, **options))

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        *,
        magnitude_loader: DataLoader | None = None,
        **deprecated: Any,
    ) -> None:
        """Fit the debiased Laplace approximation at the current (MAP) parameters.

        B and B̃ are chosen by the constructor's options; the choice is logged (INFO, logger
        ``laplace_debiased``) and recorded in ``self.fit_batches``, one
        [`BatchChoice`][laplace_debiased.two_batch.batches.BatchChoice] per fit since the last
        ``override=True``. Under a ``torch.distributed`` group (every rank calls ``fit``) the ranks
        refuse to fit if their models or B and B̃ differ
        ([`check_same_fit_inputs`][laplace_debiased.parallel.distributed.check_same_fit_inputs]), and an error
        on one rank ends the fit on every rank ([`fail_together`][laplace_debiased.parallel.distributed.fail_together]).

        Args:
            train_loader: Training data; ``N = len(train_loader.dataset)``.
            override: ``False`` accumulates onto a previous fit (where the structure allows it).
            progress_bar: Unused (laplace-torch compatibility; few batches are touched).
            magnitude_loader: Take B̃ from this loader; ``magnitude_loader=train_loader`` selects
                B̃ = B, which reduces every debiased structure to its plain single-batch version.
            **deprecated: A constructor option passed here (deprecated): set on this object, then fit.

        Raises:
            ValueError: Inputs the fit would get silently wrong
                ([`fit_checks`][laplace_debiased.two_batch.checks]).
            TypeError: A keyword that is not an option of this structure.
        """
        del progress_bar
        if deprecated:
            self._deprecated_fit_options(deprecated)
        with fail_together(f"{type(self).__name__}.fit"):
            self._check_override(override)
            check_override(isinstance(self, LLLaplace), override)
            check_model_mode(self.model)
            check_materialised(self.model)
            options = self._batch_options
            batches = split_batches(
                train_loader, n_direction_batches=options.n_direction_batches,
                n_magnitude_batches=options.n_magnitude_batches, magnitude_loader=magnitude_loader,
                split=options.split, generator=options.generator,
                magnitude_rule=self._magnitude_rule(options.n_magnitude_batches),
                dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y, device=self._device,
            )
            self._fit_split(batches, override)

    def _deprecated_fit_options(self, options: dict[str, Any]) -> None:
        """Old ``fit`` keywords: each warned (``DeprecationWarning`` naming the constructor keyword),
        then set as a constructor option would be; an unknown one raises ``TypeError``."""
        unknown = sorted(set(options) - set(self._options) - set(self._ignored_fit_options))
        if unknown:
            raise TypeError(f"{type(self).__name__}.fit() got unexpected keyword arguments {unknown}.")
        for name in options:
            if name in self._ignored_fit_options:
                message = f"fit({name}=...) has no effect on {self._key[1]} and will be removed; drop it."
            else:
                message = (
                    f"fit({name}=...) is deprecated and will be removed; pass it to the constructor: "
                    f"Laplace(model, likelihood, hessian_structure={self._key[1]!r}, {name}=...)."
                )
            warnings.warn(message, DeprecationWarning, stacklevel=3)
        self._update_options({k: v for k, v in options.items() if k not in self._ignored_fit_options})

    def _check_override(self, override: bool) -> None:
        """Structures that cannot combine fits refuse ``override=False`` here."""

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> torch.Tensor:
        """The structure's hook (module docstring): set ``self.H``, return the summed loss of B ∪ B̃."""
        raise NotImplementedError

    def _magnitude_rule(self, n_magnitude_batches: object) -> Callable[[list[Batch]], AutoMagnitude] | None:
        """``None`` unless ``n_magnitude_batches="auto"``, then
        [`auto_magnitude_rule`][laplace_debiased.two_batch.auto_magnitude.auto_magnitude_rule]."""
        if n_magnitude_batches != "auto":
            return None
        return auto_magnitude_rule(
            self.model, lambda: self.backend, last_layer=isinstance(self, LLLaplace), owner=type(self).__name__,
            likelihood=self.likelihood, dtype=self._dtype, asdl_fisher_kwargs=self._asdl_fisher_kwargs,
            dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y,
        )

    def _single_pass_fisher(self) -> str | None:
        """The curvature type that the structure's own pass over B ∪ B̃ reproduces exactly for
        this backend; ``None`` here, set by the K-FAC structures."""
        return None

    def _fit_split(self, batches: BatchSplit, override: bool) -> None:
        """[`fit`][laplace_debiased.two_batch.base.TwoBatchLaplace.fit] on the selected B and B̃: the
        inputs checked, the curvature fitted, and this fit's loss (rescaled to ``N``), ``N`` and batch choice
        added to the totals."""
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
        """The checks before a fit ([`fit_checks`][laplace_debiased.two_batch.checks], [`shared_parameters`][laplace_debiased.two_batch.shared_parameters]), eval mode, the
        last layer (last-layer classes, first fit), earlier fits forgotten when ``override``, and the output shape."""
        keys = (self.dict_key_x, self.dict_key_y)
        last_layer = isinstance(self, LLLaplace)
        check_batch_dtypes(used, self._dtype, self.likelihood, *keys)
        self.model.eval()
        X, _ = batch_inputs_targets(first, *keys)
        check_outputs_are_logits(self.model.model if last_layer else self.model, X, self.likelihood)
        if last_layer and self.model.last_layer is None:
            self._setup_last_layer(first)
        check_trainable(self.model.last_layer.parameters() if last_layer else self.model.parameters(), last_layer)
        check_shared_parameters(
            self.model.model if last_layer else self.model, self._key[1], self.model.last_layer if last_layer else None
        )
        if override:
            self._reset_fit_state()
        self.fit_output_shape = sample_output_shape(self.model, first, *keys)
        if has_padded_targets(used, self.fit_output_shape, self.likelihood, *keys) and self._kfac_blocks:
            check_padded_targets_supported(self._single_pass_fisher(), self.backend, self._asdl_fisher_kwargs)
        self.n_outputs = self.fit_output_shape[-1] if self.fit_output_shape else 1
        setattr(self.model, "output_size", self.n_outputs)

    @staticmethod
    def _distinct(direction_batches: list[Batch], magnitude_batches: list[Batch]) -> list[Batch]:
        """[`distinct_batches`][laplace_debiased.two_batch.base.distinct_batches]."""
        return distinct_batches(direction_batches, magnitude_batches)

    def _summed_loss(self, batches: list[Batch]) -> torch.Tensor:
        """[`summed_loss`][laplace_debiased.two_batch.base.summed_loss] of ``batches`` under the current
        reducer."""
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
        # Follows laplace-torch 0.3 lllaplace.py, LLLaplace.fit (its `if self.model.last_layer is
        # None:` block): that block is inline in LLLaplace.fit, which then fits the curvature over
        # all of train_loader, so it cannot be called alone; here it runs on B's first batch.
        self.data = batch
        self._find_last_layer(batch)
        self.n_params = sum(p.numel() for p in self.model.last_layer.parameters())
        self.n_layers = len(list(self.model.last_layer.parameters()))
        self.prior_precision = self._prior_precision
        self.prior_mean = self._prior_mean
        self._init_H()

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> torch.Tensor:
        """Posterior samples ``(n_samples, n_params)``; a cross-fitted ``H``
        ([`CrossFitDecomposed`][laplace_debiased.two_batch.cross_fit.CrossFitDecomposed]): exact mixture samples.
        Without ``generator``, inside ``la(x, generator=g)``: drawn from ``g``."""
        if generator is None:
            generator = self._call_generator
        if not isinstance(self.H, CrossFitDecomposed):
            return super().sample(n_samples, generator)
        return mixture_samples(
            self.posterior_precision, self.mean, n_samples, generator, device=self._device, dtype=self._dtype
        )

    # ------------------------------------------------------------------ saved state
    def parameter_layout(self, last_layer_name: str | None = None) -> Layout:
        """The approximated parameters as ``(qualified name, shape)`` in order: those with
        ``requires_grad`` (all weights), or the last layer's, named in the network.

        Args:
            last_layer_name: While the last layer is not found: the module taken as the last
                layer (none of that name: an empty layout).
        """
        if not isinstance(self, LLLaplace):
            return [(name, tuple(p.shape)) for name, p in self.model.named_parameters() if p.requires_grad]
        if self.model.last_layer is not None:
            last_layer_name, module = self.model._last_layer_name, self.model.last_layer
        else:
            module = dict(self.model.model.named_modules()).get(last_layer_name)
        if module is None:
            return []
        return [(f"{last_layer_name}.{name}", tuple(p.shape)) for name, p in module.named_parameters()]

    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state with the structure, the subset, every approximated parameter's
        name and shape, and the output shape ([`fit_state`][laplace_debiased.two_batch.saved_state.fit_state]).

        Raises:
            AttributeError: Not fitted (nor loaded) yet.
        """
        if getattr(self, "fit_output_shape", None) is None:
            raise AttributeError(
                f"Laplace not fitted: {type(self).__name__}.state_dict() needs fit() (or load_state_dict()) first."
            )
        return {**super().state_dict(), **fit_state(self._key[1], self._key[0], self.parameter_layout(), self.fit_output_shape)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by [`state_dict`][laplace_debiased.two_batch.base.TwoBatchLaplace.state_dict], checked first (``_check_loadable``).

        Raises:
            ValueError: The state does not fit this object; the message names the first difference.
        """
        self._check_loadable(state_dict)
        super().load_state_dict(state_dict)
        self.fit_output_shape = tuple(state_dict["output_shape"])
        self.fit_batches = ()

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """[`check_saved_fit`][laplace_debiased.two_batch.saved_state.check_saved_fit]; a last-layer object
        whose last layer is not found yet compares the module the state names (no forward pass).
        Structures with more settings extend this."""

        def layout() -> Layout:
            first = state_dict["parameter_names"][0] if state_dict["parameter_names"] else ""
            return self.parameter_layout(first.rpartition(".")[0])

        check_saved_fit(state_dict, self._key[1], self._key[0], layout)

    def _find_last_layer(self, data: Any) -> None:
        """laplace-torch's, unless the last layer is known already (loading a state into a
        fitted last-layer object; laplace-torch's loading would raise "Last layer is already known")."""
        if self.model.last_layer is None:
            super()._find_last_layer(data)

    def log_prob(self, value: torch.Tensor, normalized: bool = True) -> torch.Tensor:
        """laplace-torch's ``log_prob``; for a cross-fitted ``H`` the log density of the mixture
        that [`sample`][laplace_debiased.two_batch.base.TwoBatchLaplace.sample] draws from ([`mixture_log_prob`][laplace_debiased.two_batch.cross_fit.mixture_log_prob])."""
        if not isinstance(self.H, CrossFitDecomposed):
            return super().log_prob(value, normalized)
        return mixture_log_prob(self.posterior_precision, value - self.mean, normalized)

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
        ([`chunked`][laplace_debiased.two_batch.chunked]); the joint predictive (``joint=True``) in one piece. ``generator`` is
        the source of every draw of the call (``link_approx="mc"``, ``pred_type="nn"``), which
        laplace-torch 0.3 does not pass on: it is held as ``_call_generator`` for the call
        ([`sample`][laplace_debiased.two_batch.base.TwoBatchLaplace.sample], ``_glm_functional_samples``)."""

        def predict(chunk: Any) -> Output:
            return super(TwoBatchLaplace, self).__call__(
                chunk, pred_type, joint, link_approx, n_samples, diagonal_output, generator, fitting, **model_kwargs
            )

        previous, self._call_generator = self._call_generator, generator
        try:
            return predict(x) if joint else self._chunked(predict, x, generator, dim=0)
        finally:
            self._call_generator = previous

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

    def chunk_size(self, x: Any = None) -> int:
        """Inputs per chunk: ``predictive_chunk_size``, or
        [`auto_chunk_size`][laplace_debiased.two_batch.chunked.auto_chunk_size] where it is ``None`` (of the
        Jacobian entries the predictive holds, ``_jacobian_entries``; for token outputs those of the first input
        of the inputs ``x`` of the call, every parameter without ``x``)."""
        outputs = math.prod(getattr(self, "fit_output_shape", (self.n_outputs or 1,)))
        if self.predictive_chunk_size is not None:
            return checked_chunk_size(self.predictive_chunk_size, outputs, 1, self._dtype)
        return checked_chunk_size(None, outputs, self._jacobian_entries(x), self._dtype)

    def _chunked(self, predict: Callable[[Any], Output], x: Any, generator: torch.Generator | None, dim: int) -> Output:
        """[`chunked`][laplace_debiased.two_batch.chunked.chunked] at
        [`chunk_size`][laplace_debiased.two_batch.base.TwoBatchLaplace.chunk_size]."""
        return chunked(
            predict, x, self.chunk_size(x), dict_key_x=self.dict_key_x, generator=generator, device=self._device, dim=dim
        )

    def _has_token_outputs(self) -> bool:
        return len(getattr(self, "fit_output_shape", ())) > 1

    @property
    def log_likelihood(self) -> torch.Tensor:
        """laplace-torch's log likelihood; for token outputs in regression its Gaussian normaliser
        counts all ``n_data · tokens · C`` outputs
        ([`token_regression_normaliser`][laplace_debiased.two_batch.token_outputs.token_regression_normaliser])."""
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
        eigenbasis from factored per-layer Jacobians (``_factored_predictive``, float64 inside);
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
        # Follows the tail of laplace-torch 0.3's ParametricLaplace._glm_predictive_distribution
        # (baselaplace.py, after its Jacobians): it computes the Jacobians itself, with no hook to
        # pass these in.
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
        ([`covariance`][laplace_debiased.posterior.grid.GridPredictive.covariance]: a ``Linear`` layer's
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
        """Whether ``_factored_predictive`` serves tensor inputs (its conditions but the input's)."""
        if not self._kfac_blocks or self.enable_backprop or isinstance(self, LLLaplace):
            return False  # (the dense structures' curvature is not read: it may be formed lazily)
        return curvature_kind(self) in ("own", "kron") and self.prior_precision.numel() in (1, self.n_layers)

    def _jacobian_entries(self, x: Any = None) -> int:
        """Jacobian entries per output that the GLM predictive holds for one input: on the factored
        route (``_factored_predictive``, closed-form Jacobians) ``d_out + d_in`` for a ``Linear`` weight
        (``g ⊗ a``) and every entry of the others; for token outputs (a ``Linear`` on every token keeps its
        positions) what the Jacobians of the first input of the tensor ``x`` hold per output row and class
        ([`held_entries`][laplace_debiased.posterior.kron_structure.held_entries]); else, and for token outputs
        without such an ``x``, every parameter."""
        params = laplace_params(self)
        if not self._factored_applies() or not closed_form(self.model, params):
            return self.n_params
        if not self._has_token_outputs():
            return sum(p.shape[0] + p.shape[1] if p.ndim == 2 else p.numel() for p in params)
        if not isinstance(x, torch.Tensor) or len(x) == 0:
            return self.n_params
        _, jacs = logit_jacobians(self.model, params, x[:1].to(self._device))
        return max(1, math.ceil(sum(held_entries(j) for j in jacs) / math.prod(self.fit_output_shape)))

    def _glm_functional_samples(
        self,
        f_mu: torch.Tensor,
        f_var: torch.Tensor,
        n_samples: int,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's GLM functional samples (``link_approx="mc"``) from a float64 square root
        of ``f_var`` ([`normal_samples`][laplace_debiased.posterior.links.normal_samples]; laplace-torch's
        float32 Cholesky fails at small prior precision). Token outputs: ``(S, n, tokens, C)``.
        Without ``generator``, inside ``la(x, generator=g)``: drawn from ``g``."""
        if generator is None:
            generator = self._call_generator
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
    def optimize_prior_precision(self, *args: Any, **kwargs: Any) -> None:
        """laplace-torch's ``optimize_prior_precision`` (same arguments, passed on by keyword), with three
        changes.

        ``link_approx`` left out means ``"probit"``, and laplace-torch's reminder of that default
        is warned; a call that passes ``link_approx`` is not reminded.

        ``method="marglik"`` with ``prior_structure="layerwise"`` on a curvature whose blocks span
        several parameter tensors optimises one value per block
        ([`block_marglik`][laplace_debiased.two_batch.block_priors.block_marglik]); ``init_prior_prec`` is
        then a scalar, one value per block, or one per tensor with equal values within each block.
        ``method="gridsearch"`` with ``likelihood="regression"`` scores by
        [`regression_grid_loss`][laplace_debiased.two_batch.gridsearch.regression_grid_loss] (default: the
        Gaussian predictive NLL with ``self.sigma_noise``; an MSE ``loss`` with ``pred_type="glm"`` raises
        ``ValueError``).
        """
        parent = super().optimize_prior_precision
        call = inspect.signature(parent).bind(*args, **kwargs)
        passed_link = call.arguments.get("link_approx") is not None
        call.apply_defaults()
        if call.arguments["link_approx"] is None:
            call.arguments["link_approx"] = LinkApprox.PROBIT
        options = call.arguments
        method, prior_structure = options["method"], options["prior_structure"]
        spans = [1]
        if method == "marglik" and prior_structure == "layerwise":
            blocks = self._kfac_blocks and not isinstance(self, LLLaplace)
            spans = prior_spans(curvature_modules(self.backend._model) if blocks else None, self.n_layers)
        if any(span > 1 for span in spans):
            self.prior_precision = block_marglik(
                lambda delta: self.log_marginal_likelihood(prior_precision=delta), spans, options["init_prior_prec"],
                options["n_steps"], options["lr"], device=self._device, dtype=self._dtype,
            )
            return
        if method == "gridsearch" and self.likelihood == "regression":
            options["loss"] = regression_grid_loss(options["loss"], options["pred_type"], self.sigma_noise, self._device)
        with warnings.catch_warnings():
            if passed_link:
                warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`", category=UserWarning)
            parent(**options)

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
        """laplace-torch's grid search hook:
        [`grid_search`][laplace_debiased.two_batch.gridsearch.grid_search]."""
        return grid_search(self, loss, interval, val_loader, pred_type, link_approx, n_samples, progress_bar)

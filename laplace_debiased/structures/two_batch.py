"""Shared ``fit`` of all two-batch (debiased) Laplace classes, and a correct grid search.

A class using :class:`TwoBatchLaplaceMixin` lists it *before* its laplace-torch base
(``class X(TwoBatchLaplaceMixin, KronLaplace)``) and implements the hook

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

The input checks live in :mod:`.fit_checks`, the predictive over chunks of the inputs in
:mod:`.chunked`, the GLM predictive overrides (token outputs, per-example Jacobians) in
:mod:`.token_outputs`, the grid search in :mod:`.gridsearch` and the per-block layerwise marglik
in :mod:`.block_priors` (bases of the mixin).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
from laplace.lllaplace import LLLaplace
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader

from laplace_debiased.curvature.kfac import output_rows, padded_rows
from laplace_debiased.computers.batches import BatchChoice, BatchSplit, check_targets, split_batches
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.structures.block_priors import BlockPriorMixin
from laplace_debiased.structures.chunked import ChunkedPredictiveMixin
from laplace_debiased.parallel.distributed import (
    check_same_fit_inputs,
    fail_together,
    local_shards,
)
from laplace_debiased.structures.fit_checks import FitChecksMixin
from laplace_debiased.structures.gridsearch import GridSearchMixin
from laplace_debiased.parallel.reducer import current_reducer
from laplace_debiased.structures.token_outputs import TokenOutputsMixin

if TYPE_CHECKING:
    from laplace_debiased.computers.auto_magnitude import AutoMagnitude

__all__ = ["TwoBatchLaplaceMixin"]

logger = logging.getLogger(__name__)


class TwoBatchLaplaceMixin(ChunkedPredictiveMixin, TokenOutputsMixin, BlockPriorMixin, GridSearchMixin, FitChecksMixin):
    """Two-batch ``fit`` (B picks directions, B̃ measures magnitudes) for laplace-torch
    ``ParametricLaplace`` subclasses, plus a grid search that resets its metric."""

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

        Parameters
        ----------
        train_loader : DataLoader
            training data; ``N = len(train_loader.dataset)``. B = its first
            ``n_direction_batches`` batches, B̃ = the next ``n_magnitude_batches`` (a random draw
            with a shuffling loader); a one-batch loader is split into two disjoint halves by a
            seeded permutation. The choice is logged (INFO, logger ``laplace_debiased``) and
            recorded in ``self.fit_batches``, one :class:`~laplace_debiased.computers.batches.BatchChoice`
            per fit since the last ``override=True``.
        override : bool, default=True
            ``False`` accumulates onto a previous fit (online: both batch sets combined, debiased again).
        progress_bar : bool, default=False
            unused (laplace-torch compatibility; few batches are touched).
        magnitude_loader : DataLoader, optional
            take B̃ from this loader; ``magnitude_loader=train_loader`` selects B̃ = B,
            which reduces every debiased structure to its plain single-batch version.
        n_direction_batches, n_magnitude_batches : int, optional
            number of loader batches in B and B̃ (default 1 each). ``n_magnitude_batches="auto"``
            (debiased_kron/ekfac over all weights): B̃ gets the smallest ``k >= 1`` batches with
            ``R_f + k · R_f / |B| >= d_f`` for every K-FAC factor ``f`` of dimension ``d_f`` wider
            than the rows ``R_f`` B gives it (more after a short batch), at most ``AUTO_MAGNITUDE_CAP = 8``;
            ``k``, why, and any factor B ∪ B̃ still misses (a warning) are in ``fit_batches[-1].auto``
            (:mod:`~laplace_debiased.computers.auto_magnitude`).
        split : {"batches", "halves"}
            ``"halves"``: all batches, first half B, second half B̃ ("debiased full-batch").
        generator : torch.Generator, optional
            draw the batches at random; one seed, one B and B̃, with a shuffling loader too.

        Notes
        -----
        Under a ``torch.distributed`` group (collective: every rank calls ``fit``) the ranks
        refuse to fit if their models or selected B and B̃ differ
        (:func:`~laplace_debiased.parallel.distributed.check_same_fit_inputs`); an error on one
        rank ends the fit on every rank (:func:`~laplace_debiased.parallel.distributed.fail_together`).
        """
        del progress_bar
        with fail_together(f"{type(self).__name__}.fit"):
            self._check_override(override)
            self._check_model_mode()
            batches = split_batches(
                train_loader, n_direction_batches=n_direction_batches, n_magnitude_batches=n_magnitude_batches,
                magnitude_loader=magnitude_loader, split=split, generator=generator,
                magnitude_rule=self._magnitude_rule(n_magnitude_batches),
                dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y, device=self._device,
            )
            self._fit_split(batches, override)

    # ------------------------------------------------------------------ fit steps
    def _magnitude_rule(self, n_magnitude_batches: object) -> Callable[[list[Batch]], AutoMagnitude] | None:
        """``None`` unless ``n_magnitude_batches="auto"``, then the structure's rule
        (:meth:`_auto_magnitude_rule`); another string raises."""
        if not isinstance(n_magnitude_batches, str):
            return None
        if n_magnitude_batches != "auto":
            raise ValueError(f"n_magnitude_batches must be a positive integer or 'auto', got {n_magnitude_batches!r}.")
        return self._auto_magnitude_rule()

    def _auto_magnitude_rule(self) -> Callable[[list[Batch]], AutoMagnitude]:
        """Structures with K-FAC factors override this
        (:class:`~laplace_debiased.computers.auto_magnitude.AutoMagnitudeMixin`)."""
        raise ValueError(
            f"n_magnitude_batches='auto' counts the rows B gives each K-FAC factor, and {type(self).__name__} "
            "has no K-FAC factors. Pass an integer n_magnitude_batches (default 1), or use "
            "hessian_structure='debiased_kron' or 'debiased_ekfac' with subset_of_weights='all'."
        )

    def _fit_split(self, batches: BatchSplit, override: bool) -> None:
        """:meth:`fit` on the selected B and B̃ (inside its ``fail_together``): the ranks'
        inputs compared, the batches checked, the curvature fitted and accumulated."""
        check_same_fit_inputs(self.model, batches.direction, batches.magnitude)
        logger.info("%s fit: %s", type(self).__name__, batches.choice.describe())
        if batches.choice.auto is not None and batches.choice.auto.short is not None:
            logger.warning("%s fit: %s", type(self).__name__, batches.choice.auto.describe())
        used = self._distinct(batches.direction, batches.magnitude)
        self._prepare_fit(batches.direction[0], used, override)
        self.n_outputs = self._checked_n_outputs(batches.direction[0], used)
        setattr(self.model, "output_size", self.n_outputs)
        self.mean = self._map_estimate()
        loss = self._fit_two_batch(batches.direction, batches.magnitude, batches.n_data)
        self._accumulate(loss, used, batches)

    def _prepare_fit(self, first: Batch, used: list[Batch], override: bool) -> None:
        """Check the batches against the model, switch to eval mode, check that a classifier
        outputs logits, find the last layer
        (last-layer classes, first fit), check there is something to fit, and forget
        earlier fits when ``override``."""
        for b in used:
            self._check_batch_matches_model(b)
        self.model.eval()
        self._check_outputs_are_logits(first)
        if isinstance(self, LLLaplace) and self.model.last_layer is None:
            self._setup_last_layer(first)
        self._check_trainable()
        if override:
            self._reset_fit_state()

    def _checked_n_outputs(self, first: Batch, used: list[Batch]) -> int:
        """Output width, after checking every used batch's targets against the output shape
        (``self.fit_output_shape``: the per-sample output shape, ``([tokens, ...,] C)``)."""
        output_shape = self._output_shape(first)
        self.fit_output_shape = output_shape
        padded = False
        for i, b in enumerate(used):
            _, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            check_targets(y, output_shape, self.likelihood, f"fit batch {i}")
            padded = padded or bool(padded_rows(y).any())
        if padded:
            self._check_padding_supported()
        return output_shape[-1] if output_shape else 1

    def _check_padding_supported(self) -> None:
        """Refuse padded targets (-100) where laplace-torch's backend computes the K-FAC factors
        (structures with ``_single_pass_fisher`` returning ``None``): it would count the padded
        positions in the curvature. The package's own passes leave them out."""
        single_pass = getattr(self, "_single_pass_fisher", None)
        if single_pass is not None and single_pass() is None:
            raise ValueError(
                f"the fit batches have padded targets (-100), which {type(self.backend).__name__} "
                f"(with asdl_fisher_kwargs={self._asdl_fisher_kwargs}) would count in the K-FAC factors. "
                "Use the default CurvlinopsGGN (stochastic=False) or CurvlinopsEF backend without "
                "asdl_fisher_kwargs, which leave padded positions out, or remove the padded positions."
            )

    def _map_estimate(self) -> torch.Tensor:
        """The parameters being approximated as one vector (the posterior mean)."""
        params = (
            self.model.last_layer.parameters() if isinstance(self, LLLaplace) else self.params
        )
        mean = parameters_to_vector(params)
        if not self.enable_backprop:
            mean = mean.detach()
        if not torch.isfinite(mean).all():
            raise ValueError("the model parameters (the MAP estimate) contain NaN or Inf.")
        return mean

    def _accumulate(self, loss: torch.Tensor, used: list[Batch], batches: BatchSplit) -> None:
        """Add this fit's loss (rescaled to ``N``), ``N`` and its batch choice to the totals."""
        if not torch.isfinite(loss):
            raise ValueError("the training loss on the fit batches is NaN or Inf.")
        n_used = sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in used)
        self.loss = self.loss + batches.n_data / n_used * loss
        self.n_data += batches.n_data
        self.fit_batches = (*getattr(self, "fit_batches", ()), batches.choice)

    def _fit_two_batch(
        self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int
    ) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _distinct(direction_batches: list[Batch], magnitude_batches: list[Batch]) -> list[Batch]:
        """The batches of B ∪ B̃, each once (B̃ = B is the same list object)."""
        if magnitude_batches is direction_batches:
            return list(direction_batches)
        return [*direction_batches, *magnitude_batches]

    def _reset_fit_state(self) -> None:
        """Forget earlier fits (``override=True``)."""
        self._init_H()
        self.loss = 0.0
        self.n_data = 0
        self.fit_batches: tuple[BatchChoice, ...] = ()

    # ------------------------------------------------------------------ helpers
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

    @torch.no_grad()
    def _output_shape(self, batch: Batch) -> tuple[int, ...]:
        """Per-sample output shape, from one sample (the whole batch for dict inputs)."""
        X, _ = batch_inputs_targets(batch, self.dict_key_x, self.dict_key_y)
        out = self.model(X[:1] if isinstance(X, torch.Tensor) else X)
        return tuple(out.shape[1:])

    @torch.no_grad()
    def _summed_loss(self, batches: list[Batch]) -> torch.Tensor:
        """``sum over batches of factor * lossfunc(model(X), y)`` (laplace-torch's loss), each
        token its own loss term for outputs ``(n, tokens, C)`` (:func:`output_rows`).  Under a
        process group each rank forwards its rows only and the sums are all-reduced."""
        total = torch.zeros((), device=self._device, dtype=self._dtype)
        reducer = current_reducer()
        for b in local_shards(batches, self.dict_key_x, self.dict_key_y, rank=reducer.rank, world=reducer.world):
            X, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            total = total + self.backend.factor * self.backend.lossfunc(*output_rows(self.model(X), y))
        reducer.sum_([total])
        return total

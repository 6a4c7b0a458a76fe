"""Shared ``fit`` of all two-batch (debiased) Laplace classes, and a correct grid search.

A class using :class:`TwoBatchLaplaceMixin` lists it *before* its laplace-torch base
(``class X(TwoBatchLaplaceMixin, KronLaplace)``) and implements the hook

``_fit_two_batch(direction_batches, magnitude_batches, N) -> Tensor``

which computes the curvature of the direction batches B and the magnitude batches B̃,
each scaled to ``N`` data points exactly like a laplace-torch fit over a loader of ``N``
samples (summed loss; see :mod:`laplace_debiased.structures.batches` for how B and B̃ are chosen),
sets ``self.H`` and returns the summed loss over the distinct batches of B ∪ B̃
(:meth:`_distinct`), unscaled: backends that evaluate it with the curvature return theirs,
the others call :meth:`_summed_loss`, so no batch is forwarded twice for the loss.  When the hook runs, ``self.n_data`` still holds the number of data
points of earlier fits (0 unless ``override=False``), so online fits can combine them.
Subclasses that keep extra state per fit extend :meth:`_reset_fit_state`.

After ``fit``: ``self.mean`` (MAP parameters), ``self.n_outputs``, ``self.n_data += N`` and
``self.loss += N / n_used * (summed loss over the n_used distinct samples of B ∪ B̃)``, an
unbiased estimate of the summed training loss, so that ``log_likelihood``,
``log_marginal_likelihood`` and marglik prior tuning are on the full-data scale.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable

import numpy as np
import torch
import torchmetrics
import tqdm
from laplace.lllaplace import LLLaplace
from laplace.utils.enums import LinkApprox, PredType
from laplace.utils.utils import validate
from torch import nn
from torch.linalg import LinAlgError
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader

from laplace_debiased.structures.batches import (
    Batch,
    batch_inputs_targets,
    batch_size,
    split_batches,
)

__all__ = ["TwoBatchLaplaceMixin"]

_STOCHASTIC_LAYERS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)


class TwoBatchLaplaceMixin:
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
        n_magnitude_batches: int | None = None,
        split: str = "batches",
        generator: torch.Generator | None = None,
    ) -> None:
        """Fit the debiased Laplace approximation at the current (MAP) parameters.

        Parameters
        ----------
        train_loader : DataLoader
            training data; ``N = len(train_loader.dataset)``. B = its first
            ``n_direction_batches`` batches, B̃ = the next ``n_magnitude_batches``.
        override : bool, default=True
            ``False`` accumulates onto a previous fit (online learning; the curvature of
            both batch sets is combined and debiased again).
        progress_bar : bool, default=False
            accepted for laplace-torch compatibility; unused (few batches are touched).
        magnitude_loader : DataLoader, optional
            take B̃ from this loader; ``magnitude_loader=train_loader`` selects B̃ = B,
            which reduces every debiased structure to its plain single-batch version.
        n_direction_batches, n_magnitude_batches : int, optional
            number of loader batches in B and B̃ (default 1 each).
        split : {"batches", "halves"}
            ``"halves"``: all batches, first half B, second half B̃ ("debiased full-batch").
        generator : torch.Generator, optional
            draw the batches at random (reproducibly) instead of in loader order.
        """
        del progress_bar
        if isinstance(self, LLLaplace) and not override:
            raise ValueError(
                "Last-layer Laplace approximations do not support `override=False`."
            )
        self._check_model_mode()
        batches = split_batches(
            train_loader,
            n_direction_batches=n_direction_batches,
            n_magnitude_batches=n_magnitude_batches,
            magnitude_loader=magnitude_loader,
            split=split,
            generator=generator,
            dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y,
            device=self._device,
        )
        used = self._distinct(batches.direction, batches.magnitude)
        for b in used:
            self._check_batch_matches_model(b)
        self.model.eval()
        if isinstance(self, LLLaplace) and self.model.last_layer is None:
            self._setup_last_layer(batches.direction[0])
        if override:
            self._reset_fit_state()

        self.n_outputs = self._infer_n_outputs(batches.direction[0])
        setattr(self.model, "output_size", self.n_outputs)
        params = (
            self.model.last_layer.parameters() if isinstance(self, LLLaplace) else self.params
        )
        self.mean = parameters_to_vector(params)
        if not self.enable_backprop:
            self.mean = self.mean.detach()
        if not torch.isfinite(self.mean).all():
            raise ValueError("the model parameters (the MAP estimate) contain NaN or Inf.")

        loss = self._fit_two_batch(batches.direction, batches.magnitude, batches.n_data)
        if not torch.isfinite(loss):
            raise ValueError("the training loss on the fit batches is NaN or Inf.")

        n_used = sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in used)
        self.loss = self.loss + batches.n_data / n_used * loss
        self.n_data += batches.n_data

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

    # ------------------------------------------------------------------ checks
    def _check_model_mode(self) -> None:
        if self.model.training:
            stochastic = [
                f"'{name}' ({type(m).__name__})"
                for name, m in self.model.named_modules()
                if isinstance(m, _STOCHASTIC_LAYERS)
            ]
            if stochastic:
                raise ValueError(
                    "the model is in train mode and has layers that behave differently "
                    f"in train mode: {', '.join(stochastic)}. Call model.eval() before "
                    "fitting the Laplace approximation."
                )

    def _check_batch_matches_model(self, batch: Batch) -> None:
        X, y = batch_inputs_targets(batch, self.dict_key_x, self.dict_key_y)
        x = X[self.dict_key_x] if isinstance(X, MutableMapping) else X
        if x.is_floating_point() and x.dtype != self._dtype:
            raise ValueError(
                f"inputs have dtype {x.dtype} but the model has {self._dtype}; convert "
                f"the data (e.g. X.to({self._dtype})) or the model."
            )
        if self.likelihood == "regression" and y.dtype != self._dtype:
            raise ValueError(
                f"regression targets have dtype {y.dtype} but the model has {self._dtype}."
            )

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
    def _infer_n_outputs(self, batch: Batch) -> int:
        """Output width from one sample (the whole batch for dict inputs)."""
        X, y = batch_inputs_targets(batch, self.dict_key_x, self.dict_key_y)
        out = self.model(X[:1] if isinstance(X, torch.Tensor) else X)
        if self.likelihood == "regression" and y.ndim != out.ndim:
            raise ValueError(
                f"The model's output has {out.ndim} dims but the target has {y.ndim} dims."
            )
        return out.shape[-1]

    @torch.no_grad()
    def _summed_loss(self, batches: list[Batch]) -> torch.Tensor:
        """``sum over batches of factor * lossfunc(model(X), y)`` (laplace-torch's loss)."""
        total = torch.zeros((), device=self._device, dtype=self._dtype)
        for b in batches:
            X, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            f = self.model(X)
            total = total + self.backend.factor * self.backend.lossfunc(f, y)
        return total

    def _glm_functional_samples(
        self,
        f_mu: torch.Tensor,
        f_var: torch.Tensor,
        n_samples: int,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's GLM functional samples (``link_approx="mc"``) from a float64 square
        root of ``f_var`` (:func:`laplace_debiased.evaluation.predictive.normal_samples`);
        laplace-torch's float32 Cholesky fails at small prior precision."""
        from laplace_debiased.evaluation.predictive import normal_samples

        if diagonal_output:
            f_var = torch.diagonal(f_var, dim1=1, dim2=2)
        return normal_samples(f_mu, f_var, n_samples, generator)

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
        """Grid search over prior precisions; unlike laplace-torch 0.3 the running metric
        is reset before every grid point, so each point is scored on its own predictions.

        Classification with the GLM predictive and a probit/bridge/mc link scores the whole
        grid from one predictive pass over ``val_loader``
        (:func:`laplace_debiased.evaluation.predictive.grid_validation_scores`); other
        settings (and dict batches) evaluate ``validate`` once per grid point."""
        from laplace_debiased.evaluation import predictive

        if predictive.gridsearch_supported(self, pred_type, link_approx):
            try:
                scores = predictive.grid_validation_scores(
                    self, loss, interval, val_loader, link_approx, n_samples
                )
            except predictive.UnsupportedBatches:
                pass
            else:
                return interval[int(np.argmin(scores))]
        results: list[float] = []
        for prior_prec in tqdm.tqdm(interval, disable=not progress_bar):
            self.prior_precision = prior_prec
            if isinstance(loss, torchmetrics.Metric):
                loss.reset()
            try:
                result = validate(
                    self,
                    val_loader,
                    loss,
                    pred_type=pred_type,
                    link_approx=link_approx,
                    n_samples=n_samples,
                    dict_key_y=self.dict_key_y,
                )
            except LinAlgError:
                result = np.inf
            except RuntimeError as err:
                if "not positive definite" not in str(err):
                    raise
                result = np.inf
            results.append(result)
        return interval[int(np.argmin(results))]

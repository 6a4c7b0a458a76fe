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

After ``fit``: ``self.mean`` (MAP parameters), ``self.n_outputs``, ``self.fit_batches``
(which batches formed B and B̃, and how they were chosen), ``self.n_data += N`` and
``self.loss += N / n_used * (summed loss over the n_used distinct samples of B ∪ B̃)``, an
unbiased estimate of the summed training loss, so that ``log_likelihood``,
``log_marginal_likelihood`` and marglik prior tuning are on the full-data scale.

Token outputs ``(n, tokens, C)`` (``self.fit_output_shape`` has more than one entry), every
token an output: laplace-torch's GLM predictive takes ``(n, C)`` outputs, so the mixin hands
it the token rows ``(n·tokens, C)`` with their Jacobians (:meth:`_token_jacobians`) and gives
the results the token shape back: ``la(x)`` ``(n, tokens, C)`` (regression: mean and
covariance ``(n, tokens, C, C)``; ``joint=True`` stays flat over the rows), GLM samples
``(S, n, tokens, C)``. Tokens of one input are independent under this predictive only in the
sense laplace-torch's LLM examples use: each token's marginal ``N(f_t, J_t P⁻¹ J_tᵀ)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import MutableMapping
from typing import Any, Callable

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
    BatchChoice,
    BatchSplit,
    batch_inputs_targets,
    batch_size,
    check_targets,
    split_batches,
)
from laplace_debiased.curvature.kfac import output_rows
from laplace_debiased.structures.distributed import (
    all_reduce_sum_,
    check_same_fit_inputs,
    fail_together,
    local_shards,
)
from laplace_debiased.structures.rank_failures import fault_point

__all__ = ["TwoBatchLaplaceMixin"]

logger = logging.getLogger(__name__)

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
            ``n_direction_batches`` batches, B̃ = the next ``n_magnitude_batches``: with a
            shuffling loader a random draw, otherwise the first batches in dataset order. A
            loader that yields one batch has its samples split into two disjoint halves by
            a seeded permutation (B and B̃). The choice is logged (``logging``, level INFO,
            logger ``laplace_debiased``) and recorded in ``self.fit_batches``, one
            :class:`~laplace_debiased.structures.batches.BatchChoice` per fit since the last
            ``override=True``.
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

        Under a ``torch.distributed`` group (collective: every rank calls ``fit``) the ranks
        first compare digests of their model and of the selected B and B̃ and refuse, on every
        rank, to fit if they differ (:func:`~laplace_debiased.structures.distributed.check_same_fit_inputs`);
        an error on one rank ends the fit on every rank with a ``PeerRankError`` naming it
        (:func:`~laplace_debiased.structures.distributed.fail_together`).
        """
        del progress_bar
        with fail_together(f"{type(self).__name__}.fit"):
            self._check_override(override)
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
            check_same_fit_inputs(self.model, batches.direction, batches.magnitude)
            logger.info("%s fit: %s", type(self).__name__, batches.choice.describe())
            used = self._distinct(batches.direction, batches.magnitude)
            self._prepare_fit(batches.direction[0], used, override)
            self.n_outputs = self._checked_n_outputs(batches.direction[0], used)
            setattr(self.model, "output_size", self.n_outputs)
            self.mean = self._map_estimate()
            fault_point("fit")
            loss = self._fit_two_batch(batches.direction, batches.magnitude, batches.n_data)
            self._accumulate(loss, used, batches)

    # ------------------------------------------------------------------ fit steps
    def _prepare_fit(self, first: Batch, used: list[Batch], override: bool) -> None:
        """Check the batches against the model, switch to eval mode, find the last layer
        (last-layer classes, first fit), check there is something to fit, and forget
        earlier fits when ``override``."""
        for b in used:
            self._check_batch_matches_model(b)
        self.model.eval()
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
        for i, b in enumerate(used):
            _, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            check_targets(y, output_shape, self.likelihood, f"fit batch {i}")
        return output_shape[-1] if output_shape else 1

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

    # ------------------------------------------------------------------ checks
    def _check_override(self, override: bool) -> None:
        if isinstance(self, LLLaplace) and not override:
            raise ValueError(
                "Last-layer Laplace approximations do not support `override=False`."
            )

    def _check_model_mode(self) -> None:
        """Refuse Dropout/BatchNorm layers left in train mode.

        The layers' own ``training`` flags decide, not the wrapper's: laplace-torch's
        last-layer ``FeatureExtractor`` is created in train mode around a model the user put
        in eval mode, and that model must fit (as ``LLLaplace`` does).
        """
        stochastic = [
            f"'{name}' ({type(m).__name__})"
            for name, m in self.model.named_modules()
            if isinstance(m, _STOCHASTIC_LAYERS) and m.training
        ]
        if stochastic:
            raise ValueError(
                "the model is in train mode and has layers that behave differently "
                f"in train mode: {', '.join(stochastic)}. Call model.eval() before "
                "fitting the Laplace approximation."
            )

    def _check_trainable(self) -> None:
        """Refuse a fit with nothing to approximate (every parameter frozen)."""
        if isinstance(self, LLLaplace):
            if not any(p.requires_grad for p in self.model.last_layer.parameters()):
                raise ValueError(
                    "the last layer's parameters all have requires_grad=False; a last-layer "
                    "Laplace approximation is over them, so unfreeze them "
                    "(p.requires_grad_(True))."
                )
        elif not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(
                "every parameter of the model has requires_grad=False, so there is nothing "
                "to approximate; unfreeze the parameters the posterior should cover."
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
    def _output_shape(self, batch: Batch) -> tuple[int, ...]:
        """Per-sample output shape, from one sample (the whole batch for dict inputs)."""
        X, _ = batch_inputs_targets(batch, self.dict_key_x, self.dict_key_y)
        out = self.model(X[:1] if isinstance(X, torch.Tensor) else X)
        return tuple(out.shape[1:])

    @torch.no_grad()
    @torch.no_grad()
    def _summed_loss(self, batches: list[Batch]) -> torch.Tensor:
        """``sum over batches of factor * lossfunc(model(X), y)`` (laplace-torch's loss), each
        token its own loss term for outputs ``(n, tokens, C)`` (:func:`output_rows`).  Under a
        process group each rank forwards its rows only and the sums are all-reduced."""
        total = torch.zeros((), device=self._device, dtype=self._dtype)
        for b in local_shards(batches, self.dict_key_x, self.dict_key_y):
            X, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            total = total + self.backend.factor * self.backend.lossfunc(*output_rows(self.model(X), y))
        all_reduce_sum_([total])
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
        laplace-torch's float32 Cholesky fails at small prior precision. Token outputs:
        ``(S, n, tokens, C)``."""
        from laplace_debiased.evaluation.predictive import normal_samples

        if diagonal_output:
            f_var = torch.diagonal(f_var, dim1=1, dim2=2)
        samples = normal_samples(f_mu, f_var, n_samples, generator)
        return self._token_shaped(samples, leading=1)

    # ------------------------------------------------------------------ token outputs
    def _has_token_outputs(self) -> bool:
        return len(getattr(self, "fit_output_shape", ())) > 1

    @property
    def log_likelihood(self) -> torch.Tensor:
        """laplace-torch's log likelihood; for token outputs in regression its Gaussian
        normaliser counts all ``n_data · tokens · C`` outputs (laplace-torch's counts
        ``n_data · C``): ``- (tokens - 1) · n_data · C · log(σ √(2π))`` more."""
        ll = super().log_likelihood
        if self.likelihood == "regression" and self._has_token_outputs():
            tokens = math.prod(self.fit_output_shape[:-1])
            sigma = torch.as_tensor(self.sigma_noise, device=self._device, dtype=self._dtype)
            ll = ll - (tokens - 1) * self.n_data * self.n_outputs * torch.log(sigma * math.sqrt(2 * math.pi))
        return ll

    @torch.enable_grad()
    def _glm_predictive_distribution(
        self, X: Any, joint: bool = False, diagonal_output: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """laplace-torch's GLM predictive ``(f, J P⁻¹ Jᵀ)``; for token outputs over the token
        rows: ``f`` ``(n·tokens, C)``, covariance ``(n·tokens, C, C)`` (``joint``: flat mean and
        ``(n·tokens·C)²`` covariance; ``diagonal_output``: ``(n·tokens, C)``)."""
        self._glm_token_shape = None
        if not self._has_token_outputs():
            return super()._glm_predictive_distribution(X, joint, diagonal_output)
        Js, f_mu = self._token_jacobians(X)
        if joint:
            f_mu, f_var = f_mu.flatten(), self.functional_covariance(Js)
        else:
            f_var = self.functional_variance(Js)
            if diagonal_output:
                f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        if not self.enable_backprop:
            f_mu, f_var = f_mu.detach(), f_var.detach()
        return f_mu, f_var

    def _token_jacobians(self, X: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians ``(n·tokens, C, P)`` and outputs ``(n·tokens, C)`` of the token rows, with
        ``(n, tokens)`` kept for :meth:`_token_shaped`. Last layer: ``J = I_C ⊗ φᵀ`` (and
        ``I_C`` for a bias) per token feature ``φ``, laplace-torch's ``last_layer_jacobians``
        per row; all weights: laplace-torch's ``backend.jacobians`` reshaped."""
        if isinstance(self, LLLaplace):
            f, phi = self.model.forward_with_features(X)
            phi = phi.reshape(-1, phi.shape[-1])
            eye = torch.eye(f.shape[-1], device=f.device, dtype=f.dtype)
            Js = torch.einsum("kp,ij->kijp", phi, eye).flatten(2)
            if self.model.last_layer.bias is not None:
                Js = torch.cat([Js, eye.expand(len(phi), -1, -1)], dim=2)
        else:
            Js, f = self.backend.jacobians(X, enable_backprop=self.enable_backprop)
        self._glm_token_shape = tuple(f.shape[:-1])
        C = f.shape[-1]
        return Js.reshape(-1, C, Js.shape[-1]), f.reshape(-1, C)

    def _token_shaped(self, t: torch.Tensor, leading: int = 0) -> torch.Tensor:
        """``t`` with its row dimension (after ``leading`` dimensions) back in the token shape
        ``(n, tokens)`` of the last GLM predictive; unchanged for ``(n, C)`` outputs and for
        ``t`` already in token shape (laplace-torch's mc link averages shaped samples)."""
        shape = getattr(self, "_glm_token_shape", None)
        if shape is None or t.shape[leading] != math.prod(shape):
            return t
        return t.reshape(*t.shape[:leading], *shape, *t.shape[leading + 1 :])

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
        if isinstance(out, tuple):
            return tuple(self._token_shaped(t) for t in out)
        return self._token_shaped(out)

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

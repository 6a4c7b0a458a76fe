"""Prior-precision grid search of the two-batch classes
([`grid_search`][laplace_debiased.two_batch.gridsearch.grid_search], called by
[`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace]): one predictive pass for the whole
grid where [`laplace_debiased.posterior.grid`][laplace_debiased.posterior.grid] can, else laplace-torch's
``validate`` per point with the metric reset before each; the lowest score wins by the package's choice rule
([`choose_prior_precision`][laplace_debiased.prior_grid.choose_prior_precision], through
[`lowest_score_point`][laplace_debiased.two_batch.gridsearch.lowest_score_point]).

Regression: the default score is the Gaussian predictive NLL with the object's ``sigma_noise``
([`GaussianPredictiveNLL`][laplace_debiased.two_batch.gridsearch.GaussianPredictiveNLL],
[`regression_grid_loss`][laplace_debiased.two_batch.gridsearch.regression_grid_loss]), so that δ is chosen
for calibration; laplace-torch's default, the MSE of the predictive mean, does not depend on δ under the GLM
predictive (the mean is the MAP output), so every grid point would tie and the bottom of the grid would win.
An MSE passed as ``loss`` with the GLM predictive is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torchmetrics
import tqdm
from laplace.utils.enums import LinkApprox, PredType
from laplace.utils.utils import validate
from torch.linalg import LinAlgError
from torch.utils.data import DataLoader

from laplace_debiased.posterior.grid import UnsupportedBatches, grid_validation_scores, gridsearch_supported
from laplace_debiased.prior_grid import choose_prior_precision

if TYPE_CHECKING:
    from laplace.baselaplace import ParametricLaplace

__all__ = ["GaussianPredictiveNLL", "grid_search", "lowest_score_point", "regression_grid_loss"]


class GaussianPredictiveNLL(torchmetrics.Metric):
    """Mean negative log density of regression targets under the Gaussian predictive
    ``N(f, Σ_f + σ² I)``, computed in float64.

    ``update(mean, var, y)``: ``mean`` ``(n, [tokens, ...,] C)``; ``var`` the predictive
    covariance of the function ``(..., C, C)`` or its diagonal (the shape of ``mean``); ``y`` the
    targets, reshaped to ``mean``'s shape.  ``compute()``: the NLL summed over the ``C`` outputs,
    averaged over the rows (inputs, or inputs × tokens).

    Args:
        sigma_noise: observation noise standard deviation ``σ`` (scalar tensor or float).
    """

    full_state_update = False

    def __init__(self, sigma_noise: torch.Tensor | float) -> None:
        super().__init__()
        self.noise_var = float(torch.as_tensor(sigma_noise, dtype=torch.float64)) ** 2
        self.add_state("nll_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> None:
        """Add the NLL of a batch of rows.

        Args:
            mean: Predictive mean ``(n, [tokens, ...,] C)``.
            var: Predictive covariance of the function ``(..., C, C)``, or its diagonal (``mean``'s shape).
            y: Targets, reshaped to ``mean``'s shape.
        """
        mean = mean.detach().double()
        var = var.detach().double()
        if var.shape == mean.shape:
            var = torch.diag_embed(var)
        cov = var + self.noise_var * torch.eye(mean.shape[-1], dtype=torch.float64, device=mean.device)
        log_p = torch.distributions.MultivariateNormal(mean, covariance_matrix=cov).log_prob(
            y.detach().double().reshape(mean.shape)
        )
        self.nll_sum -= log_p.sum()
        self.rows += log_p.numel()

    def compute(self) -> torch.Tensor:
        """The mean NLL per row.

        Returns:
            The NLL summed over the ``C`` outputs, averaged over the rows (float64 scalar).
        """
        return self.nll_sum / self.rows


def regression_grid_loss(
    loss: Any, pred_type: PredType | str, sigma_noise: torch.Tensor | float, device: torch.device
) -> Any:
    """The regression grid search's score.

    Args:
        loss: The ``loss`` passed to ``optimize_prior_precision`` (``None``: the default).
        pred_type: The predictive (``"glm"`` or ``"nn"``).
        sigma_noise: The observation noise ``σ`` of the Laplace object.
        device: The Laplace object's device.

    Returns:
        ``loss``, or [`GaussianPredictiveNLL`][laplace_debiased.two_batch.gridsearch.GaussianPredictiveNLL]
        with ``sigma_noise`` if it is ``None``.

    Raises:
        ValueError: An MSE ``loss`` under the GLM predictive (it does not depend on δ).
    """
    if loss is None:
        return GaussianPredictiveNLL(sigma_noise).to(device)
    if pred_type == "glm" and isinstance(loss, (torchmetrics.MeanSquaredError, torch.nn.MSELoss)):
        raise ValueError(
            "the MSE of the GLM predictive mean does not depend on the prior precision (the mean "
            "is the MAP output), so a grid search by MSE picks the bottom of the grid. Pass "
            "loss=None (the default: the Gaussian predictive NLL with la.sigma_noise) or a score "
            "of the predictive variance, e.g. GaussianPredictiveNLL(sigma_noise) from "
            "laplace_debiased.two_batch.gridsearch."
        )
    return loss


def grid_search(
    la: ParametricLaplace,
    loss: torchmetrics.Metric | Callable[[torch.Tensor], torch.Tensor | float],
    interval: torch.Tensor,
    val_loader: DataLoader,
    pred_type: PredType | str,
    link_approx: LinkApprox | str = LinkApprox.PROBIT,
    n_samples: int = 100,
    progress_bar: bool = False,
) -> torch.Tensor:
    """Grid search over prior precisions; unlike laplace-torch 0.3 the running metric is reset
    before every grid point, so each point is scored on its own predictions.

    Classification with the GLM predictive and a probit/bridge/mc link scores the whole grid from
    one predictive pass over ``val_loader``
    ([`laplace_debiased.posterior.grid.grid_validation_scores`][laplace_debiased.posterior.grid.grid_validation_scores]);
    other settings (and dict batches) evaluate ``validate`` once per grid point, setting
    ``la.prior_precision``.

    Args:
        la: A fitted Laplace object.
        loss: The score (lower is better): a metric or ``loss(pred, y)``.
        interval: The prior precisions ``(G,)``.
        val_loader: Validation data.
        pred_type: The predictive (``"glm"`` or ``"nn"``).
        link_approx: The link approximation of the GLM predictive.
        n_samples: Samples of ``link_approx="mc"`` and of the ``"nn"`` predictive.
        progress_bar: Show a progress bar over the grid points.

    Returns:
        The chosen element of ``interval``
        ([`lowest_score_point`][laplace_debiased.two_batch.gridsearch.lowest_score_point]).
    """
    if gridsearch_supported(la, pred_type, link_approx):
        try:
            scores = grid_validation_scores(la, loss, interval, val_loader, link_approx, n_samples)
        except UnsupportedBatches:
            pass
        else:
            return lowest_score_point(interval, scores)
    results: list[float] = []
    for prior_prec in tqdm.tqdm(interval, disable=not progress_bar):
        la.prior_precision = prior_prec
        if isinstance(loss, torchmetrics.Metric):
            loss.reset()
        try:
            result = validate(
                la, val_loader, loss, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples,
                dict_key_y=la.dict_key_y,
            )
        except LinAlgError:
            result = np.inf
        except RuntimeError as err:
            if "not positive definite" not in str(err):
                raise
            result = np.inf
        results.append(result)
    return lowest_score_point(interval, results)


def lowest_score_point(interval: torch.Tensor, scores: list[float]) -> torch.Tensor:
    """The grid point of the lowest score, by the package's choice rule.

    Args:
        interval: The prior precisions searched, shape ``(G,)``, in any order.
        scores: The score of each grid point (lower is better), ``G`` numbers in the order of
            ``interval``.

    Returns:
        The element of ``interval`` that
        [`choose_prior_precision`][laplace_debiased.prior_grid.choose_prior_precision] chooses: non-finite
        scores are skipped and ties go to the smallest prior precision.  When no score is finite, the
        first element, as laplace-torch's ``argmin`` returns.
    """
    deltas = [float(d) for d in interval]
    best = choose_prior_precision(dict(zip(deltas, (float(s) for s in scores))), "nll")
    return interval[0 if best is None else deltas.index(best)]

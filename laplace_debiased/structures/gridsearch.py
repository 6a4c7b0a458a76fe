"""Prior-precision grid search of the two-batch classes (:class:`GridSearchMixin`, a base of
:class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`): one predictive pass for the
whole grid where :mod:`laplace_debiased.posterior.grid` can, else laplace-torch's ``validate``
per point with the metric reset before each.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torchmetrics
import tqdm
from laplace.utils.enums import LinkApprox, PredType
from laplace.utils.utils import validate
from torch.linalg import LinAlgError
from torch.utils.data import DataLoader

from laplace_debiased.posterior.grid import UnsupportedBatches, grid_validation_scores, gridsearch_supported


class GridSearchMixin:
    """A grid search that resets its metric and scores the grid in one pass where it can."""

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
        (:func:`laplace_debiased.posterior.grid.grid_validation_scores`); other
        settings (and dict batches) evaluate ``validate`` once per grid point."""
        if gridsearch_supported(self, pred_type, link_approx):
            try:
                scores = grid_validation_scores(
                    self, loss, interval, val_loader, link_approx, n_samples
                )
            except UnsupportedBatches:
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

"""Input checks of the two-batch fit (:class:`FitChecksMixin`, a base of
:class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`): refuse what laplace-torch
would fit silently wrong, with a message that says what to do.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from laplace.lllaplace import LLLaplace
from torch import nn

from laplace_debiased.structures.batches import Batch, batch_inputs_targets

_STOCHASTIC_LAYERS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """``"'name' (Type)"`` of every BatchNorm layer of ``model`` without running statistics
    (``track_running_stats=False``): such a layer normalises with its batch's statistics in eval
    mode too, so its output for one sample depends on the other samples of the batch."""
    return [
        f"'{name}' ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None
    ]


class FitChecksMixin:
    """Checks of the model and the fit batches before a two-batch fit."""

    def _check_override(self, override: bool) -> None:
        if isinstance(self, LLLaplace) and not override:
            raise ValueError(
                "Last-layer Laplace approximations do not support `override=False`."
            )

    def _check_model_mode(self) -> None:
        """Refuse Dropout/BatchNorm layers left in train mode, and BatchNorm layers without
        running statistics (:func:`batch_statistics_layers`), before any forward pass.

        The layers' own ``training`` flags decide, not the wrapper's: laplace-torch's
        last-layer ``FeatureExtractor`` is created in train mode around a model the user put
        in eval mode, and that model must fit (as ``LLLaplace`` does).
        """
        batch_stats = batch_statistics_layers(self.model)
        if batch_stats:
            raise ValueError(
                f"{', '.join(batch_stats)} normalise with the statistics of the batch they are given "
                "even in eval mode (track_running_stats=False), so the network's output, its curvature "
                "and the predictive for one input would depend on the batch it comes in. Build these "
                "layers with track_running_stats=True and estimate the running statistics on the "
                "training data (a pass in train mode), or replace them by LayerNorm / GroupNorm."
            )
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

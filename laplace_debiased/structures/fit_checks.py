"""Input checks of the two-batch fit (:class:`FitChecksMixin`, a base of
:class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`): refuse what laplace-torch
would fit silently wrong, with a message that says what to do.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
from laplace.lllaplace import LLLaplace
from torch import nn

from laplace_debiased.data.batch import Batch, batch_inputs_targets

_STOCHASTIC_LAYERS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
LOGIT_CHECK_ROWS = 8
"""Inputs of the first fit batch whose outputs :meth:`FitChecksMixin._check_outputs_are_logits` inspects."""


def outputs_are_probabilities(f: torch.Tensor) -> bool:
    """Whether every output row ``f[..., :]`` (``C >= 2`` classes) is a probability vector:
    entries ``>= 0`` summing to 1 within ``10 · C · eps`` of ``f``'s dtype (the round-off of a
    softmax).  Logits of a network pass this only by accident."""
    if f.ndim < 2 or f.shape[-1] < 2 or not f.is_floating_point():
        return False
    tol = 10 * f.shape[-1] * torch.finfo(f.dtype).eps
    return bool((f >= 0).all() and ((f.sum(-1) - 1).abs() <= tol).all())


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

    @torch.no_grad()
    def _check_outputs_are_logits(self, batch: Batch) -> None:
        """Refuse, for ``"classification"``, a model whose outputs on the first
        ``LOGIT_CHECK_ROWS`` inputs of ``batch`` are probabilities (a final ``nn.Softmax``):
        laplace-torch's likelihood applies the softmax itself, so the fit and the predictive
        would treat probabilities as logits."""
        if self.likelihood != "classification":
            return
        X, _ = batch_inputs_targets(batch, self.dict_key_x, self.dict_key_y)
        net = self.model.model if isinstance(self, LLLaplace) else self.model  # the wrapped network
        f = net(X[:LOGIT_CHECK_ROWS] if isinstance(X, torch.Tensor) else X)
        if outputs_are_probabilities(f):
            raise ValueError(
                "the model's outputs are probabilities (every row is >= 0 and sums to 1): it ends in a "
                "softmax. The 'classification' likelihood expects logits and applies the softmax "
                "itself; remove the final nn.Softmax (for an nn.Sequential, fit model[:-1]) and fit again."
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

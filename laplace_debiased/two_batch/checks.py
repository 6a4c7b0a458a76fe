"""Input checks of the two-batch fit: refuse what laplace-torch would fit silently wrong, with a
message that says what to do.  Plain functions of the model, the batches and the fit's options,
called by [`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace].
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence

import torch
from torch import nn

from laplace_debiased.data.batch import Batch, batch_inputs_targets

__all__ = [
    "LOGIT_CHECK_ROWS",
    "batch_statistics_layers",
    "check_batch_dtypes",
    "check_materialised",
    "check_model_mode",
    "check_outputs_are_logits",
    "check_override",
    "check_padded_targets_supported",
    "check_trainable",
    "outputs_are_probabilities",
]

_STOCHASTIC_LAYERS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
LOGIT_CHECK_ROWS = 8
"""Inputs of the first fit batch whose outputs
[`check_outputs_are_logits`][laplace_debiased.two_batch.checks.check_outputs_are_logits] inspects."""


def outputs_are_probabilities(f: torch.Tensor) -> bool:
    """Whether every output row ``f[..., :]`` is a probability vector.

    Args:
        f: Model outputs ``(..., C)`` with ``C >= 2`` classes.

    Returns:
        ``True`` if every entry is ``>= 0`` and every row sums to 1 within ``10 · C · eps`` of
        ``f``'s dtype (the round-off of a softmax).  Logits of a network pass this only by
        accident.
    """
    if f.ndim < 2 or f.shape[-1] < 2 or not f.is_floating_point():
        return False
    tol = 10 * f.shape[-1] * torch.finfo(f.dtype).eps
    return bool((f >= 0).all() and ((f.sum(-1) - 1).abs() <= tol).all())


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """The BatchNorm layers of ``model`` without running statistics.

    Such a layer (``track_running_stats=False``) normalises with its batch's statistics in eval
    mode too, so its output for one sample depends on the other samples of the batch.

    Args:
        model: The network.

    Returns:
        ``"'name' (Type)"`` of every such layer, in module order.
    """
    return [
        f"'{name}' ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None
    ]


def check_override(last_layer: bool, override: bool) -> None:
    """Refuse ``override=False`` for a last-layer approximation (as laplace-torch does).

    Args:
        last_layer: Whether the approximation is over the last layer only.
        override: The fit's ``override``.

    Raises:
        ValueError: ``last_layer`` and not ``override``.
    """
    if last_layer and not override:
        raise ValueError("Last-layer Laplace approximations do not support `override=False`.")


def check_model_mode(model: nn.Module) -> None:
    """Refuse Dropout/BatchNorm layers left in train mode, and BatchNorm layers without running
    statistics ([`batch_statistics_layers`][laplace_debiased.two_batch.checks.batch_statistics_layers]),
    before any forward pass.

    The layers' own ``training`` flags decide, not the wrapper's: laplace-torch's last-layer
    ``FeatureExtractor`` is created in train mode around a model the user put in eval mode, and
    that model must fit (as ``LLLaplace`` does).

    Args:
        model: The network (or laplace-torch's wrapper of it).

    Raises:
        ValueError: A layer normalises with batch statistics, or a stochastic layer is in train mode.
    """
    batch_stats = batch_statistics_layers(model)
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
        for name, m in model.named_modules()
        if isinstance(m, _STOCHASTIC_LAYERS) and m.training
    ]
    if stochastic:
        raise ValueError(
            "the model is in train mode and has layers that behave differently "
            f"in train mode: {', '.join(stochastic)}. Call model.eval() before "
            "fitting the Laplace approximation."
        )


def check_trainable(parameters: Iterable[nn.Parameter], last_layer: bool) -> None:
    """Refuse a fit with nothing to approximate (every parameter frozen).

    Args:
        parameters: The parameters the approximation is over (the last layer's, or the model's).
        last_layer: Whether they are the last layer's (for the message).

    Raises:
        ValueError: No parameter has ``requires_grad``.
    """
    if any(p.requires_grad for p in parameters):
        return
    if last_layer:
        raise ValueError(
            "the last layer's parameters all have requires_grad=False; a last-layer "
            "Laplace approximation is over them, so unfreeze them "
            "(p.requires_grad_(True))."
        )
    raise ValueError(
        "every parameter of the model has requires_grad=False, so there is nothing "
        "to approximate; unfreeze the parameters the posterior should cover."
    )


@torch.no_grad()
def check_outputs_are_logits(net: nn.Module, X: torch.Tensor | MutableMapping, likelihood: str) -> None:
    """Refuse a network whose output is not a tensor (a tuple or a dict, as Hugging Face models
    return), and, for ``"classification"``, one whose outputs are probabilities (a final
    ``nn.Softmax``): laplace-torch's likelihood applies the softmax itself, so the fit and the
    predictive would treat probabilities as logits.

    Args:
        net: The wrapped network (not laplace-torch's last-layer wrapper).
        X: Inputs of the first fit batch; a tensor's first ``LOGIT_CHECK_ROWS`` rows are used.
        likelihood: laplace-torch's likelihood; other than ``"classification"`` nothing is checked.

    Raises:
        TypeError: The network returns something other than a tensor (a tuple, a dict).
        ValueError: Every output row is a probability vector ([`outputs_are_probabilities`][laplace_debiased.two_batch.checks.outputs_are_probabilities]).
    """
    f = net(X[:LOGIT_CHECK_ROWS] if isinstance(X, torch.Tensor) else X)
    if not isinstance(f, torch.Tensor):
        raise TypeError(
            f"the model returns a {type(f).__name__}, not a tensor: laplace-torch needs model(x) to "
            "return the outputs (batch, [tokens,] outputs). Hugging Face models return a tuple or a "
            "dict (ModelOutput); wrap the model in an nn.Module whose forward returns the logits, "
            "e.g. `return self.model(**x).logits`, and fit the wrapper."
        )
    if likelihood == "classification" and outputs_are_probabilities(f):
        raise ValueError(
            "the model's outputs are probabilities (every row is >= 0 and sums to 1): it ends in a "
            "softmax. The 'classification' likelihood expects logits and applies the softmax "
            "itself; remove the final nn.Softmax (for an nn.Sequential, fit model[:-1]) and fit again."
        )


def check_materialised(model: nn.Module) -> None:
    """Refuse a model whose parameters or buffers are on the meta device (built under
    ``torch.device("meta")``, e.g. to load a large model): they have shapes but no values.

    Args:
        model: The network.

    Raises:
        ValueError: Naming the first such tensor and how to materialise the model.
    """
    meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(
            f"the model's parameters are on the meta device ({len(meta)} tensor(s), the first "
            f"'{meta[0]}'): they have no values to fit a Laplace approximation at. Materialise the "
            "model first: model.to_empty(device=...) and then load its trained weights "
            "(model.load_state_dict(state)), or load it with weights directly."
        )


def check_batch_dtypes(
    batches: Sequence[Batch], dtype: torch.dtype, likelihood: str, dict_key_x: str, dict_key_y: str
) -> None:
    """Refuse floating inputs, and regression targets, of another dtype than the model's.

    Args:
        batches: Loader batches.
        dtype: The model's dtype.
        likelihood: laplace-torch's likelihood (targets are checked for ``"regression"``).
        dict_key_x: Key of the inputs in a mapping batch (laplace-torch's ``dict_key_x``).
        dict_key_y: Key of the targets in a mapping batch.

    Raises:
        ValueError: A batch's inputs or regression targets have another dtype.
    """
    for batch in batches:
        X, y = batch_inputs_targets(batch, dict_key_x, dict_key_y)
        x = X[dict_key_x] if isinstance(X, MutableMapping) else X
        if x.is_floating_point() and x.dtype != dtype:
            raise ValueError(
                f"inputs have dtype {x.dtype} but the model has {dtype}; convert "
                f"the data (e.g. X.to({dtype})) or the model."
            )
        if likelihood == "regression" and y.dtype != dtype:
            raise ValueError(f"regression targets have dtype {y.dtype} but the model has {dtype}.")


def check_padded_targets_supported(single_pass_fisher: str | None, backend: object, asdl_fisher_kwargs: dict) -> None:
    """Refuse padded targets (-100) where laplace-torch's backend computes the K-FAC factors: it
    would count the padded positions in the curvature. The package's own passes leave them out.

    Args:
        single_pass_fisher: The curvature type of the package's shared K-FAC pass for this
            backend, ``None`` where the backend computes the factors.
        backend: laplace-torch's curvature backend (for the message).
        asdl_fisher_kwargs: laplace-torch's ``asdl_fisher_kwargs`` (for the message).

    Raises:
        ValueError: ``single_pass_fisher`` is ``None``.
    """
    if single_pass_fisher is None:
        raise ValueError(
            f"the fit batches have padded targets (-100), which {type(backend).__name__} "
            f"(with asdl_fisher_kwargs={asdl_fisher_kwargs}) would count in the K-FAC factors. "
            "Use the default CurvlinopsGGN (stochastic=False) or CurvlinopsEF backend without "
            "asdl_fisher_kwargs, which leave padded positions out, or remove the padded positions."
        )

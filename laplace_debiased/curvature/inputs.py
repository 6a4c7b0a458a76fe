"""Input plumbing of the eigen-structured curvature
([`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen]): batches of tensor or mapping inputs,
their rows and output rows (token outputs), the trainable parameters, argument checks, and the hooks
``torch.func`` cannot trace.

A batch's input ``X`` is a tensor or a mapping (a dict or a Hugging Face ``BatchEncoding``) that
the model consumes whole, ``model(X)`` (laplace-torch's ``dict_key_x``/``dict_key_y``
convention; the targets come separately).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call

from laplace_debiased.curvature.kfac import output_rows, padded_rows

Inputs = Tensor | Mapping[str, Any]
Batch = tuple[Inputs, Tensor]
Curvature = Literal["ggn", "ef"]

CURVATURES = ("ggn", "ef")
LIKELIHOODS = ("classification", "regression")


def loss_factor(likelihood: str) -> float:
    """laplace-torch's conversion factor from the torch loss to the negative log likelihood."""
    check_likelihood(likelihood)
    return 1.0 if likelihood == "classification" else 0.5


def check_likelihood(likelihood: str) -> None:
    """Check that ``likelihood`` is one of [`LIKELIHOODS`][laplace_debiased.curvature.inputs.LIKELIHOODS].

    Args:
        likelihood: laplace-torch's likelihood name.

    Raises:
        ValueError: for any other name.
    """
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}.")


def check_curvature(curvature: str) -> None:
    """Check that ``curvature`` is one of [`CURVATURES`][laplace_debiased.curvature.inputs.CURVATURES].

    Args:
        curvature: ``"ggn"`` (generalised Gauss-Newton) or ``"ef"`` (empirical Fisher).

    Raises:
        ValueError: for any other name.
    """
    if curvature not in CURVATURES:
        raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}.")


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Detached parameters of ``model`` that require grad, in ``named_parameters()`` order."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("The model has no parameters with requires_grad=True.")
    return params


def count_samples(batches: Sequence[Batch]) -> int:
    """Total number of samples in a batch list (sequences for token outputs)."""
    return sum(len(y) for _, y in batches)


def functional_model(
    model: nn.Module, params: Sequence[Tensor] | None = None
) -> tuple[Callable[[dict[str, Tensor], Inputs], Tensor], dict[str, Tensor]]:
    """``(fn, θ)``: ``fn(θ, X) = model(X)`` as a pure function (``torch.func.functional_call``)
    of the parameters ``params`` by name (default: the trainable ones,
    [`trainable_parameters`][laplace_debiased.curvature.inputs.trainable_parameters]), the other parameters
    and the buffers held at their current values; ``θ`` the detached current values of ``params``, in their
    order."""
    if params is None:
        theta = trainable_parameters(model)
    else:
        names = {id(p): k for k, p in model.named_parameters()}
        if any(id(p) not in names for p in params):
            raise ValueError("every Laplace parameter must be a parameter of the model")
        theta = {names[id(p)]: p.detach() for p in params}
    fixed = {k: v.detach() for k, v in model.named_parameters() if k not in theta}
    fixed.update(dict(model.named_buffers()))

    def fn(th: dict[str, Tensor], X: Inputs) -> Tensor:
        return functional_call(model, {**fixed, **th}, (X,))

    return fn, theta


def parameter_count(model: nn.Module) -> int:
    """Number ``P`` of trainable parameters (the dimension of the curvature)."""
    return sum(p.numel() for p in trainable_parameters(model).values())


@torch.no_grad()
def _sample_output_shape(model: nn.Module, X: Inputs) -> tuple[int, ...]:
    """Per-sample output shape ``([tokens, ...,] C)`` of ``model``, from the first row of ``X``."""
    return tuple(model(take_rows(X, slice(0, 1))).shape[1:])


def target_rows(model: nn.Module, X: Inputs, y: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The targets of a batch with one row per output row
    ([`output_rows`][laplace_debiased.curvature.kfac.output_rows], which checks their shape against the
    model's output), and the per-sample output shape ``([tokens, ...,] C)``. One forward pass of a single
    sample."""
    shape = _sample_output_shape(model, X)
    proxy = torch.empty((), dtype=torch.float32, device=y.device).expand(len(y), *shape)
    return output_rows(proxy, y)[1], shape


def count_rows(model: nn.Module, batches: Sequence[Batch]) -> int:
    """Total number of output rows (loss terms) of the batches: samples × tokens per sample."""
    return sum(len(target_rows(model, X, y)[0]) for X, y in batches)


def unpadded_samples(batches: Sequence[tuple[Any, Tensor]]) -> list[tuple[Any, Tensor]]:
    """The batches without their samples whose target is a padded position (class label -100,
    [`padded_rows`][laplace_debiased.curvature.kfac.padded_rows]; targets with one row per sample): those
    have no loss term, so they add no curvature (curvlinops' loss-Hessian square root does not
    look at the label). A batch left without samples is dropped."""
    out = []
    for X, y in batches:
        padded = padded_rows(y)
        if not padded.any():
            out.append((X, y))
        elif not padded.all():
            keep = (~padded).nonzero().squeeze(1)
            out.append((take_rows(X, keep), y[keep]))
    return out


class TokenRows(nn.Module):
    """``model`` on ``{"x": X, "rows": r}`` with its outputs ``(n, tokens, C)`` as the ``r``
    rows ``(r, C)``, so that curvlinops' losses see one row per loss term and weight a batch's
    mean loss by its ``r`` rows (``batch_size_fn``,
    [`token_rows_batch_size`][laplace_debiased.curvature.inputs.token_rows_batch_size]); with ``"keep"``
    (indices of the rows that are not padded positions) only those rows.

    Args:
        model: a network with token outputs ``(n, tokens, C)``.

    Attributes:
        model: the wrapped network.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Mapping[str, Any]) -> Tensor:
        f = self.model(inputs["x"])
        rows = f.reshape(-1, f.shape[-1])
        return rows[inputs["keep"]] if "keep" in inputs else rows


def is_mapping(X: Inputs) -> bool:
    """True for mapping inputs (dict, ``BatchEncoding``), which the model consumes whole."""
    return isinstance(X, Mapping)


def mapping_rows(X: Mapping[str, Any]) -> int:
    """Number of samples of a mapping input: the leading size of its first tensor."""
    for value in X.values():
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    raise ValueError(f"mapping input with keys {sorted(X)} holds no tensor with a batch dimension.")


def take_rows(X: Inputs, rows: slice) -> Inputs:
    """Rows ``rows`` of a tensor input, or of every batch-sized tensor of a mapping input
    (other entries are kept; the mapping keeps its type, e.g. ``BatchEncoding``)."""
    if not is_mapping(X):
        return X[rows]
    n = mapping_rows(X)
    out = copy.copy(X)
    for key, value in X.items():
        if isinstance(value, Tensor) and value.ndim > 0 and value.shape[0] == n:
            out[key] = value[rows]
    return out


def check_finite(t: Tensor, what: str) -> None:
    """Check that every entry of ``t`` is finite.

    Args:
        t: any tensor that a curvature is formed from (inputs, outputs, Jacobians).
        what: its name in the error message, in the plural (``"the inputs"``).

    Raises:
        ValueError: if ``t`` holds a NaN or an Inf.
    """
    if not torch.isfinite(t).all():
        raise ValueError(
            f"{what} contain NaN or Inf, so the curvature is undefined; check the data and the "
            "model (for a last layer: its input features) for overflow or NaN weights."
        )


@contextmanager
def backward_hooks_detached(model: nn.Module) -> Iterator[None]:
    """Detach every module backward hook of ``model`` for the duration of the block.

    BackPACK's ``extend`` installs full backward hooks; ``torch.func`` transforms cannot trace
    them (``autograd.Function`` without ``setup_context``). Outside a ``backpack(...)`` context
    those hooks compute nothing, so the curvature is unchanged. Restored on exit.
    """
    saved = [(m, m._backward_hooks, m._backward_pre_hooks) for m in model.modules()]
    try:
        for m, _, _ in saved:
            m._backward_hooks, m._backward_pre_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, hooks, pre_hooks in saved:
            m._backward_hooks, m._backward_pre_hooks = hooks, pre_hooks


def functorch_unsupported(err: Exception) -> bool:
    """Whether ``err`` says a ``torch.func`` transform cannot handle an operation of the model.

    Args:
        err: the exception a ``torch.func`` transform (``vmap``, ``jacfwd``, ``jvp``) raised.

    Returns:
        True for ``NotImplementedError`` and for errors that name forward AD, ``vmap``,
        functorch or ``setup_context``; the callers then take a route without ``torch.func``.
    """
    text = str(err)
    return isinstance(err, NotImplementedError) or any(
        s in text for s in ("forward AD", "vmap", "functorch", "setup_context")
    )


def token_rows_batch_size(inputs: Mapping[str, Any]) -> int:
    """curvlinops' ``batch_size_fn`` for the inputs of
    [`TokenRows`][laplace_debiased.curvature.inputs.TokenRows].

    Args:
        inputs: ``{"x": X, "rows": r[, "keep": keep]}``.

    Returns:
        The number ``r`` of output rows (loss terms) of the batch.
    """
    return inputs["rows"]


def output_width(model: nn.Module, batches: Sequence[Batch]) -> int:
    """Output width ``C`` of ``model`` (one forward pass of the first sample of the first batch).

    Args:
        model: the network; its per-sample output has shape ``([tokens, ...,] C)``.
        batches: ``(X, y)`` pairs; only the first sample of the first is used.

    Returns:
        ``C``, the last dimension of the per-sample output.
    """
    return _sample_output_shape(model, batches[0][0])[-1]

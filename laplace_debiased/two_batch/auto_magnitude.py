"""``n_magnitude_batches="auto"`` of the debiased K-FAC structures over all weights: the rows the
direction batches give each K-FAC factor, counted on the model (the rule and its record are in
[`laplace_debiased.two_batch.magnitude_rule`][laplace_debiased.two_batch.magnitude_rule]), and the model's
per-sample output shape.  Plain functions of the model, the batches and laplace-torch's backend, called by
[`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace]."""

from __future__ import annotations

from collections.abc import Callable

import torch
from laplace.curvature.curvature import CurvatureInterface, EFInterface
from torch import nn

from laplace_debiased.two_batch.magnitude_rule import AutoMagnitude, FactorRowCount, auto_magnitude_batches
from laplace_debiased.curvature.attention import AttentionProjection, is_conv1d
from laplace_debiased.curvature.dense_blocks import block_dims
from laplace_debiased.curvature.kfac import layer_positions
from laplace_debiased.curvature.layer_blocks import named_curvature_modules
from laplace_debiased.data.batch import Batch, batch_inputs_targets
from laplace_debiased.two_batch.checks import check_batch_dtypes

__all__ = ["auto_magnitude_rule", "factor_row_counts", "output_columns", "sample_output_shape"]


@torch.no_grad()
def sample_output_shape(model: nn.Module, batch: Batch, dict_key_x: str, dict_key_y: str) -> tuple[int, ...]:
    """Per-sample output shape of ``model``, ``([tokens, ...,] C)``.

    Args:
        model: The network.
        batch: A loader batch; its first sample is forwarded (the whole batch for dict inputs).
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        The output shape without the batch dimension.
    """
    X, _ = batch_inputs_targets(batch, dict_key_x, dict_key_y)
    out = model(X[:1] if isinstance(X, torch.Tensor) else X)
    return tuple(out.shape[1:])


def output_columns(backend: CurvatureInterface, likelihood: str, n_outputs: int, asdl_fisher_kwargs: dict) -> int:
    """Rows each output row adds to an output-side factor
    ([`laplace_debiased.two_batch.magnitude_rule`][laplace_debiased.two_batch.magnitude_rule]).

    Args:
        backend: laplace-torch's curvature backend.
        likelihood: laplace-torch's likelihood.
        n_outputs: ``C``.
        asdl_fisher_kwargs: laplace-torch's ``asdl_fisher_kwargs`` (``mc_samples``).

    Returns:
        ``C - 1`` for the cross-entropy GGN, ``C`` for the MSE GGN, 1 for the empirical Fisher,
        ``mc_samples`` for the MC Fisher.
    """
    if isinstance(backend, EFInterface):
        return 1
    if getattr(backend, "stochastic", False):
        return int(asdl_fisher_kwargs.get("mc_samples", 1))
    return max(n_outputs - 1, 1) if likelihood == "classification" else n_outputs


def factor_row_counts(
    model: nn.Module,
    layers: nn.Module,
    direction: list[Batch],
    columns: Callable[[int], int],
    *,
    dtype: torch.dtype,
    likelihood: str,
    dict_key_x: str,
    dict_key_y: str,
) -> list[FactorRowCount]:
    """Dimension and rows from B of the input and output factor of every ``Linear`` / ``Conv2d`` /
    GPT-2 ``Conv1D`` layer and attention projection (``"<attention>.in_proj"``, ``".out_proj"``)
    with trainable parameters (one forward pass per batch of B).

    Args:
        model: The network.
        layers: Its layers with the K-FAC blocks (laplace-torch's backend model).
        direction: The batches of B.
        columns: Rows per output row of an output-side factor, of ``C``
            ([`output_columns`][laplace_debiased.two_batch.auto_magnitude.output_columns]).
        dtype: The model's dtype (the batches are checked against it).
        likelihood: laplace-torch's likelihood.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        Per layer, the output factor's count, then (layers with an input factor) the input factor's.
    """
    check_batch_dtypes(direction, dtype, likelihood, dict_key_x, dict_key_y)
    named = [(name or type(m).__name__, m) for name, m in named_curvature_modules(layers)
             if isinstance(m, (nn.Linear, nn.Conv2d, AttentionProjection)) or is_conv1d(m)]
    names = {id(m): name for name, m in named}
    modules = [m for _, m in named]
    positions = [0] * len(modules)
    for b in direction:
        X, _ = batch_inputs_targets(b, dict_key_x, dict_key_y)
        positions = [p + q for p, q in zip(positions, layer_positions(model, modules, X))]
    output_shape = sample_output_shape(model, direction[0], dict_key_x, dict_key_y)
    n_columns = columns(output_shape[-1] if output_shape else 1)
    counts = []
    for m, rows in zip(modules, positions):
        d_out, d_in = block_dims(m)
        counts.append(FactorRowCount(names[id(m)], "output", d_out, rows * n_columns, len(direction)))
        if d_in is not None:
            counts.append(FactorRowCount(names[id(m)], "input", d_in, rows, len(direction)))
    return counts


def auto_magnitude_rule(
    model: nn.Module,
    backend: Callable[[], CurvatureInterface],
    *,
    last_layer: bool,
    owner: str,
    likelihood: str,
    dtype: torch.dtype,
    asdl_fisher_kwargs: dict,
    dict_key_x: str,
    dict_key_y: str,
) -> Callable[[list[Batch]], AutoMagnitude]:
    """The rule of ``n_magnitude_batches="auto"``: B's batches to
    [`auto_magnitude_batches`][laplace_debiased.two_batch.magnitude_rule.auto_magnitude_batches] of their
    [`factor_row_counts`][laplace_debiased.two_batch.auto_magnitude.factor_row_counts].

    Args:
        model: The network.
        backend: Gives laplace-torch's curvature backend (its model holds the K-FAC layers) when
            the rule runs.
        last_layer: Whether the approximation is over the last layer (refused).
        owner: The Laplace class's name (for the message).
        likelihood: laplace-torch's likelihood.
        dtype: The model's dtype.
        asdl_fisher_kwargs: laplace-torch's ``asdl_fisher_kwargs``.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        The function of the direction batches that
        [`split_batches`][laplace_debiased.two_batch.batches.split_batches] calls.

    Raises:
        ValueError: ``last_layer``.
    """
    if last_layer:
        raise ValueError(
            "n_magnitude_batches='auto' is implemented for subset_of_weights='all' (debiased_kron, "
            f"debiased_ekfac), not for the last-layer {owner}. Pass an integer "
            "n_magnitude_batches; la.coverage after a fit tells whether B ∪ B̃ reached every factor."
        )

    def rule(direction: list[Batch]) -> AutoMagnitude:
        curvature = backend()

        def columns(n_outputs: int) -> int:
            return output_columns(curvature, likelihood, n_outputs, asdl_fisher_kwargs)

        return auto_magnitude_batches(factor_row_counts(
            model, curvature._model, direction, columns, dtype=dtype, likelihood=likelihood,
            dict_key_x=dict_key_x, dict_key_y=dict_key_y,
        ))

    return rule

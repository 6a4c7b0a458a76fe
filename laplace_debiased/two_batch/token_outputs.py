"""laplace-torch's GLM predictive for token outputs ``(n, tokens, C)``, and per-example Jacobians
(functions called by [`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace]).

Token outputs ``(n, tokens, C)`` (``la.fit_output_shape`` has more than one entry), every
token an output: laplace-torch's GLM predictive takes ``(n, C)`` outputs, so the adapter hands
it the token rows ``(n·tokens, C)`` with their Jacobians
([`token_jacobians`][laplace_debiased.two_batch.token_outputs.token_jacobians]) and gives the results the
token shape back ([`token_shaped`][laplace_debiased.two_batch.token_outputs.token_shaped]): ``la(x)``
``(n, tokens, C)`` (regression: mean and covariance ``(n, tokens, C, C)``; ``joint=True`` stays flat over the
rows), GLM samples ``(S, n, tokens, C)``. Tokens of one input are independent under this predictive only in
the sense laplace-torch's LLM examples use: each token's marginal ``N(f_t, J_t P⁻¹ J_tᵀ)``. The GLM functional
samples come from a float64 square root (laplace-torch's float32 Cholesky fails at small prior precision).

Outputs ``(n, C)`` of a tensor input, all weights, without ``enable_backprop``: the Jacobians are
per-example
([`laplace_debiased.posterior.jacobians.logit_jacobians`][laplace_debiased.posterior.jacobians.logit_jacobians]),
so the memory of the GLM predictive grows linearly with ``n``; laplace-torch's ``torch.func.jacrev`` over the
batch pushes all ``n·C`` cotangents through all ``n`` inputs, quadratic in ``n``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from laplace.curvature import CurvatureInterface
from torch import nn

from laplace_debiased.curvature.inputs import backward_hooks_detached
from laplace_debiased.posterior.jacobians import logit_jacobians

__all__ = ["per_example_jacobians", "token_jacobians", "token_regression_normaliser", "token_shaped"]


def token_regression_normaliser(
    tokens: int, n_data: int, n_outputs: int, sigma_noise: torch.Tensor
) -> torch.Tensor:
    """What laplace-torch's Gaussian log likelihood leaves out for token outputs.

    laplace-torch's normaliser counts ``n_data · C`` outputs; token outputs have
    ``n_data · tokens · C``.

    Args:
        tokens: Tokens per input (the product of the output shape without ``C``).
        n_data: Training inputs ``N``.
        n_outputs: ``C``.
        sigma_noise: The observation noise ``σ`` (scalar tensor).

    Returns:
        ``-(tokens - 1) · N · C · log(σ √(2π))``, to add to laplace-torch's log likelihood.
    """
    return -(tokens - 1) * n_data * n_outputs * torch.log(sigma_noise * math.sqrt(2 * math.pi))


def per_example_jacobians(
    model: nn.Module, params: list[torch.Tensor], X: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jacobians and outputs from per-example Jacobians
    ([`laplace_debiased.posterior.jacobians.logit_jacobians`][laplace_debiased.posterior.jacobians.logit_jacobians]):
    memory linear in ``n``,
    where laplace-torch's ``torch.func.jacrev`` over the batch pushes all ``n·C`` cotangents
    through all ``n`` inputs (memory quadratic in ``n``).

    Args:
        model: The network.
        params: The parameters of the approximation, in order.
        X: Inputs ``(n, ...)``.

    Returns:
        Jacobians ``(n, C, P)`` (in the order of ``params``) and outputs ``(n, C)``.
    """
    f, layers = logit_jacobians(model, params, X)
    Js = torch.cat([layer.full().expand(len(f), -1, -1) for layer in layers], dim=-1)
    return Js, f


def token_jacobians(
    model: nn.Module, backend: CurvatureInterface, X: Any, *, last_layer: bool, enable_backprop: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Jacobians and outputs of the token rows.

    Last layer: ``J = I_C ⊗ φᵀ`` (and ``I_C`` for a bias) per token feature ``φ``,
    laplace-torch's ``last_layer_jacobians`` per row; all weights: laplace-torch's
    ``torch.func`` Jacobians (``CurvatureInterface.jacobians``, over every output entry)
    reshaped, whatever the backend: ASDL's and BackPack's ``jacobians`` differentiate
    ``f[:, i]`` for ``i < output_size``, which for outputs ``(n, tokens, C)`` is token ``i``,
    not class ``i``.

    Args:
        model: laplace-torch's model (its ``FeatureExtractor`` for a last layer).
        backend: laplace-torch's curvature backend.
        X: Inputs of ``n`` sequences.
        last_layer: Whether the approximation is over the last layer.
        enable_backprop: laplace-torch's ``enable_backprop``.

    Returns:
        Jacobians ``(n·tokens, C, P)``, outputs ``(n·tokens, C)`` and the row shape ``(n, tokens)``.
    """
    if last_layer:
        f, phi = model.forward_with_features(X)
        phi = phi.reshape(-1, phi.shape[-1])
        eye = torch.eye(f.shape[-1], device=f.device, dtype=f.dtype)
        Js = torch.einsum("kp,ij->kijp", phi, eye).flatten(2)
        if model.last_layer.bias is not None:
            Js = torch.cat([Js, eye.expand(len(phi), -1, -1)], dim=2)
    else:
        with backward_hooks_detached(model):  # BackPACK's hooks defeat torch.func
            Js, f = CurvatureInterface.jacobians(backend, X, enable_backprop=enable_backprop)
    C = f.shape[-1]
    return Js.reshape(-1, C, Js.shape[-1]), f.reshape(-1, C), tuple(f.shape[:-1])


def token_shaped(t: torch.Tensor, shape: tuple[int, ...] | None, leading: int = 0) -> torch.Tensor:
    """``t`` with its row dimension back in the token shape.

    Args:
        t: A result of the GLM predictive over token rows, rows after ``leading`` dimensions.
        shape: The row shape ``(n, tokens)`` of the last GLM predictive; ``None`` for ``(n, C)``
            outputs.
        leading: Dimensions before the rows (1 for samples ``(S, rows, C)``).

    Returns:
        ``t`` reshaped to ``(*leading, n, tokens, ...)``; unchanged for ``shape=None`` and for
        ``t`` already in token shape (laplace-torch's mc link averages shaped samples).
    """
    if shape is None or t.shape[leading] != math.prod(shape):
        return t
    return t.reshape(*t.shape[:leading], *shape, *t.shape[leading + 1 :])

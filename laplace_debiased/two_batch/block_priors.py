"""Layerwise marginal-likelihood prior tuning with one prior precision per curvature block.

``debiased_kron`` and ``debiased_ekfac`` over all weights keep a normalisation layer's weight and
bias in one dense curvature block
([`laplace_debiased.curvature.layer_blocks`][laplace_debiased.curvature.layer_blocks]), so the two tensors
take one prior precision: the posterior precision of the block is ``G + δ I`` over both. A per-tensor
("layerwise") prior then has one free value per *block*, and laplace-torch's marglik loop, which moves every
tensor's value on its own, would give the two tensors different values.

[`block_marglik`][laplace_debiased.two_batch.block_priors.block_marglik] runs that loop over the blocks
instead ([`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace] calls it where
[`prior_spans`][laplace_debiased.two_batch.block_priors.prior_spans] has a block of several tensors): it
optimises ``log δ_b``, one per block ``b``, with Adam on ``-log p(D | δ)``, evaluated at the per-tensor vector
that repeats ``δ_b`` over the tensors of block ``b``. The gradient of a block's value is the sum of its
tensors' gradients, the derivative of the marginal likelihood along the tied direction. Every
other call (a scalar or diagonal prior, grid search, a model without spanning blocks) is
laplace-torch's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from laplace_debiased.curvature.layer_blocks import block_deltas, block_spans

__all__ = ["block_marglik", "prior_spans"]


def prior_spans(block_modules: list[nn.Module] | None, n_layers: int) -> list[int]:
    """Parameter tensors per curvature block, in parameter order.

    Args:
        block_modules: The layers of the curvature blocks, in block order (K-FAC structures over
            all weights); ``None`` for structures with a block per tensor or no blocks.
        n_layers: Parameter tensors of the approximation (laplace-torch's ``n_layers``).

    Returns:
        One count per block (all 1 where ``block_modules`` is ``None``).
    """
    if block_modules is None:
        return [1] * n_layers
    return block_spans(block_modules)


def block_marglik(
    log_marginal_likelihood: Callable[[torch.Tensor], torch.Tensor],
    spans: list[int],
    init_prior_prec: float | torch.Tensor,
    n_steps: int,
    lr: float,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Adam on ``log δ_b`` (one per block), the marginal likelihood evaluated at the per-tensor
    precisions (module docstring).

    Args:
        log_marginal_likelihood: ``log p(D | δ)`` of a per-tensor prior precision vector
            ``(sum(spans),)``, differentiable in it.
        spans: Parameter tensors per block
            ([`prior_spans`][laplace_debiased.two_batch.block_priors.prior_spans]).
        init_prior_prec: A scalar, one value per block, or one per tensor with equal values
            within each block.
        n_steps: Adam steps.
        lr: Adam's learning rate.
        device: Device of the prior precision.
        dtype: dtype of the prior precision.

    Returns:
        The per-tensor prior precision ``(sum(spans),)``, each block's value repeated over its tensors.

    Raises:
        ValueError: ``init_prior_prec`` has another number of values.
    """
    repeats = torch.tensor(spans, device=device)
    init = torch.as_tensor(init_prior_prec, device=device, dtype=dtype).reshape(-1)
    if len(init) == 1:
        init = init.expand(len(spans))
    elif len(init) == sum(spans):
        init = block_deltas(init, spans)
    elif len(init) != len(spans):
        raise ValueError(
            f"init_prior_prec has {len(init)} values; a layerwise prior here takes one value, one per "
            f"curvature block ({len(spans)}) or one per parameter tensor ({sum(spans)})."
        )
    log_delta = init.log().detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([log_delta], lr=lr)
    for _ in range(n_steps):
        optimizer.zero_grad()
        (-log_marginal_likelihood(log_delta.exp().repeat_interleave(repeats))).backward()
        optimizer.step()
    return log_delta.detach().exp().repeat_interleave(repeats)

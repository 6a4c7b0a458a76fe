"""Layerwise marginal-likelihood prior tuning with one prior precision per curvature block.

``debiased_kron`` and ``debiased_ekfac`` over all weights keep a normalisation layer's weight and
bias in one dense curvature block (:mod:`laplace_debiased.curvature.layer_blocks`), so the two tensors
take one prior precision: the posterior precision of the block is ``G + δ I`` over both. A
per-tensor ("layerwise") prior then has one free value per *block*, and laplace-torch's marglik
loop, which moves every tensor's value on its own, would give the two tensors different values.

:class:`BlockPriorMixin` runs that loop over the blocks instead: it optimises ``log δ_b``, one per
block ``b``, with Adam on ``-log p(D | δ)``, evaluated at the per-tensor vector that repeats
``δ_b`` over the tensors of block ``b``. The gradient of a block's value is the sum of its
tensors' gradients, the derivative of the marginal likelihood along the tied direction. Every
other call (a scalar or diagonal prior, grid search, a model without spanning blocks) is
laplace-torch's own.
"""

from __future__ import annotations

from typing import Any

import torch
from laplace.lllaplace import LLLaplace

from laplace_debiased.curvature.layer_blocks import block_deltas, block_spans

__all__ = ["BlockPriorMixin"]


class BlockPriorMixin:
    """``optimize_prior_precision(method="marglik", prior_structure="layerwise")`` with one prior
    precision per curvature block (module docstring); a base of
    :class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`."""

    def optimize_prior_precision(
        self,
        pred_type: Any = "glm",
        method: Any = "marglik",
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: float | torch.Tensor = 1.0,
        prior_structure: Any = "scalar",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """laplace-torch's ``optimize_prior_precision``, except that ``method="marglik"`` with
        ``prior_structure="layerwise"`` on a curvature whose blocks span several parameter tensors
        optimises one value per block (:meth:`_block_marglik`); ``init_prior_prec`` is then a
        scalar, one value per block, or one per tensor with equal values within each block."""
        spans = self._prior_spans() if method == "marglik" and prior_structure == "layerwise" else []
        if all(span == 1 for span in spans):
            return super().optimize_prior_precision(
                pred_type, method, n_steps, lr, init_prior_prec, prior_structure, *args, **kwargs
            )
        self._block_marglik(spans, init_prior_prec, n_steps, lr)
        return None

    def _prior_spans(self) -> list[int]:
        """Parameter tensors per curvature block, in parameter order (all 1 for structures whose
        curvature has a block per tensor or no blocks)."""
        kfac_modules = getattr(self, "_kfac_modules", None)
        if kfac_modules is None or isinstance(self, LLLaplace):
            return [1] * self.n_layers
        return block_spans(kfac_modules())

    def _block_marglik(self, spans: list[int], init_prior_prec: float | torch.Tensor, n_steps: int, lr: float) -> None:
        """Adam on ``log δ_b`` (one per block) for ``n_steps`` steps at learning rate ``lr``, the
        marginal likelihood evaluated at the per-tensor precisions; sets ``self.prior_precision``
        to the per-tensor vector (length ``n_layers``)."""
        repeats = torch.tensor(spans, device=self._device)
        init = torch.as_tensor(init_prior_prec, device=self._device, dtype=self._dtype).reshape(-1)
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
            (-self.log_marginal_likelihood(prior_precision=log_delta.exp().repeat_interleave(repeats))).backward()
            optimizer.step()
        self.prior_precision = log_delta.detach().exp().repeat_interleave(repeats)

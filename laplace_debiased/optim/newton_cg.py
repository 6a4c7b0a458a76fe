"""Hessian-free (Newton-CG) optimizer on mini-batch quadratics, single-batch or debiased.

Each [`NewtonCG.step`][laplace_debiased.optim.newton_cg.NewtonCG.step] builds the quadratic model of
``q(θ; B) = mean loss on B + β/2‖θ‖²`` around the current θ (see
[`laplace_debiased.curvature.operators`][laplace_debiased.curvature.operators]), runs ``max_iter`` CG
iterations on ``(H_B + βI + λI) x = −∇q(θ; B)`` and moves θ ← θ + lr·x:

- ``debiased=False`` (single-batch, the usual Hessian-free step): ``x`` is the CG iterate.
- ``debiased=True``: the directions come from CG on ``B`` and the step sizes are re-measured
  on an independent batch ``B̃``
  ([`laplace_debiased.optim.cg.debiased_cg`][laplace_debiased.optim.cg.debiased_cg]); ``x`` is the debiased
  iterate. Costs one extra curvature-vector product (on ``B̃``) per CG iteration.

Step protocol (the usual ``torch.optim`` loop, no ``loss.backward()`` needed)::

    opt = NewtonCG(model, nn.CrossEntropyLoss(), loader=train_loader, debiased=True)
    for _ in range(n_steps):
        opt.step()                       # draws B (and B̃) from ``loader`` itself

or pass the batches: ``opt.step(batch)`` (single-batch) / ``opt.step(batch, batch_tilde)``
(debiased), each an ``(X, y)`` pair or a list of pairs. Drawing from the loader, the
single-batch optimizer merges ``batches_per_step`` (default 2) consecutive loader batches into
``B`` so that both variants see the same amount of data per step (the paper's comparison of a
batch of ``2b`` against two batches of ``b``); the debiased one uses one loader batch each for
``B`` and ``B̃``. ``closure``, if given, is called after the update (with gradients enabled)
and its value returned, e.g. to log a loss; otherwise ``step`` returns ``q(θ_old; B)``.
Details of the last step (the CG result, the batch quadratics' values) are in
[`NewtonCG.last_step`][laplace_debiased.optim.newton_cg.NewtonCG.last_step]. Curvature: ``"ggn"`` (default,
positive semi-definite) or ``"hessian"`` (indefinite: CG stops before a direction of non-positive curvature,
see [`laplace_debiased.optim.cg`][laplace_debiased.optim.cg]). Damping λ defaults to 0, as in the paper.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from laplace_debiased.optim.cg import CGResult, DebiasedCGResult, cg, debiased_cg
from laplace_debiased.curvature.operators import (
    Batch,
    CountingOperator,
    MiniBatchQuadratic,
    mini_batch_quadratic,
)


@dataclass
class StepInfo:
    """What one [`NewtonCG.step`][laplace_debiased.optim.newton_cg.NewtonCG.step] did.

    Attributes:
        result: the CG (or debiased CG) result; ``result.x`` is the step before ``lr``.
        quadratic: the quadratic on ``B`` (the direction batch).
        quadratic_tilde: the quadratic on ``B̃`` (debiased only, else ``None``).
        update: the applied update ``lr·x``, flat ``[D]``.

    The quadratics' ``gradient``/``value``/``theta`` are those at the old θ; their curvature
    operators read the parameters by reference, i.e. act at the *new* θ after the step.
    """

    result: CGResult | DebiasedCGResult
    quadratic: MiniBatchQuadratic
    quadratic_tilde: MiniBatchQuadratic | None
    update: Tensor


def _as_batches(batch: Batch | list[Batch]) -> list[Batch]:
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], Tensor):
        return [batch]
    batches = list(batch)
    if not batches or not all(isinstance(b, tuple | list) and len(b) == 2 for b in batches):
        raise TypeError("a batch must be an (X, y) pair or a non-empty list of (X, y) pairs")
    return [tuple(b) for b in batches]


def _merge(batches: list[Batch]) -> list[Batch]:
    return [(torch.cat([X for X, _ in batches]), torch.cat([y for _, y in batches]))]


class NewtonCG(torch.optim.Optimizer):
    """Newton-CG / Hessian-free optimizer; see the module docstring for the step protocol.

    Args:
        model: the network; its trainable parameters (or ``params``) are optimised.
        loss_func: loss with ``reduction="mean"`` (e.g. ``nn.CrossEntropyLoss()``).
        loader: source of batches for ``step()`` without arguments (cycled forever).
        debiased: re-measure CG step sizes on an independent batch ``B̃``.
        curvature: ``"ggn"`` or ``"hessian"`` (``"ef"``/``"kfac"`` also accepted).
        max_iter: CG iterations per step (``K``).
        lr: scale of the CG step (1 = the full Newton-CG step).
        damping: λ ≥ 0 added to the curvature of both batches (not to the gradient).
        weight_decay: β ≥ 0 of the ℓ² term of ``q`` (gradient ``+βθ``, curvature ``+βI``).
        rtol: CG residual tolerance relative to ``‖∇q(θ; B)‖``.
        batches_per_step: loader batches merged into ``B`` by the single-batch optimizer.
        params: subset of the model's parameters to optimise (one group).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_func: nn.Module,
        *,
        loader: Iterable[Batch] | None = None,
        debiased: bool = True,
        curvature: str = "ggn",
        max_iter: int = 30,
        lr: float = 1.0,
        damping: float = 0.0,
        weight_decay: float = 0.0,
        rtol: float = 1e-10,
        batches_per_step: int = 2,
        params: Iterable[nn.Parameter] | None = None,
    ) -> None:
        if damping < 0 or weight_decay < 0 or lr <= 0 or max_iter < 1 or batches_per_step < 1:
            raise ValueError(
                "need damping >= 0, weight_decay >= 0, lr > 0, max_iter >= 1 and "
                f"batches_per_step >= 1; got damping={damping}, weight_decay={weight_decay}, "
                f"lr={lr}, max_iter={max_iter}, batches_per_step={batches_per_step}"
            )
        params = [p for p in model.parameters() if p.requires_grad] if params is None else params
        defaults = dict(lr=lr, damping=damping, weight_decay=weight_decay, max_iter=max_iter,
                        rtol=rtol)
        super().__init__(list(params), defaults)
        if len(self.param_groups) != 1:
            raise ValueError("NewtonCG supports a single parameter group (one curvature matrix)")
        self.model, self.loss_func = model, loss_func
        self.debiased, self.curvature = debiased, curvature
        self.batches_per_step = batches_per_step
        self._loader = loader
        self._iter: Iterator[Batch] | None = None
        self.last_step: StepInfo | None = None

    def _draw(self) -> Batch:
        if self._loader is None:
            raise ValueError("no loader: pass NewtonCG(..., loader=...) or call step(batch)")
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self._loader)
            try:
                return next(self._iter)
            except StopIteration:
                self._iter = None
        raise ValueError("the loader yields no batches")

    def _quadratic(self, batches: list[Batch]) -> MiniBatchQuadratic:
        group = self.param_groups[0]
        return mini_batch_quadratic(self.model, self.loss_func, batches, self.curvature,
                                    group["weight_decay"], group["params"])

    def _damped(self, q: MiniBatchQuadratic) -> CountingOperator:
        lam = self.param_groups[0]["damping"]
        if not lam:
            return q.curvature
        return CountingOperator(lambda v: q.curvature(v) + lam * v, q.curvature.dim,
                                q.curvature.dtype, q.curvature.device)

    @torch.no_grad()
    def step(
        self,
        batch: Batch | list[Batch] | None = None,
        batch_tilde: Batch | list[Batch] | None = None,
        closure: Callable[[], Tensor] | None = None,
    ) -> Tensor:
        """One Newton-CG step; see the module docstring. Returns ``closure()`` or ``q(θ_old; B)``."""
        group = self.param_groups[0]
        if batch is None:
            if batch_tilde is not None:
                raise ValueError("batch_tilde given without batch")
            if self.debiased:
                batch, batch_tilde = [self._draw()], [self._draw()]
            else:
                batch = _merge([self._draw() for _ in range(self.batches_per_step)])
        batch = _as_batches(batch)
        if self.debiased and batch_tilde is None:
            raise ValueError("debiased=True needs an independent second batch: "
                             "step(batch, batch_tilde) or a loader")
        if not self.debiased and batch_tilde is not None:
            raise ValueError("batch_tilde given but debiased=False; merge it into batch")

        with torch.enable_grad():
            q = self._quadratic(batch)
            qt = self._quadratic(_as_batches(batch_tilde)) if self.debiased else None
        kw = dict(max_iter=group["max_iter"], rtol=group["rtol"], store_iterates=False)
        if self.debiased:
            res = debiased_cg(self._damped(q), -q.gradient, self._damped(qt), -qt.gradient, **kw)
        else:
            res = cg(self._damped(q), -q.gradient, **kw)
        if res.n_iter == 0 and res.reason == "nonpositive_curvature":
            warnings.warn("NewtonCG: the first CG direction has non-positive curvature, θ is "
                          "unchanged; use curvature='ggn' or damping > 0", RuntimeWarning)
        update = group["lr"] * res.x
        offset = 0
        for p in group["params"]:
            n = p.numel()
            p.add_(update[offset : offset + n].view_as(p))
            offset += n
        self.last_step = StepInfo(res, q, qt, update)
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return q.value

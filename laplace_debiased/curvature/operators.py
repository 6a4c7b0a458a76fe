"""Mini-batch quadratics: curvature-vector products and gradients of the regularised loss.

Convention (used by [`laplace_debiased.optim.cg`][laplace_debiased.optim.cg],
[`laplace_debiased.optim.newton_cg`][laplace_debiased.optim.newton_cg] and the diagnostics): for a batch (or
list of batches / loader) ``B`` with ``|B|`` data points in all,

    q(θ; B) = (1/|B|) Σ_{n∈B} ℓ(f_θ(x_n), y_n) + β/2 ‖θ‖²          (paper, Sec. 2)

i.e. the **mean** loss over all data points of ``B`` (not the summed loss of laplace-torch's
backends, and not the mean of per-batch means when batches differ in size) plus an ℓ² term.
Its quadratic model around θ₀ is

    q(θ₀ + d; B) ≈ q(θ₀; B) + ∇q(θ₀; B)ᵀd + ½ dᵀ (H_B + βI) d,
    ∇q(θ₀; B) = ∇L_B(θ₀) + βθ₀,

with ``H_B`` the GGN, Hessian, empirical Fisher or K-FAC (type-2, i.e. built from the exact
output Hessian) of the mean loss. Everything is built on curvlinops operators with a
``reduction="mean"`` loss: curvlinops weights each batch by ``batch_size / N`` so that a list
of batches gives the curvature of the mean over all ``N`` data points.

Vectors are **flat** tensors of shape ``[D]`` (or ``[D, K]`` for ``K`` columns), laid out in
the order of ``params`` (``torch.nn.utils.parameters_to_vector`` order), with the parameters'
dtype (float64 works when model and data are float64).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from curvlinops import (
    EFLinearOperator,
    GGNLinearOperator,
    HessianLinearOperator,
    KFACLinearOperator,
)
from curvlinops._torch_base import PyTorchLinearOperator
from torch import Tensor, nn

Batch = tuple[Tensor | Mapping, Tensor]
Data = Iterable[Batch]

CURVATURES: tuple[str, ...] = ("ggn", "hessian", "ef", "kfac")
"""Names accepted by [`curvature_operator`][laplace_debiased.curvature.operators.curvature_operator] and
[`mini_batch_quadratic`][laplace_debiased.curvature.operators.mini_batch_quadratic]."""


class CountingOperator:
    """A symmetric matrix-free operator ``v ↦ A v`` on flat vectors that counts its products.

    Args:
        matvec: function mapping ``[D]`` → ``[D]`` and ``[D, K]`` → ``[D, K]``.
        dim: ``D``.

    Attributes:
        n_products: number of curvature-vector products so far; a ``[D, K]`` block counts
            as ``K`` products. Reset it with ``op.n_products = 0``.
    """

    def __init__(
        self,
        matvec: Callable[[Tensor], Tensor],
        dim: int,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:
        self._matvec = matvec
        self.dim = dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.n_products = 0

    def __call__(self, v: Tensor) -> Tensor:
        """Return ``A v`` for ``v`` of shape ``[D]`` or ``[D, K]``."""
        if v.shape[0] != self.dim or v.ndim not in (1, 2):
            raise ValueError(
                f"expected a flat vector [{self.dim}] or matrix [{self.dim}, K], "
                f"got shape {tuple(v.shape)}"
            )
        self.n_products += 1 if v.ndim == 1 else v.shape[1]
        return self._matvec(v)

    __matmul__ = __call__


class CurvatureOperator(CountingOperator):
    """``v ↦ (H_B + βI) v`` for a curvlinops curvature operator ``H_B`` of the mean loss.

    Args:
        linop: a curvlinops operator built with a ``reduction="mean"`` loss.
        beta: ℓ² regularisation strength β ≥ 0.
    """

    def __init__(self, linop: PyTorchLinearOperator, beta: float = 0.0) -> None:
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.linop = linop
        self.beta = float(beta)
        super().__init__(self._apply, linop.shape[1], linop.dtype, linop.device)

    def _apply(self, v: Tensor) -> Tensor:
        Hv = self.linop @ v
        return Hv + self.beta * v if self.beta else Hv


def trainable_params(
    model: nn.Module, params: Sequence[nn.Parameter] | None = None
) -> list[nn.Parameter]:
    """The parameters θ (``params`` or all of ``model``'s with ``requires_grad``)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    params = list(params)
    if not params:
        raise ValueError("no trainable parameters: pass params= or set requires_grad=True")
    return params


def _check_data(data: Data) -> list[Batch] | Data:
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], Tensor):
        raise TypeError("data must be a list of (X, y) batches or a loader; got one batch — "
                        "wrap it as [(X, y)]")
    if isinstance(data, Sequence) and len(data) == 0:
        raise ValueError("data is empty: pass at least one (X, y) batch")
    return data


def _check_loss(loss_func: nn.Module) -> None:
    if getattr(loss_func, "reduction", None) != "mean":
        raise ValueError(
            "loss_func must use reduction='mean' (q(θ; B) is the mean loss over B), got "
            f"{getattr(loss_func, 'reduction', None)!r}; e.g. nn.CrossEntropyLoss()"
        )


def _num_data(data: Data) -> int | None:
    if isinstance(data, Sequence):
        return sum(y.shape[0] for _, y in data)
    return None  # curvlinops counts with one pass over the loader


def curvature_linop(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    curvature: str = "ggn",
    params: Sequence[nn.Parameter] | None = None,
    num_data: int | None = None,
    batch_size_fn: Callable[[Mapping], int] | None = None,
) -> PyTorchLinearOperator:
    """curvlinops operator of the curvature ``H_B`` of the mean loss on ``data``.

    The operator reads the parameters by reference, so it follows in-place updates — except
    K-FAC, whose factors are computed on first use (build a new one after changing θ).

    Args:
        model: the network.
        loss_func: its loss with mean reduction.
        data: a list of ``(X, y)`` batches or a loader that yields the same data on each pass (no
            ``drop_last`` with shuffling, no augmentation).
        curvature: ``"ggn"`` (Jᵀ ∇²ℓ J), ``"hessian"``, ``"ef"`` (empirical Fisher
            (1/N) Σ g_n g_nᵀ with per-sample gradients g_n) or ``"kfac"`` (curvlinops
            ``KFACLinearOperator`` with ``fisher_type="type-2"``, Linear/Conv2d layers only).
        params: the parameters the curvature is over; default: the trainable ones.
        num_data: the number of data points of ``data``; saves curvlinops a counting pass over a
            loader.
        batch_size_fn: the number of samples of one mapping input (a dict or a Hugging Face
            ``BatchEncoding`` that ``model`` consumes whole); needed for mapping inputs.

    Returns:
        The curvlinops operator, ``(D, D)`` for ``D`` parameters.
    """
    _check_loss(loss_func)
    data = _check_data(data)
    params = trainable_params(model, params)
    kwargs = dict(check_deterministic=False, num_data=num_data or _num_data(data), batch_size_fn=batch_size_fn)
    if curvature == "ggn":
        return GGNLinearOperator(model, loss_func, params, data, **kwargs)
    if curvature == "hessian":
        return HessianLinearOperator(model, loss_func, params, data, **kwargs)
    if curvature == "ef":
        return EFLinearOperator(model, loss_func, params, data, **kwargs)
    if curvature == "kfac":
        return KFACLinearOperator(model, loss_func, params, data, fisher_type="type-2", **kwargs)
    raise ValueError(f"unknown curvature {curvature!r}; choose one of {CURVATURES}")


def curvature_operator(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    curvature: str = "ggn",
    beta: float = 0.0,
    params: Sequence[nn.Parameter] | None = None,
    num_data: int | None = None,
) -> CurvatureOperator:
    """Counting operator ``v ↦ (H_B + βI) v`` on flat vectors; see
    [`curvature_linop`][laplace_debiased.curvature.operators.curvature_linop]."""
    linop = curvature_linop(model, loss_func, data, curvature, params, num_data)
    return CurvatureOperator(linop, beta)


def _loss_gradient_count(model, loss_func, data, beta, params) -> tuple[Tensor, Tensor, int]:
    _check_loss(loss_func)
    data = _check_data(data)
    params = trainable_params(model, params)
    total, grads, n = None, [torch.zeros_like(p) for p in params], 0
    for X, y in data:
        loss = loss_func(model(X), y) * X.shape[0]
        for acc, g in zip(grads, torch.autograd.grad(loss, params)):
            acc.add_(g)
        total = loss.detach() if total is None else total + loss.detach()
        n += X.shape[0]
    theta = flat_params(params)
    value = total / n + 0.5 * beta * theta.dot(theta)
    return value, torch.cat([g.reshape(-1) for g in grads]) / n + beta * theta, n


def flat_params(params: Sequence[Tensor]) -> Tensor:
    """θ as a detached flat ``[D]`` tensor (``parameters_to_vector`` order)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


@dataclass
class MiniBatchQuadratic:
    """The quadratic model of ``q(·; B)`` around θ₀ (see the module docstring).

    Attributes:
        curvature: counting operator ``v ↦ (H_B + βI) v``.
        gradient: ``∇q(θ₀; B)``, flat ``[D]``.
        value: ``q(θ₀; B)``, scalar.
        theta: θ₀, flat ``[D]``.
        n_data: ``|B|``, number of data points of ``B``.
    """

    curvature: CurvatureOperator
    gradient: Tensor
    value: Tensor
    theta: Tensor
    n_data: int

    def __call__(self, d: Tensor) -> Tensor:
        """Quadratic model ``q(θ₀) + ∇qᵀd + ½ dᵀ(H+βI)d`` at a step ``d`` (one product)."""
        return self.value + self.gradient.dot(d) + 0.5 * d.dot(self.curvature(d))


def mini_batch_quadratic(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    curvature: str = "ggn",
    beta: float = 0.0,
    params: Sequence[nn.Parameter] | None = None,
) -> MiniBatchQuadratic:
    """Quadratic model of ``q(·; B)`` at the model's current parameters θ₀ on ``data``."""
    params = trainable_params(model, params)
    value, gradient, n_data = _loss_gradient_count(model, loss_func, data, beta, params)
    return MiniBatchQuadratic(
        curvature=curvature_operator(model, loss_func, data, curvature, beta, params, n_data),
        gradient=gradient,
        value=value,
        theta=flat_params(params),
        n_data=n_data,
    )

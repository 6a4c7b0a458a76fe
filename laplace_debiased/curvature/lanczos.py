"""Lanczos route of the eigen-structured curvature
([`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen]): ARPACK's implicitly restarted
Lanczos on any symmetric operator ([`lanczos_top_k`][laplace_debiased.curvature.lanczos.lanczos_top_k], the
one Lanczos routine of the package, also used by the diagnostics) and the matrix-free summed-loss curvature
product it runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh
from torch import Tensor, nn

from laplace_debiased.curvature.inputs import (
    Batch,
    Curvature,
    token_rows_batch_size,
    TokenRows,
    backward_hooks_detached,
    count_samples,
    is_mapping,
    loss_factor,
    mapping_rows,
    parameter_count,
    target_rows,
    trainable_parameters,
    unpadded_samples,
)
from laplace_debiased.curvature.kfac import padded_rows
from laplace_debiased.curvature.thresholds import EigenPairs


def lanczos_top_k(
    operator: Callable[[Tensor], Tensor],
    dim: int,
    k: int,
    *,
    tol: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    max_iterations: int | None = None,
) -> EigenPairs:
    """Top-k eigenpairs of a symmetric operator by implicitly restarted Lanczos (ARPACK ``eigsh``).

    The Lanczos recurrence itself runs in float64.

    Args:
        operator: maps a flat ``(dim,)`` tensor of ``dtype`` on ``device`` to ``(dim,)`` (e.g. a
            [`laplace_debiased.curvature.operators.CountingOperator`][laplace_debiased.curvature.operators.CountingOperator],
            or ``linop.__matmul__`` of a curvlinops operator).
        dim: the dimension of the operator.
        k: number of eigenpairs, ``0 < k < dim`` (ARPACK's limit; form small operators densely).
        tol: ``eigsh``'s relative accuracy (0 = machine precision).
        seed: seed of the start vector, so results are reproducible.
        dtype: the dtype of the vectors ``operator`` takes.
        device: the device of the vectors ``operator`` takes, and of the result.
        max_iterations: ``eigsh``'s ``maxiter``; default ARPACK's.

    Returns:
        float64 [`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs] (``(k,)`` eigenvalues
        descending, ``(dim, k)`` orthonormal eigenvectors, method ``"lanczos"``) on ``device``; no sign
        convention.

    Raises:
        ValueError: unless ``0 < k < dim``.
        RuntimeError: if Lanczos does not converge to ``k`` eigenpairs.
    """
    if not 0 < k < dim:
        raise ValueError(
            f"Lanczos needs 0 < k < dim={dim}, got k={k}; solve such a small problem densely "
            "(top_eigenpairs: method='gram')."
        )

    def matvec(x: np.ndarray) -> np.ndarray:
        v = torch.from_numpy(np.ascontiguousarray(x.reshape(-1))).to(device=device, dtype=dtype)
        return operator(v).detach().double().cpu().numpy()

    linop = LinearOperator((dim, dim), matvec=matvec, dtype=np.float64)
    v0 = np.random.default_rng(seed).standard_normal(dim)
    try:
        values, vectors = eigsh(linop, k=k, which="LA", tol=tol, v0=v0, maxiter=max_iterations)
    except ArpackNoConvergence as err:
        raise RuntimeError(
            f"Lanczos did not converge to {k} eigenpairs ({len(err.eigenvalues)} converged); "
            "ask for fewer eigenpairs or loosen the tolerance"
        ) from err
    order = np.argsort(values)[::-1].copy()
    return EigenPairs(
        torch.as_tensor(values[order], device=device),
        torch.as_tensor(vectors[:, order].copy(), device=device),
        "lanczos",
    )


def summed_curvature_top_k(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, curvature: Curvature, k: int, tol: float, n_outputs: int
) -> EigenPairs:
    """Top-k eigenpairs of the summed-loss curvature ``G_B`` of ``batches``, matrix-free:
    [`lanczos_top_k`][laplace_debiased.curvature.lanczos.lanczos_top_k] on
    [`summed_curvature_product`][laplace_debiased.curvature.lanczos.summed_curvature_product].

    Args:
        model: the network; its trainable parameters span the ``P`` dimensions.
        batches: ``(X, y)`` pairs of the batch ``B``.
        likelihood: ``"classification"`` or ``"regression"``.
        curvature: ``"ggn"`` or ``"ef"``.
        k: number of eigenpairs, ``0 < k < P``.
        tol: ``eigsh``'s relative accuracy (0 = machine precision).
        n_outputs: the output width ``C``.

    Returns:
        float64 [`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs]: ``(k,)`` eigenvalues
        descending, ``(P, k)`` orthonormal eigenvectors, on the device of the model's parameters.
    """
    product = summed_curvature_product(model, batches, likelihood, curvature, n_outputs)
    first = next(iter(trainable_parameters(model).values()))
    return lanczos_top_k(product, parameter_count(model), k, tol=tol, dtype=first.dtype, device=first.device)


def summed_curvature_product(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, curvature: Curvature, n_outputs: int
) -> Callable[[Tensor], Tensor]:
    """``v ↦ G_B v`` (``(P,)`` in the model's dtype; the summed loss over ``batches``, the
    scaling of [`dense_curvature`][laplace_debiased.curvature.factors.dense_curvature]), matrix-free: each
    product is one pass over the batches. No batches: the zero map.

    Built on
    [`laplace_debiased.curvature.operators.curvature_linop`][laplace_debiased.curvature.operators.curvature_linop],
    the curvature of the **mean** loss (``CrossEntropyLoss()`` or ``MSELoss()``) over the ``n`` output rows
    (samples, or every token of every sample for token outputs,
    [`TokenRows`][laplace_debiased.curvature.inputs.TokenRows]); the summed loss of this module
    (``factor · lossfunc(sum)``) has ``scale`` times that curvature, with ``scale = n`` (cross-entropy) or
    ``factor · n · C`` (``MSELoss`` averages over all ``n · C`` entries), ``C = n_outputs``.

    Args:
        model: the network.
        batches: ``(X, y)`` pairs of the batch B.
        likelihood: ``"classification"`` or ``"regression"``.
        curvature: ``"ggn"`` or ``"ef"``.
        n_outputs: the output width ``C``.

    Returns:
        The product ``v ↦ G_B v``.
    """
    from laplace_debiased.curvature.operators import curvature_linop

    if not batches:
        return torch.zeros_like
    rows = [target_rows(model, X, y) for X, y in batches]
    if all(len(shape) == 1 for _, shape in rows):
        data = unpadded_samples(batches)  # padded positions have no loss term
        op_model, n = model, count_samples(data)
        batch_size_fn = mapping_rows if any(is_mapping(X) for X, _ in batches) else None
    else:  # token outputs: one row per token, padded ones left out
        op_model = TokenRows(model)
        keeps = [(~padded_rows(t)).nonzero().squeeze(1) for t, _ in rows]
        data = [({"x": X, "rows": len(k), "keep": k}, t[k]) for (X, _), (t, _), k in zip(batches, rows, keeps) if len(k)]
        n, batch_size_fn = sum(len(k) for k in keeps), token_rows_batch_size
    if not data:
        return torch.zeros_like
    if likelihood == "classification":
        lossfunc, scale = nn.CrossEntropyLoss(), float(n)
    else:
        lossfunc, scale = nn.MSELoss(), loss_factor(likelihood) * n * n_outputs
    with backward_hooks_detached(model):
        op = curvature_linop(op_model, lossfunc, data, curvature, num_data=n, batch_size_fn=batch_size_fn)

    def product(v: Tensor) -> Tensor:
        with backward_hooks_detached(model):
            return scale * (op @ v)

    return product

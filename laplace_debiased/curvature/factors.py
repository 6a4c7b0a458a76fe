"""Jacobian routes of the eigen-structured curvature
([`laplace_debiased.curvature.eigen`][laplace_debiased.curvature.eigen]): the factor ``V`` with ``G_B = V Vᵀ``
from per-sample Jacobians (``torch.func`` or reverse mode per sample), the dense ``G_B``, and the curvature
along given directions (``λ̃_i = Σ_n ‖A_nᵀ J_n u_i‖²``, forward-mode ``J u`` for a chunk of directions at
once).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.func import jacrev, jvp, vmap

from laplace_debiased.curvature.inputs import (
    Batch,
    Curvature,
    Inputs,
    check_curvature,
    check_finite,
    check_likelihood,
    functorch_unsupported,
    backward_hooks_detached,
    functional_model,
    is_mapping,
    loss_factor,
    parameter_count,
    take_rows,
    trainable_parameters,
)
from laplace_debiased.curvature.kfac import kept_rows, output_rows, padded_rows

logger = logging.getLogger(__name__)


def per_sample_factor_columns(
    model: nn.Module, X: Inputs, y: Tensor, likelihood: str, curvature: Curvature = "ggn"
) -> Iterator[Tensor]:
    """Reverse-mode route: for each sample ``n`` of the batch, the ``(P, T·R)`` block ``J_nᵀ A_n``
    of the factor ``V`` (columns of [`curvature_factor`][laplace_debiased.curvature.factors.curvature_factor],
    model dtype; ``T`` tokens, 1 without).

    One forward of the sample alone (``take_rows``) and ``T·R`` backward passes of
    ``A_ntᵀ f_nt``; only plain autograd, so it works for mapping inputs and for operations
    without forward-mode or ``vmap`` support. Parameters without ``requires_grad`` are constants.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no parameters with requires_grad=True.")
    with torch.enable_grad():
        for i in range(len(y)):
            f, targets = output_rows(model(take_rows(X, slice(i, i + 1))), y[i : i + 1])
            check_finite(f.detach(), "the model's outputs")
            A = output_curvature_factor(f.detach(), targets, likelihood, curvature)  # (T, C, R)
            out = (f.unsqueeze(-1) * A).sum(1).reshape(-1)  # (T·R,)
            columns = []
            for r in range(out.shape[0]):
                grads = torch.autograd.grad(out[r], params, retain_graph=r < out.shape[0] - 1, allow_unused=True)
                columns.append(
                    torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])
                )
            yield torch.stack(columns, dim=1)


def output_curvature_factor(f: Tensor, y: Tensor, likelihood: str, curvature: Curvature = "ggn") -> Tensor:
    """Per-sample factor ``A_n`` of the output-space curvature, ``Λ_n = A_n A_nᵀ``.

    GGN: ``R = C`` (softmax cross-entropy: ``diag(√p) − p √pᵀ``, exact since ``Σ p = 1``;
    regression: identity); EF: ``R = 1``, ``√factor · ∇_f lossfunc``. A row whose class label is
    ``-100`` (a padded position, [`padded_rows`][laplace_debiased.curvature.kfac.padded_rows]) has no
    loss term: its factor is zero.

    Args:
        f: The logits, ``(n, C)``.
        y: The targets: class labels ``(n,)`` for classification, ``(n, C)`` for regression.
        likelihood: ``"classification"`` or ``"regression"``.
        curvature: ``"ggn"`` or ``"ef"``.

    Returns:
        ``A``, shape ``(n, C, R)``.
    """
    check_likelihood(likelihood)
    check_curvature(curvature)
    f = f.detach()
    if curvature == "ef":
        if likelihood == "classification":
            labels = y.masked_fill(padded_rows(y), 0)
            r = torch.softmax(f, -1) - nn.functional.one_hot(labels, f.shape[-1]).to(f.dtype)
        else:
            r = 2.0 * (f - y)
        return kept_rows(math.sqrt(loss_factor(likelihood)) * r.unsqueeze(-1), y)
    if likelihood == "regression":
        return torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand(f.shape[0], -1, -1)
    p = torch.softmax(f, -1)
    sqrt_p = p.sqrt()
    return kept_rows(torch.diag_embed(sqrt_p) - p.unsqueeze(-1) * sqrt_p.unsqueeze(-2), y)


def curvature_factor(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    curvature: Curvature = "ggn",
    max_chunk_elements: int = 2**24,
) -> Tensor:
    """The factor ``V`` (``P × n·R``, model dtype) with ``G_B = V Vᵀ`` (see module docstring).

    Columns are ordered sample-major (``n`` outer, ``R`` inner). Per-sample Jacobians are built with
    ``vmap(jacrev)`` in chunks of at most ``max_chunk_elements`` Jacobian entries; mapping inputs
    and models ``torch.func`` cannot transform take
    [`per_sample_factor_columns`][laplace_debiased.curvature.factors.per_sample_factor_columns].
    """
    columns = []
    with backward_hooks_detached(model):
        for X, y in batches:
            columns.extend(_batch_factor(model, X, y, likelihood, curvature, max_chunk_elements))
    V = torch.cat(columns, dim=1)
    check_finite(V, "the Jacobians of the model's outputs")
    return V


def _batch_factor(
    model: nn.Module, X: Inputs, y: Tensor, likelihood: str, curvature: Curvature, max_chunk_elements: int
) -> list[Tensor]:
    """Column blocks of ``V`` for one batch (see
    [`curvature_factor`][laplace_debiased.curvature.factors.curvature_factor])."""
    if not is_mapping(X):
        if X.is_floating_point():
            check_finite(X, "the inputs")
        try:
            return _batch_factor_functorch(model, X, y, likelihood, curvature, max_chunk_elements)
        except (NotImplementedError, RuntimeError) as err:
            if not functorch_unsupported(err):
                raise
            logger.info("torch.func cannot transform the model (%s); using reverse-mode autograd per sample.", err)
    return [torch.cat(list(per_sample_factor_columns(model, X, y, likelihood, curvature)), dim=1)]


def _batch_factor_functorch(
    model: nn.Module, X: Tensor, y: Tensor, likelihood: str, curvature: Curvature, max_chunk_elements: int
) -> list[Tensor]:
    fn, params = functional_model(model)
    n_params = parameter_count(model)

    def single(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x.unsqueeze(0)).squeeze(0)

    jac = vmap(jacrev(single), in_dims=(None, 0))
    columns = []
    with torch.no_grad():
        f = fn(params, X)
    check_finite(f, "the model's outputs")
    rows, targets = output_rows(f, y)
    A = output_curvature_factor(rows, targets, likelihood, curvature)  # (n·T, C, R)
    T = len(rows) // len(y)
    chunk = max(1, max_chunk_elements // (f[0].numel() * n_params))
    for start in range(0, len(y), chunk):
        J = jac(params, X[start : start + chunk])
        J = torch.cat([j.flatten(f.ndim) for j in J.values()], dim=-1)  # (m, [T,] C, P)
        J = J.reshape(-1, f.shape[-1], n_params)  # (m·T, C, P)
        columns.append(torch.einsum("mcr,mcp->pmr", A[start * T : start * T + len(J)], J).flatten(1))
    return columns


def _linear_dense_curvature(layer: nn.Linear, batches: Sequence[Batch], likelihood: str, curvature: Curvature) -> Tensor:
    """Dense ``G_B`` of an ``nn.Linear`` from features ⊗ output curvature (float64, ``P × P``).

    ``G[(i,p),(j,q)] = Σ_n Λ_n[i,j] φ̃_n[p] φ̃_n[q]`` (``n`` over the output rows: every token of
    token outputs) with ``φ̃ = [φ, 1]`` if the layer has a bias; laplace-torch's order: weight
    row-major (``i·D + p``), then bias. Cost ``C² D² n``.
    """
    C, D = layer.out_features, layer.in_features
    has_bias = layer.bias is not None and layer.bias.requires_grad
    if not layer.weight.requires_grad:
        raise ValueError("The dense nn.Linear route needs a trainable weight.")
    Dt = D + int(has_bias)
    G = torch.zeros(C, C, Dt, Dt, dtype=torch.float64, device=layer.weight.device)
    for X, y in batches:
        check_finite(X, "the inputs")
        with torch.no_grad():
            f, targets = output_rows(layer(X), y)  # token outputs: one row per token
        check_finite(f, "the model's outputs")
        A = output_curvature_factor(f, targets, likelihood, curvature).double()
        Lam = A @ A.transpose(1, 2)  # (rows, C, C)
        phi = X.detach().double().reshape(len(f), D)
        if has_bias:
            phi = torch.cat([phi, torch.ones_like(phi[:, :1])], dim=1)
        for i in range(C):
            weighted = Lam[:, i, :, None] * phi[:, None, :]  # (rows, C, Dt)
            G[i] += (weighted.reshape(len(f), C * Dt).T @ phi).reshape(C, Dt, Dt)
    G = G.permute(0, 2, 1, 3).reshape(C * Dt, C * Dt)  # index (i, p), (j, q)
    if has_bias:
        order = [i * Dt + p for i in range(C) for p in range(D)] + [i * Dt + D for i in range(C)]
        idx = torch.tensor(order, device=G.device)
        G = G[idx][:, idx]
    return G


def dense_curvature(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, curvature: Curvature = "ggn"
) -> Tensor:
    """Dense ``G_B`` (float64, ``P × P``) of the summed loss over ``batches``.

    An ``nn.Linear`` (the last-layer case) uses features ⊗ output curvature; any other model
    uses ``V Vᵀ`` from per-sample Jacobians (meant for small models).
    """
    check_likelihood(likelihood)
    check_curvature(curvature)
    if isinstance(model, nn.Linear) and not any(is_mapping(X) for X, _ in batches):
        return _linear_dense_curvature(model, batches, likelihood, curvature)
    params = list(trainable_parameters(model).values())
    n_params = parameter_count(model)
    G = torch.zeros(n_params, n_params, dtype=torch.float64, device=params[0].device)
    for batch in batches:
        V = curvature_factor(model, [batch], likelihood, curvature).double()
        G += V @ V.T
    return G


def directional_curvatures(
    model: nn.Module,
    batches: Sequence[Batch],
    directions: Tensor,
    likelihood: str,
    curvature: Curvature = "ggn",
    chunk_size: int = 16,
) -> Tensor:
    """``λ̃_i = u_iᵀ G_B u_i`` for the columns ``u_i`` of ``directions`` (``P × k``), float64 ``(k,)``.

    One pass over ``batches``: per batch, forward-mode products ``J u`` for ``chunk_size``
    directions at once (``vmap`` over ``jvp``), then ``λ̃_i += Σ_n ‖A_nᵀ J_n u_i‖²``.
    Same scaling as ``dense_curvature`` (summed loss over the batches, no ``N / n``). Mapping
    inputs, and models without forward-mode support, take the reverse-mode route instead:
    ``λ̃_i += ‖(J_nᵀ A_n)ᵀ u_i‖²`` sample by sample
    ([`per_sample_factor_columns`][laplace_debiased.curvature.factors.per_sample_factor_columns]).
    """
    check_likelihood(likelihood)
    check_curvature(curvature)
    params = trainable_parameters(model)
    n_params = parameter_count(model)
    if directions.ndim != 2 or directions.shape[0] != n_params:
        raise ValueError(f"directions must have shape (P={n_params}, k), got {tuple(directions.shape)}.")
    U = directions.to(next(iter(params.values())).dtype)
    result = torch.zeros(directions.shape[1], dtype=torch.float64, device=U.device)
    with backward_hooks_detached(model):
        for X, y in batches:
            if not is_mapping(X):
                try:
                    result += _directional_functorch(model, params, X, y, U, likelihood, curvature, chunk_size)
                    continue
                except (NotImplementedError, RuntimeError) as err:
                    if not functorch_unsupported(err):
                        raise
                    logger.info("no forward-mode AD for the model (%s); re-measuring with reverse mode.", err)
            for block in per_sample_factor_columns(model, X, y, likelihood, curvature):
                result += (U.T.double() @ block.double()).square().sum(dim=1)
    return result


def _directional_functorch(
    model: nn.Module,
    params: dict[str, Tensor],
    X: Tensor,
    y: Tensor,
    U: Tensor,
    likelihood: str,
    curvature: Curvature,
    chunk_size: int,
) -> Tensor:
    """One batch of [`directional_curvatures`][laplace_debiased.curvature.factors.directional_curvatures] by
    ``vmap`` over forward-mode ``jvp``."""
    fn, _ = functional_model(model)
    k = U.shape[1]
    names = list(params)
    sizes = [params[n].numel() for n in names]
    result = torch.zeros(k, dtype=torch.float64, device=U.device)
    with torch.no_grad():
        f = fn(params, X)
    check_finite(f, "the model's outputs")
    rows, targets = output_rows(f, y)
    A = output_curvature_factor(rows, targets, likelihood, curvature)  # (n·T, C, R)
    for start in range(0, k, chunk_size):
        block = U[:, start : start + chunk_size]
        tangents = {
            name: piece.T.reshape(block.shape[1], *params[name].shape)
            for name, piece in zip(names, torch.split(block, sizes, dim=0))
        }

        def push(t: dict[str, Tensor]) -> Tensor:
            return jvp(lambda p: fn(p, X), (params,), (t,))[1]

        with torch.no_grad():
            Ju = vmap(push)(tangents)  # (kc, n, [T,] C)
        Ju = Ju.reshape(Ju.shape[0], -1, f.shape[-1])  # (kc, n·T, C)
        proj = torch.einsum("knc,ncr->knr", Ju.double(), A.double())
        result[start : start + block.shape[1]] += proj.square().sum(dim=(1, 2))
    return result

"""Eigen-structured curvature of a list of mini-batches (pure functions, tensors in, tensors out).

What is computed
----------------
For a model ``f(x; θ)`` and batches ``B = [(X_1, y_1), ...]`` with ``n`` samples in total, the
curvature of laplace-torch's **summed** loss ``factor * lossfunc`` (``CrossEntropyLoss(sum)`` with
``factor = 1``, or ``MSELoss(sum)`` with ``factor = 1/2``) over the batches, written as

    G_B = Σ_n J_nᵀ Λ_n J_n = V Vᵀ,      Λ_n = A_n A_nᵀ,      V = [J_1ᵀ A_1, ..., J_nᵀ A_n]  (P × n·R)

with ``J_n`` the ``C × P`` Jacobian of the logits of sample ``n`` and

- ``curvature="ggn"``: Λ_n the Hessian of the loss w.r.t. the logits (classification:
  ``diag(p) − p pᵀ``, factor ``A = diag(√p) − p √pᵀ`` with ``R = C``; regression: ``Λ = I``);
- ``curvature="ef"`` (empirical Fisher): ``A_n = √factor · ∇_f lossfunc`` with ``R = 1``.

This is exactly laplace-torch's ``CurvlinopsGGN``/``CurvlinopsEF`` ``full`` matrix of the batches.
Nothing here rescales to a data set of ``N`` points: callers multiply eigenvalues by ``N / n``
(laplace-torch's convention, so that the curvature estimates the summed loss over all data).

The parameter space is that of ``model``'s parameters with ``requires_grad``, flattened in
``named_parameters()`` order (laplace-torch's ``parameters_to_vector`` order). For a last-layer
approximation pass the last layer and batches of its input *features*.

Routes to the top-k eigenpairs (``top_eigenpairs``)
--------------------------------------------------
- ``"lanczos"``: :func:`lanczos_top_k` (``scipy.sparse.linalg.eigsh`` in float64, the one
  Lanczos routine of the package, also used by the diagnostics) on the matrix-free curvlinops
  GGN/EF operator of :func:`laplace_debiased.curvature.operators.curvature_linop` (mean loss, rescaled to
  the summed loss; each product is one pass over the batches).
- ``"gram"``: exact, through the low-rank structure (ViViT, Dangel et al. 2022): build ``V`` from
  per-sample Jacobians and diagonalise the small matrix — ``VᵀV`` (``n·R × n·R``) when that is
  smaller than ``P × P``, else ``V Vᵀ`` (for an ``nn.Linear``, ``V Vᵀ`` is formed from
  features ⊗ output curvature, never from per-parameter autograd).
- ``"auto"`` compares the rough costs of both (``choose_method``).

Re-measuring curvature along given directions (``directional_curvatures``) costs one pass over the
batches for all ``k`` directions together (forward-mode ``J u`` for a chunk of directions at once,
vectorised with ``torch.func.vmap``): ``λ̃_i = Σ_n ‖A_nᵀ J_n u_i‖²``.

Token outputs
-------------
A model may output ``(n, tokens, C)`` (any number of token dimensions) with every token an output
of its own loss term (laplace-torch's LLM convention), targets ``(n, tokens)`` (class labels) or
``(n, tokens, C)``: ``J_n`` and ``Λ_n`` above are then per token, the sum runs over all
``n·tokens`` *rows* of the outputs (:func:`laplace_debiased.curvature.kfac.output_rows`, the one
flattening helper), and ``V`` has ``n·tokens·R`` columns. A sample is still a sequence:
``N / n`` and ``count_samples`` count sequences.

Inputs and models
-----------------
A batch's input ``X`` is a tensor or a mapping (a dict or a Hugging Face ``BatchEncoding``) that
the model consumes whole, ``model(X)`` (laplace-torch's ``dict_key_x``/``dict_key_y``
convention; the targets come separately). Tensor inputs take the ``torch.func`` routes above.
Mapping inputs, and models with an operation that has no forward-mode derivative (a
``nn.MultiheadAttention`` fast path, CPU flash attention), take the reverse-mode route: one
forward per sample (the mapping's tensors sliced to that row) and ``R`` backward passes, giving
the same columns ``J_nᵀ A_n`` (``per_sample_factor_columns``). Module backward hooks (BackPACK's
``extend`` installs them; ``torch.func`` cannot trace them) are detached while the curvature is
computed and restored afterwards (``backward_hooks_detached``); outside a ``backpack(...)``
context they do nothing, so nothing changes.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vmap

from laplace_debiased.curvature.kfac import output_rows
from laplace_debiased.curvature.linalg import eigh_float64

Inputs = Tensor | Mapping[str, Any]
Batch = tuple[Inputs, Tensor]
Curvature = Literal["ggn", "ef"]
Method = Literal["auto", "gram", "lanczos"]

CURVATURES = ("ggn", "ef")
METHODS = ("auto", "gram", "lanczos")
LIKELIHOODS = ("classification", "regression")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EigenPairs:
    """Eigenpairs of a symmetric curvature, eigenvalues in descending order.

    ``values``: ``(k,)``; ``vectors``: ``(P, k)`` with orthonormal columns; float64 from this
    module (``diagnostics.directions.top_eigenpairs`` casts to the model's dtype);
    ``method``: the route that computed them (``"gram"``, ``"lanczos"`` or ``"dense"``).
    """

    values: Tensor
    vectors: Tensor
    method: str


def loss_factor(likelihood: str) -> float:
    """laplace-torch's conversion factor from the torch loss to the negative log likelihood."""
    _check_likelihood(likelihood)
    return 1.0 if likelihood == "classification" else 0.5


def _check_likelihood(likelihood: str) -> None:
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}.")


def _check_curvature(curvature: str) -> None:
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


@torch.no_grad()
def _sample_output_shape(model: nn.Module, X: Inputs) -> tuple[int, ...]:
    """Per-sample output shape ``([tokens, ...,] C)`` of ``model``, from the first row of ``X``."""
    return tuple(model(take_rows(X, slice(0, 1))).shape[1:])


def target_rows(model: nn.Module, X: Inputs, y: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The targets of a batch with one row per output row (:func:`output_rows`, which checks
    their shape against the model's output), and the per-sample output shape
    ``([tokens, ...,] C)``. One forward pass of a single sample."""
    shape = _sample_output_shape(model, X)
    proxy = torch.empty((), dtype=torch.float32, device=y.device).expand(len(y), *shape)
    return output_rows(proxy, y)[1], shape


def count_rows(model: nn.Module, batches: Sequence[Batch]) -> int:
    """Total number of output rows (loss terms) of the batches: samples × tokens per sample."""
    return sum(len(target_rows(model, X, y)[0]) for X, y in batches)


class _TokenRows(nn.Module):
    """``model`` on ``{"x": X, "rows": r}`` with its outputs ``(n, tokens, C)`` as the ``r``
    rows ``(r, C)``, so that curvlinops' losses see one row per loss term and weight a batch's
    mean loss by its ``r`` rows (``batch_size_fn``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Mapping[str, Any]) -> Tensor:
        f = self.model(inputs["x"])
        return f.reshape(-1, f.shape[-1])


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


def _check_finite(t: Tensor, what: str) -> None:
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


def _functorch_unsupported(err: Exception) -> bool:
    """Whether ``err`` says a ``torch.func`` transform cannot handle an operation of the model."""
    text = str(err)
    return isinstance(err, NotImplementedError) or any(
        s in text for s in ("forward AD", "vmap", "functorch", "setup_context")
    )


def per_sample_factor_columns(
    model: nn.Module, X: Inputs, y: Tensor, likelihood: str, curvature: Curvature = "ggn"
) -> Iterator[Tensor]:
    """Reverse-mode route: for each sample ``n`` of the batch, the ``(P, T·R)`` block ``J_nᵀ A_n``
    of the factor ``V`` (columns of :func:`curvature_factor`, model dtype; ``T`` tokens, 1
    without).

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
            _check_finite(f.detach(), "the model's outputs")
            A = output_curvature_factor(f.detach(), targets, likelihood, curvature)  # (T, C, R)
            out = (f.unsqueeze(-1) * A).sum(1).reshape(-1)  # (T·R,)
            columns = []
            for r in range(out.shape[0]):
                grads = torch.autograd.grad(out[r], params, retain_graph=r < out.shape[0] - 1, allow_unused=True)
                columns.append(
                    torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])
                )
            yield torch.stack(columns, dim=1)


def _model_fn(model: nn.Module):
    """``(params, X) -> logits`` as a pure function of the trainable parameters."""
    buffers = dict(model.named_buffers())

    def fn(params: dict[str, Tensor], X: Tensor) -> Tensor:
        return functional_call(model, (params, buffers), (X,), strict=False)

    return fn


def output_curvature_factor(f: Tensor, y: Tensor, likelihood: str, curvature: Curvature = "ggn") -> Tensor:
    """Per-sample factor ``A_n`` of the output-space curvature, ``Λ_n = A_n A_nᵀ``.

    ``f``: logits ``(n, C)``; ``y``: targets. Returns ``(n, C, R)`` — GGN: ``R = C`` (softmax
    cross-entropy: ``diag(√p) − p √pᵀ``, exact since ``Σ p = 1``; regression: identity);
    EF: ``R = 1``, ``√factor · ∇_f lossfunc``.
    """
    _check_likelihood(likelihood)
    _check_curvature(curvature)
    f = f.detach()
    if curvature == "ef":
        if likelihood == "classification":
            r = torch.softmax(f, -1) - nn.functional.one_hot(y, f.shape[-1]).to(f.dtype)
        else:
            r = 2.0 * (f - y)
        return math.sqrt(loss_factor(likelihood)) * r.unsqueeze(-1)
    if likelihood == "regression":
        return torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand(f.shape[0], -1, -1)
    p = torch.softmax(f, -1)
    sqrt_p = p.sqrt()
    return torch.diag_embed(sqrt_p) - p.unsqueeze(-1) * sqrt_p.unsqueeze(-2)


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
    and models ``torch.func`` cannot transform take :func:`per_sample_factor_columns`.
    """
    columns = []
    with backward_hooks_detached(model):
        for X, y in batches:
            columns.extend(_batch_factor(model, X, y, likelihood, curvature, max_chunk_elements))
    V = torch.cat(columns, dim=1)
    _check_finite(V, "the Jacobians of the model's outputs")
    return V


def _batch_factor(
    model: nn.Module, X: Inputs, y: Tensor, likelihood: str, curvature: Curvature, max_chunk_elements: int
) -> list[Tensor]:
    """Column blocks of ``V`` for one batch (see :func:`curvature_factor`)."""
    if not is_mapping(X):
        if X.is_floating_point():
            _check_finite(X, "the inputs")
        try:
            return _batch_factor_functorch(model, X, y, likelihood, curvature, max_chunk_elements)
        except (NotImplementedError, RuntimeError) as err:
            if not _functorch_unsupported(err):
                raise
            logger.info("torch.func cannot transform the model (%s); using reverse-mode autograd per sample.", err)
    return [torch.cat(list(per_sample_factor_columns(model, X, y, likelihood, curvature)), dim=1)]


def _batch_factor_functorch(
    model: nn.Module, X: Tensor, y: Tensor, likelihood: str, curvature: Curvature, max_chunk_elements: int
) -> list[Tensor]:
    fn = _model_fn(model)
    params = trainable_parameters(model)
    n_params = sum(p.numel() for p in params.values())

    def single(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return fn(p, x.unsqueeze(0)).squeeze(0)

    jac = vmap(jacrev(single), in_dims=(None, 0))
    columns = []
    with torch.no_grad():
        f = fn(params, X)
    _check_finite(f, "the model's outputs")
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
        _check_finite(X, "the inputs")
        with torch.no_grad():
            f, targets = output_rows(layer(X), y)  # token outputs: one row per token
        _check_finite(f, "the model's outputs")
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
    _check_likelihood(likelihood)
    _check_curvature(curvature)
    if isinstance(model, nn.Linear) and not any(is_mapping(X) for X, _ in batches):
        return _linear_dense_curvature(model, batches, likelihood, curvature)
    params = list(trainable_parameters(model).values())
    n_params = sum(p.numel() for p in params)
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
    ``λ̃_i += ‖(J_nᵀ A_n)ᵀ u_i‖²`` sample by sample (:func:`per_sample_factor_columns`).
    """
    _check_likelihood(likelihood)
    _check_curvature(curvature)
    params = trainable_parameters(model)
    n_params = sum(p.numel() for p in params.values())
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
                    if not _functorch_unsupported(err):
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
    """One batch of :func:`directional_curvatures` by ``vmap`` over forward-mode ``jvp``."""
    fn = _model_fn(model)
    k = U.shape[1]
    names = list(params)
    sizes = [params[n].numel() for n in names]
    result = torch.zeros(k, dtype=torch.float64, device=U.device)
    with torch.no_grad():
        f = fn(params, X)
    _check_finite(f, "the model's outputs")
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


def eigh_descending(G: Tensor) -> EigenPairs:
    """Full eigendecomposition of the symmetric part of ``G`` in float64, eigenvalues descending."""
    values, vectors = eigh_float64(G.double())
    return EigenPairs(values.flip(0), vectors.flip(1), "dense")


def _topk_gram(V: Tensor, k: int) -> EigenPairs:
    """Top-k eigenpairs of ``V Vᵀ`` through the smaller of ``VᵀV`` and ``V Vᵀ`` (float64)."""
    V = V.double()
    P, M = V.shape
    if P <= M:
        pairs = eigh_descending(V @ V.T)
        return EigenPairs(pairs.values[:k], pairs.vectors[:, :k], "gram")
    s, W = torch.linalg.eigh(V.T @ V)
    s, W = s.flip(0)[:k], W.flip(1)[:, :k]
    # Columns of V W / √s are orthonormal eigenvectors; drop the numerical null space.
    keep = s > s.max().clamp(min=0) * M * torch.finfo(torch.float64).eps
    s, W = s[keep], W[:, keep]
    return EigenPairs(s, (V @ W) / s.sqrt(), "gram")


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

    ``operator`` maps a flat ``(dim,)`` tensor of ``dtype`` on ``device`` to ``(dim,)`` (e.g. a
    :class:`laplace_debiased.curvature.operators.CountingOperator`, or ``linop.__matmul__`` of a
    curvlinops operator); the Lanczos recurrence itself runs in float64. The start vector is
    drawn from ``seed``, so results are reproducible. ``tol``: ``eigsh``'s relative accuracy
    (0 = machine precision). Returns float64 :class:`EigenPairs` (``(k,)`` eigenvalues
    descending, ``(dim, k)`` orthonormal eigenvectors, method ``"lanczos"``) on ``device``;
    no sign convention. Needs ``0 < k < dim`` (ARPACK's limit; form small operators densely).
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


def _topk_lanczos(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, curvature: Curvature, k: int, tol: float, n_outputs: int
) -> EigenPairs:
    """Top-k eigenpairs by :func:`lanczos_top_k` on :func:`summed_curvature_product`."""
    product = summed_curvature_product(model, batches, likelihood, curvature, n_outputs)
    first = next(iter(trainable_parameters(model).values()))
    return lanczos_top_k(product, parameter_count(model), k, tol=tol, dtype=first.dtype, device=first.device)


def parameter_count(model: nn.Module) -> int:
    """Number ``P`` of trainable parameters (the dimension of the curvature)."""
    return sum(p.numel() for p in trainable_parameters(model).values())


def summed_curvature_product(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, curvature: Curvature, n_outputs: int
) -> Callable[[Tensor], Tensor]:
    """``v ↦ G_B v`` (``(P,)`` in the model's dtype; the summed loss over ``batches``, the
    scaling of :func:`dense_curvature`), matrix-free: each product is one pass over the batches.
    No batches: the zero map.

    Built on :func:`laplace_debiased.curvature.operators.curvature_linop`, the curvature of the
    **mean** loss (``CrossEntropyLoss()`` or ``MSELoss()``) over the ``n`` output rows (samples,
    or every token of every sample for token outputs, :class:`_TokenRows`); the summed
    loss of this module (``factor · lossfunc(sum)``) has ``scale`` times that curvature, with
    ``scale = n`` (cross-entropy) or ``factor · n · C`` (``MSELoss`` averages over all ``n · C``
    entries), ``C = n_outputs``.
    """
    from laplace_debiased.curvature.operators import curvature_linop

    if not batches:
        return torch.zeros_like
    rows = [target_rows(model, X, y) for X, y in batches]
    if all(len(shape) == 1 for _, shape in rows):
        op_model, data, n = model, list(batches), count_samples(batches)
        batch_size_fn = mapping_rows if any(is_mapping(X) for X, _ in batches) else None
    else:  # token outputs: one row per token
        op_model = _TokenRows(model)
        data = [({"x": X, "rows": len(t)}, t) for (X, _), (t, _) in zip(batches, rows)]
        n, batch_size_fn = sum(len(t) for t, _ in rows), _rows_of
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


def _rows_of(inputs: Mapping[str, Any]) -> int:
    """``batch_size_fn`` of :class:`_TokenRows` inputs: their number of output rows."""
    return inputs["rows"]


def _n_outputs(model: nn.Module, batches: Sequence[Batch]) -> int:
    """Output width ``C`` of ``model`` from the first sample of the first batch."""
    return _sample_output_shape(model, batches[0][0])[-1]


LANCZOS_MATVEC_OVERHEAD = 5e7
"""Fixed cost of one Lanczos product (Python, autograd, scipy) in multiply-add equivalents."""


def choose_method(n_params: int, n_samples: int, n_columns: int, rank: int, max_gram_bytes: float = 2**30) -> str:
    """Pick ``"gram"`` or ``"lanczos"`` by a rough cost model (multiply-add equivalents).

    gram ``= 2 R n P`` (per-sample Jacobians, ``R = n_columns / n``) ``+ P M m + 10 m³``
    (forming and diagonalising the ``m × m`` matrix, ``m = min(P, M)``, ``M = n_columns``);
    lanczos ``= n_matvec · (6 n P + LANCZOS_MATVEC_OVERHEAD)`` with
    ``n_matvec = 4 max(2k + 1, 20)`` (three passes per GGN-vector product, restarts to
    machine precision). The constants were calibrated on one CPU core with the digits MLP/CNN
    (both routes take equally long at ``n = 64``, ``k = 10``, ``P ≈ 5k``). Gram is ruled out when
    ``V`` (float64) would exceed ``max_gram_bytes``, and forced when ``rank ≥ P − 1`` (``eigsh``
    needs ``k < P``).
    """
    if rank >= n_params - 1:
        return "gram"
    if 8 * n_params * n_columns > max_gram_bytes:
        return "lanczos"
    m = min(n_params, n_columns)
    gram = 2 * n_columns * n_params + n_params * n_columns * m + 10 * m**3
    lanczos = 4 * max(2 * rank + 1, 20) * (6 * n_samples * n_params + LANCZOS_MATVEC_OVERHEAD)
    return "gram" if gram <= lanczos else "lanczos"


def _lanczos_unless_unsupported(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    curvature: Curvature,
    rank: int,
    tol: float,
    n_out: int,
    fallback: bool,
) -> EigenPairs | None:
    """:func:`_topk_lanczos`, or ``None`` (``fallback``: use the Gram route) when the model has an
    operation without forward-mode AD, which curvlinops' products need; else a ``ValueError``."""
    try:
        return _topk_lanczos(model, batches, likelihood, curvature, rank, tol, n_out)
    except (NotImplementedError, RuntimeError) as err:
        if not _functorch_unsupported(err):
            raise
        if not fallback:
            raise ValueError(
                "method='lanczos' needs forward-mode AD of the model (curvlinops' GGN products), "
                f"which an operation of this model lacks ({err}); use method='gram'."
            ) from err
        logger.info("Lanczos needs forward-mode AD, which the model lacks; using the Gram route.")
        return None


def top_eigenpairs(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    rank: int,
    curvature: Curvature = "ggn",
    method: Method = "auto",
    rtol: float = 0.0,
    lanczos_tol: float = 0.0,
) -> EigenPairs:
    """Top-``rank`` eigenpairs of ``G_B`` (summed loss over ``batches``), float64, descending.

    ``method``: ``"auto"``, ``"gram"`` or ``"lanczos"`` (module docstring). ``rtol``: keep only
    eigenpairs with eigenvalue ``> rtol · λ_max`` (and ``> 0``), so fewer than ``rank`` may return.
    ``lanczos_tol``: ``eigsh``'s relative accuracy (0 = machine precision).
    """
    _check_likelihood(likelihood)
    _check_curvature(curvature)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    if rtol < 0 or not math.isfinite(rtol):
        raise ValueError(f"rtol must be a finite number ≥ 0, got {rtol!r}.")
    if not batches:
        raise ValueError("top_eigenpairs needs at least one batch.")
    n_params = sum(p.numel() for p in trainable_parameters(model).values())
    n_samples = count_rows(model, batches)  # output rows: samples × tokens
    n_out = _n_outputs(model, batches)
    n_columns = n_samples * (n_out if curvature == "ggn" else 1)
    rank = min(rank, n_params)
    chosen = choose_method(n_params, n_samples, n_columns, rank) if method == "auto" else method
    pairs = None
    if chosen == "lanczos":
        pairs = _lanczos_unless_unsupported(
            model, batches, likelihood, curvature, rank, lanczos_tol, n_out, fallback=method == "auto"
        )
    if pairs is None and isinstance(model, nn.Linear) and n_params <= n_columns and not is_mapping(batches[0][0]):
        return dense_top_eigenpairs(dense_curvature(model, batches, likelihood, curvature), rank, rtol, "gram")
    if pairs is None:
        pairs = _topk_gram(curvature_factor(model, batches, likelihood, curvature), rank)
    return threshold_eigenpairs(pairs, rtol)


def dense_top_eigenpairs(G: Tensor, rank: int, rtol: float = 0.0, method: str = "dense") -> EigenPairs:
    """Top-``rank`` eigenpairs of a dense symmetric ``G`` (``P × P``), float64, descending, with
    eigenvalue ``> rtol · λ_max`` and ``> 0`` (:func:`threshold_eigenpairs`); ``method`` labels
    the route. The dense route of :func:`top_eigenpairs`, and the one a distributed fit takes
    on the all-reduced ``G_B``."""
    dense = eigh_descending(G)
    return threshold_eigenpairs(EigenPairs(dense.values[:rank], dense.vectors[:, :rank], method), rtol)


def range_eigenpairs(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, curvature: Curvature = "ggn"
) -> EigenPairs:
    """All eigenpairs of ``G_B`` with eigenvalue above round-off (its numerical range), float64.

    Through ``VᵀV`` when ``G_B`` has fewer columns ``M = n·R`` than parameters (``M × M``
    eigenproblem instead of ``P × P``), else the dense eigendecomposition. Eigenvalues
    ``≤ P · eps · λ_max`` count as zero and are left out: their eigenvectors are not determined
    by ``G_B`` (any basis of its null space is one).
    """
    n_params = sum(p.numel() for p in trainable_parameters(model).values())
    n_out = _n_outputs(model, batches)
    n_columns = count_rows(model, batches) * (n_out if curvature == "ggn" else 1)
    if n_columns < n_params:
        pairs = _topk_gram(curvature_factor(model, batches, likelihood, curvature), n_columns)
        return threshold_eigenpairs(pairs, n_params * torch.finfo(torch.float64).eps)
    return dense_range_eigenpairs(dense_curvature(model, batches, likelihood, curvature))


def dense_range_eigenpairs(G: Tensor) -> EigenPairs:
    """Eigenpairs of a dense symmetric ``G`` (``P × P``) with eigenvalue above round-off
    (``> P · eps · λ_max``), float64, descending: the dense route of :func:`range_eigenpairs`,
    and the one a distributed fit takes on the all-reduced ``G_B``."""
    return dense_top_eigenpairs(G, G.shape[0], G.shape[0] * torch.finfo(torch.float64).eps)


def eigenbasis_debiased_curvature(U: Tensor, remeasured: Tensor, G_magnitude: Tensor) -> Tensor:
    """Dense debiased curvature ``U diag(λ̃) Uᵀ + Π G_B̃ Π`` with ``Π = I − U Uᵀ`` (float64).

    ``U`` ``(P, r)``: orthonormal range of ``G_B``; ``λ̃ = diag(Uᵀ G_B̃ U)``; ``G_magnitude``:
    ``G_B̃`` ``(P, P)``. On B's range, B's eigenvectors with B̃'s Rayleigh quotients (the
    debiasing); on B's null space, where B singles out no direction, the compression of ``G_B̃``
    (basis-free, unbiased for the full-data curvature there since B̃ is independent of B). For
    ``r = P`` this is ``U diag(diag(Uᵀ G_B̃ U)) Uᵀ``; with ``G_B̃ = G_B`` it is ``G_B``.
    """
    U, G = U.double(), G_magnitude.double()
    GU = G @ U
    UtGU = U.T @ GU
    H = (U * remeasured.double()) @ U.T + G - GU @ U.T - U @ GU.T + U @ UtGU @ U.T
    return 0.5 * (H + H.T)


def above_relative_floor(values: Tensor, rtol: float) -> Tensor:
    """Boolean mask of ``values > rtol · max(values)`` and ``> 0`` (all False if none is positive)."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    return values > max(float(values.max()) * rtol, 0.0)


def threshold_eigenpairs(pairs: EigenPairs, rtol: float) -> EigenPairs:
    """Keep eigenpairs with eigenvalue ``> rtol · max(eigenvalues)`` and ``> 0``."""
    keep = above_relative_floor(pairs.values, rtol)
    return EigenPairs(pairs.values[keep], pairs.vectors[:, keep], pairs.method)


def curved_directions(curvatures: Tensor, rtol: float) -> Tensor:
    """Mask of the directions to keep after re-measuring: ``λ̃ > rtol · max λ̃`` and ``λ̃ > 0``.

    A direction with curvature ``λ̃`` adds ``λ̃ u uᵀ`` to the precision, so removing one is exact
    for ``λ̃ = 0``, changes the precision by at most ``rtol · max λ̃`` otherwise, and keeps the
    Woodbury inverse ``diag(1/λ̃)`` finite. Negative values can only come from round-off (a
    GGN/EF is PSD) and are removed as well. All directions go if no ``λ̃`` is positive.
    """
    return above_relative_floor(curvatures, rtol)

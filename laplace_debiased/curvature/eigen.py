"""Eigen-structured curvature of a list of mini-batches (pure functions, tensors in, tensors out).

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

The routes to the top-k eigenpairs (``top_eigenpairs``):

- ``"lanczos"``: [`lanczos_top_k`][laplace_debiased.curvature.lanczos.lanczos_top_k]
  (``scipy.sparse.linalg.eigsh`` in float64, the one Lanczos routine of the package, also used by the
  diagnostics) on the matrix-free curvlinops GGN/EF operator of
  [`laplace_debiased.curvature.operators.curvature_linop`][laplace_debiased.curvature.operators.curvature_linop]
  (mean loss, rescaled to the summed loss; each product is one pass over the batches).
- ``"gram"``: exact, through the low-rank structure (ViViT, Dangel et al. 2022): build ``V`` from
  per-sample Jacobians and diagonalise the small matrix — ``VᵀV`` (``n·R × n·R``) when that is
  smaller than ``P × P``, else ``V Vᵀ`` (for an ``nn.Linear``, ``V Vᵀ`` is formed from
  features ⊗ output curvature, never from per-parameter autograd).
- ``"auto"`` compares the rough costs of both (``choose_method``).

Re-measuring curvature along given directions (``directional_curvatures``) costs one pass over the
batches for all ``k`` directions together (forward-mode ``J u`` for a chunk of directions at once,
vectorised with ``torch.func.vmap``): ``λ̃_i = Σ_n ‖A_nᵀ J_n u_i‖²``.

Token outputs. A model may output ``(n, tokens, C)`` (any number of token dimensions) with every token an output
of its own loss term (laplace-torch's LLM convention), targets ``(n, tokens)`` (class labels) or
``(n, tokens, C)``: ``J_n`` and ``Λ_n`` above are then per token, the sum runs over all
``n·tokens`` *rows* of the outputs
([`laplace_debiased.curvature.kfac.output_rows`][laplace_debiased.curvature.kfac.output_rows], the one
flattening helper), and ``V`` has ``n·tokens·R`` columns. A sample is still a sequence: ``N / n`` and
``count_samples`` count sequences.

Inputs and models. A batch's input ``X`` is a tensor or a mapping (a dict or a Hugging Face ``BatchEncoding``) that
the model consumes whole, ``model(X)`` (laplace-torch's ``dict_key_x``/``dict_key_y``
convention; the targets come separately). Tensor inputs take the ``torch.func`` routes above.
Mapping inputs, and models with an operation that has no forward-mode derivative (a
``nn.MultiheadAttention`` fast path, CPU flash attention), take the reverse-mode route: one
forward per sample (the mapping's tensors sliced to that row) and ``R`` backward passes, giving
the same columns ``J_nᵀ A_n`` (``per_sample_factor_columns``). Module backward hooks (BackPACK's
``extend`` installs them; ``torch.func`` cannot trace them) are detached while the curvature is
computed and restored afterwards (``backward_hooks_detached``); outside a ``backpack(...)``
context they do nothing, so nothing changes.

Modules: [`inputs`][laplace_debiased.curvature.inputs] (input plumbing),
[`factors`][laplace_debiased.curvature.factors] (the Jacobian routes: ``V``, dense ``G_B``, directional
curvatures), [`lanczos`][laplace_debiased.curvature.lanczos] (the Lanczos route),
[`thresholds`][laplace_debiased.curvature.thresholds]
([`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs] and which to keep); this module picks the
route. Import each name from the module that defines it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from laplace_debiased.curvature.factors import curvature_factor, dense_curvature
from laplace_debiased.curvature.inputs import (
    Batch,
    Curvature,
    check_curvature,
    check_likelihood,
    functorch_unsupported,
    output_width,
    count_rows,
    is_mapping,
    parameter_count,
)
from laplace_debiased.curvature.lanczos import summed_curvature_top_k
from laplace_debiased.curvature.linalg import symmetric_eigh64
from laplace_debiased.curvature.thresholds import EigenPairs, threshold_eigenpairs

Method = Literal["auto", "gram", "lanczos"]

METHODS = ("auto", "gram", "lanczos")

logger = logging.getLogger(__name__)


def eigh_descending(G: Tensor) -> EigenPairs:
    """Full eigendecomposition of the symmetric part of ``G`` in float64, eigenvalues descending."""
    values, vectors = symmetric_eigh64(G)
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


LANCZOS_MATVEC_OVERHEAD = 5e7
"""Fixed cost of one Lanczos product (Python, autograd, scipy) in multiply-add equivalents."""


def choose_method(n_params: int, n_samples: int, n_columns: int, rank: int, max_gram_bytes: float = 2**30) -> str:
    """Pick ``"gram"`` or ``"lanczos"`` by a rough cost model (multiply-add equivalents).

    Args:
        n_params: number ``P`` of parameters.
        n_samples: number ``n`` of samples.
        n_columns: number ``M`` of Jacobian columns (``n`` times the outputs per sample for the
            GGN, ``n`` for the empirical Fisher).
        rank: number ``k`` of eigenpairs asked for.
        max_gram_bytes: the largest float64 ``V`` the Gram route may form.

    Returns:
        ``"gram"`` or ``"lanczos"``.

    The cost model:

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
    """[`summed_curvature_top_k`][laplace_debiased.curvature.lanczos.summed_curvature_top_k], or ``None``
    (``fallback``: use the Gram route) when the model has an operation without forward-mode AD, which
    curvlinops' products need; else a ``ValueError``."""
    try:
        return summed_curvature_top_k(model, batches, likelihood, curvature, rank, tol, n_out)
    except (NotImplementedError, RuntimeError) as err:
        if not functorch_unsupported(err):
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

    Args:
        model: the network; its trainable parameters span the ``P`` dimensions.
        batches: ``(X, y)`` pairs of the batch B.
        likelihood: ``"classification"`` or ``"regression"``.
        rank: number of eigenpairs asked for.
        curvature: ``"ggn"`` or ``"ef"``.
        method: ``"auto"``, ``"gram"`` or ``"lanczos"`` (module docstring).
        rtol: keep only eigenpairs with eigenvalue ``> rtol · λ_max`` (and ``> 0``), so fewer than
            ``rank`` may return.
        lanczos_tol: ``eigsh``'s relative accuracy (0 = machine precision).

    Returns:
        float64 [`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs]: ``(r,)`` eigenvalues
        descending and ``(P, r)`` orthonormal eigenvectors, ``r <= rank``.
    """
    check_likelihood(likelihood)
    check_curvature(curvature)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    if rtol < 0 or not math.isfinite(rtol):
        raise ValueError(f"rtol must be a finite number ≥ 0, got {rtol!r}.")
    if not batches:
        raise ValueError("top_eigenpairs needs at least one batch.")
    n_params = parameter_count(model)
    n_samples = count_rows(model, batches)  # output rows: samples × tokens
    n_out = output_width(model, batches)
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
    """Top-``rank`` eigenpairs of a dense symmetric ``G``, float64, descending.

    The dense route of [`top_eigenpairs`][laplace_debiased.curvature.eigen.top_eigenpairs], and the one a
    distributed fit takes on the all-reduced ``G_B``.

    Args:
        G: ``(P, P)`` symmetric matrix.
        rank: number of eigenpairs asked for.
        rtol: keep only eigenpairs with eigenvalue ``> rtol · λ_max`` and ``> 0``
            ([`threshold_eigenpairs`][laplace_debiased.curvature.thresholds.threshold_eigenpairs]).
        method: the label of the route in the result.

    Returns:
        float64 [`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs], at most ``rank`` of them.
    """
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
    n_params = parameter_count(model)
    n_columns = factor_columns(model, batches, curvature)
    if n_columns < n_params:
        pairs = _topk_gram(curvature_factor(model, batches, likelihood, curvature), n_columns)
        return threshold_eigenpairs(pairs, n_params * torch.finfo(torch.float64).eps)
    return dense_range_eigenpairs(dense_curvature(model, batches, likelihood, curvature))


def factor_columns(model: nn.Module, batches: Sequence[Batch], curvature: Curvature = "ggn") -> int:
    """Number of columns ``M = rows · R`` of the factor ``V`` of ``G_B = V Vᵀ``
    ([`curvature_factor`][laplace_debiased.curvature.factors.curvature_factor]): ``R`` = outputs for the GGN,
    1 for the empirical Fisher."""
    n_out = output_width(model, batches)
    return count_rows(model, batches) * (n_out if curvature == "ggn" else 1)


def dense_range_eigenpairs(G: Tensor) -> EigenPairs:
    """Eigenpairs of a dense symmetric ``G`` (``P × P``) with eigenvalue above round-off
    (``> P · eps · λ_max``), float64, descending: the dense route of
    [`range_eigenpairs`][laplace_debiased.curvature.eigen.range_eigenpairs], and the one a distributed fit
    takes on the all-reduced ``G_B``."""
    return dense_top_eigenpairs(G, G.shape[0], G.shape[0] * torch.finfo(torch.float64).eps)


def eigenbasis_debiased_curvature(U: Tensor, remeasured: Tensor, G_magnitude: Tensor) -> Tensor:
    """Dense debiased curvature ``U diag(λ̃) Uᵀ + Π G_B̃ Π`` with ``Π = I − U Uᵀ`` (float64).

    On B's range, B's eigenvectors with B̃'s Rayleigh quotients (the
    debiasing); on B's null space, where B singles out no direction, the compression of ``G_B̃``
    (basis-free, unbiased for the full-data curvature there since B̃ is independent of B). For
    ``r = P`` this is ``U diag(diag(Uᵀ G_B̃ U)) Uᵀ``; with ``G_B̃ = G_B`` it is ``G_B``.

    Args:
        U: ``(P, r)`` orthonormal range of ``G_B``.
        remeasured: ``(r,)`` Rayleigh quotients ``λ̃ = diag(Uᵀ G_B̃ U)``.
        G_magnitude: ``G_B̃``, ``(P, P)``.

    Returns:
        ``(P, P)`` float64 debiased curvature.
    """
    U, G = U.double(), G_magnitude.double()
    GU = G @ U
    UtGU = U.T @ GU
    H = (U * remeasured.double()) @ U.T + G - GU @ U.T - U @ GU.T + U @ UtGU @ U.T
    return 0.5 * (H + H.T)


def factored_null_space_compression(U: Tensor, V_magnitude: Tensor) -> tuple[Tensor, EigenPairs]:
    """For ``G_B̃ = V Vᵀ`` (``V`` ``(P, M)``): ``λ̃ = diag(Uᵀ G_B̃ U)`` ``(r,)`` and the eigenpairs
    ``(μ, N)`` of ``Π G_B̃ Π`` (``Π = I − U Uᵀ``), all float64, from ``V`` alone.

    ``λ̃_i = ‖(UᵀV)_i‖²``; with ``Z = Π V`` the non-zero eigenpairs of ``Z Zᵀ = Π G_B̃ Π`` come
    from the ``M × M`` Gram ``ZᵀZ`` (``O(P M²)``, no ``P × P`` eigenproblem); eigenvalues
    ``≤ P · eps · max(λ̃, μ)`` are round-off and dropped. Then
    ``eigenbasis_debiased_curvature(U, λ̃, G_B̃) = U diag(λ̃) Uᵀ + N diag(μ) Nᵀ`` (to round-off),
    an eigendecomposition of the debiased curvature up to the orthogonality of ``[U, N]``."""
    U, V = U.double(), V_magnitude.double()
    UtV = U.T @ V
    remeasured = UtV.square().sum(dim=1)
    pairs = _topk_gram(V - U @ UtV, V.shape[1])
    scale = torch.cat([remeasured, pairs.values, remeasured.new_zeros(1)]).max()
    keep = pairs.values > U.shape[0] * torch.finfo(torch.float64).eps * scale
    return remeasured, EigenPairs(pairs.values[keep], pairs.vectors[:, keep], "gram")

"""The debiased low-rank and full curvature decompositions (Tatzel et al., ICLR 2025), as plain
functions of a curvature module, this rank's rows of B and B̃, and a reducer.

Both keep the eigenvectors ``U`` of the direction batch's curvature ``G_B`` and re-measure the
eigenvalues on the independent magnitude batch B̃ as the Rayleigh quotients
``λ̃_i = u_iᵀ G_B̃ u_i``:

- low rank ([`debiased_lowrank`][laplace_debiased.eigen.decompose.debiased_lowrank]): the top-``k``
  eigenpairs of ``G_B``, the directions whose ``λ̃`` is at most ``remeasured_rtol · max λ̃`` left out;
  or (``estimator="corrected"``) the top-``k`` eigenpairs of ``G_{B ∪ B̃}``, their eigenvalues less the
  bias both orders of B and B̃ measure
  ([`corrected_lowrank`][laplace_debiased.eigen.decompose.corrected_lowrank]);
- full ([`debiased_full`][laplace_debiased.eigen.decompose.debiased_full]): every eigenvector of ``G_B``
  with non-zero eigenvalue and, on ``G_B``'s null space (projector ``Π = I − U Uᵀ``), the compression
  ``Π G_B̃ Π``: ``H = U diag(λ̃) Uᵀ + Π G_B̃ Π``
  ([`decompose_debiased_full`][laplace_debiased.eigen.decompose.decompose_debiased_full]).

Scale convention (that of a laplace-torch fit over ``N`` data): a batch set of ``m`` samples
contributes ``N/m`` times the curvature of its summed loss. B̃ = B (``magnitude_batches=None``)
reduces both to their single-batch versions.

Every batch list here holds this rank's rows only (all rows in one process); the curvatures
and products of the ranks are added through the reducer, and what is decomposed is decomposed
on rank 0 and sent to every rank, so every rank holds the same result. The dense curvature
``G_B`` summed over the ranks is at most
[`MAX_DISTRIBUTED_DENSE_BYTES`][laplace_debiased.eigen.decompose.MAX_DISTRIBUTED_DENSE_BYTES]; beyond that,
or with ``method="lanczos"``, the low-rank route runs Lanczos on rank 0 with every product ``G_B v`` summed
over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from laplace_debiased.curvature import eigen
from laplace_debiased.curvature.factors import dense_curvature, directional_curvatures
from laplace_debiased.curvature.inputs import Batch, Curvature, parameter_count, trainable_parameters
from laplace_debiased.curvature.lanczos import lanczos_top_k, summed_curvature_product
from laplace_debiased.curvature.linalg import order_weights, remeasure_eigenvalues
from laplace_debiased.curvature.thresholds import EigenPairs, above_relative_floor, threshold_eigenpairs
from laplace_debiased.parallel.reducer import Reducer

__all__ = [
    "LOWRANK_ESTIMATORS",
    "MAX_DISTRIBUTED_DENSE_BYTES",
    "CurvatureSource",
    "FullDecomposition",
    "LowRankDecomposition",
    "corrected_lowrank",
    "debiased_full",
    "debiased_lowrank",
    "decompose_debiased_full",
    "direction_eigenpairs",
    "remeasured_eigenvalues",
    "summed_dense_curvature",
    "symmetric_outer",
]

#: the estimates of ``debiased_lowrank`` (``estimator=...``): B's eigenvectors with B̃'s Rayleigh quotients,
#: or the corrected top eigenvalues of B ∪ B̃ ([`corrected_lowrank`][laplace_debiased.eigen.decompose.corrected_lowrank])
LOWRANK_ESTIMATORS = ("paper", "corrected")

#: the largest dense float64 ``G_B`` (bytes) a low-rank fit over several ranks sums over them
MAX_DISTRIBUTED_DENSE_BYTES = 2**30


@dataclass(frozen=True)
class CurvatureSource:
    """What a curvature is computed from, besides the batches.

    Attributes:
        module: the network, or its last layer; its trainable parameters span the ``P``
            dimensions (``named_parameters()`` order).
        likelihood: ``"classification"`` or ``"regression"``.
        curvature: ``"ggn"`` (exact GGN) or ``"ef"`` (empirical Fisher).
        n_outputs: the output width ``C`` (the matrix-free product needs it).
    """

    module: nn.Module
    likelihood: str
    curvature: Curvature
    n_outputs: int


@dataclass(frozen=True)
class LowRankDecomposition:
    """The debiased low-rank curvature ``U diag(λ̃) Uᵀ``, scaled to ``n_data``.

    Attributes:
        vectors: ``U``, ``(P, r)`` float64 orthonormal eigenvectors of ``G_B`` (B's order).
        eigenvalues: ``λ̃``, ``(r,)`` float64 Rayleigh quotients of ``G_B̃`` along ``U``.
        direction_eigenvalues: ``(r,)`` float64, B's own eigenvalues of ``U``.
        method: the route to B's eigenpairs (``"gram"``, ``"lanczos"``, ``"dense"``).
    """

    vectors: Tensor
    eigenvalues: Tensor
    direction_eigenvalues: Tensor
    method: str


@dataclass(frozen=True)
class FullDecomposition:
    """The debiased dense curvature ``H = U diag(λ̃) Uᵀ + Π G_B̃ Π``, scaled to ``n_data``.

    Exactly one of ``dense`` and ``eigenpairs`` is set.

    Attributes:
        direction_eigenvalues: ``(r,)`` float64 non-zero eigenvalues of ``G_B``, descending.
        eigenvalues: ``λ̃``, ``(r,)`` float64 Rayleigh quotients of ``G_B̃`` along their
            eigenvectors ``U``.
        dense: ``H``, ``(P, P)`` float64 symmetric, where the route does not give its eigenpairs.
        eigenpairs: ``([U, N] (P, r'), [λ̃, μ] (r',))`` float64 with ``H = [U, N] diag([λ̃, μ])
            [U, N]ᵀ`` (``N diag(μ) Nᵀ = Π G_B̃ Π``), orthonormal up to round-off.
    """

    direction_eigenvalues: Tensor
    eigenvalues: Tensor
    dense: Tensor | None
    eigenpairs: tuple[Tensor, Tensor] | None


def summed_dense_curvature(source: CurvatureSource, batches: list[Batch], reducer: Reducer) -> Tensor:
    """Dense ``G`` of the summed loss over every rank's rows, on every rank.

    Args:
        source: the module and its curvature.
        batches: this rank's ``(X, y)`` rows of the batch set.
        reducer: adds the ranks' shares (one ``sum_``).

    Returns:
        ``(P, P)`` float64 ``G`` (not rescaled).
    """
    G = dense_curvature(source.module, batches, source.likelihood, source.curvature)
    reducer.sum_([G])
    return G


def remeasured_eigenvalues(
    source: CurvatureSource, batches: list[Batch], vectors: Tensor, reducer: Reducer
) -> Tensor:
    """The Rayleigh quotients ``λ̃_i = u_iᵀ G u_i`` of the summed-loss curvature ``G`` over
    every rank's rows, on every rank.

    Args:
        source: the module and its curvature.
        batches: this rank's ``(X, y)`` rows of the batch set.
        vectors: ``(P, k)`` directions ``u_i``.
        reducer: adds the ranks' shares (one ``sum_``).

    Returns:
        ``(k,)`` float64 ``λ̃`` (not rescaled).
    """
    lam = directional_curvatures(source.module, batches, vectors, source.likelihood, source.curvature)
    reducer.sum_([lam])
    return lam


def direction_eigenpairs(
    source: CurvatureSource,
    batches: list[Batch],
    *,
    rank: int,
    method: eigen.Method,
    eigval_rtol: float,
    reducer: Reducer,
) -> EigenPairs:
    """Top-``rank`` eigenpairs of ``G_B`` over every rank's rows of B (not rescaled), on every rank.

    In one process: [`top_eigenpairs`][laplace_debiased.curvature.eigen.top_eigenpairs] by ``method``. Over
    several ranks: the dense route on ``G_B`` summed over the ranks, decomposed on rank 0, or
    (``method="lanczos"``, or ``"auto"`` when the dense ``G_B`` exceeds
    [`MAX_DISTRIBUTED_DENSE_BYTES`][laplace_debiased.eigen.decompose.MAX_DISTRIBUTED_DENSE_BYTES]) Lanczos
    on rank 0 with every product ``G_B v`` summed over the ranks.

    Args:
        source: the module and its curvature.
        batches: this rank's ``(X, y)`` rows of B.
        rank: the number ``k`` of eigenpairs asked for.
        method: ``"auto"``, ``"gram"`` or ``"lanczos"``.
        eigval_rtol: eigenpairs with eigenvalue ``≤ eigval_rtol · λ_max`` are left out.
        reducer: the ranks' collectives.

    Returns:
        float64 [`EigenPairs`][laplace_debiased.curvature.thresholds.EigenPairs], ``(r,)`` descending and
        ``(P, r)`` with ``r ≤ rank``.

    Raises:
        ValueError: over several ranks, ``method="gram"`` with a dense ``G_B`` over the limit.
    """
    if reducer.world == 1:
        return eigen.top_eigenpairs(
            source.module, batches, source.likelihood, rank, source.curvature, method, eigval_rtol
        )
    n_params = parameter_count(source.module)
    dense_fits = 8 * n_params**2 <= MAX_DISTRIBUTED_DENSE_BYTES
    if method == "lanczos" or (method == "auto" and not dense_fits):
        return _lanczos_pairs(source, batches, rank, eigval_rtol, n_params, reducer)
    if not dense_fits:
        raise ValueError(
            f"a distributed debiased_lowrank fit with method='gram' all-reduces the dense "
            f"{n_params} x {n_params} curvature of B, over 1 GiB here; use method='lanczos' "
            "(or 'auto')."
        )
    G_B = summed_dense_curvature(source, batches, reducer)
    values, vectors = reducer.computed_on_rank0(
        lambda: _pair_tensors(eigen.dense_top_eigenpairs(G_B, rank, eigval_rtol)), G_B.device
    )
    return EigenPairs(values, vectors, "dense")


def _lanczos_pairs(
    source: CurvatureSource, batches: list[Batch], rank: int, eigval_rtol: float, n_params: int,
    reducer: Reducer,
) -> EigenPairs:
    """Lanczos on rank 0 over ``v ↦ G_B v``, each product summed over the ranks' rows."""
    product = summed_curvature_product(
        source.module, batches, source.likelihood, source.curvature, source.n_outputs
    )
    first = next(iter(trainable_parameters(source.module).values()))
    k = min(rank, n_params)

    def lanczos(operator: Any) -> tuple[Tensor, Tensor]:
        pairs = lanczos_top_k(operator, n_params, k, dtype=first.dtype, device=first.device)
        return _pair_tensors(threshold_eigenpairs(pairs, eigval_rtol))

    values, vectors = reducer.run_with_summed_operator(product, lanczos, n_params, first.dtype, first.device)
    return EigenPairs(values, vectors, "lanczos")


def _pair_tensors(pairs: EigenPairs) -> tuple[Tensor, Tensor]:
    return pairs.values, pairs.vectors


def debiased_lowrank(
    source: CurvatureSource,
    direction_batches: list[Batch],
    magnitude_batches: list[Batch] | None,
    *,
    sizes: tuple[int, int],
    n_data: int,
    rank: int,
    method: eigen.Method,
    eigval_rtol: float,
    remeasured_rtol: float,
    reducer: Reducer,
    estimator: str = "paper",
) -> LowRankDecomposition:
    """The debiased low-rank curvature: B's top eigenvectors, B̃'s Rayleigh quotients, or
    (``estimator="corrected"``) [`corrected_lowrank`][laplace_debiased.eigen.decompose.corrected_lowrank].

    Args:
        source: the module and its curvature.
        direction_batches: this rank's ``(X, y)`` rows of B.
        magnitude_batches: this rank's rows of B̃; ``None`` for B̃ = B (then ``λ̃`` are B's
            eigenvalues: the single-batch low-rank curvature).
        sizes: the samples of B and B̃ over all ranks.
        n_data: ``N``, the training data the curvature is scaled to.
        rank: the number ``k`` of eigenpairs of ``G_B`` asked for.
        method: the route to them
            ([`direction_eigenpairs`][laplace_debiased.eigen.decompose.direction_eigenpairs]).
        eigval_rtol: B's eigenpairs with eigenvalue ``≤ eigval_rtol · λ_max`` are not selected.
        remeasured_rtol: directions with ``λ̃ ≤ remeasured_rtol · max λ̃`` (or ``≤ 0``) are
            left out.
        reducer: the ranks' collectives.
        estimator: one of [`LOWRANK_ESTIMATORS`][laplace_debiased.eigen.decompose.LOWRANK_ESTIMATORS]; both
            give the single-batch curvature for B̃ = B.

    Returns:
        The [`LowRankDecomposition`][laplace_debiased.eigen.decompose.LowRankDecomposition], scaled to
        ``n_data`` (``N/|B|`` and ``N/|B̃|``).

    Raises:
        ValueError: an unknown ``estimator``.
    """
    if estimator not in LOWRANK_ESTIMATORS:
        raise ValueError(f"debiased_lowrank offers estimator in {LOWRANK_ESTIMATORS}, got {estimator!r}.")
    kw = {"rank": rank, "method": method, "eigval_rtol": eigval_rtol, "reducer": reducer}
    if estimator == "corrected" and magnitude_batches is not None:
        return corrected_lowrank(source, direction_batches, magnitude_batches, sizes=sizes, n_data=n_data,
                                 remeasured_rtol=remeasured_rtol, **kw)
    pairs = direction_eigenpairs(source, direction_batches, **kw)
    scale_B = n_data / sizes[0]
    if magnitude_batches is None:
        remeasured = pairs.values * scale_B
    else:
        remeasured = remeasured_eigenvalues(source, magnitude_batches, pairs.vectors, reducer) * (n_data / sizes[1])
    keep = above_relative_floor(remeasured, remeasured_rtol)
    return LowRankDecomposition(pairs.vectors[:, keep], remeasured[keep], pairs.values[keep] * scale_B, pairs.method)


def decompose_debiased_full(
    pairs: EigenPairs, G_magnitude: Tensor | None, scale_B: float
) -> FullDecomposition:
    """The debiased dense curvature from B's range eigenpairs and B̃'s curvature.

    ``H = U diag(λ̃) Uᵀ + Π G_B̃ Π`` with ``λ̃ = diag(Uᵀ G_B̃ U)`` and ``Π = I − U Uᵀ``
    ([`eigenbasis_debiased_curvature`][laplace_debiased.curvature.eigen.eigenbasis_debiased_curvature]), all
    float64.

    Args:
        pairs: the range of ``G_B``: ``(r,)`` non-zero eigenvalues, ``(P, r)`` orthonormal
            eigenvectors ``U`` (not rescaled).
        G_magnitude: ``G_B̃`` already scaled: ``None`` for B̃ = B (then ``H = G_B``), a factor
            ``V`` ``(P, M)`` with ``M < P`` and ``G_B̃ = V Vᵀ`` (then ``H`` comes as eigenpairs,
            [`factored_null_space_compression`][laplace_debiased.curvature.eigen.factored_null_space_compression]),
            or the dense ``(P, P)`` matrix (then ``H`` comes dense).
        scale_B: ``N/|B|``, the scale of B's eigenvalues.

    Returns:
        The [`FullDecomposition`][laplace_debiased.eigen.decompose.FullDecomposition].
    """
    U = pairs.vectors.double()
    values = pairs.values.double() * scale_B
    if G_magnitude is None:
        return FullDecomposition(values, values, None, (U, values))
    G = G_magnitude.double()
    if G.shape[0] != G.shape[1]:  # a factor: H = U diag(λ̃) Uᵀ + N diag(μ) Nᵀ
        lam, null = eigen.factored_null_space_compression(U, G)
        return FullDecomposition(values, lam, None, (torch.cat([U, null.vectors], dim=1), torch.cat([lam, null.values])))
    lam = remeasure_eigenvalues(U, G).double()
    H = eigen.eigenbasis_debiased_curvature(U, lam, G)
    return FullDecomposition(values, lam, 0.5 * (H + H.T), None)


def symmetric_outer(Q: Tensor, h: Tensor) -> Tensor:
    """``Q diag(h) Qᵀ`` made exactly symmetric (the average with its transpose).

    Args:
        Q: ``(P, r)`` vectors.
        h: ``(r,)`` weights.

    Returns:
        The ``(P, P)`` matrix, in the dtype of ``Q``.
    """
    H = (Q * h) @ Q.T
    return 0.5 * (H + H.T)


def _dense_debiased_full(pairs: EigenPairs, G_magnitude: Tensor | None, scale_B: float) -> list[Tensor]:
    """``[B's eigenvalues, λ̃, H]`` of
    [`decompose_debiased_full`][laplace_debiased.eigen.decompose.decompose_debiased_full] with ``H`` always
    dense."""
    result = decompose_debiased_full(pairs, G_magnitude, scale_B)
    H = result.dense if result.dense is not None else symmetric_outer(*result.eigenpairs)
    return [result.direction_eigenvalues, result.eigenvalues, H]


def _magnitude_curvature(
    source: CurvatureSource, batches: list[Batch], scale: float, reducer: Reducer
) -> Tensor:
    """``G_B̃`` times ``scale``: in one process the factor ``√scale · V`` (``(P, M)``,
    ``G_B̃ = V Vᵀ``) when ``M < P``, else (and over several ranks) the dense ``(P, P)`` matrix."""
    module = source.module
    if reducer.world == 1 and eigen.factor_columns(module, batches, source.curvature) < parameter_count(module):
        V = eigen.curvature_factor(module, batches, source.likelihood, source.curvature)
        return V.double() * scale**0.5
    return summed_dense_curvature(source, batches, reducer) * scale


def debiased_full(
    source: CurvatureSource,
    direction_batches: list[Batch],
    magnitude_batches: list[Batch] | None,
    *,
    sizes: tuple[int, int],
    n_data: int,
    reducer: Reducer,
) -> FullDecomposition:
    """The debiased dense curvature
    ([`decompose_debiased_full`][laplace_debiased.eigen.decompose.decompose_debiased_full]) of B and B̃.

    In one process B's range eigenpairs come from ``VᵀV`` when ``|B|·C < P``
    ([`range_eigenpairs`][laplace_debiased.curvature.eigen.range_eigenpairs]) and B̃ enters through its factor
    when ``|B̃|·C < P``. Over several ranks the dense ``G_B̃`` and ``G_B`` are summed over the
    ranks (in that order), rank 0 decomposes and every rank receives the dense ``H``.

    Args:
        source: the module and its curvature.
        direction_batches: this rank's ``(X, y)`` rows of B.
        magnitude_batches: this rank's rows of B̃; ``None`` for B̃ = B (``H = G_B``).
        sizes: the samples of B and B̃ over all ranks.
        n_data: ``N``, the training data the curvature is scaled to.
        reducer: the ranks' collectives.

    Returns:
        The [`FullDecomposition`][laplace_debiased.eigen.decompose.FullDecomposition], scaled to ``n_data``.
    """
    scale_B, scale_mag = n_data / sizes[0], n_data / sizes[1]
    G_mag = None if magnitude_batches is None else _magnitude_curvature(source, magnitude_batches, scale_mag, reducer)
    if reducer.world > 1:
        G_B = summed_dense_curvature(source, direction_batches, reducer)
        values, lam, H = reducer.computed_on_rank0(
            lambda: _dense_debiased_full(eigen.dense_range_eigenpairs(G_B), G_mag, scale_B), G_B.device
        )
        return FullDecomposition(values, lam, H, None)
    pairs = eigen.range_eigenpairs(source.module, direction_batches, source.likelihood, source.curvature)
    return decompose_debiased_full(pairs, G_mag, scale_B)


def corrected_lowrank(
    source: CurvatureSource,
    direction_batches: list[Batch],
    magnitude_batches: list[Batch],
    *,
    sizes: tuple[int, int],
    n_data: int,
    rank: int,
    method: eigen.Method,
    eigval_rtol: float,
    remeasured_rtol: float,
    reducer: Reducer,
) -> LowRankDecomposition:
    """The top-``k`` eigenvectors of B ∪ B̃ with eigenvalues less the bias the two orders measure.

    With ``H_S`` the curvature of batch set ``S`` scaled to ``n_data``, B ∪ B̃ pooled (the single batch
    of ``n = |B| + |B̃|`` samples), and each order's gaps ``g_{B,i} = λ_i(H_B) - u_{B,i}ᵀ H_B̃ u_{B,i}``
    over B's top-``k`` eigenpairs (``g_B̃`` the same with B̃ choosing):

    ``λ̂_i = (λ_i(H_{B∪B̃}) - k_B g_{B,i} - k_B̃ g_{B̃,i})⁺``

    matched by position (descending), with the order weights ``(k_B, k_B̃)`` of
    [`order_weights`][laplace_debiased.curvature.linalg.order_weights] (the estimate ``"corrected"`` of
    [`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected] on the top ``k``; only top-``k``
    eigenpairs and the other batch's curvature along them are needed). Positions beyond the fewest
    eigenpairs the three decompositions return are left out, then directions with
    ``λ̂ ≤ remeasured_rtol · max λ̂``. The minimum-MSE weight of ``"stein"`` is not offered: its variance
    sums over every eigen-direction, not the top ``k``.

    Args:
        source: the module and its curvature.
        direction_batches: this rank's ``(X, y)`` rows of B.
        magnitude_batches: this rank's rows of B̃.
        sizes: the samples of B and B̃ over all ranks.
        n_data: ``N``, the training data the curvature is scaled to.
        rank: ``k``.
        method: the route to each set of eigenpairs
            ([`direction_eigenpairs`][laplace_debiased.eigen.decompose.direction_eigenpairs]).
        eigval_rtol: eigenpairs with eigenvalue ``≤ eigval_rtol · λ_max`` are not selected.
        remeasured_rtol: directions with ``λ̂ ≤ remeasured_rtol · max λ̂`` (or ``≤ 0``) are left out.
        reducer: the ranks' collectives.

    Returns:
        The [`LowRankDecomposition`][laplace_debiased.eigen.decompose.LowRankDecomposition]: the pooled
        eigenvectors, ``λ̂`` as ``eigenvalues`` and the pooled eigenvalues (scaled) as
        ``direction_eigenvalues``.
    """
    kw = {"rank": rank, "method": method, "eigval_rtol": eigval_rtol, "reducer": reducer}
    scale_B, scale_Bt = n_data / sizes[0], n_data / sizes[1]
    pooled = direction_eigenpairs(source, [*direction_batches, *magnitude_batches], **kw)
    on_B, on_Bt = direction_eigenpairs(source, direction_batches, **kw), direction_eigenpairs(source, magnitude_batches, **kw)
    gap_B = on_B.values * scale_B - remeasured_eigenvalues(source, magnitude_batches, on_B.vectors, reducer) * scale_Bt
    gap_Bt = on_Bt.values * scale_Bt - remeasured_eigenvalues(source, direction_batches, on_Bt.vectors, reducer) * scale_B
    k = min(len(pooled.values), len(gap_B), len(gap_Bt))
    k_B, k_Bt = order_weights(*sizes, n_data)
    values = pooled.values[:k] * (n_data / sum(sizes))
    corrected = (values - k_B * gap_B[:k] - k_Bt * gap_Bt[:k]).clamp(min=0.0)
    keep = above_relative_floor(corrected, remeasured_rtol)
    return LowRankDecomposition(pooled.vectors[:, :k][:, keep], corrected[keep], values[keep], pooled.method)

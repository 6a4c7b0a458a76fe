"""Measure mini-batch quadratics along direction sets chosen on one batch of a partition.

A *study* picks K unit directions on a source batch B (top-k eigenvectors or CG directions) and
restricts the quadratic q(·; S) (mean loss + β/2‖θ‖², see
[`laplace_debiased.curvature.operators`][laplace_debiased.curvature.operators]) to their span on every batch S
of an equal-size partition of the data and on the full data set: value q(θ•; S), slopes Dᵀg_S and the Gram
matrix Dᵀ(H_S + βI)D.  Everything the report shows (curvatures, relative biases, CG step sizes, 2D slices, Eq.
5) is computed from these numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from laplace_debiased.optim.cg import cg
from laplace_debiased.diagnostics.directional import cg_step_sizes, directional_slopes, partition_average, relative_bias
from laplace_debiased.curvature.operators import MiniBatchQuadratic, mini_batch_quadratic

Batch = tuple[Tensor, Tensor]


def equal_partition(X: Tensor, y: Tensor, batch_size: int, generator: torch.Generator | None = None) -> list[Batch]:
    """Shuffle ``(X, y)`` and split it into ``⌊N / batch_size⌋`` batches of exactly ``batch_size``.

    The ``N mod batch_size`` left-over points are dropped, so that the batches partition the data
    set the diagnostics call "full" and Eq. 5 holds exactly.

    Args:
        X: ``(N, ...)`` inputs.
        y: ``(N, ...)`` targets.
        batch_size: the size of every batch.
        generator: the random generator of the shuffle; default the global one.

    Returns:
        ``⌊N / batch_size⌋`` ``(X, y)`` batches.
    """
    N = X.shape[0]
    if y.shape[0] != N:
        raise ValueError(f"X has {N} rows but y has {y.shape[0]}")
    if not 1 <= batch_size <= N // 2:
        raise ValueError(
            f"batch size {batch_size} must be between 1 and N/2 = {N // 2} so that there are at least "
            "two batches (a direction batch and an independent one); use a smaller --batch-size"
        )
    perm = torch.randperm(N, generator=generator)
    M = N // batch_size
    return [(X[idx], y[idx]) for idx in perm[: M * batch_size].view(M, batch_size)]


def merge_batches(batches: Sequence[Batch], max_rows: int = 1024) -> list[Batch]:
    """Concatenate consecutive batches into chunks of at most ``max(max_rows, batch size)`` rows.

    The same data in fewer, larger batches: curvature products over the full data set then cost
    fewer passes (the mean over data points is unchanged).
    """
    chunks: list[list[Batch]] = [[]]
    rows = 0
    for batch in batches:
        if chunks[-1] and rows + batch[0].shape[0] > max_rows:
            chunks.append([])
            rows = 0
        chunks[-1].append(batch)
        rows += batch[0].shape[0]
    return [(torch.cat([b[0] for b in c]), torch.cat([b[1] for b in c])) for c in chunks]


@dataclass(frozen=True)
class Restriction:
    """q(·; S) restricted to span D (``K`` directions) around θ•.

    Attributes:
        value: q(θ•; S), a scalar.
        slopes: Dᵀ g_S, ``(K,)``.
        gram: Dᵀ (H_S + βI) D, ``(K, K)``.
        n_data: |S|.
    """

    value: Tensor
    slopes: Tensor
    gram: Tensor
    n_data: int

    @property
    def curvatures(self) -> Tensor:
        """Directional curvatures ``dₖᵀ (H_S + βI) dₖ`` ``(K,)``."""
        return torch.diagonal(self.gram)


def restrict(quadratic: MiniBatchQuadratic, directions: Tensor) -> Restriction:
    """Restrict a mini-batch quadratic to the span of ``directions (P, K)`` (K products)."""
    slopes = directional_slopes(directions, quadratic.gradient)
    return Restriction(quadratic.value, slopes, directions.T @ quadratic.curvature(directions), quadratic.n_data)


QuadraticFactory = Callable[[Sequence[Batch]], MiniBatchQuadratic]


def quadratic_factory(model: nn.Module, loss_func: nn.Module, curvature: str = "ggn", beta: float = 0.0) -> QuadraticFactory:
    """``batches ↦ q(·; batches)`` at the model's current parameters (see ``mini_batch_quadratic``)."""
    return lambda batches: mini_batch_quadratic(model, loss_func, list(batches), curvature, beta)


@dataclass
class DirectionStudy:
    """Directions from batch ``source`` of a partition, measured on every batch and on all data.

    Attributes:
        kind: ``"eigen"`` (top-k eigenvectors of H_B + βI, largest first) or ``"cg"``.
        source: index of the direction batch B in the partition.
        directions: ``(P, K)`` unit columns.
        batches: one [`Restriction`][laplace_debiased.diagnostics.measure.Restriction] per batch of the
            partition (``batches[source]`` is B).
        full: the restriction on the union of the partition — measured directly when
            ``eq5_residual`` is set, else the partition average (exact by Eq. 5).
        eq5_residual: largest relative deviation of the partition average from the directly
            measured full-data restriction (values, slopes, Gram matrix), or ``None``.
        n_products: curvature-vector products spent measuring (not choosing) the directions,
            keyed by the number of data points they ran over: ``{|B|: count, |D|: count}``.
    """

    kind: str
    source: int
    directions: Tensor
    batches: list[Restriction]
    full: Restriction
    eq5_residual: float | None = None
    n_products: dict[int, int] = field(default_factory=dict)

    def curvatures(self) -> Tensor:
        """Directional curvatures on every batch ``(M, K)``; row ``source`` is the same batch."""
        return torch.stack([r.curvatures for r in self.batches])

    def slopes(self) -> Tensor:
        """Directional slopes at θ• on every batch ``(M, K)``."""
        return torch.stack([r.slopes for r in self.batches])

    def others(self) -> list[int]:
        """Indices of the batches other than the source batch."""
        return [m for m in range(len(self.batches)) if m != self.source]

    def curvature_bias_same(self) -> Tensor:
        """Relative bias of the same-batch curvature w.r.t. the full data ``(K,)``."""
        return relative_bias(self.batches[self.source].curvatures, self.full.curvatures)

    def curvature_bias_others(self) -> Tensor:
        """Relative bias of the curvature measured on each other batch ``(M-1, K)``."""
        return relative_bias(self.curvatures()[self.others()], self.full.curvatures)

    def slope_bias_same(self) -> Tensor:
        """Relative bias of the same-batch slope magnitude ``|dᵀg_B|`` vs ``|dᵀg_D|`` ``(K,)``."""
        return relative_bias(self.batches[self.source].slopes.abs(), self.full.slopes.abs())

    def step_sizes(self) -> tuple[Tensor, Tensor]:
        """CG update magnitudes τ_p on every batch ``(M, K)`` and on all data ``(K,)`` (Fig. 4)."""
        per_batch = torch.stack([cg_step_sizes(r.slopes, r.gram)[2] for r in self.batches])
        return per_batch, cg_step_sizes(self.full.slopes, self.full.gram)[2]


def average_restriction(restrictions: Sequence[Restriction]) -> Restriction:
    """The restriction on the union of equal-size batches: their average (Eq. 5)."""
    return Restriction(
        partition_average(torch.stack([r.value for r in restrictions])),
        partition_average(torch.stack([r.slopes for r in restrictions])),
        partition_average(torch.stack([r.gram for r in restrictions])),
        sum(r.n_data for r in restrictions),
    )


def eq5_residual(average: Restriction, direct: Restriction) -> float:
    """Largest relative deviation of ``average`` from ``direct`` over value, slopes and Gram."""
    worst = 0.0
    for get in (lambda r: r.value.reshape(1), lambda r: r.slopes, lambda r: r.gram.flatten()):
        a, d = get(average), get(direct)
        scale = d.abs().max().clamp_min(torch.finfo(d.dtype).tiny)
        worst = max(worst, float((a - d).abs().max() / scale))
    return worst


def count_products(products: dict[int, int], quadratic: MiniBatchQuadratic) -> None:
    """Add the products ``quadratic``'s operator has done to ``products[|S|]`` and reset its count.

    Args:
        products: operator products per batch size ``|S|``, updated in place.
        quadratic: a mini-batch quadratic whose curvature operator counts its products
            (``n_products``, set to 0 here).
    """
    op = quadratic.curvature
    products[quadratic.n_data] = products.get(quadratic.n_data, 0) + op.n_products
    op.n_products = 0


def measure_study(
    kind: str,
    source: int,
    directions: Tensor,
    partition: Sequence[Batch],
    factory: QuadraticFactory,
    full: MiniBatchQuadratic | None = None,
) -> DirectionStudy:
    """Restrict the quadratic of every batch of an equal-size ``partition`` to ``directions``.

    Costs K products on each batch.  The full-data restriction is their average (Eq. 5); if the
    full-data quadratic ``full`` is given it is also measured directly (K more products over all
    data) and the deviation is stored as ``eq5_residual``.

    Args:
        kind: the name of the direction set (e.g. ``"eigen"``, ``"cg"``).
        source: the index of the batch the directions come from.
        directions: ``(P, K)`` directions.
        partition: the equal-size batches.
        factory: builds a batch's mini-batch quadratic.
        full: the full-data quadratic, measured directly if given.

    Returns:
        The restrictions per batch, their average and the Eq. 5 residual.
    """
    if len({b[0].shape[0] for b in partition}) != 1:
        raise ValueError("the partition must consist of equal-size batches (see equal_partition)")
    products: dict[int, int] = {}
    restrictions = []
    for batch in partition:
        q = factory([batch])
        restrictions.append(restrict(q, directions))
        count_products(products, q)
    average = average_restriction(restrictions)
    residual = None
    if full is not None:
        full.curvature.n_products = 0
        direct = restrict(full, directions)
        count_products(products, full)
        residual = eq5_residual(average, direct)
    return DirectionStudy(kind, source, directions, restrictions, average, residual, products)


def cg_directions(quadratic: MiniBatchQuadratic, steps: int) -> Tensor:
    """The first ``steps`` normalised CG directions ``(P, K)`` of the Newton system on B.

    CG solves ``(H_B + βI) x = -g_B`` from x = 0
    ([`laplace_debiased.optim.cg.cg`][laplace_debiased.optim.cg.cg]); it may stop earlier (converged, or
    non-positive curvature), giving fewer columns.
    """
    result = cg(quadratic.curvature, -quadratic.gradient, max_iter=steps, store_iterates=False)
    if result.n_iter == 0:
        raise RuntimeError(
            f"CG made no step on the direction batch ({result.reason}); the curvature is not "
            "positive along the gradient — use the GGN or a larger beta"
        )
    return result.directions.T.contiguous()

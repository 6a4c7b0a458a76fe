"""The bias diagnosis: all measurements of the report in one Python call.

``diagnose_bias(model, loss_func, X, y, batch_size=...)`` partitions the data into equal batches,
and for a few source batches B

* finds the top-k eigenvectors of H_B + βI (Lanczos) and the first K CG directions of the Newton
  system on B, and measures slopes/curvatures along them on B, on every other batch and on the
  full data set (Eq. 5 checked on the way);
* compares eigenspaces between batches and with the full data (overlaps Ω);
* repeats the top-k measurement for growing batch sizes (same batch vs an independent batch vs
  full data), for the chosen curvature and for K-FAC (Fig. 17).

Numbers are in [`BiasDiagnosis`][laplace_debiased.diagnostics.bias.BiasDiagnosis];
[`laplace_debiased.diagnostics.report`][laplace_debiased.diagnostics.report] turns them into plots, JSON and
Markdown.  Costs are counted in curvature-vector products (one product = one vector times the curvature of one
data set, whatever its size) and reported per data-set size.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from laplace_debiased.diagnostics.bounds import Chain
from laplace_debiased.diagnostics.directions import top_eigenpairs
from laplace_debiased.diagnostics.measure import (
    DirectionStudy,
    count_products,
    cg_directions,
    equal_partition,
    measure_study,
    merge_batches,
    quadratic_factory,
    restrict,
)
from laplace_debiased.diagnostics.overlap import overlap_matrix
from laplace_debiased.curvature.operators import CURVATURES

LANCZOS_PRODUCTS_ESTIMATE = 4
"""Up-front estimate of Lanczos products per requested eigenpair (ARPACK, tol 1e-8); the
actual count is measured and reported."""


@dataclass(frozen=True)
class DiagnosisConfig:
    """What [`diagnose_bias`][laplace_debiased.diagnostics.bias.diagnose_bias] measures (all part of the
    report).

    Attributes:
        batch_size: The user's mini-batch size b.
        curvature: ``"ggn"``, ``"hessian"`` or ``"ef"``.
        beta: The damping β >= 0: the quadratics use ``H + βI``.
        top_k: The eigenvectors per batch.
        cg_steps: The CG directions per batch.
        n_sources: The direction batches (repeats).
        ladder: The batch sizes of the batch-size study (default b, 2b, 4b, … ≤ N/2).
        kfac: Also run the K-FAC batch-size study.
        full_eigen: Run Lanczos on the full data for the overlaps and Eq. 7.
        tolerance: The acceptable relative bias of the top-k curvatures (> 0).
        lanczos_tol: The relative accuracy of the eigenpairs (ARPACK ``tol``).
        seed: The seed of the data partition and of the Lanczos start vectors.

    Raises:
        ValueError: For another curvature, a count below 1, ``beta < 0`` or ``tolerance <= 0``.
    """

    batch_size: int
    curvature: str = "ggn"
    beta: float = 0.0
    top_k: int = 10
    cg_steps: int = 10
    n_sources: int = 3
    ladder: tuple[int, ...] | None = None
    kfac: bool = True
    full_eigen: bool = True
    tolerance: float = 0.1
    lanczos_tol: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.curvature not in CURVATURES or self.curvature == "kfac":
            raise ValueError(f"curvature must be one of 'ggn', 'hessian', 'ef', got {self.curvature!r}")
        for name in ("top_k", "cg_steps", "n_sources", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.beta < 0 or self.tolerance <= 0:
            raise ValueError(f"beta must be >= 0 and tolerance > 0, got {self.beta}, {self.tolerance}")


@dataclass
class LadderRow:
    """Top-k curvatures along the eigenvectors of one batch of size ``batch_size``.

    Attributes:
        batch_size: The size of the batches.
        source: The index of the direction batch B in its partition.
        same: The eigenvalues on B, ``(K,)``.
        independent: The curvatures on an independent batch B̃ of the same size, ``(K,)``.
        full: The curvatures on the full data, ``(K,)``.
        full_ggn: For the K-FAC study, the exact full-data curvature along the K-FAC
            eigenvectors, ``(K,)``; ``None`` otherwise.
    """

    batch_size: int
    source: int
    same: Tensor
    independent: Tensor
    full: Tensor
    full_ggn: Tensor | None = None


@dataclass
class BiasDiagnosis:
    """Everything [`diagnose_bias`][laplace_debiased.diagnostics.bias.diagnose_bias] measured (see the module
    docstring)."""

    config: DiagnosisConfig
    n_params: int
    n_data: int
    n_left_out: int
    eigen: list[DirectionStudy]
    cg: list[DirectionStudy]
    full_eigenvalues: Tensor | None
    overlap_between_batches: Tensor | None
    overlap_with_full: Tensor | None
    ladder: list[LadderRow]
    kfac_ladder: list[LadderRow]
    products: dict[str, dict[int, int]] = field(default_factory=dict)

    def eq5_residual(self) -> float | None:
        """Largest Eq. 5 deviation over the studies that measured the full data directly."""
        values = [s.eq5_residual for s in self.eigen + self.cg if s.eq5_residual is not None]
        return max(values) if values else None

    def eq7_chain(self) -> Chain | None:
        """mean λ_max(B) ≥ λ_max(D) ≥ mean u_1(B)ᵀ H_D u_1(B) over the source batches.

        Holds in expectation over random batches (exactly on a complete partition), so on a few
        sources it is a measurement, not a guarantee.
        """
        if self.full_eigenvalues is None:
            return None
        same = torch.stack([s.batches[s.source].curvatures[0] for s in self.eigen]).mean()
        cross = torch.stack([s.full.curvatures[0] for s in self.eigen]).mean()
        return Chain(float(same), float(self.full_eigenvalues[0]), float(cross))

    def total_products(self) -> dict[int, int]:
        """Curvature-vector products by data-set size, summed over all stages."""
        total: dict[int, int] = {}
        for stage in self.products.values():
            for n, c in stage.items():
                total[n] = total.get(n, 0) + c
        return total


def default_ladder(batch_size: int, n_data: int) -> tuple[int, ...]:
    """b, 2b, 4b, … up to N/4 (at least four batches of each size; b itself always)."""
    sizes, b = [batch_size], 2 * batch_size
    while b <= n_data // 4:
        sizes.append(b)
        b *= 2
    return tuple(sizes)


def n_stages(config: DiagnosisConfig, n_data: int) -> int:
    """Number of ``progress`` calls [`diagnose_bias`][laplace_debiased.diagnostics.bias.diagnose_bias] makes
    (for a progress bar's total)."""
    n_sources = min(config.n_sources, n_data // config.batch_size)
    sizes = [s for s in (config.ladder or default_ladder(config.batch_size, n_data)) if s != config.batch_size]
    return 2 * n_sources + int(config.full_eigen) + len(sizes) + (1 + len(sizes)) * int(config.kfac)


def planned_products(config: DiagnosisConfig, n_data: int, n_params: int) -> dict[str, str]:
    """Up-front cost, as curvature-vector products per stage (Lanczos counts are estimates)."""
    b, K, S = config.batch_size, config.top_k, config.n_sources
    M = n_data // b
    N = M * b
    lanczos = LANCZOS_PRODUCTS_ESTIMATE * max(2 * K + 1, 20)
    ladder = config.ladder or default_ladder(b, n_data)
    plan = {
        "eigenvectors": f"~{S * lanczos} Lanczos products on batches of {b} + {S * K * M} on batches of {b} "
        f"+ {K} on all {N} (Eq. 5 check)",
        "cg": f"{S * config.cg_steps} CG products on batches of {b} + {S * config.cg_steps * M} on batches of "
        f"{b} + {config.cg_steps} on all {N} (Eq. 5 check)",
        "batch_size_ladder": "; ".join(
            f"b={s}: ~{min(S, n_data // s - 1) * lanczos} Lanczos + {min(S, n_data // s - 1) * K} on batches of {s}"
            f" + {min(S, n_data // s - 1) * K} on all" for s in ladder if s != b
        ) or "none",
    }
    if config.full_eigen:
        plan["full_eigenvectors"] = f"~{lanczos} Lanczos products on all {N}"
    if config.kfac:
        plan["kfac_ladder"] = (f"per batch size and direction batch: K-FAC factors, ~{lanczos} cheap K-FAC products, "
                               f"{K} exact products on all {N}")
    return plan


def _studies(kind: str, sources: list[int], directions_of: Callable, counts: dict[int, int], label: str,
             partition, factory, full, say: Callable[[str], None]) -> list:
    """One [`measure_study`][laplace_debiased.diagnostics.measure.measure_study] per source batch ``s`` along
    ``directions_of(q_s, s)``, counting the curvature products into ``counts``."""
    studies = []
    for s in sources:
        q = factory([partition[s]])
        D = directions_of(q, s)
        count_products(counts, q)
        study = measure_study(kind, s, D, partition, factory, full if s == 0 else None)
        _merge(counts, study.n_products)
        studies.append(study)
        say(f"{label} of batch {s + 1}/{len(sources)}")
    return studies


def _ladders(model, loss_func, X: Tensor, y: Tensor, config: DiagnosisConfig, K: int, gen: torch.Generator,
             eigen: list, M: int, products: dict[str, dict[int, int]], say: Callable[[str], None]) -> tuple[list, list]:
    """The batch-size ladder (the eigen studies' own batch size first) and the K-FAC ladder."""
    b = config.batch_size
    ladder = [LadderRow(b, st.source, st.batches[st.source].curvatures,
                        st.batches[_independent(st.source, len(eigen), M)].curvatures, st.full.curvatures)
              for st in eigen]
    sizes = [s for s in (config.ladder or default_ladder(b, X.shape[0])) if s != b]
    if any(s > X.shape[0] // 2 for s in sizes):
        raise ValueError(f"ladder batch sizes must be at most N/2 = {X.shape[0] // 2}, got {sizes}")
    for size in sizes:
        ladder += _ladder_rows(model, loss_func, X, y, size, config, config.curvature, K, gen,
                               products["batch_size_ladder"], exact=None)
        say(f"batch size {size}")
    kfac_rows: list[LadderRow] = []
    if config.kfac:
        for size in (b, *sizes):
            kfac_rows += _ladder_rows(model, loss_func, X, y, size, config, "kfac", K, gen,
                                      products["kfac_ladder"], exact=config.curvature)
            say(f"K-FAC at batch size {size}")
    return ladder, kfac_rows


def diagnose_bias(
    model: nn.Module,
    loss_func: nn.Module,
    X: Tensor,
    y: Tensor,
    config: DiagnosisConfig,
    *,
    dtype: torch.dtype = torch.float64,
    progress: Callable[[str], None] | None = None,
) -> BiasDiagnosis:
    """Run all measurements of the bias report on the data ``(X, y)`` at the model's θ•.

    The model is copied and cast to ``dtype`` (float64 by default, so that Lanczos and Eq. 5 are
    accurate); ``loss_func`` must use ``reduction="mean"``.  ``progress`` receives a line per
    finished stage (the CLI passes a progress bar's ``write``/``update``).
    """
    say = progress or (lambda _msg: None)
    model = copy.deepcopy(model).to(dtype).eval()
    X = X.to(dtype) if X.is_floating_point() else X
    y = y.to(dtype) if y.is_floating_point() else y
    gen = torch.Generator().manual_seed(config.seed)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    b, K = config.batch_size, min(config.top_k, n_params)
    partition = equal_partition(X, y, b, gen)
    M = len(partition)
    sources = list(range(min(config.n_sources, M)))
    factory = quadratic_factory(model, loss_func, config.curvature, config.beta)
    full = factory(merge_batches(partition))
    products: dict[str, dict[int, int]] = {"eigenvectors": {}, "cg": {}, "full_eigenvectors": {},
                                           "batch_size_ladder": {}, "kfac_ladder": {}}

    def eigenvectors(q, s: int) -> Tensor:
        return top_eigenpairs(q.curvature, n_params, K, dtype=dtype, tol=config.lanczos_tol, seed=config.seed + s).vectors

    def cg_dirs(q, s: int) -> Tensor:
        return cg_directions(q, config.cg_steps)

    studies = (partition, factory, full, say)
    eigen = _studies("eigen", sources, eigenvectors, products["eigenvectors"], "eigenvectors", *studies)
    cg_studies = _studies("cg", sources, cg_dirs, products["cg"], "CG directions", *studies)

    full_values = overlap_full = None
    overlap_batches = overlap_matrix(eigen[0].directions, eigen[1].directions) if len(eigen) > 1 else None
    if config.full_eigen:
        full.curvature.n_products = 0
        full_pairs = top_eigenpairs(full.curvature, n_params, K, dtype=dtype, tol=config.lanczos_tol, seed=config.seed)
        count_products(products["full_eigenvectors"], full)
        full_values = full_pairs.values
        overlap_full = overlap_matrix(eigen[0].directions, full_pairs.vectors)
        say("eigenvectors of the full data set")

    ladder, kfac_rows = _ladders(model, loss_func, X, y, config, K, gen, eigen, M, products, say)

    return BiasDiagnosis(config, n_params, M * b, X.shape[0] - M * b, eigen, cg_studies, full_values,
                         overlap_batches, overlap_full, ladder, kfac_rows, products)


def _merge(into: dict[int, int], extra: dict[int, int]) -> None:
    for n, c in extra.items():
        into[n] = into.get(n, 0) + c


def _independent(source: int, n_sources: int, n_batches: int) -> int:
    """Index of the independent batch paired with direction batch ``source``.

    Taken from outside the direction batches where the partition allows, so that two direction
    batches are never each other's only independent measurement.
    """
    return n_sources + source if n_sources + source < n_batches else (source + 1) % n_batches


def _ladder_rows(model, loss_func, X, y, size, config, curvature, K, gen, products, exact) -> list[LadderRow]:
    """Top-k eigenvectors of ``curvature`` on a few batches of ``size``: same vs independent vs full.

    For K-FAC (``exact`` names the exact curvature) the full-data curvature of ``exact`` along the
    K-FAC eigenvectors is measured as well.
    """
    partition = equal_partition(X, y, size, gen)
    factory = quadratic_factory(model, loss_func, curvature, config.beta)
    merged = merge_batches(partition)
    full = factory(merged)
    full_exact = quadratic_factory(model, loss_func, exact, config.beta)(merged) if exact else None
    rows = []
    n_sources = min(config.n_sources, len(partition) - 1)
    for s in range(n_sources):
        q = factory([partition[s]])
        pairs = top_eigenpairs(q.curvature, q.gradient.shape[0], K, dtype=q.gradient.dtype,
                               tol=config.lanczos_tol, seed=config.seed + s)
        count_products(products, q)
        other = factory([partition[_independent(s, n_sources, len(partition))]])
        measured = [restrict(other, pairs.vectors), restrict(full, pairs.vectors)]
        count_products(products, other)
        count_products(products, full)
        exact_curv = None
        if full_exact is not None:
            exact_curv = restrict(full_exact, pairs.vectors).curvatures
            count_products(products, full_exact)
        rows.append(LadderRow(size, s, pairs.values, measured[0].curvatures, measured[1].curvatures, exact_curv))
    return rows


def batch_size_for_tolerance(sizes: list[int], biases: list[float], tolerance: float) -> tuple[int | None, bool]:
    """Smallest batch size whose median relative bias is within ``tolerance``.

    Returns ``(size, extrapolated)``: the smallest measured size with ``bias ≤ tolerance``, or,
    if none is, a power-law extrapolation ``bias ∝ b^(-α)`` fitted through the measured points
    (``extrapolated=True``); ``None`` when the bias does not decrease with the batch size.
    """
    for s, v in sorted(zip(sizes, biases)):
        if v <= tolerance:
            return s, False
    pts = [(math.log(s), math.log(v)) for s, v in zip(sizes, biases) if v > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None, True
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
    if slope >= 0:
        return None, True
    return int(math.ceil(math.exp(mx + (math.log(tolerance) - my) / slope))), True

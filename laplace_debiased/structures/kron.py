"""Debiased K-FAC Laplace (Tatzel et al., ICLR 2025, Sec. 4.2.2 / App. A.3.3).

Per parameter block, the K-FAC factors ``[G, A]`` of the direction batch B give the
eigenvectors, and the factors ``[D, C]`` of the independent magnitude batch B̃ give the
eigenvalues ``diag(U_Gᵀ D U_G)``, ``diag(U_Aᵀ C U_A)`` (:func:`laplace_debiased.curvature.linalg.debiased_kron`).

Scale convention (identical to a laplace-torch ``KronLaplace`` fit over all ``N`` data):
the factors of a batch set S with ``m`` samples are ``G_S = N/m * sum_{n in S} g_n g_nᵀ``
(output side, summed loss; bias blocks likewise) and ``A_S = mean_{n in S} a_n a_nᵀ``
(input side), so ``G_S ⊗ A_S`` estimates the K-FAC of the summed loss over ``N`` points and
``split="halves"`` is directly comparable to ``KronLaplace.fit(full_loader)``.

Fit cost: with the Curvlinops exact-GGN or EF backend (the default) the rows of B and B̃ go
through the model in shared forward/backward passes and the factor sums are split by sample
(:mod:`laplace_debiased.curvature.kfac`), so a debiased fit at 2 × b/2 costs one pass over
``b`` rows like a single-batch fit at ``b``; other backends are called once per batch.
Under an initialised ``torch.distributed`` group the rows are sharded over the ranks
(:mod:`laplace_debiased.structures.distributed`).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from laplace.curvature.curvlinops import CurvlinopsEF, CurvlinopsGGN
from laplace.baselaplace import KronLaplace
from laplace.lllaplace import KronLLLaplace
from laplace.utils.matrix import Kron

from laplace_debiased.posterior.implicit_kron import ImplicitKronDecomposed
from laplace_debiased.structures.auto_magnitude import AutoMagnitudeMixin
from laplace_debiased.structures.cross_fit import CrossFitDecomposed, CrossFitMixin
from laplace_debiased.structures.kron_layers import KronLayersMixin
from laplace_debiased.structures.two_batch import TwoBatchLaplaceMixin
from laplace_debiased.structures.batches import Batch, batch_inputs_targets, batch_size
from laplace_debiased.curvature.kfac import group_kfac_sums, input_factor_rows, zero_sums
from laplace_debiased.curvature.completion import NULL_SPACE_MODES, debiased_factor_mode
from laplace_debiased.curvature.linalg import debiased_kron
from laplace_debiased.structures.coverage import Coverage, coverage_record, report_coverage
from laplace_debiased.structures.mixed import (
    Spanned,
    SpannedImplicitKronStructure,
    SpannedKronStructure,
    block_spans,
    curvature_modules,
    expected_block_shapes,
    is_extra,
    module_blocks,
)
from laplace_debiased.structures.distributed import (
    all_reduce_sum_,
    broadcast_,
    is_distributed,
    rank_world,
    shard_batch,
)

__all__ = ["DebiasedKronDecomposed", "DebiasedKronLaplace", "DebiasedKronLLLaplace"]



class DebiasedKronDecomposed(ImplicitKronDecomposed):
    """``KronDecomposed`` whose ``+`` (prior precision) and ``*`` (likelihood factor) keep
    ``damping`` (laplace-torch 0.3 silently drops it in both operations) and whose input-side
    factors may keep their null space implicit
    (:class:`~laplace_debiased.posterior.implicit_kron.ImplicitKronDecomposed`)."""


class SpannedKronDecomposed(Spanned, DebiasedKronDecomposed):
    """:class:`DebiasedKronDecomposed` whose blocks may span several parameter tensors (a
    normalisation layer's dense block; :mod:`laplace_debiased.structures.mixed`)."""

    _structure = SpannedKronStructure
    _implicit_structure = SpannedImplicitKronStructure

    def __init__(self, eigenvectors, eigenvalues, deltas=None, damping: bool = False, *, spans: list[int] | None = None) -> None:
        super().__init__(eigenvectors, eigenvalues, deltas, damping=damping)
        self.spans = list(spans) if spans is not None else [1] * len(eigenvalues)


def _combine(old: Kron, new: Kron, n_old: int, n_new: int) -> Kron:
    """K-FAC of ``n_old + n_new`` points from two fits: output-side factors (and single-factor
    blocks) add up, input-side factors are averaged with weights ``n / (n_old + n_new)``."""
    w_old, w_new = n_old / (n_old + n_new), n_new / (n_old + n_new)
    kfacs = []
    for F_old, F_new in zip(old.kfacs, new.kfacs):
        if len(F_old) == 2:
            kfacs.append([F_old[0] + F_new[0], w_old * F_old[1] + w_new * F_new[1]])
        else:
            kfacs.append([F_old[0] + F_new[0]])
    return Kron(kfacs)


def _paired_rows(
    direction_rows: list | None, magnitude_rows: list | None
) -> list[list[tuple[torch.Tensor, torch.Tensor] | None]] | None:
    """Per block and factor ``(B's rows, B̃'s rows)`` where both are known (the ``rows`` of
    :func:`debiased_kron` and :func:`coverage_record`), ``None`` without rows."""
    if direction_rows is None or magnitude_rows is None:
        return None
    return [
        [None if d is None or m is None else (d, m) for d, m in zip(bd, bm)]
        for bd, bm in zip(direction_rows, magnitude_rows)
    ]


def _passes(
    pieces: list[tuple[Batch, int]], max_rows: int, dict_key_x: str, dict_key_y: str
) -> Iterator[tuple[Any, torch.Tensor, list[tuple[int, int, int]]]]:
    """Stack consecutive ``(batch, group)`` pieces into passes ``(X, y, segments)`` of at
    most ``max_rows`` rows (a piece never splits; dict batches pass one at a time), with
    ``segments`` the ``(start, stop, group)`` row ranges of :func:`group_kfac_sums`."""
    todo: list[tuple[Any, torch.Tensor, int]] = []
    for b, g in pieces:
        X, y = batch_inputs_targets(b, dict_key_x, dict_key_y)
        if len(y) == 0:
            continue
        if todo and (
            isinstance(X, MutableMapping) or sum(len(t[1]) for t in todo) + len(y) > max_rows
        ):
            yield _stack(todo)
            todo = []
        todo.append((X, y, g))
    if todo:
        yield _stack(todo)


def _stack(
    todo: list[tuple[Any, torch.Tensor, int]],
) -> tuple[Any, torch.Tensor, list[tuple[int, int, int]]]:
    segments, start = [], 0
    for _, y, g in todo:
        segments.append((start, start + len(y), g))
        start += len(y)
    if len(todo) == 1:
        return todo[0][0], todo[0][1], segments
    return torch.cat([t[0] for t in todo]), torch.cat([t[1] for t in todo]), segments


def _null_space_rule(direction: Kron, magnitude: Kron, null_space: str) -> str:
    """The rule for B's degenerate groups: ``null_space``, except ``"aligned"`` when B̃ is B,
    where it is the plain eigendecomposition (laplace-torch's K-FAC). The isotropic mean over
    B's tied runs (:func:`~laplace_debiased.curvature.linalg.tied_groups`) would move B's own
    eigenvalues by up to the round-off tolerance, which is coarse when one eigenvalue dominates
    the factor's norm."""
    return "aligned" if magnitude is direction else null_space


class DebiasedKronLaplace(CrossFitMixin, KronLayersMixin, AutoMagnitudeMixin, TwoBatchLaplaceMixin, KronLaplace):
    """Two-batch debiased K-FAC Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_kron")``).

    Same interface as ``KronLaplace``; ``fit`` takes the extra two-batch arguments of
    :meth:`TwoBatchLaplaceMixin.fit`. After fitting, ``H_facs`` / ``H_facs_magnitude`` are the
    ``Kron`` factors of B and B̃ (both scaled to ``n_data``) and ``H`` is a
    :class:`DebiasedKronDecomposed` with B's eigenvectors and B̃'s Rayleigh quotients
    (``fit(..., cross_fit=True)``: a
    :class:`~laplace_debiased.structures.cross_fit.CrossFitDecomposed` mixture of it and the
    role-swapped one, B̃'s eigenvectors with B's Rayleigh quotients).
    Layers: :mod:`~laplace_debiased.structures.mixed` (beyond Linear/Conv2d only with the default
    Curvlinops GGN/EF backend); backends: also ASDL GGN/EF (BackPACK: no Conv2d).
    """

    _key = ("all", "debiased_kron")
    _null_space: str = "isotropic"

    def fit(self, train_loader: Any, override: bool = True, progress_bar: bool = False, *,
            null_space: str = "isotropic", **kwargs: Any) -> None:
        """Fit as :meth:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin.fit`
        (and ``cross_fit``), plus ``null_space``: how directions that B's factors do not
        distinguish (their null space, where a factor is wider than B) get their magnitude.

        ``"isotropic"`` (default): each such eigenspace gets B̃'s mean curvature over it,
        ``tr(Pᵀ C_B̃ P) / dim P`` (unbiased, P chosen by B alone); ``"aligned"``: B̃'s own
        eigenbasis there, measured by B̃ (same-batch bias, exact zeros where B ∪ B̃ does not
        reach). See :mod:`laplace_debiased.curvature.completion` and docs/wide-layers.md.
        After the fit ``self.coverage`` (:class:`~laplace_debiased.structures.coverage.Coverage`)
        records per layer and factor what the curvature covers; it is logged, and a warning
        names the layers where a share of the weights keeps only the prior.
        ``debiased_ekfac`` (a subclass with its own eigenbasis and eigenvalues) does not use
        ``null_space`` and records no coverage.
        """
        if null_space not in NULL_SPACE_MODES:
            raise ValueError(f"null_space must be one of {NULL_SPACE_MODES}, got {null_space!r}.")
        self._null_space = null_space
        super().fit(train_loader, override=override, progress_bar=progress_bar, **kwargs)

    def _reset_fit_state(self) -> None:
        super()._reset_fit_state()
        self.H_facs = None
        self.H_facs_magnitude: Kron | None = None
        self.coverage: Coverage | None = None
        self._fit_sizes = (0, 0)
        self._factor_rows: list[list[list[torch.Tensor | None]]] | None = None

    def _fit_two_batch(
        self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int
    ) -> torch.Tensor:
        self._check_supported(direction_batches)
        same = magnitude_batches is direction_batches
        groups = [direction_batches] if same else [direction_batches, magnitude_batches]
        loss, krons = self._kfacs(groups, N)
        direction, magnitude = krons[0], krons[-1]
        if self.H_facs is not None:  # online: combine with the previous fit(s)
            self._factor_rows = None
            n_old = self.n_data
            direction = _combine(self.H_facs, direction, n_old, N)
            magnitude = _combine(self.H_facs_magnitude, magnitude, n_old, N)
        self.H_facs, self.H_facs_magnitude = direction, magnitude
        sizes = [sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in g) for g in groups]
        self._fit_sizes = (self._fit_sizes[0] + sizes[0], self._fit_sizes[1] + sizes[-1])
        self._decompose()
        self._record_coverage()
        return loss

    def _record_coverage(self) -> None:
        """``self.coverage`` of B's eigenbasis (the first component when cross-fitted),
        logged; warns once naming the layers with prior-only weights."""
        H = self.H.components[0] if isinstance(self.H, CrossFitDecomposed) else self.H
        rows = getattr(self, "_factor_rows", None) or [None]
        self.coverage = coverage_record(
            self.H_facs.kfacs, self.H_facs_magnitude.kfacs, H.eigenvectors, H.eigenvalues,
            self._block_names(), rows=_paired_rows(rows[0], rows[-1]),
            null_space=self._null_space, direction_size=self._fit_sizes[0],
            magnitude_size=self._fit_sizes[1],
        )
        report_coverage(self.coverage)

    def _kfacs(self, groups: list[list[Batch]], N: int) -> tuple[torch.Tensor, list[Kron]]:
        """K-FAC of each batch set, scaled to ``N`` points, and the summed loss over all of
        them: one shared pass (:meth:`_kfac_single_pass`) where the backend allows, else one
        backend call per batch (:meth:`_kfac`)."""
        self._factor_rows = None
        if self._single_pass_fisher() is not None:
            return self._kfac_single_pass(groups, N)
        if is_distributed():
            raise ValueError(
                f"a distributed debiased K-FAC fit needs the CurvlinopsGGN (stochastic=False) "
                f"or CurvlinopsEF backend without asdl_fisher_kwargs; got "
                f"{type(self.backend).__name__}. Use one of them or fit in one process."
            )
        fits = [self._kfac(batches, N) for batches in groups]
        return sum(f[0] for f in fits), [f[1] for f in fits]

    def _decompose(self) -> None:
        """``H``: the debiased decomposition, or cross-fitted (and B̃ ≠ B) the mixture of it
        and the role-swapped one."""
        rows = getattr(self, "_factor_rows", None) or [None]
        H = self._debiased(self.H_facs, self.H_facs_magnitude, rows[0], rows[-1])
        if self._cross_fit and self.H_facs_magnitude is not self.H_facs:
            swapped = self._debiased(self.H_facs_magnitude, self.H_facs, rows[-1], rows[0])
            H = CrossFitDecomposed(H, swapped)
        self.H = H

    def _debiased(
        self, direction: Kron, magnitude: Kron, direction_rows=None, magnitude_rows=None
    ) -> DebiasedKronDecomposed:
        """Eigenvectors of ``direction``, Rayleigh quotients of ``magnitude`` (through the
        factors' rows where both are known: :func:`debiased_kron`; the samples summed into the
        factors set their round-off tolerance); under a process group rank 0 computes them, the
        others receive them (:func:`laplace_debiased.structures.distributed.broadcast_`)."""
        null_space, terms = _null_space_rule(direction, magnitude, self._null_space), max(self._fit_sizes)
        rank, _ = rank_world()
        if rank == 0:
            eigenvectors, eigenvalues = debiased_kron(
                direction.kfacs, magnitude.kfacs, _paired_rows(direction_rows, magnitude_rows),
                factor=lambda D, M: debiased_factor_mode(D, M, null_space, terms), null_space=null_space,
            )
        else:
            eigenvectors = [[torch.empty_like(F) for F in block] for block in direction.kfacs]
            eigenvalues = [[F.new_empty(F.shape[0]) for F in block] for block in direction.kfacs]
        broadcast_([t for blocks in (eigenvectors, eigenvalues) for b in blocks for t in b])
        return self._decomposed(eigenvectors, eigenvalues)

    def _decomposed(self, eigenvectors: list, eigenvalues: list) -> DebiasedKronDecomposed:
        """The decomposed curvature; a :class:`SpannedKronDecomposed` where a dense
        normalisation block spans several parameter tensors."""
        spans = block_spans(self._kfac_modules())
        if any(span > 1 for span in spans):
            return SpannedKronDecomposed(eigenvectors, eigenvalues, damping=self.damping, spans=spans)
        return DebiasedKronDecomposed(eigenvectors, eigenvalues, damping=self.damping)

    def _single_pass_fisher(self) -> str | None:
        """The curvature type of the backend if :func:`group_kfac_sums` reproduces it
        exactly (Curvlinops exact GGN or EF, K-FAC "expand"), else ``None``."""
        if set(self._asdl_fisher_kwargs) - {"kfac_approx"} or (
            self._asdl_fisher_kwargs.get("kfac_approx", "expand") != "expand"
        ):
            return None
        if isinstance(self.backend, CurvlinopsGGN) and not self.backend.stochastic:
            return "type2"
        if isinstance(self.backend, CurvlinopsEF):
            return "empirical"
        return None

    def _kfac_single_pass(
        self, groups: list[list[Batch]], N: int
    ) -> tuple[torch.Tensor, list[Kron]]:
        """K-FAC of each batch set from shared forward/backward passes over B ∪ B̃ (this
        rank's rows of every batch, stacked into passes of at most twice the largest
        batch), summed over ranks, each scaled to ``N`` points like :meth:`_kfac`; and the
        summed loss over all batches (unscaled)."""
        rank, world = rank_world()
        key_x, key_y = self.dict_key_x, self.dict_key_y
        sizes = [[batch_size(b, key_x, key_y) for b in batches] for batches in groups]
        pieces = [
            (shard_batch(b, n, rank, world), g)
            for g, batches in enumerate(groups)
            for b, n in zip(batches, sizes[g])
        ]
        modules = self._kfac_modules()
        sums = None
        max_rows = 2 * max(max(s) for s in sizes)
        fisher = self._single_pass_fisher()
        keep_rows = world == 1
        for X, y, segments in _passes(pieces, max_rows, key_x, key_y):
            sums = group_kfac_sums(
                self.model,
                modules,
                X,
                y,
                segments,
                len(groups),
                likelihood=self.likelihood,
                lossfunc=self.backend.lossfunc,
                factor=self.backend.factor,
                fisher=fisher,
                into=sums,
                keep_rows=keep_rows,
            )
        if sums is None:  # this rank got no rows (fewer samples than ranks)
            sums = zero_sums(modules, len(groups), self.mean)
        all_reduce_sum_(sums.tensors())
        krons, self._factor_rows = [], [] if keep_rows else None
        for g, m in enumerate(sum(s) for s in sizes):
            kfacs, rows = [], []
            # Kron * factor scales each of a block's two factors by √factor
            X_g = input_factor_rows(sums, g, self.backend.factor**0.5 / m)
            for module, G, A, X in zip(modules, sums.output, sums.input, X_g):
                blocks = module_blocks(module, G[g], None if A is None else A[g], m)
                kfacs.extend(blocks)  # input rows only for Linear/Conv2d weight blocks
                rows.extend([None, X] if len(b) == 2 and not is_extra(module) else [None] * len(b) for b in blocks)
            if keep_rows:
                self._factor_rows.append(rows)
            kron = Kron(kfacs) * self.backend.factor
            kfacs = [[F[0] * (N / m), *F[1:]] for F in kron.kfacs]
            self._check_blocks(kfacs)
            krons.append(Kron(kfacs))
        return sums.loss.sum(), krons

    def _kfac(self, batches: list[Batch], N: int) -> tuple[torch.Tensor, Kron]:
        """K-FAC of the batch set by one backend call per batch (backends that
        :meth:`_single_pass_fisher` does not reproduce), scaled to ``N`` points (module
        docstring convention), and the summed loss the backend evaluates with it."""
        if len(self.fit_output_shape) > 1:
            raise ValueError(
                f"outputs of shape (batch, {', '.join(map(str, self.fit_output_shape))}) "
                f"(every token an output) need the CurvlinopsGGN (stochastic=False) or "
                f"CurvlinopsEF backend without asdl_fisher_kwargs; got "
                f"{type(self.backend).__name__}, whose K-FAC does not treat tokens as outputs."
            )
        m = sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in batches)
        loss = torch.zeros((), device=self._device, dtype=self._dtype)
        total: Kron | None = None
        for b in batches:
            X, y = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            self.model.zero_grad()
            # with N=m every backend returns [sum_b g gᵀ, (1/m) sum_b a aᵀ]; factor-wise
            # addition over the batches then gives [sum_S g gᵀ, mean_S a aᵀ].
            batch_loss, kron = self.backend.kron(X, y, N=m, **self._asdl_fisher_kwargs)
            loss = loss + batch_loss
            total = kron if total is None else total + kron
        kfacs = [[F[0] * (N / m), *F[1:]] for F in self._trainable_blocks(total.kfacs)]
        self._check_blocks(kfacs)
        return loss, Kron(kfacs)

    def state_dict(self) -> dict[str, Any]:
        """KronLaplace's state, B̃'s factors and the decomposition (cross-fitted: also the
        swapped component, under ``"H_swapped"``)."""
        state = super().state_dict()
        state["H_magnitude"] = self.H_facs_magnitude.kfacs
        comps = self.H.components if isinstance(self.H, CrossFitDecomposed) else (self.H,)
        state["H_eigenvectors"] = comps[0].eigenvectors
        state["H_eigenvalues"] = comps[0].eigenvalues
        if len(comps) == 2:
            state["H_swapped"] = [comps[1].eigenvectors, comps[1].eigenvalues]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved fit (``self.coverage`` is not saved: it is ``None`` after loading)."""
        super().load_state_dict(state_dict)
        self.coverage = None
        self.H_facs_magnitude = Kron(state_dict["H_magnitude"])
        H = self._decomposed(state_dict["H_eigenvectors"], state_dict["H_eigenvalues"])
        if "H_swapped" in state_dict:
            vecs, vals = state_dict["H_swapped"]
            H = CrossFitDecomposed(H, self._decomposed(vecs, vals))
        self.H = H


class DebiasedKronLLLaplace(DebiasedKronLaplace, KronLLLaplace):
    """Last-layer two-batch debiased K-FAC Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_kron")``), a ``KronLLLaplace`` with the debiased fit of
    :class:`DebiasedKronLaplace`. ``override=False`` is not supported (as in laplace-torch)."""

    _key = ("last_layer", "debiased_kron")

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
(:mod:`laplace_debiased.parallel.distributed`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils.data import DataLoader
from laplace.curvature.curvlinops import CurvlinopsEF, CurvlinopsGGN
from laplace.baselaplace import KronLaplace
from laplace.lllaplace import KronLLLaplace
from laplace.utils.matrix import Kron

from laplace_debiased.posterior.implicit_kron import ImplicitKronDecomposed
from laplace_debiased.structures.auto_magnitude import AutoMagnitudeMixin
from laplace_debiased.structures.cross_fit import CrossFitDecomposed, CrossFitMixin
from laplace_debiased.structures.kron_layers import KronLayersMixin
from laplace_debiased.structures.two_batch import TwoBatchLaplaceMixin
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.curvature.completion import NULL_SPACE_MODES
from laplace_debiased.computers.kron import combine_kfacs, decompose_two_batch
from laplace_debiased.computers.kron_estimators import ESTIMATORS, Correction, resolve_estimator
from laplace_debiased.computers.coverage import Coverage, report_coverage
from laplace_debiased.curvature.layer_blocks import block_spans
from laplace_debiased.posterior.spanned import Spanned, SpannedImplicitKronStructure, SpannedKronStructure
from laplace_debiased.parallel.reducer import current_reducer
from laplace_debiased.computers.kron_passes import single_pass_kfacs

__all__ = ["DebiasedKronDecomposed", "DebiasedKronLaplace", "DebiasedKronLLLaplace"]




class DebiasedKronDecomposed(ImplicitKronDecomposed):
    """``KronDecomposed`` whose ``+`` (prior precision) and ``*`` (likelihood factor) keep
    ``damping`` (laplace-torch 0.3 silently drops it in both operations) and whose input-side
    factors may keep their null space implicit
    (:class:`~laplace_debiased.posterior.implicit_kron.ImplicitKronDecomposed`)."""


class SpannedKronDecomposed(Spanned, DebiasedKronDecomposed):
    """:class:`DebiasedKronDecomposed` whose blocks may span several parameter tensors (a
    normalisation layer's dense block; :mod:`laplace_debiased.curvature.layer_blocks`)."""

    _structure = SpannedKronStructure
    _implicit_structure = SpannedImplicitKronStructure

    def __init__(self, eigenvectors, eigenvalues, deltas=None, damping: bool = False, *, spans: list[int] | None = None) -> None:
        super().__init__(eigenvectors, eigenvalues, deltas, damping=damping)
        self.spans = list(spans) if spans is not None else [1] * len(eigenvalues)


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
    Layers: :mod:`~laplace_debiased.curvature.layer_blocks` (beyond Linear/Conv2d only with the default
    Curvlinops GGN/EF backend); backends: also ASDL GGN/EF (BackPACK: no Conv2d).
    """

    _key = ("all", "debiased_kron")
    _null_space: str = "isotropic"
    _estimator: str = "paper"
    _estimators: tuple[str, ...] = ESTIMATORS

    def fit(
        self,
        train_loader: DataLoader,
        override: bool = True,
        progress_bar: bool = False,
        *,
        magnitude_loader: DataLoader | None = None,
        n_direction_batches: int | None = None,
        n_magnitude_batches: int | Literal["auto"] | None = None,
        split: str = "batches",
        generator: torch.Generator | None = None,
        null_space: str = "isotropic",
        estimator: str | None = None,
        cross_fit: bool = False,
    ) -> None:
        """Fit the debiased K-FAC approximation at the current (MAP) parameters.

        ``train_loader`` to ``generator``: the two batches, as
        :meth:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin.fit`.

        ``cross_fit=True``: also fit the swapped roles (basis from B̃, eigenvalues from B) and use
        the equal-weight mixture of the two (:mod:`~laplace_debiased.structures.cross_fit`).

        ``null_space``: how directions that B's factors do not
        distinguish (their null space, where a factor is wider than B) get their magnitude.

        ``"isotropic"`` (default): each such eigenspace gets B̃'s mean curvature over it,
        ``tr(Pᵀ C_B̃ P) / dim P`` (unbiased, P chosen by B alone); ``"aligned"``: B̃'s own
        eigenbasis there, measured by B̃ (same-batch bias, exact zeros where B ∪ B̃ does not
        reach). See :mod:`laplace_debiased.curvature.completion` and docs/wide-layers.md.
        After the fit ``self.coverage`` (:class:`~laplace_debiased.computers.coverage.Coverage`)
        records per layer and factor what the curvature covers; it is logged, and a warning
        names the layers where a share of the weights keeps only the prior.
        ``debiased_ekfac`` (a subclass with its own eigenbasis and eigenvalues) does not use
        ``null_space`` and records no coverage.

        ``estimator``: ``"paper"`` (default; B's eigenvectors, B̃'s Rayleigh quotients; the only one
        of ``debiased_ekfac``) or ``"corrected"`` (the eigenvectors of B ∪ B̃, as a single batch of
        all their samples, with eigenvalues less the regression-to-the-mean gap that the two
        batches measure against each other; :mod:`laplace_debiased.curvature.corrected`;
        ``null_space`` does not apply; measured against the paper's in docs/guide/choosing-batches.md).
        After a corrected fit
        ``self.correction`` (:class:`~laplace_debiased.computers.kron_estimators.Correction`)
        holds per block and factor what the correction changed, and it is logged.
        """
        if null_space not in NULL_SPACE_MODES:
            raise ValueError(f"null_space must be one of {NULL_SPACE_MODES}, got {null_space!r}.")
        if not isinstance(cross_fit, bool):
            raise TypeError(f"cross_fit must be a bool, got {type(cross_fit).__name__}.")
        self._null_space = null_space
        self._estimator = resolve_estimator(estimator, self._estimators, self._key[1], cross_fit)
        self._cross_fit = cross_fit
        super().fit(
            train_loader, override=override, progress_bar=progress_bar, magnitude_loader=magnitude_loader,
            n_direction_batches=n_direction_batches, n_magnitude_batches=n_magnitude_batches, split=split,
            generator=generator,
        )

    def _reset_fit_state(self) -> None:
        super()._reset_fit_state()
        self.H_facs = None
        self.H_facs_magnitude: Kron | None = None
        self.coverage: Coverage | None = None
        self.correction: Correction | None = None
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
            direction = Kron(combine_kfacs(self.H_facs.kfacs, direction.kfacs, n_old, N))
            magnitude = Kron(combine_kfacs(self.H_facs_magnitude.kfacs, magnitude.kfacs, n_old, N))
        self.H_facs, self.H_facs_magnitude = direction, magnitude
        sizes = [sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in g) for g in groups]
        self._fit_sizes = (self._fit_sizes[0] + sizes[0], self._fit_sizes[1] + sizes[-1])
        self._decompose(self.n_data + N)
        self._record_coverage()
        return loss

    def _kfacs(self, groups: list[list[Batch]], N: int) -> tuple[torch.Tensor, list[Kron]]:
        """K-FAC of each batch set, scaled to ``N`` points, and the summed loss over all of
        them: one shared pass (:meth:`_kfac_single_pass`) where the backend allows, else one
        backend call per batch (:meth:`_kfac`)."""
        self._factor_rows = None
        if self._single_pass_fisher() is not None:
            return self._kfac_single_pass(groups, N)
        if current_reducer().world > 1:
            raise ValueError(
                f"a distributed debiased K-FAC fit needs the CurvlinopsGGN (stochastic=False) "
                f"or CurvlinopsEF backend without asdl_fisher_kwargs; got "
                f"{type(self.backend).__name__}. Use one of them or fit in one process."
            )
        fits = [self._kfac(batches, N) for batches in groups]
        return sum(f[0] for f in fits), [f[1] for f in fits]

    def _decompose(self, n_data: int | None = None) -> None:
        """``H``, ``coverage`` and ``correction`` from ``H_facs`` and ``H_facs_magnitude``
        (:func:`~laplace_debiased.computers.kron.decompose_two_batch`; ``n_data``: the training
        data the batches were drawn from, by default ``self.n_data``)."""
        rows = getattr(self, "_factor_rows", None) or [None]
        result = decompose_two_batch(
            self.H_facs.kfacs, self.H_facs_magnitude.kfacs, rows=(rows[0], rows[-1]),
            null_space=self._null_space, estimator=self._estimator, cross_fit=self._cross_fit,
            sizes=self._fit_sizes, n_data=n_data or self.n_data, names=self._block_names(),
            reducer=current_reducer(),
        )
        H = self._decomposed(result.eigenvectors, result.eigenvalues)
        self.H = H if result.swapped is None else CrossFitDecomposed(H, self._decomposed(*result.swapped))
        self.coverage, self.correction = result.coverage, result.correction

    def _record_coverage(self) -> None:
        """Log ``self.coverage`` and warn once, naming the layers with prior-only weights."""
        report_coverage(self.coverage)

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
        """K-FAC of each batch set from shared passes over B ∪ B̃ (:func:`single_pass_kfacs`),
        each checked against the trainable parameters; and the summed loss."""
        loss, kfacs, self._factor_rows = single_pass_kfacs(
            self.model, self._kfac_modules(), groups, N, likelihood=self.likelihood, backend=self.backend,
            fisher=self._single_pass_fisher(), keys=(self.dict_key_x, self.dict_key_y), mean=self.mean,
            reducer=current_reducer(),
        )
        for blocks in kfacs:
            self._check_blocks(blocks)
        return loss, [Kron(blocks) for blocks in kfacs]

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
        self.coverage = self.correction = None
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

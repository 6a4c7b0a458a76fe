"""Debiased K-FAC Laplace (Tatzel et al., ICLR 2025, Sec. 4.2.2 / App. A.3.3).

Per parameter block, the K-FAC factors ``[G, A]`` of the direction batch B give the
eigenvectors, and the factors ``[D, C]`` of the independent magnitude batch B̃ give the
eigenvalues ``diag(U_Gᵀ D U_G)``, ``diag(U_Aᵀ C U_A)``
([`laplace_debiased.curvature.linalg.debiased_kron`][laplace_debiased.curvature.linalg.debiased_kron]).

Scale convention (identical to a laplace-torch ``KronLaplace`` fit over all ``N`` data):
the factors of a batch set S with ``m`` samples are ``G_S = N/m * sum_{n in S} g_n g_nᵀ``
(output side, summed loss; bias blocks likewise) and ``A_S = mean_{n in S} a_n a_nᵀ``
(input side), so ``G_S ⊗ A_S`` estimates the K-FAC of the summed loss over ``N`` points and
``split="halves"`` is directly comparable to ``KronLaplace.fit(full_loader)``.

Fit cost: with the Curvlinops exact-GGN or EF backend (the default) the rows of B and B̃ go
through the model in shared forward/backward passes and the factor sums are split by sample
([`laplace_debiased.curvature.kfac`][laplace_debiased.curvature.kfac]), so a debiased fit at 2 × b/2 costs one
pass over ``b`` rows like a single-batch fit at ``b``; other backends are called once per batch.
Under an initialised ``torch.distributed`` group the rows are sharded over the ranks
([`laplace_debiased.parallel.distributed`][laplace_debiased.parallel.distributed]).
"""

from __future__ import annotations

from typing import Any

import torch
from laplace.baselaplace import KronLaplace
from laplace.curvature.curvature import CurvatureInterface
from laplace.lllaplace import KronLLLaplace
from laplace.utils.matrix import Kron
from torch import nn

from laplace_debiased.two_batch.coverage import Coverage, report_coverage
from laplace_debiased.kron.decompose import combine_kfacs, decompose_two_batch
from laplace_debiased.kron.estimators import ESTIMATORS, Correction, resolve_estimator
from laplace_debiased.kron.passes import single_pass_kfacs
from laplace_debiased.curvature.completion import NULL_SPACE_MODES
from laplace_debiased.curvature.linalg import RowFactor, dense_factor
from laplace_debiased.curvature.layer_blocks import block_spans, curvature_modules
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.parallel.reducer import current_reducer
from laplace_debiased.kron.posterior import ImplicitKronDecomposed
from laplace_debiased.kron.spanned import Spanned, SpannedImplicitKronStructure, SpannedKronStructure
from laplace_debiased.two_batch.cross_fit import CrossFitDecomposed
from laplace_debiased.kron.layers import (
    block_names,
    check_blocks,
    check_supported,
    single_pass_fisher,
    trainable_blocks,
)
from laplace_debiased.two_batch.base import TwoBatchLaplace

__all__ = [
    "DebiasedKronDecomposed",
    "DebiasedKronLaplace",
    "DebiasedKronLLLaplace",
    "RowsKron",
    "backend_kfacs",
    "debiased_kron_curvature",
    "fit_kfacs",
    "kron_decomposed",
    "kron_factors",
    "kron_fit_options",
    "kron_from_state",
    "kron_state",
]


class RowsKron(Kron):
    """laplace-torch's ``Kron`` whose factors may be held as rows: ``factors`` holds per block the
    factors as fitted, a ``(d, d)`` tensor or a
    [`RowFactor`][laplace_debiased.curvature.linalg.RowFactor] (a factor with fewer rows than its
    width, never formed densely by the fit). Reading ``kfacs`` (laplace-torch's attribute, for users
    and laplace-torch's methods, e.g. ``state_dict``) forms such factors densely, once: they replace
    the rows in ``factors``, so the list can be modified in place as laplace-torch's; assigning
    ``kfacs`` sets ``factors``."""

    def __init__(self, factors: list[list[torch.Tensor | RowFactor]]) -> None:
        super().__init__(factors)

    @property
    def kfacs(self) -> list[list[torch.Tensor]]:
        """The factors as ``(d, d)`` tensors, those held as rows formed here (``XᵀX``, one tensor per
        ``RowFactor`` shared by several blocks) and kept in their place."""
        if any(isinstance(F, RowFactor) for block in self.factors for F in block):
            formed: dict[int, torch.Tensor] = {}

            def form(F: torch.Tensor | RowFactor) -> torch.Tensor:
                if id(F) not in formed:
                    formed[id(F)] = dense_factor(F)
                return formed[id(F)]

            self.factors = [[form(F) for F in block] for block in self.factors]
        return self.factors

    @kfacs.setter
    def kfacs(self, value: list[list[torch.Tensor | RowFactor]]) -> None:
        self.factors = value


class DebiasedKronDecomposed(ImplicitKronDecomposed):
    """``KronDecomposed`` whose ``+`` (prior precision) and ``*`` (likelihood factor) keep
    ``damping`` (laplace-torch 0.3 silently drops it in both operations) and whose input-side
    factors may keep their null space implicit
    ([`ImplicitKronDecomposed`][laplace_debiased.kron.posterior.ImplicitKronDecomposed])."""


class SpannedKronDecomposed(Spanned, DebiasedKronDecomposed):
    """[`DebiasedKronDecomposed`][laplace_debiased.kron.laplace.DebiasedKronDecomposed] whose blocks may
    span several parameter tensors (a normalisation layer's dense block;
    [`laplace_debiased.curvature.layer_blocks`][laplace_debiased.curvature.layer_blocks])."""

    _structure = SpannedKronStructure
    _implicit_structure = SpannedImplicitKronStructure

    def __init__(self, eigenvectors, eigenvalues, deltas=None, damping: bool = False, *, spans: list[int] | None = None) -> None:
        super().__init__(eigenvectors, eigenvalues, deltas, damping=damping)
        self.spans = list(spans) if spans is not None else [1] * len(eigenvalues)


def kron_decomposed(
    eigenvectors: list, eigenvalues: list, damping: bool, modules: list[nn.Module]
) -> DebiasedKronDecomposed:
    """The decomposed curvature of a debiased K-FAC.

    Args:
        eigenvectors: Per block, the eigenvectors of its factors.
        eigenvalues: Per block, the eigenvalues of its factors.
        damping: laplace-torch's ``damping``.
        modules: The layers of the blocks, in block order.

    Returns:
        A [`SpannedKronDecomposed`][laplace_debiased.kron.laplace.SpannedKronDecomposed] where a dense
        normalisation block spans several parameter tensors, else a
        [`DebiasedKronDecomposed`][laplace_debiased.kron.laplace.DebiasedKronDecomposed].
    """
    spans = block_spans(modules)
    if any(span > 1 for span in spans):
        return SpannedKronDecomposed(eigenvectors, eigenvalues, damping=damping, spans=spans)
    return DebiasedKronDecomposed(eigenvectors, eigenvalues, damping=damping)


def kron_fit_options(
    null_space: str, estimator: str | None, cross_fit: object, *, offered: tuple[str, ...], structure: str
) -> str:
    """Check the options of a K-FAC-based fit (``debiased_kron``, ``debiased_ekfac``).

    Args:
        null_space: The constructor's ``null_space``, one of
            [`NULL_SPACE_MODES`][laplace_debiased.curvature.completion.NULL_SPACE_MODES].
        estimator: The constructor's ``estimator``, ``None`` for the default.
        cross_fit: The constructor's ``cross_fit``, a bool.
        offered: The estimators the structure offers.
        structure: The ``hessian_structure`` name (for the message).

    Returns:
        The estimator the fit uses
        ([`resolve_estimator`][laplace_debiased.kron.estimators.resolve_estimator]).

    Raises:
        ValueError: An unknown ``null_space`` or ``estimator``, or ``"corrected"`` / ``"shrunk"`` / ``"stein"``
            with ``cross_fit`` or ``null_space="aligned"``.
        TypeError: ``cross_fit`` is not a bool.
    """
    if null_space not in NULL_SPACE_MODES:
        raise ValueError(f"null_space must be one of {NULL_SPACE_MODES}, got {null_space!r}.")
    if not isinstance(cross_fit, bool):
        raise TypeError(f"cross_fit must be a bool, got {type(cross_fit).__name__}.")
    return resolve_estimator(estimator, offered, structure, cross_fit, null_space)


def backend_kfacs(
    model: nn.Module,
    backend: CurvatureInterface,
    groups: list[list[Batch]],
    N: int,
    *,
    asdl_fisher_kwargs: dict,
    output_shape: tuple[int, ...],
    dict_key_x: str,
    dict_key_y: str,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, list[Kron]]:
    """K-FAC of each batch set by one backend call per batch (backends that
    [`single_pass_fisher`][laplace_debiased.kron.layers.single_pass_fisher] does not reproduce),
    scaled to ``N`` points (module docstring convention), with the blocks of frozen parameters
    dropped and the rest checked.

    Args:
        model: The network.
        backend: laplace-torch's curvature backend.
        groups: The batch sets (B, and B̃ unless it is B).
        N: Training samples the factors are scaled to.
        asdl_fisher_kwargs: laplace-torch's ``asdl_fisher_kwargs``, passed to ``backend.kron``.
        output_shape: The per-sample output shape ``([tokens, ...,] C)``.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.
        device: Device of the loss.
        dtype: dtype of the loss.

    Returns:
        The summed loss the backend evaluates with the factors over all sets, and one ``Kron``
        per set.

    Raises:
        ValueError: Under a process group, for token outputs, or where the backend drops a block.
    """
    if current_reducer().world > 1:
        raise ValueError(
            f"a distributed debiased K-FAC fit needs the CurvlinopsGGN (stochastic=False) "
            f"or CurvlinopsEF backend without asdl_fisher_kwargs; got "
            f"{type(backend).__name__}. Use one of them or fit in one process."
        )
    modules = curvature_modules(backend._model)
    losses, krons = [], []
    for batches in groups:
        if len(output_shape) > 1:
            raise ValueError(
                f"outputs of shape (batch, {', '.join(map(str, output_shape))}) "
                f"(every token an output) need the CurvlinopsGGN (stochastic=False) or "
                f"CurvlinopsEF backend without asdl_fisher_kwargs; got "
                f"{type(backend).__name__}, whose K-FAC does not treat tokens as outputs."
            )
        m = sum(batch_size(b, dict_key_x, dict_key_y) for b in batches)
        loss = torch.zeros((), device=device, dtype=dtype)
        total: Kron | None = None
        for b in batches:
            X, y = batch_inputs_targets(b, dict_key_x, dict_key_y)
            model.zero_grad()
            # with N=m every backend returns [sum_b g gᵀ, (1/m) sum_b a aᵀ]; factor-wise
            # addition over the batches then gives [sum_S g gᵀ, mean_S a aᵀ].
            batch_loss, kron = backend.kron(X, y, N=m, **asdl_fisher_kwargs)
            loss = loss + batch_loss
            total = kron if total is None else total + kron
        kfacs = [[F[0] * (N / m), *F[1:]] for F in trainable_blocks(backend._model, total.kfacs)]
        check_blocks(kfacs, modules, backend)
        losses.append(loss)
        krons.append(Kron(kfacs))
    return sum(losses), krons


def fit_kfacs(
    model: nn.Module,
    backend: CurvatureInterface,
    groups: list[list[Batch]],
    N: int,
    *,
    fisher: str | None,
    likelihood: str,
    asdl_fisher_kwargs: dict,
    output_shape: tuple[int, ...],
    mean: torch.Tensor,
    dict_key_x: str,
    dict_key_y: str,
) -> tuple[torch.Tensor, list[Kron], list | None, list | None]:
    """K-FAC of each batch set, scaled to ``N`` points, and the summed loss over all of them: one
    shared pass ([`single_pass_kfacs`][laplace_debiased.kron.passes.single_pass_kfacs]) where the
    backend allows, else [`backend_kfacs`][laplace_debiased.kron.laplace.backend_kfacs]; the layers and the
    first set checked first ([`check_supported`][laplace_debiased.kron.layers.check_supported]),
    the blocks checked against the trainable parameters.

    Args:
        model: The network.
        backend: laplace-torch's curvature backend.
        groups: The batch sets (B, and B̃ unless it is B).
        N: Training samples the factors are scaled to.
        fisher: [`single_pass_fisher`][laplace_debiased.kron.layers.single_pass_fisher] of the
            backend (``None``: [`backend_kfacs`][laplace_debiased.kron.laplace.backend_kfacs]).
        likelihood: laplace-torch's likelihood.
        asdl_fisher_kwargs: laplace-torch's ``asdl_fisher_kwargs``.
        output_shape: The per-sample output shape ``([tokens, ...,] C)``.
        mean: The MAP parameters ``(P,)``.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.

    Returns:
        The summed loss, one ``Kron`` per set (a [`RowsKron`][laplace_debiased.kron.laplace.RowsKron] from
        the shared pass, whose factors with fewer rows than their width are held as rows), the shared
        pass's factor rows and per set, block and factor the rank-one terms summed into the factor (both
        ``None`` for [`backend_kfacs`][laplace_debiased.kron.laplace.backend_kfacs]).

    Raises:
        ValueError: What the backend would get wrong for these layers and batches
            ([`check_supported`][laplace_debiased.kron.layers.check_supported]), or what
            [`backend_kfacs`][laplace_debiased.kron.laplace.backend_kfacs] refuses.
    """
    check_supported(backend, backend._model, groups[0], fisher, output_shape)
    params = next(model.parameters())
    if fisher is None:
        loss, krons = backend_kfacs(
            model, backend, groups, N, asdl_fisher_kwargs=asdl_fisher_kwargs, output_shape=output_shape,
            dict_key_x=dict_key_x, dict_key_y=dict_key_y, device=params.device, dtype=params.dtype,
        )
        return loss, krons, None, None
    modules = curvature_modules(backend._model)
    loss, kfacs, rows, terms = single_pass_kfacs(  # reward modelling fits the classification curvature
        model, modules, groups, N, likelihood="classification" if likelihood == "reward_modeling" else likelihood,
        backend=backend, fisher=fisher,
        keys=(dict_key_x, dict_key_y), mean=mean, reducer=current_reducer(),
    )
    for blocks in kfacs:
        check_blocks(blocks, modules, backend)
    return loss, [RowsKron(blocks) for blocks in kfacs], rows, terms


def kron_factors(kron: Kron) -> list[list[torch.Tensor | RowFactor]]:
    """The factors of ``kron`` as fitted: a [`RowsKron`][laplace_debiased.kron.laplace.RowsKron]'s
    ``factors`` (some held as rows), else laplace-torch's ``kfacs``."""
    return kron.factors if isinstance(kron, RowsKron) else kron.kfacs


def _added_terms(old: list | None, new: list) -> list | None:
    """Rank-one terms per block and factor of two fits combined online (``None``: unknown)."""
    return None if old is None else [[a + b for a, b in zip(o, n)] for o, n in zip(old, new)]


def debiased_kron_curvature(
    direction: Kron,
    magnitude: Kron,
    rows: list | None,
    *,
    null_space: str,
    estimator: str,
    cross_fit: bool,
    sizes: tuple[int, int],
    n_data: int,
    layers: nn.Module,
    damping: bool,
    terms: tuple[list | None, list | None] = (None, None),
) -> tuple[DebiasedKronDecomposed | CrossFitDecomposed, Coverage | None, Correction | None]:
    """The debiased K-FAC curvature of B's and B̃'s factors
    ([`decompose_two_batch`][laplace_debiased.kron.decompose.decompose_two_batch]).

    Args:
        direction: B's K-FAC, scaled to ``n_data``.
        magnitude: B̃'s K-FAC, scaled to ``n_data``.
        rows: The shared pass's factor rows per batch set (``None``: not known).
        null_space: ``"isotropic"`` or ``"aligned"``.
        estimator: ``"paper"``, ``"corrected"``, ``"shrunk"`` or ``"stein"``.
        cross_fit: Also decompose the swapped roles.
        sizes: Samples summed into B's and B̃'s factors.
        n_data: The training data the batches were drawn from.
        layers: The network (laplace-torch's backend model), for the block names and spans.
        damping: laplace-torch's ``damping``.
        terms: B's and B̃'s rank-one terms per block and factor (``None``: unknown, the samples).

    Returns:
        The decomposition ([`kron_decomposed`][laplace_debiased.kron.laplace.kron_decomposed], or the
        mixture of it and the swapped one), the coverage record and the correction record (``None`` where not
        computed).
    """
    rows = rows or [None]
    result = decompose_two_batch(
        kron_factors(direction), kron_factors(magnitude), rows=(rows[0], rows[-1]), null_space=null_space,
        estimator=estimator, cross_fit=cross_fit, sizes=sizes, n_data=n_data,
        names=block_names(layers, len(kron_factors(direction))), reducer=current_reducer(), terms=terms,
    )
    modules = curvature_modules(layers)
    H = kron_decomposed(result.eigenvectors, result.eigenvalues, damping, modules)
    if result.swapped is not None:
        H = CrossFitDecomposed(H, kron_decomposed(*result.swapped, damping, modules))
    return H, result.coverage, result.correction


def kron_state(H: DebiasedKronDecomposed | CrossFitDecomposed) -> dict[str, Any]:
    """The ``state_dict`` entries of a debiased K-FAC decomposition.

    Args:
        H: The decomposition, or a cross-fitted mixture of two.

    Returns:
        ``"H_eigenvectors"``, ``"H_eigenvalues"`` and, for a mixture, ``"H_swapped"``
        (the swapped component's eigenvectors and eigenvalues).
    """
    comps = H.components if isinstance(H, CrossFitDecomposed) else (H,)
    state = {"H_eigenvectors": comps[0].eigenvectors, "H_eigenvalues": comps[0].eigenvalues}
    if len(comps) == 2:
        state["H_swapped"] = [comps[1].eigenvectors, comps[1].eigenvalues]
    return state


def kron_from_state(
    state_dict: dict[str, Any], damping: bool, modules: list[nn.Module]
) -> DebiasedKronDecomposed | CrossFitDecomposed:
    """The decomposition [`kron_state`][laplace_debiased.kron.laplace.kron_state] saved.

    Args:
        state_dict: A ``state_dict`` with [`kron_state`][laplace_debiased.kron.laplace.kron_state]'s
            entries.
        damping: laplace-torch's ``damping``.
        modules: The layers of the blocks, in block order.

    Returns:
        The decomposition ([`kron_decomposed`][laplace_debiased.kron.laplace.kron_decomposed]), or the
        mixture of it and the swapped one.
    """
    H = kron_decomposed(state_dict["H_eigenvectors"], state_dict["H_eigenvalues"], damping, modules)
    if "H_swapped" in state_dict:
        H = CrossFitDecomposed(H, kron_decomposed(*state_dict["H_swapped"], damping, modules))
    return H


class DebiasedKronLaplace(TwoBatchLaplace, KronLaplace):
    """Two-batch debiased K-FAC Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_kron")``).

    After ``fit``, ``H_facs`` / ``H_facs_magnitude``
    are the ``Kron`` factors of B and B̃ (scaled to ``n_data``; a
    [`RowsKron`][laplace_debiased.kron.laplace.RowsKron] whose factors with fewer rows than their width
    are formed densely only where ``kfacs`` is read, as by ``state_dict``) and ``H`` a
    [`DebiasedKronDecomposed`][laplace_debiased.kron.laplace.DebiasedKronDecomposed]: by default the pooled
    eigenvectors of B ∪ B̃ with corrected eigenvalues; with
    ``estimator="paper"`` B's eigenvectors and B̃'s Rayleigh quotients (cross-fitted: a
    [`CrossFitDecomposed`][laplace_debiased.two_batch.cross_fit.CrossFitDecomposed]); ``coverage``
    ([`Coverage`][laplace_debiased.two_batch.coverage.Coverage], logged) records what the curvature covers and
    ``correction`` ([`Correction`][laplace_debiased.kron.estimators.Correction]) what a corrected fit changed.
    Layers: [`layer_blocks`][laplace_debiased.curvature.layer_blocks] (beyond Linear/Conv2d only with the
    default Curvlinops GGN/EF backend); backends: also ASDL GGN/EF (BackPACK: no Conv2d).

    The GLM predictive ``la(x)`` (tensor inputs, not ``joint``, no ``enable_backprop``) builds no
    Jacobian: ``J P⁻¹ Jᵀ`` comes from each layer's inputs and backpropagated output gradients in the
    K-FAC eigenbasis ([`GridPredictive.covariance`][laplace_debiased.posterior.grid.GridPredictive.covariance]),
    a Jacobian formed only for a layer without that structure (normalisation blocks, a layer whose
    dense rotation is cheaper). ``functional_variance(Js)`` is laplace-torch's: given Jacobians, it
    keeps laplace-torch's route.
    """

    _key = ("all", "debiased_kron")
    _kfac_blocks = True

    def _single_pass_fisher(self) -> str | None:
        """[`single_pass_fisher`][laplace_debiased.kron.layers.single_pass_fisher] of the backend."""
        return single_pass_fisher(self.backend, self._asdl_fisher_kwargs)
    _estimators: tuple[str, ...] = ESTIMATORS
    _options = (*TwoBatchLaplace._options, "null_space", "estimator", "cross_fit")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        *args: Any,
        null_space: str = "isotropic",
        estimator: str | None = None,
        cross_fit: bool = False,
        **kwargs: Any,
    ) -> None:
        """laplace-torch's ``KronLaplace`` constructor, the batch options of
        [`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace], and the estimate.

        Args:
            model: The network, as for laplace-torch.
            likelihood: laplace-torch's likelihood.
            *args: laplace-torch's positional arguments.
            null_space: For ``estimator="paper"``, B's null space: ``"isotropic"`` (B̃'s mean curvature
                there) or ``"aligned"`` (B̃'s eigenbasis there)
                ([`completion`][laplace_debiased.curvature.completion]).
            estimator: ``"corrected"`` (default), ``"shrunk"`` (the correction shrunk by the two
                orders' disagreement), ``"stein"`` (weighted by its minimum-MSE, James–Stein, weight) or
                ``"paper"``
                ([`resolve_estimator`][laplace_debiased.kron.estimators.resolve_estimator]; the maths:
                [`corrected`][laplace_debiased.kron.corrected]). B̃ = B gives stock K-FAC either way.
            cross_fit: Also fit the swapped roles (basis from B̃, eigenvalues from B) and use the
                equal-weight mixture of the two ([`cross_fit`][laplace_debiased.two_batch.cross_fit]).
            **kwargs: The batch options and laplace-torch's keyword arguments.

        Raises:
            ValueError: An unknown ``null_space`` or ``estimator``, or options that do not combine.
            TypeError: ``cross_fit`` is not a bool.
        """
        self._set_estimate(null_space, estimator, cross_fit)
        super().__init__(model, likelihood, *args, **kwargs)

    def _set_estimate(self, null_space: str, estimator: str | None, cross_fit: bool) -> None:
        """Check and keep the estimate's options ([`kron_fit_options`][laplace_debiased.kron.laplace.kron_fit_options])."""
        self._estimator = kron_fit_options(null_space, estimator, cross_fit, offered=self._estimators, structure=self._key[1])
        self._requested_estimator, self._null_space, self._cross_fit = estimator, null_space, cross_fit

    def _update_options(self, options: dict[str, Any]) -> None:
        estimate = {"null_space": self._null_space, "estimator": self._requested_estimator, "cross_fit": self._cross_fit}
        if any(name in options for name in estimate):
            self._set_estimate(**{name: options.pop(name, value) for name, value in estimate.items()})
        super()._update_options(options)

    def _reset_fit_state(self) -> None:
        super()._reset_fit_state()
        self.H_facs = self.H_facs_magnitude = self.coverage = self.correction = self._factor_rows = None
        self._fit_sizes = (0, 0)
        self._factor_terms: tuple[list | None, list | None] = (None, None)

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> torch.Tensor:
        groups = [direction_batches] if magnitude_batches is direction_batches else [direction_batches, magnitude_batches]
        loss, krons, self._factor_rows, terms = fit_kfacs(
            self.model, self.backend, groups, N, fisher=self._single_pass_fisher(), likelihood=self.likelihood,
            asdl_fisher_kwargs=self._asdl_fisher_kwargs, output_shape=self.fit_output_shape, mean=self.mean,
            dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y,
        )
        direction, magnitude = krons[0], krons[-1]
        if self.H_facs is not None:  # online: combine with the previous fit(s)
            self._factor_rows = None
            known = getattr(self, "_factor_terms", (None, None))
            terms = None if terms is None else [_added_terms(old, new) for old, new in zip(known, terms)]
            direction = Kron(combine_kfacs(self.H_facs.kfacs, direction.kfacs, self.n_data, N))
            magnitude = Kron(combine_kfacs(self.H_facs_magnitude.kfacs, magnitude.kfacs, self.n_data, N))
        self.H_facs, self.H_facs_magnitude = direction, magnitude
        self._factor_terms = (None, None) if terms is None else (terms[0], terms[-1])
        sizes = [sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in g) for g in groups]
        self._fit_sizes = (self._fit_sizes[0] + sizes[0], self._fit_sizes[1] + sizes[-1])
        self._decompose(self.n_data + N)
        report_coverage(self.coverage)
        return loss

    def _decompose(self, n_data: int | None = None) -> None:
        """``H``, ``coverage`` and ``correction`` from ``H_facs`` and ``H_facs_magnitude``
        ([`debiased_kron_curvature`][laplace_debiased.kron.laplace.debiased_kron_curvature]), scaled to
        ``n_data`` data points (by default ``self.n_data``)."""
        self.H, self.coverage, self.correction = debiased_kron_curvature(
            self.H_facs, self.H_facs_magnitude, getattr(self, "_factor_rows", None), null_space=self._null_space,
            estimator=self._estimator, cross_fit=self._cross_fit, sizes=self._fit_sizes,
            terms=getattr(self, "_factor_terms", (None, None)),
            n_data=n_data or self.n_data, layers=self.backend._model, damping=self.damping,
        )

    def state_dict(self) -> dict[str, Any]:
        """KronLaplace's state, B̃'s factors, the decomposition ([`kron_state`][laplace_debiased.kron.laplace.kron_state]), and the
        samples in B and B̃ and the estimator's settings, which an online fit continues from."""
        return {
            **super().state_dict(), "H_magnitude": self.H_facs_magnitude.kfacs, **kron_state(self.H),
            "kron_fit_sizes": list(self._fit_sizes), "kron_estimator": self._estimator,
            "kron_null_space": self._null_space, "kron_cross_fit": self._cross_fit,
        }

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """The checks of every structure, then the estimate's options: a state fitted with other
        options is refused (an online fit would continue it with this object's)."""
        super()._check_loadable(state_dict)
        mine = {"estimator": self._estimator, "null_space": self._null_space, "cross_fit": self._cross_fit}
        saved = {name: state_dict.get(f"kron_{name}") for name in mine}
        if saved != mine:
            raise ValueError(
                f"the state was fitted with {saved} but this object has {mine}; construct it with the same "
                "options, e.g. Laplace(..., estimator=...)."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved fit (``self.coverage`` is not saved: it is ``None`` after loading); a state
        fitted with other estimate options than the constructor's is refused."""
        super().load_state_dict(state_dict)
        self.coverage = self.correction = self._factor_rows = None
        self.H_facs_magnitude = Kron(state_dict["H_magnitude"])
        self.H = kron_from_state(state_dict, self.damping, curvature_modules(self.backend._model))
        self._fit_sizes = tuple(state_dict["kron_fit_sizes"])


class DebiasedKronLLLaplace(DebiasedKronLaplace, KronLLLaplace):
    """Last-layer two-batch debiased K-FAC Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_kron")``), a ``KronLLLaplace`` with the debiased fit of
    [`DebiasedKronLaplace`][laplace_debiased.kron.laplace.DebiasedKronLaplace]. ``override=False`` is not
    supported (as in laplace-torch)."""

    _key = ("last_layer", "debiased_kron")

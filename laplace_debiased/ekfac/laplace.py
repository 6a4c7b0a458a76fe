"""Debiased EKFAC Laplace: K-FAC eigenbasis of B, exact curvature along it measured on B̃.

Per parameter block the posterior precision is ``s · Q diag(vec Λ) Qᵀ + δ`` with
``Q = Q_G ⊗ Q_A`` the eigenvectors of B's K-FAC factors and ``Λ = diag(Qᵀ C_B̃ Q)`` the exact
GGN / empirical-Fisher curvature of the independent batch B̃ along them, scaled to ``N`` data
points like every debiased structure (``N/|B̃|`` times the sum over B̃; maths in
[`laplace_debiased.ekfac.passes`][laplace_debiased.ekfac.passes]).  With B̃ = B this is plain EKFAC on
B.

Outputs may be ``(n, tokens, C)``, every token an output with its own loss term (targets
``(n, tokens)``): the K-FAC basis comes from ``debiased_kron``'s shared pass, and the
eigenvalues of each token position are measured and added up
([`measure_ekfac_eigenvalues`][laplace_debiased.ekfac.passes.measure_ekfac_eigenvalues]).

Cross-fitting (``cross_fit=True``) also builds the swapped approximation (basis from
B̃, curvature measured on B) and uses the equal-weight mixture of the two Gaussians as the
posterior ([`laplace_debiased.two_batch.cross_fit`][laplace_debiased.two_batch.cross_fit], shared with
``debiased_kron``).

Under an initialised ``torch.distributed`` group the K-FAC sums come from ``debiased_kron``'s
sharded pass, rank 0 broadcasts their eigenbasis, every rank measures the eigenvalue sums on its
rows of B̃ and the sums are all-reduced
([`laplace_debiased.ekfac.decompose`][laplace_debiased.ekfac.decompose], through the reducer of
[`current_reducer`][laplace_debiased.parallel.reducer.current_reducer]).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from curvlinops import FisherType
from laplace.baselaplace import KronLaplace
from laplace.curvature.curvature import CurvatureInterface, EFInterface
from laplace.lllaplace import KronLLLaplace
from torch import Tensor, nn

from laplace_debiased.ekfac.decompose import EKFACMeasurement, decompose_ekfac
from laplace_debiased.curvature.layer_blocks import block_modules, block_spans, curvature_modules, is_extra
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.parallel.distributed import local_shards
from laplace_debiased.parallel.reducer import current_reducer
from laplace_debiased.ekfac.posterior import EKFACDecomposed, SpannedEKFACDecomposed
from laplace_debiased.two_batch.cross_fit import CrossFitDecomposed
from laplace_debiased.kron.laplace import fit_kfacs, kron_factors, kron_fit_options
from laplace_debiased.kron.layers import single_pass_fisher
from laplace_debiased.two_batch.base import TwoBatchLaplace

__all__ = [
    "DebiasedEKFACLaplace",
    "DebiasedEKFACLLLaplace",
    "debiased_ekfac_curvature",
    "ekfac_curvature",
    "ekfac_from_state",
    "ekfac_measurement",
    "ekfac_state",
    "fisher_type",
]


def fisher_type(backend: CurvatureInterface) -> str:
    """The curvature the EKFAC eigenvalues measure for ``backend``.

    Args:
        backend: laplace-torch's curvature backend.

    Returns:
        A ``curvlinops.FisherType``: the empirical Fisher for an EF backend, the MC Fisher for a
        ``stochastic`` GGN backend, else the exact GGN.
    """
    if isinstance(backend, EFInterface):
        return FisherType.EMPIRICAL
    return FisherType.MC if getattr(backend, "stochastic", False) else FisherType.TYPE2


def ekfac_measurement(
    batches: list[Batch],
    *,
    N: int,
    backend: CurvatureInterface,
    modules: list[nn.Module],
    dict_key_x: str,
    dict_key_y: str,
    dtype: torch.dtype,
) -> EKFACMeasurement:
    """What the Linear/Conv2d blocks' eigenvalues are measured with: this rank's rows of
    ``batches``, the backend's loss and curvature type, the sum scaled to ``N``.

    Args:
        batches: The measured batch set (all ranks' batches; this rank keeps its shard).
        N: Training samples the eigenvalues are scaled to.
        backend: laplace-torch's curvature backend (its model and loss function).
        modules: The layers of the K-FAC blocks, in block order.
        dict_key_x: Key of the inputs in a mapping batch.
        dict_key_y: Key of the targets in a mapping batch.
        dtype: The model's dtype.

    Returns:
        The [`EKFACMeasurement`][laplace_debiased.ekfac.decompose.EKFACMeasurement].
    """
    reducer = current_reducer()
    n_rows = sum(batch_size(b, dict_key_x, dict_key_y) for b in batches)
    shards = local_shards(batches, dict_key_x, dict_key_y, rank=reducer.rank, world=reducer.world)
    data = [batch_inputs_targets(b, dict_key_x, dict_key_y) for b in shards]
    dict_inputs = bool(data) and not isinstance(data[0][0], Tensor)
    return EKFACMeasurement(
        model=backend.model,
        loss_func=backend.lossfunc,
        params=[p for m in modules if not is_extra(m) for p in m.parameters(recurse=False) if p.requires_grad],
        batches=data,
        fisher_type=fisher_type(backend),
        batch_size_fn=(lambda x: x[dict_key_x].shape[0]) if dict_inputs else None,
        scale=N / n_rows * backend.factor,
        dtype=dtype,
    )


def _ekfac_decomposed(eigenvectors: list, eigenvalues: list[Tensor], modules: list[nn.Module]) -> EKFACDecomposed:
    """[`SpannedEKFACDecomposed`][laplace_debiased.ekfac.posterior.SpannedEKFACDecomposed] where a block spans
    several parameter tensors, else [`EKFACDecomposed`][laplace_debiased.ekfac.posterior.EKFACDecomposed]."""
    spans = block_spans(modules)
    if any(span > 1 for span in spans):
        return SpannedEKFACDecomposed(eigenvectors, eigenvalues, spans)
    return EKFACDecomposed(eigenvectors, eigenvalues)


def ekfac_curvature(
    basis: list, measured: list, measurement: EKFACMeasurement, modules: list[nn.Module], rows: list | None = None,
    terms: list | None = None,
) -> EKFACDecomposed:
    """EKFAC with the eigenbasis of one batch set's K-FAC and the curvature of another
    ([`decompose_ekfac`][laplace_debiased.ekfac.decompose.decompose_ekfac]).

    Args:
        basis: The K-FAC blocks (``Kron.kfacs``) whose eigenbasis is kept, scaled to ``N``.
        measured: The K-FAC blocks of the measured batch set, scaled to ``N`` (for the
            embedding and normalisation blocks).
        measurement: The measured batch set
            ([`ekfac_measurement`][laplace_debiased.ekfac.laplace.ekfac_measurement]).
        modules: The layers of the blocks, in block order.
        rows: ``None``, or per block and factor the rows of ``basis``'s factors where known: a
            factor with fewer rows than its width keeps its complement implicit.
        terms: ``None``, or per block and factor the rank-one terms of ``basis``'s factors (the
            same without rows).

    Returns:
        The decomposition, spanned where a block spans several parameter tensors.
    """
    extra = [is_extra(m) for m in block_modules(modules)]
    result = decompose_ekfac(basis, measured, extra, measurement, current_reducer(), rows, terms)
    return _ekfac_decomposed(result.eigenvectors, result.eigenvalues, modules)


def debiased_ekfac_curvature(
    direction: list,
    magnitude: list,
    batches: tuple[list[Batch], list[Batch]],
    measure: Callable[[list[Batch]], EKFACMeasurement],
    modules: list[nn.Module],
    *,
    swap: bool,
    rows: tuple[list | None, list | None] = (None, None),
    terms: tuple[list | None, list | None] = (None, None),
) -> EKFACDecomposed | CrossFitDecomposed:
    """The debiased EKFAC curvature of a fit: B's eigenbasis, B̃'s curvature along it
    ([`ekfac_curvature`][laplace_debiased.ekfac.laplace.ekfac_curvature]), and with ``swap`` the mixture
    with the swapped roles.

    Args:
        direction: B's K-FAC blocks (``Kron.kfacs``), scaled to ``N``.
        magnitude: B̃'s K-FAC blocks, scaled to ``N`` (B's where B̃'s are not needed).
        batches: B and B̃.
        measure: The measurement of a batch set's curvature
            ([`ekfac_measurement`][laplace_debiased.ekfac.laplace.ekfac_measurement]).
        modules: The layers of the blocks, in block order.
        swap: Also decompose the swapped roles (basis from B̃, curvature from B).
        rows: B's and B̃'s factor rows per block and factor (``None`` where unknown): a factor
            with fewer rows than its width is decomposed through them.
        terms: B's and B̃'s rank-one terms per block and factor (``None`` where unknown).

    Returns:
        The decomposition, or the
        [`CrossFitDecomposed`][laplace_debiased.two_batch.cross_fit.CrossFitDecomposed] of it and the swapped
        one.
    """
    H = ekfac_curvature(direction, magnitude, measure(batches[1]), modules, rows[0], terms[0])
    if swap:
        swapped = ekfac_curvature(magnitude, direction, measure(batches[0]), modules, rows[-1], terms[-1])
        H = CrossFitDecomposed(H, swapped)
    return H


def ekfac_state(H: EKFACDecomposed | CrossFitDecomposed) -> dict[str, Any]:
    """The ``state_dict`` entry of a debiased EKFAC decomposition.

    Args:
        H: The decomposition, or a cross-fitted mixture of two.

    Returns:
        ``{"H_ekfac": [[eigenvectors, eigenvalues], ...]}``, one pair per component.
    """
    comps = H.components if isinstance(H, CrossFitDecomposed) else (H,)
    return {"H_ekfac": [[c.eigenvectors, c.eigenvalues] for c in comps]}


def ekfac_from_state(state_dict: dict[str, Any], modules: list[nn.Module]) -> EKFACDecomposed | CrossFitDecomposed:
    """The decomposition [`ekfac_state`][laplace_debiased.ekfac.laplace.ekfac_state] saved.

    Args:
        state_dict: A ``state_dict`` with [`ekfac_state`][laplace_debiased.ekfac.laplace.ekfac_state]'s
            entry.
        modules: The layers of the blocks, in block order.

    Returns:
        The decomposition, or the mixture of it and the swapped one.
    """
    comps = [_ekfac_decomposed(vecs, vals, modules) for vecs, vals in state_dict["H_ekfac"]]
    return comps[0] if len(comps) == 1 else CrossFitDecomposed(*comps)


class DebiasedEKFACLaplace(TwoBatchLaplace, KronLaplace):
    """Two-batch debiased EKFAC Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_ekfac")``).

    Same interface as ``KronLaplace``. After ``fit``, ``H_facs`` is B's K-FAC (``Kron``,
    scaled to ``n_data``; cross-fitted, ``H_facs_magnitude`` is B̃'s), and ``H`` an
    [`EKFACDecomposed`][laplace_debiased.ekfac.posterior.EKFACDecomposed] (or, cross-fitted, a
    [`CrossFitDecomposed`][laplace_debiased.two_batch.cross_fit.CrossFitDecomposed]).
    Layers: ``nn.Linear`` and ``nn.Conv2d`` (weight sharing handled exactly: per sample, the
    conv weight gradient is summed over positions before it is rotated and squared); embeddings,
    attention projections and GPT-2 ``Conv1D`` get debiased K-FAC blocks, normalisation layers
    their dense blocks ([`laplace_debiased.curvature.layer_blocks`][laplace_debiased.curvature.layer_blocks]).
    Backends as ``debiased_kron``: the GGN backends give the exact GGN diagonal (``stochastic``
    ones an MC Fisher), EF backends the empirical Fisher.  ``damping`` is not supported (the
    eigenvalues are not Kronecker-factored), nor are online fits (``override=False``).
    """

    _key = ("all", "debiased_ekfac")
    _kfac_blocks = True

    def _single_pass_fisher(self) -> str | None:
        """[`single_pass_fisher`][laplace_debiased.kron.layers.single_pass_fisher] of the backend."""
        return single_pass_fisher(self.backend, self._asdl_fisher_kwargs)

    _options = (*TwoBatchLaplace._options, "estimator", "cross_fit")
    _ignored_fit_options = ("null_space",)

    def __init__(
        self, model: nn.Module, likelihood: str, *args: Any, estimator: str | None = None, cross_fit: bool = False,
        **kwargs: Any,
    ) -> None:
        """laplace-torch's ``KronLaplace`` constructor (without ``damping``), the batch options of
        [`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace], and the estimate.

        Args:
            model: The network, as for laplace-torch.
            likelihood: laplace-torch's likelihood.
            *args: laplace-torch's positional arguments.
            estimator: ``"paper"`` only (the default).
            cross_fit: Also fit the swapped roles (basis from B̃, curvature from B) and use the
                equal-weight mixture of the two ([`cross_fit`][laplace_debiased.two_batch.cross_fit]).
            **kwargs: The batch options and laplace-torch's keyword arguments.

        Raises:
            ValueError: ``damping=True``, or an estimator other than ``"paper"``.
            TypeError: ``cross_fit`` is not a bool.
        """
        self._set_estimate(estimator, cross_fit)
        super().__init__(model, likelihood, *args, **kwargs)
        if self.damping:
            raise ValueError(
                "damping=True needs Kronecker-factored eigenvalues; EKFAC has one eigenvalue "
                "per basis direction. Use hessian_structure='debiased_kron' for damping."
            )

    def _set_estimate(self, estimator: str | None, cross_fit: bool) -> None:
        """Check and keep the estimate's options ([`kron_fit_options`][laplace_debiased.kron.laplace.kron_fit_options])."""
        kron_fit_options("isotropic", estimator, cross_fit, offered=("paper",), structure=self._key[1])
        self._estimator, self._cross_fit = estimator, cross_fit

    def _update_options(self, options: dict[str, Any]) -> None:
        if "estimator" in options or "cross_fit" in options:
            self._set_estimate(options.pop("estimator", self._estimator), options.pop("cross_fit", self._cross_fit))
        super()._update_options(options)

    def _check_override(self, override: bool) -> None:
        if not override:
            raise ValueError(
                "debiased EKFAC does not support override=False: refit on all the data with "
                "override=True."
            )

    def _reset_fit_state(self) -> None:
        super()._reset_fit_state()
        self.H_facs = self.H_facs_magnitude = self.coverage = self.correction = None

    def _fit_two_batch(self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int) -> Tensor:
        modules, fisher = curvature_modules(self.backend._model), self._single_pass_fisher()
        same = magnitude_batches is direction_batches
        swap = self._cross_fit and not same  # the swapped component needs B̃'s K-FAC too
        both = not same and (swap or any(map(is_extra, modules)))  # extra blocks: B̃'s sums of the shared pass
        loss, krons, rows, terms = fit_kfacs(
            self.model, self.backend, [direction_batches, magnitude_batches] if both else [direction_batches], N,
            fisher=fisher, likelihood=self.likelihood, asdl_fisher_kwargs=self._asdl_fisher_kwargs,
            output_shape=self.fit_output_shape, mean=self.mean, dict_key_x=self.dict_key_x, dict_key_y=self.dict_key_y,
        )
        direction, magnitude = krons[0], krons[-1]
        if not (same or both):
            loss = loss + self._summed_loss(magnitude_batches)
        measure = partial(
            ekfac_measurement, N=N, backend=self.backend, modules=modules, dict_key_x=self.dict_key_x,
            dict_key_y=self.dict_key_y, dtype=self._dtype,
        )
        self.H = debiased_ekfac_curvature(
            kron_factors(direction), kron_factors(magnitude), (direction_batches, magnitude_batches), measure, modules,
            swap=swap,
            rows=(rows[0], rows[-1]) if rows else (None, None), terms=(terms[0], terms[-1]) if terms else (None, None),
        )
        self.H_facs, self.H_facs_magnitude = direction, (magnitude if swap else None)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """KronLaplace's state (``"H"``: B's K-FAC) and the decomposition
        ([`ekfac_state`][laplace_debiased.ekfac.laplace.ekfac_state])."""
        return {**super().state_dict(), **ekfac_state(self.H)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved fit ([`ekfac_from_state`][laplace_debiased.ekfac.laplace.ekfac_from_state])."""
        super().load_state_dict(state_dict)
        self.H_facs_magnitude = None
        self.H = ekfac_from_state(state_dict, curvature_modules(self.backend._model))


class DebiasedEKFACLLLaplace(DebiasedEKFACLaplace, KronLLLaplace):
    """Last-layer two-batch debiased EKFAC Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_ekfac")``)."""

    _key = ("last_layer", "debiased_ekfac")

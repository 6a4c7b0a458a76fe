"""Debiased EKFAC Laplace: K-FAC eigenbasis of B, exact curvature along it measured on B̃.

Per parameter block the posterior precision is ``s · Q diag(vec Λ) Qᵀ + δ`` with
``Q = Q_G ⊗ Q_A`` the eigenvectors of B's K-FAC factors and ``Λ = diag(Qᵀ C_B̃ Q)`` the exact
GGN / empirical-Fisher curvature of the independent batch B̃ along them, scaled to ``N`` data
points like every debiased structure (``N/|B̃|`` times the sum over B̃; maths in
:mod:`laplace_debiased.curvature.ekfac`).  With B̃ = B this is plain EKFAC on B.

Outputs may be ``(n, tokens, C)``, every token an output with its own loss term (targets
``(n, tokens)``): the K-FAC basis comes from ``debiased_kron``'s shared pass, and the
eigenvalues of each token position are measured and added up
(:func:`~laplace_debiased.curvature.ekfac.measure_ekfac_eigenvalues`).

Cross-fitting (``fit(..., cross_fit=True)``) also builds the swapped approximation (basis from
B̃, curvature measured on B) and uses the equal-weight mixture of the two Gaussians as the
posterior (:mod:`laplace_debiased.structures.cross_fit`, shared with ``debiased_kron``).

Under an initialised ``torch.distributed`` group the K-FAC sums come from ``debiased_kron``'s
sharded pass, rank 0 broadcasts their eigenbasis, every rank measures the eigenvalue sums on its
rows of B̃ and the sums are all-reduced (:mod:`laplace_debiased.computers.ekfac`, through the
reducer of :func:`~laplace_debiased.parallel.reducer.current_reducer`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from curvlinops import FisherType
from laplace.curvature.curvature import EFInterface
from laplace.lllaplace import KronLLLaplace
from laplace.utils.matrix import Kron
from torch import Tensor
from torch.utils.data import DataLoader

from laplace_debiased.computers.ekfac import EKFACMeasurement, decompose_ekfac
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.structures.cross_fit import CrossFitDecomposed
from laplace_debiased.parallel.distributed import local_shards
from laplace_debiased.parallel.reducer import Reducer, current_reducer
from laplace_debiased.structures.kron import DebiasedKronLaplace
from laplace_debiased.curvature.layer_blocks import block_modules, block_spans, is_extra
from laplace_debiased.posterior.ekfac import EKFACDecomposed, SpannedEKFACDecomposed

__all__ = ["DebiasedEKFACLaplace", "DebiasedEKFACLLLaplace"]


class DebiasedEKFACLaplace(DebiasedKronLaplace):
    """Two-batch debiased EKFAC Laplace over all weights (``Laplace(...,
    subset_of_weights="all", hessian_structure="debiased_ekfac")``).

    Same interface as ``KronLaplace``; ``fit`` takes the two-batch arguments of
    :meth:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin.fit` plus
    ``cross_fit``.  After fitting, ``H_facs`` is B's K-FAC (``Kron``, scaled to ``n_data``), and
    ``H`` an :class:`EKFACDecomposed` (or, cross-fitted, a :class:`CrossFitDecomposed`).
    Layers: ``nn.Linear`` and ``nn.Conv2d`` (weight sharing handled exactly: per sample, the
    conv weight gradient is summed over positions before it is rotated and squared); embeddings,
    attention projections and GPT-2 ``Conv1D`` get debiased K-FAC blocks, normalisation layers
    their dense blocks (:mod:`laplace_debiased.curvature.layer_blocks`).
    Backends as ``debiased_kron``: the GGN backends give the exact GGN diagonal (``stochastic``
    ones an MC Fisher), EF backends the empirical Fisher.  ``damping`` is not supported (the
    eigenvalues are not Kronecker-factored), nor are online fits (``override=False``).
    """

    _key = ("all", "debiased_ekfac")
    _estimators = ("paper",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.damping:
            raise ValueError(
                "damping=True needs Kronecker-factored eigenvalues; EKFAC has one eigenvalue "
                "per basis direction. Use hessian_structure='debiased_kron' for damping."
            )

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
        """Fit as :meth:`DebiasedKronLaplace.fit` (``estimator``: ``"paper"`` only; ``null_space``
        is not used: the EKFAC eigenvalues are B̃'s exact diagonal in B's basis). ``override=False``
        raises: EKFAC eigenvalues are measured in one basis and cannot be re-measured in a
        combined basis without the earlier data."""
        if not override:
            raise ValueError(
                "debiased EKFAC does not support override=False: refit on all the data with "
                "override=True."
            )
        super().fit(
            train_loader, override=override, progress_bar=progress_bar, magnitude_loader=magnitude_loader,
            n_direction_batches=n_direction_batches, n_magnitude_batches=n_magnitude_batches, split=split,
            generator=generator, null_space=null_space, estimator=estimator, cross_fit=cross_fit,
        )

    def _fit_two_batch(
        self, direction_batches: list[Batch], magnitude_batches: list[Batch], N: int
    ) -> Tensor:
        self._check_supported(direction_batches)
        same = magnitude_batches is direction_batches
        swap = self._cross_fit and not same  # the swapped component needs B̃'s K-FAC too
        # embedding / normalisation blocks are measured from B̃'s sums of the shared pass
        both = not same and (swap or any(map(is_extra, self._kfac_modules())))
        groups = [direction_batches, magnitude_batches] if both else [direction_batches]
        loss, krons = self._kfacs(groups, N)
        direction, magnitude = krons[0], krons[-1]
        if not (same or both):
            loss = loss + self._summed_loss(magnitude_batches)
        H = self._ekfac(direction, magnitude, magnitude_batches, N)
        if swap:
            H = CrossFitDecomposed(H, self._ekfac(magnitude, direction, direction_batches, N))
        self.H_facs, self.H_facs_magnitude, self.H = direction, (magnitude if swap else None), H
        return loss

    def _fisher_type(self) -> str:
        if isinstance(self.backend, EFInterface):
            return FisherType.EMPIRICAL
        return FisherType.MC if getattr(self.backend, "stochastic", False) else FisherType.TYPE2

    def _ekfac(self, kron: Kron, measured: Kron, batches: list[Batch], N: int) -> EKFACDecomposed:
        """EKFAC with the eigenbasis of ``kron`` and the curvature of ``batches`` (whose K-FAC
        sums are ``measured``), scaled to N (:func:`~laplace_debiased.computers.ekfac.decompose_ekfac`)."""
        modules = self._kfac_modules()
        reducer = current_reducer()
        result = decompose_ekfac(
            kron.kfacs, measured.kfacs, [is_extra(m) for m in block_modules(modules)],
            self._ekfac_measurement(batches, N, reducer), reducer,
        )
        spans = block_spans(modules)
        if any(span > 1 for span in spans):
            return SpannedEKFACDecomposed(result.eigenvectors, result.eigenvalues, spans)
        return EKFACDecomposed(result.eigenvectors, result.eigenvalues)

    def _ekfac_measurement(self, batches: list[Batch], N: int, reducer: Reducer) -> EKFACMeasurement:
        """This rank's rows of ``batches`` and the backend's loss and curvature type, for
        measuring the Linear/Conv2d blocks; the sum is scaled to N."""
        n_rows = sum(batch_size(b, self.dict_key_x, self.dict_key_y) for b in batches)
        shards = local_shards(batches, self.dict_key_x, self.dict_key_y, rank=reducer.rank, world=reducer.world)
        data = [batch_inputs_targets(b, self.dict_key_x, self.dict_key_y) for b in shards]
        dict_inputs = bool(data) and not isinstance(data[0][0], Tensor)
        return EKFACMeasurement(
            model=self.backend.model,
            loss_func=self.backend.lossfunc,
            params=[p for m in self._kfac_modules() if not is_extra(m) for p in m.parameters(recurse=False) if p.requires_grad],
            batches=data,
            fisher_type=self._fisher_type(),
            batch_size_fn=(lambda x: x[self.dict_key_x].shape[0]) if dict_inputs else None,
            scale=N / n_rows * self.backend.factor,
            dtype=self._dtype,
        )

    def state_dict(self) -> dict[str, Any]:
        state = super(DebiasedKronLaplace, self).state_dict()  # KronLaplace: "H" = B's K-FAC
        comps = self.H.components if isinstance(self.H, CrossFitDecomposed) else (self.H,)
        state["H_ekfac"] = [[c.eigenvectors, c.eigenvalues] for c in comps]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super(DebiasedKronLaplace, self).load_state_dict(state_dict)
        spans = block_spans(self._kfac_modules())
        comps = [
            SpannedEKFACDecomposed(vecs, vals, spans) if any(s > 1 for s in spans) else EKFACDecomposed(vecs, vals)
            for vecs, vals in state_dict["H_ekfac"]
        ]
        self.H_facs_magnitude = None
        self.H = comps[0] if len(comps) == 1 else CrossFitDecomposed(*comps)


class DebiasedEKFACLLLaplace(DebiasedEKFACLaplace, KronLLLaplace):
    """Last-layer two-batch debiased EKFAC Laplace (``Laplace(..., "last_layer",
    hessian_structure="debiased_ekfac")``)."""

    _key = ("last_layer", "debiased_ekfac")

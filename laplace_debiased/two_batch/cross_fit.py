"""Cross-fitting: the equal-weight mixture of the two role-swapped debiased approximations.

A debiased fit takes the eigenbasis from B and the eigenvalues from B̃.  ``Laplace(...,
cross_fit=True)`` (``debiased_kron`` and ``debiased_ekfac``) also builds the swapped
approximation (basis from B̃, eigenvalues from B) and uses the **equal-weight mixture** of the
two Gaussians ``N(θ*, P₁⁻¹)`` and ``N(θ*, P₂⁻¹)`` as the posterior.  The mixture is symmetric in
B and B̃ and reduces to the plain structure when B̃ = B.  Averaging the two *precisions*
instead would be a single Gaussian, but ``P₁ + P₂`` is diagonal in no Kronecker basis
(``Q₁ ≠ Q₂``), so nothing about it is cheap; the mixture keeps every operation structured:

* GLM predictive: the mixture's exact function-space mean and covariance,
  ``f(x)`` and ``½ J (P₁⁻¹ + P₂⁻¹) Jᵀ`` (laplace-torch's ``functional_variance``, and
  [`GridPredictive`][laplace_debiased.posterior.grid.GridPredictive]);
* ``sample``: exact mixture samples (each sample from a component drawn with probability ½);
* ``log_prob``: the mixture's log density, ``log(½ N(θ; θ*, P₁⁻¹) + ½ N(θ; θ*, P₂⁻¹))``
  (logsumexp of the components' log densities);
* marginal likelihood: the average of the two components' Laplace log evidences
  (``log_det_posterior_precision`` and ``square_norm`` are component averages).

The components are laplace-torch ``KronDecomposed`` (debiased K-FAC) or
[`EKFACDecomposed`][laplace_debiased.ekfac.posterior.EKFACDecomposed] (debiased EKFAC) objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import math

import torch
from torch import Tensor

from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.posterior.kron_structure import KronStructure

__all__ = ["CrossFitDecomposed", "CrossFitStructure", "mixture_log_prob", "mixture_samples"]


def _block_shapes(component: Any) -> list[tuple[int, ...]]:
    """Per block, the sizes of the eigenbasis factors (``[d_out, d_in]`` or ``[d]``)."""
    return [tuple(len(Q) for Q in Qs) for Qs in component.eigenvectors]


class CrossFitDecomposed:
    """Equal-weight mixture of two Gaussians with precisions ``P₁``, ``P₂`` (two
    ``KronDecomposed`` or two ``EKFACDecomposed`` of the same blocks; module docstring).

    ``+`` / ``*`` act on both components.  ``bmm(W, e)``, ``diag(e)``, ``to_matrix(e)`` and
    ``logdet`` are component averages: for ``e = -1`` these are the mixture's covariance
    ``½(P₁⁻¹ + P₂⁻¹)`` (products, diagonal: marginal variances); for ``e = 1`` the averaged
    precision used in the averaged log evidence.  Other exponents have no mixture meaning and
    raise (draw samples with the Laplace object's ``sample``).
    """

    def __init__(self, first: Any, second: Any) -> None:
        if type(first) is not type(second):
            raise TypeError(
                f"mixture components of different types {type(first).__name__} and "
                f"{type(second).__name__}"
            )
        shapes = [_block_shapes(c) for c in (first, second)]
        if shapes[0] != shapes[1]:
            raise ValueError(f"mixture components have different blocks: {shapes}")
        self.components = (first, second)

    def __len__(self) -> int:
        return len(self.components[0])

    @property
    def deltas(self) -> Tensor:
        return self.components[0].deltas

    def detach(self) -> CrossFitDecomposed:
        for c in self.components:
            c.detach()
        return self

    def __add__(self, deltas: Tensor) -> CrossFitDecomposed:
        return CrossFitDecomposed(*(c + deltas for c in self.components))

    def __mul__(self, scalar: Tensor | float) -> CrossFitDecomposed:
        return CrossFitDecomposed(*(c * scalar for c in self.components))

    __radd__ = __add__
    __rmul__ = __mul__

    @staticmethod
    def _check_exponent(exponent: float) -> None:
        if exponent not in (1, -1):
            raise ValueError(
                f"exponent {exponent}: a Gaussian mixture has no matrix power other than the "
                "averaged precision (1) and its covariance (-1); use sample() for draws."
            )

    def logdet(self) -> Tensor:
        """Average of the components' log determinants (averaged log evidence)."""
        return 0.5 * (self.components[0].logdet() + self.components[1].logdet())

    def bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        self._check_exponent(exponent)
        return 0.5 * (self.components[0].bmm(W, exponent) + self.components[1].bmm(W, exponent))

    def inv_square_form(self, W: Tensor) -> Tensor:
        """``½ W (P₁⁻¹ + P₂⁻¹) Wᵀ``: the mixture's function-space covariance."""
        return 0.5 * (self.components[0].inv_square_form(W) + self.components[1].inv_square_form(W))

    def diag(self, exponent: float = 1) -> Tensor:
        self._check_exponent(exponent)
        return 0.5 * (self.components[0].diag(exponent) + self.components[1].diag(exponent))

    def to_matrix(self, exponent: float = 1) -> Tensor:
        self._check_exponent(exponent)
        return 0.5 * (self.components[0].to_matrix(exponent) + self.components[1].to_matrix(exponent))

    def grid_structure(self, h_factor: float | Tensor, numels: Sequence[int]) -> CrossFitStructure:
        return CrossFitStructure(self, h_factor, numels)


def _component_structure(component: Any, h_factor: float | Tensor, numels: Sequence[int]) -> Any:
    """The grid structure of one component: its own (EKFAC) or
    [`KronStructure`][laplace_debiased.posterior.kron_structure.KronStructure]."""
    if callable(getattr(component, "grid_structure", None)):
        return component.grid_structure(h_factor, numels)
    return KronStructure(component, h_factor, numels)


class CrossFitStructure:
    """Grid structure of a [`CrossFitDecomposed`][laplace_debiased.two_batch.cross_fit.CrossFitDecomposed]
    mixture: ``Σ(δ)`` is the average of the two components' function-space covariances (float64)."""

    def __init__(self, H: CrossFitDecomposed, h_factor: float | Tensor, numels: Sequence[int]) -> None:
        self.parts = [_component_structure(c, h_factor, numels) for c in H.components]

    def rotate(self, jacs: Sequence[LayerJacobian]) -> list:
        return [part.rotate(jacs) for part in self.parts]

    def covariances(self, rotated, prior_precisions) -> Tensor:
        return 0.5 * sum(p.covariances(r, prior_precisions) for p, r in zip(self.parts, rotated))

    def covariance(self, rotated, delta) -> Tensor:
        return self.covariances(rotated, [delta])[0]

    def variances(self, rotated, prior_precisions, project: bool = False) -> Tensor:
        """``diag Σ(δ)`` (or ``diag ΠΣ(δ)Π``), ``(G, n, C)``: the average of the components'."""
        return 0.5 * sum(p.variances(r, prior_precisions, project) for p, r in zip(self.parts, rotated))


def mixture_samples(
    P: CrossFitDecomposed, mean: Tensor, n_samples: int, generator: torch.Generator | None = None, *,
    device: torch.device, dtype: torch.dtype,
) -> Tensor:
    """Exact samples of the equal-weight mixture of ``N(mean, P₁⁻¹)`` and ``N(mean, P₂⁻¹)``.

    Args:
        P: The posterior precision, a mixture of two components ``P₁``, ``P₂``.
        mean: The posterior mean ``(P,)``.
        n_samples: Samples ``S``.
        generator: The random generator (``None``: torch's global one).
        device: Device of the standard normal draws (the model's).
        dtype: dtype of the standard normal draws (the model's).

    Returns:
        Samples ``(S, P)``, each from a component drawn with probability ½.
    """
    n_params = len(mean)
    z = torch.randn(n_samples, n_params, device=device, dtype=dtype, generator=generator)
    pick = torch.rand(n_samples, generator=generator, device=z.device) < 0.5
    steps = torch.where(
        pick[:, None],
        P.components[0].bmm(z, exponent=-0.5).reshape(n_samples, -1),
        P.components[1].bmm(z, exponent=-0.5).reshape(n_samples, -1),
    )
    return mean.reshape(1, n_params) + steps


def mixture_log_prob(P: CrossFitDecomposed, delta: Tensor, normalized: bool = True) -> Tensor:
    """Log density of the mixture of ``N(θ*, P₁⁻¹)`` and ``N(θ*, P₂⁻¹)``, weights ½, at ``θ* + delta``.

    Computed stably with logsumexp::

        log p(θ) = -P/2 log 2π + log ½ + logsumexp_k (½ log det P_k - ½ Δᵀ P_k Δ).

    Args:
        P: The posterior precision, a mixture of two components ``P₁``, ``P₂``.
        delta: ``θ - θ*``, ``(P,)``.
        normalized: ``False`` drops the terms that do not depend on ``θ``, ``-P/2 log 2π`` and the
            mean of the ``½ log det P_k``, so that equal components give laplace-torch's
            ``-½ Δᵀ P Δ``.

    Returns:
        The log density, a scalar.
    """
    half_logdets = torch.stack([0.5 * c.logdet() for c in P.components])
    quads = torch.stack([delta @ c.bmm(delta, exponent=1) for c in P.components])
    log_p = torch.logsumexp(half_logdets - 0.5 * quads, 0) + math.log(0.5)
    if not normalized:
        return log_p - half_logdets.mean()
    return log_p - 0.5 * len(delta) * math.log(2 * math.pi)

"""Link approximations on the Gaussian logits ``N(f, Σ)`` of the linearised network.

The shapes are ``f`` ``(n, C)`` and ``Σ`` ``(n, C, C)``. The links:

* ``"probit"`` -- laplace-torch's diagonal probit ``softmax(f / sqrt(1 + π/8 diag Σ))``.  It is
  fooled by the softmax-invariant all-ones direction: a large ``c`` in ``Σ + c·11ᵀ`` shrinks all
  logits although the softmax of every sample is unchanged.
* ``"probit_projected"`` -- the same probit on the distribution of the logits projected onto the
  logit-difference subspace (``Π = I - 11ᵀ/C``): ``softmax(Πf / sqrt(1 + π/8 diag(ΠΣΠ)))``.
  Exactly invariant to ``f + a·1`` and ``Σ + c·11ᵀ``.
* ``"mc"`` -- Monte-Carlo: ``mean_s softmax(f + Σ^{1/2} ε_s)``; for a GLM this equals sampling
  ``θ_s ~ N(θ*, P⁻¹)`` and evaluating the linearized network (Eq. 18 of Tatzel et al.).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from laplace_debiased.curvature.linalg import symmetric_eigh64

#: links of the sweeps and reports
LINKS = ("probit_projected", "probit", "mc")
#: every link [`apply_link`][laplace_debiased.posterior.links.apply_link] and
#: [`GridPredictive.grid`][laplace_debiased.posterior.grid.GridPredictive.grid] evaluate (adds laplace-torch's
#: bridge)
ALL_LINKS = (*LINKS, "bridge", "bridge_norm")


# --------------------------------------------------------------------------------------------
# Link approximations: (f, Σ) -> class probabilities
# --------------------------------------------------------------------------------------------
def probit_from_variances(f: Tensor, var: Tensor) -> Tensor:
    """``softmax(f_c / sqrt(1 + π/8 var_c))``; f, var ``(n, C)``."""
    return torch.softmax(f / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)


def probit(f: Tensor, cov: Tensor) -> Tensor:
    """laplace-torch's probit: ``softmax(f_c / sqrt(1 + π/8 Σ_cc))``; f ``(n, C)``, cov ``(n, C, C)``."""
    return probit_from_variances(f, cov.diagonal(dim1=-2, dim2=-1))


def project_logits(f: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and covariance of ``Πf_lin`` with ``Π = I - 11ᵀ/C`` (removes the softmax-invariant
    all-ones direction).  Returns ``(Πf, ΠΣΠ)`` with the shapes of the inputs.

    Double-centring ``Σ`` cancels when ``Σ`` is dominated by the all-ones direction; the
    structures' ``variances(..., project=True)`` project the Jacobian instead."""
    return project_classes(f, -1), project_classes(project_classes(cov, -1), -2)


def probit_projected(f: Tensor, cov: Tensor) -> Tensor:
    """Probit on the logit-difference subspace: [`probit`][laplace_debiased.posterior.links.probit] of
    [`project_logits`][laplace_debiased.posterior.links.project_logits]."""
    return probit(*project_logits(f, cov))


def project_classes(A: Tensor, dim: int = 1) -> Tensor:
    """``Π`` applied along the class axis ``dim`` of ``A`` (``Π = I - 11ᵀ/C``: centre over the
    classes); the default ``dim=1`` is that of Jacobians ``(n, C, ...)``."""
    return A - A.mean(dim, keepdim=True)


def mc_softmax(
    f: Tensor, cov: Tensor, n_samples: int = 100, generator: torch.Generator | None = None
) -> Tensor:
    """Monte-Carlo predictive ``1/S Σ_s softmax(f + L ε_s)``, ``L = V Λ^{1/2} Vᵀ`` the symmetric
    square root of ``Σ = V Λ Vᵀ`` (float64 eigendecomposition, so rank-deficient ``Σ`` is fine). Unlike
    ``V Λ^{1/2}``, it does not depend on the signs or, within a repeated eigenvalue, the basis that
    ``eigh`` returns, so a round-off change of ``Σ`` changes the samples only by as much.  f ``(n, C)``,
    cov ``(n, C, C)`` -> ``(n, C)`` in ``f.dtype``."""
    evals, evecs = symmetric_eigh64(cov)
    root = (evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)
    eps = torch.randn(n_samples, *f.shape, dtype=f.dtype, device=f.device, generator=generator)
    logits = f.double() + torch.einsum("nij,snj->sni", root, eps.double())
    return torch.softmax(logits, dim=-1).mean(0).to(f.dtype)


def laplace_bridge(f: Tensor, cov: Tensor, normalise: bool = False) -> Tensor:
    """laplace-torch's Laplace bridge (``link_approx="bridge"``, ``"bridge_norm"`` with
    ``normalise=True``): Dirichlet mean after the zero-mean correction of ``(f, Σ)``.
    f ``(n, C)``, cov ``(n, C, C)`` -> ``(n, C)``; same formula as laplace-torch 0.3."""
    total = cov.sum(dim=(1, 2))[:, None]
    row = cov.sum(-1)
    f = f - row * f.sum(-1, keepdim=True) / total
    var = (cov - row.unsqueeze(-1) * cov.sum(-2).unsqueeze(-2) / total[..., None]).diagonal(dim1=-2, dim2=-1)
    K = f.shape[-1]
    if normalise:
        m = var.mean(dim=1) / math.sqrt(K / 2)
        f = f / m.sqrt().unsqueeze(-1)
        var = var / m.unsqueeze(-1)
    sum_exp = torch.exp(-f).sum(dim=1, keepdim=True)
    alpha = (1 - 2 / K + f.exp() / K**2 * sum_exp) / var
    return torch.nan_to_num(alpha / alpha.sum(dim=1, keepdim=True), nan=1.0)


def normal_samples(
    mean: Tensor, var: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """Samples ``(S, n, C)`` of ``N(mean, var)``, mean ``(n, C)``, var ``(n, C, C)`` or diagonal
    ``(n, C)``: laplace-torch's ``normal_samples`` (same ``ε`` draw, ``(C, S)`` in the mean's
    dtype, shared over the batch) with the symmetric square root of a float64
    eigendecomposition (round-off negative eigenvalues clamped) instead of a Cholesky factor,
    which fails for the ill-conditioned float32 ``Σ`` of a small prior precision."""
    n, C = mean.shape
    eps = torch.randn((C, n_samples), device=mean.device, dtype=mean.dtype, generator=generator).double()
    if var.shape == mean.shape:
        scaled = var.double().clamp_min(0.0).sqrt().unsqueeze(-1) * eps
    elif var.shape == (n, C, C):
        evals, evecs = symmetric_eigh64(var)
        scaled = (evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)) @ (evecs.transpose(-1, -2) @ eps)
    else:
        raise ValueError(f"var must be (n, C) or (n, C, C) for mean {tuple(mean.shape)}, got {tuple(var.shape)}")
    return (mean.double().unsqueeze(-1) + scaled).permute(2, 0, 1).to(mean.dtype)


def apply_link(
    link: str,
    f: Tensor,
    cov: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Dispatch to [`probit_projected`][laplace_debiased.posterior.links.probit_projected],
    [`probit`][laplace_debiased.posterior.links.probit],
    [`mc_softmax`][laplace_debiased.posterior.links.mc_softmax] or
    [`laplace_bridge`][laplace_debiased.posterior.links.laplace_bridge] by name."""
    if link == "probit":
        return probit(f, cov)
    if link == "probit_projected":
        return probit_projected(f, cov)
    if link == "mc":
        return mc_softmax(f, cov, n_samples, generator)
    if link in ("bridge", "bridge_norm"):
        return laplace_bridge(f, cov, normalise=link == "bridge_norm")
    raise ValueError(f"unknown link approximation {link!r}; choose from {ALL_LINKS}")

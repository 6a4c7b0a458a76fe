"""The sampled linearised predictive (Eq. 18 of Tatzel et al.): parameter samples of any
laplace-torch posterior and forward-mode Jacobian-vector products, for posteriors without a cheap
eigenbasis.

The posterior maths (links, Jacobians, posterior structures, grid predictive, grid search) live
in [`laplace_debiased.posterior`][laplace_debiased.posterior].
"""

from __future__ import annotations

import torch
from torch import Tensor

from laplace_debiased.curvature.inputs import functional_model
from laplace_debiased.posterior.from_laplace import laplace_params


@torch.no_grad()
def linearized_logit_samples(
    la,
    x: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> Tensor:
    """Samples ``f(x) + J(x)(θ_s - θ*)`` of the linearized network, ``θ_s = la.sample(S)``.

    ``J(x)(θ_s - θ*)`` is one forward-mode JVP per sample (``torch.func.jvp``), so no Jacobian is
    formed; works for any laplace-torch posterior with a ``sample`` method.  Returns ``(S, N, C)``.
    """
    fn, theta = functional_model(la.model, laplace_params(la))
    steps = la.sample(n_samples, generator=generator) - la.mean
    sizes = [p.numel() for p in theta.values()]
    tangents = [
        {k: t.view_as(p).to(p.dtype) for (k, p), t in zip(theta.items(), s.split(sizes))} for s in steps
    ]
    chunks = []
    for xc in x.split(chunk_size):
        def at_xc(th: dict[str, Tensor], xc: Tensor = xc) -> Tensor:
            return fn(th, xc)

        chunks.append(torch.stack([sum(torch.func.jvp(at_xc, (theta,), (t,))) for t in tangents]))
    return torch.cat(chunks, dim=1)


def sampled_linearized_predictive(
    la,
    x: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> Tensor:
    """Eq. 18 of Tatzel et al.: ``1/S Σ_s softmax(f(x) + J(x)(θ_s - θ*))``, shape ``(N, C)``
    (see [`linearized_logit_samples`][laplace_debiased.evaluation.predictive.linearized_logit_samples])."""
    return torch.softmax(linearized_logit_samples(la, x, n_samples, generator, chunk_size), -1).mean(0)

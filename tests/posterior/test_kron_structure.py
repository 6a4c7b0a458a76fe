"""K-FAC structures (:mod:`laplace_debiased.posterior.kron_structure`): covariances over a prior grid against
the dense Kronecker blocks, and variances (projected or not) without forming Σ."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.posterior.jacobians import LayerJacobian
from laplace_debiased.posterior.kron_structure import KronStructure
from laplace_debiased.posterior.links import project_logits


def _random_kron_structure(C: int = 4, out: int = 4, inp: int = 5, damping: bool = False, shared: bool = False):
    from laplace.utils.matrix import KronDecomposed

    g = torch.Generator().manual_seed(3)
    def orth(n):
        return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    Qs = [[orth(out), orth(inp)], [orth(out)]]
    ls = [[torch.rand(out, generator=g, dtype=torch.float64) * 10, torch.rand(inp, generator=g, dtype=torch.float64)],
          [torch.rand(out, generator=g, dtype=torch.float64) * 3]]
    H = KronDecomposed(Qs, ls, damping=damping)
    struct = KronStructure(H, 0.7, [out * inp, out])
    n = 6
    m = 1 if shared else n  # shared: one output gradient for every input (the output layer)
    jacs = [
        LayerJacobian(g=torch.randn(m, C, out, generator=g, dtype=torch.float64),
                      a=torch.randn(n, inp, generator=g, dtype=torch.float64)),
        LayerJacobian(dense=torch.randn(m, C, out, generator=g, dtype=torch.float64)),
    ]
    return struct, jacs


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("damping", [False, True])
def test_kron_variances_equal_diagonal_of_explicit_projected_covariance(damping, shared):
    struct, jacs = _random_kron_structure(damping=damping, shared=shared)
    rotated = struct.rotate(jacs)
    grid = [1e-6, 0.3, torch.tensor([2.0, 0.1], dtype=torch.float64)]
    cov = struct.covariances(rotated, grid)
    # Σ against J P⁻¹ Jᵀ written out with the dense Kronecker blocks
    J = torch.cat([j.full().expand(6, -1, -1) for j in jacs], -1)
    for gi, delta in enumerate(grid):
        d = torch.as_tensor(delta, dtype=torch.float64).expand(2)
        inv = []
        for k in range(2):
            Q = torch.kron(*struct.Qs[k]) if len(struct.Qs[k]) == 2 else struct.Qs[k][0]
            inv.append((Q * struct._inverse_eigenvalues(k, d[k]).reshape(-1)) @ Q.T)
        ref = torch.einsum("ncp,pq,nkq->nck", J, torch.block_diag(*inv), J)
        torch.testing.assert_close(cov[gi], ref, rtol=1e-10, atol=1e-12)
    f = torch.zeros(cov.shape[:-1][1:], dtype=torch.float64)
    for project in (False, True):
        ref = torch.stack([(project_logits(f, c)[1] if project else c).diagonal(dim1=-2, dim2=-1) for c in cov])
        ours = struct.variances(rotated, grid, project=project)
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-13)

"""A Conv2d Jacobian rotated into the K-FAC eigenbasis factor by factor (before the sum over
positions) equals the rotated dense Jacobian, and the grid predictive stays laplace-torch's."""

from __future__ import annotations

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.posterior.from_laplace import laplace_params, posterior_structure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import LayerJacobian, logit_jacobians
from laplace_debiased.posterior.kron_structure import positions_cheaper, positions_sum, rotated_factors


def wide_kernel_cnn() -> nn.Module:
    """Conv2d(8, 16, 3) on 8x4x4 inputs: 4 positions, 72 unfolded inputs (positions cheaper)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)).double()


def test_rotated_factors_summed_over_positions_are_the_rotated_dense_jacobian():
    g = torch.Generator().manual_seed(0)
    G = torch.randn(4, 3, 5, 7, generator=g, dtype=torch.float64)
    u = torch.randn(4, 6, 7, generator=g, dtype=torch.float64)
    Q_G = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))[0]
    Q_A = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    J = torch.einsum("ncot,nkt->ncok", G, u)
    torch.testing.assert_close(positions_sum(*rotated_factors(G, u, Q_G, Q_A)), (Q_G.T @ J @ Q_A).flatten(2), atol=1e-13, rtol=0)


def test_kron_grid_with_positions_route_equals_dense_route_and_laplace():
    model = wide_kernel_cnn()
    X = torch.randn(24, 8, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(2))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=12))
    structure = posterior_structure(la)
    _, jacs = logit_jacobians(model, laplace_params(la), X[:5])
    assert jacs[0].positions is not None and positions_cheaper(jacs[0].positions)
    grid = [1e-3, 0.1, 10.0]
    via_positions = structure.covariances(structure.rotate(jacs), grid)
    dense_only = [LayerJacobian(dense=j.full()) if j.positions is not None else j for j in jacs]
    via_dense = structure.covariances(structure.rotate(dense_only), grid)
    torch.testing.assert_close(via_positions, via_dense, atol=1e-12 * float(via_dense.abs().max()), rtol=0)
    la.prior_precision = 0.1
    ours = GridPredictive(la)(X[:5], link="probit", prior_precision=0.1)
    torch.testing.assert_close(ours, la(X[:5], pred_type="glm", link_approx="probit"), atol=1e-10, rtol=0)

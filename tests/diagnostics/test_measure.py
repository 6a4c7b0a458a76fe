"""Diagnostics measurement (:mod:`laplace_debiased.diagnostics.measure`) against the closed forms
of linear least squares: slopes and curvatures by hand, Eq. 5 (the partition average is the full
data), and CG directions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_debiased.diagnostics.directional import cg_step_sizes, directional_curvatures, directional_slopes, partition_average
from laplace_debiased.diagnostics.measure import (
    cg_directions,
    equal_partition,
    measure_study,
    quadratic_factory,
)
from laplace_debiased.diagnostics.directions import top_eigenpairs
from laplace_debiased.optim.cg import cg, debiased_cg

pytestmark = pytest.mark.usefixtures("float64")

BETA = 0.1


def least_squares(N: int = 60, P: int = 5, seed: int = 0):
    """Linear model f(x) = θᵀx with mean squared error: H = GGN = 2XᵀX/N, g = 2Xᵀ(Xθ-y)/N."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, P, generator=g) * torch.linspace(0.2, 2.0, P)
    y = torch.randn(N, 1, generator=g)
    model = nn.Linear(P, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, P, generator=g))
    return model, X, y


def dense_quadratic(model, X, y, beta=BETA):
    theta = model.weight.detach().reshape(-1)
    N = X.shape[0]
    H = 2 * X.T @ X / N + beta * torch.eye(X.shape[1])
    g = 2 * X.T @ (X @ theta - y.reshape(-1)) / N + beta * theta
    value = ((X @ theta - y.reshape(-1)) ** 2).mean() + 0.5 * beta * theta.dot(theta)
    return value, g, H


@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
def test_least_squares_slopes_curvatures_by_hand(curvature):
    model, X, y = least_squares()
    partition = equal_partition(X, y, 15, torch.Generator().manual_seed(1))
    factory = quadratic_factory(model, nn.MSELoss(), curvature, BETA)
    full = factory(partition)
    source = factory([partition[0]])
    D = top_eigenpairs(source.curvature, source.gradient.shape[0], 3, dtype=source.gradient.dtype).vectors
    study = measure_study("eigen", 0, D, partition, factory, full)

    Xs = torch.cat([b[0] for b in partition])
    ys = torch.cat([b[1] for b in partition])
    value, g, H = dense_quadratic(model, Xs, ys)
    torch.testing.assert_close(study.full.value, value)
    torch.testing.assert_close(study.full.slopes, D.T @ g)
    torch.testing.assert_close(study.full.gram, D.T @ H @ D)
    for (Xb, yb), r in zip(partition, study.batches):
        vb, gb, Hb = dense_quadratic(model, Xb, yb)
        torch.testing.assert_close(r.slopes, directional_slopes(D, gb))
        torch.testing.assert_close(r.curvatures, directional_curvatures(D, Hb @ D))
    # the directions are the top eigenvectors of the source batch's H_B + βI
    _, _, HB = dense_quadratic(model, *partition[0])
    top = torch.linalg.eigvalsh(HB).flip(0)[:3]
    torch.testing.assert_close(study.batches[0].curvatures, top)
    assert study.n_products == {15: 4 * 3, 60: 3}


def test_eq5_partition_average_equals_full():
    model, X, y = least_squares(N=48, P=6)
    partition = equal_partition(X, y, 8, torch.Generator().manual_seed(3))
    factory = quadratic_factory(model, nn.MSELoss(), "ggn", BETA)
    D = torch.linalg.qr(torch.randn(6, 4))[0]
    study = measure_study("eigen", 2, D, partition, factory, factory(partition))
    assert study.eq5_residual < 1e-13
    # not trivially satisfied: single batches differ from the full data by far more, and a
    # "full" data set that is not the union of the partition fails the check
    assert (study.curvatures() - study.full.curvatures).abs().max() > 1e-2
    assert measure_study("eigen", 2, D, partition, factory, factory(partition[:-1])).eq5_residual > 1e-3
    # weighted average for unequal batch sizes
    sizes = torch.tensor([1, 3])
    torch.testing.assert_close(partition_average(torch.tensor([[2.0], [6.0]]), sizes), torch.tensor([5.0]))


def test_cg_directions_conjugate_iterates_match_dense_solve_and_step_sizes():
    model, X, y = least_squares(N=40, P=6)
    partition = equal_partition(X, y, 10, torch.Generator().manual_seed(0))
    factory = quadratic_factory(model, nn.MSELoss(), "ggn", BETA)
    source = factory([partition[0]])
    D = cg_directions(source, steps=6)
    _, gB, HB = dense_quadratic(model, *partition[0])
    gram = D.T @ HB @ D
    torch.testing.assert_close(gram - torch.diag(torch.diagonal(gram)), torch.zeros(6, 6), atol=1e-10, rtol=0)
    # after P steps CG has solved the Newton system exactly
    result = cg(lambda v: HB @ v, -gB, max_iter=6)
    torch.testing.assert_close(result.x, torch.linalg.solve(HB, -gB))
    torch.testing.assert_close(result.directions.T, D)
    # same batch: the Gram recursion reproduces CG's own step sizes ...
    _, _, tau = cg_step_sizes(D.T @ gB, gram)
    torch.testing.assert_close(tau, result.step_sizes)
    # ... another batch: it reproduces debiased CG with B̃ = that batch
    _, gO, HO = dense_quadratic(model, *partition[1])
    ref = debiased_cg(lambda v: HB @ v, -gB, lambda v: HO @ v, -gO, max_iter=6)
    slopes, curv, tau_o = cg_step_sizes(D.T @ gO, D.T @ HO @ D)
    torch.testing.assert_close(tau_o, ref.step_sizes)
    torch.testing.assert_close(slopes, ref.slopes)
    torch.testing.assert_close(curv, ref.curvatures)
